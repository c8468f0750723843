"""Sort heads into local / copy / broad / mixed, or streaming / full-cache, from their statistics (pure pandas)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from numbers import Integral

import pandas as pd

from attnprobe import defaults, limits
from attnprobe.errors import AttnprobeError
from attnprobe.scores import OUTPUT_NORM


class HeadType(str, Enum):
    PREVIOUS = "previous"  # extended scheme: a local head dominated by the previous token
    LOCAL = "local"
    SINK = "sink"  # extended scheme: a copy head whose mass sits mostly on the first token
    DORMANT = "dormant"  # extended scheme: a sink that writes little (output_norm small against its layer)
    COPY = "copy"
    BROAD = "broad"
    MIXED = "mixed"
    STREAMING = "streaming"  # kv scheme: nearly all mass on the sinks plus the recent window
    FULL_CACHE = "full-cache"  # kv scheme: needs keys outside the sinks and the window (the whole cache)
    RETRIEVAL = "full-cache"  # the name FULL_CACHE had until 2026-11-29: an alias (iteration skips it)


class Scheme(str, Enum):
    DEFAULT = "default"  # local / copy / broad / mixed
    EXTENDED = "extended"  # adds previous (within local), sink (within copy) and dormant (within sink)
    KV = "kv"  # streaming / full-cache, from sink_window


ALL_TYPES = tuple(t.value for t in HeadType)  # display order
HEAD_TYPES = ("local", "copy", "broad", "mixed")  # the default scheme
EXTENDED_TYPES = ("previous", "local", "sink", "dormant", "copy", "broad", "mixed")  # the extended scheme
# The rules read each score over the rows the mask leaves a choice (a row with one valid key has
# entropy 0 and first-token mass 1, a row whose +-2 window holds every valid key has diagonal 1,
# whatever the head does): such rows must never decide a label. entropy_norm and previous_token
# already leave them out.
RULE_COLUMNS = ("diagonal_unforced", "entropy_unforced", "entropy_norm")
EXTENDED_COLUMNS = ("first_token_unforced", "previous_token")
OUTPUT_COLUMN = OUTPUT_NORM  # the extended scheme's dormant rule, where analyze measured it
OUTPUT_RATIO = "output_norm_ratio"  # a head's output_norm over its layer's median (head_types.csv)
KV_TYPES = ("streaming", "full-cache")  # the kv scheme
KV_COLUMNS = ("sink_window",)
_TOLERANCE = 1e-6  # a value equal to a threshold up to float32 rounding (1e-7 relative) counts as reaching it


@dataclass(frozen=True)
class Thresholds:
    """Defaults follow from the metric definitions; the README explains each."""

    local_min_diagonal: float = defaults.LOCAL_MIN_DIAGONAL
    copy_max_entropy: float = defaults.COPY_MAX_ENTROPY
    broad_min_entropy_norm: float = defaults.BROAD_MIN_ENTROPY_NORM
    sink_min_first_token: float = defaults.SINK_MIN_FIRST_TOKEN
    previous_min_previous_token: float = defaults.PREVIOUS_MIN_PREVIOUS_TOKEN
    streaming_min_sink_window: float = defaults.STREAMING_MIN_SINK_WINDOW
    dormant_max_output_ratio: float = defaults.DORMANT_MAX_OUTPUT_RATIO

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_min_diagonal <= 1.0:
            raise AttnprobeError(f"--local-min-diagonal {self.local_min_diagonal} must be between 0 and 1")
        if self.copy_max_entropy < 0.0:
            raise AttnprobeError(f"--copy-max-entropy {self.copy_max_entropy} must be 0 or more (nats)")
        limits.check_real("--copy-max-entropy", self.copy_max_entropy, 0.0, limits.MAX_ENTROPY_NATS)
        for option, value in (
            ("--broad-min-entropy-norm", self.broad_min_entropy_norm),
            ("--sink-min-first-token", self.sink_min_first_token),
            ("--previous-min-previous-token", self.previous_min_previous_token),
            ("--streaming-min-sink-window", self.streaming_min_sink_window),
        ):
            if not 0.0 <= value <= 1.0:
                raise AttnprobeError(f"{option} {value} must be between 0 and 1")
        if not 0.0 <= self.dormant_max_output_ratio <= 1.0:
            raise AttnprobeError(f"--dormant-max-output-ratio {self.dormant_max_output_ratio} must be between 0 and 1 "
                                 "(a share of the layer's median output_norm)")


def is_local(diagonal: pd.Series, t: Thresholds) -> pd.Series:
    return diagonal >= t.local_min_diagonal - _TOLERANCE


def is_copy(entropy: pd.Series, t: Thresholds) -> pd.Series:
    return entropy <= t.copy_max_entropy + _TOLERANCE


def is_broad(entropy_norm: pd.Series, t: Thresholds) -> pd.Series:
    return entropy_norm >= t.broad_min_entropy_norm - _TOLERANCE


def is_sink(first_token: pd.Series, t: Thresholds) -> pd.Series:
    """Strictly more than the threshold: an even split between the first token and another is no sink."""
    return first_token > t.sink_min_first_token + _TOLERANCE


def is_previous(previous_token: pd.Series, t: Thresholds) -> pd.Series:
    return previous_token >= t.previous_min_previous_token - _TOLERANCE


def output_ratio(heads: pd.DataFrame) -> pd.Series:
    """Each head's output_norm over the median output_norm of its layer's heads: 1 is a typical head of the layer,
    0 a head that writes nothing. The median, not the mean: one loud head (SmolLM2's layer 24 has three at over five
    times the others) would make every other head look quiet."""
    norms = heads[OUTPUT_COLUMN]
    return (norms / norms.groupby(heads["layer"]).transform("median")).rename(OUTPUT_RATIO)


def is_dormant(ratio: pd.Series, t: Thresholds) -> pd.Series:
    """Strictly less than the threshold: a sink writing less than this share of its layer's median head."""
    return ratio < t.dormant_max_output_ratio - _TOLERANCE


