"""The one check that arrays are attention maps: every weight a finite probability, every row summing to 1 (at most
1 with a learned sink's share), for stored maps (io reads them) and a checkpoint's (resume). Pure numpy."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class MapFault(NamedTuple):
    """Where maps are not attention maps (map_fault): `bad` marks the entries of `values` at fault, the weights
    themselves ([layer, head, query, key]; `in_rows` False) or else the rows' sums ([layer, head, query])."""

    in_rows: bool
    bad: np.ndarray
    values: np.ndarray


def map_fault(maps: np.ndarray, above: float, tolerance: float, whole_rows: bool = False) -> MapFault | None:
    """The first way `maps` [layer, head, query, key] are not attention maps, or None when they are: a weight that
    is not a finite probability (in [0, 1 + `above`]), else a row that sums to more than 1 + `tolerance` (with
    `whole_rows`, a row further than `tolerance` from 1). The one check of stored maps (map_problem) and of a
    checkpoint's (resume.check_example_maps); rows are summed in the dtype of `maps`."""
    weights = ~np.isfinite(maps) | (maps < 0) | (maps > 1 + above)  # [layer, head, query, key]
    if weights.any():
        return MapFault(False, weights, maps)
    sums = maps.sum(axis=-1)  # [layer, head, query]
    off = (np.abs(sums - 1) > tolerance) if whole_rows else (sums > 1 + tolerance)  # [layer, head, query]
    return MapFault(True, off, sums) if off.any() else None


def map_problem(maps: np.ndarray) -> str | None:
    """Why `maps` [layer, head, query, key] are not attention maps (None when they are): every entry a finite
    probability and every row summing to at most 1 (exactly 1 but for a learned sink's share), to float16's
    error since the files may store float16."""
    maps = np.asarray(maps, dtype=np.float32)
    if maps.size == 0:
        return None
    slack = 4 * float(np.finfo(np.float16).eps) * max(1, maps.shape[-1])  # float16 rounding, summed over a row
    fault = map_fault(maps, slack, slack)
    if fault is None:
        return None
    if fault.in_rows:
        return f"a row of its weights sums to {float(fault.values.max()):.3g}, more than 1"
    if not np.isfinite(maps).all():
        return f"{int((~np.isfinite(maps)).sum())} of its {maps.size} weights are not finite numbers (NaN or inf)"
    low, high = float(maps.min()), float(maps.max())
    return f"its weights run from {low:.3g} to {high:.3g}, not probabilities in [0, 1]"
