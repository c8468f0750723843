"""attnprobe's own attention function: the exact eager result, in blocks of query rows, with statistics.

It is registered with transformers' `AttentionInterface` (and a mask function with
`AttentionMaskInterface`) under the name `attnprobe_stats`. Per layer it receives query, key, value
and the padding mask, and for each block of query rows computes the scores against the keys the
block may see, masks them, takes the softmax in float32, folds the block's row statistics into
per-sentence sums, and multiplies the block by the values. No [n, n] map exists anywhere: peak extra
memory is one block, sized from a memory budget. Anything the function does not implement (sliding
windows, soft-capping, learned sinks, a KV cache, ...) is refused with one line, never approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe import defaults
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import RECENT_WINDOW, SINK_TOKENS, SentenceSums, block_row_stats
from attnprobe.model import LastLayerDone, LoadedModel, attention_modules, forward_kwargs

NAME = "attnprobe_stats"
SUPPORTED = ("gpt2", "llama", "bert")  # model types whose eager attention this function reproduces
DEFAULT_BUDGET_MIB = defaults.BLOCK_MIB
TEMPORARIES = 6  # float32 tensors of a block's size alive at once: scores, softmax, statistics' temporaries

# Settings a model may pass to its attention function that change the result; none is implemented.
REFUSED_KWARGS = {
    "sliding_window": "sliding-window attention",
    "softcap": "attention logit soft-capping",
    "s_aux": "learned attention sinks (s_aux)",
    "sinks": "learned attention sinks",
    "position_bias": "an additive position bias (ALiBi, T5)",
    "alibi": "ALiBi position biases",
}
# Config fields that make a supported architecture compute something else.
REFUSED_CONFIG = {
    "sliding_window": "sliding-window attention",
    "attn_logit_softcapping": "attention logit soft-capping",
    "reorder_and_upcast_attn": "GPT-2's reorder_and_upcast_attn",
    "alibi": "ALiBi position biases",
}

LayerSums = Callable[[int, SentenceSums, Tensor | None], None]  # layer, sums, example maps [head, q, k] or None


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


_ACTIVE: ContextVar[Batch | None] = ContextVar("attnprobe_batch", default=None)


def unsupported(loaded: LoadedModel) -> str | None:
    """Why the statistics function cannot run this model exactly, or None when it can."""
    model, config = loaded.model, loaded.model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED:
        return f"the {model_type} architecture (supported: {', '.join(SUPPORTED)})"
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return f"{type(model).__name__}, which does not route its attention through AttentionInterface"
    for key, feature in REFUSED_CONFIG.items():
        if getattr(config, key, None):
            return f"{feature} ({key}={getattr(config, key)!r})"
    if model_type in ("gpt2", "llama") and getattr(config, "is_causal", None) is False:
        return "a bidirectional mask on a causal architecture (is_causal=False)"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        return f"layer types {sorted(layer_types)} (only full attention is implemented)"
    return None


def block_size(batch: int, heads: int, keys: int, budget_bytes: int) -> int:
    """Query rows per block so that a block's temporaries fit the budget; at least 1."""
    per_row = batch * heads * keys * 4 * TEMPORARIES
    return max(1, budget_bytes // max(per_row, 1))


def stats_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable | None = None, attention_mask: Tensor | None = None, **_: Any,
) -> Tensor | None:
    """The mask handed to the attention function: the [batch, key] padding mask, never [n, n]."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function not in (causal_mask_function, bidirectional_mask_function, None):
        raise AttnprobeError(
            "this model asks for a custom attention mask (sliding window, chunked or packed attention), "
            "which attnprobe's statistics attention does not implement: use --attention eager"
        )
    if q_offset or kv_offset or q_length != kv_length:
        raise AttnprobeError("attnprobe's statistics attention runs without a KV cache: pass use_cache=False")
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:].bool()  # [batch, key]


def stats_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """Eager attention, block by block; statistics go to the active batch. Returns (output, None)."""
    for name, feature in REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise AttnprobeError(f"this model uses {feature}, which attnprobe's statistics attention does not "
                                 "implement: use --attention eager")
    if dropout:
        raise AttnprobeError("attention dropout is on (the model is training): call model.eval()")
    batch_info = _ACTIVE.get()
    if batch_info is None:
        raise AttnprobeError("attnprobe's statistics attention runs only inside attnprobe.kernel.run_batch")
    layer = batch_info.layers[id(module)]
    causal = bool(getattr(module, "is_causal", True))
    sums, example, output = attend(query, key, value, attention_mask, scaling, causal, batch_info,
                                   need_output=layer != batch_info.last_layer)
    batch_info.on_layer(layer, sums, example)
    if layer == batch_info.last_layer:
        raise LastLayerDone  # nothing after the last attention can change a statistic
    return output, None


def attend(
    query: Tensor, key: Tensor, value: Tensor, padding: Tensor | None, scaling: float | None, causal: bool,
    info: Batch, need_output: bool = True,
) -> tuple[SentenceSums, Tensor | None, Tensor]:
    """The exact eager attention output [batch, query, head, dim] and the statistics of every row."""
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query heads sharing one KV head (grouped-query attention)
    scale = dim**-0.5 if scaling is None else scaling
    real = torch.ones(batch, n, dtype=torch.bool, device=query.device) if padding is None else padding  # [batch, key]
    if real.dim() != 2 or real.shape[-1] != n or bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise AttnprobeError("attnprobe's statistics attention takes a right-padded [batch, key] mask "
                             f"(got shape {tuple(real.shape)}, or padding on the left): pad on the right")
    lengths = real.sum(dim=-1)  # [batch]: right padding
    keys_t = key.transpose(-1, -2)  # [batch, kv_head, dim, key]: a view
    output = query.new_empty(batch, n, heads, dim)  # [batch, query, head, dim]
    rows = info.block_rows or block_size(batch, heads, n, info.budget_bytes)
    sums = SentenceSums()
    example = _example_buffer(info, heads, query.device)  # [head, q, k] or None
    for q0 in range(0, n, rows):
        q1 = min(n, q0 + rows)
        keys = q1 if causal else n  # a causal block sees no key after its last row
        q_block = query[:, :, q0:q1].reshape(batch, kv_heads, groups * (q1 - q0), dim)  # [batch, kv, g*r, dim]
        scores = (q_block @ keys_t[..., :keys]).mul_(scale)  # [batch, kv, g*r, keys]: scaled in the model's dtype
        scores = scores.view(batch, heads, q1 - q0, keys).float()  # [batch, head, r, keys], as eager rounds it
        mask_block(scores, real, q0, causal)
        p, entropy = softmax_with_entropy(scores)  # [batch, head, r, keys], [batch, head, r]
        del scores
        special = None if info.special is None else info.special[:, :keys]  # [batch, keys]
        stats = block_row_stats(p, q0, lengths, causal, special, info.sink, info.window, entropy)
        sums.add(stats, q0, lengths, info.bins)
        if example is not None and q0 < example.shape[1]:
            row, kept = info.example
            end = min(q1, kept)
            example[:, q0:end, : min(keys, kept)] = p[row, :, : end - q0, :kept].float()  # [head, q, k]
        if need_output:
            weights = p.to(value.dtype).view(batch, kv_heads, groups * (q1 - q0), keys)  # [batch, kv, g*r, keys]
            out = weights @ value[:, :, :keys]  # [batch, kv, g*r, dim]
            out = out.view(batch, heads, q1 - q0, dim).transpose(1, 2)  # [batch, r, head, dim]
            output[:, q0:q1] = out
    return sums, example, output


def mask_block(scores: Tensor, real: Tensor, q0: int, causal: bool) -> None:
    """Set the scores of keys a row may not see to the float32 minimum, in place (our own tensor).

    Causal: only the square of keys inside the block holds future keys; padding: only padded keys.
    """
    rows, keys = scores.shape[-2:]
    lowest = torch.finfo(torch.float32).min
    if causal:
        i = torch.arange(q0, q0 + rows, device=scores.device)  # [r]
        j = torch.arange(q0, keys, device=scores.device)  # [strip]
        scores[..., q0:].masked_fill_(j[None, :] > i[:, None], lowest)  # [batch, head, r, strip]
    if not bool(real[:, :keys].all()):
        scores.masked_fill_(~real[:, None, None, :keys], lowest)  # [batch, head, r, keys]


def softmax_with_entropy(scores: Tensor) -> tuple[Tensor, Tensor]:
    """softmax over the last axis and each row's entropy, from the shifted scores.

    With s' = s - max and Z = sum exp(s'), ln p = s' - ln Z, so H = ln Z - sum p s': one product
    instead of a logarithm per entry. Edits `scores` (our own) in place.
    """
    scores.sub_(scores.amax(dim=-1, keepdim=True))  # [batch, head, r, keys]: <= 0, masked keys hugely negative
    p = scores.exp()  # [batch, head, r, keys]
    total = p.sum(dim=-1, keepdim=True)  # [batch, head, r, 1]
    p.div_(total)
    entropy = total[..., 0].log() - (p * scores).sum(dim=-1)  # [batch, head, r]; masked keys: 0 * finite
    return p, entropy


def _example_buffer(info: Batch, heads: int, device: torch.device) -> Tensor | None:
    if info.example is None:
        return None
    kept = info.example[1]
    return torch.zeros(heads, kept, kept, device=device)  # [head, query, key]


_registered = False


def register() -> None:
    """Make `attnprobe_stats` known to transformers (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, stats_attention)
    AttentionMaskInterface.register(NAME, stats_mask)
    _registered = True


@contextmanager
def statistics_attention(loaded: LoadedModel) -> Iterator[None]:
    """Switch the model to the statistics function for the duration; refuse what it cannot do exactly."""
    reason = unsupported(loaded)
    if reason is not None:
        raise AttnprobeError(f"attnprobe's statistics attention does not implement {reason}: use --attention eager")
    register()
    model = loaded.model
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.inference_mode()
def run_batch(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor, on_layer: LayerSums, *,
    special: Tensor | None = None, sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, bins: int = 1,
    budget_mib: float = DEFAULT_BUDGET_MIB, block_rows: int | None = None, example: tuple[int, int] | None = None,
) -> None:
    """Run one right-padded batch under `statistics_attention`; `on_layer` gets each layer's sums."""
    modules = attention_modules(loaded.model)
    info = Batch(
        layers={id(m): layer for layer, (m, _) in enumerate(modules)}, last_layer=len(modules) - 1,
        special=special, sink=sink, window=window, bins=bins, budget_bytes=int(budget_mib * 2**20),
        block_rows=block_rows, example=example, on_layer=on_layer,
    )
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
