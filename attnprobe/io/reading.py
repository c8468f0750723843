"""Reading a results folder: every file checked before it is used (its columns, numbers, shapes, that it was
written by the run that wrote run.json), and refused in one line naming the file and the command that remakes it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError, plain
from attnprobe.io.names import (
    CHECKPOINT_FILE,
    COMPARE_HEADS_FILE,
    COMPARE_LAYERS_FILE,
    COMPARE_RUN_FILE,
    COMPARE_TYPES_FILE,
    EXAMPLE_FILE,
    EXAMPLES_FILE,
    HEAD_EXAMPLES_FILE,
    RENAMED_TYPES,
    RESAMPLES_FILE,
    RUN_FILE,
    SENTENCES_FILE,
    SIMILARITY_FILE,
)
from attnprobe.io.records import check_checkpoint_slots, check_written_by_run, checkpoint_files
from attnprobe.mapcheck import map_problem

TEXT_COLUMNS = ("head_type", "category")  # every other column a reader asks for must hold numbers


def read_json(out: str | Path, name: str, made_by: str) -> Any:
    """The JSON file `name` of `out`; say which command makes it when it is missing or unreadable."""
    path = Path(out) / name
    if not path.is_file():
        raise AttnprobeError(f"no {name} in {out}: run `{made_by} --out {out}` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `{made_by}` again") from err
    except RecursionError:
        raise AttnprobeError(f"{path} is unreadable (nested too deeply); run `{made_by}` again") from None
    if not isinstance(data, dict):
        raise AttnprobeError(f"{path} is not a JSON object ({type(data).__name__}): it was not made by `{made_by}`; "
                             "run it again")
    return data


def read_run(out: str | Path) -> dict[str, Any]:
    """run.json as `analyze` wrote it."""
    path = Path(out) / RUN_FILE
    run = read_json(out, RUN_FILE, "attnprobe analyze")
    needed = {"model": ("spec", "layers", "heads", "kv_heads", "head_dim"), "attention": ("sink_tokens", "window")}
    for section, keys in needed.items():
        if not isinstance(run.get(section), dict) or any(k not in run[section] for k in keys):
            raise AttnprobeError(f"{path} lacks {section} settings (made by an older attnprobe): run `attnprobe "
                                 "analyze` again")
    for section in ("summary", "bootstrap", "corpus"):
        if section in run and not isinstance(run[section], dict):
            raise AttnprobeError(f"{path} holds a {section} that is not an object: run `attnprobe analyze` again")
    numbers = [run["model"][k] for k in ("layers", "heads", "kv_heads", "head_dim")]
    numbers += [run["attention"][k] for k in ("sink_tokens", "window")] + [run.get("longest_sequence", 1)]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise AttnprobeError(f"{path} holds a model or attention setting that is not a whole number: run "
                             "`attnprobe analyze` again")
    if "longest_sequence" not in run:
        raise AttnprobeError(f"{path} lacks longest_sequence (made by an older attnprobe): run `attnprobe analyze` "
                             "again")
    return run


def read_table(out: str | Path, name: str, columns: Iterable[str], made_by: str) -> pd.DataFrame:
    """Read a results CSV, requiring `columns`; say which command makes it if it is missing."""
    path = Path(out) / name
    if not path.is_file():
        raise AttnprobeError(f"no {name} in {out}: run `{made_by} --out {out}` first")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise AttnprobeError(f"{path} is not a readable CSV ({err}); run `{made_by}` again") from err
    columns = list(columns)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise AttnprobeError(
            f"{path} lacks column(s) {', '.join(missing)}: it was not made by `{made_by}`; run it again"
        )
    if frame.empty:
        raise AttnprobeError(f"{path} has no rows: run `{made_by}` again")
    if "head_type" in frame.columns:  # an older folder's labels under today's names
        frame["head_type"] = frame["head_type"].replace(RENAMED_TYPES)
    not_numbers = [c for c in columns if c not in TEXT_COLUMNS and not pd.api.types.is_numeric_dtype(frame[c])]
    if not_numbers:
        raise AttnprobeError(
            f"{path} has values that are not numbers in {', '.join(not_numbers)}: run `{made_by}` again"
        )
    for column in ("layer", "head", "bin"):
        if column in columns:
            values = frame[column].to_numpy(dtype=float)
            bad = ~(np.isfinite(values) & (values >= 0) & (values == np.round(values)))
            if bad.any():
                raise AttnprobeError(f"{path} has a {column} that is not a whole number of 0 or more "
                                     f"({plain(frame[column].iloc[int(np.argmax(bad))])}): run `{made_by}` again")
            frame[column] = frame[column].astype(np.int64)
    key = [c for c in ("category", "layer", "head", "bin") if c in columns]
    if key and frame.duplicated(key).any():
        raise AttnprobeError(f"{path} repeats a ({', '.join(key)}) row: run `{made_by}` again")
    check_written_by_run(out, name)  # last: a damaged file is named as damaged
    return frame


def read_columns(out: str | Path, name: str) -> list[str]:
    """The header of a results CSV (empty when it cannot be read; read_table then says why)."""
    try:
        return list(pd.read_csv(Path(out) / name, nrows=0).columns)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
        return []


def read_sentences(out: str | Path) -> Any:
    """sentences.parquet as a lazy pyarrow ParquetFile (`.iter_batches()`, `.read().to_pandas()`)."""
    import pyarrow.parquet as pq

    path = Path(out) / SENTENCES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {SENTENCES_FILE} in {out}: run `attnprobe analyze --per-sentence --out {out}`")
    check_written_by_run(out, SENTENCES_FILE)
    return pq.ParquetFile(path)


def read_example(out: str | Path) -> dict[str, Any] | None:
    """The example attention maps saved by `analyze`, or None when there are none."""
    path = Path(out) / EXAMPLE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens = [str(t) for t in data["tokens"]]
            total = int(data["total_tokens"]) if "total_tokens" in data else len(tokens)
            _check_maps(data["maps"], "maps")
            found = {"maps": data["maps"], "tokens": tokens, "sentence": str(data["sentence"]), "total_tokens": total}
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, EXAMPLE_FILE)
    return found


def _check_maps(maps: np.ndarray, name: str) -> None:
    """ValueError when the stored `maps` are not attention maps (mapcheck.map_problem): never drawn as if they were."""
    problem = map_problem(maps)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


def read_examples(out: str | Path) -> list[dict[str, Any]]:
    """The example sentences' maps: examples.npz when `analyze` wrote one, else example_attention.npz's one
    example, else []. Each is a dict as `examples_writer` takes (maps as float32)."""
    path = Path(out) / EXAMPLES_FILE
    if not path.is_file():
        one = read_example(out)
        if one is None:
            return []
        return [{**one, "maps": np.asarray(one["maps"], dtype=np.float32), "category": "", "index": -1, "line": -1}]
    try:
        with np.load(path, allow_pickle=False) as data:
            examples = []
            for i in range(int(data["count"])):
                tokens = [str(t) for t in data[f"tokens_{i}"]]
                maps = np.asarray(data[f"maps_{i}"], dtype=np.float32)
                if maps.ndim != 4 or maps.shape[2:] != (len(tokens), len(tokens)):
                    raise ValueError(f"maps_{i} {maps.shape} does not fit its {len(tokens)} tokens")
                _check_maps(maps, f"maps_{i}")
                optional = {key: data[f"{key}_{i}"] for key in ("total_tokens", "category", "index", "line")
                            if f"{key}_{i}" in data}
                examples.append({
                    "maps": maps, "tokens": tokens, "sentence": str(data[f"sentence_{i}"]),
                    "total_tokens": int(optional.get("total_tokens", len(tokens))),
                    "category": str(optional.get("category", "")), "index": int(optional.get("index", -1)),
                    "line": int(optional.get("line", -1)),
                })
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, EXAMPLES_FILE)
    return examples


def read_head_examples(out: str | Path) -> dict[str, np.ndarray] | None:
    """head_examples.npz as `analyze` wrote it (io.writers.HEAD_EXAMPLE_ARRAYS), checked; None when there is none."""
    from attnprobe.io.writers import HEAD_EXAMPLE_ARRAYS, head_examples_problem

    path = Path(out) / HEAD_EXAMPLES_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in HEAD_EXAMPLE_ARRAYS if name in data.files}
    except (OSError, KeyError, ValueError, EOFError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze --out {out}` again") from err
    problem = head_examples_problem(arrays)
    if problem is not None:
        raise AttnprobeError(f"{path} is not a head_examples file ({problem}); run `attnprobe analyze --out {out}` "
                             "again")
    check_written_by_run(out, HEAD_EXAMPLES_FILE)
    return arrays


def read_resamples(out: str | Path) -> dict[str, np.ndarray]:
    """The bootstrap's resampled head means `analyze` saved: per score [resample, layer, head]."""
    path = Path(out) / RESAMPLES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {RESAMPLES_FILE} in {out}: run `attnprobe analyze --out {out}` again")
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {key: data[key] for key in data.files}
    except (OSError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, RESAMPLES_FILE)
    return found


