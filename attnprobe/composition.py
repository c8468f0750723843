"""Composition scores (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"), from the weights alone.

A head's OV circuit W_OV = W_V W_O says what it writes into the residual stream; a later head's QK circuit
W_QK = W_Q W_K^T says how it reads the stream to choose where to look, and its OV circuit what it moves. In the
row-vector convention of TransformerLens (x @ W_V @ W_O), the score of a sender head s and a later receiver head r is

    Q:  |W_OV^s W_QK^r|   / (|W_OV^s| |W_QK^r|)      the sender writes what the receiver's queries read
    K:  |W_OV^s W_QK^rT|  / (|W_OV^s| |W_QK^r|)      ... what the receiver's keys read
    V:  |W_OV^s W_OV^r|   / (|W_OV^s| |W_OV^r|)      ... what the receiver's values read

with |.| the Frobenius norm: TransformerLens' `utils.composition_scores` as `HookedTransformer.all_composition_scores`
calls it, 0 when the receiver reads nothing the sender writes, 1 when both are rank one on the same direction.

The weights are folded first, as TransformerLens loads a model: a pre-attention LayerNorm's scale is multiplied into
W_Q, W_K, W_V and those are centred over their d_model input (the norm's output has zero mean), and every W_O is
centred over its d_model output (`center_writing_weights`); an RMSNorm's scale is multiplied into W_Q, W_K, W_V and
nothing is centred (RMSNorm does not subtract the mean). Biases are left out, as TransformerLens' scores do, and
rotary position embeddings too (the scores read W_Q and W_K only). Under grouped-query attention each query head
uses its group's K and V weights (TransformerLens repeats them the same way).

Every norm is computed in float64 without building a d_model x d_model matrix: with thin QR factors A = Q_A R_A and
B^T = Q_B R_B, |A M B| = |R_A M R_B^T| for any M, and all four circuits are such products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe.defaults import COMPOSE_SAMPLES, COMPOSE_SEED, COMPOSE_TOP
from attnprobe.errors import AttnprobeError

MODES = ("Q", "K", "V")
SAMPLES = COMPOSE_SAMPLES  # random pairs of circuits for the baseline
SEED = COMPOSE_SEED
TOP = COMPOSE_TOP  # the strongest edges the figure draws
BASELINE_ELEMENTS = 1 << 24  # float64 random entries drawn at once for the baseline: 128 MiB
PAIR_ELEMENTS = 1 << 24  # float64 entries of each [sender, receiver, k, k] temporary: 128 MiB

# where each family keeps its weights: the attention module's projections, the block's pre-attention norm
FUSED = "c_attn"  # GPT-2's Conv1D: [d_model, 3 d_model], Q then K then V
SEPARATE = ("q_proj", "k_proj", "v_proj")  # Llama, Mistral, Qwen2, Gemma, Phi, StableLM, Starcoder2, OPT
OUTPUTS = ("o_proj", "c_proj", "dense", "out_proj")
PRE_NORMS = ("ln_1", "input_layernorm", "self_attn_layer_norm")
# a norm inside the attention (Qwen3, OLMo2, StableLM's qk_layernorm) or on its output (Gemma 2/3): the circuits are
# not linear maps of the residual stream, so the scores would not mean what they say
NONLINEAR_PARTS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
OUTPUT_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass
class HeadWeights:
    """The folded weights of every head, float64: w_q, w_k, w_v [layer, head, d_model, head size] (K and V repeated
    over each KV head's group of query heads), w_o [layer, head, head size, d_model]."""

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    kv_heads: int
    norm: str  # "layernorm" or "rmsnorm"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(layers, heads, d_model, head size)."""
        layers, heads, d_model, size = self.w_q.shape
        return layers, heads, d_model, size


@dataclass
class Composition:
    """Every pair of heads in different layers (sender earlier), per mode; `scores` [mode, layer, head, layer, head]
    holds NaN where the receiver is not later than the sender."""

    scores: np.ndarray
    baseline: dict[str, float]  # mean and sd of random matrices' scores, and their shapes
    info: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """composition.csv's rows: one per (sender, receiver, mode), strongest first within each mode."""
        return composition_rows(self.scores, self.baseline["mean"], self.baseline["sd"])


# ---- the scores: pure torch --------------------------------------------------------------------------------------


def right_factor(matrix: Tensor) -> Tensor:
    """R of the thin QR factorisation of [..., n, k] (n >= k): [..., k, k], with |matrix @ X| = |R @ X|."""
    return torch.linalg.qr(matrix, mode="r").R  # [..., k, k]


def factored_norm(a: Tensor, b: Tensor) -> Tensor:
    """|a @ b|_F for a [..., n, k] and b [..., k, m], without the [n, m] product: |R_a R_bT^T|."""
    return torch.linalg.matrix_norm(right_factor(a) @ right_factor(b.transpose(-1, -2)).transpose(-1, -2))  # [...]


def composed_norms(r_left: Tensor, w_out: Tensor, w_in: Tensor, r_right: Tensor) -> Tensor:
    """|L W_out W_in R^T|_F for every sender s and receiver r: r_left [s, k, k] (the sender's left factor), w_out
    [s, k, d] (what it writes), w_in [r, d, k] (what the receiver reads), r_right [r, k, k] -> [s, r]. Receivers in
    chunks whose [s, r, k, k] temporaries hold at most PAIR_ELEMENTS each."""
    senders, size = r_left.shape[0], r_left.shape[-1]
    chunk = max(1, PAIR_ELEMENTS // (senders * size * size))  # receivers at once
    return torch.cat([chunk_norms(r_left, w_out, w_in[start : start + chunk], r_right[start : start + chunk])
                      for start in range(0, w_in.shape[0], chunk)], dim=1)  # [s, r]


def chunk_norms(r_left: Tensor, w_out: Tensor, w_in: Tensor, r_right: Tensor) -> Tensor:
    """composed_norms of one chunk of receivers: [s, r]."""
    middle = torch.einsum("sid,rdj->srij", w_out, w_in)  # [s, r, k, k]: the only product over d_model
    left = torch.einsum("sai,srij->sraj", r_left, middle)  # [s, r, k, k]
    both = torch.einsum("sraj,rbj->srab", left, r_right)  # [s, r, k, k]
    return torch.linalg.matrix_norm(both)  # [s, r]


def receiver_factors(weights: HeadWeights, mode: str) -> tuple[Tensor, Tensor]:
    """What each head reads in `mode` and the right factor of the rest of its circuit: (w_in [layer, head, d, k],
    r_right [layer, head, k, k]). Q: W_Q and W_K; K: W_K and W_Q (the circuit transposed); V: W_V and W_O^T."""
    if mode == "Q":
        return weights.w_q, right_factor(weights.w_k)
    if mode == "K":
        return weights.w_k, right_factor(weights.w_q)
    if mode == "V":
        return weights.w_v, right_factor(weights.w_o.transpose(-1, -2))
    raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")


def composition_scores(weights: HeadWeights, mode: str) -> Tensor:
    """[layer, head, layer, head] float64: the `mode` composition score of each sender (first two axes) with each
    receiver in a later layer; NaN elsewhere (TransformerLens' all_composition_scores puts 0 there), and NaN where
    either circuit is zero (0 / 0)."""
    layers, heads, _, _ = weights.shape
    w_in, r_right = receiver_factors(weights, mode)  # [layer, head, d, k], [layer, head, k, k]
    r_values = right_factor(weights.w_v)  # [layer, head, k, k]
    ov = factored_norm(weights.w_v, weights.w_o)  # [layer, head]: |W_OV|
    read = factored_norm(w_in, r_right.transpose(-1, -2))  # [layer, head]: |W_QK| or |W_OV|
    scores = torch.full((layers, heads, layers, heads), float("nan"), dtype=torch.float64)  # [L, H, L, H]
    for layer in range(layers - 1):
        later = slice(layer + 1, layers)
        norms = composed_norms(r_values[layer], weights.w_o[layer], w_in[later].flatten(0, 1),
                               r_right[later].flatten(0, 1))  # [head, later heads]
        norms = norms / ov[layer][:, None] / read[later].flatten()[None, :]  # [head, later heads]
        scores[layer, :, later] = norms.reshape(heads, layers - layer - 1, heads)  # [head, later layer, head]
    return scores


def random_baseline(d_model: int, head_size: int, samples: int = SAMPLES, seed: int = SEED) -> dict[str, Any]:
    """The score of random matrices of the heads' shapes: two circuits A B and C D with A, C [d_model, head size]
    and B, D [head size, d_model] of independent standard normal entries (the same for every mode). Its mean is
    about 1 / sqrt(d_model) whatever the head size: the level a score must clear to say more than chance."""
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, BASELINE_ELEMENTS // (4 * d_model * head_size))  # samples drawn at once
    scores = torch.cat([random_scores(torch.randn((min(chunk, samples - start), 4, d_model, head_size),
                                                  generator=generator, dtype=torch.float64))
                        for start in range(0, samples, chunk)])  # [sample]
    return {"mean": float(scores.mean()), "sd": float(scores.std()), "samples": samples, "seed": seed,
            "d_model": d_model, "head_size": head_size}


def later_pairs(layers: int, heads: int) -> np.ndarray:
    """[layer, head, layer, head] bool: the receiver (last two axes) is in a later layer than the sender."""
    later = np.arange(layers)[:, None] < np.arange(layers)[None, :]  # [sender layer, receiver layer]
    return np.broadcast_to(later[:, None, :, None], (layers, heads, layers, heads))


def random_scores(draws: Tensor) -> Tensor:
    """[sample, 4, d, k] standard normal draws (A, B^T, C, D^T) -> [sample]: the score of A B against C D."""
    a, b, c, d = draws.unbind(1)  # [sample, d, k] each; b and d used transposed, as [k, d]
    b, d = b.transpose(-1, -2), d.transpose(-1, -2)  # [sample, k, d] each
    middle = right_factor(a) @ (b @ c) @ right_factor(d.transpose(-1, -2)).transpose(-1, -2)  # [sample, k, k]
    return torch.linalg.matrix_norm(middle) / factored_norm(a, b) / factored_norm(c, d)  # [sample]


def composition_rows(scores: np.ndarray, baseline: float, spread: float) -> pd.DataFrame:
    """[mode, layer, head, layer, head] scores -> rows (sender_layer, sender_head, receiver_layer, receiver_head,
    mode, score, baseline, baseline_sd), the pairs with a later receiver only, strongest first within each mode (a
    head whose circuit is zero has no score: NaN, last)."""
    frames = []
    for m, mode in enumerate(MODES):
        s_layer, s_head, r_layer, r_head = np.nonzero(later_pairs(scores.shape[1], scores.shape[2]))  # [pair] each
        frame = pd.DataFrame({"sender_layer": s_layer, "sender_head": s_head, "receiver_layer": r_layer,
                              "receiver_head": r_head, "mode": mode,
                              "score": scores[m][s_layer, s_head, r_layer, r_head]})
        frames.append(frame.sort_values("score", ascending=False, kind="stable"))
    table = pd.concat(frames, ignore_index=True)
    table["baseline"], table["baseline_sd"] = baseline, spread
    return table


# ---- the weights of a transformers model -------------------------------------------------------------------------


def head_weights(model: nn.Module, modules: list[nn.Module], heads: int, kv_heads: int) -> HeadWeights:
    """Every head's folded weights (see the module's docstring) from a loaded transformers model and its attention
    modules in layer order; one plain line naming what is missing where a family is not supported."""
    names = {id(module): name for name, module in model.named_modules()}
    per_layer = [layer_weights(model, names.get(id(module), ""), module, heads, kv_heads)
                 for module in modules]
    norms = {norm for *_, norm in per_layer}
    stacked = [torch.stack(parts) for parts in zip(*(weights for *weights, _ in per_layer))]
    return HeadWeights(*stacked, kv_heads=kv_heads, norm=norms.pop())


def layer_weights(model: nn.Module, name: str, module: nn.Module, heads: int, kv_heads: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
    """One layer's folded (w_q, w_k, w_v [head, d, k], w_o [head, k, d], norm kind)."""
    refuse_nonlinear(model, name, module)
    w_q, w_k, w_v = read_projections(module)  # [d, heads x k], [d, kv heads x k] twice
    w_o = as_in_out(find_child(module, OUTPUTS, name, "output projection"))  # [heads x k, d]
    norm = pre_norm(model, name)
    scale, kind = norm_scale(norm), norm_kind(norm)  # [d]
    w_q, w_k, w_v = (split_heads(w * scale[:, None], count, heads) for w, count in  # [head, d, k] each
                     ((w_q, heads), (w_k, kv_heads), (w_v, kv_heads)))
    w_o = w_o.reshape(heads, -1, w_o.shape[-1])  # [head, k, d]
    if kind == "layernorm":
        w_q, w_k, w_v = (w - w.mean(dim=1, keepdim=True) for w in (w_q, w_k, w_v))  # [head, d, k]: centred input
        w_o = w_o - w_o.mean(dim=2, keepdim=True)  # [head, k, d]: centred output
    return w_q, w_k, w_v, w_o, kind


def refuse_nonlinear(model: nn.Module, name: str, module: nn.Module) -> None:
    """A norm on the queries and keys, or on the attention's output, makes the circuits nonlinear: refuse it."""
    block = parent(model, name)
    found = [part for part in NONLINEAR_PARTS if isinstance(getattr(module, part, None), nn.Module)]
    found += [part for part in OUTPUT_NORMS if isinstance(getattr(block, part, None), nn.Module)]
    if found:
        raise AttnprobeError(f"{type(module).__name__} normalises inside or after attention ({', '.join(found)}): "
                             "its circuits are not linear maps of the residual stream, so compose does not score "
                             "them; use a model without such norms (GPT-2, Llama, Mistral, Qwen2, Gemma, Phi)")


def read_projections(module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """W_Q, W_K, W_V as [d_model, outputs] float64, from GPT-2's fused c_attn or from q/k/v_proj."""
    fused = getattr(module, FUSED, None)
    if fused is not None:
        if getattr(module, "is_cross_attention", False) or getattr(module, "multi_query", False):
            raise AttnprobeError(f"{type(module).__name__}'s c_attn is not GPT-2's fused Q, K, V of equal widths")
        return tuple(as_in_out(fused).chunk(3, dim=1))  # type: ignore[return-value]  # [d, d] each
    parts = [getattr(module, part, None) for part in SEPARATE]
    if any(not is_linear(part) for part in parts):
        raise AttnprobeError(f"{type(module).__name__} has neither GPT-2's c_attn nor q_proj, k_proj and v_proj: "
                             "compose reads the weights of GPT-2-, Llama- and OPT-style attention only")
    return tuple(as_in_out(part) for part in parts)  # type: ignore[return-value]


def find_child(module: nn.Module, names: tuple[str, ...], where: str, what: str) -> nn.Module:
    """The first linear child of `module` among `names`."""
    for child in names:
        if is_linear(getattr(module, child, None)):
            return getattr(module, child)
    raise AttnprobeError(f"{where or type(module).__name__} has no {what} compose knows (looked for "
                         f"{', '.join(names)})")


def parent(model: nn.Module, name: str) -> nn.Module:
    """The module holding `name` (a decoder block, for an attention module)."""
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def pre_norm(model: nn.Module, name: str) -> nn.Module:
    """The norm the block applies to the residual stream before this attention."""
    block = parent(model, name)
    config = getattr(model, "config", None)
    if getattr(config, "do_layer_norm_before", True) is False:  # OPT-350m: post-norm
        raise AttnprobeError("the model normalises after attention (do_layer_norm_before is false): compose scores "
                             "pre-norm decoders only")
    for child in PRE_NORMS:
        norm = getattr(block, child, None)
        if isinstance(norm, nn.Module) and hasattr(norm, "weight"):
            return norm
    raise AttnprobeError(f"{type(block).__name__} has no pre-attention norm compose knows (looked for "
                         f"{', '.join(PRE_NORMS)}): compose scores pre-norm decoders (GPT-2, Llama, Mistral, Qwen2, "
                         "Gemma, Phi, OPT), not encoders or post-norm models")


def norm_kind(norm: nn.Module) -> str:
    """layernorm (subtracts the mean: weights folded and centred) or rmsnorm (scales only)."""
    if isinstance(norm, nn.LayerNorm) or ("LayerNorm" in type(norm).__name__ and "RMS" not in type(norm).__name__):
        return "layernorm"
    if "RMS" in type(norm).__name__:
        return "rmsnorm"
    raise AttnprobeError(f"the pre-attention norm {type(norm).__name__} is neither a LayerNorm nor an RMSNorm")


@torch.no_grad()
def norm_scale(norm: nn.Module) -> Tensor:
    """The per-channel scale [d_model] float64 a norm applies after normalising: a LayerNorm's weight; for an
    RMSNorm its output for a vector of ones (rms 1), which is Llama's weight and Gemma's 1 + weight alike, up to the
    factor 1 / sqrt(1 + eps) common to every channel (the scores do not change when a matrix is scaled)."""
    weight = norm.weight
    if weight.device.type == "meta":
        raise AttnprobeError("the model's weights are not loaded (placeholders on the meta device): load it without "
                             "--device-map")
    if norm_kind(norm) == "layernorm":
        return weight.detach().double()  # [d]
    ones = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)  # [1, d]
    return norm(ones)[0].detach().double().cpu()  # [d]


def is_linear(module: Any) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nx"))


def as_in_out(projection: nn.Module) -> Tensor:
    """A projection's weight as [in, out] float64 on the CPU (GPT-2's Conv1D already stores [in, out])."""
    weight = projection.weight
    if weight.device.type == "meta":
        raise AttnprobeError("the model's weights are not loaded (placeholders on the meta device): load it without "
                             "--device-map")
    weight = weight.detach().double().cpu()  # [out, in] (Linear) or [in, out] (Conv1D)
    return weight.T if isinstance(projection, nn.Linear) else weight  # [in, out]


def split_heads(weight: Tensor, count: int, heads: int) -> Tensor:
    """[d, count x k] -> [heads, d, k]: each of `count` heads' columns, repeated over its group of query heads
    (kv head j serves query heads j g ... j g + g - 1, as transformers' repeat_kv)."""
    d_model, width = weight.shape
    if width % count or heads % count:
        raise AttnprobeError(f"a projection of width {width} does not split into {count} heads of {heads} query heads")
    split = weight.reshape(d_model, count, width // count).transpose(0, 1)  # [count, d, k]
    return split.repeat_interleave(heads // count, dim=0)  # [heads, d, k]


# ---- a model's composition ---------------------------------------------------------------------------------------


def compose_weights(weights: HeadWeights, samples: int = SAMPLES, seed: int = SEED) -> Composition:
    """Every mode's scores and the random baseline for the heads' shapes."""
    layers, heads, d_model, size = weights.shape
    if layers < 2:
        raise AttnprobeError("the model has one layer: composition needs heads in two different layers")
    scores = np.stack([composition_scores(weights, mode).numpy() for mode in MODES])  # [mode, L, H, L, H]
    baseline = random_baseline(d_model, size, samples, seed)
    info = {"layers": layers, "heads": heads, "kv_heads": weights.kv_heads, "d_model": d_model, "head_size": size,
            "norm": weights.norm, "folded": FOLDED[weights.norm], "gqa": GQA if weights.kv_heads < heads else None}
    return Composition(scores, baseline, info)


FOLDED = {
    "layernorm": "LayerNorm scale folded into W_Q, W_K, W_V, centred over d_model; W_O centred over d_model",
    "rmsnorm": "RMSNorm scale folded into W_Q, W_K, W_V; nothing centred",
}
GQA = "each query head uses its group's K and V weights (its KV head's, repeated as repeat_kv does)"


def compose_loaded(loaded: Any, samples: int = SAMPLES, seed: int = SEED) -> Composition:
    """`compose` of an attnprobe LoadedModel (model.load_model)."""
    from attnprobe.model import attention_modules

    if not loaded.causal:
        raise AttnprobeError(f"{loaded.spec} is an encoder ({type(loaded.model).__name__}), normalised after each "
                             "attention: compose scores pre-norm decoders (GPT-2, Llama, Mistral, Qwen2, Gemma, Phi, "
                             "OPT), whose weights fold as TransformerLens folds them")
    modules = [module for module, _ in attention_modules(loaded.model)]
    if not modules:
        raise AttnprobeError(f"found no attention modules in {loaded.spec}")
    weights = head_weights(loaded.model, modules, loaded.num_heads, loaded.num_kv_heads)
    result = compose_weights(weights, samples, seed)
    result.info["model"] = loaded.spec
    return result


def compose(model: Any, samples: int = SAMPLES, seed: int = SEED, dtype: str = "auto") -> Composition:
    """The notebook API: the composition of `model` (a name or path, loaded on the CPU in `dtype`; a LoadedModel;
    or a transformers model and its tokenizer). `result.scores` [mode, layer, head, layer, head], `result.table()`
    composition.csv's rows, `result.baseline` and `result.info` as composition.json records them."""
    from attnprobe.model import as_loaded

    check_settings(samples, TOP, seed)
    return compose_loaded(as_loaded(model, "cpu", dtype), samples, seed)


def check_settings(samples: int, top: int, seed: int) -> None:
    """--samples (2 or more: the baseline's spread), --top and --seed within their bounds."""
    from attnprobe import limits

    limits.check_whole("--samples", samples, 2, limits.MAX_BASELINE_SAMPLES, SAMPLES)
    limits.check_whole("--top", top, 1, limits.MAX_TOP, TOP)
    limits.check_whole("--seed", seed, 0, limits.MAX_SEED, SEED)


def composition_record(loaded: Any, result: Composition, table: pd.DataFrame, top: int, seconds: float
                       ) -> dict[str, Any]:
    """composition.json: the model, how its weights were read and folded, the baseline, each mode's strongest
    edges and how many pairs clear the baseline by 3 of its standard deviations."""
    from attnprobe import __version__
    from attnprobe.records import model_record, versions

    cut = result.baseline["mean"] + 3 * result.baseline["sd"]
    modes = {}
    for mode, rows in table.groupby("mode", sort=False):
        strongest = rows.nlargest(min(top, 10), "score")
        modes[mode] = {"pairs": int(len(rows)), "above_baseline_3sd": int((rows["score"] > cut).sum()),
                       "mean": float(rows["score"].mean()),
                       "strongest": [{"sender": [int(r.sender_layer), int(r.sender_head)],
                                      "receiver": [int(r.receiver_layer), int(r.receiver_head)],
                                      "score": round(float(r.score), 6)} for r in strongest.itertuples()]}
    return {"attnprobe_version": __version__, **result.info, "model": model_record(loaded), "dtype": loaded.dtype,
            "baseline": result.baseline, "modes": modes, "top": top,
            "definition": "|W_OV^s W^r|_F / (|W_OV^s|_F |W^r|_F) with W^r = W_QK^r (Q), W_QK^r transposed (K) or "
                          "W_OV^r (V), row-vector convention, as TransformerLens' all_composition_scores",
            "wall_seconds": round(seconds, 3), "versions": versions()}
