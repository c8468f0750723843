"""A plain-torch stand-in for aten's memory-efficient attention, so that the fused path's CUDA branch runs on CPU.

`efficient_attention` has the signature and the results of `torch.ops.aten._scaled_dot_product_efficient_attention`
(torch 2.11-2.13: query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None ->
output, log_sumexp, philox_seed, philox_offset) and refuses what the CUDA op refuses: Q and K of different head
sizes, heads that differ between Q, K and V (no grouped-query broadcast), a last axis that is not contiguous, a bias
of another dtype or shape than [batch, head, query, key], or whose strides are not multiples of 16 bytes (the
kernel's alignment check). Its output has the CUDA op's memory layout ([batch, query, head, value width] in memory,
returned transposed) and its logsumexp is float32, padded to a multiple of 32 queries with NaN, so that a caller
that forgets to cut it reads NaN. It computes in float64 and builds the [n, n] map: for tests only.

`kernel.efficient_kernel(efficient_attention)` is then the fused path's CUDA kernel with this op in place of the
aten call (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the CUDA kernel takes
ALIGNMENT_BYTES = 16
LSE_PAD = 32  # the CUDA op's logsumexp covers the queries rounded up to a multiple of 32


def check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def check_inputs(query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None, dropout_p: float) -> None:
    """The CUDA op's checks on its inputs, as errors."""
    check(query.dim() == key.dim() == value.dim() == 4, "query, key and value must be 4-D [batch, head, seq, dim]")
    check(query.dtype in DTYPES and key.dtype == value.dtype == query.dtype,
          f"query, key and value must share one of {DTYPES}; got {query.dtype}, {key.dtype}, {value.dtype}")
    check(query.shape[0] == key.shape[0] == value.shape[0], "batch sizes differ")
    check(query.shape[1] == key.shape[1] == value.shape[1], "Q, K and V must have the same number of heads")
    check(key.shape[2] == value.shape[2], "key and value lengths differ")
    check(query.shape[3] == key.shape[3], f"Q and K head sizes differ: {query.shape[3]} and {key.shape[3]}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        check(x.stride(-1) == 1, f"{name}'s last axis must be contiguous (stride {x.stride()})")
    check(dropout_p == 0.0, "dropout is not used here")
    if attn_bias is None:
        return
    batch, heads, n, keys = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    check(attn_bias.dtype == query.dtype, f"invalid dtype for bias {attn_bias.dtype}: should match query's")
    check(tuple(attn_bias.shape) == (batch, heads, n, keys),
          f"attn_bias of shape {tuple(attn_bias.shape)}, expected {(batch, heads, n, keys)}")
    check(attn_bias.stride(-1) == 1, "attn_bias's last axis must be contiguous")
    alignment = ALIGNMENT_BYTES // attn_bias.element_size()
    for axis, what in ((0, "strideB"), (1, "strideH"), (2, "strideM")):
        check(attn_bias.stride(axis) % alignment == 0,
              f"attn_bias is not correctly aligned ({what}): stride {attn_bias.stride(axis)}, multiple of {alignment}")


def efficient_attention(query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None,
                        compute_log_sumexp: bool, dropout_p: float = 0.0, is_causal: bool = False, *,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output [batch, head, query, value width] in the query's dtype, logsumexp float32 [batch, head, queries
    rounded up to 32] or [batch, head, 0], seed, offset), in float64 inside."""
    check_inputs(query, key, value, attn_bias, dropout_p)
    batch, heads, n, dim = query.shape
    scores = (query.double() @ key.double().transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    if attn_bias is not None:
        scores = scores + attn_bias.double()  # [batch, head, query, key]
    if is_causal:  # from the top left: query i sees keys j <= i
        later = torch.ones(n, key.shape[2], dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [batch, head, query]
    weights = (scores - lse[..., None]).exp()  # [batch, head, query, key]
    out = (weights @ value.double()).to(query.dtype)  # [batch, head, query, value width]
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the CUDA op's layout: [batch, query, head, width]
    rows = -(-n // LSE_PAD) * LSE_PAD if compute_log_sumexp else 0
    padded = torch.full((batch, heads, rows), float("nan"), device=query.device)  # [batch, head, rows]
    if compute_log_sumexp:
        padded[..., :n] = lse.float()
    empty = torch.empty((), dtype=torch.long)
    return out, padded, empty, empty
