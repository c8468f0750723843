"""KV-cache head files that compression tools load, from a results folder (or from its head_scores.parquet).

Four formats; the first two from one score per head (`load_scores`):

- `duo-attention`: DuoAttention's folder (mit-han-lab/duo-attention `attn_patterns/<model>/`), which NVIDIA kvpress's
  `DuoAttentionPress.load_attention_pattern` reads too: `full_attention_heads.tsv`, one row per layer and one
  tab-separated column per **KV head**, values in [0, 1] (higher: the head keeps its full cache), and `config.json`
  with `sink_size` and `recent_size` (the tokens a streaming head keeps). Both tools read the table with
  `np.loadtxt(path, dtype=float, delimiter="\\t")` and clip it to [0, 1]; kvpress makes the lowest-scoring
  `round(size x head_compression_ratio)` KV heads streaming, so only the order of the scores matters to it.
- `retrieval-head`: Wu et al. 2024's `head_score/<model>.json` (which HeadKV reads too): one object
  `{"L-H": [score per trial]}`, keyed per **query head**. It is named `<model>.json` unless that is the name of
  duo-attention's files or of export's record (a model folder named `config` or `attnprobe`): then
  `<model>.retrieval-head.json` (`retrieval_head_name`), so that no format's file replaces another's.

- `head-scores`: head_scores.parquet, every head score of the run in one file (`headscores`), which `export --from`
  reads back: each format from it equals the format from the folder (`headscores.ScoreFile` answers as a folder).
- `layer-budgets`: layer_budgets.json, the fraction of the cache each layer keeps, from analyze's entropy, for
  kvpress's PerLayerCompressionPress (`budgets`).

The per-query-head score, in [0, 1], comes from `attnprobe train-pattern` where it ran into the folder (each query
head gets its KV head's trained gate, `load_trained`: DuoAttention's gates are per KV head), else from `attnprobe
retrieval` where it ran there (each head's mean retrieval score over the trials) and otherwise from `analyze`'s
heads.csv (the kv score, `kv_scores`): the far share
(1 - sink_window) / (1 - first_token), clipped to [0, 1], i.e. of the attention a head does not park on the first
token, the share that a sink + window cache would drop. Dividing by 1 - first_token matters for retrieval (copy,
induction) heads: on ordinary text they park most of their attention on the first token and look local by
1 - sink_window (the score until 2026-11-27, which in kvpress did worse than a random choice of heads with 75% of
them streaming), but the little they spend elsewhere goes far back. Under grouped-query attention several query heads
read one KV head, and a KV head can be made streaming only if all of them can: its score is the largest of its query
heads' scores. A head whose sink_window is undefined (no row reached past the sinks and the window) keeps its full
cache: score 1; an undefined or absent first_token counts as 0 (the score is then 1 - sink_window).

Ties: kvpress ranks the table with `np.argsort`, whose default sort is not stable, so tied scores (with a few
retrieval trials a third of a model's KV heads can score 0) would be made streaming in an order nobody chose. The
exported table has no ties: within each group of equal scores a secondary score (`HeadScores.secondary`, pooled over
a KV head's query heads by its largest value like the score) orders the heads, then the layer, head order, and each
head gets `rank x eps` added (or, for a group at 1, subtracted), eps = min(smallest gap between distinct scores, 0.5)
/ (number of KV heads + 1): distinct scores keep their order and the values stay in [0, 1]. The secondary score of a
retrieval export is the far share (KV_SCORE) where `analyze` ran into the same folder, else the mean attention mass a
head puts on the needle while it is decoded (retrieval_heads.csv's `needle_mass`); of a kv export the retrieval score
where `retrieval` ran there too. The retrieval-head JSON keeps the measured scores as they are (they are the trials'
own).

Provenance: `export` writes `attnprobe.json` beside the exported files (DuoAttention and kvpress read only
full_attention_heads.tsv and config.json's sink_size and recent_size): per format, the model record (spec, source,
shape, weights fingerprint), the results folder, where the scores and the sizes came from, and the sha256 of each file
written. `ablate --method streaming --pattern` checks the model against it, and `export` writes over a file in --to
only when attnprobe.json records it unchanged: never over a file attnprobe did not write.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import budgets, defaults, headscores, io, limits
from attnprobe.errors import AttnprobeError, plain

FORMATS = ("duo-attention", "retrieval-head", "head-scores", "layer-budgets")
SCORE_FORMATS = FORMATS[:2]  # written from one score per head (load_scores); the others from every score of the run
SOURCES = ("auto", "retrieval", "kv", "trained")  # --scores: where the per-head scores come from
TRAINED_RUN_FILE, TRAINED_GATES_FILE = io.TRAINED_RUN_FILE, io.TRAINED_GATES_FILE  # `attnprobe train-pattern`'s
TRAINED_BY = "attnprobe train-pattern"
TRAINED_WORDS = ("trained gates (train-pattern), one per KV head: each query head gets its KV head's gate, the "
                 "retrieval-head format too")
DUO_SCORES_FILE = "full_attention_heads.tsv"
DUO_CONFIG_FILE = "config.json"
PROVENANCE_FILE = "attnprobe.json"  # export's record of what it wrote, and from which model (no tool reads it)
WRITTEN_BY = "attnprobe export"


@dataclass
class HeadScores:
    """Per query head, how much it needs the full KV cache, and what the exported files need beside it."""

    per_query: np.ndarray  # [layer, head] in [0, 1]: higher needs the full cache more
    source: str  # "retrieval" or "kv"
    model: dict[str, Any]  # spec, layers, heads, kv_heads
    sink: int  # sink_size: the first tokens a streaming head keeps
    recent: int  # recent_size: the last tokens a streaming head keeps
    per_trial: dict[str, list[float]] | None = None  # retrieval's {"L-H": [score per trial]}; None from kv
    secondary: np.ndarray | None = None  # [layer, head]: orders tied scores (higher: later); None: layer, head order
    secondary_name: str | None = None  # what `secondary` is, in words
    sizes_from: str = "run.json"  # where sink and recent came from, in words
    results: str | None = None  # the results folder read


def pool_kv_heads(per_query: np.ndarray, kv_heads: int) -> np.ndarray:
    """[layer, head] -> [layer, kv head]: each KV head takes the largest score of the query heads that read it
    (repeat_kv: query head h reads KV head h // (heads // kv_heads)), so it is streaming only if all of them are."""
    layers, heads = per_query.shape
    if kv_heads < 1 or heads % kv_heads:
        raise AttnprobeError(f"kv_heads {kv_heads} does not divide the {heads} query heads per layer: the results "
                             "folder's run.json is damaged; run `attnprobe analyze` again")
    return per_query.reshape(layers, kv_heads, heads // kv_heads).max(axis=-1)  # [layer, kv head]


KV_SCORE = "(1 - sink_window) / (1 - first_token) (analyze)"  # the kv score, in words


def kv_scores(heads: pd.DataFrame, layers: int, per_layer: int) -> np.ndarray:
    """[layer, head]: the far share of each head's attention, far_share(sink_window, first_token) from heads.csv.
    A head whose sink_window is undefined keeps its full cache (1); an undefined or absent first_token counts as 0."""
    window = _grid(heads, "sink_window", layers, per_layer, io.HEADS_FILE, "attnprobe analyze")  # [layer, head]
    if np.isnan(window).all():
        raise AttnprobeError(f"{io.HEADS_FILE}'s sink_window is empty: no sequence was longer than the sink + window "
                             "tokens; run `attnprobe analyze` on longer text (or a smaller --window)")
    first = np.zeros_like(window)  # [layer, head]
    if "first_token" in heads.columns:
        if not pd.api.types.is_numeric_dtype(heads["first_token"]):
            raise AttnprobeError(f"{io.HEADS_FILE} has values that are not numbers in first_token: run `attnprobe "
                                 "analyze` again")
        first = np.nan_to_num(_grid(heads, "first_token", layers, per_layer, io.HEADS_FILE, "attnprobe analyze"))
    for name, grid in (("sink_window", window), ("first_token", first)):
        if ((grid < -1e-6) | (grid > 1 + 1e-6)).any():
            raise AttnprobeError(f"{io.HEADS_FILE} has a {name} outside [0, 1]: run `attnprobe analyze` again")
    return far_share(window, first)


def far_share(sink_window: np.ndarray, first_token: np.ndarray) -> np.ndarray:
    """clip((1 - sink_window) / (1 - first_token), 0, 1), elementwise: of the attention a head does not park on the
    first token, the share that reaches past the sinks and the recent window. A head that parks everything there
    (1 - first_token = 0) scores 0 if nothing reaches past them, else 1; an undefined sink_window (NaN) scores 1."""
    far = 1.0 - np.clip(sink_window, 0.0, 1.0)  # mass a sink + window cache drops
    unparked = 1.0 - np.clip(first_token, 0.0, 1.0)  # mass not on the first token
    share = np.divide(far, unparked, out=(far > 0).astype(float), where=unparked > 0)
    return np.where(np.isnan(sink_window), 1.0, np.clip(share, 0.0, 1.0))


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
    return {k: model[k] for k in ("spec", "layers", "heads", "kv_heads")} | {"source": model.get("source"),
                                                                             "weights": model.get("weights")}


def check_sizes(sink: int, recent: int, default_sink: object = defaults.SINK_TOKENS,
                default_recent: object = defaults.WINDOW) -> None:
    """config.json's sink_size (0 or more) and recent_size (1 or more: kvpress masks a streaming head's context keys
    `[sink:-recent]`, and with recent 0 that slice, `[sink:-0]`, is empty: nothing masked), both up to
    limits.MAX_POSITIONS. The defaults the message quotes are this export's: the results folder's own sizes."""
    limits.check_whole("--sink-size", sink, 0, limits.MAX_POSITIONS, default_sink)
    limits.check_whole("--recent-size", recent, 1, limits.MAX_POSITIONS, default_recent)


Files = headscores.FolderFiles | headscores.ScoreFile  # a run's results: its folder, or its head_scores.parquet


def as_files(out: str | Path | Files) -> Files:
    """`out` as export reads it: a results folder (a path), or what is given already (a head-scores file)."""
    return out if isinstance(out, (headscores.FolderFiles, headscores.ScoreFile)) else headscores.FolderFiles(out)


def load_scores(out: str | Path | Files, scores: str = "auto", sink: int | None = None,
                recent: int | None = None) -> HeadScores:
    """The per-head scores of the results folder `out` (or of a head-scores file, `headscores.read_score_file`):
    retrieval's where `attnprobe retrieval` wrote there (and `scores` is auto or retrieval), else sink_window's from
    `analyze` (kv). `sink`/`recent` override the run's S and W (run.json's attention.sink_tokens and window); without
    run.json (retrieval alone) analyze's defaults defaults.SINK_TOKENS and defaults.WINDOW stand in, the S and W
    `analyze` would have measured with."""
    if scores not in SOURCES:
        raise AttnprobeError(f"--scores {scores!r}: use one of {', '.join(SOURCES)}")
    files = as_files(out)
    has_run = files.has(io.RUN_FILE)
    has_retrieval = files.has(io.RETRIEVAL_RUN_FILE)
    trained = scores == "trained" or (scores == "auto" and files.has(TRAINED_RUN_FILE))
    if (scores == "kv" or (has_run and not trained)) and not has_run:
        raise AttnprobeError(files.lacking(io.RUN_FILE, "attnprobe analyze"))
    run = files.read_run() if has_run and not trained else None
    has_trained = files.has(TRAINED_RUN_FILE)
    source = scores if scores != "auto" else ("trained" if has_trained else "retrieval" if has_retrieval else "kv")
    if source == "trained":
        return load_trained(files, sink, recent)
    if source == "retrieval":
        retrieval = files.read_json(io.RETRIEVAL_RUN_FILE, "attnprobe retrieval")
        model = _shape(retrieval.get("model"), files.path(io.RETRIEVAL_RUN_FILE))
        if retrieval.get("trials_scored") == 0:
            raise AttnprobeError(f"{files.path(io.RETRIEVAL_RUN_FILE)} scored no trial (the model never copied the "
                                 "needle): run `attnprobe retrieval --decode forced`, or export the sink_window "
                                 "scores with --scores kv")
        if run is not None:
            _check_same_model(model, _shape(run["model"], files.path(io.RUN_FILE)))
    else:
        if run is None:
            raise AttnprobeError(f"{files.lacking(io.RUN_FILE, 'attnprobe analyze')} (or `attnprobe retrieval`)")
        model = _shape(run["model"], files.path(io.RUN_FILE))
    given = [name for name, value in (("--sink-size", sink), ("--recent-size", recent)) if value is not None]
    if run is not None:
        own = int(run["attention"]["sink_tokens"]), int(run["attention"]["window"])
        sizes_from = f"{io.RUN_FILE}'s --sink-tokens and --window"
        quoted = (f"{own[0]}, {io.RUN_FILE}'s --sink-tokens", f"{own[1]}, {io.RUN_FILE}'s --window")
    else:  # retrieval alone: analyze's defaults, what `analyze` would have measured sink_window with
        own = defaults.SINK_TOKENS, defaults.WINDOW
        sizes_from = f"analyze's defaults S = {defaults.SINK_TOKENS}, W = {defaults.WINDOW}: no {io.RUN_FILE}"
        quoted = (f"{own[0]}, analyze's: no {io.RUN_FILE}", f"{own[1]}, analyze's: no {io.RUN_FILE}")
    sink = own[0] if sink is None else sink
    recent = own[1] if recent is None else recent
    check_sizes(sink, recent, *quoted)
    sizes_from = " and ".join(given) if len(given) == 2 else f"{sizes_from}, and {given[0]}" if given else sizes_from
    layers, heads = model["layers"], model["heads"]
    secondary, secondary_name = None, None
    if source == "retrieval":
        table = files.read_table(io.RETRIEVAL_FILE, ["layer", "head", "mean"], "attnprobe retrieval")
        per_query = retrieval_scores(table, layers, heads)
        if not (per_query > 0).any():
            raise AttnprobeError(f"every retrieval score in {files.path(io.RETRIEVAL_FILE)} is 0 (the model never "
                                 "copied the needle): run `attnprobe retrieval --decode forced`, or export the "
                                 "sink_window scores with --scores kv")
        trials = files.read_json(io.RETRIEVAL_SCORES_FILE, "attnprobe retrieval")
        per_trial = _check_trials(trials, layers, heads, files.path(io.RETRIEVAL_SCORES_FILE))
        if run is not None and files.has(io.HEADS_FILE):
            try:
                heads_table = files.read_table(io.HEADS_FILE, ["layer", "head", "sink_window"],
                                               "attnprobe analyze")
                secondary, secondary_name = kv_scores(heads_table, layers, heads), KV_SCORE
            except AttnprobeError:
                secondary = None  # damaged or another run's: the needle mass, else layer, head order
        if secondary is None and "needle_mass" in table.columns \
                and pd.api.types.is_numeric_dtype(table["needle_mass"]):
            mass = _grid(table, "needle_mass", layers, heads, io.RETRIEVAL_FILE, "attnprobe retrieval")
            if np.isfinite(mass).all():
                secondary, secondary_name = mass, "attention mass on the needle (retrieval)"
    else:
        table = files.read_table(io.HEADS_FILE, ["layer", "head", "sink_window"], "attnprobe analyze")
        per_query, per_trial = kv_scores(table, layers, heads), None
        if has_retrieval and files.has(io.RETRIEVAL_FILE):
            try:
                retrieval = files.read_json(io.RETRIEVAL_RUN_FILE, "attnprobe retrieval")
                _check_same_model(_shape(retrieval.get("model"), files.path(io.RETRIEVAL_RUN_FILE)), model)
                means = files.read_table(io.RETRIEVAL_FILE, ["layer", "head", "mean"], "attnprobe retrieval")
                secondary = retrieval_scores(means, layers, heads)
                secondary_name = "retrieval scores (retrieval)"
            except AttnprobeError:
                secondary = None  # another model's, or damaged: the layer, head order breaks the ties
    return HeadScores(per_query, source, model, int(sink), int(recent), per_trial, secondary, secondary_name,
                      sizes_from, files.where)


def load_trained(files: Files, sink: int | None, recent: int | None) -> HeadScores:
    """`attnprobe train-pattern`'s gates as per-query-head scores: each query head gets its KV head's gate (the
    pooling of pool_kv_heads gives the gates back); S and W from its settings unless given."""
    run = files.read_json(TRAINED_RUN_FILE, TRAINED_BY)
    where = files.path(TRAINED_RUN_FILE)
    settings = run.get("settings")
    if run.get("command") != TRAINED_BY or not isinstance(settings, dict):
        raise AttnprobeError(f"{where} is not a record of `{TRAINED_BY}`: run it again")
    model = _shape(run.get("model"), where)
    hashes = run.get(io.RUN_FILES_KEY)
    if not isinstance(hashes, dict) or not isinstance(hashes.get(TRAINED_GATES_FILE), str):
        raise AttnprobeError(f"{where} lacks the sha256 of its {TRAINED_GATES_FILE} (every `{TRAINED_BY}` records "
                             "it; this record was edited): run it again")
    check_recorded(files, run, TRAINED_GATES_FILE, where)
    table = files.read_table(TRAINED_GATES_FILE, ["gate"], TRAINED_BY)  # per KV head: read_table keys heads
    layers, kv_heads = model["layers"], model["kv_heads"]
    for column in ("layer", "kv_head"):
        values = pd.to_numeric(table[column], errors="coerce") if column in table.columns else None
        if values is None or not (np.isfinite(values) & (values >= 0) & (values == np.round(values))).all():
            raise AttnprobeError(f"{files.path(TRAINED_GATES_FILE)} has no {column} column or one that is not whole "
                                 f"numbers of 0 or more: run `{TRAINED_BY}` again")
    renamed = table.astype({"layer": np.int64, "kv_head": np.int64}).rename(columns={"kv_head": "head"})
    gates = _grid(renamed, "gate", layers, kv_heads, TRAINED_GATES_FILE, TRAINED_BY)  # [layer, kv head]
    if not np.isfinite(gates).all() or ((gates < 0) | (gates > 1)).any():
        raise AttnprobeError(f"{files.path(TRAINED_GATES_FILE)} has a gate that is missing or outside [0, 1]: run "
                             f"`{TRAINED_BY}` again")
    sizes = [settings.get(k) for k in ("sink", "recent")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        raise AttnprobeError(f"{where} lacks its sink and recent sizes: run `{TRAINED_BY}` again")
    given = [name for name, value in (("--sink-size", sink), ("--recent-size", recent)) if value is not None]
    sink = sizes[0] if sink is None else sink
    recent = sizes[1] if recent is None else recent
    check_sizes(sink, recent, f"{sizes[0]}, {TRAINED_RUN_FILE}'s", f"{sizes[1]}, {TRAINED_RUN_FILE}'s")
    sizes_from = " and ".join(given) if len(given) == 2 else \
        f"{TRAINED_RUN_FILE}'s --sink-size and --recent-size" + (f", and {given[0]}" if given else "")
    per_query = np.repeat(gates, model["heads"] // kv_heads, axis=1)  # [layer, head]: query head h reads h // groups
    return HeadScores(per_query, "trained", model, int(sink), int(recent), None, None, None, sizes_from,
                      files.where)


def check_recorded(files: Files, run: dict[str, Any], name: str, where: str) -> None:
    """Refuse `name` of `files` when the record `run` lists the sha256 of the files its run wrote and this one's
    differs (a copy from another run)."""
    if not files.recorded(run, name):
        raise AttnprobeError(f"{name} in {files.where} was not written by the run that wrote {Path(where).name} (its "
                             f"sha256 differs from the one recorded): run `{TRAINED_BY}` again, or copy the whole "
                             "folder")


def source_words(scores: HeadScores) -> str:
    """Where the exported scores came from, in words (export's summary line)."""
    return {"kv": KV_SCORE, "retrieval": "retrieval scores (retrieval)", "trained": TRAINED_WORDS}[scores.source]


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
    """DuoAttention's `full_attention_heads` [layer, kv head] in [0, 1], without ties (`break_ties`), and its config
    {sink_size, recent_size}."""
    kv_heads = scores.model["kv_heads"]
    table = np.clip(pool_kv_heads(scores.per_query, kv_heads), 0.0, 1.0)  # [layer, kv head]
    secondary = None if scores.secondary is None else pool_kv_heads(scores.secondary, kv_heads)
    return break_ties(table, secondary), {"sink_size": int(scores.sink), "recent_size": int(scores.recent)}


def break_ties(primary: np.ndarray, secondary: np.ndarray | None = None) -> np.ndarray:
    """`primary` (values in [0, 1]) with no two values equal, so that any sort (kvpress's np.argsort, not stable)
    gives one order: within a group of equal values the heads are ordered by `secondary` (lower first; NaN as
    lowest), then by their place in the array (layer, head order), and the r-th of a group of k gets v + r x eps
    (v - (k - 1 - r) x eps where that would pass 1). eps = min(smallest gap between distinct values, 0.5) / (size +
    1): a group moves by less than half the gap to its neighbours, so distinct values keep their order, and the
    values stay in [0, 1]."""
    flat = np.asarray(primary, dtype=np.float64).reshape(-1)
    size = flat.size
    distinct = np.unique(flat)
    if len(distinct) == size:
        return np.asarray(primary, dtype=np.float64).copy()
    gap = float(np.diff(distinct).min()) if len(distinct) > 1 else 1.0
    eps = min(gap, 0.5) / (size + 1)
    second = np.zeros(size) if secondary is None else np.nan_to_num(np.asarray(secondary, float).reshape(-1),
                                                                     nan=-np.inf)
    order = np.lexsort((np.arange(size), second, flat))  # by primary, then secondary, then position
    result = flat.copy()
    start = 0
    while start < size:
        end = start
        while end < size and flat[order[end]] == flat[order[start]]:
            end += 1
        group, value = order[start:end], flat[order[start]]
        steps = np.arange(len(group)) * eps
        result[group] = value + steps if value + steps[-1] <= 1.0 else value - steps[::-1]
        start = end
    return result.reshape(np.shape(primary))


def retrieval_head_json(scores: HeadScores) -> dict[str, list[float]]:
    """Wu et al.'s `{"L-H": [score per trial]}`: retrieval's own trials, or from sink_window one value per head
    (the far share, KV_SCORE), keyed per query head in layer, head order."""
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


# Names no format's file may take but its own: export's record, duo-attention's two files and layer-budgets' JSON. A
# retrieval-head JSON is named after the model, so a model folder named `attnprobe`, `config` or `layer_budgets`
# would otherwise write over one of them
FIXED_NAMES = (PROVENANCE_FILE, DUO_SCORES_FILE, DUO_CONFIG_FILE, budgets.FILE_NAME)
RETRIEVAL_HEAD_SUFFIX = ".retrieval-head.json"  # where <model>.json would take a fixed name


def retrieval_head_name(spec: str) -> str:
    """The retrieval-head JSON's name: `<model>.json` (Retrieval_Head's `head_score/<model>.json`), or
    `<model>.retrieval-head.json` where that is one of FIXED_NAMES (compared case-blind, as macOS and Windows folders
    compare names), so that every format's files stay apart from the others' and from the record."""
    name = f"{file_stem(spec)}.json"
    taken = {fixed.casefold() for fixed in FIXED_NAMES}
    return f"{file_stem(spec)}{RETRIEVAL_HEAD_SUFFIX}" if name.casefold() in taken else name


def export_files(scores: HeadScores, fmt: str) -> dict[str, io.Writer]:
    """The files of format `fmt`, by name inside --to, ready for io.write_files."""
    if fmt == "duo-attention":
        table, config = duo_attention(scores)
        return {DUO_SCORES_FILE: io.tsv_writer(table), DUO_CONFIG_FILE: io.json_writer(config)}
    if fmt == "retrieval-head":
        return {retrieval_head_name(scores.model["spec"]): io.compact_json_writer(retrieval_head_json(scores))}
    raise AttnprobeError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")


def write_export(to: str | Path, scores: HeadScores, fmt: str) -> list[Path]:
    """Write format `fmt`'s files into `to` and, last, attnprobe.json (`provenance`). Refused before anything is
    written where `to` holds a file of those names that attnprobe did not write (`check_targets`)."""
    to = io.check_out_dir(to, "--to")
    return write_recorded(to, fmt, export_files(scores, fmt), scores_entry(scores, fmt))


def write_head_scores(to: str | Path, files: Files) -> tuple[list[Path], dict[str, Any]]:
    """head_scores.parquet (`headscores`: every head score of the run) into `to`, and attnprobe.json; returns the
    paths written and the file's metadata record."""
    to = io.check_out_dir(to, "--to")
    frame, record = headscores.gather(files)
    entry = {"attnprobe_version": record["attnprobe_version"], "model": record["model"],
             "results": str(Path(files.where).resolve()), "commands": list(record["parts"])}
    return write_recorded(to, "head-scores", {headscores.FILE_NAME: headscores.writer(frame, record)}, entry), record


def write_budgets(to: str | Path, files: Files, ratio: float, min_kept: float) -> tuple[list[Path], dict[str, Any]]:
    """layer_budgets.json (`budgets`: per-layer kept fractions from analyze's entropy, for kvpress's
    PerLayerCompressionPress) into `to`, and attnprobe.json; returns the paths written and the budgets' record."""
    budgets.check_settings(ratio, min_kept)
    to = io.check_out_dir(to, "--to")
    if not files.has(io.RUN_FILE):
        raise AttnprobeError(f"{files.lacking(io.RUN_FILE, 'attnprobe analyze')}: the budgets follow its entropy")
    run = files.read_run()
    model = _shape(run["model"], files.path(io.RUN_FILE))
    heads = files.read_table(io.HEADS_FILE, ["layer", "head", budgets.STATISTIC], "attnprobe analyze")
    statistic = budgets.layer_statistic(heads, model["layers"], model["heads"])  # [layer]
    kept = budgets.allocate(statistic, 1.0 - ratio, min_kept)  # [layer]
    record = budgets.budget_record(statistic, kept, ratio, min_kept, model)
    entry = {"attnprobe_version": record["attnprobe_version"], "model": model,
             "results": str(Path(files.where).resolve()), "statistic": budgets.STATISTIC,
             "compression_ratio": float(ratio), "min_kept": float(min_kept)}
    return write_recorded(to, "layer-budgets", {budgets.FILE_NAME: io.json_writer(record)}, entry), record


def write_recorded(to: Path, fmt: str, files: dict[str, io.Writer], entry: dict[str, Any]) -> list[Path]:
    """`files` into `to`, then attnprobe.json with `entry` (and the files' sha256) as format `fmt`'s record."""
    earlier = check_targets(to, list(files))

    def record(hashes: dict[str, str]) -> io.Writer:
        return io.json_writer(record_exports(earlier, fmt, entry, hashes, to))

    return io.write_files(to, files, last=(PROVENANCE_FILE, record), option="--to")


def scores_entry(scores: HeadScores, fmt: str) -> dict[str, Any]:
    """attnprobe.json's entry of a duo-attention or retrieval-head export (without the files' sha256)."""
    from attnprobe import __version__

    entry: dict[str, Any] = {
        "attnprobe_version": __version__,
        "model": scores.model,
        "results": None if scores.results is None else str(Path(scores.results).resolve()),
        "scores": scores.source,
        "ties": scores.secondary_name or "layer, head order",
    }
    if fmt == "duo-attention":
        entry |= {"sink_size": int(scores.sink), "recent_size": int(scores.recent), "sizes_from": scores.sizes_from}
    return entry


def provenance(earlier: dict[str, Any], scores: HeadScores, fmt: str, hashes: dict[str, str],
               to: Path) -> dict[str, Any]:
    """attnprobe.json after a duo-attention or retrieval-head export (`record_exports`)."""
    return record_exports(earlier, fmt, scores_entry(scores, fmt), hashes, to)


def record_exports(earlier: dict[str, Any], fmt: str, entry: dict[str, Any], hashes: dict[str, str],
                   to: Path) -> dict[str, Any]:
    """attnprobe.json: the earlier record's other formats whose files are still there, unchanged, and which this
    export does not replace (it is written before this export's files are renamed into place), and this export's
    `entry` with the sha256 of its files."""
    replaced = {name.casefold() for name in hashes}
    exports = {name: other for name, other in earlier.get("exports", {}).items() if name != fmt
               and not replaced & {f.casefold() for f in other.get("files", {})}
               and all(_sha256(to / f) == sha for f, sha in other.get("files", {}).items())}
    return {"written_by": WRITTEN_BY, "exports": {**exports, fmt: {**entry, "files": hashes}}}


def read_provenance(folder: str | Path, option: str = "--to") -> dict[str, Any]:
    """`folder`'s attnprobe.json ({} where there is none); refused when it is not export's record."""
    path = Path(folder) / PROVENANCE_FILE
    if not os.path.lexists(path):
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or record.get("written_by") != WRITTEN_BY \
            or not isinstance(record.get("exports"), dict) \
            or not all(isinstance(e, dict) and isinstance(e.get("files", {}), dict)
                       for e in record["exports"].values()):
        raise AttnprobeError(f"{option} {folder} holds a {PROVENANCE_FILE} that `attnprobe export` did not write: "
                             f"pass another {option}, or move {PROVENANCE_FILE} away")
    return record


def check_targets(to: Path, names: list[str]) -> dict[str, Any]:
    """Refuse an export into `to` over a file attnprobe did not write: one of `names` that attnprobe.json does not
    record with its present sha256 (a model's config.json, DuoAttention's own pattern, an edited file). Returns the
    earlier attnprobe.json ({} where none)."""
    record = read_provenance(to)
    recorded = {name: sha for entry in record.get("exports", {}).values()
                for name, sha in entry.get("files", {}).items()}
    for name in names:
        path = to / name
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_file():
            raise AttnprobeError(f"--to {to} holds {name}, which is not a plain file: pass another --to, or move "
                                 f"{name} away")
        if recorded.get(name) != _sha256(path):
            what = _foreign_config(path) if name == DUO_CONFIG_FILE else ""
            raise AttnprobeError(f"--to {to} already holds {name}{what}, which `attnprobe export` did not write (or "
                                 f"which changed since): pass another --to (a new or empty folder), or move {name} "
                                 "away")
    return record


def _foreign_config(path: Path) -> str:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return ""
    extra = sorted(set(config) - {"sink_size", "recent_size"}) if isinstance(config, dict) else []
    return f" (a config with {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}: a model's?)" if extra else ""


def _sha256(path: Path) -> str | None:
    """io.hash_file, or None for a file that cannot be read (it then matches no record)."""
    try:
        return io.hash_file(path)
    except OSError:
        return None
