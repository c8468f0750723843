"""Bootstrap confidence intervals over sentences (pure numpy).

Every statistic is resampled with the same resamples of sentences, so the intervals of heads,
layers and the early-vs-late gradient all describe the same "another sample of sentences".
"""

from __future__ import annotations

import warnings

import numpy as np

CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000


def resample_counts(n_items: int, resamples: int, seed: int) -> np.ndarray:
    """How often each item is drawn in each resample (with replacement): [resample, item]."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_items, np.full(n_items, 1.0 / n_items), size=resamples).astype(np.float64)


def resampled_means(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Means of `values` [item, ...] under each resample, skipping NaN: [resample, ...]."""
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a score undefined everywhere stays NaN
        low, high = np.nanpercentile(resampled, [tail, 100 - tail], axis=0)
    return low, high
