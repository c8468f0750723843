"""Bootstrap confidence intervals over sentences (pure numpy): the Poisson bootstrap.

Each sentence gets, for each of the R resamples, an independent Poisson(1) weight: how often it is
drawn into that resample (Hanley & MacGibbon 2006; Chamandy et al. 2012). The weights come from
(seed, the sentence's index in the corpus) alone, so they, and the intervals, do not depend on
batch size, batch order or how many processes share the corpus, and a resample's weighted sums
can be accumulated as sentences stream past. Every statistic uses the same weights, so the
intervals of heads, layers, categories and the early-vs-late gradient all describe the same
"another sample of sentences".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np

CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000


def poisson_weights(indices: Iterable[int], resamples: int, seed: int) -> np.ndarray:
    """Poisson(1) weights [resample, item] for the items with these corpus indices.

    Column k depends only on (seed, indices[k]): the same sentence gets the same weights whatever
    else is in the batch or the shard.
    """
    columns = [np.random.default_rng([seed, int(i)]).poisson(1.0, resamples) for i in indices]
    return np.array(columns, dtype=np.float64).reshape(-1, resamples).T  # [resample, item]


def resampled_means(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Weighted means of `values` [item, ...] under each resample's weights [resample, item], skipping NaN.

    A resample whose items with a value all have weight 0 gives NaN, which `interval` skips.
    """
    flat = values.reshape(values.shape[0], -1)  # [item, k]
    present = ~np.isnan(flat)  # [item, k]
    totals = counts @ np.where(present, flat, 0.0)  # [resample, k]
    weights = counts @ present  # [resample, k]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = totals / weights  # NaN where a resample drew no item with a value
    return means.reshape((counts.shape[0], *values.shape[1:]))


def interval(resampled: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the resample axis (axis 0)."""
    tail = (1.0 - confidence) / 2 * 100
    if not np.isnan(resampled).any():  # the same percentiles, without nanpercentile's NaN handling (2.5x faster)
        low, high = np.percentile(resampled, [tail, 100 - tail], axis=0)
        return low, high
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a score undefined everywhere stays NaN
        low, high = np.nanpercentile(resampled, [tail, 100 - tail], axis=0)
    return low, high
