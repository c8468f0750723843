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


def text_writer(text: str) -> Writer:
    return lambda path: path.write_text(text, encoding="utf-8")
