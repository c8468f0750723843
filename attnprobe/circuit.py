"""Circuits at head granularity: edge attribution patching (EAP, EAP-IG), exact edge patching and faithfulness.

The graph (Hanna et al.'s EAP-IG graph, with grouped-query attention kept grouped):

- senders: the input embeddings (`input`, the first block's input), each query head's output (`a{l}.h{h}`: its
  slice of the output projection's input times that slice of the projection, what the head adds to the residual
  stream) and each MLP's output (`m{l}`);
- receivers: each query head's query input (`a{l}.h{h}`, input `q`), each key/value head's key and value inputs
  (`a{l}.kv{g}`, inputs `k` and `v`, shared by the query heads it serves; named `a{l}.h{g}` where there is no
  grouping), each MLP's input (`m{l}`) and the logits (`logits`, the final norm's input);
- an edge u -> v for every sender u upstream of v. A receiver's input is the residual stream where it reads it,
  which is the sum of the upstream senders' outputs (plus constant biases), so patching the edge u -> v changes
  v's input alone by (corrupt_u - current_u) before v's own norm: a head's query slice is recomputed from
  norm(x + delta) while the other heads keep theirs.

Scores (the first-order change of the mean metric when the edge is patched to the corrupt run, as EAP-IG's code
signs them): EAP = sum over positions of (corrupt_u - clean_u) . dM/d(input_v), every edge from one clean and one
corrupt forward and one backward; EAP-IG = the same with the gradient averaged over m points on the straight line
from the corrupt to the clean input embeddings (alpha = k/m, k = 1..m, so m = 1 is EAP; EAP-IG's code takes
k = 0..m-1); GradDrop (AtP*, Kramar et al. 2024) as an option. Exact edge patching: the patched mean metric minus
the clean one, each edge a copy of the pairs run from its receiver's layer on.

Faithfulness (MIB, Mueller et al. 2025): the metric with every edge outside the circuit patched to the corrupt run
(or mean-ablated), (M_circuit - M_corrupt) / (M_clean - M_corrupt), at circuit sizes given as fractions of the
edges (top |score|); CPR and CMD are the trapezoid areas of f and |1 - f| over the fractions.

Supported: decoders whose blocks add the attention's and the MLP's outputs to the residual stream after a norm at
their input (GPT-2, Llama, Qwen, Mistral, OPT's pre-norm...); post-norm blocks, norms after attention or the MLP
(Gemma 2) and parallel blocks (GPT-NeoX, Phi) are refused by a check that the stream is that sum.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe.ablate import fast_attention, run_blocks, tile
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, forward_kwargs
from attnprobe.patching import Parts, find_parts, module_width

METHODS = ("eap", "eap-ig", "exact")
ABLATIONS = ("patch", "mean")
PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes (fractions of edges)
MLP_NAMES = ("mlp", "feed_forward", "ffn")
BUFFER_MIB = 1024  # one chunk's buffer of every sender's output [senders, rows, seq, hidden]
COPY_TOKENS = 16_384  # positions (copies x pairs x seq) in one batched exact-patching pass
CONFIDENCE = 0.95

Metric = Callable[[Tensor, Sequence[Any]], Tensor]  # (logits [rows, vocab] float32, the rows' pairs) -> [rows]


# ---- the graph -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Graph:
    """The nodes and edges of a model's computational graph at head granularity (see the module's docstring)."""

    layers: int
    heads: int
    kv_heads: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def per_layer(self) -> int:
        """Receivers in one layer: the query heads, the key heads, the value heads, the MLP."""
        return self.heads + 2 * self.kv_heads + 1

    @cached_property
    def senders(self) -> list[str]:
        names = ["input"]
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}" for h in range(self.heads)] + [f"m{layer}"]
        return names

    def kv_name(self, layer: int, group: int) -> str:
        return f"a{layer}.h{group}" if self.group == 1 else f"a{layer}.kv{group}"

    @cached_property
    def receivers(self) -> list[tuple[str, str]]:
        """(node, input) per receiver, in the order the model reads them."""
        out: list[tuple[str, str]] = []
        for layer in range(self.layers):
            out += [(f"a{layer}.h{h}", "q") for h in range(self.heads)]
            out += [(self.kv_name(layer, g), kind) for kind in "kv" for g in range(self.kv_heads)]
            out.append((f"m{layer}", ""))
        return out + [("logits", "")]

    def sender_index(self, layer: int, head: int | None = None) -> int:
        """A head's (or, head None, the MLP's) index among the senders."""
        return 1 + layer * (self.heads + 1) + (self.heads if head is None else head)

    def receiver_layer(self, r: int) -> int:
        return min(r // self.per_layer, self.layers)

    def prefix(self, r: int) -> int:
        """Receiver r reads the senders [0, prefix): everything before its layer, and its layer's heads for an MLP."""
        if r == len(self.receivers) - 1:
            return len(self.senders)
        layer, j = divmod(r, self.per_layer)
        return 1 + layer * (self.heads + 1) + (self.heads if j == self.per_layer - 1 else 0)

    @cached_property
    def mask(self) -> np.ndarray:
        """[senders, receivers] bool: the real edges."""
        prefixes = np.array([self.prefix(r) for r in range(len(self.receivers))])  # [receivers]
        return np.arange(len(self.senders))[:, None] < prefixes[None, :]

    @property
    def edge_count(self) -> int:
        return int(self.mask.sum())

    def serves(self, node: str) -> list[str]:
        """The query heads a key/value head serves (a query head: itself)."""
        layer, _, rest = node[1:].partition(".")
        if rest.startswith("kv"):
            g = int(rest[2:])
            return [f"a{layer}.h{h}" for h in range(g * self.group, (g + 1) * self.group)]
        return [node]

    def groups(self) -> dict[str, list[str]]:
        """Each grouped key/value receiver with the query heads it serves (empty without grouping)."""
        if self.group == 1:
            return {}
        return {self.kv_name(layer, g): self.serves(self.kv_name(layer, g)) for layer in range(self.layers)
                for g in range(self.kv_heads)}


