"""Exact edge patching: each chosen edge alone patched to the corrupt run, many edges a batched pass; and sets of
edges patched together (exact_sets), many sets a batched pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from attnprobe.ablate import fast_attention, run_blocks, tile
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout, hidden_of
from attnprobe.circuit.runs import (
    BUFFER_MIB,
    Deltas,
    Metric,
    Pass,
    Prompts,
    chunks,
    instrumented,
    measure,
    part,
    real_positions,
    recorded,
)
from attnprobe.circuit.stream import Transported
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

COPY_TOKENS = 16_384  # positions (copies x pairs x seq) in one batched exact-patching pass


@torch.inference_mode()
def exact(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric,
          edges: Sequence[tuple[int, int]], progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The mean metric with each edge (sender, receiver) alone patched to the corrupt run, minus the clean mean
    [edges] float64: the pairs' copies run from the receiver's layer on, several edges a pass."""
    graph = layout.graph
    check_edges(graph, edges)

    def prepare(sub: Prompts, kept: Kept, diff: Tensor, stats: dict) -> tuple[int, Callable[[list[int]], Tensor]]:
        if layout.post_norm:  # each edge's diff carried to its receiver's point
            diff = Transported(layout, diff, stats, kept.record, kept.stats, real_positions(sub))
        else:
            diff -= kept.record
            diff *= real_positions(sub)
        return max(1, COPY_TOKENS // sub.mask.numel()), lambda chosen: patched_copies(
            layout, kept, sub, metric, [edges[e] for e in chosen], diff)

    return patched_means(loaded, layout, prompts, metric, [graph.receiver_layer(r) for _, r in edges], prepare,
                         progress)


def patched_means(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, starts: Sequence[int],
                  prepare: Callable[..., tuple[int, Callable[[list[int]], Tensor]]],
                  progress: Callable[[int, int], None] | None) -> np.ndarray:
    """The mean over the pairs of the metric with item i patched minus the clean metric [items] float64, the items
    (edges, sets of edges) run as copies of the pairs from layer starts[i] on, those of one start a batched pass. Per
    chunk of pairs (what BUFFER_MIB holds): the corrupt run recorded, the clean run kept, then `prepare(pairs,
    kept, corrupt record, its norm statistics)` gives the copies a pass may hold and the metric [copies, pairs] of
    the chosen items."""
    total = np.zeros(len(starts))
    if not len(starts):
        return total
    parts = chunks(prompts, layout)
    done, steps = 0, len(starts) * len(parts)
    with fast_attention(loaded.model):
        for rows in parts:
            sub = part(prompts, rows)
            corrupt, _, stats = recorded(loaded, layout, sub, sub.corrupt)
            kept = keep_run(loaded, layout, sub)
            clean = measure(layout, metric, kept.final, sub)[0].double()  # [pairs]
            size, patched_of = prepare(sub, kept, corrupt, stats)
            for chosen in grouped(starts, size):
                total[chosen] += (patched_of(chosen).double() - clean).sum(1).cpu().numpy()
                done += len(chosen)
                if progress:
                    progress(done, steps)
    return total / prompts.mask.shape[0]


def grouped(starts: Sequence[int], size: int) -> list[list[int]]:
    """Indices grouped by the layer their copies start at, lowest first, at most `size` a group."""
    by_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(starts):
        by_layer.setdefault(layer, []).append(i)
    return [mine[k : k + size] for _, mine in sorted(by_layer.items()) for k in range(0, len(mine), size)]


@dataclass
class Kept:
    """The clean run kept to restart at any layer: each block's input and arguments, the final norm's input, every
    sender's output."""

    hidden: list[Tensor]
    extras: list[tuple[tuple, dict]]
    before_final: Tensor | None  # post-norm: None (the logits read the last block's output)
    final: Tensor
    record: Tensor
    stats: dict[int, Tensor]  # post-norm: each stream norm's statistics


def keep_run(loaded: LoadedModel, layout: Layout, prompts: Prompts) -> Kept:
    parts = layout.parts
    count = len(parts.blocks)
    hidden: list[Any] = [None] * count
    extras: list[Any] = [None] * count
    before: list[Tensor] = []

    def block_hook(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden[layer] = hidden_of(args, kwargs)
            extras[layer] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})

        return hook

    handles = [b.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, b in enumerate(parts.blocks)]
    if not layout.post_norm:
        handles.append(parts.final.register_forward_pre_hook(lambda _m, args: before.append(args[0])))
    try:
        record, final, stats = recorded(loaded, layout, prompts, prompts.clean)
    finally:
        for handle in handles:
            handle.remove()
    return Kept(hidden, extras, before[0] if before else None, final, record, stats)


def patched_copies(layout: Layout, kept: Kept, prompts: Prompts, metric: Metric,
                   edges: list[tuple[int, int]], diff: Tensor | Transported) -> Tensor:
    """The metric [copies, pairs] with edge c alone patched in copy c, the copies run from the lowest receiver's layer
    on (a receiver's input gets corrupt_u - clean_u: nothing upstream of it changed; post-norm: each carried to the
    receiver's point)."""
    graph = layout.graph
    pairs = prompts.last.shape[0]
    wanted: dict[tuple[int, int], Deltas] = {}
    for c, (s, r) in enumerate(edges):
        layer, j = graph.receiver_layer(r), r - graph.receiver_layer(r) * graph.per_layer
        delta = diff.edge(s, r) if isinstance(diff, Transported) else diff[s]  # [pairs, seq, hidden]
        wanted.setdefault((layer, j), []).append((j, slice(c * pairs, (c + 1) * pairs), delta))

    def patch(layer: int, low: int, high: int) -> Deltas:
        return [d for j in range(low, high) for d in wanted.get((layer, j), [])]

    start = min(graph.receiver_layer(r) for _, r in edges)
    if layout.post_norm:  # the logits' deltas go in at the last block's output: that block runs again
        start = min(start, graph.layers - 1)
    return run_from(layout, kept, prompts, metric, Pass(patch=patch), start, len(edges))