def read_compare(out: str | Path) -> tuple[dict[str, Any], pd.DataFrame | None, pd.DataFrame, pd.DataFrame | None]:
    """What `attnprobe compare` wrote into `out`: compare.json, and the heads (or None), layers and types tables."""
    path = Path(out) / COMPARE_RUN_FILE
    made_by = "attnprobe compare OUT_A OUT_B"
    info = read_json(out, COMPARE_RUN_FILE, made_by)
    if not isinstance(info, dict) or "pairing" not in info or "same_shape" not in info:
        raise AttnprobeError(f"{path} was not made by `{made_by}`: run it again")
    score = info.get("score", "entropy")
    heads = read_table(out, COMPARE_HEADS_FILE, ["layer", "head", f"{score}_diff"], made_by) \
        if info["same_shape"] else None
    layers = read_table(out, COMPARE_LAYERS_FILE, ["depth", f"{score}_diff"], made_by)
    types = read_table(out, COMPARE_TYPES_FILE, ["head_type", "fraction_a", "fraction_b"], made_by) \
        if (Path(out) / COMPARE_TYPES_FILE).is_file() else None
    return info, heads, layers, types


def read_similarity(out: str | Path) -> dict[str, Any] | None:
    """head_similarity.npz as `write_similarity` wrote it (None when `out` has none), checked: a square,
    symmetric, finite `js` of values in [0, ln 2] with a layer and head per row."""
    import zipfile

    path = Path(out) / SIMILARITY_FILE
    if not path.is_file():
        return None
    made_by = f"attnprobe related --out {out}"
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `{made_by}` again") from err
    missing = [key for key in ("js", "layer", "head", "sentences", "rows", "model") if key not in found]
    if missing:
        raise AttnprobeError(f"{path} lacks {', '.join(missing)}: it was not made by `{made_by}`; run it again")
    js, layer, head = found["js"], found["layer"], found["head"]
    n = layer.shape[0] if layer.ndim == 1 else -1
    good = (js.ndim == 2 and js.shape == (n, n) and head.shape == (n,) and n > 0 and js.dtype.kind == "f"
            and layer.dtype.kind in "iu" and head.dtype.kind in "iu")
    if not good or not np.all(np.isfinite(js)) or np.any(js < 0) or np.any(js > np.log(2) + 1e-6) \
            or not np.allclose(js, js.T, rtol=0, atol=1e-9) or not np.allclose(np.diag(js), 0.0, rtol=0, atol=1e-9):
        # the diagonal is a head's JS with itself: exactly 0 as `related` writes it
        raise AttnprobeError(f"{path} does not hold a symmetric [head, head] matrix of JS divergences with a layer "
                             f"and head per row and 0 on its diagonal: run `{made_by}` again")
    found["model"] = str(found["model"])
    return found


