"""Post-norm decoders (OPT-350m): the senders' outputs carried through the norms the residual stream passes.

A post-norm block renormalises the stream after each add: h = ln_a(x + attn), x' = ln_f(h + mlp). With each norm's
per-position statistics frozen at a run's own values (its mean-centring and 1 / sigma), a norm is linear in its
input, so the stream at any point is exactly the sum over the senders upstream of their outputs carried through
every norm between (centred, times 1 / sigma, times the norm's weight, per norm), plus constant terms (the norms'
biases and the output projection's bias, carried the same way). The constant terms ride with the `input` sender,
so that every sender's carried contribution sums to the stream in every run and patching every edge gives the
corrupt run. A sender's contribution at a receiver is a function of the run (its output and its statistics), and an
edge u -> v moves v's input by u's contribution at v's point in the corrupt run minus the same in the clean run.

Points, where receivers read the stream: 2l, block l's input (its queries, keys and values); 2l + 1, the MLP's
input h; 2L, the last block's output (the logits). Stream norm k sits between points k and k + 1."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout
from attnprobe.circuit.runs import Prompts, real_positions, recorded
from attnprobe.model import LoadedModel


def first_norm(graph: Graph, s: int) -> int:
    """The first stream norm sender s passes: the input norm 0, a head of layer l norm 2l, its MLP 2l + 1."""
    if s == 0:
        return 0
    layer, j = divmod(s - 1, graph.heads + 1)
    return 2 * layer + (1 if j == graph.heads else 0)


def point(graph: Graph, r: int) -> int:
    """Where receiver r reads the stream (see the module's docstring)."""
    layer, j = divmod(r, graph.per_layer)
    return 2 * graph.layers if layer == graph.layers else 2 * layer + (1 if j == graph.per_layer - 1 else 0)


def carried_before(graph: Graph, k: int) -> int:
    """The senders written before stream norm k runs, [0, n): the ones it carries."""
    layer, second = divmod(k, 2)
    return 1 + layer * (graph.heads + 1) + graph.heads + second


def step(layout: Layout, k: int, values: Tensor, inv: Tensor, constants: bool) -> Tensor:
    """values [..., rows, seq, hidden] through stream norm k at the statistics inv [rows, seq, 1]; with `constants`
    (the input's slot) the constant terms added where they enter: the output projection's bias before the
    attention's norm, the norm's bias after."""
    norm = layout.stream[k]
    if constants and k % 2 == 0:
        bias = getattr(layout.parts.projections[k // 2], "bias", None)
        values = values if bias is None else values + bias.detach().to(values.dtype)
    values = norm.frozen(values, inv)
    bias = norm.bias()
    return values if not constants or bias is None else values + bias.to(values.dtype)


class Walk:
    """One run's sender record [senders, rows, seq, hidden] carried from point to point in place, at that run's
    statistics {stream norm: inv [rows, seq, 1]} (a dict a forward may still be filling: a point is reached only
    after its norms ran)."""

    def __init__(self, layout: Layout, record: Tensor, stats: dict[int, Tensor]):
        self.layout, self.record, self.stats, self.point = layout, record, stats, 0

    def at(self, target: int) -> Tensor:
        """The record with senders [0, n) carried to point `target` (n: those upstream of it)."""
        graph = self.layout.graph
        while self.point < target:
            k = self.point
            n = carried_before(graph, k)
            inv = self.stats[k]
            self.record[1:n] = step(self.layout, k, self.record[1:n], inv, False)
            self.record[0] = step(self.layout, k, self.record[0], inv, True)
            self.point += 1
        return self.record


def carry(layout: Layout, value: Tensor, stats: dict[int, Tensor], s: int, target: int) -> Tensor:
    """Sender s's output value [rows, seq, hidden] carried to point `target`."""
    for k in range(first_norm(layout.graph, s), target):
        value = step(layout, k, value, stats[k], s == 0)
    return value


@dataclass
class Transported:
    """Both runs' sender records and statistics: the diffs an edge's patch moves its receiver's input by."""

    layout: Layout
    corrupt: Tensor  # [senders, pairs, seq, hidden]
    corrupt_stats: dict[int, Tensor]
    clean: Tensor  # [senders, pairs, seq, hidden]
    clean_stats: dict[int, Tensor]
    real: Tensor  # [1, pairs, seq, 1]

    def edge(self, s: int, r: int) -> Tensor:
        """Edge (s, r)'s diff at r's point [pairs, seq, hidden]."""
        target = point(self.layout.graph, r)
        return (carry(self.layout, self.corrupt[s], self.corrupt_stats, s, target)
                - carry(self.layout, self.clean[s], self.clean_stats, s, target)) * self.real[0]

    @torch.inference_mode()
    def scores(self, grads: Tensor, visit: Callable[[int, Tensor], None] | None = None) -> Tensor:
        """sum over pairs and positions of diff_u(at v's point) . grad_v, point by point, both records carried in
        place (so once): [senders, receivers] float64, zero off the graph. visit(point, diff), if given, sees each
        point's diffs [n, pairs, seq, hidden] of the n senders upstream of it (the QK fix reads them)."""
        graph = self.layout.graph
        scores = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64,
                             device=grads.device)  # [senders, receivers]
        corrupt = Walk(self.layout, self.corrupt, self.corrupt_stats)
        clean = Walk(self.layout, self.clean, self.clean_stats)
        targets = np.array([point(graph, r) for r in range(len(graph.receivers))])  # [receivers]
        for target in range(2 * graph.layers + 1):
            mine = torch.from_numpy(np.flatnonzero(targets == target)).to(grads.device)  # [receivers here]
            n = graph.prefix(int(mine[0]))
            diff = (corrupt.at(target)[:n] - clean.at(target)[:n]) * self.real  # [n, pairs, seq, hidden]
            if visit is not None:
                visit(target, diff)
            product = diff.flatten(1) @ grads[mine].flatten(1).to(diff.dtype).t()  # [n, receivers here]
            scores[:n, mine] = product.double()
        return scores * torch.from_numpy(graph.mask).to(scores.device)


def transported(loaded: LoadedModel, layout: Layout, prompts: Prompts) -> tuple[Transported, Tensor, Tensor]:
    """Both runs recorded: (the diffs, the clean and the corrupt first-block inputs [pairs, seq, hidden])."""
    corrupt, _, corrupt_stats = recorded(loaded, layout, prompts, prompts.corrupt)
    clean, _, clean_stats = recorded(loaded, layout, prompts, prompts.clean)
    real = real_positions(prompts)  # [1, pairs, seq, 1]
    return Transported(layout, corrupt, corrupt_stats, clean, clean_stats, real), clean[0].clone(), corrupt[0].clone()
