"""The only module that touches the results folder: checks, atomic writes, validated reads."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError

HEADS_FILE = "heads.csv"
LAYERS_FILE = "layers.csv"
RUN_FILE = "run.json"
EXAMPLE_FILE = "example_attention.npz"
TYPES_FILE = "head_types.csv"
CATEGORIES_FILE = "categories.csv"
PROBE_FILE = "probe.csv"
PROBE_RUN_FILE = "probe.json"
POSITIONS_FILE = "positions.csv"
CHECKPOINT_FILE = "checkpoint.npz"  # a long run's progress; removed once it completes
SENTENCES_FILE = "sentences.parquet"  # analyze --per-sentence
KV_CACHE_FILE = "kv_cache.json"
RESAMPLES_FILE = "resamples.npz"  # per score, the bootstrap's resampled head means [resample, layer, head]

TEXT_COLUMNS = ("head_type", "category")  # every other column a reader asks for must hold numbers

Writer = Callable[[Path], None]  # writes one file at the given (temporary) path


def check_out_dir(out: str | Path) -> Path:
    """Fail early if results could not be written to `out`; creates nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AttnprobeError(f"--out {out} is a file: pass a folder (it is created if missing)")
    if out.is_dir():
        _check_writable(out)
        return out
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AttnprobeError(f"--out {out} cannot be created: {parent} is a file; pass another folder")
    _check_writable(parent)
    return out


def write_files(out: str | Path, writers: dict[str, Writer], remove: Iterable[str] = ()) -> list[Path]:
    """Write every file to a temporary name, then rename them all into place.

    `remove` names files left by an earlier run that would now be wrong; they go once the rest is in place.
    """
    out = check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, write in writers.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
            os.close(fd)
            staged.append((Path(tmp), out / name))
            write(Path(tmp))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    mode = 0o666 & ~_umask()
    for tmp, final in staged:
        os.chmod(tmp, mode)  # mkstemp makes 0600 files; results should read like any other file
        os.replace(tmp, final)
    for name in remove:
        (out / name).unlink(missing_ok=True)
    return [final for _, final in staged]


class SentenceWriter:
    """sentences.parquet, streamed: one row per (sentence, layer, head), row groups as batches finish.

    Written under a temporary name and renamed by `commit`; `discard` (or an exception inside the
    `with`) removes it, so an interrupted run leaves no half-written file.
    """

    ROWS_PER_GROUP = 65_536

    def __init__(
        self, out: str | Path, names: Iterable[str], lines: list[int], categories: list[str | None]
    ) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.out = check_out_dir(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.names, self.lines, self.categories = list(names), lines, categories
        fields = [("sentence", pa.int64()), ("line", pa.int64()), ("category", pa.string()), ("layer", pa.int32()),
                  ("head", pa.int32())] + [(name, pa.float64()) for name in self.names]
        self.schema = pa.schema(fields)
        fd, tmp = tempfile.mkstemp(dir=self.out, prefix=f".{SENTENCES_FILE}.", suffix=".tmp")
        os.close(fd)
        self.tmp = Path(tmp)
        self.writer = pq.ParquetWriter(self.tmp, self.schema)
        self.pending: list[Any] = []
        self.pending_rows = 0

    def write(self, indices: list[int], values: dict[str, np.ndarray]) -> None:
        """One batch: `values` per score [sentence, layer, head] for the sentences at `indices`."""
        import pyarrow as pa

        some = values[self.names[0]]
        n, layers, heads = some.shape
        sentence = np.repeat(np.asarray(indices, dtype=np.int64), layers * heads)
        columns = {
            "sentence": sentence,
            "line": np.asarray(self.lines, dtype=np.int64)[sentence],
            "category": [self.categories[i] for i in sentence],
            "layer": np.tile(np.repeat(np.arange(layers, dtype=np.int32), heads), n),
            "head": np.tile(np.arange(heads, dtype=np.int32), n * layers),
        }
        missing = np.full(len(sentence), np.nan)  # a score this corpus has none of (special_tokens)
        columns.update({name: values[name].reshape(-1) if name in values else missing for name in self.names})
        self.pending.append(pa.table(columns, schema=self.schema))
        self.pending_rows += len(sentence)
        if self.pending_rows >= self.ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending))
        self.pending, self.pending_rows = [], 0

    def commit(self) -> Path:
        self._flush()
        self.writer.close()
        os.chmod(self.tmp, 0o666 & ~_umask())
        final = self.out / SENTENCES_FILE
        os.replace(self.tmp, final)
        return final

    def discard(self) -> None:
        self.writer.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> SentenceWriter:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.discard()


