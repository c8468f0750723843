"""EAP and EAP-IG: every edge's score from clean and corrupt forwards and backward passes (GradDrop as an option)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from attnprobe.ablate import fast_attention
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout, first, hidden_of, slice_weight
from attnprobe.circuit.qkfix import Kept, keep_attention, post_norm_visit, qk_receivers, qk_scores
from attnprobe.circuit.runs import (
    Metric,
    Pass,
    Prompts,
    chunks,
    first_input,
    forward,
    measure,
    outputs,
    part,
    real_positions,
)
from attnprobe.circuit.stream import Transported, transported
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel


def attribute(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, *, steps: int = 1,
              grad_drop: bool = False, qk_fix: bool = False,
              progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """EAP (steps 1) or EAP-IG (steps m) scores of every edge, [senders, receivers] float64 (0 off the graph): the
    first-order change of the mean metric when the edge is patched to the corrupt run. The score is linear in the
    gradient, so EAP-IG sums each receiver's gradient over the steps and contracts once.

    grad_drop (AtP*'s GradDrop, Kramar et al. 2024): the scores again with the gradient through each block's
    contribution to the residual stream dropped in turn, sum over blocks l of |score_l| / (layers - 1): an edge
    whose paths cancel in the full gradient shows where one block's paths are left out. Unsigned; layers times the
    passes.

    qk_fix (AtP*'s QK fix, qkfix.py): the edges into queries and keys scored with the patched attention pattern
    recomputed exactly, from the clean run's gradient (the k = m point: see qkfix.py); on every block shape."""
    graph = layout.graph
    if grad_drop and layout.post_norm:
        raise AttnprobeError("--grad-drop on a post-norm decoder: a block's contribution passes its norms, so there is "
                             "no residual add to drop; use it on pre-norm or sandwich-norm decoders")
    scores = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)  # [senders, receivers]
    parts_done, parts_list = 0, chunks(prompts, layout, gradients=True)
    with fast_attention(loaded.model):
        for rows in parts_list:
            sub = part(prompts, rows)
            diff, clean_in, start = sender_diffs(loaded, layout, sub)  # start: the corrupt input [pairs, seq, hidden]
            folded = not layout.post_norm  # clean_u still to subtract from diff, in the clean point's pass
            kept = keep_attention(loaded, layout, sub) if qk_fix else None
            drops: list[int | None] = list(range(graph.layers)) if grad_drop else [None]
            for i, dropped in enumerate(drops):
                grads = torch.zeros(len(graph.receivers), *clean_in.shape, device=clean_in.device)  # [receivers, ...]
                g_z: dict[int, Tensor] | None = None
                # the clean point first: its pass completes diff (clean_u subtracted: no forward of its own), and the
                # QK fix reads its gradient alone
                for k in (steps, *range(1, steps)):
                    point = clean_in if k == steps else start + (k / steps) * (clean_in - start)  # [pairs, seq, hid]
                    record = diff if folded and i == 0 and k == steps else None
                    wanted = {} if kept is not None and k == steps else None
                    receiver_gradients(loaded, layout, sub, metric, point.clone().requires_grad_(True), grads,
                                       dropped, record, wanted)
                    g_z = wanted if wanted is not None else g_z
                    if record is not None:
                        diff *= real_positions(sub)  # [senders, pairs, seq, hidden]: corrupt_u - clean_u
                    if progress:
                        parts_done += 1
                        progress(parts_done, steps * len(drops) * len(parts_list))
                part_scores, fixed = contract(layout, kept, sub, diff, grads, g_z)
                part_scores = part_scores.cpu() / steps  # [senders, receivers]: scores are kept on the CPU
                if fixed is not None:
                    part_scores = torch.where(qk_receivers(graph), fixed.cpu(), part_scores)
                scores += part_scores if dropped is None else part_scores.abs() / max(1, graph.layers - 1)
    return (scores / prompts.mask.shape[0]).numpy() * graph.mask


def contract(layout: Layout, kept: Kept | None, sub: Prompts, diff: Tensor | Transported, grads: Tensor,
             g_z: dict[int, Tensor] | None) -> tuple[Tensor, Tensor | None]:
    """Every edge's score summed over the steps' gradients grads [receivers, pairs, seq, hidden] and, with the QK fix
    (kept and the clean point's g_z), the fixed scores of the edges into queries and keys: ([senders, receivers],
    the same or None) float64. Post-norm: the fix reads each block's input's carried diffs as the contraction
    carries them."""
    fixed = None
    with torch.inference_mode():
        if isinstance(diff, Transported):
            fixed = None if g_z is None else torch.zeros(len(layout.graph.senders), len(layout.graph.receivers),
                                                         dtype=torch.float64)  # [senders, receivers]
            visit = None if fixed is None else post_norm_visit(layout, kept, sub, g_z, fixed)
            return diff.scores(grads, visit), fixed
        if g_z is not None:
            fixed = qk_scores(layout, kept, sub, diff, g_z)
    return contract_all(layout.graph, diff, grads), fixed


def sender_diffs(loaded: LoadedModel, layout: Layout, sub: Prompts) -> tuple[Tensor | Transported, Tensor, Tensor]:
    """The senders' diffs, the clean and the corrupt first-block inputs. Pre-norm: the corrupt run's outputs
    [senders, pairs, seq, hidden], from which the gradient pass at the clean point subtracts clean_u (no forward of
    its own); post-norm: both runs' records, carried to each receiver's point as they are contracted."""
    if layout.post_norm:
        return transported(loaded, layout, sub)
    diff, _ = outputs(loaded, layout, sub, sub.corrupt)  # [senders, pairs, seq, hidden]
    return diff, first_input(loaded, layout, sub.clean, sub.mask), diff[0].clone()


def receiver_gradients(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, embed: Tensor,
                       into: Tensor, dropped: int | None = None, record: Tensor | None = None,
                       g_z: dict[int, Tensor] | None = None) -> None:
    """Adds dM/d(input_v) of every receiver, summed over pairs' metrics, to into [receivers, pairs, seq, hidden],
    from one forward and backward with the first block's input `embed` [pairs, seq, hidden] (and, `dropped`, no
    gradient through that block's contribution to the residual stream); `record` [senders, pairs, seq, hidden], if
    given, has each sender's output in this forward subtracted; `g_z`, if given, gets each layer's dM/dz at its
    output projection's input (none for a dropped block's layer)."""
    graph = layout.graph
    run = Pass(embed=embed, grads=True, record=record, subtract=True, g_z=g_z)
    handles = [] if dropped is None else [layout.parts.blocks[dropped].register_forward_hook(drop_hook,
                                                                                            with_kwargs=True)]
    try:
        with torch.enable_grad():
            final = forward(loaded, layout, prompts.clean, prompts.mask, run)
            value = measure(layout, metric, final, prompts).sum()
            torch.autograd.grad(value, [embed])
    finally:
        for handle in handles:
            handle.remove()
    for layer in range(graph.layers):
        base = layer * graph.per_layer
        into[base : base + graph.per_layer - 1] += qkv_gradients(layout, run, layer)
        if layer in run.g_mlp:  # none where a dropped block cut it off
            into[base + graph.per_layer - 1] += run.g_mlp[layer]
    into[-1] += run.g_logits[0]


def drop_hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: the block's output with its contribution (output - input) cut from the backward pass."""
    x = hidden_of(args, kwargs)  # [rows, seq, hidden]
    out = first(output)
    kept = x + (out - x).detach()  # [rows, seq, hidden]: the same values, gradient through the skip alone
    return (kept, *output[1:]) if isinstance(output, (tuple, list)) else kept


def contract_all(graph: Graph, diff: Tensor, grads: Tensor) -> Tensor:
    """sum over pairs and positions of diff_u . grad_v for every pair of a sender and a receiver, as one matrix
    product [senders, n x hidden] @ [n x hidden, receivers] (each operand read once), zero off the graph:
    [senders, receivers] float64."""
    product = diff.flatten(1) @ grads.flatten(1).to(diff.dtype).t()  # [senders, receivers]
    return product.double() * torch.from_numpy(graph.mask).to(product.device)


def qkv_gradients(layout: Layout, run: Pass, layer: int) -> Tensor:
    """dM/d(the residual stream) through each q/k/v receiver's own path: its slice's gradient through its rows of
    the map, then back through the block's input norm at the run's input: [receivers, rows, seq, hidden]."""
    maps = layout.qkv[layer]
    x = run.xs[layer].detach()  # [rows, seq, hidden]
    if any((layer, id(m)) not in run.g_maps for m, _ in maps):  # no gradient reached them (a block dropped)
        return x.new_zeros(len(maps), *x.shape)
    cotangents = x.new_empty(len(maps), *x.shape)  # [receivers, rows, seq, hidden]
    for j, (m, cut) in enumerate(maps):
        torch.matmul(run.g_maps[(layer, id(m))][..., cut].to(x.dtype), slice_weight(m, cut).detach().to(x.dtype),
                     out=cotangents[j])
    norm = layout.ln1_norms[layer] if layout.ln1_norms else None
    if norm is not None:  # a LayerNorm or RMSNorm: its backward in closed form, one pass for every receiver
        return norm.backward(x, cotangents)
    with torch.enable_grad():  # another norm: run once, its backward batched over the receivers (vmap)
        x = x.clone().requires_grad_(True)
        (grads,) = torch.autograd.grad(layout.ln1[layer](x), [x], cotangents, is_grads_batched=True)
    return grads
