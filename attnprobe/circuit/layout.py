"""Where a decoder computes what the circuit graph reads: its norms, MLPs, query/key/value maps and output
projections, found by what they do and checked against one short run.

Three block shapes are read (see the package's docstring): pre-norm (x + attn(ln1 x), then + mlp(ln2 .)), sandwich
(Gemma 2 and 3: each of attention's and the MLP's outputs through a norm of its own before it is added) and
post-norm (OPT-350m: ln_a(x + attn(x)), then ln_f(. + mlp(.)), the stream itself renormalised)."""

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
NORM_KINDS = ("layer", "rms", "rms1")  # LayerNorm, RMSNorm with gain w (Llama), RMSNorm with gain 1 + w (Gemma)


@dataclass(frozen=True)
class Norm:
    """A LayerNorm or RMSNorm read as a linear map once its per-position statistics are frozen: its output is
    sum over the parts c of its input of centre(c) x inv x gain, plus its bias; `inv` (1 / sigma, or 1 / rms) is the
    run's own, from the norm's whole input. Computed in float32, as Gemma's norms compute."""

    module: nn.Module
    kind: str  # one of NORM_KINDS
    eps: float

    def gain(self) -> Tensor:
        weight = getattr(self.module, "weight", None)
        if weight is None:
            return torch.ones(())  # a 0-d tensor: combines with one on any device
        return weight.detach().float() + (1.0 if self.kind == "rms1" else 0.0)  # [hidden]

    def inverse(self, x: Tensor) -> Tensor:
        """1 / sigma (LayerNorm) or 1 / rms per position of the norm's input x [..., hidden]: [..., 1] float32."""
        x = x.detach().float()
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., 1]

    def frozen(self, part: Tensor, inv: Tensor) -> Tensor:
        """A part of the norm's input [..., hidden] mapped at the frozen statistics inv [..., 1]: what it adds to the
        norm's output, in part's dtype (no bias)."""
        value = part.float()
        if self.kind == "layer":
            value = value - value.mean(-1, keepdim=True)
        return (value * inv * self.gain()).to(part.dtype)  # [..., hidden]

    def backward(self, x: Tensor, cotangents: Tensor) -> Tensor:
        """The norm's vector-Jacobian products at its input x [..., hidden] for a batch of cotangents of its output
        [r, ..., hidden]: [r, ..., hidden] float32, the statistics' own derivative included (the closed form of
        autograd's backward, one pass for every cotangent: y = gain x centre(x) x inv, inv = 1 / sqrt(mean(centre(x)^2)
        + eps), so the product is centre(a inv - centre(x) inv^3 mean(a centre(x))) with a = gain x cotangent)."""
        x = x.detach().float()
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)  # [..., hidden]
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., 1]
        a = cotangents.float() * self.gain()  # [r, ..., hidden]
        dot = (a * x).mean(-1, keepdim=True)  # [r, ..., 1]
        out = a.mul_(inv).addcmul_(x * inv.pow(3), dot, value=-1.0)  # [r, ..., hidden]
        return out - out.mean(-1, keepdim=True) if self.kind == "layer" else out

    def bias(self) -> Tensor | None:
        bias = getattr(self.module, "bias", None) if self.kind == "layer" else None
        return None if bias is None else bias.detach().float()


def norm_of(module: nn.Module, x: Tensor, y: Tensor) -> Norm | None:
    """The Norm reading of a module that computed y from x in the probe run, or None where no form matches."""
    eps = next((getattr(module, n) for n in ("eps", "variance_epsilon", "epsilon") if hasattr(module, n)), None)
    if not isinstance(eps, float) or x.shape[-1] != y.shape[-1]:
        return None
    for kind in NORM_KINDS:
        norm = Norm(module, kind, eps)
        want = norm.frozen(x.float(), norm.inverse(x))  # [..., hidden]
        bias = norm.bias()
        want = want if bias is None else want + bias
        if close(y, want):
            return norm
    return None


def close(got: Tensor, want: Tensor, scale: float | None = None) -> bool:
    """got equals want (both flattened to [positions, hidden]) within float32 error."""
    got, want = got.detach().reshape(-1, got.shape[-1]).float(), want.detach().reshape(-1, want.shape[-1]).float()
    if got.shape != want.shape:
        return False
    scale = scale or float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) <= 1e-4 * scale


