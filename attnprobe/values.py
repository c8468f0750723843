"""What a head moves, not only where it looks: each key's contribution after the output projection.

For head h and key j, f_h(x_j) = W_O^h v_j^h is what the key adds to the residual stream when the head puts all
its weight on it: its value vector times the head's slice of the output projection (`o_proj`, GPT-2's `c_proj`,
BERT's `attention.output.dense`, ...; the bias, shared by every head, left out). The value-weighted map
a~_ij = a_ij |f_h(x_j)| / sum_k a_ik |f_h(x_k)| (Kobayashi et al. 2020) is the attention with an additive per-key
bias ln |f_h(x_j)|, so every row statistic applies to it unchanged; `output_norm` is |sum_j a_ij f_h(x_j)|, the
size of what the head writes at row i.

The norms never build W_O v at the model's width: with the thin QR factorisation W_O^h = Q_h R_h (Q_h with
orthonormal columns), |W_O^h x| = |R_h x| for any x, and R_h is [head size, head size]. Under grouped- or
multi-query attention each query head reads its KV head's values through its own slice of W_O.

The eager path reads the values through `capturing_values`: the model's own eager attention function, called
under another name (`attnprobe_eager`) that also keeps each layer's values for the hooks.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe.errors import AttnprobeError
from attnprobe.model import using_attention

PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense", "out_lin", "Wo")  # children of the attention module
SIBLING_PROJECTIONS = ("output.dense",)  # BERT family: `attention.self` hands its heads to `attention.output.dense`
EAGER_NAME = "attnprobe_eager"  # the model's eager attention under another name, keeping the values
ZERO_NORM = -1e30  # ln |f| of a key whose contribution is exactly 0 (log_weights)


def find_projections(model: nn.Module, modules: list[nn.Module], heads: int) -> tuple[list[nn.Module] | None, str]:
    """Per layer, the output projection that combines the heads of `modules` (the attention modules in layer
    order); or None and why not. A projection must be a linear layer (or GPT-2's Conv1D) reading heads x
    head size values."""
    names = {id(module): name for name, module in model.named_modules()}
    found = []
    for layer, module in enumerate(modules):
        projection = _projection_of(model, names.get(id(module), ""), module)
        if projection is None:
            return None, (f"{type(module).__name__} (layer {layer}) has no output projection attnprobe knows (looked "
                          f"for {', '.join(PROJECTIONS + SIBLING_PROJECTIONS)})")
        inputs = _weight(projection).shape[1]
        if inputs % heads:
            return None, (f"the output projection of layer {layer} reads {inputs} values, not a multiple of its "
                          f"{heads} heads")
        found.append(projection)
    return found, "found: " + ", ".join(sorted({_relative(names, m, p) for m, p in zip(modules, found)}))


def _projection_of(model: nn.Module, name: str, module: nn.Module) -> nn.Module | None:
    for child in PROJECTIONS:
        candidate = getattr(module, child, None)
        if _linear(candidate):
            return candidate
    parent = name.rpartition(".")[0]
    for path in SIBLING_PROJECTIONS:
        try:
            candidate = model.get_submodule(f"{parent}.{path}" if parent else path)
        except AttributeError:
            continue
        if _linear(candidate):
            return candidate
    return None


def _relative(names: dict[int, str], module: nn.Module, projection: nn.Module) -> str:
    """The projection's name relative to its layer's attention module (`o_proj`, `../output.dense`)."""
    attention, own = names.get(id(module), ""), names.get(id(projection), "")
    if own.startswith(attention + "."):
        return own[len(attention) + 1 :]
    return "../" + own[len(attention.rpartition(".")[0]) + 1 :]


def _linear(module: Any) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nx"))


def _weight(projection: nn.Module) -> Tensor:
    """The weight as [out, in], whatever the layer stores (GPT-2's Conv1D keeps [in, out]). A weight that
    accelerate offloaded (--device-map to the disk or the CPU) is a placeholder until the layer runs: it is read
    from the offload's own map."""
    weight = projection.weight
    if weight.device.type == "meta":
        stored = getattr(getattr(projection, "_hf_hook", None), "weights_map", None)
        weight = stored["weight"] if stored is not None and "weight" in stored else weight
    return weight if isinstance(projection, nn.Linear) else weight.t()  # [hidden, heads x head size]


_FACTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # projection -> (weight identity, factors)


def head_factors(projection: nn.Module, heads: int) -> Tensor:
    """R_h of each head's slice W_O^h = Q_h R_h: [head, k, head size] float32 (k = min(width, head size)), so that
    |W_O^h x| = |R_h x|. Computed in float64 once per weight (cached while the weight is unchanged)."""
    weight = _weight(projection)  # [hidden, heads x head size]
    if weight.device.type == "meta":
        raise AttnprobeError("the output projection's weights are not loaded (a placeholder on the meta device), so "
                             "the value-weighted scores cannot be computed: pass --no-value-weighted")
    offloaded = projection.weight.device.type == "meta"  # read from accelerate's map: a new tensor on every read
    identity = ("offloaded", heads) if offloaded else (weight.data_ptr(), weight._version, weight.device,
                                                       weight.dtype, heads)
    cached = _FACTORS.get(projection)
    if cached is not None and cached[0] == identity:
        return cached[1]
    hidden = weight.shape[0]
    slices = weight.detach().double().reshape(hidden, heads, -1).transpose(0, 1)  # [head, hidden, head size]
    factors = torch.linalg.qr(slices, mode="r").R.float().contiguous()  # [head, k, head size]
    _FACTORS[projection] = (identity, factors)
    return factors


def head_norms(x: Tensor, factors: Tensor) -> Tensor:
    """|W_O^h x| of per-head vectors x [batch, head, n, head size]: [batch, head, n], float32.

    One batched product per head ([batch x n, head size] times R_h^T), not a broadcast over the batch."""
    batch, heads, n, dim = x.shape
    factors = factors.to(x.device)  # [head, k, head size]: an offloaded projection's live on the CPU
    rows = x.float().transpose(0, 1).reshape(heads, batch * n, dim)  # [head, batch x n, head size]
    moved = torch.bmm(rows, factors.transpose(-1, -2))  # [head, batch x n, k]
    return torch.linalg.vector_norm(moved, dim=-1).view(heads, batch, n).transpose(0, 1)  # [batch, head, n]


def key_norms(value: Tensor, factors: Tensor) -> Tensor:
    """|f_h(x_j)| = |W_O^h v_j| of every key for every query head: [batch, head, key], float32.

    `value` [batch, kv head, key, head size]: query head h reads KV head h // (heads / kv heads), so each KV
    head's values meet its group's factors side by side in one product.
    """
    batch, kv_heads, n, dim = value.shape
    factors = factors.to(value.device)  # [head, k, head size]: an offloaded projection's live on the CPU
    heads, k = factors.shape[0], factors.shape[1]
    groups = heads // kv_heads
    rows = value.float().transpose(0, 1).reshape(kv_heads, batch * n, dim)  # [kv head, batch x key, head size]
    both = factors.view(kv_heads, groups * k, dim).transpose(-1, -2)  # [kv head, head size, group x k]
    moved = torch.bmm(rows, both).view(kv_heads, batch, n, groups, k)  # [kv head, batch, key, group, k]
    norms = torch.linalg.vector_norm(moved, dim=-1)  # [kv head, batch, key, group]
    return norms.permute(1, 0, 3, 2).reshape(batch, heads, n)  # [batch, head, key]


def log_weights(norms: Tensor) -> Tensor:
    """ln |f_h(x_j)|, the additive bias that turns attention into value-weighted attention: [batch, head, key].

    A key of norm 0 gets ZERO_NORM (-1e30): its weight exp(s - 1e30) is exactly 0, yet added to a score the float32
    minimum marks as masked it stays finite, so no -inf - -inf makes a NaN."""
    return torch.where(norms > 0, norms.clamp(min=torch.finfo(torch.float32).tiny).log(), ZERO_NORM)  # [b, h, key]


def weighted_map(p: Tensor, norms: Tensor) -> Tensor:
    """The value-weighted map a_ij |f_h(x_j)| / sum_k a_ik |f_h(x_k)| of a whole map p [batch, head, query, key]
    (the eager path); NaN in a row whose every attended key has norm 0."""
    weighted = p.float() * norms[:, :, None, :]  # [batch, head, query, key]
    return weighted / weighted.sum(dim=-1, keepdim=True)  # [batch, head, query, key]


# ---- the eager path: the model's own eager function, keeping the values ---------------------------------------

_CAPTURED: ContextVar[dict[int, Tensor] | None] = ContextVar("attnprobe_values", default=None)


EAGER_FUNCTION = "eager_attention_forward"  # the name every transformers 5 modeling file gives its eager attention


def eager_function(module: nn.Module) -> Callable | None:
    """The eager attention function the module's forward calls: `eager_attention_forward` of the modeling file that
    defines the forward, or else of the module's own modeling file; None when neither has one.

    The forward may be wrapped (transformers 5.24 wraps attention forwards in `deprecate_kwarg`), so its own
    `__globals__` can be the decorator's module: the function is looked up through `inspect.unwrap` and through the
    defining class's module in `sys.modules`, never through the wrapper."""
    for owner in type(module).__mro__:
        forward = owner.__dict__.get("forward")
        if forward is None:
            continue
        found = getattr(inspect.unwrap(forward), "__globals__", {}).get(EAGER_FUNCTION)
        if found is None:
            found = getattr(sys.modules.get(owner.__module__), EAGER_FUNCTION, None)
        if callable(found):
            return found
        break  # the forward that runs is this class's: another class's function would not be the one it calls
    found = getattr(sys.modules.get(type(module).__module__), EAGER_FUNCTION, None)
    return found if callable(found) else None


def eager_with_values(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      *args: Any, **kwargs: Any) -> Any:
    """The module's own eager attention, unchanged; its values [batch, kv head, key, head size] are kept."""
    function = eager_function(module)
    if function is None:
        raise AttnprobeError(f"{type(module).__name__} has no {EAGER_FUNCTION} attnprobe can call, so the eager path "
                             "cannot read its values: pass --no-value-weighted")
    captured = _CAPTURED.get()
    if captured is not None:
        captured[id(module)] = value
    return function(module, query, key, value, attention_mask, *args, **kwargs)


def take_values(module: nn.Module) -> Tensor:
    """The values [batch, kv head, key, head size] that `module` attended over in the last forward pass under
    `capturing_values` (handed over once)."""
    captured = _CAPTURED.get()
    value = None if captured is None else captured.pop(id(module), None)
    if value is None:
        raise AttnprobeError(f"{type(module).__name__} did not pass its values through attnprobe's eager attention: "
                             "pass --no-value-weighted")
    return value


@contextmanager
def capturing_values(model: nn.Module) -> Iterator[dict[int, Tensor]]:
    """Run the model's own eager attention under `attnprobe_eager` for the duration; the dict it yields maps
    id(attention module) -> that module's values of the last forward pass."""
    from transformers.masking_utils import eager_mask

    captured: dict[int, Tensor] = {}
    with using_attention(model, EAGER_NAME, eager_with_values, eager_mask):
        token = _CAPTURED.set(captured)
        try:
            yield captured
        finally:
            _CAPTURED.reset(token)
