"""Sort heads into local / copy / broad / mixed from their statistics (pure pandas)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import pandas as pd

from attnprobe import defaults
from attnprobe.errors import AttnprobeError


class HeadType(str, Enum):
    PREVIOUS = "previous"  # extended scheme: a local head dominated by the previous token
    LOCAL = "local"
    SINK = "sink"  # extended scheme: a copy head whose mass sits mostly on the first token
    COPY = "copy"
    BROAD = "broad"
    MIXED = "mixed"


class Scheme(str, Enum):
    DEFAULT = "default"  # local / copy / broad / mixed
    EXTENDED = "extended"  # adds previous (within local) and sink (within copy)


ALL_TYPES = tuple(t.value for t in HeadType)  # display order
HEAD_TYPES = ("local", "copy", "broad", "mixed")  # the default scheme
RULE_COLUMNS = ("diagonal", "entropy", "entropy_norm")
EXTENDED_COLUMNS = ("first_token", "previous_token")
_TOLERANCE = 1e-9  # so that a value equal to a threshold, up to rounding, counts as reaching it


@dataclass(frozen=True)
class Thresholds:
    """Defaults follow from the metric definitions; the README explains each."""

    local_min_diagonal: float = defaults.LOCAL_MIN_DIAGONAL
    copy_max_entropy: float = defaults.COPY_MAX_ENTROPY
    broad_min_entropy_norm: float = defaults.BROAD_MIN_ENTROPY_NORM
    sink_min_first_token: float = defaults.SINK_MIN_FIRST_TOKEN
    previous_min_previous_token: float = defaults.PREVIOUS_MIN_PREVIOUS_TOKEN

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_min_diagonal <= 1.0:
            raise AttnprobeError(f"--local-min-diagonal {self.local_min_diagonal} must be between 0 and 1")
        if self.copy_max_entropy < 0.0:
            raise AttnprobeError(f"--copy-max-entropy {self.copy_max_entropy} must be 0 or more (nats)")
        for option, value in (
            ("--broad-min-entropy-norm", self.broad_min_entropy_norm),
            ("--sink-min-first-token", self.sink_min_first_token),
            ("--previous-min-previous-token", self.previous_min_previous_token),
        ):
            if not 0.0 <= value <= 1.0:
                raise AttnprobeError(f"{option} {value} must be between 0 and 1")


def is_local(diagonal: pd.Series, t: Thresholds) -> pd.Series:
    return diagonal >= t.local_min_diagonal - _TOLERANCE


def is_copy(entropy: pd.Series, t: Thresholds) -> pd.Series:
    return entropy <= t.copy_max_entropy + _TOLERANCE


def is_broad(entropy_norm: pd.Series, t: Thresholds) -> pd.Series:
    return entropy_norm >= t.broad_min_entropy_norm - _TOLERANCE


def is_sink(first_token: pd.Series, t: Thresholds) -> pd.Series:
    return first_token >= t.sink_min_first_token - _TOLERANCE


def is_previous(previous_token: pd.Series, t: Thresholds) -> pd.Series:
    return previous_token >= t.previous_min_previous_token - _TOLERANCE


def required_columns(scheme: Scheme | str = Scheme.DEFAULT) -> list[str]:
    extra = EXTENDED_COLUMNS if Scheme(scheme) is Scheme.EXTENDED else ()
    return ["layer", "head", *RULE_COLUMNS, *extra]


def head_types(
    heads: pd.DataFrame, thresholds: Thresholds | None = None, scheme: Scheme | str = Scheme.DEFAULT
) -> pd.Series:
    """The rule, in order: local first (a previous-token head is also sharp), then copy, broad, mixed.

    The extended scheme then splits local heads dominated by the previous token off as
    `previous`, and copy heads whose mass sits mostly on the first token off as `sink`.
    """
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
    if Scheme(scheme) is Scheme.EXTENDED:
        types[(types == HeadType.LOCAL.value) & is_previous(heads["previous_token"], t)] = HeadType.PREVIOUS.value
        types[(types == HeadType.COPY.value) & is_sink(heads["first_token"], t)] = HeadType.SINK.value
    return types


def classify(
    heads: pd.DataFrame, thresholds: Thresholds | None = None, scheme: Scheme | str = Scheme.DEFAULT
) -> pd.DataFrame:
    """`layer`, `head`, `head_type` and the values the rule used."""
    result = heads[required_columns(scheme)].copy()
    result.insert(2, "head_type", head_types(heads, thresholds, scheme))
    return result


def counts_per_layer(types: pd.DataFrame) -> pd.DataFrame:
    """Heads of each type in each layer, every type of the scheme a column (zeros included)."""
    table = pd.crosstab(types["layer"], types["head_type"])
    extended = bool(set(table.columns) & {HeadType.SINK.value, HeadType.PREVIOUS.value})
    return table.reindex(columns=list(ALL_TYPES if extended else HEAD_TYPES), fill_value=0)