@dataclass(frozen=True)
class Layout:
    """A decoder's parts as the graph reads them.

    shape: "pre-norm", "sandwich" or "post-norm". post_attn / post_mlp (sandwich): per block the norm applied to
    the attention's / the MLP's output before it is added; stream (post-norm): the norms the stream itself passes,
    two a block (after the attention's add, after the MLP's), the sender records carried through them."""

    parts: Parts
    graph: Graph
    ln1: list[nn.Module]  # per block, the norm whose output the attention reads (nn.Identity: it reads the stream)
    ln2: list[nn.Module]  # per block, the module whose input is the MLP receiver's input (its norm, or its first map)
    mlps: list[nn.Module]  # per block, the module whose output is the MLP sender's output
    qkv: list[list[tuple[nn.Module, slice]]]  # per block, per q/k/v receiver: the map and its slice of the output
    w_out: list[Tensor]  # per block, the output projection as [hidden, heads, head_dim]
    shape: str = "pre-norm"
    post_attn: tuple[Norm | None, ...] = ()
    stream: tuple[Norm, ...] = ()
    tail: nn.Module | None = None  # post-norm: what the model applies to the last block's output (OPT's project_out)
    ln1_norms: tuple[Norm | None, ...] = ()  # per block, ln1 read as a Norm (None: no form matched, or none)

    @property
    def post_norm(self) -> bool:
        return self.shape == "post-norm"


def find_layout(loaded: LoadedModel) -> Layout:
    """The parts of a decoder the circuit graph needs, found by what they do; refuses a model whose residual stream
    is neither the sum of what its attention and MLPs add (pre-norm, sandwich) nor that sum renormalised after each
    add (post-norm)."""
    parts = find_parts(loaded)
    graph = Graph(len(parts.blocks), parts.heads, parts.kv_heads)
    seen, final = probe(loaded, parts)
    found = [block_parts(loaded, parts, layer, block, seen) for layer, block in enumerate(parts.blocks)]
    shapes = {f.shape for f in found}
    if len(shapes) > 1:
        raise AttnprobeError(f"{loaded.spec}: its blocks are of different shapes ({', '.join(sorted(shapes))}): "
                             "circuit reads models whose blocks are all of one shape")
    shape = shapes.pop()
    tail = None
    if shape == "post-norm":
        tail = post_norm_tail(loaded, parts, seen, final)
    elif parts.final is None:
        raise AttnprobeError(f"{loaded.spec}: found no norm after the last block: circuits read the logits' input "
                             "there")
    check_heads_apart(loaded, parts, seen)
    qkv = [qkv_maps(parts, layer) for layer in range(graph.layers)]
    w_out = [out_weight(module, parts) for module in parts.projections]
    return Layout(parts, graph, [f.ln1 for f in found], [f.ln2 for f in found], [f.mlp for f in found], qkv, w_out,
                  shape, tuple(f.post_attn for f in found), tuple(n for f in found for n in f.stream), tail,
                  tuple(reading(f.ln1, seen) if id(f.ln1) in seen else None for f in found))


def probe(loaded: LoadedModel, parts: Parts) -> tuple[dict[int, tuple[tuple, dict, Any]], Tensor]:
    """One short run recording every module's arguments and output, by module id, and the last hidden state."""
    seen: dict[int, tuple[tuple, dict, Any]] = {}

    def note(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        seen[id(module)] = (args, kwargs, output)

    handles = [m.register_forward_hook(note, with_kwargs=True) for m in loaded.model.modules()]
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(1, 5, device=loaded.device) % vocab)[None]  # [1, 4]
    try:
        with torch.no_grad():
            final = loaded.model(**forward_kwargs(loaded.model, ids, torch.ones_like(ids))).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return seen, final


