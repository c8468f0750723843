"""A run's tables from its sums: per (sentence, layer, head) rows (`tidy`), the layer means, the early/late
entropy gradient, and the bootstrap intervals of every score; and the note on a run of few sentences."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import defaults
from attnprobe.accumulate import Accumulator
from attnprobe.bootstrap import interval
from attnprobe.corpus import Corpus
from attnprobe.metrics import METRICS, SPECIAL
from attnprobe.scores import VW_METRICS

FEW_SENTENCES = defaults.FEW_SENTENCES


def tidy(stats: dict[str, np.ndarray], corpus: Corpus) -> pd.DataFrame:
    """One row per (sentence, layer, head) of per-score arrays [sentence, layer, head], with each sentence's
    category (sentences.parquet, Analysis.per_sentence)."""
    n_sentences, n_layers, n_heads = stats["entropy"].shape
    grids = np.meshgrid(np.arange(n_sentences), np.arange(n_layers), np.arange(n_heads), indexing="ij")
    frame = pd.DataFrame({key: g.ravel() for key, g in zip(("sentence", "layer", "head"), grids)})
    for name, column in stats.items():
        frame[name] = column.ravel()
    frame["category"] = [corpus.sentences[i].category for i in frame["sentence"]]
    return frame


def metric_columns(frame: pd.DataFrame) -> list[str]:
    """The score columns `frame` holds, in the order of the scores."""
    return [name for name in (*METRICS, SPECIAL, *VW_METRICS) if name in frame.columns]


def summarize_layers(heads: pd.DataFrame) -> pd.DataFrame:
    """One row per layer: the mean of every score over its heads, and the spread of its heads' entropy."""
    grouped = heads.groupby("layer", sort=True)
    layers = grouped[metric_columns(heads)].mean()
    layers["entropy_head_std"] = grouped["entropy"].std(ddof=0)
    layers["entropy_head_min"] = grouped["entropy"].min()
    layers["entropy_head_max"] = grouped["entropy"].max()
    return layers.reset_index()


def third(n_layers: int) -> int:
    """How many layers are "early" and how many "late": a third of them, at least one."""
    return max(1, n_layers // 3)


def early_late(layers: pd.DataFrame) -> dict[str, Any]:
    """Mean entropy of the first and last third of the layers, and early minus late."""
    n = len(layers)
    k = third(n)
    early = layers["entropy"].iloc[:k].mean()
    late = layers["entropy"].iloc[n - k :].mean()
    return {
        "early_layers": [0, k - 1],
        "late_layers": [n - k, n - 1],
        "early_entropy": float(early),
        "late_entropy": float(late),
        "difference": float(early - late),
    }


def add_intervals(
    heads: pd.DataFrame, layers: pd.DataFrame, totals: Accumulator, resampled: dict[str, np.ndarray] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """`<name>_ci_low`/`_ci_high` for every score of heads and layers, and the gradient's interval. `resampled`:
    per score, totals.resampled_head_means [resample, layer, head], when the caller has them already."""
    head_columns, layer_columns = {}, {}
    for name in totals.shape.names:
        per_head = resampled[name] if resampled is not None else totals.resampled_head_means(name)  # [r, l, h]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN heads stay NaN
            per_layer = np.nanmean(per_head, axis=2)  # [resample, layer]
        low, high = interval(per_head)
        head_columns[f"{name}_ci_low"], head_columns[f"{name}_ci_high"] = low.ravel(), high.ravel()
        low, high = interval(per_layer)
        layer_columns[f"{name}_ci_low"], layer_columns[f"{name}_ci_high"] = low, high
        if name == "entropy":
            entropy_by_layer = per_layer
    heads = pd.concat([heads, pd.DataFrame(head_columns, index=heads.index)], axis=1)  # one copy, not one per column
    layers = pd.concat([layers, pd.DataFrame(layer_columns, index=layers.index)], axis=1)
    summary = early_late(layers)
    k = third(entropy_by_layer.shape[1])
    early = entropy_by_layer[:, :k].mean(axis=1)  # [resample]
    late = entropy_by_layer[:, -k:].mean(axis=1)  # [resample]
    for key, resampled in (("early_entropy", early), ("late_entropy", late), ("difference", early - late)):
        low, high = interval(resampled)
        summary[f"{key}_ci"] = [float(low), float(high)]
    return heads, layers, summary


def few_sentences_note(sentences: int, block_lengths: list[int] | None = None) -> str | None:
    """The warning for a run over fewer than FEW_SENTENCES sentences (its intervals come from the block bootstrap
    over query rows, `block_lengths` rows per block), else None."""
    if sentences >= FEW_SENTENCES:
        return None
    sizes = sorted(set(block_lengths or []))
    blocks = f" (blocks of {sizes[0] if len(sizes) == 1 else f'{sizes[0]}-{sizes[-1]}'} rows)" if sizes else ""
    return (f"only {sentences} sequence{'' if sentences == 1 else 's'}: the 95% intervals come from a block bootstrap "
            f"over the query rows within {'it' if sentences == 1 else 'each'}{blocks}, not over sentences; they show "
            "how the means would vary over another stretch of similar text, assuming rows more than a block apart are "
            "nearly independent, and say nothing about another sample of sentences or documents. Use at least "
            f"{FEW_SENTENCES} sequences for intervals over sentences")
