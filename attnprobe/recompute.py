"""Attention maps recomputed from scratch: each layer's softmax(Q K^T * scale + bias) from the input its attention
module was called with, the module's own projection (and q/k norm) weights and the model's config.

Independent of attnprobe's kernel and of transformers' attention code: the rotary embeddings (default, linear,
dynamic NTK, Llama 3, YaRN; partial and interleaved), ALiBi, soft-capping, sliding windows, grouped-query heads,
q/k norms, query pre-attention scalars and learned sinks are written out here from their definitions, in float32.
`verify` compares the result with the maps attnprobe reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CannotRecompute(Exception):
    """This model (or this setting of it) has no recomputation here; the message says which, in a few words."""


@dataclass
class Scores:
    """One layer's logits and what else decides its softmax."""

    logits: Tensor  # [batch, head, query, key], before any mask
    magnitude: Tensor  # [batch, head, query]: max over keys of sum_d |q_d k_d| * |scale| (the logits' rounding scale)
    window: tuple[int, int] | None = None  # a key j is seen by query i when i - j < back and j - i <= ahead
    sinks: Tensor | None = None  # [head]: learned sink logits, one extra column of the softmax, then dropped


Recompute = Callable[[nn.Module, Tensor, Any, int], Scores]


# ---- small pieces: projections, heads, norms ----------------------------------------------------------------

def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """x W^T + b in float32 from a Linear's (or Falcon's) weights; GPT-2's Conv1D stores W transposed."""
    weight = layer.weight.float()
    bias = None if getattr(layer, "bias", None) is None else layer.bias.float()
    if type(layer).__name__ == "Conv1D":
        out = x @ weight  # [batch, seq, out]
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)  # [batch, seq, out]


