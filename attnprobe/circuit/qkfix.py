"""AtP*'s QK fix (Kramar et al. 2024): the scores of the edges into a query or a key with the attention pattern
recomputed exactly, linear only after it.

EAP's score of an edge u -> (a head's query or a key head's key) is linear through the softmax, and says nothing
where attention is saturated: a patched query that moves the head's attention to another key has a near-zero
gradient. Here the patched pattern is computed: the receiver's input moved by delta = corrupt_u - clean_u, its
queries (or keys) recomputed from norm(x + delta) through the receiver's map, and the layer's own attention module
run on them with the clean run's values and arguments (rotary embeddings, q/k norms, soft-capping, masks, sliding
windows, grouped heads: whatever the model applies), so that head h's output becomes z'_h = A'_h V. Then

    score(u -> q of h) = sum over positions of dM/dz_h . (z'_h - z_h)      (= dM/dz_h . ((A'_h - A_h) V))

and a key head's score is that sum over the query heads of its group (each sees the new keys). dM/dz_h is the
gradient at the output projection's input in the clean point's backward (runs.z_grad_hook), through the model as
it computes, so that the score is the exact edge patch (exact.py) to first order in the heads' outputs, exact in
the pattern, on every block shape:

- pre-norm: W_O_h^T times the gradient of the residual stream after the attention;
- sandwich (Gemma 2 and 3): the head's output passes the post-attention norm, and patching the edge moves that
  norm's 1 / rms with it (every head of the layer is rescaled), so dM/dz_h carries the norm's full derivative, not
  its frozen scale: the frozen scale reads a head's own outgoing edges, whose diff is between two runs each at its
  own statistics, while here one run's head output moves. Soft-capped attention (Gemma 2) saturates in tanh before
  the softmax: the recomputed pattern has the cap applied by the module itself;
- post-norm (OPT-350m): the receiver's input moves by the sender's diff carried through the stream's norms to the
  block's input (stream.py; the fix reads it at that point as the contraction carries the records), and dM/dz_h
  passes the norms after the head as the model computes them.

With GradDrop the backward is the dropped one, so the dropped gradients carry over (a head whose own block is
dropped gets no gradient, and 0, as its edges' receivers in that block do).

Cost: per (receiver layer, sender) one attention call on two copies of the pairs (every query head's query moved in
one, every key head's key in the other: each head's output depends on its own query and its group's keys only;
check_apart refuses a model where that fails), the senders in chunks. In that call the query/key/value maps serve
the clean run's outputs with the moved slices written in (norm(x + delta) once per sender, then the layer's queries
and keys in one matmul each), and the call stops at the output projection, whose input z' is all it reads: roughly
one attention recomputation per (sender, layer) pair, plus one clean forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe.ablate import tile
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout, project
from attnprobe.circuit.runs import BUFFER_MIB, Pass, Prompts, forward, real_positions
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

CALL_MIB = BUFFER_MIB // 4  # one recomputation's copies: [2 x senders x pairs, seq, max(hidden, heads x seq)]


@dataclass
class Kept:
    """The clean run's attention, per layer: the block's input, the attention module's arguments (its input the
    normed stream), its query/key/value maps' outputs and the heads' outputs z."""

    x: list[Tensor]  # per layer [pairs, seq, hidden]
    calls: list[tuple[tuple, dict]]  # per layer, the attention module's args and kwargs
    z: list[Tensor]  # per layer [pairs, seq, heads, head_dim]
    maps: list[dict[int, Tensor]]  # per layer, each q/k/v map's output by id(map) [pairs, seq, width]


@torch.inference_mode()
def keep_attention(loaded: LoadedModel, layout: Layout, prompts: Prompts) -> Kept:
    """One clean forward keeping what the recomputation reads."""
    parts = layout.parts
    calls: list[Any] = [None] * len(parts.blocks)
    z: list[Any] = [None] * len(parts.blocks)

    def call_hook(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[layer] = (args, kwargs)

        return hook

    def z_hook(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            z[layer] = args[0].unflatten(-1, (parts.heads, parts.head_dim))  # [pairs, seq, heads, head_dim]

        return hook

    maps: list[dict[int, Tensor]] = [{} for _ in parts.blocks]

    def map_hook(layer: int) -> Callable:
        def hook(module: nn.Module, _args: tuple, output: Tensor) -> None:
            maps[layer][id(module)] = output  # [pairs, seq, width]

        return hook

    handles = [a.register_forward_pre_hook(call_hook(i), with_kwargs=True) for i, a in enumerate(parts.attentions)]
    handles += [p.register_forward_pre_hook(z_hook(i)) for i, p in enumerate(parts.projections)]
    handles += [m.register_forward_hook(map_hook(i)) for i in range(len(parts.blocks))
                for m in {id(m): m for m, _ in layout.qkv[i]}.values()]
    run = Pass()
    try:
        forward(loaded, layout, prompts.clean, prompts.mask, run)
    finally:
        for handle in handles:
            handle.remove()
    return Kept([run.xs[i] for i in range(len(parts.blocks))], calls, z, maps)


def qk_receivers(graph: Graph) -> Tensor:
    """[receivers] bool: the query and key receivers, whose scores the fix replaces."""
    return torch.tensor([kind in ("q", "k") for _, kind in graph.receivers])


def qk_scores(layout: Layout, kept: Kept, prompts: Prompts, diff: Tensor, g_z: dict[int, Tensor]) -> Tensor:
    """The QK-fixed score of every edge into a query or a key, summed over the pairs, [senders, receivers] float64
    (0 in the other columns): diff [senders, pairs, seq, hidden] is corrupt_u - clean_u at every receiver's input
    (pre-norm and sandwich blocks: the senders' outputs themselves), g_z each layer's dM/dz [pairs, seq, heads x
    head_dim] (see qk_layer; a layer without one, its block dropped, keeps 0)."""
    graph = layout.graph
    out = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)  # [senders, receivers]
    checked = False
    for layer in range(graph.layers):
        if layer in g_z:
            count = graph.prefix(layer * graph.per_layer)  # the senders before this layer
            qk_layer(layout, kept, prompts, layer, diff[:count], g_z[layer], out, check=not checked)
            checked = True
    return out


def post_norm_visit(layout: Layout, kept: Kept, prompts: Prompts, g_z: dict[int, Tensor],
                    out: Tensor) -> Callable[[int, Tensor], None]:
    """For a post-norm decoder's contraction (stream.Transported.scores, which carries both runs' records point by
    point): at each block's input, point 2l, the QK-fixed scores of layer l's queries and keys written into out
    [senders, receivers] from the diffs carried there [n, pairs, seq, hidden]."""

    def visit(target: int, diff: Tensor) -> None:
        layer, second = divmod(target, 2)
        if second == 0 and layer in g_z:
            qk_layer(layout, kept, prompts, layer, diff, g_z[layer], out, check=target == 0)

    return visit


def qk_layer(layout: Layout, kept: Kept, prompts: Prompts, layer: int, diff: Tensor, g_z: Tensor, out: Tensor,
             check: bool = False) -> None:
    """Writes into out [senders, receivers] the QK-fixed scores of the edges into one layer's queries and keys:
    diff [n, pairs, seq, hidden] moves the layer's input (each of the n senders before it; post-norm: carried to
    the block's input), g_z [pairs, seq, heads x head_dim] is dM/dz at the output projection's input from a
    backward through the model (the post-attention norm of a sandwich block at its full derivative, its 1 / rms
    moving with the head's output as it does when the edge is patched; a post-norm block's stream norms the
    same). check: check_apart on the first sender."""
    graph = layout.graph
    real = real_positions(prompts)[0, :, :, None]  # [pairs, seq, 1, 1]
    grad = g_z.float().unflatten(-1, (graph.heads, -1)) * real  # [pairs, seq, heads, head_dim]
    base, size = layer * graph.per_layer, sender_chunk(layout, kept, layer)
    for start in range(0, diff.shape[0], size):
        senders = slice(start, min(start + size, diff.shape[0]))
        moved = patched_outputs(layout, kept, layer, diff[senders])  # [2, senders, pairs, seq, heads, dim]
        if check and start == 0:
            check_apart(layout, kept, layer, diff[0], moved[:, 0])
        change = moved.float() - kept.z[layer].float()  # [2, senders, pairs, seq, heads, dim]
        per_head = torch.einsum("ksphd,phd->ksh", change.flatten(2, 3), grad.flatten(0, 1)).double()  # [2, n, heads]
        out[senders, base : base + graph.heads] = per_head[0].cpu()
        keys = per_head[1].unflatten(-1, (graph.kv_heads, graph.group)).sum(-1)  # [senders, kv_heads]
        out[senders, base + graph.heads : base + graph.heads + graph.kv_heads] = keys.cpu()


def sender_chunk(layout: Layout, kept: Kept, layer: int) -> int:
    """Senders a recomputation takes at once: two copies of the pairs each, within CALL_MIB."""
    pairs, seq = kept.x[layer].shape[:2]
    width = max(kept.x[layer].shape[-1], layout.graph.heads * seq)
    return max(1, (CALL_MIB << 20) // (2 * pairs * seq * width * 4))


def patched_outputs(layout: Layout, kept: Kept, layer: int, deltas: Tensor, first: bool = False) -> Tensor:
    """The heads' outputs with every query head's query (copy 0) or every key head's key (copy 1) recomputed from
    norm(x + delta), one delta [pairs, seq, hidden] a sender: [2, senders, pairs, seq, heads, head_dim]. first: the
    first query head's query and the first key head's key alone."""
    parts, graph = layout.parts, layout.graph
    senders, pairs = deltas.shape[:2]
    x = kept.x[layer]  # [pairs, seq, hidden]
    moved = layout.ln1[layer]((x[None] + deltas.to(x.dtype)).flatten(0, 1))  # [senders x pairs, seq, hidden]
    maps = layout.qkv[layer]
    q_map, k_map = maps[0][0], maps[graph.heads][0]
    q_last, k_last = (0, graph.heads) if first else (graph.heads - 1, graph.heads + graph.kv_heads - 1)
    q_cut = slice(maps[0][1].start, maps[q_last][1].stop)
    k_cut = slice(maps[graph.heads][1].start, maps[k_last][1].stop)
    rows = senders * pairs
    outputs = {key: clean.repeat(2 * senders, 1, 1) for key, clean in kept.maps[layer].items()}  # [2 x rows, ...]
    outputs[id(q_map)][:rows, :, q_cut] = project(q_map, moved, q_cut)
    outputs[id(k_map)][rows:, :, k_cut] = project(k_map, moved, k_cut)
    seen: list[Tensor] = []
    args, kwargs = tile(kept.calls[layer], 2 * senders, pairs)
    modules = {id(m): m for m, _ in maps}
    with served(modules, outputs), stopped_at(parts.projections[layer], seen):
        parts.attentions[layer](*args, **kwargs)
    z = seen[0].unflatten(-1, (parts.heads, parts.head_dim))  # [2 x senders x pairs, seq, heads, head_dim]
    return z.unflatten(0, (2, senders, pairs))  # [2, senders, pairs, seq, heads, head_dim]


def check_apart(layout: Layout, kept: Kept, layer: int, delta: Tensor, moved: Tensor) -> None:
    """Refuses a model whose heads read each other's queries or keys after their maps (a norm over every head's
    query at once): there the first query head's output with its query alone moved differs from `moved` [2, pairs,
    seq, heads, head_dim], every head's moved at once (likewise the first key head's)."""
    alone = patched_outputs(layout, kept, layer, delta[None], first=True)[:, 0]  # [2, pairs, seq, heads, dim]
    group = layout.graph.group
    bound = max(1e-3, 8 * torch.finfo(moved.dtype).eps) * (float(kept.z[layer].abs().max()) or 1.0)  # rounding
    apart = (float((alone[0, ..., 0, :] - moved[0, ..., 0, :]).abs().max()) <= bound and
             float((alone[1, ..., :group, :] - moved[1, ..., :group, :]).abs().max()) <= bound)
    if not apart:
        raise AttnprobeError(f"--qk-fix: {type(layout.parts.attentions[layer]).__name__} mixes its heads' queries or "
                             "keys after their maps (a norm over every head at once), so the heads' patterns cannot "
                             "be recomputed together; drop --qk-fix")


class Stop(Exception):
    """Raised at the output projection: the heads' outputs are read, the rest of the attention is not needed."""