def has_output_norm(heads: pd.DataFrame) -> bool:
    """Whether heads.csv holds output_norm (analyze measures it where it finds the model's output projection)."""
    return OUTPUT_COLUMN in heads.columns and bool(heads[OUTPUT_COLUMN].notna().any())


def is_streaming(sink_window: pd.Series, t: Thresholds) -> pd.Series:
    return sink_window >= t.streaming_min_sink_window - _TOLERANCE


def required_columns(scheme: Scheme | str = Scheme.DEFAULT) -> list[str]:
    if Scheme(scheme) is Scheme.KV:
        return ["layer", "head", *KV_COLUMNS]
    extra = EXTENDED_COLUMNS if Scheme(scheme) is Scheme.EXTENDED else ()
    return ["layer", "head", *RULE_COLUMNS, *extra]


def kv_head_types(heads: pd.DataFrame, thresholds: Thresholds | None = None) -> pd.Series:
    """`streaming` if sink_window reaches the threshold, else `full-cache` (a missing value included)."""
    if heads["sink_window"].isna().all():
        raise AttnprobeError(
            "sink_window is empty: no sequence was longer than the sink + window tokens (or the model is an "
            "encoder); analyze longer documents (e.g. --split paragraphs or --split file) or lower --window"
        )
    streaming = is_streaming(heads["sink_window"], thresholds or Thresholds()).fillna(False).astype(bool)
    types = pd.Series(HeadType.FULL_CACHE.value, index=heads.index, name="head_type")
    types[streaming] = HeadType.STREAMING.value
    return types


def head_types(
    heads: pd.DataFrame, thresholds: Thresholds | None = None, scheme: Scheme | str = Scheme.DEFAULT
) -> pd.Series:
    """The rule, in order: local first (a previous-token head is also sharp), then copy, broad, mixed.

    The extended scheme then splits local heads dominated by the previous token off as
    `previous`, copy heads whose mass sits mostly on the first token off as `sink`, and, where heads.csv has
    output_norm, sinks that write little (output_ratio below the threshold) off as `dormant`.
    The kv scheme is separate: `streaming` or `full-cache` from sink_window alone.
    """
    if Scheme(scheme) is Scheme.KV:
        return kv_head_types(heads, thresholds)
    t = thresholds or Thresholds()
    types = pd.Series(HeadType.MIXED.value, index=heads.index, name="head_type")
    undecided = pd.Series(True, index=heads.index)
    for kind, hit in (
        (HeadType.LOCAL, is_local(heads["diagonal_unforced"], t)),
        (HeadType.COPY, is_copy(heads["entropy_unforced"], t)),
        (HeadType.BROAD, is_broad(heads["entropy_norm"], t)),
    ):
        chosen = undecided & hit.fillna(False).astype(bool)
        types[chosen] = kind.value
        undecided &= ~chosen
    if Scheme(scheme) is Scheme.EXTENDED:
        types[(types == HeadType.LOCAL.value) & is_previous(heads["previous_token"], t)] = HeadType.PREVIOUS.value
        types[(types == HeadType.COPY.value) & is_sink(heads["first_token_unforced"], t)] = HeadType.SINK.value
        if has_output_norm(heads):
            quiet = is_dormant(output_ratio(heads), t).fillna(False).astype(bool)
            types[(types == HeadType.SINK.value) & quiet] = HeadType.DORMANT.value
    return types