def heads(x: Tensor, head_dim: int) -> Tensor:
    batch, seq, _ = x.shape
    return x.view(batch, seq, -1, head_dim).transpose(1, 2)  # [batch, head, seq, head_dim]


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dimension (Gemma's weights are stored - 1)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension; weight may be per head [head, dim]."""
    centred = x - x.mean(-1, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out if bias is None else out + bias.float()


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def finish(q: Tensor, k: Tensor, scale: float, *, softcap: float | None = None, bias: Tensor | None = None,
           bias_scaled: bool = False, window: tuple[int, int] | None = None, sinks: Tensor | None = None) -> Scores:
    """q K^T * scale (+ bias, inside the scale when `bias_scaled`, as Falcon adds its ALiBi), soft-capped to
    cap * tanh(s / cap); grouped key heads serve their query heads in order."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [batch, q_head, seq, head_dim]
    logits = q @ k.transpose(-1, -2)  # [batch, head, query, key]
    magnitude = (q.abs() @ k.abs().transpose(-1, -2)).amax(dim=-1) * abs(scale)  # [batch, head, query]
    if bias is not None and bias_scaled:
        logits = logits + bias
    logits = logits * scale
    if bias is not None and not bias_scaled:
        logits = logits + bias
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return Scores(logits, magnitude, window, sinks)


def causal_window(config: Any, layer: int) -> tuple[int, int] | None:
    """A decoder layer's sliding window from the config: `layer_types` names the sliding layers where it exists;
    otherwise `sliding_window` applies to every layer (Mistral, Starcoder2). Key j is seen when i - j < W."""
    size = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and types[layer] != "sliding_attention":
        return None
    return (int(size), 0) if size else None


# ---- rotary position embeddings ---------------------------------------------------------------------------

def rope_parameters(config: Any, layer: int) -> dict:
    """The layer's rotary parameters: transformers 5's `rope_parameters`, per layer type where it holds several
    (Gemma 3, ModernBERT), else the older `rope_theta` / `rope_scaling` attributes."""
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    types = getattr(config, "layer_types", None)
    if types is not None and types[layer] in rope:
        rope = rope[types[layer]]
    return dict(rope)


def inverse_frequencies(rope: dict, dim: int, config: Any, seq: int) -> tuple[Tensor, float]:
    """The rotary frequencies of a `dim`-channel rotation and the factor on cos and sin, for each rope type.

    default: theta^(-2i/dim). linear: divided by `factor`. dynamic (NTK): the base grows once the sequence passes
    max_position_embeddings. llama3: wavelengths longer than original_max / low_freq_factor divided by `factor`,
    shorter than original_max / high_freq_factor kept, and a linear blend between. yarn: a ramp between
    interpolated (/ factor) and extrapolated frequencies over the channels whose rotations at the original length
    fall between beta_slow and beta_fast, with cos and sin scaled by 0.1 ln(factor) + 1 (or `attention_factor`).
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # [dim / 2]
    if kind == "dynamic":
        longest = int(getattr(config, "max_position_embeddings", seq))
        if seq > longest:
            factor = float(rope["factor"])
            theta *= (factor * seq / longest - (factor - 1)) ** (dim / (dim - 2))
    base = 1.0 / theta**exponents  # [dim / 2]
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "linear":
        return base / float(rope["factor"]), 1.0
    if kind == "llama3":
        return llama3_frequencies(base, rope), 1.0
    if kind == "yarn":
        return yarn_frequencies(base, rope, dim, theta, config)
    raise CannotRecompute(f"rope type {kind!r}")


def llama3_frequencies(base: Tensor, rope: dict) -> Tensor:
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi / base  # [dim / 2]
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
    scaled = torch.where(wavelength > original / low, base / factor, base)
    medium = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(medium, (1 - blend) * base / factor + blend * base, scaled)


def yarn_frequencies(base: Tensor, rope: dict, dim: int, theta: float, config: Any) -> tuple[Tensor, float]:
    original = float(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or config.max_position_embeddings / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def channel(rotations: float) -> float:  # the channel that turns `rotations` times over the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(rope.get("beta_fast") or 32), channel(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)  # [dim / 2]
    return base / factor * ramp + base * (1 - ramp), float(attention)


def rotate(x: Tensor, rope: dict, config: Any, dim: int, interleaved: bool = False) -> Tensor:
    """Rotate the first `dim` channels of x [batch, head, seq, head_dim] by position 0..seq-1 (verify pads on the
    right, so real tokens keep their positions); the rest pass. Pairs are (i, i + dim/2), or (2i, 2i+1) when
    `interleaved` (GPT-J, Cohere)."""
    seq = x.shape[-2]
    frequencies, factor = inverse_frequencies(rope, dim, config, seq)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * frequencies  # [seq, dim / 2]
    cos, sin = angles.cos() * factor, angles.sin() * factor  # [seq, dim / 2]
    turned, kept = x[..., :dim], x[..., dim:]
    if interleaved:
        even, odd = turned[..., 0::2], turned[..., 1::2]  # [batch, head, seq, dim / 2] each
        turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        first, second = turned[..., : dim // 2], turned[..., dim // 2 :]
        turned = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((turned, kept), dim=-1)  # [batch, head, seq, head_dim]


def rotary_dim(config: Any, rope: dict, head_dim: int) -> int:
    """Channels that rotate: head_dim x partial_rotary_factor (GPT-NeoX's rotary_pct, Phi, StableLM), or
    GPT-J's rotary_dim."""
    if getattr(config, "model_type", "") == "gptj":
        return int(config.rotary_dim or head_dim)
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


# ---- rotary decoders ----------------------------------------------------------------------------------------

def rotary_projections(module: nn.Module, hidden: Tensor, config: Any, head_dim: int) -> tuple[Tensor, Tensor]:
    """q [batch, head, seq, d] and k [batch, kv_head, seq, d] before any norm and rotation."""
    kind = config.model_type
    n, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kind == "gpt_neox":  # one projection, each head's [q, k, v] side by side
        qkv = heads(linear(hidden, module.query_key_value), 3 * head_dim)  # [batch, head, seq, 3 d]
        return qkv[..., :head_dim], qkv[..., head_dim : 2 * head_dim]
    if kind == "phi3":  # one projection: all q heads, then k, then v
        qkv = linear(hidden, module.qkv_proj)
        return heads(qkv[..., : n * head_dim], head_dim), heads(qkv[..., n * head_dim : (n + kv) * head_dim], head_dim)
    if kind == "falcon":
        return falcon_projections(module, hidden, config, head_dim)
    q, k = linear(hidden, module.q_proj), linear(hidden, module.k_proj)  # [batch, seq, heads x d]
    clip = getattr(config, "clip_qkv", None)
    if clip:  # OLMo
        q, k = q.clamp(-clip, clip), k.clamp(-clip, clip)
    if kind == "olmo2":  # RMS norm over all heads at once, before they are split
        eps = config.rms_norm_eps
        q, k = rms_norm(q, module.q_norm.weight, eps), rms_norm(k, module.k_norm.weight, eps)
    return heads(q, head_dim), heads(k, head_dim)


def falcon_projections(module: nn.Module, hidden: Tensor, config: Any, head_dim: int) -> tuple[Tensor, Tensor]:
    """Falcon's fused projection: per KV group [q ... q, k, v] (new architecture), [q, k, v] per head, or all q
    heads then one k and one v (multi-query)."""
    fused = linear(hidden, module.query_key_value)  # [batch, seq, out]
    batch, seq, _ = fused.shape
    n = config.num_attention_heads
    if config.new_decoder_architecture:
        groups = fused.view(batch, seq, config.num_kv_heads, -1, head_dim)  # [batch, seq, kv, n/kv + 2, d]
        q = groups[:, :, :, :-2].flatten(2, 3)  # [batch, seq, head, d]
        k = groups[:, :, :, -2]  # [batch, seq, kv, d]
    elif not config.multi_query:
        per_head = fused.view(batch, seq, n, 3, head_dim)
        q, k = per_head[..., 0, :], per_head[..., 1, :]
    else:
        q = fused[..., : n * head_dim].view(batch, seq, n, head_dim)
        k = fused[..., n * head_dim :][..., None, :head_dim]  # [batch, seq, 1, d]
    return q.transpose(1, 2), k.transpose(1, 2)  # [batch, head, seq, d], [batch, kv_head, seq, d]


def qk_norms(module: nn.Module, q: Tensor, k: Tensor, config: Any) -> tuple[Tensor, Tensor]:
    """Per-head q and k norms: RMS (Qwen3; Gemma 3 with weights stored - 1), LayerNorm (Phi's qk_layernorm, one per
    head in StableLM), or Cohere's bias-free LayerNorm with a weight per head."""
    kind = config.model_type
    if kind in ("qwen3", "gemma3_text"):
        offset = 1.0 if kind == "gemma3_text" else 0.0
        eps = config.rms_norm_eps
        return rms_norm(q, module.q_norm.weight, eps, offset), rms_norm(k, module.k_norm.weight, eps, offset)
    if kind == "cohere" and getattr(config, "use_qk_norm", False):
        eps = config.layer_norm_eps
        return (layer_norm(q, module.q_norm.weight[:, None], None, eps),
                layer_norm(k, module.k_norm.weight[:, None], None, eps))  # weights [head, 1, d]
    if kind == "phi" and getattr(config, "qk_layernorm", False):
        eps = config.layer_norm_eps
        return (layer_norm(q, module.q_layernorm.weight, module.q_layernorm.bias, eps),
                layer_norm(k, module.k_layernorm.weight, module.k_layernorm.bias, eps))
    if kind == "stablelm" and getattr(config, "qk_layernorm", False):
        eps = config.layer_norm_eps

        def stacked(norms: nn.Module, name: str) -> Tensor | None:
            parts = [getattr(norm, name) for norm in norms.norms]
            return None if parts[0] is None else torch.stack([p.float() for p in parts])[:, None]  # [head, 1, d]

        return (layer_norm(q, stacked(module.q_layernorm, "weight"), stacked(module.q_layernorm, "bias"), eps),
                layer_norm(k, stacked(module.k_layernorm, "weight"), stacked(module.k_layernorm, "bias"), eps))
    return q, k


def rotary_scale(config: Any, head_dim: int) -> float:
    """Granite's attention_multiplier; Gemma 2/3's query_pre_attn_scalar^-1/2; else head_dim^-1/2."""
    if getattr(config, "attention_multiplier", None) is not None:
        return float(config.attention_multiplier)
    if config.model_type in ("gemma2", "gemma3_text") and getattr(config, "query_pre_attn_scalar", None):
        return float(config.query_pre_attn_scalar) ** -0.5
    return head_dim**-0.5


def rotary_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    """Llama and the decoders built like it: project, norm, rotate, scale, soft-cap; window and sinks from the
    config and the module's own weights."""
    head_dim = head_dim_of(config)
    q, k = rotary_projections(module, hidden, config, head_dim)
    q, k = qk_norms(module, q, k, config)
    rope = rope_parameters(config, layer)
    dim = rotary_dim(config, rope, head_dim)
    interleaved = config.model_type in ("gptj", "cohere")
    q, k = rotate(q, rope, config, dim, interleaved), rotate(k, rope, config, dim, interleaved)
    softcap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
    sinks = module.sinks.detach().float() if config.model_type == "gpt_oss" else None
    return finish(q, k, rotary_scale(config, head_dim), softcap=softcap, window=causal_window(config, layer),
                  sinks=sinks)


# ---- ALiBi ----------------------------------------------------------------------------------------------------

def alibi_slopes(heads_count: int) -> Tensor:
    """Press et al.'s slopes: 2^(-8 i / n) for a power of two n; otherwise those of the power of two below, then
    every other slope of the power above. BLOOM and Falcon round them to bfloat16, as here."""
    power = 2 ** math.floor(math.log2(heads_count))
    base = 2.0 ** (-(2.0 ** -(math.log2(power) - 3)))
    slopes = [base ** (i + 1) for i in range(power)]
    if power != heads_count:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * power) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(power, heads_count - power))]
    return torch.tensor(slopes, dtype=torch.float32).bfloat16().float()  # [head]


def mpt_slopes(heads_count: int, bias_max: float) -> Tensor:
    """MPT's slopes: 1 / 2^(i * bias_max / n') for the power of two n' >= n, odd ones first when n' > n."""
    power = 2 ** math.ceil(math.log2(heads_count))
    slopes = 1.0 / 2.0 ** (torch.arange(1, power + 1, dtype=torch.float32) * (bias_max / power))  # [power]
    if power != heads_count:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads_count]
    return slopes  # [head]


