"""attnprobe's own attention function: the exact eager result, in blocks of query rows, with statistics.

It is registered with transformers' `AttentionInterface` (and a mask function with
`AttentionMaskInterface`) under the name `attnprobe_stats`. Per layer it receives query, key, value
and the padding mask, and for each block of query rows computes the scores against the keys the
block may see, masks them, takes the softmax in float32, folds the block's row statistics into
per-sentence sums, and multiplies the block by the values. No [n, n] map exists anywhere: peak extra
memory is one block, sized from a memory budget.

The function grows by features, never by model names. It implements grouped- and multi-query heads,
the model's own `scaling`, sliding-window (local) attention, causal or bidirectional (a windowed block
computes only the keys inside its window), attention-logit soft-capping (`softcap`) and learned
attention sinks (`s_aux`). The mask is read from the mask function transformers hands over: it is
evaluated on probe positions and must be causal, bidirectional, or either within a window, or it is
refused. Every other argument a model passes is refused by name when it is set, with one line, never
approximated; `discover` runs a two-token pass to learn each layer's features before a run.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnprobe import defaults, values
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import (
    DIAGONAL_WINDOW,
    RECENT_WINDOW,
    SINK_TOKENS,
    RowGeometry,
    RowMasses,
    SentenceSums,
    TokenClasses,
    TokenPairs,
    block_row_stats,
    received,
    row_geometry,
    row_stats,
    split_stacked,
    token_pairs,
    token_stats,
    value_weighted,
)
from attnprobe.model import LastLayerDone, LoadedModel, attention_modules, forward_kwargs, using_attention
from attnprobe.scores import OUTPUT_NORM

NAME = "attnprobe_stats"
DEFAULT_BUDGET_MIB = defaults.BLOCK_MIB
FUSED_MIN_TOKENS = 512  # --attention auto: the fused kernel from this length on (both paths are exact)
UNDERFLOW_GAP = 60.0  # _sink_window: ln of the largest factor a view may put on the first view's weights (below 1e-38)
TEMPORARIES = 6  # float32 tensors of a block's size alive at once: scores, softmax, statistics' temporaries

# Arguments a model may pass to its attention function that change nothing here (when unset, or always).
HARMLESS_KWARGS = {"position_ids", "use_cache", "deterministic", "output_attentions", "cache_position",
                   "is_causal", "layer_idx"}  # position_ids: packed sequences would show in the mask, which is probed
IMPLEMENTED_KWARGS = {"sliding_window", "softcap", "s_aux", "sinks"}  # read by layer_features
# Config fields that change a model's attention without reaching the attention function.
REFUSED_CONFIG = {"reorder_and_upcast_attn": "GPT-2's reorder_and_upcast_attn"}

LayerSums = Callable[[int, SentenceSums, Tensor | None], None]  # layer, sums, example maps [head, q, k] or None


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


@dataclass
class Batch:
    """What the attention function needs for the batch being run, and where its results go."""

    layers: dict[int, int]  # id(attention module) -> layer index
    last_layer: int
    special: Tensor | None  # [batch, seq] bool: special-token positions
    sink: int
    window: int
    bins: int  # position bins to keep
    budget_bytes: int
    block_rows: int | None  # fixed block size, overriding the budget (tests)
    example: tuple[int, int] | None  # (row in the batch, tokens kept) whose maps to hand back
    on_layer: LayerSums
    features: dict[int, LayerFeatures] = field(default_factory=dict)  # filled as the layers run
    discovering: list[str] | None = None  # discover(): collect what is not implemented instead of refusing
    fused: int | None = None  # through the fused kernel: layers it computes exactly, in batches this long or longer
    projections: list[nn.Module] | None = None  # per layer, the output projection: also the value-weighted scores
    keep_rows: bool = False  # hand every row's values back too (SentenceSums.rows), for the block bootstrap
    tokens: TokenClasses | None = None  # token ids and punctuation: punctuation, duplicate and the mass received
    kept: dict[tuple, Any] = field(default_factory=dict)  # what every layer shares: `padding`, `block`
    ran: set[str] = field(default_factory=set)  # the kernels the layers ran: "fused", "blocked"

    def padding(self, padding: Tensor | None, batch: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The checked right-padded mask [batch, key] and the lengths [batch] of a layer's padding mask: checked
        and counted by the first layer that gets this mask, the others reuse them."""
        found = self.kept.get(("padding", id(padding), batch, n))
        if found is None or found[0] is not padding:  # the mask itself is kept, so its id is not reused
            real = _right_padded(padding, batch, n, device)  # [batch, key]
            found = self.kept["padding", id(padding), batch, n] = (padding, real, real.sum(dim=-1))
        return found[1], found[2]

    def block(self, real: Tensor, lengths: Tensor, q0: int, q1: int, k0: int, k1: int, causal: bool,
              span: int | None) -> Block:
        """The Block of query rows q0 .. q1 - 1 and keys k0 .. k1 - 1 under the mask `real` (one of `padding`'s).

        Kept for the other layers only when the block is the whole sequence (short sentences, where making it costs
        as much as using it): a long sequence's blocks together would hold [rows, keys] masks of every block."""
        key = ("block", id(real), q0, q1, k0, k1, causal, span)
        found = self.kept.get(key)
        if found is None:
            pairs = None if self.tokens is None else token_pairs(self.tokens.ids, q0, q1 - q0, k0, k1 - k0, lengths,
                                                                  causal, span)
            found = Block(row_geometry(q0, q1 - q0, lengths, causal, span),
                          mask_plan(real, q0, q1 - q0, k1 - k0, causal, k0, span), pairs)
            if q0 == 0 and q1 == real.shape[-1]:
                self.kept[key] = found
        return found


@dataclass
class Block:
    """What the statistics of a block of query rows share across the layers of a batch (Batch.block): their
    geometry, the mask of the block's scores and the keys that hold each row's token."""

    rows: RowGeometry
    mask: MaskPlan
    pairs: TokenPairs | None  # None without token classes


@dataclass
class MaskPlan:
    """Which scores of a block mask_block hides: a strip of columns some row may not see, and padded keys."""

    strip: tuple[int, int, Tensor] | None  # (lo, hi, hidden [rows, hi - lo] bool), None: every row sees every key
    padded: Tensor | None  # [batch, 1, 1, keys] bool: padded keys, None when every key is real


_ACTIVE: ContextVar[Batch | None] = ContextVar("attnprobe_batch", default=None)


@dataclass(frozen=True)
class Discovery:
    """Whether the statistics attention runs a model exactly; per layer, what it computes."""

    features: tuple[LayerFeatures, ...] | None  # None where the model's attention could not be read
    reason: str | None  # the first feature not implemented; None when blocked attention applies
    kv_heads: int = 0  # key/value heads per layer

    def spans(self, layers: int) -> list[int | None]:
        """Each layer's attention window (None: every key), for the eager path's counts too."""
        return [f.span for f in self.features] if self.features else [None] * layers

    def record(self) -> dict[str, Any]:
        """The features used, for run.json: what varies by layer is listed by layer."""
        if not self.features:
            return {}
        windows = sorted({f.span for f in self.features if f.span is not None})
        groups = self.features[0].groups
        return {
            "causal": self.features[0].causal,
            "query_heads_per_kv_head": groups,
            "sliding_window": {str(w): [k for k, f in enumerate(self.features) if f.span == w] for w in windows}
            or None,
            "softcap": next((f.softcap for f in self.features if f.softcap is not None), None),
            "attention_sinks": any(f.sinks for f in self.features),
            "scale": sorted({f.scale for f in self.features}),
        }

    def fused_layers(self, device: torch.device | None = None) -> list[int]:
        """The layers the fused path computes on `device` (the others run blocked)."""
        if device is not None and device.type not in KERNELS:
            return []
        return [k for k, f in enumerate(self.features or ()) if fusable(f)]

    def labels(self) -> list[str]:
        """Short names of the features beyond plain multi-head attention (the README's table)."""
        if not self.features:
            return []
        first = self.features[0]
        out = []
        if first.groups > 1:
            out.append("MQA" if self.kv_heads == 1 else "GQA")
        if any(f.span is not None for f in self.features):
            out.append("window" if all(f.span is not None for f in self.features) else "window (some layers)")
        if any(f.softcap is not None for f in self.features):
            out.append("soft-cap")
        if any(f.sinks for f in self.features):
            out.append("sinks")
        if any(f.own_scale for f in self.features):
            out.append("own scale")
        return out


_DISCOVERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Discovery


def discover(loaded: LoadedModel) -> Discovery:
    """Run two tokens through the model under the statistics attention, and learn from each layer's call and
    mask what it computes, or the first thing it does that the function does not implement (cached)."""
    model = loaded.model
    if model in _DISCOVERED:
        return _DISCOVERED[model]
    reason = config_reason(loaded)
    found = Discovery(None, reason)
    if reason is None:
        found = _discover(loaded)
    _DISCOVERED[model] = found
    return found


def unsupported(loaded: LoadedModel) -> str | None:
    """Why the statistics function cannot run this model exactly, or None when it can."""
    return discover(loaded).reason


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


def _discover(loaded: LoadedModel) -> Discovery:
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = torch.tensor([[1 % vocab, 2 % vocab]], device=loaded.device)  # [1, 2]
    problems: list[str] = []
    features: dict[int, LayerFeatures] = {}

    def keep(_layer: int, _sums: SentenceSums, _maps: Tensor | None) -> None:
        pass

    try:
        with _switched(loaded):
            run_batch(loaded, ids, torch.ones_like(ids), keep, discovering=problems, features=features)
    except Unsupported as err:
        problems.append(err.feature)
    except AttnprobeError as err:
        problems.append(str(err).split(": use --attention")[0])
    layers = len(attention_modules(loaded.model))
    complete = len(features) == layers
    return Discovery(tuple(features[k] for k in range(layers)) if complete else None,
                     problems[0] if problems else None, loaded.num_kv_heads)