# ---- where the model computes what -----------------------------------------------------------------------


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


# ---- one instrumented forward ----------------------------------------------------------------------------

Deltas = list[tuple[int, slice, Tensor]]  # (receiver within its layer, rows, delta [rows, seq, hidden])


@dataclass
class Pass:
    """What one forward does besides the model's own computation.

    record: [senders, rows, seq, hidden], each sender's output written (or, subtract, subtracted) as computed;
    embed: the first block's input instead of the embeddings; patch(layer, j_first, j_last): the deltas of the
    receivers [j_first, j_last) of a layer (layer = layers: the logits); grads: collect dM/d(input) per receiver."""

    record: Tensor | None = None
    subtract: bool = False
    embed: Tensor | None = None
    patch: Callable[[int, int, int], Deltas] | None = None
    grads: bool = False
    xs: dict[int, Tensor] = field(default_factory=dict)  # per layer, the block's input
    g_maps: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (layer, id(map)) -> dM/d(map output)
    g_mlp: dict[int, Tensor] = field(default_factory=dict)  # per layer, dM/d(MLP's norm input) through the MLP
    g_logits: list[Tensor] = field(default_factory=list)


def write(run: Pass, start: int, values: Tensor) -> None:
    """Senders [start, start + len(values)) of the record get values [n, rows, seq, hidden]."""
    target = run.record[start : start + values.shape[0]]  # [n, rows, seq, hidden]
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
        handles.append(parts.projections[layer].register_forward_pre_hook(heads_hook(layout, run, layer)))
        handles.append(layout.mlps[layer].register_forward_hook(mlp_hook(layout, run, layer)))
        handles.append(layout.ln2[layer].register_forward_pre_hook(input_hook(run, layer, nq, layer)))
        for module in {id(m): m for m, _ in layout.qkv[layer]}.values():
            handles.append(module.register_forward_hook(qkv_hook(layout, run, layer, module)))
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


