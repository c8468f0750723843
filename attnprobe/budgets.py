"""Per-layer KV-cache budgets from attention entropy, written as a file NVIDIA kvpress's PerLayerCompressionPress takes.

The idea of entropy-based layer budgets proposed to NVIDIA kvpress (its issue #237, ZigZagKV, and pull request #206,
EntropyAdaptivePress): a layer whose heads attend diffusely (high entropy) spreads what it reads over many keys and
gets more of the cache; a layer whose heads attend sharply (low entropy) gets less. Here the budget is fixed offline
from a run of `attnprobe analyze`, not measured again at each prefill:

    s_l    = the mean over layer l's query heads of heads.csv's `entropy` (nats)
    kept_l = clip(c x s_l, min_kept, 1), with the one c at which the mean of kept_l over the layers is 1 - ratio

`kept_l` is the fraction of the context's KV entries layer l keeps after the prefill (every KV head of the layer
alike); `ratio` the overall compression ratio it was made for (the fraction removed, kvpress's meaning). The mean
over layers of `compression_ratios` (1 - kept_l) is `ratio`, which is what PerLayerCompressionPress reports as its
own compression_ratio. Where clipping takes mass off a layer at 1 (or adds it to a layer at min_kept), the other
layers share it in proportion to their entropy: `allocate` solves for c exactly (the mean is piecewise linear in c).

kvpress 0.5.5 keeps `max(1, int(L x (1 - compression_ratios[l])))` entries of a context of L tokens in layer l
(`kvpress.utils.compute_n_kept`), chosen by the wrapped ScorerPress's scores. `layer_budgets.json` says all of this in
its own fields (`meaning`, `press`, `statistic`), so that the file is read right without this page.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from attnprobe import defaults, limits
from attnprobe.errors import AttnprobeError

FILE_NAME = "layer_budgets.json"
FORMAT = "attnprobe layer budgets"
FORMAT_VERSION = 1
DEFAULT_RATIO, DEFAULT_MIN_KEPT = defaults.BUDGET_RATIO, defaults.BUDGET_MIN_KEPT
STATISTIC = "entropy"  # heads.csv's column the budgets follow
PRESS = "PerLayerCompressionPress"
CLIENT = "kvpress 0.5.5"


def check_settings(ratio: float, min_kept: float) -> None:
    """--compression-ratio in [0, 1] and --min-kept in (0, 1] (kvpress keeps at least one entry of a layer), with
    1 - ratio >= min_kept: the mean kept fraction cannot be below every layer's floor (so a ratio of 1 is refused)."""
    limits.check_real("--compression-ratio", ratio, 0.0, 1.0, DEFAULT_RATIO)
    limits.check_real("--min-kept", min_kept, 0.0, 1.0, DEFAULT_MIN_KEPT, low_open=True)
    if 1.0 - ratio < min_kept - 1e-12:
        raise AttnprobeError(f"--compression-ratio {ratio:g} keeps {1 - ratio:g} of the cache on average, below "
                             f"--min-kept {min_kept:g}, the least any layer keeps: lower one of them")


