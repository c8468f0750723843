"""One instrumented forward (senders' outputs recorded, receivers' inputs patched, their gradients kept) and the
pairs it runs on."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe.batching import pad_batch
from attnprobe.circuit.layout import Layout, Norm, first, hidden_of, project
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, forward_kwargs
from attnprobe.tokens import encode

BUFFER_MIB = 1024  # one chunk's buffer of every sender's output [senders, rows, seq, hidden]

Metric = Callable[[Tensor, Sequence[Any]], Tensor]  # (logits [rows, vocab] float32, the rows' pairs) -> [rows]
Deltas = list[tuple[int, slice, Tensor]]  # (receiver within its layer, rows, delta [rows, seq, hidden])


@dataclass
class Pass:
    """What one forward does besides the model's own computation.

    record: [senders, rows, seq, hidden], each sender's output written (or, subtract, subtracted) as computed;
    embed: the first block's input instead of the embeddings; patch(layer, j_first, j_last): the deltas of the
    receivers [j_first, j_last) of a layer (layer = layers: the logits); grads: collect dM/d(input) per receiver;
    stats (post-norm): a dict to fill with each stream norm's statistics; g_z (with grads, for the QK fix): a dict
    to fill with each layer's dM/dz, the gradient at its output projection's input (none where no gradient reached
    it)."""

    record: Tensor | None = None
    subtract: bool = False
    embed: Tensor | None = None
    patch: Callable[[int, int, int], Deltas] | None = None
    grads: bool = False
    stats: dict[int, Tensor] | None = None  # post-norm: per stream norm, the run's 1 / sigma [rows, seq, 1]
    g_z: dict[int, Tensor] | None = None  # per layer, dM/dz at the output projection's input [rows, seq, heads x dim]
    xs: dict[int, Tensor] = field(default_factory=dict)  # per layer, the block's input
    g_maps: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (layer, id(map)) -> dM/d(map output)
    g_mlp: dict[int, Tensor] = field(default_factory=dict)  # per layer, dM/d(MLP's norm input) through the MLP
    g_logits: list[Tensor] = field(default_factory=list)


def write(run: Pass, start: int, values: Tensor) -> None:
    """Senders [start, start + len(values)) of the record get values [n, rows, seq, hidden] (never part of a
    gradient: a gradient pass records too)."""
    target = run.record[start : start + values.shape[0]]  # [n, rows, seq, hidden]
    values = values.detach()
    if run.subtract:
        target -= values.to(target.dtype)
    else:
        target.copy_(values)


@contextmanager
def instrumented(layout: Layout, run: Pass) -> Iterator[None]:
    """The hooks that carry out `run` on every block the model (or run_blocks) calls, for the duration."""
    parts, graph = layout.parts, layout.graph
    handles = []
    nq = graph.heads + 2 * graph.kv_heads
    for layer, block in enumerate(parts.blocks):
        handles.append(block.register_forward_pre_hook(block_hook(layout, run, layer), with_kwargs=True))
        if layout.shape == "sandwich":
            handles.append(parts.projections[layer].register_forward_hook(sandwich_heads_hook(layout, run, layer)))
        else:
            handles.append(parts.projections[layer].register_forward_pre_hook(heads_hook(layout, run, layer)))
        if run.grads and run.g_z is not None:
            handles.append(parts.projections[layer].register_forward_pre_hook(z_grad_hook(run, layer)))
        handles.append(layout.mlps[layer].register_forward_hook(mlp_hook(layout, run, layer)))
        handles.append(layout.ln2[layer].register_forward_pre_hook(input_hook(run, layer, nq, layer)))
        for module in {id(m): m for m, _ in layout.qkv[layer]}.values():
            handles.append(module.register_forward_hook(qkv_hook(layout, run, layer, module)))
    if layout.post_norm:
        handles.append(parts.blocks[-1].register_forward_hook(output_hook(run, graph.layers)))
        if run.stats is not None:
            handles += [norm.module.register_forward_pre_hook(stats_hook(run, k, norm))
                        for k, norm in enumerate(layout.stream)]
    else:
        handles.append(parts.final.register_forward_pre_hook(input_hook(run, graph.layers, 0, None)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def block_hook(layout: Layout, run: Pass, layer: int) -> Callable:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        changed = None
        if layer == 0 and run.embed is not None:
            if args:
                args = (run.embed, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": run.embed}
            changed = (args, kwargs)
        x = hidden_of(args, kwargs)  # [rows, seq, hidden]
        run.xs[layer] = x.detach()  # no graph held: the gradient hooks refer to `run`, a cycle through autograd
        if layer == 0 and run.record is not None:
            write(run, 0, x.detach()[None])
        return changed

    return hook


def heads_hook(layout: Layout, run: Pass, layer: int) -> Callable:
    def hook(_module: nn.Module, args: tuple) -> None:
        if run.record is None:
            return
        z = args[0].detach().unflatten(-1, (layout.parts.heads, layout.parts.head_dim))  # [rows, seq, heads, dim]
        contributions = torch.einsum("bshd,ohd->hbso", z, layout.w_out[layer].detach())  # [heads, rows, seq, hidden]
        write(run, layout.graph.sender_index(layer, 0), contributions)

    return hook


def sandwich_heads_hook(layout: Layout, run: Pass, layer: int) -> Callable:
    """Forward hook on a sandwich block's output projection: each head's contribution through the post-attention
    norm at this run's own statistics (so that the heads add up to the norm's output)."""
    norm = layout.post_attn[layer]

    def hook(_module: nn.Module, args: tuple, output: Tensor) -> None:
        if run.record is None:
            return
        z = args[0].detach().unflatten(-1, (layout.parts.heads, layout.parts.head_dim))  # [rows, seq, heads, dim]
        contributions = torch.einsum("bshd,ohd->hbso", z, layout.w_out[layer].detach())  # [heads, rows, seq, hidden]
        write(run, layout.graph.sender_index(layer, 0), norm.frozen(contributions, norm.inverse(output)))

    return hook


def z_grad_hook(run: Pass, layer: int) -> Callable:
    """Pre-hook on an output projection: the gradient at its input z (every head's output before the projection),
    through the model itself (norms after it included), kept in run.g_z."""

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        z = args[0]  # [rows, seq, heads x head_dim]
        if not z.requires_grad:
            return None
        z = z.view_as(z)  # a node of its own: the gradient through the projection alone
        z.register_hook(lambda g: run.g_z.__setitem__(layer, g.detach()))
        return (z, *args[1:])

    return hook


def mlp_hook(layout: Layout, run: Pass, layer: int) -> Callable:
    def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
        if run.record is not None:
            value = first(output).detach().reshape(run.xs[layer].shape)  # [rows, seq, hidden] (OPT's fc2: flattened)
            write(run, layout.graph.sender_index(layer), value[None])

    return hook


def stats_hook(run: Pass, k: int, norm: Norm) -> Callable:
    """Pre-hook on a post-norm stream norm: the run's 1 / sigma kept."""

    def hook(_module: nn.Module, args: tuple) -> None:
        shape = run.xs[k // 2].shape[:2]
        run.stats[k] = norm.inverse(args[0]).view(*shape, 1)  # [rows, seq, 1]

    return hook


def input_hook(run: Pass, layer: int, j: int, grad_layer: int | None) -> Callable:
    """Pre-hook on an MLP's input norm (or the final norm; post-norm: on the MLP's first map): its deltas added, its
    gradient kept."""

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        given = args[0]  # [rows, seq, hidden] (OPT's fc1: [rows x seq, hidden])
        x = given if given.dim() == 3 else given.view(*run.xs[layer].shape[:2], -1)  # [rows, seq, hidden]
        deltas = run.patch(layer, j, j + 1) if run.patch else []
        if deltas:
            x = x.clone()  # given may be the residual stream itself (post-norm): the receiver's copy alone moves
        for _, rows, delta in deltas:
            x[rows] = x[rows] + delta.to(x.dtype)
        if run.grads and x.requires_grad:
            x = x.view_as(x)  # a node of its own: the gradient through this norm alone
            store = run.g_logits.append if grad_layer is None else (lambda g: run.g_mlp.__setitem__(grad_layer, g))
            x.register_hook(lambda g: store(g.detach()))
        return None if x is given else (x.view(given.shape), *args[1:])

    return hook


def output_hook(run: Pass, layers: int) -> Callable:
    """Forward hook on a post-norm model's last block: the logits receiver's deltas and gradient at its output."""
    inner = input_hook(run, layers, 0, None)

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        changed = inner(_module, (first(output),))
        if changed is None:
            return None
        return (changed[0], *output[1:]) if isinstance(output, (tuple, list)) else changed[0]

    return hook


def qkv_hook(layout: Layout, run: Pass, layer: int, module: nn.Module) -> Callable:
    """Forward hook on a query/key/value map: the slices of receivers with deltas recomputed from norm(x + delta);
    its output's gradient kept."""
    mine = [j for j, (m, _) in enumerate(layout.qkv[layer]) if m is module]

    def hook(_module: nn.Module, _args: tuple, output: Tensor) -> Tensor | None:
        out = output
        if run.patch:
            for j, rows, delta in run.patch(layer, mine[0], mine[-1] + 1):
                if j not in mine:
                    continue
                out = out.clone() if out is output else out
                x = run.xs[layer][rows]  # [rows, seq, hidden]
                cut = layout.qkv[layer][j][1]
                normed = layout.ln1[layer](x + delta.to(x.dtype))  # [rows, seq, hidden]
                out[rows, :, cut] = project(module, normed, cut).to(out.dtype)
        if run.grads and out.requires_grad:
            out = out.view_as(out)
            out.register_hook(lambda g: run.g_maps.__setitem__((layer, id(module)), g.detach()))
        return None if out is output else out

    return hook


# ---- pairs -----------------------------------------------------------------------------------------------


@dataclass
class Prompts:
    """Tokenized pairs: clean and corrupt ids of one length per pair, right-padded to the longest pair."""

    clean: Tensor  # [pairs, seq]
    corrupt: Tensor  # [pairs, seq]
    mask: Tensor  # [pairs, seq]
    last: Tensor  # [pairs]
    pairs: list[Any]


def tokenize(loaded: LoadedModel, pairs: Sequence[Any]) -> Prompts:
    """The pairs' prompts tokenized as `analyze` does (under --bos); a pair whose prompts differ in length is
    refused with its number."""
    if not pairs:
        raise AttnprobeError("no prompt pairs: give at least one")
    clean = encode(loaded, [p.clean for p in pairs])["input_ids"]
    corrupt = encode(loaded, [p.corrupt for p in pairs])["input_ids"]
    for k, (a, b) in enumerate(zip(clean, corrupt), start=1):
        if len(a) != len(b):
            raise AttnprobeError(f"pair {k}: the clean prompt is {len(a)} tokens and the corrupt one {len(b)}: "
                                 "edge patching needs both of one length (change a word so they tokenize alike)")
    clean_ids, mask = pad_batch([list(t) for t in clean], loaded.device)  # [pairs, seq]
    corrupt_ids, _ = pad_batch([list(t) for t in corrupt], loaded.device)  # [pairs, seq]
    return Prompts(clean_ids, corrupt_ids, mask, mask.sum(1) - 1, list(pairs))


def chunks(prompts: Prompts, layout: Layout, gradients: bool = False) -> list[slice]:
    """Pairs in chunks whose buffer of every sender's output [senders, pairs, seq, hidden] (post-norm: three, both
    runs' records and their carried diff) and with `gradients`, of every receiver's gradient, fits BUFFER_MIB."""
    graph, hidden = layout.graph, layout.w_out[0].shape[0]
    rows = len(graph.senders) * (3 if layout.post_norm else 1) + (len(graph.receivers) if gradients else 0)
    per_pair = rows * prompts.mask.shape[1] * hidden * 4
    size = max(1, (BUFFER_MIB << 20) // per_pair)
    count = prompts.mask.shape[0]
    return [slice(s, min(s + size, count)) for s in range(0, count, size)]


def part(prompts: Prompts, rows: slice) -> Prompts:
    return Prompts(prompts.clean[rows], prompts.corrupt[rows], prompts.mask[rows], prompts.last[rows],
                   prompts.pairs[rows])


def logits_of(layout: Layout, final: Tensor, prompts: Prompts) -> Tensor:
    """The logits at each row's last position, float32 [rows, vocab], from the final hidden state [rows, seq, hid]."""
    rows = torch.arange(final.shape[0], device=final.device)  # [rows]
    last = prompts.last.repeat(final.shape[0] // prompts.last.shape[0])  # [rows]
    return layout.parts.logits(layout.parts.head(final[rows, last])).float()  # [rows, vocab]


def measure(layout: Layout, metric: Metric, final: Tensor, prompts: Prompts) -> Tensor:
    """The metric of every row of final [copies x pairs, seq, hidden]: [copies, pairs]."""
    copies = final.shape[0] // prompts.last.shape[0]
    values = metric(logits_of(layout, final, prompts), list(prompts.pairs) * copies)  # [rows]
    return values.view(copies, -1)  # [copies, pairs]


def forward(loaded: LoadedModel, layout: Layout, ids: Tensor, mask: Tensor, run: Pass) -> Tensor:
    """The model on ids with `run`'s hooks: the last hidden state [rows, seq, hidden]."""
    with instrumented(layout, run):
        return loaded.model(**forward_kwargs(loaded.model, ids, mask)).last_hidden_state


class Reached(Exception):
    """Raised by first_input's hook: the run has what it came for."""


@torch.no_grad()
def first_input(loaded: LoadedModel, layout: Layout, ids: Tensor, mask: Tensor) -> Tensor:
    """The first block's input on ids [rows, seq, hidden] (the embeddings as the model sums them), without running
    the blocks."""
    seen: list[Tensor] = []

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(hidden_of(args, kwargs))
        raise Reached

    handle = layout.parts.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        loaded.model(**forward_kwargs(loaded.model, ids, mask))
    except Reached:
        pass
    finally:
        handle.remove()
    return seen[0]


def sender_buffer(layout: Layout, rows: int, seq: int, device: torch.device) -> Tensor:
    hidden = layout.w_out[0].shape[0]
    return torch.zeros(len(layout.graph.senders), rows, seq, hidden, device=device)  # [senders, rows, seq, hidden]


@torch.no_grad()
def outputs(loaded: LoadedModel, layout: Layout, prompts: Prompts, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Every sender's output on ids [senders, pairs, seq, hidden] and the last hidden state (no_grad, not inference
    mode: a gradient pass may write the record)."""
    buffer, final, _ = recorded(loaded, layout, prompts, ids)
    return buffer, final


@torch.no_grad()
def recorded(loaded: LoadedModel, layout: Layout, prompts: Prompts,
             ids: Tensor) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
    """outputs() and, post-norm, each stream norm's statistics (see stream.py)."""
    buffer = sender_buffer(layout, *ids.shape, loaded.device)
    run = Pass(record=buffer, stats={} if layout.post_norm else None)
    final = forward(loaded, layout, ids, prompts.mask, run)
    return buffer, final, run.stats or {}


def real_positions(prompts: Prompts) -> Tensor:
    return prompts.mask.bool()[None, :, :, None]  # [1, pairs, seq, 1]
