"""The blocked path: the exact eager attention in blocks of query rows sized from a memory budget, the softmax in
float32 with each row's entropy, and the statistics of every row (the value-weighted ones from the same scores)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnprobe import values
from attnprobe.kernel.batch import Batch
from attnprobe.kernel.masks import apply_mask, block_keys, window_reach
from attnprobe.metrics import SentenceSums, block_row_stats, received, split_stacked, token_stats
from attnprobe.scores import OUTPUT_NORM

TEMPORARIES = 6  # float32 tensors of a block's size alive at once: scores, softmax, statistics' temporaries


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
