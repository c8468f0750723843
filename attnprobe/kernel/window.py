"""The fused path's recent window: `row_sink_window` from the fused kernel's logsumexp, a banded sum over the
`window` most recent keys, block by block (O(n window) memory), for the map and its value-weighted map at once."""

from __future__ import annotations

import torch
from torch import Tensor

from attnprobe import values
from attnprobe.kernel.batch import Batch
from attnprobe.kernel.blocked import block_size

UNDERFLOW_GAP = 60.0  # _sink_window: ln of the largest factor a view may put on the first view's weights (below 1e-38)


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
    padded = info.hidden_keys(real)  # [batch, 1, 1, key] or None: kept for the batch
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