@contextmanager
def stopped_at(projection: nn.Module, seen: list[Tensor]) -> Iterator[None]:
    """For the duration, a call of `projection` appends its input to `seen` and ends the attention's call there."""

    def hook(_module: nn.Module, args: tuple) -> None:
        seen.append(args[0])
        raise Stop

    handle = projection.register_forward_pre_hook(hook)
    try:
        yield
    except Stop:
        pass
    finally:
        handle.remove()


@contextmanager
def served(modules: dict[int, nn.Module], outputs: dict[int, Tensor]) -> Iterator[None]:
    """For the duration, each query/key/value map returns its prepared output [rows, seq, width] instead of
    computing it (the clean outputs with the moved slices written in: no projection computed twice)."""
    before = {key: module.__dict__.get("forward") for key, module in modules.items()}

    def serve(key: int) -> Callable:
        def forward(x: Tensor, *_args: Any, **_kwargs: Any) -> Tensor:
            if x.shape[:-1] != outputs[key].shape[:-1]:
                raise AttnprobeError(f"--qk-fix: the attention module called a query/key/value map on {tuple(x.shape)} "
                                     "values, not the layer's input: this architecture cannot be recomputed here; "
                                     "drop --qk-fix")
            return outputs[key]

        return forward

    for key, module in modules.items():
        module.forward = serve(key)
    try:
        yield
    finally:
        for key, module in modules.items():
            if before[key] is None:
                del module.forward
            else:
                module.forward = before[key]
