"""`attnprobe circuit`: the edge graph, EAP, EAP-IG, exact edge patching and faithfulness against hand-written
plain-transformers hook oracles on tiny models (GPT-2, Llama with grouped-query attention, OPT pre-norm, Gemma 2's
sandwich norms with attention-logit and final-logit soft-capping, OPT post-norm as OPT-350m)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import zoo
from test_patch import PAIRS as TEXT_PAIRS
from test_patch import planted_model

from attnprobe import circuit as cc
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model


@dataclass(frozen=True)
class TaskPair:
    """The tasks module's pair (a stand-in written to its contract): token ids scored at the last position."""

    clean: str
    corrupt: str
    good: tuple[int, ...]
    bad: tuple[int, ...]


def logit_diff(logits: torch.Tensor, pairs) -> torch.Tensor:
    """The contract's logit-diff: mean logit of the good tokens minus mean logit of the bad ones, per row."""
    good = torch.stack([logits[k, list(p.good)].mean() for k, p in enumerate(pairs)])  # [rows]
    bad = torch.stack([logits[k, list(p.bad)].mean() for k, p in enumerate(pairs)])  # [rows]
    return good - bad


# the module names each family's source gives (the oracle's own lookup; circuit finds them by what they do)
NAMES = {
    "gpt2": {"layers": "transformer.h", "ln1": "ln_1", "ln2": "ln_2", "mlp": "mlp", "o": "attn.c_proj",
             "qkv": ("attn.c_attn",) * 3, "final": "transformer.ln_f"},
    "llama": {"layers": "model.layers", "ln1": "input_layernorm", "ln2": "post_attention_layernorm", "mlp": "mlp",
              "o": "self_attn.o_proj", "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "final": "model.norm"},
    # sandwich norms: the MLP sender is the post-feedforward norm's output; the heads pass the post-attention norm
    "gemma2": {"layers": "model.layers", "ln1": "input_layernorm", "ln2": "pre_feedforward_layernorm",
               "mlp": "post_feedforward_layernorm", "post_attn": "post_attention_layernorm", "o": "self_attn.o_proj",
               "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "final": "model.norm"},
    # OPT's other sizes: pre-norm, the MLP's maps called by the block itself on [seq, hidden]
    "opt": {"layers": "model.decoder.layers", "ln1": "self_attn_layer_norm", "ln2": "final_layer_norm", "mlp": "fc2",
            "o": "self_attn.out_proj", "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "final": "model.decoder.final_layer_norm"},
    # post-norm (OPT-350m's layout): heads and the MLP read the stream bare, which two LayerNorms a block renormalise
    "opt-post": {"layers": "model.decoder.layers", "ln2": "fc1", "mlp": "fc2", "o": "self_attn.out_proj",
                 "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "stream": ("self_attn_layer_norm", "final_layer_norm")},
}
FAMILIES = list(NAMES)
# the zoo's model of each family and its settings: Gemma 2 with both soft-caps small enough to bend its logits
MADE = {"opt": ("opt", {}), "gemma2": ("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 4.0}),
        "opt-post": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 16})}  # project_in, _out: 350m's


def vary_norms_and_biases(model):
    """Every 1-d parameter (norm weights, biases) moved off its initial 1 or 0, so that a norm's gain, its bias and
    the projections' biases all count."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def float64_rms(norm: torch.nn.Module) -> None:
    """Gemma's RMSNorm computes in float32 whatever the model's dtype: the oracle's own, in float64."""

    def forward(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)

    norm.forward = forward


def pairs_of(loaded) -> list[TaskPair]:
    ids = lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    return [TaskPair(p.clean, p.corrupt, (ids(p.answer),), (ids(p.wrong),)) for p in TEXT_PAIRS]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    made, settings = MADE.get(name, (name, {}))
    folder = zoo.make(made, tmp_path_factory.mktemp(f"circuit-{name}"), lm_head=True, **settings)
    from transformers import AutoModelForCausalLM

    if name in MADE:
        vary_norms_and_biases(AutoModelForCausalLM.from_pretrained(folder)).save_pretrained(folder)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval().double()
    for module in model.modules():
        if type(module).__name__ == "Gemma2RMSNorm":
            float64_rms(module)
    return name, loaded, Oracle(name, model, loaded.num_heads, loaded.num_kv_heads)  # one oracle: its runs cached


class Oracle:
    """Edge patching by hand on one prompt, in float64: the senders' outputs from plain hooks, then one receiver's
    input moved by eps x (corrupt_u - clean_u) before its own norm (a query/key/value slice recomputed from it)."""

    def __init__(self, name: str, model, heads: int, kv_heads: int):
        self.n, self.model, self.heads, self.kv = NAMES[name], model, heads, kv_heads
        self.layers = list(model.get_submodule(self.n["layers"]))
        self.d = model.config.hidden_size // heads

    def part(self, layer: int, key: str):
        return self.layers[layer].get_submodule(self.n[key])

    def outputs(self, ids: list[int]) -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}
        def embed(_m, args, kwargs):
            seen["input"] = (args[0] if args else kwargs["hidden_states"])[0]

        handles = [self.layers[0].register_forward_pre_hook(embed, with_kwargs=True)]
        for layer in range(len(self.layers)):
            def heads(_m, args, layer=layer):
                o = self.part(layer, "o")
                w = o.weight if isinstance(o, torch.nn.Linear) else o.weight.t()  # [hidden, heads * d]
                for h in range(self.heads):
                    cut = slice(h * self.d, (h + 1) * self.d)
                    seen[f"a{layer}.h{h}"] = args[0][0][:, cut] @ w[:, cut].t()

            def sandwich(norm, args, layer=layer):  # each head through the post-attention norm at this run's rms
                scale = (1 + norm.weight) / (args[0][0].pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
                for h in range(self.heads):
                    seen[f"a{layer}.h{h}"] = seen[f"a{layer}.h{h}"] * scale

            handles.append(self.part(layer, "o").register_forward_pre_hook(heads))
            if "post_attn" in self.n:
                handles.append(self.part(layer, "post_attn").register_forward_pre_hook(sandwich))
            handles.append(self.part(layer, "mlp").register_forward_hook(  # OPT's fc2: [seq, hidden]
                lambda _m, _a, out, layer=layer: seen.__setitem__(f"m{layer}", out.reshape(-1, out.shape[-1]))))
            handles += self.stream_hooks(layer, seen)
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([ids]))
        finally:
            for handle in handles:
                handle.remove()
        return seen

    def stream_hooks(self, layer: int, seen: dict) -> list:
        """Post-norm: each stream norm's 1 / sigma by hand (inv{k}, [seq, 1]) and the stream at each point (at{p})."""
        if "stream" not in self.n:
            return []
        handles = []
        for second, name in enumerate(self.n["stream"]):
            k = 2 * layer + second

            def stats(_m, args, k=k):
                x = args[0].reshape(-1, args[0].shape[-1])  # [seq, hidden]
                centred = x - x.mean(-1, keepdim=True)
                seen[f"inv{k}"] = 1 / (centred.pow(2).mean(-1, keepdim=True) + _m.eps).sqrt()

            norm = self.layers[layer].get_submodule(name)
            handles.append(norm.register_forward_pre_hook(stats))
            handles.append(norm.register_forward_hook(
                lambda _m, _a, out, k=k: seen.__setitem__(f"at{k + 1}", out.reshape(-1, out.shape[-1]))))
        if layer == 0:
            handles.append(self.layers[0].register_forward_pre_hook(
                lambda _m, args, kwargs: seen.__setitem__("at0", (args[0] if args else kwargs["hidden_states"])[0]),
                with_kwargs=True))
        return handles

    def carried(self, seen: dict, sender: str, point: int) -> torch.Tensor:
        """Post-norm: a sender's contribution to the stream at a point [seq, hidden]: its output through each stream
        norm between, centred, times 1 / sigma and the norm's weight; the input's is what the others leave of the
        stream there (the embeddings and every bias)."""
        if sender == "input":
            others = [u for u in seen if u[0] in "am" and u[1].isdigit() and self.first_norm(u) < point]
            return seen[f"at{point}"] - sum((self.carried(seen, u, point) for u in others),
                                            torch.zeros_like(seen["input"]))
        value = seen[sender]
        for k in range(self.first_norm(sender), point):
            norm = self.layers[k // 2].get_submodule(self.n["stream"][k % 2])
            value = (value - value.mean(-1, keepdim=True)) * seen[f"inv{k}"] * norm.weight
        return value

    @staticmethod
    def first_norm(sender: str) -> int:
        return 2 * int(sender[1:].split(".")[0]) + (sender[0] == "m")

    def point(self, receiver: tuple[str, str]) -> int:
        node = receiver[0]
        if node == "logits":
            return 2 * len(self.layers)
        return 2 * int(node[1:].split(".")[0]) + node.startswith("m")

    def diff(self, clean: dict, corrupt: dict, sender: str, receiver: tuple[str, str]) -> torch.Tensor:
        """What patching the edge adds to the receiver's input [seq, hidden]: corrupt - clean output (post-norm:
        each carried to the receiver's point at its own run's statistics)."""
        if "stream" not in self.n:
            return corrupt[sender] - clean[sender]
        return self.carried(corrupt, sender, self.point(receiver)) - self.carried(clean, sender, self.point(receiver))

    def metric(self, ids: list[int], pair: TaskPair, receiver: tuple[str, str] | None = None,
               delta: torch.Tensor | None = None, frozen: tuple[int, torch.Tensor] | None = None) -> float:
        handles = []
        if receiver is not None:
            handles = self.receiver_hooks(receiver, delta)
        if frozen is not None:  # a block's contribution to the residual stream held at the given value
            def hold(_m, args, kwargs, out):
                x = args[0] if args else kwargs["hidden_states"]
                held = x + frozen[1]
                return (held, *out[1:]) if isinstance(out, tuple) else held

            handles.append(self.layers[frozen[0]].register_forward_hook(hold, with_kwargs=True))
        try:
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()
        return float(logits[list(pair.good)].mean() - logits[list(pair.bad)].mean())

    def receiver_hooks(self, receiver: tuple[str, str], delta: torch.Tensor) -> list:
        node, kind = receiver
        if node == "logits" and "stream" in self.n:  # post-norm: the logits read the last block's output
            return [self.layers[-1].register_forward_hook(lambda _m, _a, out: out + delta)]
        if node == "logits":
            return [self.model.get_submodule(self.n["final"]).register_forward_pre_hook(
                lambda _m, args: (args[0] + delta, *args[1:]))]
        layer = int(node[1:].split(".")[0])
        if node.startswith("m"):  # OPT's fc1 reads [seq, hidden]
            return [self.part(layer, "ln2").register_forward_pre_hook(
                lambda _m, args: (args[0] + delta.reshape(args[0].shape), *args[1:]))]
        index = int(node.split(".")[1].lstrip("hkv"))
        width = self.heads * self.d if kind == "q" else self.kv * self.d
        offset = {"q": 0, "k": self.heads * self.d, "v": self.heads * self.d + self.kv * self.d}[kind]
        names = self.n["qkv"]
        module = self.layers[layer].get_submodule(names["qkv".index(kind)])
        combined = names[0] == names["qkv".index(kind)] and kind != "q"
        start = (offset if combined else 0) + index * self.d
        assert index * self.d < width
        store = {}
        def keep(_m, args, kwargs):
            store["x"] = args[0] if args else kwargs["hidden_states"]

        pre = self.layers[layer].register_forward_pre_hook(keep, with_kwargs=True)

        def swap(_m, _a, out):
            moved = store["x"] + delta
            normed = self.part(layer, "ln1")(moved) if "ln1" in self.n else moved  # post-norm: read bare
            full = (torch.nn.functional.linear(normed, module.weight, module.bias)
                    if isinstance(module, torch.nn.Linear) else normed @ module.weight + module.bias)
            out = out.clone()
            out[..., start : start + self.d] = full[..., start : start + self.d]
            return out

        return [pre, module.register_forward_hook(swap)]


def ids_of(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def some_edges(graph: cc.Graph, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Edges into every kind of receiver: q, k, v, an MLP, the logits, drawn at random."""
    rng = np.random.default_rng(seed)
    logits = len(graph.receivers) - 1
    groups = [[r for r, (_, k) in enumerate(graph.receivers[:logits]) if k == kind] for kind in ("q", "k", "v", "")]
    edges = []
    for group in [*groups, [logits]]:
        for _ in range(count):
            r = int(rng.choice(group))
            edges.append((int(rng.integers(graph.prefix(r))), r))
    return edges


def oracle_change(oracle: Oracle, loaded, pairs, edge, graph, eps: float) -> float:
    """The mean over pairs of metric(eps) - metric(0), by hand."""
    s, r = edge
    total = 0.0
    for pair in pairs:
        clean, a, b, base = oracle_runs(oracle, loaded, pair)
        sender = graph.senders[s]
        delta = eps * oracle.diff(a, b, sender, graph.receivers[r])[None]
        total += oracle.metric(clean, pair, graph.receivers[r], delta) - base
    return total / len(pairs)


def oracle_runs(oracle: Oracle, loaded, pair) -> tuple:
    """A pair's clean ids, clean and corrupt sender outputs and clean metric, computed once per oracle."""
    cache = oracle.__dict__.setdefault("cache", {})
    if pair not in cache:
        clean, corrupt = ids_of(loaded, pair.clean), ids_of(loaded, pair.corrupt)
        cache[pair] = (clean, oracle.outputs(clean), oracle.outputs(corrupt), oracle.metric(clean, pair))
    return cache[pair]


def test_exact_edge_patching_equals_the_hook_oracle(family):
    """Each edge patched alone (q, k, v of grouped heads, MLPs, logits): the mean metric change equals the hand
    oracle's on every family."""
    _, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    edges = some_edges(graph, 1)
    got = cc.exact(loaded, layout, prompts, logit_diff, edges)
    want = np.array([oracle_change(oracle, loaded, pairs, e, graph, 1.0) for e in edges])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    assert np.abs(want).max() > 1e-3  # the edges move the metric: the comparison is not of zeros


def test_eap_is_the_first_order_change_of_the_exact_patch(family):
    """EAP's score of an edge = (M(eps) - M(-eps)) / (2 eps) with eps x (corrupt_u - clean_u) added to the receiver's
    input alone (float64 oracle, central difference)."""
    _, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    scores = cc.attribute(loaded, layout, prompts, logit_diff)
    eps = 1e-3
    edges = some_edges(graph, 1, seed=1)
    want = np.array([(oracle_change(oracle, loaded, pairs, e, graph, eps) -
                      oracle_change(oracle, loaded, pairs, e, graph, -eps)) / (2 * eps) for e in edges])
    got = np.array([scores[e] for e in edges])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, np.abs(want).max()))
    assert np.abs(want).max() > 1e-3
    assert (scores[~graph.mask] == 0).all()


def contribution(oracle: Oracle, ids: list[int], layer: int) -> torch.Tensor:
    """What a block adds to the residual stream on one prompt: output - input (computed once per oracle)."""
    cache = oracle.__dict__.setdefault("contributions", {})
    if (tuple(ids), layer) not in cache:
        cache[(tuple(ids), layer)] = block_output_change(oracle, ids, layer)
    return cache[(tuple(ids), layer)]


def block_output_change(oracle: Oracle, ids: list[int], layer: int) -> torch.Tensor:
    seen = {}

    def keep(_m, args, kwargs, out):
        seen["c"] = (out[0] if isinstance(out, tuple) else out) - (args[0] if args else kwargs["hidden_states"])

    handle = oracle.layers[layer].register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        oracle.model(input_ids=torch.tensor([ids]))
    handle.remove()
    return seen["c"]


def test_grad_drop_is_the_mean_magnitude_of_the_first_order_changes_with_a_block_held(family):
    """GradDrop's score of an edge = sum over blocks l of |d metric / d eps| with eps x (corrupt_u - clean_u) added to
    the receiver's input and block l's contribution to the residual stream held at its clean value, / (layers - 1)
    (float64 oracle, central differences)."""
    name, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)[:2]
    if name == "opt-post":  # no residual add to drop: refused in one line
        with pytest.raises(AttnprobeError, match="--grad-drop on a post-norm decoder"):
            cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, grad_drop=True)
        return
    scores = cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, grad_drop=True)
    eps = 1e-3
    edges = some_edges(graph, 1, seed=3)[1::2]  # a key, an MLP: a receiver before the last block and one in it
    want = []
    for s, r in edges:
        total = 0.0
        for layer in range(graph.layers):
            change = 0.0
            for pair in pairs:
                clean, a, b, _ = oracle_runs(oracle, loaded, pair)
                held = (layer, contribution(oracle, clean, layer))
                sender = graph.senders[s]
                up, down = (oracle.metric(clean, pair, graph.receivers[r], sign * eps * (b[sender] - a[sender])[None],
                                          held) for sign in (1, -1))
                change += (up - down) / (2 * eps) / len(pairs)
            total += abs(change)
        want.append(total / (graph.layers - 1))
    got = np.array([scores[e] for e in edges])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, max(want)))
    assert max(want) > 1e-3


