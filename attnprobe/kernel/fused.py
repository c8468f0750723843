"""The fused path: every row statistic without a map, from fused attention calls (`devices.flash`) whose values carry
the keys and the statistics' channels, and the logsumexp of each row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnprobe import values
from attnprobe.kernel import duplicates
from attnprobe.kernel.batch import Batch
from attnprobe.kernel.devices import flash, one_head_size
from attnprobe.kernel.duplicates import _fused_duplicate, batch_plan
from attnprobe.kernel.window import _bias_difference, _sink_window
from attnprobe.metrics import DIAGONAL_WINDOW, RowMasses, SentenceSums, row_stats, value_weighted
from attnprobe.scores import OUTPUT_NORM


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
    real, lengths = info.padding(padding, batch, n, query.device)  # [batch, key], [batch]: kept for every layer
    geometry = info.geometry(lengths, n, causal, None)  # no host sync per layer (its position bins, once per batch)
    hidden = info.hidden_keys(real)  # [batch, 1, 1, key] or None: one host sync per batch
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
        plan, masses.has_duplicate = batch_plan(info, lengths, q.shape[2], causal, duplicates.TILE_ROWS, None)
        masses.duplicate = _fused_duplicate(q, keys, lse, plan, causal, scale)
    per_row = row_stats(masses, 0, lengths, causal, geometry=geometry)
    if factors is not None:
        empty = _nothing_to_weigh(norms, real, causal)  # [batch, head, q]
        per_row.update({name: values_.masked_fill(empty, torch.nan) for name, values_ in value_weighted(
            row_stats(found[1][0], 0, lengths, causal, geometry=geometry)).items()})
        per_row[OUTPUT_NORM] = values.head_norms(out, factors)  # [batch, head, q]
    sums = SentenceSums(rows={} if info.keep_rows else None) if info.tokens is None else ReceivedOnRead(
        lambda: _fused_received(q, keys, lse, real, causal, scale), rows={} if info.keep_rows else None)
    sums.add(per_row, 0, lengths, info.bins, geometry)
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