def alibi_bias(slopes: Tensor, seq: int) -> Tensor:
    """slope x key position: softmax sees only differences along a row, so this is slope x (j - i) up to a
    constant per row."""
    return slopes[:, None, None] * torch.arange(seq, dtype=torch.float32)  # [head, 1, key]


def bloom_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    head_dim = config.hidden_size // config.n_head
    per_head = heads(linear(hidden, module.query_key_value), 3 * head_dim)  # [batch, head, seq, 3 d]: [q, k, v]
    q, k = per_head[..., :head_dim], per_head[..., head_dim : 2 * head_dim]
    return finish(q, k, head_dim**-0.5, bias=alibi_bias(alibi_slopes(config.n_head), hidden.shape[1]))


def falcon_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int, alibi_times: int = 1) -> Scores:
    """Falcon: rotary, or (q k + alibi) / sqrt(d) with `config.alibi`. `alibi_times=2` is what transformers' eager
    Falcon computes (5.24): it adds the ALiBi to the logits and again through the attention mask, while its SDPA
    path adds it once; verify tries it to name that cause when the maps differ."""
    if not config.alibi:
        return rotary_scores(module, hidden, config, layer)
    head_dim = config.hidden_size // config.num_attention_heads
    q, k = falcon_projections(module, hidden, config, head_dim)
    bias = alibi_bias(alibi_slopes(config.num_attention_heads), hidden.shape[1]) * alibi_times
    return finish(q, k, head_dim**-0.5, bias=bias, bias_scaled=True)  # (q k + alibi) / sqrt(d)


