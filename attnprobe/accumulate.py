"""Corpus statistics as sums: fold each batch in, drop it; memory independent of the number of sentences.

For every score and head the accumulator keeps the sum of the per-sentence values and how many
sentences had one; the Poisson-bootstrap resamples keep weighted sums and weights [resample, layer x
head] (under the block bootstrap of a run of few sequences, `add_resampled` folds in each sequence's
resampled means instead, with weight 1); the entropy keeps its sum of squares (for `entropy_std`);
position bins and categories keep sums and counts of their own. Every field is a sum, so two
accumulators merge by adding them (one `all_reduce` under torchrun), and the results equal those
computed from every sentence's values.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.allocator import sparse_zeros
from attnprobe.bootstrap import POISSON, interval, poisson_weights
from attnprobe.metrics import bin_range

CATEGORY_SCORES = ("entropy", "entropy_norm")  # categories.csv: each layer's mean over heads, per category
TOKEN_SUMS = ("tokmass", "tokuniform")  # the sums indexed by token id, [vocab, ...], mapped in row by row


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
    method: str = POISSON  # the bootstrap: poisson (weights per sentence, folded by `flush`) or block (`add_resampled`)
    vocab: int = 0  # top_tokens.csv: the mass each token id received, per head (0: not kept)

    @property
    def category_scores(self) -> tuple[str, ...]:
        return tuple(name for name in CATEGORY_SCORES if name in self.names)


RESAMPLE_CELLS = 2**24  # resamples x scores x heads at most: the two resample sums stay within 256 MiB (float64)


def resamples_within_budget(asked: int, scores: int, heads: int) -> int:
    """The resamples a run keeps: `asked`, or fewer where `asked` x scores x heads (all layers' heads) would pass
    RESAMPLE_CELLS. Up to 512 heads (a 1B model) with every score, 1,000 resamples fit; at 1,024 heads (32 x 32,
    an 8B shape) the two float64 sums [resample, score, layer, head] would hold 2 x 1,000 x 27 x 1,024 x 8 bytes
    (442 MB) and the run's means per resample as much again, so they keep about 600. The percentile interval's
    endpoints then move by Monte Carlo noise about sqrt(1000 / 600) = 1.3 times that of 1,000 resamples."""
    return max(1, min(asked, RESAMPLE_CELLS // max(1, scores * heads)))


PENDING_SENTENCES = 64  # sentences held before their resample sums are folded in with one product
FOLD_RESAMPLES = 256  # resamples whose sums one product of a fold computes (a buffer of 256 x columns)
PENDING_KEYS = ("pending/fill", "pending/index", "pending/category", "pending/values", "pending/present")


def pending_after(batch_sizes: Sequence[int], method: str = POISSON) -> int:
    """How many sentences wait in the buffer after batches of these sizes (`Accumulator._wait`'s rule: a batch
    larger than the buffer goes in slices; a slice that would not fit folds the buffer in first). The block
    bootstrap keeps no buffer. A checkpoint's pending/fill must be this."""
    if method != POISSON:
        return 0
    fill = 0
    for n in batch_sizes:
        for start in range(0, n, PENDING_SENTENCES):
            part = min(PENDING_SENTENCES, n - start)
            fill = (0 if fill + part > PENDING_SENTENCES else fill) + part
    return fill


class Accumulator:
    """Sums over sentences of every per-sentence statistic; `add` a batch, `merge` another.

    The resample sums [resample, layer, head] of a score are the costly part (1000 x heads floats touched per
    fold): sentences wait in a fixed-size buffer ("pending/...", part of the state) and are folded in
    PENDING_SENTENCES at a time with one product. The buffer fills at the same batches in a resumed run as in
    an uninterrupted one, so the two add the same numbers in the same groups and agree exactly. `sums` folds
    the buffer in first (results, merging ranks); `state()` is the raw dict, buffer included (checkpoints).
    """

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        lh, r, b = (shape.layers, shape.heads), shape.resamples, shape.bins
        self._sums: dict[str, np.ndarray] = {}
        # every score's resample sums are views of one array, so a fold adds them all in one operation
        self._wsum = _zeroed((r, len(shape.names), *lh))  # [resample, score, layer, head]
        self._wcount = _zeroed((r, len(shape.names), *lh))  # [resample, score, layer, head]
        self._drawn = np.zeros(r)  # [resample]: weights folded in but not yet added to every column of _wcount
        self._product = np.empty((min(r, FOLD_RESAMPLES), len(shape.names) * lh[0] * lh[1]))  # [resample, columns]
        for k, name in enumerate(shape.names):
            self._sums[f"sum/{name}"] = np.zeros(lh)  # [layer, head]
            self._sums[f"count/{name}"] = np.zeros(lh)
            self._sums[f"wsum/{name}"] = self._wsum[:, k]  # [resample, layer, head]
            self._sums[f"wcount/{name}"] = self._wcount[:, k]
        self._sums["sumsq/entropy"] = np.zeros(lh)
        for name in shape.bin_names:
            self._sums[f"binsum/{name}"] = np.zeros((*lh, b))  # [layer, head, bin]
            self._sums[f"bincount/{name}"] = np.zeros((*lh, b))
        self._sums["rows"] = np.zeros(b)  # real query rows per bin
        for category in shape.categories:
            self._sums[f"catcount/{category}"] = np.zeros(shape.layers)  # [layer]
            for name in shape.category_scores:  # sums over the sentences where the score is defined
                self._sums[f"catsum/{name}/{category}"] = np.zeros(shape.layers)  # [layer]
                self._sums[f"catn/{name}/{category}"] = np.zeros(shape.layers)  # [layer]
                self._sums[f"catwsum/{name}/{category}"] = np.zeros((r, shape.layers))  # [resample, layer]
                self._sums[f"catwn/{name}/{category}"] = np.zeros((r, shape.layers))  # [resample, layer]
        if shape.vocab:  # by token id: a corpus maps in the rows of the tokens it holds (allocator.sparse_zeros)
            self._sums["tokmass"] = sparse_zeros((shape.vocab, *lh))  # [vocab, layer, head]
            self._sums["tokuniform"] = sparse_zeros((shape.vocab, shape.layers))  # [vocab, layer]
            self._sums["tokcount"] = np.zeros(shape.vocab)  # [vocab]: key positions holding the token
        self._empty_buffer()

    def _empty_buffer(self) -> None:
        """The waiting sentences: all zeros when empty, so merging two emptied accumulators adds nothing."""
        if "pending/fill" in self._sums:  # zeroed in place: new arrays would be mapped in again, page by page
            for key in PENDING_KEYS:
                self._sums[key].fill(0.0)
            return
        p, lh = PENDING_SENTENCES, (self.shape.layers, self.shape.heads)
        self._sums["pending/fill"] = np.zeros(1)
        self._sums["pending/index"] = np.zeros(p)  # [pending]: corpus index of each waiting sentence
        self._sums["pending/category"] = np.zeros(p)  # [pending]: 1 + its category's position, 0: none
        self._sums["pending/values"] = np.zeros((p, len(self.shape.names), *lh))  # [pending, score, layer, head]
        self._sums["pending/present"] = np.zeros((p, len(self.shape.names), *lh))  # 1 where it has a value, else 0

    @property
    def sums(self) -> dict[str, np.ndarray]:
        """Every sum, the waiting sentences folded in."""
        self.flush()
        return self.state()

    @sums.setter
    def sums(self, value: dict[str, np.ndarray]) -> None:
        """Take these sums (a checkpoint's state, the ranks' merged sums), copied into place."""
        self._drawn.fill(0.0)
        for key, array in value.items():
            self._sums[key][...] = array

    def restore(self, sums: dict[str, np.ndarray], token_rows: np.ndarray | None = None) -> None:
        """Take a checkpoint's sums (resume.State: checked by `check_fits`). `token_rows`: the token ids whose rows
        its top-token sums hold ([met, ...]); only those rows are written, so the rest of the [vocab, ...] tables
        stay unmapped (allocator.sparse_zeros), as in the run that saved it."""
        if token_rows is None:
            self.sums = sums
            return
        self.sums = {key: value for key, value in sums.items() if key not in TOKEN_SUMS}
        for key in TOKEN_SUMS:
            self._sums[key][token_rows] = sums[key]  # [met, ...] into [vocab, ...]

    def state(self) -> dict[str, np.ndarray]:
        """The raw sums with the buffer of waiting sentences, for a checkpoint (restore with `sums = ...`)."""
        if self._drawn.any():  # the resample counts every column shares, added once, not at every fold
            self._wcount += self._drawn[:, None, None, None]
            self._drawn.fill(0.0)
        return self._sums

    def add(
        self, indices: Sequence[int], stats: dict[str, np.ndarray], bins: dict[str, np.ndarray],
        lengths: Sequence[int], categories: Sequence[str] | None = None,
    ) -> None:
        """Fold in one batch: `stats` [sentence, layer, head], `bins` [sentence, layer, head, bin]."""
        s = self._sums
        for name, values in stats.items():
            present = ~np.isnan(values)  # [sentence, layer, head]
            zeroed = np.where(present, values, 0.0)
            s[f"sum/{name}"] += zeroed.sum(axis=0)
            s[f"count/{name}"] += present.sum(axis=0)
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
            for category in categories:
                s[f"catcount/{category}"] += 1.0
        if self.shape.method == POISSON:
            self._wait(indices, stats, categories)
        elif self.shape.categories and categories is not None:  # the block resamples come through add_resampled
            self._add_categories(stats, categories)

    def _add_categories(self, stats: dict[str, np.ndarray], categories: Sequence[str]) -> None:
        """The category sums of a batch (without resamples): per score, each layer's mean over heads."""
        s = self._sums
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            by_sentence = {name: np.nanmean(stats[name], axis=2) for name in self.shape.category_scores}  # [n, layer]
        for k, category in enumerate(categories):
            for name, values in by_sentence.items():
                present = ~np.isnan(values[k])  # [layer]: a one-token sentence has no entropy_norm
                s[f"catsum/{name}/{category}"] += np.where(present, values[k], 0.0)
                s[f"catn/{name}/{category}"] += present

    def add_resampled(
        self, layer: int, resampled: dict[str, np.ndarray], categories: Sequence[str] | None = None,
    ) -> None:
        """Fold in one layer's block-bootstrap means of a batch, per score [resample, sentence, head]: each sentence
        with a value counts once in each resample, so a resample's head mean is the mean over sentences of their
        resampled means, as the point is the mean over sentences of their means."""
        s = self._sums
        for name, values in resampled.items():
            present = ~np.isnan(values)  # [resample, sentence, head]
            s[f"wsum/{name}"][:, layer] += np.where(present, values, 0.0).sum(axis=1)  # [resample, head]
            s[f"wcount/{name}"][:, layer] += present.sum(axis=1)
        if not self.shape.categories or categories is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            by_sentence = {name: np.nanmean(resampled[name], axis=2) for name in self.shape.category_scores}
        for k, category in enumerate(categories):
            for name, values in by_sentence.items():  # [resample, sentence]: the mean over heads
                present = ~np.isnan(values[:, k])  # [resample]
                s[f"catwsum/{name}/{category}"][:, layer] += np.where(present, values[:, k], 0.0)
                s[f"catwn/{name}/{category}"][:, layer] += present

    def _wait(self, indices: Sequence[int], stats: dict[str, np.ndarray], categories: Sequence[str] | None) -> None:
        """Put a batch's sentences in the buffer, folding the buffer in first when they would not fit."""
        n = len(indices)
        if n > PENDING_SENTENCES:  # a batch larger than the buffer: in slices, in order
            for start in range(0, n, PENDING_SENTENCES):
                part = slice(start, start + PENDING_SENTENCES)
                self._wait(indices[part], {k: v[part] for k, v in stats.items()},
                           None if categories is None else categories[part])
            return
        s = self._sums
        if int(s["pending/fill"][0]) + n > PENDING_SENTENCES:
            self.flush()
        at = slice(int(s["pending/fill"][0]), int(s["pending/fill"][0]) + n)
        s["pending/index"][at] = indices
        values = np.stack([stats[name] for name in self.shape.names], axis=1)  # [n, score, layer, head]
        present = ~np.isnan(values)
        s["pending/values"][at] = np.where(present, values, 0.0)  # a checkpoint holds finite numbers only
        s["pending/present"][at] = present
        if self.shape.categories and categories is not None:
            s["pending/category"][at] = [1 + self.shape.categories.index(c) for c in categories]
        s["pending/fill"][0] += n

    def flush(self) -> None:
        """Fold the waiting sentences into the resample sums: one product [resample, sentence] x [sentence, ...]."""
        s = self._sums
        fill = int(s["pending/fill"][0])
        if fill == 0:
            return
        r = self.shape.resamples
        weights = poisson_weights(s["pending/index"][:fill].astype(np.int64), r, self.shape.seed)  # [resample, n]
        flat = s["pending/values"][:fill].reshape(fill, -1)  # [n, score x layer x head], 0 where no value
        present = s["pending/present"][:fill].reshape(fill, -1)  # [n, score x layer x head]
        wsum = self._wsum.reshape(r, -1)  # [resample, columns]: a view
        for r0 in range(0, r, FOLD_RESAMPLES):  # a few resamples at a time: a small buffer, the same products
            part = self._product[: min(FOLD_RESAMPLES, r - r0)]  # [resamples, columns]
            wsum[r0 : r0 + len(part)] += np.matmul(weights[r0 : r0 + len(part)], flat, out=part)
        drawn = weights.sum(axis=1)  # [resample]: the count of a column where every sentence has a value
        self._drawn += drawn  # added to every column by `state`; whole numbers, so the order changes nothing
        gaps = present.min(axis=0) < 1  # [score x layer x head]: some sentence has no value there
        if gaps.any():
            counts = self._wcount.reshape(r, -1)  # [resample, columns]: a view
            counts[:, gaps] += weights @ present[:, gaps] - drawn[:, None]  # those without a value
        if self.shape.categories:
            values = np.where(s["pending/present"][:fill] > 0, s["pending/values"][:fill], np.nan)
            self._flush_categories(weights, values, s["pending/category"][:fill].astype(np.int64))
        self._empty_buffer()

    def _flush_categories(self, weights: np.ndarray, values: np.ndarray, category: np.ndarray) -> None:
        """The category sums of the waiting sentences: per score, each layer's mean over heads."""
        s = self._sums
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            means = np.nanmean(values, axis=3)  # [n, score, layer]: the mean over heads
        for position, label in enumerate(self.shape.categories):
            chosen = category == position + 1  # [n]
            if not chosen.any():
                continue
            w = weights[:, chosen]  # [resample, chosen]
            for name in self.shape.category_scores:
                by_sentence = means[chosen, self.shape.names.index(name)]  # [chosen, layer]
                present = ~np.isnan(by_sentence)  # a one-token sentence has no entropy_norm
                value = np.where(present, by_sentence, 0.0)
                s[f"catsum/{name}/{label}"] += value.sum(axis=0)
                s[f"catn/{name}/{label}"] += present.sum(axis=0)
                s[f"catwsum/{name}/{label}"] += w @ value  # [resample, layer]
                s[f"catwn/{name}/{label}"] += w @ present  # [resample, layer]

    def add_tokens(self, ids: Any, received: Any, uniform: Any) -> None:
        """Fold in one batch's mass received per key position, by token id: `ids` [position] (the batch's real
        tokens, flattened), `received` [layer, head, position], `uniform` [layer, position] (torch tensors)."""
        import torch

        ids = ids.cpu()  # [position]
        s = self._sums  # these sums wait for nothing: no fold of the buffer needed
        mass = torch.from_numpy(s["tokmass"]).view(self.shape.vocab, -1)  # [vocab, layer x head]: shares memory
        by_position = received.cpu().double().reshape(mass.shape[1], -1).t().contiguous()  # [position, layer x head]
        mass.index_add_(0, ids, by_position)
        torch.from_numpy(s["tokuniform"]).index_add_(0, ids, uniform.cpu().double().t().contiguous())  # [vocab, layer]
        s["tokcount"] += np.bincount(ids.numpy(), minlength=self.shape.vocab)[: self.shape.vocab]

    def merge(self, other: Accumulator) -> None:
        mine = self.sums
        for key, value in other.sums.items():
            mine[key] += value

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


def _zeroed(shape: tuple[int, ...]) -> np.ndarray:
    """Zeros written out at once, for sums that every fold writes whole (the resample sums): np.zeros leaves the
    pages to be mapped in on first write, one fault at a time."""
    out = np.empty(shape)
    out.fill(0.0)
    return out


def _ratio(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """total / count, NaN where the count is 0 (one division, only where it is defined)."""
    out = np.full(np.broadcast_shapes(total.shape, count.shape), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.divide(total, count, out=out, where=count > 0)