def read_sentences(out: str | Path) -> Any:
    """sentences.parquet as a lazy pyarrow ParquetFile (`.iter_batches()`, `.read().to_pandas()`)."""
    import pyarrow.parquet as pq

    path = Path(out) / SENTENCES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {SENTENCES_FILE} in {out}: run `attnprobe analyze --per-sentence --out {out}`")
    return pq.ParquetFile(path)


def csv_writer(frame: pd.DataFrame) -> Writer:
    return lambda path: frame.to_csv(path, index=False, float_format="%.8g")


def json_writer(data: dict[str, Any]) -> Writer:
    return lambda path: path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def npz_writer(**arrays: np.ndarray) -> Writer:
    def write(path: Path) -> None:
        with open(path, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    return write


def figure_writer(figure: Any) -> Writer:
    return lambda path: figure.savefig(path, format="png", dpi=120, bbox_inches="tight")


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
    not_numbers = [c for c in columns if c not in TEXT_COLUMNS and not pd.api.types.is_numeric_dtype(frame[c])]
    if not_numbers:
        raise AttnprobeError(
            f"{path} has values that are not numbers in {', '.join(not_numbers)}: run `{made_by}` again"
        )
    key = [c for c in ("category", "layer", "head", "bin") if c in columns]
    if frame.duplicated(key).any():
        raise AttnprobeError(f"{path} repeats a ({', '.join(key)}) row: run `{made_by}` again")
    return frame


def read_columns(out: str | Path, name: str) -> list[str]:
    """The header of a results CSV (empty when it cannot be read; read_table then says why)."""
    try:
        return list(pd.read_csv(Path(out) / name, nrows=0).columns)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
        return []


def check_same_heads(heads: pd.DataFrame, other: pd.DataFrame, name: str, made_by: str) -> None:
    """Refuse a derived table that was made from another heads.csv (another model or run)."""
    key = ["layer", "head"]
    shared = [c for c in ("entropy_unforced", "entropy_norm", "diagonal_unforced", "sink_window") if c in other.columns]
    left = heads[key + shared].sort_values(key).reset_index(drop=True)
    right = other[key + shared].sort_values(key).reset_index(drop=True)
    same_heads = left[key].equals(right[key])
    close = same_heads and np.allclose(left[shared], right[shared], rtol=0, atol=1e-4, equal_nan=True)
    if not close:
        raise AttnprobeError(f"{name} does not match heads.csv (made from another run): run `{made_by}` again")


def read_run(out: str | Path) -> dict[str, Any]:
    """run.json as `analyze` wrote it."""
    path = Path(out) / RUN_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {RUN_FILE} in {out}: run `attnprobe analyze --out {out}` first")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    needed = {"model": ("spec", "layers", "heads", "kv_heads", "head_dim"), "attention": ("sink_tokens", "window")}
    for section, keys in needed.items():
        if not isinstance(run.get(section), dict) or any(k not in run[section] for k in keys):
            raise AttnprobeError(f"{path} lacks {section} settings (made by an older attnprobe): run `attnprobe "
                                 "analyze` again")
    numbers = [run["model"][k] for k in ("layers", "heads", "kv_heads", "head_dim")]
    numbers += [run["attention"][k] for k in ("sink_tokens", "window")] + [run.get("longest_sequence", 1)]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise AttnprobeError(f"{path} holds a model or attention setting that is not a whole number: run "
                             "`attnprobe analyze` again")
    if "longest_sequence" not in run:
        raise AttnprobeError(f"{path} lacks longest_sequence (made by an older attnprobe): run `attnprobe analyze` "
                             "again")
    return run


def read_checkpoint(out: str | Path) -> Any:
    """The checkpoint `analyze` left in `out`, as a resume.State."""
    from attnprobe.resume import State

    path = Path(out) / CHECKPOINT_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {CHECKPOINT_FILE} in {out}: nothing to resume; run without --resume")
    try:
        with np.load(path, allow_pickle=False) as data:
            return State.from_arrays({key: data[key] for key in data.files})
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}): delete it and run without --resume") from err


def read_example(out: str | Path) -> dict[str, Any] | None:
    """The example attention maps saved by `analyze`, or None when there are none."""
    path = Path(out) / EXAMPLE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens = [str(t) for t in data["tokens"]]
            total = int(data["total_tokens"]) if "total_tokens" in data else len(tokens)
            return {"maps": data["maps"], "tokens": tokens, "sentence": str(data["sentence"]), "total_tokens": total}
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err


def read_resamples(out: str | Path) -> dict[str, np.ndarray]:
    """The bootstrap's resampled head means `analyze` saved: per score [resample, layer, head]."""
    path = Path(out) / RESAMPLES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {RESAMPLES_FILE} in {out}: run `attnprobe analyze --out {out}` again")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _check_writable(folder: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise AttnprobeError(f"--out {folder} is not writable ({err.strerror}): pass another folder") from err
