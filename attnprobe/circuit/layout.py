"""Where a decoder computes what the circuit graph reads: its norms, MLPs, query/key/value maps and output
projections, found by what they do and checked against one short run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe.circuit.graph import Graph
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, forward_kwargs
from attnprobe.patching import Parts, find_parts, module_width

MLP_NAMES = ("mlp", "feed_forward", "ffn")


@dataclass(frozen=True)
class Layout:
    """A decoder's parts as the graph reads them."""

    parts: Parts
    graph: Graph
    ln1: list[nn.Module]  # per block, the norm whose output the attention reads
    ln2: list[nn.Module]  # per block, the norm whose output the MLP reads
    mlps: list[nn.Module]
    qkv: list[list[tuple[nn.Module, slice]]]  # per block, per q/k/v receiver: the map and its slice of the output
    w_out: list[Tensor]  # per block, the output projection as [hidden, heads, head_dim]


def find_layout(loaded: LoadedModel) -> Layout:
    """The parts of a pre-norm decoder the circuit graph needs, found by what they do; refuses a model whose residual
    stream is not the sum of what its attention and MLPs add."""
    parts = find_parts(loaded)
    if parts.final is None:
        raise AttnprobeError(f"{loaded.spec}: found no norm after the last block: circuits read the logits' input "
                             "there")
    graph = Graph(len(parts.blocks), parts.heads, parts.kv_heads)
    seen = probe(loaded, parts)
    ln1, ln2, mlps = [], [], []
    for layer, block in enumerate(parts.blocks):
        found = block_parts(loaded, parts, layer, block, seen)
        ln1.append(found[0])
        ln2.append(found[1])
        mlps.append(found[2])
    qkv = [qkv_maps(parts, layer) for layer in range(graph.layers)]
    w_out = [out_weight(module, parts) for module in parts.projections]
    return Layout(parts, graph, ln1, ln2, mlps, qkv, w_out)


def probe(loaded: LoadedModel, parts: Parts) -> dict[int, tuple[tuple, dict, Any]]:
    """One short run recording every block module's arguments and output, by module id."""
    seen: dict[int, tuple[tuple, dict, Any]] = {}

    def note(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        seen[id(module)] = (args, kwargs, output)

    modules = [m for block in parts.blocks for m in block.modules()]
    handles = [m.register_forward_hook(note, with_kwargs=True) for m in modules]
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(1, 5, device=loaded.device) % vocab)[None]  # [1, 4]
    try:
        with torch.no_grad():
            loaded.model(**forward_kwargs(loaded.model, ids, torch.ones_like(ids)))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first(value: Any) -> Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def hidden_of(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def block_parts(loaded: LoadedModel, parts: Parts, layer: int, block: nn.Module,
                seen: dict) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ln1, ln2, mlp) of one block, checked: the MLP's input norm reads x + attention, the block returns that plus
    the MLP's output, and the heads' contributions add up to the attention's output."""
    unsupported = (f"{loaded.spec}: {type(block).__name__} does not add its attention's and MLP's outputs to the "
                   "residual stream after a norm at their input (post-norm blocks, norms after attention or the MLP "
                   "as in Gemma 2, parallel blocks as in GPT-NeoX): circuit supports pre-norm decoders such as GPT-2, "
                   "Llama, Qwen and Mistral")
    attention = parts.attentions[layer]
    mlp = next((getattr(block, n) for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    if mlp is None or id(attention) not in seen or id(mlp) not in seen:
        raise AttnprobeError(unsupported)
    inner = {id(m) for m in attention.modules()} | {id(m) for m in mlp.modules()}

    def producer(tensor: Tensor) -> nn.Module | None:
        return next((m for m in block.modules() if m is not block and id(m) not in inner and id(m) in seen
                     and first(seen[id(m)][2]) is tensor), None)

    x = hidden_of(*seen[id(block)][:2])  # [1, seq, hidden]
    attn_in = hidden_of(*seen[id(attention)][:2])
    mlp_in = hidden_of(*seen[id(mlp)][:2])
    ln1, ln2 = producer(attn_in), producer(mlp_in)
    if ln1 is None or ln2 is None:
        raise AttnprobeError(unsupported)
    middle = hidden_of(*seen[id(ln2)][:2])  # [1, seq, hidden]: the stream the MLP's norm reads
    attn_out = first(seen[id(attention)][2])
    out = first(seen[id(block)][2])
    mlp_out = first(seen[id(mlp)][2])
    z = first(seen[id(parts.projections[layer])][0])  # [1, seq, heads * head_dim]
    heads = torch.einsum("bshd,ohd->bso", z.unflatten(-1, (parts.heads, parts.head_dim)),
                         out_weight(parts.projections[layer], parts))  # [1, seq, hidden]
    bias = getattr(parts.projections[layer], "bias", None)
    if bias is not None:
        heads = heads + bias
    scale = float(out.detach().abs().max()) or 1.0
    for got, want in ((middle, x + attn_out), (out, middle + mlp_out), (heads, attn_out)):
        if got.shape != want.shape or float((got - want).detach().abs().max()) > 1e-4 * scale:
            raise AttnprobeError(unsupported)
    return ln1, ln2, mlp


def qkv_maps(parts: Parts, layer: int) -> list[tuple[nn.Module, slice]]:
    """Per q/k/v receiver of the layer (query heads, key heads, value heads), the map computing it and its slice."""
    maps = parts.qkv[layer]
    d, q_width, kv_width = parts.head_dim, parts.heads * parts.head_dim, parts.kv_heads * parts.head_dim
    widths = [module_width(m) for m in maps]
    if len(maps) >= 3 and widths[-3:] == [q_width, kv_width, kv_width]:
        modules, offsets = maps[-3:], (0, 0, 0)
    elif maps and widths[-1] == q_width + 2 * kv_width and hasattr(parts.attentions[layer], "split_size"):
        modules, offsets = [maps[-1]] * 3, (0, q_width, q_width + kv_width)  # GPT-2's c_attn: [q | k | v]
    else:
        raise AttnprobeError(f"{type(parts.attentions[layer]).__name__} computes its queries, keys and values in a "
                             "layout circuit does not know")
    out = [(modules[0], slice(h * d, (h + 1) * d)) for h in range(parts.heads)]
    for kind in (1, 2):
        out += [(modules[kind], slice(offsets[kind] + g * d, offsets[kind] + (g + 1) * d))
                for g in range(parts.kv_heads)]
    return out


def out_weight(module: nn.Module, parts: Parts) -> Tensor:
    """The output projection's weight as [hidden, heads, head_dim] (nn.Linear or GPT-2's Conv1D)."""
    weight = module.weight if isinstance(module, nn.Linear) else module.weight.t()  # [hidden, heads * head_dim]
    return weight.unflatten(1, (parts.heads, parts.head_dim))  # [hidden, heads, head_dim]


def project(module: nn.Module, x: Tensor, cut: slice) -> Tensor:
    """The slice `cut` of a linear map's output on x [..., hidden] (nn.Linear or GPT-2's Conv1D)."""
    bias = getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        return nn.functional.linear(x, module.weight[cut], None if bias is None else bias[cut])
    out = x @ module.weight[:, cut]  # [..., width]
    return out if bias is None else out + bias[cut]


def slice_weight(module: nn.Module, cut: slice) -> Tensor:
    """The rows of a linear map that compute its output slice `cut`: [width, hidden]."""
    return module.weight[cut] if isinstance(module, nn.Linear) else module.weight[:, cut].t()
