"""How each kind of result file is written: a Writer per format (CSV, JSON, TSV, npz, figures, text), each writing
one file at the (temporary) path it is given; writing.write_files puts them into place."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError
from attnprobe.io.names import FIGURE_FORMATS, MAX_EXAMPLES

Writer = Callable[[Path], None]  # writes one file at the given (temporary) path


def csv_writer(frame: pd.DataFrame) -> Writer:
    return lambda path: frame.to_csv(path, index=False, float_format="%.8g")


def json_writer(data: dict[str, Any]) -> Writer:
    """Valid JSON always: a NaN or infinite number (a value that is undefined, such as an interval of too
    few sentences) is written as null; `allow_nan=False` makes sure no bare NaN slips through."""
    return lambda path: path.write_text(json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n",
                                        encoding="utf-8")


def finite_json(value: Any) -> Any:
    """`value` with every float that is NaN or infinite replaced by None (dicts, lists and tuples walked)."""
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    return value


def compact_json_writer(data: dict[str, Any]) -> Writer:
    """One line of JSON, as Wu et al.'s retrieval_head_detection.py writes its head scores (NaN refused)."""
    return lambda path: path.write_text(json.dumps(data, allow_nan=False) + "\n", encoding="utf-8")


def tsv_writer(table: np.ndarray) -> Writer:
    """A 2-D array as tab-separated numbers, one row per line, read back with np.loadtxt(..., delimiter="\t"):
    DuoAttention's full_attention_heads.tsv. Each number is Python's shortest repr of the float64, which reads back
    to the same float: export's tie-breaking steps (far below 8 digits on a large model) survive the round trip."""
    def write(path: Path) -> None:
        rows = np.atleast_2d(np.asarray(table, dtype=np.float64))
        path.write_text("".join("\t".join(repr(float(v)) for v in row) + "\n" for row in rows), encoding="utf-8")

    return write


def npz_writer(compress: bool = True, **arrays: np.ndarray) -> Writer:
    """`compress=False` for arrays zip cannot shrink much (bootstrap resamples: 27% smaller for 50x the time)."""
    def write(path: Path) -> None:
        with open(path, "wb") as handle:
            (np.savez_compressed if compress else np.savez)(handle, **arrays)

    return write


def figure_writer(figure: Any, format: str = "png", dpi: float = 120) -> Writer:
    """Save a matplotlib figure as png, svg or pdf (`dpi`: pixels per inch of a png and of images inside
    svg/pdf). A glyph no installed font has (matplotlib < 3.10 has no Last Resort font) warns nobody."""
    if format not in FIGURE_FORMATS:
        raise AttnprobeError(f"--format {format!r}: use one of {', '.join(FIGURE_FORMATS)}")

    def write(path: Path) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from", category=UserWarning)
            figure.savefig(path, format=format, dpi=dpi, bbox_inches="tight")

    return write


def examples_writer(examples: list[dict[str, Any]]) -> Writer:
    """examples.npz: several example sentences' maps, each with the layout of example_attention.npz.

    Each example is a dict with `maps` [layer, head, query, key] (float32 or float16; n x n for its first
    n tokens), `tokens` (n strings), `sentence`, and optionally `total_tokens` (before the cut; default n),
    `category` ("" for none), `index` (0-based in the corpus) and `line` (-1: unknown). The file holds
    `count` and, per example i, `maps_{i}`, `tokens_{i}`, `sentence_{i}`, `total_tokens_{i}`, `category_{i}`,
    `index_{i}` and `line_{i}`: no pickles, so `np.load(..., allow_pickle=False)` reads it.
    """
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    if not 1 <= len(examples) <= MAX_EXAMPLES:
        raise ValueError(f"examples.npz holds 1 to {MAX_EXAMPLES} examples, not {len(examples)}")
    arrays: dict[str, np.ndarray] = {"count": np.asarray(len(examples), dtype=np.int64)}
    for i, example in enumerate(examples):
        maps, tokens = np.asarray(example["maps"]), [str(t) for t in example["tokens"]]
        n = len(tokens)
        if maps.ndim != 4 or maps.shape[2:] != (n, n):
            raise ValueError(f"example {i}: maps {maps.shape} is not [layer, head, {n}, {n}] for {n} tokens")
        arrays[f"maps_{i}"] = maps if maps.dtype in (np.float16, np.float32) else maps.astype(np.float32)
        arrays[f"tokens_{i}"] = np.asarray(tokens, dtype=str)
        arrays[f"sentence_{i}"] = np.asarray(str(example["sentence"]))
        arrays[f"total_tokens_{i}"] = np.asarray(int(example.get("total_tokens", n)), dtype=np.int64)
        arrays[f"category_{i}"] = np.asarray(str(example.get("category") or ""))
        arrays[f"index_{i}"] = np.asarray(int(example.get("index", -1)), dtype=np.int64)
        arrays[f"line_{i}"] = np.asarray(int(example.get("line", -1)), dtype=np.int64)
    return io.npz_writer(**arrays)  # through the package, as every writer is reached (see writing.py)


