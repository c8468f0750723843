"""The fused attention kernel of each device (`KERNELS`) behind `flash`, the one seam every fused call goes through:
aten's flash attention on CPU, its memory-efficient attention on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnprobe.errors import AttnprobeError


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


def _widened(x: Tensor, width: int) -> Tensor:
    """x [batch, head, n, dim] with zero channels up to `width`: a query or key padded so leaves its scores alone."""
    out = x.new_zeros(*x.shape[:-1], width)  # [batch, head, n, width]
    out[..., : x.shape[-1]] = x
    return out