def mpt_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    attn = config.attn_config
    if not attn.alibi or attn.qk_ln:
        raise CannotRecompute("MPT without ALiBi or with qk_ln")
    head_dim = config.d_model // config.n_heads
    fused = linear(hidden, module.Wqkv)  # [batch, seq, 3 x embed]
    if attn.clip_qkv:
        fused = fused.clamp(-attn.clip_qkv, attn.clip_qkv)
    q, k, _ = fused.chunk(3, dim=-1)
    scale = attn.softmax_scale or head_dim**-0.5
    bias = alibi_bias(mpt_slopes(config.n_heads, attn.alibi_bias_max), hidden.shape[1])
    return finish(heads(q, head_dim), heads(k, head_dim), scale, bias=bias)


# ---- absolute-position models: GPT-2, BERT and its kin, OPT ------------------------------------------------

def gpt2_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    head_dim = config.n_embd // config.n_head
    q, k, _ = linear(hidden, module.c_attn).split(config.n_embd, dim=2)  # each [batch, seq, embed]
    scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer + 1
    return finish(heads(q, head_dim), heads(k, head_dim), scale)


def bigcode_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    """GPT-BigCode: all q heads then one k and one v (multi-query), else [q, k, v] per head."""
    head_dim = config.n_embd // config.n_head
    fused = linear(hidden, module.c_attn)
    if config.multi_query:
        q = heads(fused[..., : config.n_embd], head_dim)  # [batch, head, seq, d]
        k = heads(fused[..., config.n_embd :][..., :head_dim], head_dim)  # [batch, 1, seq, d]
    else:
        per_head = heads(fused, 3 * head_dim)
        q, k = per_head[..., :head_dim], per_head[..., head_dim : 2 * head_dim]
    return finish(q, k, head_dim**-0.5 if config.scale_attn_weights else 1.0)