def allocate(statistic: np.ndarray, target: float, floor: float) -> np.ndarray:
    """[layer] kept fractions clip(c x statistic, floor, 1) whose mean is `target`, for `statistic` [layer] of
    numbers >= 0 and floor <= target <= 1. c is found exactly: the mean is piecewise linear and non-decreasing in c,
    with a break wherever a layer leaves the floor or reaches 1; between the two breaks around `target` it is solved
    for directly. Refused where no c reaches `target` (a layer at 0 stays at the floor)."""
    s = np.asarray(statistic, dtype=np.float64)  # [layer]
    n = s.size
    reachable = float(np.where(s > 0, 1.0, floor).mean())  # the mean as c grows without bound
    if target > reachable + 1e-12:
        raise AttnprobeError(f"the layers' {STATISTIC} reaches a mean kept fraction of at most {reachable:g}, below "
                             f"the {target:g} asked (a layer whose heads all have entropy 0 keeps only --min-kept): "
                             "raise --compression-ratio")
    if target <= floor or not (s > 0).any():
        return np.full(n, floor)
    positive = s[s > 0]
    breaks = np.unique(np.concatenate([floor / positive, 1.0 / positive]))  # c where a layer leaves the floor or 1
    means = np.array([np.clip(c * s, floor, 1.0).mean() for c in breaks])  # non-decreasing
    k = min(int(np.searchsorted(means, target)), len(breaks) - 1)  # the target lies in (breaks[k - 1], breaks[k]]
    low, high = (breaks[k - 1] if k else 0.0), breaks[k]
    scaled = (low + high) / 2 * s  # which layers sit at 1, at the floor, or between, all along that interval
    top, bottom = scaled >= 1.0, scaled <= floor
    free = ~(top | bottom)
    c = (n * target - top.sum() - floor * bottom.sum()) / s[free].sum() if free.any() else high
    return np.clip(c * s, floor, 1.0)  # [layer]


def layer_statistic(heads: pd.DataFrame, layers: int, per_layer: int) -> np.ndarray:
    """[layer] the mean over each layer's query heads of heads.csv's entropy, checked: every head once, each a
    number of 0 or more."""
    if len(heads) != layers * per_layer or not (heads["layer"].lt(layers) & heads["head"].lt(per_layer)).all():
        raise AttnprobeError(f"heads.csv holds {len(heads)} heads, not the model's {layers} layers x {per_layer} "
                             "heads (it is from another run): run `attnprobe analyze` again")
    values = heads[STATISTIC].to_numpy(dtype=float)
    if not (np.isfinite(values) & (values >= 0)).all():
        raise AttnprobeError(f"heads.csv has an {STATISTIC} that is missing or below 0: run `attnprobe analyze` "
                             "again")
    return heads.groupby("layer")[STATISTIC].mean().reindex(range(layers)).to_numpy(dtype=float)  # [layer]


def budget_record(statistic: np.ndarray, kept: np.ndarray, ratio: float, min_kept: float,
                  model: dict[str, Any]) -> dict[str, Any]:
    """layer_budgets.json: the budgets and, in its own fields, what they mean, for which press, the ratio they were
    made for and how they were computed from which statistic."""
    from attnprobe import __version__

    ratios = [float(1.0 - k) for k in kept]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "written_by": "attnprobe export",
        "attnprobe_version": __version__, "model": model,
        "meaning": "kept[l]: the fraction of the context's KV entries layer l keeps after the prefill, every KV head "
                   "of the layer alike; compression_ratios[l] = 1 - kept[l]: the fraction it removes. Their mean "
                   "over the layers is compression_ratio.",
        "press": {"name": PRESS, "client": CLIENT, "argument": "compression_ratios",
                  "usage": f"{PRESS}(press=<a ScorerPress, e.g. KnormPress()>, compression_ratios=compression_ratios)",
                  "kept_entries": "max(1, int(L x (1 - compression_ratios[l]))) of a context of L tokens in each KV "
                                  "head of layer l, the ones the wrapped press scores highest (compute_n_kept)"},
        "compression_ratio": float(ratio), "mean_kept": float(np.mean(kept)), "min_kept": float(min_kept),
        "statistic": {"name": STATISTIC, "from": "heads.csv of `attnprobe analyze` (nats)",
                      "per_layer": "the mean over the layer's query heads",
                      "rule": "kept[l] = clip(c x statistic[l], min_kept, 1), c chosen so that the mean of kept over "
                              "the layers is 1 - compression_ratio: proportional to the layer's mean entropy, what "
                              "clipping takes off or adds shared by the other layers in proportion to theirs"},
        "layers": [{"layer": layer, STATISTIC: float(s), "kept": float(k), "compression_ratio": r}
                   for layer, (s, k, r) in enumerate(zip(statistic, kept, ratios))],
        "kept": [float(k) for k in kept],
        "compression_ratios": ratios,
    }
