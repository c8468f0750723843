"""What one layer's attention call asks of the statistics attention: its features (causal, window, soft-cap, sinks,
groups, scale), read from the call and its mask, and what is refused by name, with the config fields no attention
function sees."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

# Arguments a model may pass to its attention function that change nothing here (when unset, or always).
HARMLESS_KWARGS = {"position_ids", "use_cache", "deterministic", "output_attentions", "cache_position",
                   "is_causal", "layer_idx"}  # position_ids: packed sequences would show in the mask, which is probed
IMPLEMENTED_KWARGS = {"sliding_window", "softcap", "s_aux", "sinks"}  # read by layer_features
# Config fields that change a model's attention without reaching the attention function.
REFUSED_CONFIG = {"reorder_and_upcast_attn": "GPT-2's reorder_and_upcast_attn"}


class Unsupported(AttnprobeError):
    """A feature the statistics attention does not implement; `feature` names it."""

    def __init__(self, feature: str) -> None:
        super().__init__(f"attnprobe's statistics attention does not implement {feature}: use --attention eager")
        self.feature = feature


@dataclass(frozen=True)
class LayerFeatures:
    """What one layer's attention computes, as its attention call and its mask show it."""

    causal: bool
    span: int | None  # attention window: causal i - span < j <= i, bidirectional |i - j| <= span; None: all keys
    softcap: float | None  # scores -> softcap * tanh(scores / softcap)
    sinks: bool  # a learned sink logit per head joins the softmax (s_aux)
    groups: int  # query heads per key/value head (1: multi-head; heads: multi-query)
    scale: float  # of the scores: 1/sqrt(head size), or the model's own (`scaling`)
    own_scale: bool = False  # the model's scale is not 1/sqrt(head size) (Gemma's query_pre_attn_scalar, OPT)
    head_size: int = field(default=0, compare=False)  # channels per head of the queries and keys (what a kernel
    # takes, not what the layer computes: left out of equality)


def config_reason(loaded: LoadedModel) -> str | None:
    """What the model's class or config does that no attention function sees (None: nothing)."""
    model, config = loaded.model, loaded.model.config
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return (f"{type(model).__name__}, which computes its attention itself instead of through transformers' "
                "AttentionInterface")
    for key, feature in REFUSED_CONFIG.items():
        if getattr(config, key, None):
            return f"{feature} ({key}={getattr(config, key)!r})"
    return None


def layer_features(
    module: nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, scaling: float | None, dropout: float,
    kwargs: dict[str, Any], problems: list[str] | None,
) -> tuple[LayerFeatures, Tensor | None]:
    """What this attention call asks for, and the learned sink logits [head] if any; refuse what is not
    implemented (or, while discovering, note it in `problems`)."""
    def refuse(feature: str) -> None:
        if problems is None:
            raise Unsupported(feature)
        problems.append(feature)

    shape = getattr(mask, "attnprobe_mask", None)
    if shape is None:
        refuse("an attention mask that did not come from attnprobe's mask function (the model edits or builds "
               "its own mask)")
        shape = (bool(getattr(module, "is_causal", True)), None)
    causal, span = shape
    if kwargs.get("sliding_window") is not None and span is None:
        refuse(f"a sliding window of {kwargs['sliding_window']} that its attention mask does not apply")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.numel() != query.shape[1]):
        refuse("attention sinks that are not one logit per head")
        sinks = None
    softcap = kwargs.get("softcap")
    standard = query.shape[-1] ** -0.5
    if kwargs.get("encoder_hidden_states") is not None:
        refuse("cross-attention (encoder_hidden_states)")
    for name, value in kwargs.items():
        if value is None or value is False or name in HARMLESS_KWARGS or name in IMPLEMENTED_KWARGS:
            continue
        refuse(f"the attention argument {name}={_short(value)}")
    if dropout:
        refuse("attention dropout (the model is training: call model.eval())")
    if query.shape[1] % key.shape[1]:
        refuse(f"{query.shape[1]} query heads over {key.shape[1]} key/value heads")
    features = LayerFeatures(causal=causal, span=span, softcap=None if softcap is None else float(softcap),
                             sinks=sinks is not None, groups=query.shape[1] // max(key.shape[1], 1),
                             scale=float(standard if scaling is None else scaling),
                             own_scale=scaling is not None and not math.isclose(scaling, standard, rel_tol=1e-6),
                             head_size=query.shape[-1])
    return features, sinks


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Tensor) else f"a tensor of shape {tuple(value.shape)}"
    return text if len(text) <= 40 else text[:37] + "..."


def fusable(features: LayerFeatures) -> bool:
    """Whether the fused identity computes this layer exactly: plain softmax attention over every allowed key
    (soft-capping, windows and sinks stay on the blocked path)."""
    return features.span is None and features.softcap is None and not features.sinks
