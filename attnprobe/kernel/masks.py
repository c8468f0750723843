"""Masks: the mask function registered with the statistics attention (`stats_mask`: the [batch, key] padding mask,
tagged with the shape `probe_mask` reads off transformers' mask function), the keys a block of query rows may see,
and the plan of what a block's scores hide (`mask_plan`, `apply_mask`: only the columns some row may not see)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnprobe.errors import AttnprobeError
from attnprobe.kernel.features import Unsupported


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


def _right_padded(padding: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor:
    real = torch.ones(batch, n, dtype=torch.bool, device=device) if padding is None else padding  # [batch, key]
    if real.dim() != 2 or real.shape[-1] != n or bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise AttnprobeError("attnprobe's statistics attention takes a right-padded [batch, key] mask "
                             f"(got shape {tuple(real.shape)}, or padding on the left): pad on the right")
    return real


@dataclass
class MaskPlan:
    """Which scores of a block mask_block hides: a strip of columns some row may not see, and padded keys."""

    strip: tuple[int, int, Tensor] | None  # (lo, hi, hidden [rows, hi - lo] bool), None: every row sees every key
    padded: Tensor | None  # [batch, 1, 1, keys] bool: padded keys, None when every key is real


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