def mlp_hook(layout: Layout, run: Pass, layer: int) -> Callable:
    def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
        if run.record is not None:
            write(run, layout.graph.sender_index(layer), first(output).detach()[None])

    return hook


def input_hook(run: Pass, layer: int, j: int, grad_layer: int | None) -> Callable:
    """Pre-hook on an MLP's input norm (or the final norm): its deltas added, its gradient kept."""

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]  # [rows, seq, hidden]
        deltas = run.patch(layer, j, j + 1) if run.patch else []
        for _, rows, delta in deltas:
            x = x.clone() if x is args[0] else x
            x[rows] = x[rows] + delta.to(x.dtype)
        if run.grads and x.requires_grad:
            x = x.view_as(x)  # a node of its own: the gradient through this norm alone
            store = run.g_logits.append if grad_layer is None else (lambda g: run.g_mlp.__setitem__(grad_layer, g))
            x.register_hook(lambda g: store(g.detach()))
        return None if x is args[0] else (x, *args[1:])

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
    from attnprobe.batching import pad_batch
    from attnprobe.tokens import encode

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


def chunks(prompts: Prompts, graph: Graph, hidden: int, gradients: bool = False) -> list[slice]:
    """Pairs in chunks whose buffer of every sender's output [senders, pairs, seq, hidden] (and with `gradients`,
    of every receiver's gradient) fits BUFFER_MIB."""
    rows = len(graph.senders) + (len(graph.receivers) if gradients else 0)
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


def sender_buffer(layout: Layout, rows: int, seq: int, device: torch.device) -> Tensor:
    hidden = layout.w_out[0].shape[0]
    return torch.zeros(len(layout.graph.senders), rows, seq, hidden, device=device)  # [senders, rows, seq, hidden]