def read_checkpoint(out: str | Path, name: str = CHECKPOINT_FILE) -> Any:
    """The checkpoint `analyze` left in `out` (this rank's `name` under torchrun), as a resume.State."""
    from attnprobe.resume import State

    check_checkpoint_slots(out)
    path = Path(out) / name
    if not path.is_file():
        others = checkpoint_files(out)
        if others:
            raise AttnprobeError(f"no {name} in {out}, but {', '.join(others)}: resume with as many processes as "
                                 "the stopped run (checkpoint.npz: one; checkpoint-rankR-of-N.npz: torchrun N)")
        raise AttnprobeError(f"no {name} in {out}: nothing to resume; run without --resume")
    return read_state(path, State.from_arrays)


def read_state(path: Path, from_arrays: Any) -> Any:
    """A checkpoint's state from the .npz at `path`, through `from_arrays(arrays, where)` (which checks every
    field); an unreadable or damaged file is one line (analyze's checkpoint and train-pattern's)."""
    import zipfile

    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with data:
            return from_arrays({key: data[key] for key in data.files}, str(path))
    except (OSError, EOFError, KeyError, ValueError, RecursionError, AttributeError, zipfile.BadZipFile) as err:
        reason = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise AttnprobeError(f"{path} is unreadable or damaged ({reason}): delete it and run without --resume") \
            from err
