"""Corpus statistics as sums: fold each batch in, drop it; memory independent of the number of sentences.

For every score and head the accumulator keeps the sum of the per-sentence values and how many
sentences had one; the Poisson-bootstrap resamples keep weighted sums and weights [resample, layer x
head]; the entropy keeps its sum of squares (for `entropy_std`); position bins and categories keep
sums and counts of their own. Every field is a sum, so two accumulators merge by adding them (one
`all_reduce` under torchrun), and the results equal those computed from every sentence's values.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.bootstrap import interval, poisson_weights
from attnprobe.metrics import bin_range

CATEGORY_SCORES = ("entropy", "entropy_norm")  # categories.csv: each layer's mean over heads, per category


@dataclass
class Shape:
    names: tuple[str, ...]  # scores, per head
    bin_names: tuple[str, ...]  # scores kept per position bin
    layers: int
    heads: int
    bins: int
    resamples: int
    seed: int
    categories: tuple[str, ...]  # empty for an untagged corpus
    vocab: int = 0  # top_tokens.csv: the mass each token id received, per head (0: not kept)

    @property
    def category_scores(self) -> tuple[str, ...]:
        return tuple(name for name in CATEGORY_SCORES if name in self.names)


class Accumulator:
    """Sums over sentences of every per-sentence statistic; `add` a batch, `merge` another."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        lh, r, b = (shape.layers, shape.heads), shape.resamples, shape.bins
        self.sums: dict[str, np.ndarray] = {}
        for name in shape.names:
            self.sums[f"sum/{name}"] = np.zeros(lh)  # [layer, head]
            self.sums[f"count/{name}"] = np.zeros(lh)
            self.sums[f"wsum/{name}"] = np.zeros((r, *lh))  # [resample, layer, head]
            self.sums[f"wcount/{name}"] = np.zeros((r, *lh))
        self.sums["sumsq/entropy"] = np.zeros(lh)
        for name in shape.bin_names:
            self.sums[f"binsum/{name}"] = np.zeros((*lh, b))  # [layer, head, bin]
            self.sums[f"bincount/{name}"] = np.zeros((*lh, b))
        self.sums["rows"] = np.zeros(b)  # real query rows per bin
        for category in shape.categories:
            self.sums[f"catcount/{category}"] = np.zeros(shape.layers)  # [layer]
            for name in shape.category_scores:  # sums over the sentences where the score is defined
                self.sums[f"catsum/{name}/{category}"] = np.zeros(shape.layers)  # [layer]
                self.sums[f"catn/{name}/{category}"] = np.zeros(shape.layers)  # [layer]
                self.sums[f"catwsum/{name}/{category}"] = np.zeros((r, shape.layers))  # [resample, layer]
                self.sums[f"catwn/{name}/{category}"] = np.zeros((r, shape.layers))  # [resample, layer]
        if shape.vocab:  # layers x heads x vocab x 8 bytes: independent of the corpus
            self.sums["tokmass"] = np.zeros((*lh, shape.vocab))  # [layer, head, vocab]
            self.sums["tokuniform"] = np.zeros((shape.layers, shape.vocab))  # [layer, vocab]
            self.sums["tokcount"] = np.zeros(shape.vocab)  # [vocab]: key positions holding the token

    def add(
        self, indices: Sequence[int], stats: dict[str, np.ndarray], bins: dict[str, np.ndarray],
        lengths: Sequence[int], categories: Sequence[str] | None = None,
    ) -> None:
        """Fold in one batch: `stats` [sentence, layer, head], `bins` [sentence, layer, head, bin]."""
        weights = poisson_weights(indices, self.shape.resamples, self.shape.seed)  # [resample, sentence]
        s = self.sums
        for name, values in stats.items():
            present = ~np.isnan(values)  # [sentence, layer, head]
            zeroed = np.where(present, values, 0.0)
            s[f"sum/{name}"] += zeroed.sum(axis=0)
            s[f"count/{name}"] += present.sum(axis=0)
            s[f"wsum/{name}"] += np.tensordot(weights, zeroed, axes=1)  # [resample, layer, head]
            s[f"wcount/{name}"] += np.tensordot(weights, present.astype(np.float64), axes=1)
            if name == "entropy":
                s["sumsq/entropy"] += (zeroed**2).sum(axis=0)
        for name, values in bins.items():
            present = ~np.isnan(values)  # [sentence, layer, head, bin]
            k = values.shape[-1]
            s[f"binsum/{name}"][..., :k] += np.where(present, values, 0.0).sum(axis=0)
            s[f"bincount/{name}"][..., :k] += present.sum(axis=0)
        for length in lengths:
            for b in range(self.shape.bins):
                lo, hi = bin_range(b)
                s["rows"][b] += max(0, min(hi, length - 1) - lo + 1)
        if self.shape.categories and categories is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                # per score [sentence, layer]: the mean over heads
                by_sentence = {name: np.nanmean(stats[name], axis=2) for name in self.shape.category_scores}
            for k, category in enumerate(categories):
                s[f"catcount/{category}"] += 1.0
                for name, values in by_sentence.items():
                    present = ~np.isnan(values[k])  # [layer]: a one-token sentence has no entropy_norm
                    value = np.where(present, values[k], 0.0)  # [layer]
                    s[f"catsum/{name}/{category}"] += value
                    s[f"catn/{name}/{category}"] += present
                    s[f"catwsum/{name}/{category}"] += np.outer(weights[:, k], value)  # [resample, layer]
                    s[f"catwn/{name}/{category}"] += np.outer(weights[:, k], present)  # [resample, layer]

    def add_tokens(self, ids: Any, received: Any, uniform: Any) -> None:
        """Fold in one batch's mass received per key position, by token id: `ids` [position] (the batch's real
        tokens, flattened), `received` [layer, head, position], `uniform` [layer, position] (torch tensors)."""
        import torch

        ids = ids.cpu()  # [position]
        s = self.sums
        mass = torch.from_numpy(s["tokmass"]).view(-1, self.shape.vocab)  # [layer x head, vocab]: shares memory
        mass.index_add_(1, ids, received.cpu().double().reshape(mass.shape[0], -1))
        torch.from_numpy(s["tokuniform"]).index_add_(1, ids, uniform.cpu().double())  # [layer, vocab]
        s["tokcount"] += np.bincount(ids.numpy(), minlength=self.shape.vocab)[: self.shape.vocab]

    def merge(self, other: Accumulator) -> None:
        for key, value in other.sums.items():
            self.sums[key] += value

    # ---- results ------------------------------------------------------------------------------

    def head_means(self) -> dict[str, np.ndarray]:
        return {name: _ratio(self.sums[f"sum/{name}"], self.sums[f"count/{name}"]) for name in self.shape.names}

    def resampled_head_means(self, name: str) -> np.ndarray:
        """[resample, layer, head]; NaN where a resample drew no sentence with a value."""
        return _ratio(self.sums[f"wsum/{name}"], self.sums[f"wcount/{name}"])

    def entropy_std(self) -> np.ndarray:
        """Standard deviation of the per-sentence entropy across sentences (ddof = 1), per head."""
        n = self.sums["count/entropy"]
        total, squares = self.sums["sum/entropy"], self.sums["sumsq/entropy"]
        with np.errstate(invalid="ignore", divide="ignore"):
            variance = (squares - total**2 / n) / (n - 1)
        return np.where(n > 1, np.sqrt(np.clip(variance, 0.0, None)), np.nan)

    def heads(self) -> pd.DataFrame:
        """heads.csv without intervals: one row per head, the mean over sentences of every score."""
        layer, head = np.meshgrid(range(self.shape.layers), range(self.shape.heads), indexing="ij")
        frame = pd.DataFrame({"layer": layer.ravel(), "head": head.ravel()})
        for name, values in self.head_means().items():
            frame[name] = values.ravel()
        frame["entropy_std"] = self.entropy_std().ravel()
        frame["sentences"] = self.sums["count/entropy"].ravel().astype(np.int64)
        return frame

    def positions(self, longest: int) -> pd.DataFrame:
        """positions.csv: per layer, head and bin, the rows and each score's mean over sentences."""
        layers, heads, bins = self.shape.layers, self.shape.heads, self.shape.bins
        grids = np.meshgrid(np.arange(layers), np.arange(heads), np.arange(bins), indexing="ij")
        frame = pd.DataFrame({key: g.ravel() for key, g in zip(("layer", "head", "bin"), grids)})
        frame["position_min"] = [bin_range(b)[0] for b in frame["bin"]]
        frame["position_max"] = [min(bin_range(b)[1], longest - 1) for b in frame["bin"]]
        frame["rows"] = self.sums["rows"].astype(np.int64)[frame["bin"]]
        for name in self.shape.bin_names:
            frame[name] = _ratio(self.sums[f"binsum/{name}"], self.sums[f"bincount/{name}"]).ravel()
        return frame

    def categories(self) -> pd.DataFrame | None:
        """categories.csv: per category and layer, the mean entropy and normalized entropy with intervals."""
        if not self.shape.categories:
            return None
        frames = []
        for category in self.shape.categories:
            count = self.sums[f"catcount/{category}"]
            frame = pd.DataFrame({"category": category, "layer": np.arange(self.shape.layers)})
            for name in self.shape.category_scores:
                resampled = _ratio(self.sums[f"catwsum/{name}/{category}"], self.sums[f"catwn/{name}/{category}"])
                low, high = interval(resampled)
                frame[name] = _ratio(self.sums[f"catsum/{name}/{category}"], self.sums[f"catn/{name}/{category}"])
                frame[f"{name}_ci_low"], frame[f"{name}_ci_high"] = low, high
            frame["sentences"] = int(count[0])
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)


def _ratio(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)
