"""Sort heads into local / copy / broad / mixed from their statistics (pure pandas)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import pandas as pd

from attnprobe.errors import AttnprobeError


class HeadType(str, Enum):
    LOCAL = "local"
    COPY = "copy"
    BROAD = "broad"
    MIXED = "mixed"


HEAD_TYPES = tuple(t.value for t in HeadType)
RULE_COLUMNS = ("diagonal", "entropy", "entropy_norm")
_TOLERANCE = 1e-9  # so that a value equal to a threshold, up to rounding, counts as reaching it


@dataclass(frozen=True)
class Thresholds:
    """Defaults follow from the metric definitions; the README explains each."""

    local_min_diagonal: float = 0.8  # 80% of the mass within +-2 tokens of the query
    copy_max_entropy: float = math.log(2)  # no more spread than an even split over two tokens
    broad_min_entropy_norm: float = 0.7  # at least 70% of the maximum ln(k) for the row

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_min_diagonal <= 1.0:
            raise AttnprobeError(f"--local-min-diagonal {self.local_min_diagonal} must be between 0 and 1")
        if self.copy_max_entropy < 0.0:
            raise AttnprobeError(f"--copy-max-entropy {self.copy_max_entropy} must be 0 or more (nats)")
        if not 0.0 <= self.broad_min_entropy_norm <= 1.0:
            raise AttnprobeError(
                f"--broad-min-entropy-norm {self.broad_min_entropy_norm} must be between 0 and 1"
            )


def is_local(diagonal: pd.Series, t: Thresholds) -> pd.Series:
    return diagonal >= t.local_min_diagonal - _TOLERANCE


def is_copy(entropy: pd.Series, t: Thresholds) -> pd.Series:
    return entropy <= t.copy_max_entropy + _TOLERANCE


def is_broad(entropy_norm: pd.Series, t: Thresholds) -> pd.Series:
    return entropy_norm >= t.broad_min_entropy_norm - _TOLERANCE


def head_types(heads: pd.DataFrame, thresholds: Thresholds | None = None) -> pd.Series:
    """The rule, in order: local first (a previous-token head is also sharp), then copy, broad, mixed."""
    t = thresholds or Thresholds()
    types = pd.Series(HeadType.MIXED.value, index=heads.index, name="head_type")
    undecided = pd.Series(True, index=heads.index)
    for kind, hit in (
        (HeadType.LOCAL, is_local(heads["diagonal"], t)),
        (HeadType.COPY, is_copy(heads["entropy"], t)),
        (HeadType.BROAD, is_broad(heads["entropy_norm"], t)),
    ):
        chosen = undecided & hit.fillna(False).astype(bool)
        types[chosen] = kind.value
        undecided &= ~chosen
    return types


def classify(heads: pd.DataFrame, thresholds: Thresholds | None = None) -> pd.DataFrame:
    """`layer`, `head`, `head_type` and the values the rule used."""
    result = heads[["layer", "head", *RULE_COLUMNS]].copy()
    result.insert(2, "head_type", head_types(heads, thresholds))
    return result


def counts_per_layer(types: pd.DataFrame) -> pd.DataFrame:
    """Heads of each type in each layer, every type a column (zeros included)."""
    table = pd.crosstab(types["layer"], types["head_type"])
    return table.reindex(columns=list(HEAD_TYPES), fill_value=0)