# head_examples.npz's arrays (headpages.head_examples makes them): what each holds, per segment, entry, row or pick
HEAD_EXAMPLE_ARRAYS = {
    "scores": "[score] the statistics the examples were chosen by (heads.csv's names)",
    "top_keys": "k, the keys kept per query row",
    "segment_sentence": "[segment] 0-based index of the sequence in the corpus",
    "segment_line": "[segment] its line in the corpus file",
    "segment_start": "[segment] first query row of the window (0 for a whole sentence)",
    "segment_stop": "[segment] one past its last query row",
    "segment_tokens": "[segment] tokens of the whole sequence",
    "segment_text": "[segment] the sentence's text (empty for a window of a long sequence)",
    "segment_category": "[segment] its category (empty: none)",
    "label_offsets": "[segment + 1] where each segment's labels start in label_positions and labels",
    "label_positions": "[label] token positions whose labels are kept: the window's and every top key's",
    "labels": "[label] those tokens' text",
    "entry_segment": "[entry] the segment one head's top keys are of",
    "entry_layer": "[entry] its layer",
    "entry_head": "[entry] its head",
    "row_offsets": "[entry + 1] where each entry's rows start in keys and weights",
    "keys": "[row, k] per query row of the window, the positions of its k largest weights (-1: none)",
    "weights": "[row, k] those weights (0 where no key)",
    "pick_score": "[pick] index into scores",
    "pick_entry": "[pick] the entry (head and segment) picked",
    "pick_value": "[pick] the head's statistic on that segment",
    "pick_decile": "[pick] its tenth of the head's values, 0 = lowest",
    "pick_extreme": "[pick] +1: among the highest, -1: among the lowest, 0: a decile's example",
}


def head_examples_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """What makes `arrays` no head_examples.npz (a missing array, lengths or indices that do not fit, weights
    outside [0, 1], keys outside their sequence), or None."""
    missing = [name for name in HEAD_EXAMPLE_ARRAYS if name not in arrays]
    if missing:
        return f"it lacks {', '.join(missing)}"
    a = {name: np.asarray(arrays[name]) for name in HEAD_EXAMPLE_ARRAYS}
    segments, entries, picks = len(a["segment_sentence"]), len(a["entry_segment"]), len(a["pick_entry"])
    k = int(a["top_keys"])
    sizes = {"segment": [n for n in HEAD_EXAMPLE_ARRAYS if n.startswith("segment_")],
             "entry": ["entry_layer", "entry_head"], "pick": [n for n in HEAD_EXAMPLE_ARRAYS if n.startswith("pick_")]}
    for unit, names in sizes.items():
        count = {"segment": segments, "entry": entries, "pick": picks}[unit]
        if any(a[n].ndim != 1 or len(a[n]) != count for n in names):
            return f"its {unit} arrays differ in length"
    for name, count, total in (("label_offsets", segments, len(a["labels"])), ("row_offsets", entries, len(a["keys"]))):
        offsets = a[name]
        if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
            return f"{name} does not fit"
    if len(a["label_positions"]) != len(a["labels"]) or a["keys"].shape != (len(a["keys"]), k) or \
            a["weights"].shape != a["keys"].shape:
        return "its labels, keys or weights do not fit"
    rows = np.diff(a["row_offsets"])
    if entries and (a["entry_segment"].min() < 0 or a["entry_segment"].max() >= segments):
        return "an entry names no segment"
    if entries and (rows != (a["segment_stop"] - a["segment_start"])[a["entry_segment"]]).any():
        return "an entry's rows do not fit its window"
    weights = a["weights"]
    if not (np.isfinite(weights).all() and (weights >= 0).all() and (weights <= 1 + 1e-6).all()):
        return "a weight is not a probability"
    if entries:
        tokens = np.repeat(a["segment_tokens"][a["entry_segment"]], rows)  # [row]
        keys = a["keys"]
        if (keys < -1).any() or (keys >= tokens[:, None]).any():
            return "a key lies outside its sequence"
    if picks and (a["pick_entry"].min() < 0 or a["pick_entry"].max() >= entries or a["pick_score"].min() < 0
                  or a["pick_score"].max() >= len(a["scores"]) or (np.abs(a["pick_extreme"]) > 1).any()
                  or a["pick_decile"].min() < 0 or a["pick_decile"].max() > 9):
        return "a pick names no entry, score or decile"
    return None


def head_examples_writer(arrays: dict[str, np.ndarray]) -> Writer:
    """head_examples.npz: the arrays HEAD_EXAMPLE_ARRAYS lists (headpages.head_examples), checked first; strings as
    unicode arrays, so `np.load(..., allow_pickle=False)` reads it."""
    from attnprobe import io

    problem = head_examples_problem(arrays)
    if problem is not None:
        raise ValueError(f"head_examples.npz: {problem}")
    return io.npz_writer(**{name: np.asarray(arrays[name]) for name in HEAD_EXAMPLE_ARRAYS})


def text_writer(text: str) -> Writer:
    return lambda path: path.write_text(text, encoding="utf-8")