@torch.inference_mode()
def outputs(loaded: LoadedModel, layout: Layout, prompts: Prompts, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Every sender's output on ids [senders, pairs, seq, hidden] and the last hidden state."""
    buffer = sender_buffer(layout, *ids.shape, loaded.device)
    final = forward(loaded, layout, ids, prompts.mask, Pass(record=buffer))
    return buffer, final


def real_positions(prompts: Prompts) -> Tensor:
    return prompts.mask.bool()[None, :, :, None]  # [1, pairs, seq, 1]


# ---- EAP and EAP-IG --------------------------------------------------------------------------------------


def attribute(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, *, steps: int = 1,
              grad_drop: bool = False, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """EAP (steps 1) or EAP-IG (steps m) scores of every edge, [senders, receivers] float64 (0 off the graph): the
    first-order change of the mean metric when the edge is patched to the corrupt run. The score is linear in the
    gradient, so EAP-IG sums each receiver's gradient over the steps and contracts once.

    grad_drop (AtP*'s GradDrop, Kramar et al. 2024): the scores again with the gradient through each block's
    contribution to the residual stream dropped in turn, sum over blocks l of |score_l| / (layers - 1): an edge
    whose paths cancel in the full gradient shows where one block's paths are left out. Unsigned; layers times the
    passes."""
    graph = layout.graph
    scores = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)  # [senders, receivers]
    parts_done, parts_list = 0, chunks(prompts, graph, layout.w_out[0].shape[0], gradients=True)
    with fast_attention(loaded.model):
        for rows in parts_list:
            sub = part(prompts, rows)
            diff, _ = outputs(loaded, layout, sub, sub.corrupt)
            with torch.inference_mode():
                run = Pass(record=diff, subtract=True)
                forward(loaded, layout, sub.clean, sub.mask, run)  # corrupt_u - clean_u, in place
                diff *= real_positions(sub)  # [senders, pairs, seq, hidden]
            clean_in = run.xs[0]  # [pairs, seq, hidden]
            start = clean_in - diff[0]  # [pairs, seq, hidden]: the corrupt input
            drops: list[int | None] = list(range(graph.layers)) if grad_drop else [None]
            for dropped in drops:
                grads = torch.zeros(len(graph.receivers), *diff.shape[1:], device=diff.device)  # [receivers, ...]
                for k in range(1, steps + 1):
                    embed = (start + (k / steps) * (clean_in - start)).clone().requires_grad_(True)
                    receiver_gradients(loaded, layout, sub, metric, embed, grads, dropped)
                    if progress:
                        parts_done += 1
                        progress(parts_done, steps * len(drops) * len(parts_list))
                part_scores = contract_all(graph, diff, grads) / steps
                scores += part_scores if dropped is None else part_scores.abs() / max(1, graph.layers - 1)
    return (scores / prompts.mask.shape[0]).numpy() * graph.mask


def receiver_gradients(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, embed: Tensor,
                       into: Tensor, dropped: int | None = None) -> None:
    """Adds dM/d(input_v) of every receiver, summed over pairs' metrics, to into [receivers, pairs, seq, hidden],
    from one forward and backward with the first block's input `embed` [pairs, seq, hidden] (and, `dropped`, no
    gradient through that block's contribution to the residual stream)."""
    graph = layout.graph
    run = Pass(embed=embed, grads=True)
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
    cotangents = torch.stack([run.g_maps[(layer, id(m))][..., cut] @ slice_weight(m, cut).detach()
                              for m, cut in maps])  # [receivers, rows, seq, hidden]
    with torch.enable_grad():
        stacked = x[None].expand(len(maps), *x.shape).clone().requires_grad_(True)  # [receivers, rows, seq, hidden]
        (grads,) = torch.autograd.grad(layout.ln1[layer](stacked), [stacked], cotangents.to(x.dtype))
    return grads


# ---- exact edge patching ---------------------------------------------------------------------------------


@torch.inference_mode()
def exact(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric,
          edges: Sequence[tuple[int, int]], progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The mean metric with each edge (sender, receiver) alone patched to the corrupt run, minus the clean mean
    [edges] float64: the pairs' copies run from the receiver's layer on, several edges a pass."""
    graph = layout.graph
    check_edges(graph, edges)
    total = np.zeros(len(edges))
    done = 0
    with fast_attention(loaded.model):
        for rows in chunks(prompts, graph, layout.w_out[0].shape[0]):
            sub = part(prompts, rows)
            diff, _ = outputs(loaded, layout, sub, sub.corrupt)
            kept = keep_run(loaded, layout, sub)
            diff -= kept.record
            diff *= real_positions(sub)
            clean = measure(layout, metric, kept.final, sub)[0].double()  # [pairs]
            for chosen in passes(graph, edges, max(1, COPY_TOKENS // sub.mask.numel())):
                patched = patched_copies(layout, kept, sub, metric, [edges[e] for e in chosen], diff)
                total[chosen] += (patched.double() - clean).sum(1).cpu().numpy()
                done += len(chosen)
                if progress:
                    progress(done, len(edges) * len(chunks(prompts, graph, layout.w_out[0].shape[0])))
    return total / prompts.mask.shape[0]


def passes(graph: Graph, edges: Sequence[tuple[int, int]], size: int) -> list[list[int]]:
    """The edges' indices in batched passes: edges whose receivers are in one layer together (a pass starts at its
    receivers' layer), at most `size` copies a pass."""
    by_layer: dict[int, list[int]] = {}
    for e, (_, r) in enumerate(edges):
        by_layer.setdefault(graph.receiver_layer(r), []).append(e)
    return [mine[k : k + size] for _, mine in sorted(by_layer.items()) for k in range(0, len(mine), size)]


@dataclass
class Kept:
    """The clean run kept to restart at any layer: each block's input and arguments, the final norm's input, every
    sender's output."""

    hidden: list[Tensor]
    extras: list[tuple[tuple, dict]]
    before_final: Tensor
    final: Tensor
    record: Tensor


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
    handles.append(parts.final.register_forward_pre_hook(lambda _m, args: before.append(args[0])))
    try:
        record, final = outputs(loaded, layout, prompts, prompts.clean)
    finally:
        for handle in handles:
            handle.remove()
    return Kept(hidden, extras, before[0], final, record)


def patched_copies(layout: Layout, kept: Kept, prompts: Prompts, metric: Metric,
                   edges: list[tuple[int, int]], diff: Tensor) -> Tensor:
    """The metric [copies, pairs] with edge c alone patched in copy c, the copies run from the lowest receiver's layer
    on (a receiver's input gets corrupt_u - clean_u: nothing upstream of it changed)."""
    graph = layout.graph
    pairs = prompts.last.shape[0]
    wanted: dict[tuple[int, int], Deltas] = {}
    for c, (s, r) in enumerate(edges):
        layer, j = graph.receiver_layer(r), r - graph.receiver_layer(r) * graph.per_layer
        wanted.setdefault((layer, j), []).append((j, slice(c * pairs, (c + 1) * pairs), diff[s]))

    def patch(layer: int, low: int, high: int) -> Deltas:
        return [d for j in range(low, high) for d in wanted.get((layer, j), [])]

    start = min(graph.receiver_layer(r) for _, r in edges)
    run = Pass(patch=patch)
    with instrumented(layout, run):
        if start == graph.layers:
            final = layout.parts.final(tile(kept.before_final, len(edges), pairs))
        else:
            final = run_blocks(layout.parts.blocks, layout.parts.final, kept.hidden, kept.extras, start, len(edges))
    return measure(layout, metric, final, prompts)


def check_edges(graph: Graph, edges: Sequence[tuple[int, int]]) -> None:
    for s, r in edges:
        if not (0 <= r < len(graph.receivers) and 0 <= s < graph.prefix(r)):
            raise AttnprobeError(f"edge ({s}, {r}) is not an edge of the graph: a sender feeds only receivers after it")


# ---- circuits and faithfulness ---------------------------------------------------------------------------


def top_edges(graph: Graph, scores: np.ndarray, count: int) -> np.ndarray:
    """The `count` real edges of largest |score| (ties: the earlier edge), as a [senders, receivers] bool mask."""
    flat = np.where(graph.mask, np.abs(scores), -np.inf).ravel()  # [senders * receivers]
    order = np.argsort(-flat, kind="stable")[: min(count, graph.edge_count)]
    chosen = np.zeros(flat.shape, dtype=bool)
    chosen[order] = True
    return chosen.reshape(graph.mask.shape)


def random_edges(graph: Graph, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` real edges drawn uniformly without replacement, as a mask."""
    real = np.flatnonzero(graph.mask.ravel())
    chosen = np.zeros(graph.mask.size, dtype=bool)
    chosen[rng.choice(real, size=min(count, real.size), replace=False)] = True
    return chosen.reshape(graph.mask.shape)


@dataclass
class Baseline:
    """One chunk's runs a circuit's evaluation reads: the clean metric, the corrupt one and the corrupt (or mean)
    outputs of every sender."""

    prompts: Prompts
    clean: Tensor  # [pairs]
    corrupt: Tensor  # [pairs]
    replaced: Tensor  # [senders, pairs, seq, hidden]: what a patched edge's sender sends


@torch.inference_mode()
def baselines(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric,
              ablation: str = "patch") -> list[Baseline]:
    """Per chunk of pairs, the clean and corrupt metric and the senders' replacement outputs: the corrupt run's
    (patch), or each sender's mean over every pair's real positions in the clean run (mean)."""
    if ablation not in ABLATIONS:
        raise AttnprobeError(f"--ablation {ablation!r}: use one of {', '.join(ABLATIONS)}")
    out = []
    total = None
    count = 0
    with fast_attention(loaded.model):
        for rows in chunks(prompts, layout.graph, layout.w_out[0].shape[0]):
            sub = part(prompts, rows)
            corrupt, corrupt_final = outputs(loaded, layout, sub, sub.corrupt)
            clean_out, clean_final = outputs(loaded, layout, sub, sub.clean)
            if ablation == "mean":
                real = real_positions(sub)  # [1, pairs, seq, 1]
                sums = (clean_out * real).sum((1, 2))  # [senders, hidden]
                total = sums if total is None else total + sums
                count += int(real.sum())
            out.append(Baseline(sub, measure(layout, metric, clean_final, sub)[0].double(),
                                measure(layout, metric, corrupt_final, sub)[0].double(), corrupt))
    if ablation == "mean":
        mean = total / count  # [senders, hidden]
        for base in out:
            base.replaced = mean[:, None, None, :].expand_as(base.replaced).clone()
    return out


@torch.inference_mode()
def evaluate(loaded: LoadedModel, layout: Layout, bases: list[Baseline], metric: Metric,
             circuit: np.ndarray) -> float:
    """The mean metric with every real edge outside `circuit` ([senders, receivers] bool) patched: each receiver
    reads its in-circuit senders' outputs as this run computes them and the others' replacement outputs."""
    graph = layout.graph
    outside = torch.from_numpy(graph.mask & ~circuit).float().to(loaded.device)  # [senders, receivers]
    total, count = 0.0, 0
    with fast_attention(loaded.model):
        for base in bases:
            sub = base.prompts
            buffer = base.replaced.clone()  # [senders, pairs, seq, hidden]: replaced - current as they are computed
            real = real_positions(sub)[0]  # [pairs, seq, 1]

            def patch(layer: int, low: int, high: int, buffer: Tensor = buffer, real: Tensor = real) -> Deltas:
                r0 = layer * graph.per_layer + low
                p = graph.prefix(r0)
                weights = outside[:p, r0 : r0 + high - low]  # [prefix, receivers]
                if not bool(weights.any()):
                    return []
                delta = torch.einsum("sr,snh->rnh", weights, buffer[:p].flatten(1, 2))  # [receivers, n, hidden]
                delta = delta.unflatten(1, buffer.shape[1:3]) * real  # [receivers, pairs, seq, hidden]
                return [(low + i, slice(None), delta[i]) for i in range(high - low) if bool(weights[:, i].any())]

            final = forward(loaded, layout, sub.clean, sub.mask, Pass(record=buffer, subtract=True, patch=patch))
            total += float(measure(layout, metric, final, sub)[0].double().sum())
            count += sub.last.shape[0]
    return total / count


@dataclass
class Faithfulness:
    curve: pd.DataFrame  # edges, fraction, faithfulness, metric, random_mean, random_low, random_high
    clean: float
    corrupt: float
    cpr: float
    cmd: float
    random_cpr: float | None
    random_cmd: float | None


def faithfulness(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, scores: np.ndarray, *,
                 fractions: Sequence[float] = PERCENTAGES, randoms: int = 0, ablation: str = "patch",
                 seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Faithfulness:
    """The faithfulness curve of the top-|score| circuits at each fraction of the edges (int(fraction x edges)
    edges, as MIB counts them), beside `randoms` random circuits of each size (their mean and 95% interval), with
    CPR and CMD."""
    check_fractions(fractions)
    graph = layout.graph
    bases = baselines(loaded, layout, prompts, metric, ablation)
    clean = float(torch.cat([b.clean for b in bases]).mean())
    corrupt = float(torch.cat([b.corrupt for b in bases]).mean())
    rng = np.random.default_rng(seed)
    rows = []
    steps, done = len(fractions) * (1 + randoms), 0
    for fraction in fractions:
        count = int(fraction * graph.edge_count)
        value = evaluate(loaded, layout, bases, metric, top_edges(graph, scores, count))
        drawn = [normalized(evaluate(loaded, layout, bases, metric, random_edges(graph, count, rng)), clean, corrupt)
                 for _ in range(randoms)]
        done += 1 + randoms
        if progress:
            progress(done, steps)
        low, high = (np.quantile(drawn, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]) if drawn else (np.nan, np.nan))
        rows.append({"edges": count, "fraction": fraction, "faithfulness": normalized(value, clean, corrupt),
                     "metric": value, "random_mean": float(np.mean(drawn)) if drawn else np.nan,
                     "random_low": float(low), "random_high": float(high)})
    curve = pd.DataFrame(rows)
    cpr, cmd = areas(curve["fraction"].to_numpy(), curve["faithfulness"].to_numpy())
    random_areas = areas(curve["fraction"].to_numpy(), curve["random_mean"].to_numpy()) if randoms else (None, None)
    return Faithfulness(curve, clean, corrupt, cpr, cmd, *random_areas)


def normalized(value: float, clean: float, corrupt: float) -> float:
    """MIB's faithfulness: (M_circuit - M_corrupt) / (M_clean - M_corrupt)."""
    return (value - corrupt) / (clean - corrupt) if clean != corrupt else float("nan")


def areas(fractions: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """CPR and CMD as MIB's evaluate_area_under_curve computes them: trapezoids over the fractions themselves
    (its log_scale flag changes nothing it sums) of f and of |1 - f|, from the first fraction to the last."""
    x, f = np.asarray(fractions, float), np.asarray(values, float)
    width = np.diff(x)  # [sizes - 1]
    cpr = float((width * (f[:-1] + f[1:]) / 2).sum())
    cmd = float((width * (np.abs(1 - f[:-1]) + np.abs(1 - f[1:])) / 2).sum())
    return cpr, cmd


def check_fractions(fractions: Sequence[float]) -> None:
    values = list(fractions)
    if len(values) < 2 or any(not 0 < v <= 1 for v in values) or values != sorted(set(values)):
        raise AttnprobeError(f"--sizes {','.join(str(v) for v in values)}: give two or more increasing fractions of "
                             "the edges in (0, 1], e.g. 0.001,0.01,0.1,1")


# ---- tables ----------------------------------------------------------------------------------------------


def edge_table(graph: Graph, scores: np.ndarray, circuit: np.ndarray | None = None) -> pd.DataFrame:
    """edges.csv: one row per real edge (sender, receiver, input, score[, in_circuit]), by |score| descending."""
    s, r = np.nonzero(graph.mask)  # [edges] each
    frame = pd.DataFrame({
        "sender": [graph.senders[i] for i in s],
        "receiver": [graph.receivers[j][0] for j in r],
        "input": [graph.receivers[j][1] for j in r],
        "score": scores[s, r],
    })
    if circuit is not None:
        frame["in_circuit"] = circuit[s, r]
    order = np.argsort(-np.abs(frame["score"].to_numpy()), kind="stable")
    return frame.iloc[order].reset_index(drop=True)


def mib_importances(graph: Graph, scores: np.ndarray, circuit: np.ndarray, hidden: int) -> dict[str, Any]:
    """MIB's importances.json (EAP-IG's Graph.to_json): cfg, nodes {name: in_graph}, edges {"u->v<q>": {score,
    in_graph}}; a grouped key/value receiver's edge is written for each query head it serves (the grouped score)."""
    edges: dict[str, dict[str, Any]] = {}
    s_idx, r_idx = np.nonzero(graph.mask)
    for s, r in zip(s_idx, r_idx):
        node, kind = graph.receivers[r]
        for target in (graph.serves(node) if kind in ("k", "v") else [node]):
            name = f"{graph.senders[s]}->{target}" + (f"<{kind}>" if kind else "")
            edges[name] = {"score": float(scores[s, r]), "in_graph": bool(circuit[s, r])}
    used = {graph.senders[s] for s in np.nonzero(circuit.any(1))[0]}
    used |= {t for r in np.nonzero(circuit.any(0))[0] for t in graph.serves(graph.receivers[r][0])}
    names = graph.senders + ["logits"]
    return {
        "cfg": {"n_layers": graph.layers, "n_heads": graph.heads, "n_kv_heads": graph.kv_heads,
                "parallel_attn_mlp": False, "d_model": hidden},
        "nodes": {name: {"in_graph": name in used or name == "logits"} for name in names},
        "edges": edges,
    }


# ---- the whole run ---------------------------------------------------------------------------------------


@dataclass
class CircuitResult:
    scores: np.ndarray  # [senders, receivers]
    circuit: np.ndarray  # [senders, receivers] bool
    faithfulness: Faithfulness | None
    exact: pd.DataFrame | None  # the top edges' exact patching beside their scores
    seconds: dict[str, float]


def find_circuit(loaded: LoadedModel, pairs: Sequence[Any], metric: Metric, *, method: str = "eap-ig",
                 steps: int = 5, grad_drop: bool = False, top: int | None = None, threshold: float | None = None,
                 fractions: Sequence[float] = PERCENTAGES, randoms: int = 5, ablation: str = "patch",
                 check: int = 0, seed: int = 0, progress: Callable[[str, int, int], None] | None = None,
                 ) -> tuple[Layout, CircuitResult]:
    """Score every edge (method eap, eap-ig, or exact: every edge patched alone), choose the circuit (top edges or
    |score| >= threshold), its faithfulness curve and, with check > 0, the exact patch of the top `check` edges."""
    if method not in METHODS:
        raise AttnprobeError(f"--method {method!r}: use one of {', '.join(METHODS)}")
    if steps < 1:
        raise AttnprobeError(f"--steps {steps}: give at least 1")
    if grad_drop and method == "exact":
        raise AttnprobeError("--grad-drop applies to --method eap or eap-ig: exact patching has no gradient to drop")
    layout = find_layout(loaded)
    graph = layout.graph
    prompts = tokenize(loaded, pairs)
    seconds: dict[str, float] = {}
    tick = time.perf_counter()
    say = (lambda stage: (lambda d, t: progress(stage, d, t))) if progress else (lambda stage: None)  # noqa: E731
    if method == "exact":
        edges = list(zip(*np.nonzero(graph.mask)))
        scores = np.zeros(graph.mask.shape)
        values = exact(loaded, layout, prompts, metric, edges, say("exact patching"))
        for (s, r), v in zip(edges, values):
            scores[s, r] = v
    else:
        scores = attribute(loaded, layout, prompts, metric, steps=1 if method == "eap" else steps,
                           grad_drop=grad_drop, progress=say("attribution"))
    seconds["scores"] = time.perf_counter() - tick
    circuit = choose(graph, scores, top, threshold)
    checked = None
    if check:
        tick = time.perf_counter()
        chosen = top_edges(graph, scores, check)
        edges = list(zip(*np.nonzero(chosen)))
        values = exact(loaded, layout, prompts, metric, edges, say("exact check"))
        checked = pd.DataFrame({"sender": [graph.senders[s] for s, _ in edges],
                                "receiver": [graph.receivers[r][0] for _, r in edges],
                                "input": [graph.receivers[r][1] for _, r in edges],
                                "score": [scores[s, r] for s, r in edges], "exact": values})
        seconds["check"] = time.perf_counter() - tick
    faith = None
    if fractions:
        tick = time.perf_counter()
        faith = faithfulness(loaded, layout, prompts, metric, scores, fractions=fractions, randoms=randoms,
                             ablation=ablation, seed=seed, progress=say("faithfulness"))
        seconds["faithfulness"] = time.perf_counter() - tick
    return layout, CircuitResult(scores, circuit, faith, checked, {k: round(v, 3) for k, v in seconds.items()})


def choose(graph: Graph, scores: np.ndarray, top: int | None, threshold: float | None) -> np.ndarray:
    """The circuit: the `top` edges of largest |score|, or every edge with |score| >= threshold."""
    if top is not None and threshold is not None:
        raise AttnprobeError("--top and --threshold both choose the circuit: give one of them")
    if threshold is not None:
        if threshold < 0:
            raise AttnprobeError(f"--threshold {threshold}: give a |score| of 0 or more")
        return graph.mask & (np.abs(scores) >= threshold)
    if top is not None and top < 1:
        raise AttnprobeError(f"--top {top}: give at least 1 edge")
    return top_edges(graph, scores, top if top is not None else max(1, graph.edge_count // 100))