def run_from(layout: Layout, kept: Kept, prompts: Prompts, metric: Metric, run: Pass, start: int,
             copies: int) -> Tensor:
    """The metric [copies, pairs] of `copies` copies of the kept clean run restarted at layer `start` (layers: at the
    final norm) with `run`'s hooks."""
    pairs = prompts.last.shape[0]
    with instrumented(layout, run):
        if start == layout.graph.layers:
            final = layout.parts.final(tile(kept.before_final, copies, pairs))
        else:
            final = run_blocks(layout.parts.blocks, layout.parts.final if not layout.post_norm else layout.tail,
                               kept.hidden, kept.extras, start, copies)
    return measure(layout, metric, final, prompts)


@torch.inference_mode()
def exact_sets(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric,
               sets: Sequence[Sequence[tuple[int, int]]],
               progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The mean metric with each set's edges patched together to the corrupt run, minus the clean mean [sets]
    float64: every receiver of the set reads its set's senders' corrupt outputs in place of their outputs in this
    run (faithfulness's patch of the edges outside a circuit, here of the edges in the set); a set of one edge is
    exact()'s patch. The pairs' copies run from the set's lowest receiver layer on, several sets a pass (the copies
    a pass holds: COPY_TOKENS positions and a sender record that fits BUFFER_MIB). Pre-norm and sandwich decoders."""
    graph = layout.graph
    if layout.post_norm:
        raise AttnprobeError("edges patched together on a post-norm decoder: each receiver would need every sender's "
                             "output carried through the norms of its own copy; patch the edges one at a time")
    for edges in sets:
        check_edges(graph, edges)
    total = np.zeros(len(sets))
    live = [k for k, edges in enumerate(sets) if edges]  # an empty set changes nothing: 0
    starts = [min(graph.receiver_layer(r) for _, r in sets[k]) for k in live]

    def prepare(sub: Prompts, kept: Kept, corrupt: Tensor, _stats: dict) -> tuple[int, Callable]:
        per_copy = corrupt[0].numel() * len(graph.senders) * 4  # bytes of one copy's sender record
        size = max(1, min(COPY_TOKENS // sub.mask.numel(), (BUFFER_MIB << 20) // per_copy))
        return size, lambda chosen: set_copies(layout, kept, sub, metric, [sets[live[i]] for i in chosen], corrupt,
                                               starts[chosen[0]])

    total[live] = patched_means(loaded, layout, prompts, metric, starts, prepare, progress)
    return total


def set_copies(layout: Layout, kept: Kept, prompts: Prompts, metric: Metric,
               sets: Sequence[Sequence[tuple[int, int]]], corrupt: Tensor, start: int) -> Tensor:
    """The metric [copies, pairs] with set c's edges patched in copy c, run from layer `start`: a receiver's input
    moves by the sum over its set's senders of (corrupt output - output in this copy), the record of every sender
    held as corrupt minus current (the senders before `start`: the clean run's, as nothing upstream changed)."""
    graph = layout.graph
    pairs, copies = prompts.last.shape[0], len(sets)
    # the senders the copies do not recompute (from layer 1 on: the input and the layers before start)
    before = 0 if start == 0 else len(graph.senders) if start == graph.layers else graph.prefix(start * graph.per_layer)
    record = corrupt.repeat(1, copies, 1, 1)  # [senders, copies x pairs, seq, hidden]
    record[:before] -= kept.record[:before].repeat(1, copies, 1, 1)
    weights = torch.zeros(copies, len(graph.senders), len(graph.receivers), device=corrupt.device)  # [copies, s, r]
    for c, edges in enumerate(sets):
        weights[c, [s for s, _ in edges], [r for _, r in edges]] = 1.0
    real = real_positions(prompts)[0]  # [pairs, seq, 1]

    def patch(layer: int, low: int, high: int) -> Deltas:
        r0 = layer * graph.per_layer + low
        p = graph.prefix(r0)
        w = weights[:, :p, r0 : r0 + high - low]  # [copies, prefix, receivers]
        used = w.any(1)  # [copies, receivers]
        if not bool(used.any()):
            return []
        moved = record[:p].unflatten(1, (copies, pairs))  # [prefix, copies, pairs, seq, hidden]
        delta = torch.einsum("csr,scnth->crnth", w, moved) * real  # [copies, receivers, pairs, seq, hidden]
        return [(low + i, slice(c * pairs, (c + 1) * pairs), delta[c, i]) for c, i in used.nonzero().tolist()]

    return run_from(layout, kept, prompts, metric, Pass(record=record, subtract=True, patch=patch), start, copies)


def check_edges(graph: Graph, edges: Sequence[tuple[int, int]]) -> None:
    for s, r in edges:
        if not (0 <= r < len(graph.receivers) and 0 <= s < graph.prefix(r)):
            raise AttnprobeError(f"edge ({s}, {r}) is not an edge of the graph: a sender feeds only receivers after it")