def patched_pattern(oracle: Oracle, clean: list[int], receiver, delta: torch.Tensor, layer: int) -> torch.Tensor:
    """The layer's attention pattern [heads, seq, seq] with the receiver's input moved by delta (eager, float64)."""
    handles = oracle.receiver_hooks(receiver, delta)
    try:
        with torch.no_grad():
            return oracle.model(input_ids=torch.tensor([clean]), output_attentions=True).attentions[layer][0]
    finally:
        for handle in handles:
            handle.remove()


def receiving_heads(graph, r: int) -> tuple[int, list[int]]:
    """The layer of a query or key receiver and the query heads that read it (a key head: its group's)."""
    node, kind = graph.receivers[r]
    layer = int(node[1:].split(".")[0])
    index = int(node.split(".")[1].lstrip("hkv"))
    return layer, [index] if kind == "q" else list(range(index * graph.group, (index + 1) * graph.group))


def oracle_qk(oracle: Oracle, loaded, pairs, edge, graph) -> float:
    """AtP*'s QK-fixed score of a query or key edge by hand, mean over pairs: the receiver's q or k slice patched
    exactly in a forward, the heads' new patterns A' read from eager attention, and sum over positions and the
    heads that read the slice of dM/dz_h . ((A'_h - A_h) V_h), dM/dz_h from a clean backward, V from the clean
    run."""
    s, r = edge
    layer, heads = receiving_heads(graph, r)
    total = 0.0
    for pair in pairs:
        clean, a, b, _ = oracle_runs(oracle, loaded, pair)
        delta = oracle.diff(a, b, graph.senders[s], graph.receivers[r])[None]  # [1, seq, hidden] (post-norm: carried)
        before, values, grad_z = clean_attention(oracle, clean, pair, layer)
        after = patched_pattern(oracle, clean, graph.receivers[r], delta, layer)  # [heads, seq, seq]
        for h in heads:  # after, before: [heads, seq, seq]; values: [kv heads, seq, dim]; grad_z: [seq, heads, dim]
            total += float(((after[h] - before[h]) @ values[h // graph.group] * grad_z[:, h]).sum())
    return total / len(pairs)


def clean_attention(oracle: Oracle, ids: list[int], pair: TaskPair, layer: int,
                    frozen: tuple[int, torch.Tensor] | None = None) -> tuple:
    """One clean prompt's patterns at a layer [heads, seq, seq], its values [kv heads, seq, dim] and dM/dz
    [seq, heads, dim] (a clean forward and backward with plain hooks; `frozen`: that block's contribution to the
    residual stream replaced by the given constant)."""
    seen = {}
    names = oracle.n["qkv"]
    v_map = oracle.layers[layer].get_submodule(names[2])
    offset = (oracle.heads + oracle.kv) * oracle.d if names[0] == names[2] else 0

    def keep_v(_m, _a, out):
        seen["v"] = out[0, :, offset : offset + oracle.kv * oracle.d].detach()  # [seq, kv heads x dim]

    def keep_z(_m, args):
        seen["z"] = args[0]
        args[0].retain_grad()

    def hold(_m, args, kwargs, out):
        held = (args[0] if args else kwargs["hidden_states"]) + frozen[1]
        return (held, *out[1:]) if isinstance(out, tuple) else held

    handles = [v_map.register_forward_hook(keep_v), oracle.part(layer, "o").register_forward_pre_hook(keep_z)]
    if frozen is not None:
        handles.append(oracle.layers[frozen[0]].register_forward_hook(hold, with_kwargs=True))
    try:
        out = oracle.model(input_ids=torch.tensor([ids]), output_attentions=True)
        logits = out.logits[0, -1]
        (logits[list(pair.good)].mean() - logits[list(pair.bad)].mean()).backward()
    finally:
        for handle in handles:
            handle.remove()
        oracle.model.zero_grad(set_to_none=True)
    values = seen["v"].unflatten(-1, (oracle.kv, oracle.d)).transpose(0, 1)  # [kv heads, seq, dim]
    grad = seen["z"].grad if seen["z"].grad is not None else torch.zeros_like(seen["z"])  # none: its block held
    grad_z = grad[0].unflatten(-1, (oracle.heads, oracle.d))  # [seq, heads, dim]
    return out.attentions[layer][0].detach(), values, grad_z


def qk_edges(graph: cc.Graph, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Edges into queries and keys of every layer, drawn at random."""
    return [e for e in some_edges(graph, count, seed) if graph.receivers[e[1]][1] in ("q", "k")]


def test_qk_fix_equals_the_hook_oracle(family):
    """--qk-fix's score of query and key edges (grouped keys summed over their query heads) equals the hand-written
    oracle: the slice patched exactly, the new pattern read, linear only after it (float64 oracle; attnprobe runs
    float32: rtol 1e-3)."""
    _, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    scores = cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, qk_fix=True)
    edges = qk_edges(graph, 3, seed=4)
    want = np.array([oracle_qk(oracle, loaded, pairs, e, graph) for e in edges])
    got = np.array([scores[e] for e in edges])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, np.abs(want).max()))
    assert np.abs(want).max() > 1e-3
    assert {graph.receivers[r][1] for _, r in edges} == {"q", "k"}


def heads_change(oracle: Oracle, loaded, pair, edge, graph) -> tuple[list[int], int, torch.Tensor]:
    """A pair's clean ids, the receiver's layer and z' - z [1, seq, heads x dim]: the change of the layer's output
    projection input (every head's output) when the edge alone is patched exactly (an eager float64 forward)."""
    s, r = edge
    layer = int(graph.receivers[r][0][1:].split(".")[0])
    clean, a, b, _ = oracle_runs(oracle, loaded, pair)
    delta = oracle.diff(a, b, graph.senders[s], graph.receivers[r])[None]  # [1, seq, hidden]
    seen = []
    handle = oracle.part(layer, "o").register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        oracle.metric(clean, pair)
        oracle.metric(clean, pair, graph.receivers[r], delta)
    finally:
        handle.remove()
    return clean, layer, seen[1] - seen[0]


def first_order_in_the_heads(oracle: Oracle, loaded, pairs, edge, graph, eps: float = 1e-2) -> float:
    """The exact patch of a query or key edge to first order in the heads' outputs, exact in the pattern, with no
    gradient: (M(z + eps dz) - M(z - eps dz)) / (2 eps), dz = z' - z at the output projection's input, the model
    run whole after it (a sandwich block's post-attention norm at its own rms; a post-norm block's stream norms),
    mean over pairs. eps 1e-2: Llama's RMSNorm computes in float32 even in the float64 oracle, which rounds M to ~1e-7
    of itself (1e-5 of the quotient at this step), and the step's own error, eps^2 / 6 times M's third derivative,
    is of that order."""
    total = 0.0
    for pair in pairs:
        clean, layer, dz = heads_change(oracle, loaded, pair, edge, graph)
        values = []
        for sign in (1, -1):
            handle = oracle.part(layer, "o").register_forward_pre_hook(
                lambda _m, args, step=sign * eps * dz: (args[0] + step, *args[1:]))
            try:
                values.append(oracle.metric(clean, pair))
            finally:
                handle.remove()
        total += (values[0] - values[1]) / (2 * eps)
    return total / len(pairs)


def frozen_scale_score(oracle: Oracle, loaded, pairs, edge, graph) -> float:
    """Sandwich: the same score with dM/dz read at the post-attention norm's frozen scale, W_O^T (s * G) with s =
    (1 + w) / rms of the clean attention output and G the gradient at the norm's output: the definition that leaves
    out how the norm's rms moves with the head's output, which an edge's patch moves."""
    total = 0.0
    for pair in pairs:
        clean, layer, dz = heads_change(oracle, loaded, pair, edge, graph)
        seen = {}

        def keep(norm, args, out, seen=seen):
            seen["scale"] = (1 + norm.weight) / (args[0].pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
            seen["out"] = out
            out.retain_grad()

        handle = oracle.part(layer, "post_attn").register_forward_hook(keep)
        try:
            logits = oracle.model(input_ids=torch.tensor([clean])).logits[0, -1]
            (logits[list(pair.good)].mean() - logits[list(pair.bad)].mean()).backward()
        finally:
            handle.remove()
            oracle.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            g_z = (seen["scale"] * seen["out"].grad) @ oracle.part(layer, "o").weight  # [1, seq, heads x dim]
            total += float((g_z * dz).sum())
    return total / len(pairs)


def test_qk_fix_is_the_exact_patch_to_first_order_in_the_heads_outputs(family):
    """The definition the QK fix stands on, on every block shape: its score of a query or key edge equals the exact
    edge patch to first order in the heads' outputs and exact in the pattern, by central differences at the output
    projection's input (no gradient; float64 oracle, attnprobe float32: rtol 1e-3). On Gemma 2's sandwich blocks
    the frozen-scale reading of dM/dz differs from it by far more than the tolerance: the fix takes the norm's full
    derivative, as the patch moves the norm's rms."""
    name, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)[:3]
    scores = cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, qk_fix=True)
    edges = qk_edges(graph, 2, seed=5)
    want = np.array([first_order_in_the_heads(oracle, loaded, pairs, e, graph) for e in edges])
    got = np.array([scores[e] for e in edges])
    atol = 1e-4 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=atol)
    assert np.abs(want).max() > 1e-3
    if name == "gemma2":
        frozen = np.array([frozen_scale_score(oracle, loaded, pairs, e, graph) for e in edges])
        assert np.abs(frozen - want).max() > 100 * (atol + 1e-3 * np.abs(want).max())


def test_qk_fix_moves_only_query_and_key_edges_and_reads_eap_igs_clean_point(family):
    """With --qk-fix the value, MLP and logits edges keep their scores bit for bit, the query and key edges move;
    under EAP-IG the fixed edges are those of EAP (the fix is taken at the clean run, the k = m point)."""
    _, loaded, _ = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    prompts = cc.tokenize(loaded, pairs_of(loaded))
    qk = np.array([kind in ("q", "k") for _, kind in graph.receivers])
    ig = cc.attribute(loaded, layout, prompts, logit_diff, steps=3)
    ig_fixed = cc.attribute(loaded, layout, prompts, logit_diff, steps=3, qk_fix=True)
    eap_fixed = cc.attribute(loaded, layout, prompts, logit_diff, qk_fix=True)
    assert (ig_fixed[:, ~qk] == ig[:, ~qk]).all()
    assert np.abs(ig_fixed[:, qk] - ig[:, qk]).max() > 1e-3
    np.testing.assert_allclose(ig_fixed[:, qk], eap_fixed[:, qk], rtol=0, atol=1e-12)
    assert (ig_fixed[~graph.mask] == 0).all()


def test_qk_fix_with_grad_drop_is_the_mean_magnitude_of_the_fixed_changes_with_a_block_held(family):
    """--qk-fix with --grad-drop: a query or key edge's score = sum over blocks l of |dM/dz . (A' - A) V| with dM/dz
    from a backward in which block l's contribution to the residual stream is held at its clean value (a constant),
    / (layers - 1). The edges are into the last block: held, it gives 0 (the heads' own block); the first block
    held leaves the full gradient. attnprobe runs float32 (rtol 1e-3, as the other oracle tests)."""
    name, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)[:2]
    if name == "opt-post":  # GradDrop is refused there, with or without the fix
        with pytest.raises(AttnprobeError, match="--grad-drop on a post-norm decoder"):
            cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, grad_drop=True, qk_fix=True)
        return
    scores = cc.attribute(loaded, layout, cc.tokenize(loaded, pairs), logit_diff, grad_drop=True, qk_fix=True)
    edges = [(graph.senders.index("m0"), graph.receivers.index(("a1.h1", "q"))),
             (graph.senders.index("m0"), graph.receivers.index((graph.kv_name(1, 0), "k")))]
    want = [sum(abs(held_qk_change(oracle, loaded, pairs, edge, graph, held)) for held in range(graph.layers)) /
            (graph.layers - 1) for edge in edges]
    got = np.array([scores[e] for e in edges])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * max(1.0, max(want)))
    assert min(want) > 1e-4