def classify(
    heads: pd.DataFrame,
    thresholds: Thresholds | None = None,
    scheme: Scheme | str = Scheme.DEFAULT,
    kv_heads: int | None = None,
) -> pd.DataFrame:
    """`layer`, `head`, `head_type` and the values the rule used.

    With the kv scheme and `kv_heads` (KV heads per layer), also `kv_head`, the KV head each
    query head reads (GQA / repeat_kv: head h uses h // (heads per layer // kv_heads)), and
    `kv_head_streaming`, True when every query head sharing that KV head in that layer is streaming.
    """
    if kv_heads is not None and Scheme(scheme) is not Scheme.KV:
        raise AttnprobeError(f"kv_heads {kv_heads} applies only to the kv scheme: use --scheme kv or leave it out")
    result = heads[required_columns(scheme)].copy()
    result.insert(2, "head_type", head_types(heads, thresholds, scheme))
    if Scheme(scheme) is Scheme.EXTENDED and has_output_norm(heads):
        result[OUTPUT_COLUMN] = heads[OUTPUT_COLUMN]
        result[OUTPUT_RATIO] = output_ratio(heads)
    if kv_heads is None:
        return result
    result["kv_head"] = result["head"] // (_heads_per_layer(heads) // _check_kv_heads(kv_heads, heads))
    streaming = result["head_type"] == HeadType.STREAMING.value
    result["kv_head_streaming"] = streaming.groupby([result["layer"], result["kv_head"]]).transform("all")
    return result


def _heads_per_layer(heads: pd.DataFrame) -> int:
    """Query heads in each layer; every layer must have the same number."""
    sizes = heads.groupby("layer")["head"].nunique()
    if sizes.nunique() != 1:
        raise AttnprobeError(f"layers have {sorted(set(sizes))} heads, not one number: run `attnprobe analyze` again")
    return int(sizes.iloc[0])


def _check_kv_heads(kv_heads: int, heads: pd.DataFrame) -> int:
    n = _heads_per_layer(heads)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, Integral) or kv_heads < 1 or n % kv_heads:
        raise AttnprobeError(f"kv_heads {kv_heads} must divide the {n} query heads per layer: use the model's value")
    return int(kv_heads)


def counts_per_layer(types: pd.DataFrame) -> pd.DataFrame:
    """Heads of each type in each layer, every type of the scheme a column (zeros included); `dormant` only where
    the dormant rule could run (types with output_norm_ratio)."""
    table = pd.crosstab(types["layer"], types["head_type"])
    if set(table.columns) & set(KV_TYPES):
        return table.reindex(columns=list(KV_TYPES), fill_value=0)
    extended = bool(set(table.columns) & {HeadType.SINK.value, HeadType.PREVIOUS.value, HeadType.DORMANT.value})
    if not extended:
        return table.reindex(columns=list(HEAD_TYPES), fill_value=0)
    dormant = OUTPUT_RATIO in types.columns or HeadType.DORMANT.value in table.columns  # decided, or not decidable
    return table.reindex(columns=[t for t in EXTENDED_TYPES if dormant or t != HeadType.DORMANT.value], fill_value=0)


def kv_cache_estimate(
    types: pd.DataFrame,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    sink: int,
    window: int,
    lengths: dict[str, int],
) -> dict:
    """KV-cache bytes at each named length, full versus keeping only sink + window tokens in streaming KV heads.

    `types` is `classify(..., scheme="kv", kv_heads=...)`. Assumes keys and values of every layer are
    cached in the model's dtype (`dtype_bytes` each, no quantisation), a streaming KV head keeps exactly
    min(T, sink + window) tokens and every other KV head keeps all T. It counts attention mass on the
    kept tokens, not loss of accuracy: check accuracy before relying on the saving.
    """
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise AttnprobeError(f"{name} {value} must be 1 or more: use the model's value")
    if sink < 0 or window < 0:
        raise AttnprobeError(f"sink {sink} and window {window} must be 0 or more: use the values of heads.csv")
    if "kv_head_streaming" not in types.columns:
        raise AttnprobeError("types has no kv_head_streaming column: classify with scheme kv and kv_heads")
    groups = types.groupby(["layer", "kv_head"])["kv_head_streaming"].all()
    if len(groups) != layers * kv_heads:
        raise AttnprobeError(
            f"types has {len(groups)} KV heads, not layers {layers} x kv_heads {kv_heads}: use the model's values"
        )
    bytes_per_head_token = head_dim * 2 * dtype_bytes  # a key and a value
    streaming_kv = int(groups.sum())
    streaming_query = int((types["head_type"] == HeadType.STREAMING.value).sum())
    return {
        "assumptions": {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim),
                        "dtype_bytes": int(dtype_bytes), "sink": int(sink), "window": int(window)},
        "bytes_per_token_full": int(layers * kv_heads * bytes_per_head_token),
        "counts": {"query_heads_streaming": streaming_query, "query_heads_full_cache": len(types) - streaming_query,
                   "kv_heads_streaming": streaming_kv, "kv_heads_total": len(groups)},
        "lengths": {name: _length_estimate(name, tokens, len(groups), streaming_kv, bytes_per_head_token, sink + window)
                    for name, tokens in lengths.items()},
    }


def _length_estimate(name: str, tokens: int, total_kv: int, streaming_kv: int, per_token: int, kept: int) -> dict:
    if tokens < 1:
        raise AttnprobeError(f"length {name} = {tokens} must be 1 token or more")
    full = int(total_kv * tokens * per_token)
    streaming = int((streaming_kv * min(tokens, kept) + (total_kv - streaming_kv) * tokens) * per_token)
    return {"tokens": int(tokens), "full_bytes": full, "streaming_bytes": streaming, "ratio": streaming / full}