def block_size(batch: int, heads: int, keys: int, budget_bytes: int, extra: int | None = None) -> int:
    """Query rows per block so that a block's temporaries fit the budget; at least 1.

    A block sees `keys` keys, or, in a windowed layer, its own rows plus `extra` more (then r (r + extra) must fit).
    """
    unit = batch * heads * 4 * TEMPORARIES  # bytes per (row, key)
    if extra is None:
        return max(1, budget_bytes // max(unit * keys, 1))
    cells = budget_bytes // max(unit, 1)  # r * (r + extra) <= cells
    rows = int((-extra + math.sqrt(extra * extra + 4 * cells)) / 2)
    return max(1, min(rows, keys))


def window_reach(causal: bool, span: int | None) -> tuple[int, int]:
    """How far before and after its own position a row of a windowed layer sees."""
    if span is None:
        raise ValueError("no window")
    return (span - 1, 0) if causal else (span, span)


def block_keys(q0: int, q1: int, n: int, causal: bool, span: int | None) -> tuple[int, int]:
    """The keys [k0, k1) the query rows [q0, q1) may see."""
    k1 = q1 if causal else n
    if span is None:
        return 0, k1
    before, after = window_reach(causal, span)  # a causal row sees nothing after itself: after = 0
    return max(0, q0 - before), min(k1, q1 + after)


def probe_mask(mask_function: Callable | None, span: int | None) -> tuple[bool, int | None]:
    """(causal, window) of a transformers mask function, read by evaluating it on probe positions.

    Accepted: causal (j <= i), bidirectional, and either within a window of `span` (the `local_size`
    transformers passes with it). Anything else (chunked, packed, image-token or custom masks) is refused.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function in (causal_mask_function, None):
        return True, None
    if mask_function is bidirectional_mask_function:
        return False, None
    w = span or 0
    points = sorted({*range(6), *(x for base in (w, 2 * w) for x in range(base - 2, base + 3) if x >= 0)})
    grid = torch.tensor(points)  # [m]
    q, k = grid[:, None], grid[None, :]  # [m, 1], [1, m]
    zero = torch.zeros_like(q)
    try:
        got = torch.as_tensor(mask_function(zero, zero, q, k)).bool().expand(len(points), len(points))  # [m, m]
    except Exception as err:  # a mask function that needs more than positions (padding, token types, ...)
        raise Unsupported(f"a custom attention mask ({type(err).__name__} when probed)") from None
    candidates = [(True, None), (False, None)] + ([(True, span), (False, span)] if span else [])
    for causal, window in candidates:
        expected = (k <= q) if causal else torch.ones_like(got)
        if window is not None:
            expected = expected & ((k > q - window) if causal else ((q - k).abs() <= window))
        if torch.equal(got, expected.expand_as(got)):
            return causal, window
    raise Unsupported("this model's attention mask (chunked, packed or custom: neither causal nor bidirectional, "
                      "with or without a sliding window)")


def stats_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable | None = None, attention_mask: Tensor | None = None, local_size: int | None = None,
    device: Any = None, **_: Any,
) -> Tensor:
    """The mask handed to the attention function: the [batch, key] padding mask, never [n, n], tagged with what
    the mask function asks for (`attnprobe_mask`: causal, window)."""
    if q_offset or kv_offset or q_length != kv_length:
        raise Unsupported("a KV cache (pass use_cache=False)")
    shape = probe_mask(mask_function, local_size)
    if attention_mask is None:
        real = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)  # [batch, key]
    else:
        real = attention_mask[:, -kv_length:].bool()  # [batch, key]
    real.attnprobe_mask = shape
    return real


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
                             own_scale=scaling is not None and not math.isclose(scaling, standard, rel_tol=1e-6))
    return features, sinks


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Tensor) else f"a tensor of shape {tuple(value.shape)}"
    return text if len(text) <= 40 else text[:37] + "..."


def stats_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """Eager attention, block by block; statistics go to the active batch. Returns (output, None)."""
    batch_info = _ACTIVE.get()
    if batch_info is None:
        raise AttnprobeError("attnprobe's statistics attention runs only inside attnprobe.kernel.run_batch")
    features, sinks = layer_features(module, query, key, attention_mask, scaling, dropout, kwargs,
                                     batch_info.discovering)
    layer = batch_info.layers[id(module)]
    batch_info.features[layer] = features
    need_output = layer != batch_info.last_layer
    projections = batch_info.projections
    factors = None if projections is None else values.head_factors(projections[layer], query.shape[1])
    if batch_info.fused is not None and query.shape[2] >= batch_info.fused and fusable(features) \
            and query.device.type in KERNELS:
        sums, example, output = fused_attend(query, key, value, attention_mask, scaling, features.causal, batch_info,
                                             need_output=need_output, factors=factors)
        batch_info.ran.add("fused")
    else:
        batch_info.ran.add("blocked")
        sums, example, output = attend(query, key, value, attention_mask, scaling, features.causal, batch_info,
                                       need_output=need_output, span=features.span, softcap=features.softcap,
                                       sinks=sinks, factors=factors)
    batch_info.on_layer(layer, sums, example)
    if isinstance(sums, ReceivedOnRead):
        sums.forget()  # received is computed only if the callback read it
    if layer == batch_info.last_layer:
        raise LastLayerDone  # nothing after the last attention can change a statistic
    return output, None


def attend(
    query: Tensor, key: Tensor, value: Tensor, padding: Tensor | None, scaling: float | None, causal: bool,
    info: Batch, need_output: bool = True, span: int | None = None, softcap: float | None = None,
    sinks: Tensor | None = None, factors: Tensor | None = None,
) -> tuple[SentenceSums, Tensor | None, Tensor]:
    """The exact eager attention output [batch, query, head, dim] and the statistics of every row.

    `span`: the layer's attention window (None: every key); `softcap`: scores -> softcap * tanh(scores /
    softcap); `sinks` [head]: a learned logit per head that joins each row's softmax and takes its share.
    `factors` [head, k, dim] (values.head_factors): also the value-weighted statistics, from the same scores
    (weighted_block; the sink, which moves nothing, is left out), written next to the map along the batch axis of
    one buffer so that one pass of the block statistics computes both, and `output_norm` from the block's output.
    """
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query heads sharing one KV head (grouped-query attention)
    scale = dim**-0.5 if scaling is None else scaling
    real, lengths = info.padding(padding, batch, n, query.device)  # [batch, key], [batch]: right padding
    keys_t = key.transpose(-1, -2)  # [batch, kv_head, dim, key]: a view
    output = query.new_empty(batch, n, heads, dim)  # [batch, query, head, dim]
    extra = None if span is None else sum(window_reach(causal, span))
    stacked = heads if factors is None else 2 * heads  # the value-weighted map doubles a block's statistics
    rows = info.block_rows or block_size(batch, stacked, n, info.budget_bytes, extra)
    sink_logits = None if sinks is None else sinks.float().view(1, heads, 1, 1)  # [1, head, 1, 1]
    norms = None if factors is None else values.key_norms(value, factors)  # [batch, head, key]: |f_h(x_j)|
    bias = None if norms is None else values.log_weights(norms)  # [batch, head, key]
    sums = SentenceSums(rows={} if info.keep_rows else None)
    taken = None if info.tokens is None else torch.zeros(batch, heads, n, device=query.device)  # [b, h, key]
    example = _example_buffer(info, heads, query.device)  # [head, q, k] or None
    for q0 in range(0, n, rows):
        q1 = min(n, q0 + rows)
        k0, k1 = block_keys(q0, q1, n, causal, span)
        block = info.block(real, lengths, q0, q1, k0, k1, causal, span)
        q_block = query[:, :, q0:q1].reshape(batch, kv_heads, groups * (q1 - q0), dim)  # [batch, kv, g*r, dim]
        scores = (q_block @ keys_t[..., k0:k1]).mul_(scale)  # [batch, kv, g*r, keys]: scaled in the model's dtype
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap  # [batch, kv, g*r, keys], as eager rounds it
        scores = scores.view(batch, heads, q1 - q0, k1 - k0).float()  # [batch, head, r, keys]
        apply_mask(scores, block.mask)
        both = None if bias is None else scores.new_empty(batch, 2 * heads, q1 - q0, k1 - k0)  # [b, 2 x h, r, keys]
        p, entropy, log_p = softmax_with_entropy(  # [b, h, r, keys] (both's first heads), [b, h, r], [b, h, r, keys]
            scores, sink_logits, None if both is None else both[:, :heads])
        special = None if info.special is None else info.special[:, :k1]  # [batch, keys up to k1]
        if both is None:
            stats = block_row_stats(p, q0, lengths, causal, special, info.sink, info.window, entropy, k0=k0,
                                    span=span, tokens=info.tokens, geometry=block.rows, pairs=block.pairs)
        else:  # the map and its value-weighted map stacked on the head axis in one buffer, no cat
            weighted_entropy = weighted_block(p, log_p, norms[:, :, k0:k1], bias[:, :, k0:k1], both[:, heads:])
            stats = split_stacked(block_row_stats(both, q0, lengths, causal, special, info.sink, info.window,
                                                  torch.cat((entropy, weighted_entropy), dim=1), k0=k0, span=span,
                                                  geometry=block.rows), heads)
            if info.tokens is not None:  # of the map only: the stack's second half would be thrown away
                stats.update(token_stats(p, info.tokens, q0, lengths, causal, k0, span, block.pairs))
        del scores
        if taken is not None:
            taken[:, :, k0:k1] += received(p, q0, lengths)  # [batch, head, keys]
        if example is not None and q0 < example.shape[1] and k0 < example.shape[1]:
            row, kept = info.example
            end, last = min(q1, kept), min(k1, kept)
            example[:, q0:end, k0:last] = p[row, :, : end - q0, : last - k0].float()  # [head, q, k]
        if need_output or factors is not None:
            weights = p.to(value.dtype).view(batch, kv_heads, groups * (q1 - q0), k1 - k0)  # [batch, kv, g*r, keys]
            out = (weights @ value[:, :, k0:k1]).view(batch, heads, q1 - q0, dim)  # [batch, head, r, dim]
            if factors is not None:
                stats[OUTPUT_NORM] = values.head_norms(out, factors)  # [batch, head, r]
            output[:, q0:q1] = out.transpose(1, 2)  # [batch, r, head, dim]
        sums.add(stats, q0, lengths, info.bins, block.rows)
        del both, p
    sums.received = taken
    return sums, example, output


def weighted_block(p: Tensor, log_p: Tensor, norms: Tensor, bias: Tensor, out: Tensor) -> Tensor:
    """The value-weighted block a_ij w_j / sum_k a_ik w_k (w_j = |f_h(x_j)|, `norms` [batch, head, keys]; `bias` its
    log, values.log_weights), written to `out` [batch, head, r, keys]; returns each row's entropy [batch, head, r].
    NaN in a row whose weights w_j a_ij are all 0.

    From softmax_with_entropy's p and ln p (edited here): ln a~_ij = ln p_ij + ln w_j - ln z_i with
    z_i = sum_k a_ik w_k, and H~_i = ln z_i - sum_j a~_ij (ln p_ij + ln w_j): products and sums, no second
    exponential. A row whose every key of norm above 0 has a weight a_ij below float32's range (1e-38) would be NaN
    here; the fused path, in log space, still gives it.
    """
    weighted = torch.mul(p, norms[:, :, None, :], out=out)  # [batch, head, r, keys]
    z = weighted.sum(dim=-1)  # [batch, head, r]
    weighted.div_(z[..., None])  # 0/0 = NaN in a row with nothing to weigh
    logits = log_p.add_(bias[:, :, None, :])  # [batch, head, r, keys]: ln p + ln w; masked keys stay near -3.4e38
    return z.log() - (weighted * logits).sum(dim=-1)  # [batch, head, r]


def fusable(features: LayerFeatures) -> bool:
    """Whether the fused identity computes this layer exactly: plain softmax attention over every allowed key
    (soft-capping, windows and sinks stay on the blocked path)."""
    return features.span is None and features.softcap is None and not features.sinks


def _right_padded(padding: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor:
    real = torch.ones(batch, n, dtype=torch.bool, device=device) if padding is None else padding  # [batch, key]
    if real.dim() != 2 or real.shape[-1] != n or bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise AttnprobeError("attnprobe's statistics attention takes a right-padded [batch, key] mask "
                             f"(got shape {tuple(real.shape)}, or padding on the left): pad on the right")
    return real


def flash(query: Tensor, key: Tensor, value: Tensor, causal: bool, additive: Tensor | None,
          scale: float) -> tuple[Tensor, Tensor]:
    """The fused attention kernel, the one seam every fused call goes through: (output [batch, head, query, value
    width], logsumexp of each row, float32 [batch, head, query]).

    `query` and `key` share a head size; `value` may be wider (the statistics' value channels) or narrower. Every
    tensor has one head per query head (the callers repeat a grouped key/value head). `additive` [batch, head or 1,
    1, key]: a per-key term added to the scores (0/-inf for padding, a bias), or None. The device's FusedKernel
    (KERNELS) runs it; a kernel that needs one head size for Q, K and V gets the narrower ones padded with zero
    channels (zeros in Q leave the scores alone), and its output cut back to the value's width.
    """
    found = KERNELS.get(query.device.type)
    if found is None:
        raise AttnprobeError(f"the fused path runs on {', '.join(KERNELS)}, not {query.device.type}: use "
                             "--attention blocked")
    width = value.shape[-1]
    if found.one_head_size and key.shape[-1] != width:
        wide = max(key.shape[-1], width)
        query, key, value = (x if x.shape[-1] == wide else _widened(x, wide) for x in (query, key, value))
        out, lse = found.call(query, key, value, causal, additive, scale)  # [batch, head, q, wide], [batch, head, q]
        return out[..., :width], lse
    return found.call(query, key, value, causal, additive, scale)


def _cpu_flash(query: Tensor, key: Tensor, value: Tensor, causal: bool, additive: Tensor | None,
               scale: float) -> tuple[Tensor, Tensor]:
    """aten's flash attention for CPU (Q, K and V of one head size). `additive` is made contiguous: the kernel
    reads a mask whose keys are not adjacent in memory (a logsumexp's, which the kernel returns strided) by first
    copying it out to a whole [batch, head, query, key] map."""
    additive = None if additive is None else additive.contiguous()  # [batch, head or 1, 1, key]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=additive, scale=scale)[:2]
    return out, lse


BIAS_ALIGNMENT = 16  # elements: a bias row of the memory-efficient kernel starts on a multiple of 16 (32 bytes)


def efficient_kernel(op: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, Tensor]]:
    """A FusedKernel call through `op`, which has the signature and results of aten's memory-efficient attention
    `_scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
    *, scale) -> (output, logsumexp, philox seed, philox offset)`: Q and K of one head size, V of its own; the
    logsumexp float32 [batch, head, queries rounded up to a multiple of 32], cut back here. The CUDA kernel is
    called directly, not through scaled_dot_product_attention, so no backend choice can fall back to the math
    kernel and its [n, n] map: a call it cannot run fails. The tests run this function on CPU with a plain-torch
    `op` of the same contract (tests/efficient_reference.py), so the CUDA path differs only in the aten call."""

    def call(query: Tensor, key: Tensor, value: Tensor, causal: bool, additive: Tensor | None,
             scale: float) -> tuple[Tensor, Tensor]:
        query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))  # as the
        # kernel reads them: each head's channels adjacent
        bias = None if additive is None else _kernel_bias(additive, query, key)  # [batch, head, query, key]
        out, lse = op(query, key, value, bias, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., : query.shape[2]]  # [batch, head, q, value width], [batch, head, q]

    return call


def _kernel_bias(additive: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """`additive` [batch, head or 1, 1, key] as the memory-efficient kernel reads a bias: in the queries' dtype, each
    row starting on a multiple of BIAS_ALIGNMENT elements (the kernel checks the bias's batch and head strides), and
    broadcast to [batch, head, query, key] by strides of 0, no copy (what scaled_dot_product_attention's own mask
    preparation does)."""
    batch, heads, n = query.shape[:3]
    keys = key.shape[2]
    padded = -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    rows = additive.new_zeros(*additive.shape[:-1], padded, dtype=query.dtype)  # [batch, head or 1, 1, padded]
    rows[..., :keys] = additive
    return rows[..., :keys].expand(batch, heads, n, keys)  # [batch, head, query, key]


@dataclass(frozen=True)
class FusedKernel:
    """One device's fused attention kernel behind `flash`: `call(query, key, value, causal, additive, scale) ->
    (output, logsumexp [batch, head, query])`. `one_head_size`: the kernel takes Q, K and V of one head size only,
    so the statistics' value channels widen Q and K too (the fused path then lays its calls out so that the keys
    and values are one buffer); otherwise Q and K keep their head size."""

    name: str
    call: Callable[..., tuple[Tensor, Tensor]]
    one_head_size: bool


def _cuda_efficient(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
    return torch.ops.aten._scaled_dot_product_efficient_attention(*args, **kwargs)


KERNELS: dict[str, FusedKernel] = {  # the devices the fused path runs on (elsewhere the blocked path runs)
    "cpu": FusedKernel("aten flash attention for CPU", _cpu_flash, one_head_size=True),
    "cuda": FusedKernel("aten memory-efficient attention (CUDA)", efficient_kernel(_cuda_efficient),
                        one_head_size=False),
}


def one_head_size(device: torch.device) -> bool:
    """Whether the fused kernel on `device` takes Q, K and V of one head size only."""
    found = KERNELS.get(device.type)
    return found is None or found.one_head_size


def fused_attend(
    query: Tensor, key: Tensor, value: Tensor, padding: Tensor | None, scaling: float | None, causal: bool,
    info: Batch, need_output: bool = True, factors: Tensor | None = None,
) -> tuple[SentenceSums, Tensor | None, Tensor | None]:
    """The attention output from the fused kernel and every row statistic without a map.

    A fused call in float32 takes the keys as values (centred on their mean, so that the scores and the
    logsumexp stay small) with extra value channels: the key's position (centred), 1 on the first `sink` keys and
    1 on special tokens. A float32 model's own values ride in the same call (one call of head size 2 dim + 3,
    rounded up, costs less on CPU than two calls); other dtypes get their output from a call of their own.
    For a 0/-inf mask ln p_ij = s_ij - lse_i, so the entropy is
    H_i = lse_i - scale q_i . (sum_j p_ij k_j); single weights (first key, previous, self, the +-2 diagonal) are
    exp(s_ij - lse_i) for those j; the mean distance is i - E[j] (causal) or, for encoders, E[j] - i plus twice
    the causal part sum_{j<=i} p_ij (i - j) from a third, causal call; the recent window of sink_window is a
    banded sum over the W keys before each row.

    `factors` [head, k, dim] (values.head_factors): also the value-weighted statistics, from one more statistics
    call with ln |f_h(x_j)| added to the mask (see _fused_masses; the single weights' logits and the recent
    window's band are shared with the map's), and `output_norm` from the output.
    """
    batch, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    real = _right_padded(padding, batch, n, query.device)  # [batch, key]
    lengths = real.sum(dim=-1)  # [batch]
    hidden = None if bool(real.all()) else ~real[:, None, None, :]  # [batch, 1, 1, key]
    wanted = need_output or factors is not None  # the output: for the next layer, or for output_norm
    together = wanted and value.dtype == torch.float32  # then the values ride in the statistics call
    out = None
    if wanted and not together:
        additive = None if hidden is None else torch.zeros(
            hidden.shape, dtype=query.dtype, device=query.device).masked_fill_(hidden, float("-inf"))
        key_h = key.repeat_interleave(groups, dim=1) if groups > 1 else key  # [batch, head, key, dim]
        value_h = value.repeat_interleave(groups, dim=1) if groups > 1 else value  # [batch, head, key, dim]
        out, _ = flash(query, key_h, value_h, causal, additive, scale)  # [batch, head, q, dim]
    q = query.float()  # [batch, head, q, dim]
    weight = real[:, None, :, None].float()  # [batch, 1, key, 1]
    key32 = key.float()  # [batch, kv head, key, dim]: the calls repeat it for each head of a group as they copy it
    centre = (key32 * weight).sum(dim=2, keepdim=True) / lengths.clamp(min=1)[:, None, None, None]  # [b, kv, 1, dim]
    centred = key32 - centre  # [batch, kv head, key, dim]: softmax unchanged, scores and lse smaller
    additive32 = None if hidden is None else torch.zeros(hidden.shape, device=q.device).masked_fill_(
        hidden, float("-inf"))  # [batch, 1, 1, key]
    norms = None if factors is None else values.key_norms(value, factors)  # [batch, head, key]
    biases = (None,) if norms is None else (None, values.log_weights(norms))  # the map; the value-weighted one
    found, carried, keys = _fused_masses(q, centred, real, additive32, causal, info, scale, biases,
                                         carry=value if together else None)
    masses, lse = found[0]
    if together:  # centring the keys leaves every row's softmax, so the output, as it was
        out = carried  # [batch, head, q, dim]
    if info.tokens is not None:
        masses.duplicate, masses.has_duplicate = _fused_duplicate(q, keys, lse, info.tokens.ids, lengths, causal,
                                                                   scale, info.kept)
    per_row = row_stats(masses, 0, lengths, causal)
    if factors is not None:
        empty = _nothing_to_weigh(norms, real, causal)  # [batch, head, q]
        per_row.update({name: values_.masked_fill(empty, torch.nan) for name, values_ in value_weighted(
            row_stats(found[1][0], 0, lengths, causal)).items()})
        per_row[OUTPUT_NORM] = values.head_norms(out, factors)  # [batch, head, q]
    sums = SentenceSums(rows={} if info.keep_rows else None) if info.tokens is None else ReceivedOnRead(
        lambda: _fused_received(q, keys, lse, real, causal, scale), rows={} if info.keep_rows else None)
    sums.add(per_row, 0, lengths, info.bins)
    output = out.transpose(1, 2) if need_output else None  # [batch, q, head, dim]
    return sums, _fused_example(info, q, keys, lse, real, causal, scale), output


class ReceivedOnRead(SentenceSums):
    """SentenceSums whose `received` [batch, head, key] is computed when first read: the fused path's costs a
    statistics call of its own, which a run without top_tokens.csv never reads. `forget` (stats_attention, once the
    layer's callback returned) lets go of what computing it holds; unread, it then stays None."""

    def __init__(self, compute: Callable[[], Tensor], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._compute: Callable[[], Tensor] | None = compute

    @property
    def received(self) -> Tensor | None:
        if self._compute is not None:
            self._received, self._compute = self._compute(), None
        return self._received

    @received.setter
    def received(self, value: Tensor | None) -> None:
        self._received, self._compute = value, None

    def forget(self) -> None:
        self._compute = None


class _FusedSums(NamedTuple):
    """What one statistics call of _fused_masses reads from the fused kernel, [batch, head, q] each."""

    lse: Tensor  # each row's logsumexp
    entropy: Tensor
    distance: Tensor
    sinks: Tensor  # the mass on the first `sink` keys
    special: Tensor | None  # None where not counted
    punctuation: Tensor | None


def _fused_masses(
    q: Tensor, keys: Tensor, real: Tensor, additive: Tensor | None, causal: bool, info: Batch, scale: float,
    biases: tuple[Tensor | None, ...] = (None,), carry: Tensor | None = None,
) -> tuple[list[tuple[RowMasses, Tensor]], Tensor | None, Tensor]:
    """Every row's masses from the fused kernel (fused_attend's identities) and the logsumexp [batch, head, q], once
    per entry of `biases` (None: the map itself); the attention output of `carry` [batch, kv head, key, c] (values
    that ride along in the first call) or None; and the keys [batch, head, key, dim] as the calls read them (a view
    of the first call's buffer). `keys` [batch, kv head, key, dim] (centred): each query head of a group reads its
    KV head's. Each entry costs a statistics call of its own (_fused_call), all from one widened copy of the
    queries; the scores of the single weights and of the recent window's band are computed once for all of them.

    A bias [batch, head, key] is an additive per-key term, ln |f_h(x_j)| for the value-weighted map
    (values.ZERO_NORM where the norm is 0). It joins the mask, the single weights exp(s_ij + b_j - lse_i) and the
    recent window's banded sum, and the entropy loses its mean, -sum_j p_ij b_j, from one more value channel:
    H_i = lse_i - scale q_i . E[k] - E[b]. Special tokens and punctuation are counted without a bias only.
    """
    batch, heads, n, dim = q.shape
    widths = [_head_size(dim + len(_channels(info, bias)) + (carry.shape[-1] if k == 0 and carry is not None else 0))
              for k, bias in enumerate(biases)]
    queries = [q] * len(widths)  # [batch, head, q, dim] each: a kernel that takes values wider than Q and K
    if one_head_size(q.device):  # the kernel's queries are as wide as its values
        widened = q.new_empty(batch, heads, n, max(widths))  # [batch, head, q, width]: every call reads a prefix
        widened[..., :dim] = q
        widened[..., dim:] = 0.0  # zero channels leave the scores alone
        queries = [widened[..., :width] for width in widths]
        del widened
    calls = [_fused_call(query, width, keys, additive, causal, info, scale, bias, carry if k == 0 else None)
             for k, (query, bias, width) in enumerate(zip(queries, biases, widths))]
    del queries
    sums, carried, keys = [call_sums for call_sums, _, _ in calls], calls[0][1], calls[0][2]

    views = [(call.lse, call.sinks, bias) for call, bias in zip(sums, biases)]
    offsets = range(-DIAGONAL_WINDOW, (0 if causal else DIAGONAL_WINDOW) + 1)  # a causal row's later keys: weight 0
    windows, band, split = _sink_window(q, keys, views, real, causal, info, scale, tuple(offsets))

    def weights_at(offset: int) -> list[Tensor]:
        """p[i, i + offset] for every row, one [batch, head, q] per bias, 0 where that key is not allowed (a future
        key of a causal row). The first view's s_ij + b_j - lse_i comes from the band from row `split` on, from a
        product of its own before; the other views' from the first's plus their lse and bias differences."""
        found = [torch.zeros(batch, heads, n, device=q.device) for _ in biases]  # [batch, head, q] each
        if offset not in offsets or abs(offset) >= n:
            return found
        rows = slice(max(0, -offset), n - max(0, offset))  # the rows whose key i + offset exists
        cols = slice(max(0, offset), n - max(0, -offset))
        shifted = band[offset] if offset in band else torch.empty(batch, heads, n, device=q.device)  # [b, h, q]
        own = slice(rows.start, min(split, rows.stop))  # the rows before the band's
        if own.start < own.stop:
            logit = scale * torch.linalg.vecdot(q[:, :, own], keys[:, :, own.start + offset : own.stop + offset])
            if biases[0] is not None:
                logit = logit + biases[0][:, :, own.start + offset : own.stop + offset]  # [batch, head, m]
            shifted[:, :, own] = logit - sums[0].lse[:, :, own]  # [batch, head, m]
        for k, (out, bias, call) in enumerate(zip(found, biases, sums)):
            logit = shifted[:, :, rows]  # [batch, head, m]: the first view's s_ij + b_j - lse_i
            if k:
                logit = logit + (sums[0].lse - call.lse)[:, :, rows]  # [batch, head, m]
                if bias is not None or biases[0] is not None:
                    logit = logit + _bias_difference(bias, biases[0])[:, :, cols]
            out[:, :, rows] = torch.where(real[:, None, cols], logit.exp(), 0.0)  # a padded key has no weight
        return found

    near = {offset: weights_at(offset) for offset in range(-DIAGONAL_WINDOW, DIAGONAL_WINDOW + 1)}
    first_logit = scale * (q @ keys[:, :, 0, :, None])[..., 0]  # [batch, head, q]: key 0 is always allowed
    found = []
    for k, (bias, call) in enumerate(zip(biases, sums)):
        biased = first_logit if bias is None else first_logit + bias[:, :, :1]  # [batch, head, q]
        masses = RowMasses(
            entropy=call.entropy, diagonal=sum(weights[k] for weights in near.values()),
            first=(biased - call.lse).exp(), previous=near[-1][k], self=near[0][k], distance=call.distance,
            sink_window=windows[k], special=call.special, punctuation=call.punctuation,
        )
        found.append((masses, call.lse))
    return found, carried, keys


def _channels(info: Batch, bias: Tensor | None) -> tuple[str, ...]:
    """The statistics' value channels of a _fused_call after the keys, in order."""
    return ("position", "sink", *(("special",) if info.special is not None and bias is None else ()),
            *(("punctuation",) if info.tokens is not None and bias is None else ()),
            *(("bias",) if bias is not None else ()))


def _fused_call(
    queries: Tensor, width: int, keys: Tensor, additive: Tensor | None, causal: bool, info: Batch, scale: float,
    bias: Tensor | None = None, carry: Tensor | None = None,
) -> tuple[_FusedSums, Tensor | None, Tensor]:
    """One statistics call of _fused_masses (`bias` [batch, head, key] or None) and the output of `carry`
    [batch, kv head, key, c] riding in it, [batch, head, q, c] or None; and the keys [batch, head, key, dim] as the
    call read them. `queries` [batch, head, q, dim or width]: the queries, for a kernel of one head size widened to
    the values' `width` with zero channels (one_head_size); `keys` [batch, kv head, key, dim].

    One buffer [batch, head, key, width] holds the keys (repeated for each head of a group as they are copied in),
    the statistics' channels (_channels: the centred position, 1 on the first `sink` keys, special and punctuation
    flags, the bias), zeros, and the carried values last. It is the call's values, and its first channels as wide
    as the queries are the call's keys: all of it for a kernel of one head size (the queries' zero channels leave
    the scores to the keys'), the keys' own `dim` channels (a view) for one that takes wider values."""
    batch, heads, n = queries.shape[:3]
    kv_heads, dim = keys.shape[1], keys.shape[-1]
    mid = (n - 1) / 2
    names = _channels(info, bias)
    at = {name: dim + k for k, name in enumerate(names)}
    first = width - (0 if carry is None else carry.shape[-1])  # where the carried values start
    buffer = queries.new_empty(batch, heads, n, width)  # [batch, head, key, width]: written in place
    grouped = buffer.view(batch, kv_heads, heads // kv_heads, n, width)  # [batch, kv head, group, key, width]
    grouped[..., :dim] = keys[:, :, None]
    if carry is not None:
        grouped[..., first:] = carry[:, :, None]
    buffer[..., dim:first] = 0.0
    buffer[..., at["position"]] = torch.arange(n, device=buffer.device, dtype=torch.float32) - mid  # [key]
    buffer[..., : info.sink, at["sink"]] = 1.0
    if "special" in at:
        buffer[..., at["special"]] = info.special[:, None, :n].float()  # [batch, 1, key]
    if "punctuation" in at:
        buffer[..., at["punctuation"]] = info.tokens.punctuation[:, None, :n].float()  # [batch, 1, key]
    if bias is not None:
        buffer[..., at["bias"]] = torch.where(bias > values.ZERO_NORM, bias, 0.0)  # [batch, head, key]: b_j
        additive = bias[:, :, None, :] if additive is None else bias[:, :, None, :] + additive  # [b, h, 1, key]
    mean, lse = flash(queries, buffer[..., : queries.shape[-1]], buffer, causal, additive, scale)  # [batch, head, q,
    # width], [batch, head, q]
    carried = None if carry is None else mean[..., first:].to(carry.dtype)  # [batch, head, q, c]
    q = queries[..., :dim]  # [batch, head, q, dim]
    keys_h = buffer[..., :dim]  # [batch, head, key, dim]
    entropy = lse - scale * torch.linalg.vecdot(q, mean[..., :dim])  # [batch, head, q]
    if bias is not None:
        entropy = entropy - mean[..., at["bias"]]  # [batch, head, q]
    position = mean[..., at["position"]] + mid  # [batch, head, q]: E[j]
    if causal:
        distance = torch.arange(n, device=q.device) - position  # [batch, head, q]
    else:
        distance = _encoder_distance(q, keys_h, lse, position, additive, scale)
    found = _FusedSums(
        lse=lse, entropy=entropy, distance=distance, sinks=mean[..., at["sink"]],
        special=mean[..., at["special"]] if "special" in at else None,
        punctuation=mean[..., at["punctuation"]] if "punctuation" in at else None,
    )
    return found, carried, keys_h


TILE_ROWS = 64  # rows of a duplicate tile (positions in token order): tiles pack whole groups up to this many rows
TILE_KEYS = 2048  # keys of a duplicate tile, at most (a token that repeats more often is cut into several)


@dataclass(frozen=True)
class _SameToken:
    """Where one sentence's pairs of positions holding the same token lie: its positions sorted by token (stable, so
    by position within a token), those of tokens that occur once left out, cut into tiles of rows x keys of that
    order. A tile holds some whole groups of one token each (rows and keys the same span) or part of one large
    group; within it the pairs are those of the same group, key before row (causal) or any other key."""

    order: Tensor  # [m] positions in token order, only of tokens that occur more than once
    group: Tensor  # [m] which token (a group number) each holds
    tiles: tuple[tuple[int, int, int, int], ...]  # (row start, row end, key start, key end) in `order`
    has: Tensor  # [length] bool: the position has such a key (causal: not its token's first occurrence)


def _same_token(ids: Tensor, causal: bool) -> _SameToken:
    """The pairs plan of one sentence's ids [length] (see _SameToken): the same in every layer."""
    order = ids.argsort(stable=True)  # [length]: positions grouped by id
    _, counts = torch.unique_consecutive(ids[order], return_counts=True)  # [groups]
    repeated = counts.repeat_interleave(counts) > 1  # [length]: in token order
    order, counts = order[repeated], counts[counts > 1]  # [m], [groups of 2 or more]
    group = torch.arange(len(counts), device=ids.device).repeat_interleave(counts)  # [m]
    has = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)  # [length]
    first = counts.cumsum(0) - counts  # [groups]: where each group starts in `order`
    has[order] = True
    if causal:
        has[order[first]] = False  # a token's first occurrence has no earlier key holding it
    tiles, pack, begin = [], 0, 0
    for end in counts.cumsum(0).tolist():  # group [begin, end) of `order`
        if end - begin > TILE_ROWS:  # a large group: rows by TILE_ROWS, keys up to the row (causal) by TILE_KEYS
            tiles += [(pack, begin, pack, begin)] if pack < begin else []
            for r0 in range(begin, end, TILE_ROWS):
                r1 = min(end, r0 + TILE_ROWS)
                tiles += [(r0, r1, c0, min(c0 + TILE_KEYS, r1 if causal else end))
                          for c0 in range(begin, r1 if causal else end, TILE_KEYS)]
            pack = end
        elif end - pack > TILE_ROWS:  # the pack is full: close it before this group
            tiles.append((pack, begin, pack, begin))
            pack = begin
        begin = end
    tiles += [(pack, begin, pack, begin)] if pack < begin else []
    return _SameToken(order, group, tuple(tiles), has)


def _fused_duplicate(q: Tensor, keys: Tensor, lse: Tensor, ids: Tensor, lengths: Tensor, causal: bool,
                     scale: float, cache: dict[Any, Any] | None = None) -> tuple[Tensor, Tensor]:
    """row_duplicate from the fused kernel's logsumexp: exp(s_ij - lse_i) summed over the pairs of positions that
    hold the same token, and whether each row has such a key, [batch, 1, q]. The positions are sorted by token
    (_same_token, never an [n, n] mask): a tile of that order is one product of the rows' queries and the keys.
    `cache`: the pairs plan is kept there for the batch's other layers."""
    batch, heads, n, _ = q.shape
    mass = torch.zeros(batch, heads, n, device=q.device)  # [batch, head, q]
    has = torch.zeros(batch, 1, n, dtype=torch.bool, device=q.device)  # [batch, 1, q]
    for b in range(batch):
        length = int(lengths[b])
        key = ("same token", b, length, causal)
        plan = None if cache is None else cache.get(key)
        if plan is None:
            plan = _same_token(ids[b, :length], causal)
            if cache is not None:
                cache[key] = plan
        has[b, 0, :length] = plan.has
        if not plan.tiles:
            continue
        order = plan.order
        rows_q, rows_k, rows_lse = (x[b].index_select(1, order) for x in (q, keys, lse))  # [head, m, (dim)]
        found = torch.zeros(heads, len(order), device=q.device)  # [head, m]
        sorted_at = torch.arange(len(order), device=q.device)  # [m]
        for r0, r1, c0, c1 in plan.tiles:
            logits = (rows_q[:, r0:r1] @ rows_k[:, c0:c1].transpose(-1, -2)).mul_(scale)  # [head, r, c]
            same = plan.group[r0:r1, None] == plan.group[None, c0:c1]  # [r, c]
            i, j = sorted_at[r0:r1, None], sorted_at[None, c0:c1]  # [r, 1], [1, c]
            same &= (j < i) if causal else (j != i)  # within a group token order is position order
            logits.sub_(rows_lse[:, r0:r1, None]).masked_fill_(~same, float("-inf"))
            found[:, r0:r1] += logits.exp_().sum(dim=-1)  # [head, r]
        mass[b].index_copy_(1, order, found)  # [head, q]
    return mass, has


def _fused_received(q: Tensor, keys: Tensor, lse: Tensor, real: Tensor, causal: bool, scale: float) -> Tensor:
    """The mass each key receives, sum_i p_ij over the real rows, from one more fused call with queries and keys
    swapped and -lse_i as an additive per-key term: its logsumexp is ln sum_i exp(s_ij - lse_i). A causal map is
    run in reversed order (j <= i is then a causal mask again). [batch, head, key]."""
    bias = torch.where(real[:, None, :], -lse, float("-inf"))[:, :, None, :]  # [batch, head, 1, q]
    swapped_q, swapped_k = keys, q  # [batch, head, n, dim] each
    if causal:
        swapped_q, swapped_k, bias = swapped_q.flip(2), swapped_k.flip(2), bias.flip(3)
    _, lse_t = flash(swapped_q.contiguous(), swapped_k.contiguous(), swapped_k.contiguous(), causal, bias, scale)
    if causal:
        lse_t = lse_t.flip(2)  # [batch, head, key]
    return torch.where(real[:, None, :], lse_t.exp(), 0.0)  # [batch, head, key]


def _nothing_to_weigh(norms: Tensor, real: Tensor, causal: bool) -> Tensor:
    """Rows whose every allowed key has norm 0, [batch, head, q]: their value-weighted map is undefined."""
    some = (norms > 0) & real[:, None, :]  # [batch, head, key]
    if causal:
        return some.cumsum(dim=-1) == 0  # [batch, head, q]: nothing among j <= i
    return ~some.any(dim=-1, keepdim=True).expand_as(some)  # [batch, head, q]


def _head_size(channels: int) -> int:
    """The head size of a fused call that carries `channels`: Q, K and V share one, rounded up to a multiple of 8."""
    return -(-channels // 8) * 8


def _widened(x: Tensor, width: int) -> Tensor:
    """x [batch, head, n, dim] with zero channels up to `width`: a query or key padded so leaves its scores alone."""
    out = x.new_zeros(*x.shape[:-1], width)  # [batch, head, n, width]
    out[..., : x.shape[-1]] = x
    return out


def _encoder_distance(
    q: Tensor, keys: Tensor, lse: Tensor, position: Tensor, additive: Tensor | None, scale: float,
) -> Tensor:
    """sum_j p_ij |i - j| of an encoder row: E[j] - i + 2 sum_{j <= i} p_ij (i - j), the causal part from a causal
    fused call (its own logsumexp, rescaled to the row's) whose values are the centred key positions."""
    batch, heads, n, dim = keys.shape
    mid = (n - 1) / 2
    i = torch.arange(n, device=q.device)  # [q]
    values_ = q.new_zeros(batch, heads, n, _head_size(1))  # [batch, head, key, 8]: one channel, padded
    values_[..., 0] = torch.arange(n, device=q.device, dtype=torch.float32) - mid  # [key]
    before, lse_before = flash(q, keys, values_, True, additive, scale)  # [batch, head, q, 8], [batch, head, q]
    share = (lse_before - lse).exp()  # [batch, head, q]: the mass on keys j <= i
    below = share * ((i - mid) - before[..., 0])  # [batch, head, q]: sum_{j <= i} p_ij (i - j)
    return position - i + 2 * below  # [batch, head, q]


def _sink_window(
    q: Tensor, keys: Tensor, views: list[tuple[Tensor, Tensor, Tensor | None]], real: Tensor, causal: bool,
    info: Batch, scale: float, offsets: tuple[int, ...] = (),
) -> tuple[list[Tensor], dict[int, Tensor], int]:
    """row_sink_window from the fused kernel's logsumexp, one [batch, head, q] for each (lse, mass of the first
    `sink` keys (a value channel), bias or None) in `views`: that mass plus a banded sum over the `window` most
    recent keys, block by block (O(n window) memory); a bias [batch, head, key] is added to the scores (the
    value-weighted map). The band's weights are computed once, for the first view: p_ij = exp(s_ij + b_j - lse_i)
    straight from one product per block (baddbmm); another view's window mass is sum_j p_ij exp(b'_j - b_j) times
    exp(lse_i - lse'_i), all the views' sums one product of the block with the per-key factors. A view whose
    weights that product could lose (first-view weights below float32's range that its factors would lift to a
    share above 1e-8: UNDERFLOW_GAP) gets its own exponential of s_ij + b'_j - lse'_i instead.

    Also, per offset o <= 0 in `offsets`, the first view's s_ij + b_j - lse_i at j = i + o, [batch, head, q], read
    off the band (its diagonals) from the row it returns last on: sink + window (n, and no offsets, when no row
    has a band)."""
    batch, heads, n, dim = q.shape
    start, window = info.sink + info.window, info.window
    if not causal or start >= n:
        return [torch.full((batch, heads, n), torch.nan, device=q.device) for _ in views], {}, n  # [b, h, q] each
    diagonals = {o: torch.empty(batch * heads, n, device=q.device) for o in offsets if -window < o <= 0}  # [b x h, q]
    # a block of r rows computes r + window - 1 logits per row for its window of `window`: r = window / 8 wastes an
    # eighth; smaller blocks cost more in calls than they save
    rows = max(1, min(block_size(batch, heads, n, info.budget_bytes, window), max(16, window // 8)))
    outside = _outside_band(rows, window, q.device)  # [r, r + window - 1]: keys outside each row's window
    padded = None if bool(real.all()) else ~real[:, None, None, :]  # [batch, 1, 1, key]
    flat_q, flat_k = q.reshape(batch * heads, n, dim), keys.reshape(batch * heads, n, dim)  # [batch x head, n, dim]
    lse0, _, bias0 = views[0]
    first = -lse0.reshape(batch * heads, n, 1)  # [batch x head, q, 1]
    first_bias = None if bias0 is None else bias0.reshape(batch * heads, 1, n)  # [batch x head, 1, key]
    factors = torch.ones(batch * heads, n, len(views), device=q.device)  # [batch x head, key, view]: exp(b'_j - b_j)
    own = {}  # view -> (lse_i - lse'_i [batch x head, q, 1], b'_j - b_j [batch x head, 1, key] or None): in log space
    for k, (lse, _, bias) in enumerate(views[1:], start=1):
        gap = None if bias is None and bias0 is None else _bias_difference(bias, bias0)  # [batch, head, key]
        defined = lse > values.ZERO_NORM / 2  # [batch, head, q]: not a row with nothing to weigh (NaN anyway)
        lifted = torch.where(defined, lse0 - lse, 0.0).amax() + (0.0 if gap is None else gap.amax())  # ln of the
        # largest factor on a weight
        if bool(lifted > UNDERFLOW_GAP):
            own[k] = ((lse0 - lse).reshape(batch * heads, n, 1), None if gap is None else gap.reshape(batch * heads,
                                                                                                     1, n))
        elif gap is not None:
            factors[..., k] = gap.reshape(batch * heads, n).exp()
    recent = torch.zeros(batch * heads, n, len(views), device=q.device)  # [batch x head, q, view]
    for q0 in range(start, n, rows):
        q1 = min(n, q0 + rows)
        r, k0 = q1 - q0, q0 - window + 1  # k0 >= sink: the window keys never reach the sink keys
        added = first[:, q0:q1] if first_bias is None else first[:, q0:q1] + first_bias[:, :, k0:q1]
        shifted = torch.baddbmm(added, flat_q[:, q0:q1], flat_k[:, k0:q1].transpose(1, 2), alpha=scale)  # [b x h, r,
        # keys]: s_ij + b_j - lse_i of the first view
        for offset, into in diagonals.items():  # key i + o of row i sits at column (i - q0) + window - 1 + o
            into[:, q0:q1] = shifted.diagonal(window - 1 + offset, dim1=1, dim2=2)  # [batch x head, r]
        hidden = outside[:r, : r + window - 1]  # [r, keys]: the band depends on j - i only
        blocks = {}
        for k, (lse_gap, gap) in own.items():  # [batch x head, r, keys]: s_ij + b'_j - lse'_i
            blocks[k] = shifted + lse_gap[:, q0:q1]
            if gap is not None:
                blocks[k].add_(gap[:, :, k0:q1])
        for block in (*blocks.values(), shifted):
            block[:, :, : r - 1].masked_fill_(hidden[:, : r - 1], float("-inf"))  # the band's lower-left triangle
            block[:, :, window:].masked_fill_(hidden[:, window:], float("-inf"))  # its upper-right one
            if padded is not None:
                block.view(batch, heads, r, -1).masked_fill_(padded[..., k0:q1], float("-inf"))
        if len(views) == 1:  # a sum is cheaper than a product with ones
            recent[:, q0:q1, 0] = shifted.exp_().sum(dim=-1)  # [batch x head, r]
        else:
            torch.bmm(shifted.exp_(), factors[:, k0:q1], out=recent[:, q0:q1])  # [batch x head, r, view]
        for k, block in blocks.items():
            recent[:, q0:q1, k] = block.exp_().sum(dim=-1)  # [batch x head, r]
    out = []
    for k, (lse, sink_mass, _) in enumerate(views):
        mass = recent[..., k].view(batch, heads, n)  # [batch, head, q]
        if k and k not in own:
            mass = mass * (lse0 - lse).exp()  # [batch, head, q]: from the first view's weights to this one's
        found = sink_mass + mass  # [batch, head, q]
        found[..., :start] = torch.nan  # rows whose window and sink keys cover every key
        out.append(found)
    return out, {o: into.view(batch, heads, n) for o, into in diagonals.items()}, start


def _outside_band(rows: int, window: int, device: torch.device) -> Tensor:
    """Block coordinates [r, r + window - 1] (row a = q0 + a, key c = q0 - window + 1 + c): True where the key is
    not among the row's `window` most recent (c < a or c > a + window - 1)."""
    a = torch.arange(rows, device=device)[:, None]  # [r, 1]
    c = torch.arange(rows + window - 1, device=device)[None, :]  # [1, keys]
    return (c < a) | (c > a + window - 1)  # [r, keys]


def _bias_difference(bias: Tensor | None, base: Tensor | None) -> Tensor:
    """bias - base of two per-key biases [batch, head, key] (None: 0)."""
    if base is None:
        return bias
    return -base if bias is None else bias - base


def _fused_example(
    info: Batch, q: Tensor, keys: Tensor, lse: Tensor, real: Tensor, causal: bool, scale: float
) -> Tensor | None:
    """The example sentence's first tokens' maps, from the scores and the row's logsumexp: [head, kept, kept]."""
    if info.example is None:
        return None
    row, kept = info.example
    logits = scale * (q[row, :, :kept] @ keys[row, :, :kept].transpose(-1, -2))  # [head, kept, kept]
    allowed = real[row, None, :kept].expand(kept, kept)  # [kept, kept]
    if causal:
        allowed = allowed & torch.ones(kept, kept, dtype=torch.bool, device=q.device).tril()
    return torch.where(allowed, (logits - lse[row, :, :kept, None]).exp(), 0.0)  # [head, kept, kept]


def mask_block(scores: Tensor, real: Tensor, q0: int, causal: bool, k0: int = 0, span: int | None = None) -> None:
    """Set the scores of keys a row may not see to the float32 minimum, in place (our own tensor).

    Only the columns where some row of the block is masked are touched: the causal square at the
    block's own positions, the window's far edge, padded keys.
    """
    rows, keys = scores.shape[-2:]
    apply_mask(scores, mask_plan(real, q0, rows, keys, causal, k0, span))


def mask_plan(real: Tensor, q0: int, rows: int, keys: int, causal: bool, k0: int = 0,
              span: int | None = None) -> MaskPlan:
    """What mask_block hides in a block of `rows` query rows from q0 and `keys` keys from k0 (the same in every
    layer of a batch)."""
    i = torch.arange(q0, q0 + rows, device=real.device)  # [r]
    j = torch.arange(k0, k0 + keys, device=real.device)  # [keys]
    hidden = torch.zeros(rows, keys, dtype=torch.bool, device=real.device)  # [r, keys]
    if causal:
        hidden |= j[None, :] > i[:, None]
    if span is not None:
        hidden |= (j[None, :] <= i[:, None] - span) if causal else ((j[None, :] - i[:, None]).abs() > span)
    columns = hidden.any(dim=0).nonzero()  # [c, 1]
    strip = None
    if len(columns):
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        strip = (lo, hi, hidden[:, lo:hi])  # [r, strip]
    padded = None if bool(real[:, k0 : k0 + keys].all()) else ~real[:, None, None, k0 : k0 + keys]  # [b, 1, 1, keys]
    return MaskPlan(strip, padded)


def apply_mask(scores: Tensor, plan: MaskPlan) -> None:
    """mask_block's masking of `scores` [batch, head, r, keys] by a MaskPlan, in place."""
    lowest = torch.finfo(torch.float32).min
    if plan.strip is not None:
        lo, hi, hidden = plan.strip
        scores[..., lo:hi].masked_fill_(hidden, lowest)  # [batch, head, r, strip]
    if plan.padded is not None:
        scores.masked_fill_(plan.padded, lowest)  # [batch, head, r, keys]


def softmax_with_entropy(scores: Tensor, sinks: Tensor | None = None, out: Tensor | None = None,
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """softmax over the last axis, each row's entropy -sum p ln p, and ln p (hugely negative, finite, at masked keys).

    torch's own softmax and log_softmax, as eager attention takes them: fused kernels, where a plain exp of the
    masked keys' hugely negative scores takes a slow path (40 times the time of the whole softmax on short
    sentences). `sinks` [1, head, 1, 1]: a learned logit per head that joins the softmax as one more column and is
    dropped from p (its rows then sum to less than 1), as gpt-oss does: with s' = s - max and Z = sum exp(s') over
    the keys and the sink, ln p = s' - ln Z and H = ln Z sum p - sum p s'. Edits `scores` (our own) in place;
    `out` [batch, head, r, keys], when given, receives p.
    """
    if sinks is None:
        p = torch.softmax(scores, dim=-1)  # [batch, head, r, keys]
        p = p if out is None else out.copy_(p)  # [batch, head, r, keys]
        log_p = torch.log_softmax(scores, dim=-1)  # [batch, head, r, keys]
        return p, -(p * log_p).sum(dim=-1), log_p  # masked keys: 0 * finite
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # [batch, head, r, 1]
    scores.sub_(top)  # [batch, head, r, keys]: <= 0, masked keys hugely negative
    p = scores.exp() if out is None else torch.exp(scores, out=out)  # [batch, head, r, keys]
    total = p.sum(dim=-1, keepdim=True) + (sinks - top).exp()  # [batch, head, r, 1]
    p.div_(total)
    log_total = total[..., 0].log()  # [batch, head, r]
    entropy = log_total * p.sum(dim=-1) - (p * scores).sum(dim=-1)  # [batch, head, r]; masked keys: 0 * finite
    return p, entropy, scores.sub_(log_total[..., None])


def _example_buffer(info: Batch, heads: int, device: torch.device) -> Tensor | None:
    if info.example is None:
        return None
    kept = info.example[1]
    return torch.zeros(heads, kept, kept, device=device)  # [head, query, key]


@contextmanager
def statistics_attention(loaded: LoadedModel) -> Iterator[None]:
    """Switch the model to the statistics function for the duration; refuse what it cannot do exactly."""
    reason = unsupported(loaded)
    if reason is not None:
        raise Unsupported(reason)
    with _switched(loaded):
        yield


def _switched(loaded: LoadedModel) -> Any:
    """The model on the statistics function (`attnprobe_stats`) for the duration."""
    return using_attention(loaded.model, NAME, stats_attention, stats_mask)


@torch.inference_mode()
def run_batch(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor, on_layer: LayerSums, *,
    special: Tensor | None = None, sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, bins: int = 1,
    budget_mib: float = DEFAULT_BUDGET_MIB, block_rows: int | None = None, example: tuple[int, int] | None = None,
    discovering: list[str] | None = None, features: dict[int, LayerFeatures] | None = None, fused: int | None = None,
    projections: list[nn.Module] | None = None, keep_rows: bool = False, tokens: TokenClasses | None = None,
) -> str:
    """Run one right-padded batch under `statistics_attention`; `on_layer` gets each layer's sums. Returns the
    batch's path: "fused" when any layer ran the fused kernel, else "blocked".

    `features`, when given, receives each layer's LayerFeatures; `discovering` collects what is not implemented
    instead of refusing it (discover()). `fused`: run the layers `fusable` accepts through the fused kernel when
    the batch is at least this many tokens long (0: always; None: never). `projections`: each layer's output
    projection (values.find_projections), to measure the value-weighted scores and output_norm too. `keep_rows`:
    the sums handed to `on_layer` keep every row's values too (`SentenceSums.rows`).
    `tokens`: the batch's token ids and punctuation flags, for `punctuation`, `duplicate` and the mass each key
    receives (SentenceSums.received, for top_tokens.csv; on the fused path computed only if `on_layer` reads it).
    """
    modules = attention_modules(loaded.model)
    info = Batch(
        layers={id(m): layer for layer, (m, _) in enumerate(modules)}, last_layer=len(modules) - 1,
        special=special, sink=sink, window=window, bins=bins, budget_bytes=int(budget_mib * 2**20),
        block_rows=block_rows, example=example, on_layer=on_layer, discovering=discovering, fused=fused,
        projections=projections, keep_rows=keep_rows, tokens=tokens,
    )
    if features is not None:
        info.features = features
    seen: list[int] = []

    def record(layer: int, sums: SentenceSums, maps: Tensor | None) -> None:
        seen.append(layer)
        on_layer(layer, sums, maps)

    info.on_layer = record
    token = _ACTIVE.set(info)
    try:
        loaded.model(**forward_kwargs(loaded.model, input_ids, attention_mask))
    except LastLayerDone:
        pass
    finally:
        _ACTIVE.reset(token)
    missing = sorted(set(range(len(modules))) - set(seen))
    if missing:
        raise AttnprobeError(f"model {loaded.spec} did not call attnprobe's statistics attention in layer(s) "
                             f"{missing}: use --attention eager")
    return "fused" if "fused" in info.ran else "blocked"
