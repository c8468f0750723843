"""KV-cache head files that compression tools load, from a results folder.

Two formats:

- `duo-attention`: DuoAttention's folder (mit-han-lab/duo-attention `attn_patterns/<model>/`), which NVIDIA kvpress's
  `DuoAttentionPress.load_attention_pattern` reads too: `full_attention_heads.tsv`, one row per layer and one
  tab-separated column per **KV head**, values in [0, 1] (higher: the head keeps its full cache), and `config.json`
  with `sink_size` and `recent_size` (the tokens a streaming head keeps). Both tools read the table with
  `np.loadtxt(path, dtype=float, delimiter="\\t")` and clip it to [0, 1]; kvpress makes the lowest-scoring
  `round(size x head_compression_ratio)` KV heads streaming, so only the order of the scores matters to it.
- `retrieval-head`: Wu et al. 2024's `head_score/<model>.json` (which HeadKV reads too): one object
  `{"L-H": [score per trial]}`, keyed per **query head**.

The per-query-head score, in [0, 1], comes from `attnprobe retrieval` where it ran into the folder (each head's mean
retrieval score over the trials) and otherwise from `analyze`'s sink_window: 1 - sink_window, the share of the head's
attention that a sink + window cache would drop. Under grouped-query attention several query heads read one KV head,
and a KV head can be made streaming only if all of them can: its score is the largest of its query heads' scores
(for the sink_window score, 1 - the smallest sink_window among them). A head whose sink_window is undefined (no row
reached past the sinks and the window) keeps its full cache: score 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import io
from attnprobe.errors import AttnprobeError, plain

FORMATS = ("duo-attention", "retrieval-head")
SOURCES = ("auto", "retrieval", "kv")  # --scores: where the per-head scores come from
DUO_SCORES_FILE = "full_attention_heads.tsv"
DUO_CONFIG_FILE = "config.json"


@dataclass
class HeadScores:
    """Per query head, how much it needs the full KV cache, and what the exported files need beside it."""

    per_query: np.ndarray  # [layer, head] in [0, 1]: higher needs the full cache more
    source: str  # "retrieval" or "kv"
    model: dict[str, Any]  # spec, layers, heads, kv_heads
    sink: int  # sink_size: the first tokens a streaming head keeps
    recent: int  # recent_size: the last tokens a streaming head keeps
    per_trial: dict[str, list[float]] | None = None  # retrieval's {"L-H": [score per trial]}; None from kv


def pool_kv_heads(per_query: np.ndarray, kv_heads: int) -> np.ndarray:
    """[layer, head] -> [layer, kv head]: each KV head takes the largest score of the query heads that read it
    (repeat_kv: query head h reads KV head h // (heads // kv_heads)), so it is streaming only if all of them are."""
    layers, heads = per_query.shape
    if kv_heads < 1 or heads % kv_heads:
        raise AttnprobeError(f"kv_heads {kv_heads} does not divide the {heads} query heads per layer: the results "
                             "folder's run.json is damaged; run `attnprobe analyze` again")
    return per_query.reshape(layers, kv_heads, heads // kv_heads).max(axis=-1)  # [layer, kv head]


def kv_scores(heads: pd.DataFrame, layers: int, per_layer: int) -> np.ndarray:
    """[layer, head]: 1 - sink_window from heads.csv (1 where sink_window is undefined: keep the full cache)."""
    grid = _grid(heads, "sink_window", layers, per_layer, io.HEADS_FILE, "attnprobe analyze")
    if np.isnan(grid).all():
        raise AttnprobeError(f"{io.HEADS_FILE}'s sink_window is empty: no sequence was longer than the sink + window "
                             "tokens; run `attnprobe analyze` on longer text (or a smaller --window)")
    if ((grid < -1e-6) | (grid > 1 + 1e-6)).any():
        raise AttnprobeError(f"{io.HEADS_FILE} has a sink_window outside [0, 1]: run `attnprobe analyze` again")
    return np.where(np.isnan(grid), 1.0, 1.0 - np.clip(grid, 0.0, 1.0))


def retrieval_scores(table: pd.DataFrame, layers: int, per_layer: int) -> np.ndarray:
    """[layer, head]: each head's mean retrieval score from retrieval_heads.csv."""
    grid = _grid(table, "mean", layers, per_layer, io.RETRIEVAL_FILE, "attnprobe retrieval")
    if np.isnan(grid).any() or ((grid < -1e-9) | (grid > 1 + 1e-9)).any():
        raise AttnprobeError(f"{io.RETRIEVAL_FILE} has a mean that is missing or outside [0, 1]: run "
                             "`attnprobe retrieval` again")
    return np.clip(grid, 0.0, 1.0)


def _grid(frame: pd.DataFrame, column: str, layers: int, per_layer: int, name: str, made_by: str) -> np.ndarray:
    """`column` of a per-head table as [layer, head], which must hold every head of the model exactly once."""
    inside = frame["layer"].lt(layers) & frame["head"].lt(per_layer)
    if len(frame) != layers * per_layer or not inside.all():
        raise AttnprobeError(f"{name} holds {len(frame)} heads, not the model's {layers} layers x {per_layer} heads "
                             f"(it is from another run): run `{made_by}` again")
    grid = np.full((layers, per_layer), np.nan)  # [layer, head]
    grid[frame["layer"].to_numpy(), frame["head"].to_numpy()] = frame[column].to_numpy(dtype=float)
    return grid


def _shape(model: Any, where: str) -> dict[str, Any]:
    """The model record's spec and shape, checked: whole numbers, KV heads dividing the query heads, a decoder."""
    if not isinstance(model, dict) or any(k not in model for k in ("spec", "layers", "heads", "kv_heads")):
        raise AttnprobeError(f"{where} lacks the model's layers, heads and kv_heads: run the command that made it "
                             "again")
    numbers = [model[k] for k in ("layers", "heads", "kv_heads")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in numbers) \
            or model["heads"] % model["kv_heads"]:
        raise AttnprobeError(f"{where} holds a model shape that is not whole numbers with kv_heads dividing heads "
                             f"({', '.join(plain(v) for v in numbers)}): run the command that made it again")
    if model.get("causal", True) is False:
        raise AttnprobeError(f"{model['spec']} is an encoder: it keeps no KV cache, so there is nothing to export")
    return {k: model[k] for k in ("spec", "layers", "heads", "kv_heads")} | {"source": model.get("source")}


def load_scores(out: str | Path, scores: str = "auto", sink: int | None = None,
                recent: int | None = None) -> HeadScores:
    """The per-head scores of the results folder `out`: retrieval's where `attnprobe retrieval` wrote there (and
    `scores` is auto or retrieval), else sink_window's from `analyze` (kv). `sink`/`recent` override the run's
    S and W (run.json's attention.sink_tokens and window); without run.json they must be given."""
    if scores not in SOURCES:
        raise AttnprobeError(f"--scores {scores!r}: use one of {', '.join(SOURCES)}")
    for name, value in (("--sink-size", sink), ("--recent-size", recent)):
        if value is not None and value < 0:
            raise AttnprobeError(f"{name} {value} is below 0: use 0 or more")
    out = Path(out)
    if not out.is_dir():
        raise AttnprobeError(f"--out {out} is not a results folder: run `attnprobe analyze` or `attnprobe retrieval` "
                             "with --out first")
    has_run = (out / io.RUN_FILE).is_file()
    has_retrieval = (out / io.RETRIEVAL_RUN_FILE).is_file()
    run = io.read_run(out) if has_run or scores == "kv" else None
    source = scores if scores != "auto" else ("retrieval" if has_retrieval else "kv")
    if source == "retrieval":
        retrieval = io.read_json(out, io.RETRIEVAL_RUN_FILE, "attnprobe retrieval")
        model = _shape(retrieval.get("model"), str(out / io.RETRIEVAL_RUN_FILE))
        if retrieval.get("trials_scored") == 0:
            raise AttnprobeError(f"{out / io.RETRIEVAL_RUN_FILE} scored no trial (the model never copied the "
                                 "needle): run `attnprobe retrieval --decode forced`, or export the sink_window "
                                 "scores with --scores kv")
        if run is not None:
            _check_same_model(model, _shape(run["model"], str(out / io.RUN_FILE)))
    else:
        if run is None:
            raise AttnprobeError(f"no {io.RUN_FILE} in {out}: run `attnprobe analyze --out {out}` (or "
                                 "`attnprobe retrieval`) first")
        model = _shape(run["model"], str(out / io.RUN_FILE))
    if run is not None:
        sink = int(run["attention"]["sink_tokens"]) if sink is None else sink
        recent = int(run["attention"]["window"]) if recent is None else recent
    if sink is None or recent is None:
        raise AttnprobeError(f"no {io.RUN_FILE} in {out} to take the sink and window sizes from: pass --sink-size "
                             "and --recent-size (the tokens a streaming head keeps)")
    layers, heads = model["layers"], model["heads"]
    if source == "retrieval":
        table = io.read_table(out, io.RETRIEVAL_FILE, ["layer", "head", "mean"], "attnprobe retrieval")
        per_query = retrieval_scores(table, layers, heads)
        if not (per_query > 0).any():
            raise AttnprobeError(f"every retrieval score in {out / io.RETRIEVAL_FILE} is 0 (the model never copied "
                                 "the needle): run `attnprobe retrieval --decode forced`, or export the sink_window "
                                 "scores with --scores kv")
        trials = io.read_json(out, io.RETRIEVAL_SCORES_FILE, "attnprobe retrieval")
        per_trial = _check_trials(trials, layers, heads, out / io.RETRIEVAL_SCORES_FILE)
    else:
        table = io.read_table(out, io.HEADS_FILE, ["layer", "head", "sink_window"], "attnprobe analyze")
        per_query, per_trial = kv_scores(table, layers, heads), None
    return HeadScores(per_query, source, model, int(sink), int(recent), per_trial)


def _check_same_model(retrieval: dict[str, Any], analyzed: dict[str, Any]) -> None:
    shape = ("layers", "heads", "kv_heads")
    same_name = {retrieval["spec"], retrieval.get("source")} & {analyzed["spec"], analyzed.get("source")} - {None}
    if [retrieval[k] for k in shape] != [analyzed[k] for k in shape] or not same_name:
        raise AttnprobeError(f"{io.RETRIEVAL_RUN_FILE} is of {retrieval['spec']} but {io.RUN_FILE} of "
                             f"{analyzed['spec']}: run `attnprobe retrieval` with the analyzed model, or pass "
                             "--scores kv")


def _check_trials(trials: dict[str, Any], layers: int, heads: int, path: Path) -> dict[str, list[float]]:
    """retrieval's {"L-H": [scores]}: every head once, each a list of numbers in [0, 1]."""
    names = {f"{layer}-{head}" for layer in range(layers) for head in range(heads)}
    if set(trials) != names:
        raise AttnprobeError(f"{path} does not name the model's {layers} x {heads} heads as \"layer-head\": run "
                             "`attnprobe retrieval` again")
    for name, values in trials.items():
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and 0 <= v <= 1 for v in values):
            raise AttnprobeError(f"{path} holds scores of head {name} that are not numbers in [0, 1]: run "
                                 "`attnprobe retrieval` again")
    return {name: [float(v) for v in trials[name]] for name in sorted(names, key=_head_order)}


def _head_order(name: str) -> tuple[int, int]:
    layer, head = name.split("-")
    return int(layer), int(head)


def duo_attention(scores: HeadScores) -> tuple[np.ndarray, dict[str, int]]:
    """DuoAttention's `full_attention_heads` [layer, kv head] in [0, 1] and its config {sink_size, recent_size}."""
    table = pool_kv_heads(scores.per_query, scores.model["kv_heads"])  # [layer, kv head]
    return np.clip(table, 0.0, 1.0), {"sink_size": int(scores.sink), "recent_size": int(scores.recent)}


def retrieval_head_json(scores: HeadScores) -> dict[str, list[float]]:
    """Wu et al.'s `{"L-H": [score per trial]}`: retrieval's own trials, or from sink_window one value per head
    (1 - sink_window: the mass a sink + window cache would drop), keyed per query head in layer, head order."""
    if scores.per_trial is not None:
        return scores.per_trial
    layers, heads = scores.per_query.shape
    return {f"{layer}-{head}": [float(scores.per_query[layer, head])] for layer in range(layers)
            for head in range(heads)}


def file_stem(spec: str) -> str:
    """The name Retrieval_Head gives its JSON (`head_score/<model>.json`): the model's last path part, made safe."""
    stem = Path(str(spec).rstrip("/\\")).name or "model"
    stem = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in stem).lstrip(".")
    return stem.removesuffix(".gguf") or "model"


def export_files(scores: HeadScores, fmt: str) -> dict[str, io.Writer]:
    """The files of format `fmt`, by name inside --to, ready for io.write_files."""
    if fmt == "duo-attention":
        table, config = duo_attention(scores)
        return {DUO_SCORES_FILE: io.tsv_writer(table), DUO_CONFIG_FILE: io.json_writer(config)}
    if fmt == "retrieval-head":
        return {f"{file_stem(scores.model['spec'])}.json": io.compact_json_writer(retrieval_head_json(scores))}
    raise AttnprobeError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