def held_qk_change(oracle: Oracle, loaded, pairs, edge, graph, held: int) -> float:
    """dM/dz . (A' - A) V summed over the receiving heads, mean over pairs, with dM/dz from a backward in which block
    `held`'s contribution to the residual stream is a constant (its clean value): no gradient passes through it."""
    s, r = edge
    layer, heads = receiving_heads(graph, r)
    total = 0.0
    for pair in pairs:
        clean, a, b, _ = oracle_runs(oracle, loaded, pair)
        before, values, grad_z = clean_attention(oracle, clean, pair, layer,
                                                 (held, contribution(oracle, clean, held)))
        delta = (b[graph.senders[s]] - a[graph.senders[s]])[None]  # [1, seq, hidden]
        after = patched_pattern(oracle, clean, graph.receivers[r], delta, layer)  # [heads, seq, seq]
        for h in heads:
            total += float(((after[h] - before[h]) @ values[h // graph.group] * grad_z[:, h]).sum())
    return total / len(pairs)


def test_eap_ig_with_one_step_is_eap_and_more_steps_move_it(family):
    _, loaded, _ = family
    layout = cc.find_layout(loaded)
    prompts = cc.tokenize(loaded, pairs_of(loaded))
    eap = cc.attribute(loaded, layout, prompts, logit_diff)
    np.testing.assert_allclose(cc.attribute(loaded, layout, prompts, logit_diff, steps=1), eap, rtol=0, atol=1e-9)
    ig = cc.attribute(loaded, layout, prompts, logit_diff, steps=3)
    assert np.abs(ig - eap).max() > 1e-4  # the gradient is taken elsewhere on the path


def test_eap_ig_integrates_the_gradient_on_the_line_from_the_corrupt_to_the_clean_input(family):
    """EAP-IG (m = 3) of the edges into the logits, against a float64 oracle of plain hooks: per pair, the gradient
    of the metric at the final norm's input with the first block's input set to corrupt + (k/m) (clean - corrupt),
    k = 1..m, averaged over k and contracted with corrupt_u - clean_u (the line starts at the corrupt input: a line
    from 2 clean - corrupt, its mirror, gives other scores)."""
    name, loaded, oracle = family
    if "final" not in NAMES[name]:
        pytest.skip("post-norm: the logits read the last block's output, tested by the carried oracles")
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    steps = 3
    got = cc.attribute(loaded, layout, prompts, logit_diff, steps=steps)[:, -1]  # [senders]: edges into the logits
    model = oracle.model
    final = model.get_submodule(NAMES[name]["final"])
    want = np.zeros(len(graph.senders))
    for k, pair in enumerate(pairs):
        n = int(prompts.mask[k].sum())
        clean, corrupt = (oracle.outputs(prompts.clean[k, :n].tolist()),
                          oracle.outputs(prompts.corrupt[k, :n].tolist()))
        start, end = corrupt["input"], clean["input"]  # [seq, hidden]
        for step in range(1, steps + 1):
            point = (start + (step / steps) * (end - start))[None]  # [1, seq, hidden]
            seen = []

            def swap(_m, args, kwargs, point=point):
                return ((point, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": point})

            def keep(_m, args, seen=seen):
                x = args[0].detach().requires_grad_(True)  # [1, seq, hidden]
                seen.append(x)
                return (x, *args[1:])

            handles = [oracle.layers[0].register_forward_pre_hook(swap, with_kwargs=True),
                       final.register_forward_pre_hook(keep)]
            try:
                logits = model(input_ids=torch.tensor([prompts.clean[k, :n].tolist()])).logits[:, -1]  # [1, vocab]
                (g,) = torch.autograd.grad(logit_diff(logits, [pair]).sum(), seen)  # [1, seq, hidden]
            finally:
                for handle in handles:
                    handle.remove()
            for s, sender in enumerate(graph.senders):
                want[s] += float(((corrupt[sender] - clean[sender]) * g[0]).sum()) / steps
    want /= len(pairs)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
    mirror = cc.attribute(loaded, layout, prompts, logit_diff, steps=1)[:, -1]  # EAP: the clean point alone
    assert np.abs(mirror - want).max() > 1e-2 * scale  # the steps matter here: the test can tell the lines apart


def test_circuit_evaluation_ends_at_the_clean_and_corrupt_runs_and_one_edge_out_is_its_exact_patch(family):
    """Every edge in the circuit: the clean metric; none: the corrupt run's; all but one: the clean metric plus that
    edge's exact patch (the sequential evaluator against the restarted copies)."""
    _, loaded, _ = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    bases = cc.baselines(loaded, layout, prompts, logit_diff)
    clean = float(torch.cat([b.clean for b in bases]).mean())
    corrupt = float(torch.cat([b.corrupt for b in bases]).mean())
    tol = 1e-4 * max(1.0, abs(clean), abs(corrupt))
    assert cc.evaluate(loaded, layout, bases, logit_diff, graph.mask) == pytest.approx(clean, abs=tol)
    assert cc.evaluate(loaded, layout, bases, logit_diff, np.zeros_like(graph.mask)) == pytest.approx(corrupt, abs=tol)
    edges = some_edges(graph, 1, seed=2)
    changes = cc.exact(loaded, layout, prompts, logit_diff, edges)
    for edge, change in zip(edges, changes):
        circuit = graph.mask.copy()
        circuit[edge] = False
        assert cc.evaluate(loaded, layout, bases, logit_diff, circuit) == pytest.approx(clean + change, abs=tol)


def test_the_graph_counts_and_names_grouped_heads():
    graph = cc.Graph(layers=2, heads=4, kv_heads=2)
    assert graph.senders[:6] == ["input", "a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0"]
    assert graph.receivers[4:9] == [("a0.kv0", "k"), ("a0.kv1", "k"), ("a0.kv0", "v"), ("a0.kv1", "v"), ("m0", "")]
    assert graph.serves("a1.kv1") == ["a1.h2", "a1.h3"]
    # layer 0: 8 q/k/v receivers read the input, the MLP the input and 4 heads; layer 1: 6 and 10; logits: 11
    assert graph.edge_count == 8 * 1 + 5 + 8 * 6 + 10 + 11
    assert cc.Graph(1, 2, 2).receivers[2] == ("a0.h0", "k")


def test_cpr_and_cmd_are_mibs_trapezoids():
    """On a known curve, by hand: CPR = sum (x2 - x1)(f1 + f2)/2, CMD the same of |1 - f|, over the fractions."""
    x = np.array([0.1, 0.5, 1.0])
    f = np.array([0.0, 0.5, 1.5])
    cpr, cmd = cc.areas(x, f)
    assert cpr == pytest.approx(0.4 * 0.25 + 0.5 * 1.0)
    assert cmd == pytest.approx(0.4 * (1 + 0.5) / 2 + 0.5 * (0.5 + 0.5) / 2)


def test_a_planted_circuit_is_found_with_faithfulness_one(tmp_path):
    """A model whose answer reaches the logits only through input -> a1.h0 (its value) -> logits: EAP-IG ranks those
    two edges first, the circuit of two edges restores the clean metric (faithfulness 1), CPR >= 0.95, and random
    circuits of two edges stay near 0."""
    folder = planted_model(tmp_path / "planted")
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    token = lambda w: loaded.tokenizer(w, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    pairs = [TaskPair("b a a", "b c a", (token("a"),), (token("c"),)),
             TaskPair("c b b", "c a b", (token("b"),), (token("a"),)),
             TaskPair("a c c", "a b c", (token("c"),), (token("b"),))]
    layout, result = cc.find_circuit(loaded, pairs, logit_diff, method="eap-ig", steps=3, top=2, randoms=0)
    graph = layout.graph
    table = cc.edge_table(graph, result.scores, result.circuit)
    assert set(zip(table["sender"][:2], table["receiver"][:2], table["input"][:2])) == {
        ("input", "a1.h0", "v"), ("a1.h0", "logits", "")}
    curve = result.faithfulness.curve
    at_two = curve[curve["edges"] >= 2].iloc[0]
    assert at_two["faithfulness"] == pytest.approx(1.0, abs=1e-4)
    assert result.faithfulness.cpr >= 0.95
    two = cc.baselines(loaded, layout, cc.tokenize(loaded, pairs), logit_diff)
    rng = np.random.default_rng(0)
    drawn = [cc.normalized(cc.evaluate(loaded, layout, two, logit_diff, cc.random_edges(graph, 2, rng)),
                           result.faithfulness.clean, result.faithfulness.corrupt) for _ in range(20)]
    assert np.mean(drawn) <= 0.1


def saturated_model(folder: Path, sharpness: float = 2.0) -> Path:
    """A 2-layer GPT-2 (4 heads of 4) whose weights are zero but for one saturated head: layer 1's head 0 at the
    last position attends to position 0 when the last token is `a` and to position 1 when it is `b` (its query reads
    a - b, its key position 0's marker - position 1's; the logits differ by ~ 46 at sharpness 2, so the pattern is
    0/1 to e^-46), and copies that position's token to the channels the LM head reads. The output projection's bias
    puts +-1000 on two channels the LM head ignores: the final norm's spread then moves by ~ 1e-5 of itself when the
    head copies another token, so the metric is linear in the head's output to that precision. Vocabulary: a, b,
    c."""
    model, hidden = zoo.blank_gpt2(folder)
    with torch.no_grad():
        model.transformer.wpe.weight[0, 8], model.transformer.wpe.weight[1, 9] = 4.0, 4.0  # the positions' markers
        attn = model.transformer.h[1].attn
        w = attn.c_attn.weight  # [hidden, q | k | v]
        w[1, 0], w[2, 0], w[1, 1], w[2, 1] = sharpness, -sharpness, -sharpness, sharpness  # query: +-(a - b)
        w[8, hidden], w[9, hidden], w[8, hidden + 1], w[9, hidden + 1] = sharpness, -sharpness, -sharpness, sharpness
        for j in range(4):
            w[j, 2 * hidden + j] = 1.0  # head 0's value <- token channel j
            attn.c_proj.weight[j, 10 + j] = 1.0  # head 0's output -> channel 10 + j
            model.lm_head.weight[j, 10 + j] = 100.0  # token j's logit <- channel 10 + j
        attn.c_proj.bias[14], attn.c_proj.bias[15] = 1000.0, -1000.0
    model.save_pretrained(folder)
    return folder


def test_qk_fix_recovers_a_saturated_head_that_eap_misses(tmp_path):
    """A saturated head whose patched query attends to another key: EAP's score of the query edge is ~0 (the
    softmax's gradient is e^-46), the exact patch is large, and the QK-fixed score equals the exact patch to 1e-3:
    everything after the pattern is linear here but the final norm, whose spread moves by ~ 1e-5 of itself (the
    planted +-1000 channels), and float32 rounds the norm's input of ~ 1000 to ~ 1e-4 of the head's ~ 3."""
    loaded = load_model(str(saturated_model(tmp_path / "saturated")), "cpu", "float32", lm_head=True)
    token = lambda w: loaded.tokenizer(w, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    pairs = [TaskPair("b c a", "b c b", (token("b"),), (token("c"),)),
             TaskPair("c b a", "c b b", (token("c"),), (token("b"),)),
             TaskPair("a c a", "a c b", (token("a"),), (token("c"),))]
    layout = cc.find_layout(loaded)
    graph = layout.graph
    prompts = cc.tokenize(loaded, pairs)
    edge = (graph.senders.index("input"), graph.receivers.index(("a1.h0", "q")))
    exact = cc.exact(loaded, layout, prompts, logit_diff, [edge])[0]
    eap = cc.attribute(loaded, layout, prompts, logit_diff)[edge]
    fixed = cc.attribute(loaded, layout, prompts, logit_diff, qk_fix=True)[edge]
    assert exact < -1.0  # the patched query copies the other token: the metric flips sign
    assert abs(eap) < 1e-3 * abs(exact)
    assert fixed == pytest.approx(exact, rel=1e-3)


def test_qk_fix_reads_a_saturated_soft_capped_gemma2_that_eap_misses(tmp_path):
    """Gemma 2 with both soft-caps (attention 5, final 4), its last layer's queries scaled 1000-fold: every raw
    attention logit there lies far past the cap, tanh is flat, and EAP's score of every edge into that layer's
    queries and keys is 0, while the exact patches are not. The QK-fixed scores equal the exact patch to first order
    in the heads' outputs, exact in the pattern (the float64 central-difference oracle, rtol 1e-3), and track the
    exact patches themselves (correlation over the layer's query and key edges; the rest is the nonlinearity after
    the pattern: the post-attention norm, the MLP, the final norm and cap)."""
    name, settings = MADE["gemma2"]
    folder = zoo.make(name, tmp_path / "gemma2", lm_head=True, **settings)
    from transformers import AutoModelForCausalLM

    model = vary_norms_and_biases(AutoModelForCausalLM.from_pretrained(folder))
    with torch.no_grad():
        model.model.layers[-1].self_attn.q_proj.weight.mul_(1000.0)
    model.save_pretrained(folder)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)[:3]
    prompts = cc.tokenize(loaded, pairs)
    last = f"a{graph.layers - 1}."
    edges = [(s, r) for r, (node, kind) in enumerate(graph.receivers) if node.startswith(last) and kind in ("q", "k")
             for s in range(graph.prefix(r))]
    exact = cc.exact(loaded, layout, prompts, logit_diff, edges)
    eap = cc.attribute(loaded, layout, prompts, logit_diff)
    fixed = cc.attribute(loaded, layout, prompts, logit_diff, qk_fix=True)
    got = np.array([fixed[e] for e in edges])
    assert np.abs(exact).max() > 1e-2  # the patches move the metric
    assert max(abs(eap[e]) for e in edges) < 1e-6 * np.abs(exact).max()  # saturated: EAP sees nothing
    assert np.corrcoef(got, exact)[0, 1] > 0.8
    model64 = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval().double()
    for module in model64.modules():
        if type(module).__name__ == "Gemma2RMSNorm":
            float64_rms(module)
    oracle = Oracle("gemma2", model64, loaded.num_heads, loaded.num_kv_heads)
    chosen = [edges[k] for k in np.argsort(-np.abs(got))[:3]]
    want = np.array([first_order_in_the_heads(oracle, loaded, pairs, e, graph) for e in chosen])
    np.testing.assert_allclose([fixed[e] for e in chosen], want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


def test_qk_fix_is_refused_for_exact_patching(family):
    _, loaded, _ = family
    with pytest.raises(AttnprobeError, match="--qk-fix applies to --method eap or eap-ig"):
        cc.find_circuit(loaded, pairs_of(loaded), logit_diff, method="exact", qk_fix=True)


QK_FAMILIES = ["gpt2", "llama", "qwen3", "mistral (sliding window)", "gemma", "stablelm", "gpt_bigcode", "granite",
               "gpt_oss", "starcoder2", "gemma2", "gemma3_text", "opt (post-norm)"]
QK_MADE = {"opt (post-norm)": MADE["opt-post"]}  # the zoo's gemma2 has its attention soft-cap and sliding window


@pytest.mark.parametrize("name", QK_FAMILIES)
def test_qk_fix_recomputes_the_heads_outputs_a_patched_forward_gives(tmp_path, name):
    """The fix's attention call (the clean run's arguments tiled: rotary, q/k norms, sliding windows, sinks, soft
    scales, grouped and multi-query heads, a padded row) gives the heads' outputs that the whole model gives with
    every query (or key) slice of the layer recomputed from norm(x + delta) by circuit's own receiver hooks, at
    every layer (Gemma 2's sliding and global layers, soft-capped)."""
    from attnprobe.ablate import fast_attention
    from attnprobe.circuit import qkfix, runs

    made, settings = QK_MADE.get(name, (name, {}))
    loaded = load_model(str(zoo.make(made, tmp_path / "m", lm_head=True, **settings)), "cpu", "float32", lm_head=True)
    layout = cc.find_layout(loaded)
    graph = layout.graph
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 60, (2, 7), generator=gen)  # [pairs, seq]
    corrupt = torch.where(torch.rand(2, 7, generator=gen) < 0.4, torch.randint(3, 60, (2, 7), generator=gen), clean)
    mask = torch.ones_like(clean)
    mask[1, 5:] = 0
    prompts = runs.Prompts(clean, corrupt, mask, mask.sum(1) - 1, [None, None])
    with fast_attention(loaded.model), torch.inference_mode():
        diff = cc.outputs(loaded, layout, prompts, corrupt)[0] - cc.outputs(loaded, layout, prompts, clean)[0]
        diff *= runs.real_positions(prompts)  # [senders, pairs, seq, hidden]
        kept = qkfix.keep_attention(loaded, layout, prompts)
        for layer in range(graph.layers):
            senders = [s for s in (0, graph.sender_index(0, 1), graph.sender_index(0))
                       if s < graph.prefix(layer * graph.per_layer)]
            recomputed_outputs_match(loaded, layout, kept, layer, senders, diff, clean, mask)


def recomputed_outputs_match(loaded, layout, kept, layer: int, senders: list[int], diff, clean, mask) -> None:
    """patched_outputs at one layer against the whole model patched by circuit's receiver hooks, sender by sender."""
    from attnprobe.circuit import qkfix, runs

    graph = layout.graph
    moved = qkfix.patched_outputs(layout, kept, layer, diff[senders])  # [2, senders, pairs, seq, heads, dim]
    for c, kind in enumerate("qk"):
        js = [j for j, (_, k) in enumerate(graph.receivers[: graph.per_layer]) if k == kind]
        for i, s in enumerate(senders):
            seen: list[torch.Tensor] = []
            patch = lambda lay, lo, hi, s=s, js=js: ([(j, slice(None), diff[s]) for j in range(lo, hi)  # noqa: E731
                                                     if j in js] if lay == layer else [])
            handle = layout.parts.projections[layer].register_forward_pre_hook(
                lambda _m, args, seen=seen: seen.append(args[0].unflatten(-1, (graph.heads, -1))))
            try:
                cc.forward(loaded, layout, clean, mask, runs.Pass(patch=patch))
            finally:
                handle.remove()
            real = mask.bool()[:, :, None, None]  # [pairs, seq, 1, 1]
            want, got = seen[0] * real, moved[c, i] * real
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
            if i == 0:
                assert float((want - kept.z[layer] * real).abs().max()) > 1e-3  # the patch moves the outputs


def test_qk_fix_refuses_heads_mixed_by_a_module_the_layout_does_not_name(tmp_path):
    """A Llama whose queries are scaled by their norm over every head at once in a module not named a norm: the
    layout reads it (EAP runs), and --qk-fix's own check, which compares one head's query moved alone with every
    head's moved together, refuses it in one line."""
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            q = self.inner(x)  # [rows, seq, heads x dim]
            return q / q.pow(2).mean(-1, keepdim=True).add(1.0).sqrt()

    loaded = load_model(str(zoo.make("llama", tmp_path / "m", lm_head=True)), "cpu", "float32", lm_head=True)
    for block in loaded.model.layers:
        block.self_attn.q_proj = Mixed(block.self_attn.q_proj)
    layout = cc.find_layout(loaded)
    prompts = cc.tokenize(loaded, pairs_of(loaded))
    cc.attribute(loaded, layout, prompts, logit_diff)
    with pytest.raises(AttnprobeError, match="mixes its heads' queries or keys") as info:
        cc.attribute(loaded, layout, prompts, logit_diff, qk_fix=True)
    assert "\n" not in str(info.value)


def test_heads_that_read_each_others_queries_are_refused(tmp_path):
    """A Llama whose queries pass a norm over every head's query at once (as OLMo 2's): patching one head's query
    input alone (and the QK fix's patterns recomputed together) would be wrong, so the layout refuses it in one
    line."""
    from torch import nn

    loaded = load_model(str(zoo.make("llama", tmp_path / "m", lm_head=True)), "cpu", "float32", lm_head=True)
    cc.find_layout(loaded)  # the plain model is read
    for block in loaded.model.layers:
        q = block.self_attn.q_proj
        block.self_attn.q_proj = nn.Sequential(q, nn.LayerNorm(q.out_features))
    with pytest.raises(AttnprobeError, match="normalises every head's queries or keys together") as info:
        cc.find_layout(loaded)
    assert "\n" not in str(info.value)


def test_a_parallel_block_model_is_refused_in_one_line(tmp_path):
    """GPT-NeoX's parallel attention and MLP (both read x): neither pre-norm, sandwich nor post-norm."""
    folder = zoo.make("gpt_neox", tmp_path / "neox", lm_head=True, use_parallel_residual=True)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    with pytest.raises(AttnprobeError, match="neither a pre-norm, a sandwich-norm nor a post-norm block") as info:
        cc.find_layout(loaded)
    assert "\n" not in str(info.value)


SHAPES = {"gpt2": "pre-norm", "llama": "pre-norm", "opt": "pre-norm", "gemma2": "sandwich", "opt-post": "post-norm"}


def test_each_family_is_read_as_its_block_shape(family):
    """The layout finder names each block shape; a post-norm model's tail is its project_out (OPT-350m's), and mean
    ablation, which has no statistics to carry a mean through the stream's norms with, is refused there."""
    name, loaded, oracle = family
    layout = cc.find_layout(loaded)
    assert layout.shape == SHAPES[name]
    if name == "opt-post":
        assert type(layout.tail).__name__ == "Linear" and layout.tail.out_features == 16
        with pytest.raises(AttnprobeError, match="--ablation mean on a post-norm decoder"):
            cc.baselines(loaded, layout, cc.tokenize(loaded, pairs_of(loaded)), logit_diff, ablation="mean")


def test_gemma3s_senders_add_up_to_the_stream_its_final_norm_reads(tmp_path):
    """Gemma 3 (sandwich norms, per-head query and key norms): the input, every head's output through the
    post-attention norm at the run's own rms and every post-feedforward norm's output add up to the final norm's
    input (a plain hook on the model) at every real position."""
    folder = zoo.make("gemma3_text", tmp_path / "gemma3", lm_head=True)
    from transformers import AutoModelForCausalLM

    vary_norms_and_biases(AutoModelForCausalLM.from_pretrained(folder)).save_pretrained(folder)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    layout = cc.find_layout(loaded)
    assert layout.shape == "sandwich"
    prompts = cc.tokenize(loaded, pairs_of(loaded))
    record, _ = cc.outputs(loaded, layout, prompts, prompts.clean)  # [senders, pairs, seq, hidden]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: seen.insert(0, args[0][0]))
    for k, pair in enumerate(pairs_of(loaded)):
        with torch.no_grad():
            model(input_ids=torch.tensor([ids_of(loaded, pair.clean)]))
        got = record[:, k, : seen[0].shape[0]].sum(0)  # [seq, hidden]
        torch.testing.assert_close(got, seen[0], rtol=0, atol=1e-4 * float(seen[0].abs().max()))
        heads = record[1 : 1 + layout.graph.heads, k, : seen[0].shape[0]]  # [heads, seq, hidden]
        assert float(heads.abs().max()) > 1e-2  # the heads send something
    handle.remove()


def test_gemma2s_soft_caps_bend_its_logits_and_circuit_reads_them(family):
    """The Gemma 2 family's caps matter (raw attention and final logits beyond them) and circuit's clean metric is
    the model's own, capped."""
    name, loaded, oracle = family
    if name != "gemma2":
        pytest.skip("Gemma 2 only")
    config = oracle.model.config
    raw = {}
    handle = oracle.model.lm_head.register_forward_hook(lambda _m, _a, out: raw.__setitem__("logits", out))
    pair = pairs_of(loaded)[0]
    ids = ids_of(loaded, pair.clean)
    with torch.no_grad():
        capped = oracle.model(input_ids=torch.tensor([ids])).logits[0, -1]
    handle.remove()
    assert float(raw["logits"].abs().max()) > config.final_logit_softcapping  # tanh bends them by 24% or more
    assert float(capped.abs().max()) < config.final_logit_softcapping
    attentions = [layer.self_attn for layer in oracle.layers]
    for attention in attentions:
        attention.attn_logit_softcapping = None
    with torch.no_grad():
        uncapped = oracle.model(input_ids=torch.tensor([ids])).logits[0, -1]
    for attention in attentions:
        attention.attn_logit_softcapping = config.attn_logit_softcapping
    assert float((uncapped - capped).abs().max()) > 1e-2  # the attention cap changes the logits too
    layout = cc.find_layout(loaded)
    assert layout.shape == "sandwich"
    bases = cc.baselines(loaded, layout, cc.tokenize(loaded, [pair]), logit_diff)
    assert float(bases[0].clean[0]) == pytest.approx(oracle_runs(oracle, loaded, pair)[3], abs=1e-4)


def write_pairs(path: Path, pairs) -> Path:
    import json

    path.write_text("".join(json.dumps(p.__dict__) + "\n" for p in pairs), encoding="utf-8")
    return path


@pytest.fixture
def tasks_module(monkeypatch):
    """attnprobe.tasks as its contract has it; a stand-in where the module is not installed yet."""
    import importlib.util
    import sys
    import types

    import attnprobe

    if importlib.util.find_spec("attnprobe.tasks") is not None:
        return
    from attnprobe import ioi
    from attnprobe.patching import first_token, read_pairs

    def convert(loaded, made):
        return [TaskPair(p.clean, p.corrupt, (first_token(loaded, p.answer, "answer"),),
                         (first_token(loaded, p.wrong, "wrong"),)) for p in made]

    module = types.ModuleType("attnprobe.tasks")
    module.TaskPair, module.TASKS, module.METRIC = TaskPair, ("ioi",), {"ioi": "logit-diff"}
    module.task_pairs = lambda loaded, task, n, seed=0: convert(loaded, ioi.ioi_pairs(loaded, n, "abc", seed))
    module.file_pairs = lambda loaded, path: convert(loaded, read_pairs(path))
    module.metric_value = lambda logits, pairs, kind: logit_diff(logits, pairs)
    monkeypatch.setitem(sys.modules, "attnprobe.tasks", module)
    monkeypatch.setattr(attnprobe, "tasks", module, raising=False)


def test_cli_writes_the_edges_the_circuit_and_mibs_importances(tmp_path, tasks_module):
    """`attnprobe circuit --pairs`: edges.csv (every edge, by |score|), circuit.json (the top edges, the curve at the
    sizes asked, CPR and CMD, the key/value groups), importances.json in MIB's layout (a grouped key/value edge once
    per query head it serves)."""
    import json

    import pandas as pd
    from test_cli import run

    folder = zoo.make("llama", tmp_path / "llama", lm_head=True)
    pairs = write_pairs(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    out = tmp_path / "out"
    result = run("circuit", "--model", folder, "--pairs", pairs, "--out", out, "--method", "eap", "--top", "5",
                 "--sizes", "0.1,0.5,1", "--random", "2")
    assert result.exit_code == 0, result.output
    graph = cc.Graph(2, 4, 2)
    edges = pd.read_csv(out / "edges.csv", keep_default_na=False)
    assert list(edges.columns) == ["sender", "receiver", "input", "score", "in_circuit"]
    assert len(edges) == graph.edge_count and edges["in_circuit"].sum() == 5
    assert (edges["score"].abs().diff().dropna() <= 0).all()
    run_info = json.loads((out / "circuit.json").read_text())
    assert [e["sender"] for e in run_info["circuit"]["edges"]] == list(edges["sender"][:5])
    assert [row["fraction"] for row in run_info["faithfulness"]["curve"]] == [0.1, 0.5, 1.0]
    assert run_info["faithfulness"]["curve"][-1]["faithfulness"] == pytest.approx(1.0, abs=1e-4)
    assert run_info["graph"]["kv_groups"]["a1.kv1"] == ["a1.h2", "a1.h3"]
    mib = json.loads((out / "importances.json").read_text())
    assert set(mib) == {"cfg", "nodes", "edges"} and mib["cfg"]["n_heads"] == 4
    kv = sum(1 for _, r in zip(*np.nonzero(graph.mask)) if graph.receivers[r][1] in "kv" and graph.receivers[r][1])
    assert len(mib["edges"]) == graph.edge_count + kv  # each key/value edge twice (2 query heads a group)
    assert mib["edges"]["input->a0.h3<k>"] == mib["edges"]["input->a0.h2<k>"]
    assert "input->logits" in mib["edges"] and "a1.h0->m1" in mib["edges"]
    import importlib.util

    if importlib.util.find_spec("attnprobe.plotting.circuit") is not None:  # the figures where they can be drawn
        assert (out / "circuit.png").is_file() and (out / "faithfulness.png").is_file()
    again = run("circuit", "--model", folder, "--pairs", pairs, "--out", out, "--method", "eap", "--top", "5",
                "--sizes", "none")  # a rerun without the curve leaves no earlier curve beside its circuit.json
    assert again.exit_code == 0, again.output
    assert json.loads((out / "circuit.json").read_text())["faithfulness"] is None
    assert not (out / "faithfulness.png").exists()


def test_cli_qk_fix_is_recorded_and_refused_for_exact(tmp_path, tasks_module):
    """`--qk-fix` (with --grad-drop) writes qk_fix and what the scores are into circuit.json; with --method exact it
    is refused in one line."""
    import json

    from test_cli import assert_one_line_error, run

    folder = zoo.make("llama", tmp_path / "llama", lm_head=True)
    pairs = write_pairs(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    out = tmp_path / "out"
    result = run("circuit", "--model", folder, "--pairs", pairs, "--out", out, "--method", "eap", "--qk-fix",
                 "--grad-drop", "--top", "5", "--sizes", "none")
    assert result.exit_code == 0, result.output
    run_info = json.loads((out / "circuit.json").read_text())
    assert run_info["qk_fix"] is True and run_info["grad_drop"] is True
    assert "QK fix" in run_info["score"] and "GradDrop" in run_info["score"]
    refused = run("circuit", "--model", folder, "--pairs", pairs, "--out", tmp_path / "exact", "--method", "exact",
                  "--qk-fix", "--sizes", "none")
    assert_one_line_error(refused, "--qk-fix applies to --method eap or eap-ig")


def test_mean_ablation_of_every_edge_reads_the_mean_residual(tmp_path):
    """--ablation mean with the empty circuit: every receiver reads each sender's mean over the clean prompts' real
    positions (plus the biases), so the logits read the clean run's final-norm input averaged over every real
    position; computed by hand with a hook on the final norm."""
    folder = zoo.make("gpt2", tmp_path / "gpt2", lm_head=True)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    layout = cc.find_layout(loaded)
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    bases = cc.baselines(loaded, layout, prompts, logit_diff, ablation="mean")
    got = cc.evaluate(loaded, layout, bases, logit_diff, np.zeros_like(layout.graph.mask))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    seen = []
    handle = model.transformer.ln_f.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0]))
    with torch.no_grad():
        for pair in pairs:
            model(input_ids=torch.tensor([ids_of(loaded, pair.clean)]))
    handle.remove()
    mean = torch.cat(seen).mean(0)  # [hidden]: over every real position of every pair
    with torch.no_grad():
        logits = model.lm_head(model.transformer.ln_f(mean))  # [vocab]
    want = np.mean([float(logit_diff(logits[None], [p])[0]) for p in pairs])
    assert got == pytest.approx(want, abs=1e-4 * max(1.0, abs(want)))


def test_top_and_threshold_choose_the_circuit():
    graph = cc.Graph(1, 2, 1)
    scores = np.where(graph.mask, np.arange(graph.mask.size).reshape(graph.mask.shape) % 7 - 3.0, 0)
    top = cc.choose(graph, scores, 3, None)
    assert top.sum() == 3 and np.abs(scores[top]).min() >= np.abs(scores[graph.mask & ~top]).max()
    assert (cc.choose(graph, scores, None, 2.5) == (graph.mask & (np.abs(scores) >= 2.5))).all()
    with pytest.raises(AttnprobeError, match="--top and --threshold"):
        cc.choose(graph, scores, 3, 1.0)


# ---- the bound on what the exact check missed (--missed) ------------------------------------------------------


@contextmanager
def receivers_moved(oracle: Oracle, graph: cc.Graph, edges, corrupt: dict, current: dict):
    """Each receiver of `edges` moved by the sum over its edges of (corrupt_u - current_u), by hand."""
    deltas: dict = {}
    for s, r in edges:
        u = graph.senders[s]
        deltas[graph.receivers[r]] = deltas.get(graph.receivers[r], 0) + (corrupt[u] - current[u])[None]
    handles = [h for receiver, delta in deltas.items() for h in oracle.receiver_hooks(receiver, delta)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def oracle_set_change(oracle: Oracle, loaded, pairs, edges, graph: cc.Graph) -> float:
    """The mean metric change with `edges` patched together, by hand in float64: each receiver reads its senders'
    corrupt outputs in place of their outputs in the patched run itself, found by running again until the senders'
    outputs settle (each run settles one more layer)."""
    total = 0.0
    for pair in pairs:
        ids, clean, corrupt, base = oracle_runs(oracle, loaded, pair)
        current = clean
        for _ in range(graph.layers + 1):
            with receivers_moved(oracle, graph, edges, corrupt, current):
                current = oracle.outputs(ids)
        with receivers_moved(oracle, graph, edges, corrupt, current):
            total += oracle.metric(ids, pair) - base
    return total / len(pairs)


def test_edges_patched_together_equal_exact_alone_and_the_hook_oracle_together(family):
    """exact_sets: a set of one edge is exact()'s patch; sets of several edges (into one receiver, into heads of one
    layer and the logits, a receiver upstream of another's sender) equal the float64 hook oracle's joint patch, in
    which a receiver reads its senders' corrupt outputs whatever the run made of them; post-norm is refused."""
    name, loaded, oracle = family
    layout = cc.find_layout(loaded)
    graph = layout.graph
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    if layout.post_norm:
        with pytest.raises(AttnprobeError, match="post-norm"):
            cc.exact_sets(loaded, layout, prompts, logit_diff, [[(0, 0)]])
        return
    edges = some_edges(graph, 2)
    alone = cc.exact_sets(loaded, layout, prompts, logit_diff, [[e] for e in edges])
    np.testing.assert_allclose(alone, cc.exact(loaded, layout, prompts, logit_diff, edges), rtol=1e-6, atol=1e-6)
    logits, mlp1 = len(graph.receivers) - 1, 2 * graph.per_layer - 1
    a00, a10 = graph.sender_index(0, 0), graph.sender_index(1, 0)
    sets = [[(0, mlp1), (a00, mlp1), (graph.sender_index(0), mlp1)],  # three senders into one MLP
            [(0, graph.per_layer), (a00, graph.per_layer + graph.heads), (1, logits)],  # q, k of layer 1, logits
            [(0, 0), (a00, logits), (a10, logits), (0, graph.per_layer + graph.heads + graph.kv_heads)],  # chained
            rng_set(graph, 12)]
    got = cc.exact_sets(loaded, layout, prompts, logit_diff, sets + [[]])
    want = np.array([oracle_set_change(oracle, loaded, pairs, s, graph) for s in sets])
    np.testing.assert_allclose(got[:-1], want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    assert got[-1] == 0.0 and np.abs(want).min() > 1e-3  # the sets move the metric: not a comparison of zeros
    one_by_one = [cc.exact(loaded, layout, prompts, logit_diff, edges).sum() for edges in sets]
    assert np.abs(got[:-1] - one_by_one).max() > 1e-3  # patched together is not the sum of the edges alone


def rng_set(graph: cc.Graph, count: int, seed: int = 1) -> list[tuple[int, int]]:
    real = list(zip(*np.nonzero(graph.mask)))
    picked = np.random.default_rng(seed).choice(len(real), size=count, replace=False)
    return [(int(real[k][0]), int(real[k][1])) for k in picked]


def test_the_bound_is_the_binomial_rank_of_each_edges_subsets():
    """rank(k): the largest j with P(Binomial(k, 1/2) <= j - 1) <= 5% (closed form); bounds() picks, per edge, the
    j-th largest |effect| of its subsets and their smallest, as a loop over edges does by hand."""
    from attnprobe.circuit.missed import bounds, rank

    assert [rank(k, 0.95) for k in (0, 4, 5, 8, 16)] == [0, 0, 1, 2, 5]  # 2^-5 = 0.031; 9 / 256; P(<= 4 | 16) = 0.038
    rng = np.random.default_rng(0)
    members = rng.random((30, 50)) < 0.3  # [subsets, edges]
    effects = rng.normal(size=30)
    bound, lowest, counts = bounds(effects, members, 0.95)
    for e in range(50):
        mine = np.sort(np.abs(effects[members[:, e]]))[::-1]
        j = rank(len(mine), 0.95)
        assert counts[e] == len(mine)
        assert bound[e] == (mine[j - 1] if j else np.inf)
        assert lowest[e] == (mine[-1] if len(mine) else np.inf)


@pytest.fixture(scope="module")
def every_edge(tmp_path_factory):
    """A tiny GPT-2 with every edge patched exactly: (loaded, layout, pairs, prompts, edges, exact effects)."""
    folder = zoo.make("gpt2", tmp_path_factory.mktemp("missed"), lm_head=True)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    layout = cc.find_layout(loaded)
    pairs = pairs_of(loaded)
    prompts = cc.tokenize(loaded, pairs)
    edges = [(int(s), int(r)) for s, r in zip(*np.nonzero(layout.graph.mask))]
    return loaded, layout, pairs, prompts, edges, cc.exact(loaded, layout, prompts, logit_diff, edges)


def score_matrix(graph: cc.Graph, edges, values) -> np.ndarray:
    scores = np.zeros(graph.mask.shape)
    for (s, r), v in zip(edges, values):
        scores[s, r] = v
    return scores


def test_the_bound_holds_for_the_unverified_edges_at_its_rate_over_seeds(every_edge):
    """Every edge's exact effect known: the top 10 verified, the other 100 bounded from 64 subsets (p = 0.1) under
    8 seeds. The bound reaches the edge's true |effect| in at least 95% of the (edge, seed) cases it bounds, most
    edges are bounded, and AtP*'s no-cancellation bound (the smallest subset) falls short far more often here: the
    rank is what makes the rate."""
    loaded, layout, _, prompts, edges, effects = every_edge
    graph = layout.graph
    scores = score_matrix(graph, edges, effects)
    verified = cc.top_edges(graph, scores, 10)
    held, held_lowest, bounded = [], [], []
    for seed in range(8):
        found = cc.missed_bounds(loaded, layout, prompts, logit_diff, verified, 0.0, subsets=64, p=0.1, seed=seed)
        truth = np.abs([scores[s, r] for s, r in found.edges])  # [unverified]
        ok = np.isfinite(found.bound)
        held += list(found.bound[ok] >= truth[ok] - 1e-6)
        held_lowest += list(found.lowest[ok] >= truth[ok] - 1e-6)
        bounded.append(ok.mean())
        assert len(found.edges) == graph.edge_count - 10 and (found.lowest[ok] <= found.bound[ok]).all()
    assert np.mean(held) >= 0.95 and np.mean(bounded) >= 0.5
    assert np.mean(held_lowest) < 0.9


def test_a_strong_edge_ranked_low_is_flagged_as_missed(every_edge):
    """Scores by hand: the edge of largest exact effect given score 0 (ranked last, so unverified), the next 10
    verified. Under every one of 5 seeds its bound (or its having too few subsets) flags it: the bound reaches past
    the smallest verified effect, and missed_table lists it flagged. (Its bound need not reach its own effect here:
    the other edges patched with it saturate the metric and take back part of it, the cancellation the assumption
    rules out.)"""
    loaded, layout, _, prompts, edges, effects = every_edge
    graph = layout.graph
    strongest = int(np.argmax(np.abs(effects)))
    scores = score_matrix(graph, edges, effects)
    s, r = edges[strongest]
    scores[s, r] = 0.0
    verified = cc.top_edges(graph, scores, 10)
    smallest = float(np.abs(scores[verified]).min())
    assert not verified[s, r] and abs(effects[strongest]) > 2 * smallest
    for seed in range(5):
        found = cc.missed_bounds(loaded, layout, prompts, logit_diff, verified, smallest, subsets=64, p=0.1,
                                 seed=seed)
        k = found.edges.index((s, r))
        assert found.flagged[k] and found.bound[k] > 2 * smallest
    unflagged = ~found.flagged & np.isfinite(found.bound)
    assert unflagged.any() and (found.bound[unflagged] < smallest).all()  # the flag is a threshold, not every edge
    table = cc.missed_table(graph, scores, found)
    row = table[(table["sender"] == graph.senders[s]) & (table["receiver"] == graph.receivers[r][0])
                & (table["input"] == graph.receivers[r][1])]
    assert bool(row["flagged"].iloc[0]) and len(table) == graph.edge_count - 10


def test_cli_missed_writes_the_bound_and_refuses_without_check(tmp_path, tasks_module):
    """`--check 5 --missed 40`: circuit.json's "missed" (subsets, the largest bound, the flagged edges, each subset's
    effect) and edges.csv's missed_bound (blank for the 5 verified edges); --missed without --check, and --missed-p
    without --missed, are refused in one line."""
    import json

    import pandas as pd
    from test_cli import assert_one_line_error, run

    folder = zoo.make("llama", tmp_path / "llama", lm_head=True)
    pairs = write_pairs(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    out = tmp_path / "out"
    result = run("circuit", "--model", folder, "--pairs", pairs, "--out", out, "--method", "eap", "--sizes", "none",
                 "--check", "5", "--missed", "40", "--missed-p", "0.2")
    assert result.exit_code == 0, result.output
    found = json.loads((out / "circuit.json").read_text())["missed"]
    graph = cc.Graph(2, 4, 2)
    assert found["subsets"] == 40 and found["p"] == 0.2 and found["unverified_edges"] == graph.edge_count - 5
    assert len(found["subset_effects"]) == 40 and found["largest_bound"]["bound"] > 0
    edges = pd.read_csv(out / "edges.csv")
    assert edges["missed_bound"].isna().sum() == 5 and edges["missed_bound"].max() >= found["largest_bound"]["bound"]
    refused = run("circuit", "--model", folder, "--pairs", pairs, "--out", tmp_path / "o2", "--sizes", "none",
                  "--missed", "40")
    assert_one_line_error(refused, "--missed bounds the edges --check leaves unverified")
    refused = run("circuit", "--model", folder, "--pairs", pairs, "--out", tmp_path / "o3", "--sizes", "none",
                  "--missed-p", "0.3")
    assert_one_line_error(refused, "--missed-p does nothing here")


@pytest.mark.parametrize("kind", ["layer", "rms", "rms1"])
def test_a_norms_closed_form_backward_is_autograds(kind):
    """Norm.backward (the q/k/v receivers' gradients through their block's input norm, every receiver at once) equals
    autograd's vector-Jacobian products of the module itself, in float64, for a LayerNorm with a bias, Llama's RMSNorm
    (gain w) and Gemma 2's (gain 1 + w)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from attnprobe.circuit.layout import norm_of

    torch.manual_seed(0)
    module = {"layer": lambda: torch.nn.LayerNorm(16, eps=1e-5), "rms": lambda: LlamaRMSNorm(16, eps=1e-6),
              "rms1": lambda: Gemma2RMSNorm(16, eps=1e-6)}[kind]().double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 2 + 0.7  # [rows, seq, hidden]
    norm = norm_of(module, x, module(x))
    assert norm is not None and norm.kind == kind
    cotangents = torch.randn(4, 3, 5, 16, dtype=torch.float64)  # [receivers, rows, seq, hidden]
    xg = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(module(xg), [xg], cotangents, is_grads_batched=True)
    got = norm.backward(x, cotangents)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