def first(value: Any) -> Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def hidden_of(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


@dataclass(frozen=True)
class Found:
    shape: str
    ln1: nn.Module
    ln2: nn.Module
    mlp: nn.Module
    post_attn: Norm | None = None
    stream: tuple[Norm, ...] = ()


def mlp_modules(block: nn.Module, attention: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(the module reading the MLP's input, the module returning its output): the block's MLP module for both, or
    where the block calls its MLP's maps itself (OPT's fc1, fc2), its first and last linear map outside attention."""
    mlp = next((getattr(block, n) for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    if mlp is not None:
        return mlp, mlp
    inside = {id(m) for m in attention.modules()}
    maps = [m for m in block.modules() if id(m) not in inside and isinstance(m, nn.Linear)]
    return (maps[0], maps[-1]) if len(maps) >= 2 else None


def block_parts(loaded: LoadedModel, parts: Parts, layer: int, block: nn.Module, seen: dict) -> Found:
    """One block's parts, checked on the probe run: the heads' contributions add up to the attention's output, and
    the block is x + post_attn(attn(ln1 x)), then + post_mlp(mlp(ln2 .)) (pre-norm: no post norms; sandwich: both)
    or ln_f(h + mlp(h)) with h = ln_a(x + attn(x)) (post-norm)."""
    unsupported = (f"{loaded.spec}: {type(block).__name__} is neither a pre-norm, a sandwich-norm nor a post-norm "
                   "block (parallel attention and MLP as in GPT-NeoX and Phi are not read): circuit supports decoders "
                   "such as GPT-2, Llama, Qwen, Mistral, Gemma 2 and OPT")
    attention = parts.attentions[layer]
    mlp = mlp_modules(block, attention)
    if mlp is None or any(id(m) not in seen for m in (attention, block, *mlp)):
        raise AttnprobeError(unsupported)
    inner = {id(m) for m in attention.modules()} | {id(m) for part in mlp for m in part.modules()}
    own = [m for m in block.modules() if m is not block and id(m) not in inner and id(m) in seen]
    x = hidden_of(*seen[id(block)][:2])  # [1, seq, hidden]
    out = first(seen[id(block)][2])  # [1, seq, hidden]
    attn_in, attn_out = hidden_of(*seen[id(attention)][:2]), first(seen[id(attention)][2])  # [1, seq, hidden]
    mlp_in, mlp_out = hidden_of(*seen[id(mlp[0])][:2]), first(seen[id(mlp[1])][2])  # [(1,) seq, hidden]
    if not close(heads_sum(parts, layer, seen), attn_out):
        raise AttnprobeError(unsupported)
    scale = float(out.detach().abs().max()) or 1.0
    tensors = (x, out, attn_in, attn_out, mlp_in, mlp_out)
    found = additive(own, seen, mlp, tensors, scale)
    if found is not None and found.shape == "sandwich" and getattr(parts.projections[layer], "bias", None) is not None:
        found = None  # the bias would pass the post-attention norm at each run's own scale: no sender carries it
    found = found if found is not None else renormalised(own, seen, mlp, tensors, scale)
    if found is None:
        raise AttnprobeError(unsupported)
    return found


def producer(own: list[nn.Module], seen: dict, tensor: Tensor) -> nn.Module | None:
    """The block's own module (not attention's, not the MLP's) whose output is `tensor` (the object, or the same
    values reshaped)."""
    found = next((m for m in own if first(seen[id(m)][2]) is tensor), None)
    return found if found is not None else next((m for m in own if isinstance(first(seen[id(m)][2]), Tensor)
                          and first(seen[id(m)][2]).numel() == tensor.numel()
                          and torch.equal(first(seen[id(m)][2]).reshape(tensor.shape), tensor)), None)


def consumer(own: list[nn.Module], seen: dict, tensor: Tensor) -> nn.Module | None:
    """The block's own module whose input is `tensor` (the object) and that changes it (not a dropout)."""
    return next((m for m in own if (seen[id(m)][0] or seen[id(m)][1]) and hidden_of(*seen[id(m)][:2]) is tensor
                 and not torch.equal(first(seen[id(m)][2]), tensor)), None)


def reading(module: nn.Module, seen: dict) -> Norm | None:
    args, kwargs, output = seen[id(module)]
    return norm_of(module, hidden_of(args, kwargs), first(output))


def additive(own: list, seen: dict, mlp: tuple, t: tuple, scale: float) -> Found | None:
    """Pre-norm or sandwich: the stream x + post_attn(attn_out) + post_mlp(mlp_out), each post norm optional."""
    x, out, attn_in, attn_out, mlp_in, mlp_out = t
    ln1 = producer(own, seen, attn_in)
    ln1 = nn.Identity() if ln1 is None and attn_in is x else ln1
    ln2 = producer(own, seen, mlp_in)
    if ln1 is None or ln2 is None:
        return None
    middle = hidden_of(*seen[id(ln2)][:2])  # [(1,) seq, hidden]: the stream the MLP's norm reads
    post_attn, post_mlp = consumer(own, seen, attn_out), consumer(own, seen, mlp_out)
    added_attn = first(seen[id(post_attn)][2]) if post_attn is not None else attn_out
    added_mlp = first(seen[id(post_mlp)][2]) if post_mlp is not None else mlp_out
    if not (close(middle, x + added_attn, scale) and close(out, middle.reshape(out.shape)
                                                           + added_mlp.reshape(out.shape), scale)):
        return None
    norms = [reading(m, seen) if m is not None else None for m in (post_attn, post_mlp)]
    if (post_attn is not None and norms[0] is None) or (post_mlp is not None and norms[1] is None):
        return None
    sandwich = post_attn is not None or post_mlp is not None
    if sandwich and (post_attn is None or post_mlp is None):
        return None  # a norm after one of the two alone: not a shape read here
    return Found("sandwich" if sandwich else "pre-norm", ln1, ln2, post_mlp if post_mlp is not None else mlp[1],
                 norms[0])


def renormalised(own: list, seen: dict, mlp: tuple, t: tuple, scale: float) -> Found | None:
    """Post-norm: attention reads x; h = ln_a(x + attn_out) is the MLP's input; the block returns ln_f(h +
    mlp_out)."""
    x, out, attn_in, attn_out, mlp_in, mlp_out = t
    if not (attn_in is x or close(attn_in, x)):
        return None
    ln_a, ln_f = producer(own, seen, mlp_in), producer(own, seen, out)
    if ln_a is None or ln_f is None:
        return None
    norms = (reading(ln_a, seen), reading(ln_f, seen))
    if None in norms:
        return None
    h_in, f_in = hidden_of(*seen[id(ln_a)][:2]), hidden_of(*seen[id(ln_f)][:2])
    if not (close(h_in, x + attn_out, scale) and close(f_in, mlp_in.reshape(f_in.shape) + mlp_out.reshape(f_in.shape),
                                                       scale)):
        return None
    return Found("post-norm", nn.Identity(), mlp[0], mlp[1], None, norms)


def heads_sum(parts: Parts, layer: int, seen: dict) -> Tensor:
    """The heads' contributions (plus the projection's bias) on the probe run: [1, seq, hidden]."""
    z = first(seen[id(parts.projections[layer])][0])  # [1, seq, heads * head_dim]
    heads = torch.einsum("bshd,ohd->bso", z.unflatten(-1, (parts.heads, parts.head_dim)),
                         out_weight(parts.projections[layer], parts))  # [1, seq, hidden]
    bias = getattr(parts.projections[layer], "bias", None)
    return heads if bias is None else heads + bias


def post_norm_tail(loaded: LoadedModel, parts: Parts, seen: dict, final: Tensor) -> nn.Module | None:
    """What a post-norm model applies to its last block's output to make the last hidden state: nothing, or one
    linear map (OPT-350m's project_out); refused where a norm follows too."""
    last = first(seen[id(parts.blocks[-1])][2])  # [1, seq, hidden]
    if parts.final is not None:
        raise AttnprobeError(f"{loaded.spec}: a post-norm decoder with a norm after its last block: circuit reads "
                             "post-norm decoders whose logits read the last block's output (OPT-350m)")
    if last.shape == final.shape and torch.equal(last, final):
        return None
    inside = {id(m) for block in parts.blocks for m in block.modules()}
    for module in loaded.model.modules():
        if (isinstance(module, nn.Linear) and id(module) not in inside and id(module) in seen
                and hidden_of(*seen[id(module)][:2]) is last and torch.equal(first(seen[id(module)][2]), final)):
            return module
    raise AttnprobeError(f"{loaded.spec}: its last hidden state is not its last block's output nor one linear map "
                         "of it: circuit cannot read its logits' input")


def check_heads_apart(loaded: LoadedModel, parts: Parts, seen: dict) -> None:
    """Refuses attention that normalises its queries or keys across heads (OLMo 2's q_norm over every head): one
    head's patched query would move the others'."""
    width = parts.heads * parts.head_dim
    for attention in parts.attentions:
        for module in attention.modules():
            if isinstance(module, nn.Linear) or module is attention or id(module) not in seen:
                continue
            args, kwargs, _ = seen[id(module)]
            given = (args or tuple(kwargs.values()) or (None,))[0]
            if isinstance(given, Tensor) and given.shape[-1] in (width, parts.kv_heads * parts.head_dim) \
                    and given.shape[-1] != parts.head_dim and "norm" in type(module).__name__.lower():
                raise AttnprobeError(f"{loaded.spec}: {type(module).__name__} in {type(attention).__name__} "
                                     "normalises every head's queries or keys together: circuit patches one head's "
                                     "input alone and cannot read such attention")


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