PROJECTIONS = {"distilbert": ("q_lin", "k_lin"), "opt": ("q_proj", "k_proj")}  # else BERT's query, key


def absolute_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    """BERT, RoBERTa, XLM-R, ELECTRA, ALBERT, DistilBERT, OPT: positions enter with the embeddings."""
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise CannotRecompute(f"{kind} position embeddings")
    n = getattr(config, "num_attention_heads", None) or config.n_heads
    head_dim = (getattr(config, "hidden_size", None) or config.dim) // n
    q_name, k_name = PROJECTIONS.get(config.model_type, ("query", "key"))
    q = heads(linear(hidden, getattr(module, q_name)), head_dim)
    k = heads(linear(hidden, getattr(module, k_name)), head_dim)
    return finish(q, k, head_dim**-0.5)


def modernbert_scores(module: nn.Module, hidden: Tensor, config: Any, layer: int) -> Scores:
    """ModernBERT: rotary with a base per layer type; local layers see local_attention / 2 keys on each side."""
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = linear(hidden, module.Wqkv).view(*hidden.shape[:2], 3, config.num_attention_heads, head_dim)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)  # [batch, head, seq, d]
    rope = rope_parameters(config, layer)
    q, k = rotate(q, rope, config, head_dim), rotate(k, rope, config, head_dim)
    local = config.layer_types[layer] == "sliding_attention"
    half = config.local_attention // 2
    return finish(q, k, head_dim**-0.5, window=(half + 1, half) if local else None)


RECOMPUTE: dict[str, Recompute] = {
    "gpt2": gpt2_scores, "gpt_bigcode": bigcode_scores,
    **{kind: absolute_scores for kind in ("bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert", "opt")},
    **{kind: rotary_scores for kind in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
                                        "phi3", "olmo", "olmo2", "stablelm", "starcoder2", "cohere", "granite",
                                        "gpt_oss", "gpt_neox", "gptj")},
    "falcon": falcon_scores, "bloom": bloom_scores, "mpt": mpt_scores, "modernbert": modernbert_scores,
}


def probabilities(scores: Scores, keys: Tensor) -> Tensor:
    """softmax over the keys `keys` [batch, 1, query, key] lets each query see (padding, the future), and the
    layer's window; a learned sink takes its share of each row and is dropped."""
    logits = scores.logits
    seq = logits.shape[-1]
    if scores.window is not None:
        back, ahead = scores.window
        offset = torch.arange(seq)[:, None] - torch.arange(seq)  # [query, key]: i - j
        keys = keys & (offset < back) & (-offset <= ahead)
    logits = logits.masked_fill(~keys, -math.inf)  # [batch, head, query, key]
    if scores.sinks is not None:
        sink = scores.sinks[None, :, None, None].expand(*logits.shape[:-1], 1)  # [batch, head, query, 1]
        return torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [batch, head, query, key]
