"""Does a head matter? Ablate heads, measure what the model loses, screen with gradients, prune.

Ablating a head replaces its slice of the concatenated head outputs, the input of the attention
output projection (`o_proj`, GPT-2's `c_proj`, BERT's `attention.output.dense`), with zeros
(`zero`) or with its mean over the corpus (`mean`), through a forward pre-hook. Under grouped-query
attention the slice is one query head's, so a query head is ablated alone.

Measures, per sentence, against the unablated model on the same batch:
- decoders: the change in mean next-token loss (nats per token) and the mean KL divergence
  KL(unablated || ablated) of the next-token distributions, over the sentence's real tokens;
- encoders: 1 - cosine of the final hidden states (mean over real tokens, `hidden_change`) and of
  the mean-pooled sentence embedding (`embedding_change`).

Speed: an ablation in layer l cannot change layers below l. One unablated pass per batch keeps the
residual stream at every layer's input (and the arguments the model passed each layer); the
ablations of layer l then run layers l..L-1 only, several at once, as copies of the batch stacked
along the batch dimension with a different head ablated in each copy.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe import __version__, naming
from attnprobe.batching import length_batches, pad_batch, tokenize
from attnprobe.bootstrap import (
    CONFIDENCE,
    DEFAULT_RESAMPLES,
    few_items_note,
    interval,
    poisson_weights,
    resampled_means,
)
from attnprobe.corpus import Corpus, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, forward_kwargs, load_model, quiet_transformers
from attnprobe.naming import head_name
from attnprobe.planning import check_options

METHODS = ("zero", "mean")
DECODER_MEASURES = ("loss_change", "kl")  # the first one ranks heads
ENCODER_MEASURES = ("embedding_change", "hidden_change")
PRUNING_PERCENTS = tuple(range(0, 101, 10))
PRUNING_ORDERS = ("ablation", "kl", "gradient", "random")  # kl: decoders only; ablation and kl: every head ablated
GRADIENT_PROBES = 8  # encoders: random directions that estimate the norm of the embedding's gradient
PROJECTIONS = ("self_attn.o_proj", "attn.c_proj", "attention.output.dense")  # Llama family, GPT-2, BERT
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm")  # after the last block, inside the base model
COPY_TOKENS = 16_384  # positions (copies x batch x seq) in one batched ablation pass
LOGIT_MIB = 256  # memory for one chunk of next-token log-probabilities

Target = tuple[int, tuple[int, ...]]  # (layer, heads ablated together): one head, or a whole layer
Progress = Callable[[str, int, int], None]  # (stage, sentences done, sentences in all)


@dataclass
class Ablation:
    heads: pd.DataFrame  # importance.csv: one row per ablated (layer, head)
    layers: pd.DataFrame | None  # layer_importance.csv: one row per layer, with --layers
    pruning: pd.DataFrame | None  # pruning.csv: order x percent of heads removed
    run: dict[str, Any]  # ablate.json: provenance, settings, Spearman correlation


@dataclass(frozen=True)
class Stack:
    """Where a model's blocks, head-combining projections, final norm and LM head are."""

    layers: list[nn.Module]  # the transformer blocks, in order
    projections: list[nn.Module]  # per block, the module whose input is the concatenated head outputs
    final: nn.Module | None  # the norm after the last block (GPT-2 ln_f, Llama norm; BERT has none)
    head: nn.Module | None  # the LM head of a decoder
    heads: int
    head_dim: int


@dataclass(frozen=True)
class Batch:
    indices: list[int]  # corpus index of each row
    input_ids: Tensor  # [batch, seq]
    mask: Tensor  # [batch, seq], 1 on real tokens (right padding)
    predicts: Tensor  # [batch, seq] bool: positions whose next token is real (decoders)
    targets: Tensor  # [predicted] the next token at each predicting position
    rows: Tensor  # [predicted] the batch row of each predicting position


@dataclass
class Prefix:
    """The unablated pass over one batch, kept to restart the network at any layer."""

    hidden: list[Tensor]  # per layer, the residual stream at its input [batch, seq, hidden]
    extras: list[tuple[tuple, dict]]  # per layer, the other arguments the model passed it
    final: Tensor  # the base model's last hidden state [batch, seq, hidden]


# ---- public entry points ---------------------------------------------------------------------------------


def ablate(
    model: str, corpus: str, *, method: str = "zero", heads: list[tuple[int, int]] | None = None,
    layers: bool = False, batch_size: int = 8, device: str = "auto", dtype: str = "auto",
    resamples: int = DEFAULT_RESAMPLES, seed: int = 0, pruning: bool = True, progress: Progress | None = None,
    limit: int | None = None,
) -> Ablation:
    """Ablate every head (or `heads`) of `model` over `corpus` (its first `limit` sentences, as `--limit`);
    loads a decoder with its LM head."""
    check_settings(method, batch_size, resamples, seed)
    text = read_corpus(corpus).head(limit)
    loaded = load_model(model, device, dtype, lm_head=True)
    return ablate_loaded(loaded, text, method=method, heads=heads, layers=layers, batch_size=batch_size,
                         resamples=resamples, seed=seed, pruning=pruning, progress=progress)


def ablate_loaded(
    loaded: LoadedModel, corpus: Corpus, *, method: str = "zero", heads: list[tuple[int, int]] | None = None,
    layers: bool = False, batch_size: int = 8, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
    pruning: bool = True, progress: Progress | None = None,
) -> Ablation:
    """Single-head (and layer) ablation, gradient importance and the pruning curve, as tables."""
    check_settings(method, batch_size, resamples, seed)
    started = time.perf_counter()
    stack = find_stack(loaded)
    chosen = check_heads(heads, loaded.num_layers, stack.heads)
    ids = tokenize(loaded, corpus).ids
    batches = make_batches(loaded, ids, batch_size)
    names = measure_names(loaded)
    if loaded.causal and all(len(t) < 2 for t in ids):
        raise AttnprobeError("every sentence of the corpus is a single token: a decoder has nothing to predict")
    targets = [(layer, (head,)) for layer, head in chosen]
    if layers:
        targets += [(layer, tuple(range(stack.heads))) for layer in range(loaded.num_layers)]
    timings: dict[str, float] = {}
    with fast_attention(loaded.model):
        fill = timed(timings, "mean", lambda: head_fill(loaded, stack, batches, method, progress))
        values = timed(timings, "ablate", lambda: measure(loaded, stack, batches, targets, fill, progress=progress))
        grads = timed(timings, "gradient", lambda: gradient_importance(loaded, stack, batches, seed, progress))
    weights = poisson_weights(range(len(ids)), resamples, seed)  # [resample, sentence]
    table = head_table(values, chosen, names, weights, grads)
    rho = spearman(table["gradient_importance"].to_numpy(), table[names[0]].to_numpy())
    layer_table = layer_rows(values, len(chosen), loaded.num_layers, names, weights) if layers else None
    curve = None
    if pruning:
        orders = pruning_orders(table, grads, len(chosen) == loaded.num_layers * stack.heads, names[0], seed)
        with fast_attention(loaded.model):
            curve = timed(timings, "pruning", lambda: pruning_curve(loaded, stack, batches, orders, fill, weights,
                                                                    progress))
    run = run_info(loaded, corpus, ids, method, heads, layers, batch_size, resamples, seed, names[0], rho)
    run["pruning_percents"] = run["pruning_percents"] if pruning else None  # --no-pruning: no curve, none recorded
    run["seconds"] = {k: round(v, 3) for k, v in timings.items()}
    run["wall_seconds"] = round(time.perf_counter() - started, 3)
    return Ablation(table, layer_table, curve, run)


def parse_heads(text: str) -> list[tuple[int, int]] | None:
    """`all` -> None; `L0H1,L2H3` or `0.1,2.3` -> [(0, 1), (2, 3)] (0-based, each head once)."""
    if text.strip().lower() == "all":
        return None
    return naming.parse_heads(text)


def check_heads(heads: list[tuple[int, int]] | None, layers: int, per_layer: int) -> list[tuple[int, int]]:
    """The heads to ablate, in (layer, head) order; all of them for None."""
    if heads is None:
        return [(layer, head) for layer in range(layers) for head in range(per_layer)]
    if not heads:
        raise AttnprobeError("--heads names no head: give e.g. L0H1,L2H3 (or all)")
    naming.check_heads_exist(heads, layers, per_layer)
    return sorted(heads)


def check_settings(method: str, batch_size: int, resamples: int, seed: int) -> None:
    if method not in METHODS:
        raise AttnprobeError(f"unknown --method {method!r}: use zero or mean")
    check_options(batch_size, resamples, seed)


def measure_names(loaded: LoadedModel) -> tuple[str, ...]:
    return DECODER_MEASURES if loaded.causal else ENCODER_MEASURES


def timed(timings: dict[str, float], name: str, work: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    result = work()
    timings[name] = time.perf_counter() - started
    return result


# ---- the model's parts ---------------------------------------------------------------------------------


def find_stack(loaded: LoadedModel) -> Stack:
    """The blocks, projections, final norm and LM head of a GPT-2, Llama-family or BERT model."""
    from attnprobe.model import attention_modules

    model = loaded.model
    names = {id(module): name for name, module in model.named_modules()}
    blocks = [model.get_submodule(block_name(names[id(module)])) for module, _ in attention_modules(model)]
    projections = [projection_of(block, loaded) for block in blocks]
    final = next((getattr(model, n) for n in FINAL_NORMS if isinstance(getattr(model, n, None), nn.Module)), None)
    if loaded.causal and loaded.lm_head is None:
        raise AttnprobeError(f"ablating {loaded.spec} needs its LM head: load it with load_model(..., lm_head=True)")
    if loaded.causal and not isinstance(loaded.lm_head, nn.Linear):
        raise AttnprobeError(f"the LM head of {loaded.spec} is a {type(loaded.lm_head).__name__}, not a linear layer: "
                             "attnprobe ablate measures decoders whose logits are a linear map of the last state")
    scaled = [k for k in ("final_logit_softcapping", "logit_scale") if getattr(model.config, k, None)]
    if loaded.causal and scaled:
        raise AttnprobeError(f"{loaded.spec} transforms its logits ({scaled[0]}={getattr(model.config, scaled[0])}), "
                             "which attnprobe ablate does not implement: use a GPT-2 or Llama-family model")
    return Stack(blocks, projections, final, loaded.lm_head, loaded.num_heads, loaded.head_dim)


def block_name(attention_name: str) -> str:
    """`h.0.attn` -> `h.0`; `encoder.layer.2.attention.self` -> `encoder.layer.2`: up to the layer index."""
    parts = attention_name.split(".")
    index = next(i for i, part in enumerate(parts) if part.isdigit())
    return ".".join(parts[: index + 1])


def projection_of(block: nn.Module, loaded: LoadedModel) -> nn.Module:
    for name in PROJECTIONS:
        try:
            return block.get_submodule(name)
        except AttributeError:
            continue
    raise AttnprobeError(
        f"attnprobe ablate does not know where {type(loaded.model).__name__} combines its heads (looked for "
        f"{', '.join(PROJECTIONS)}): use a GPT-2, Llama-family or BERT model"
    )


@contextmanager
def fast_attention(model: nn.Module) -> Iterator[None]:
    """SDPA for the duration (no attention maps are read here), where the model allows it and SDPA computes what the
    model does: not under attention-logit soft-capping (Gemma 2), which SDPA cannot apply and some transformers
    releases (5.17) still accept SDPA for, silently dropping the soft-capping (logits off by 0.67 on a tiny Gemma 2)."""
    before = model.config._attn_implementation
    if getattr(model.config, "attn_logit_softcapping", None):
        yield
        return
    try:
        with quiet_transformers():
            model.set_attn_implementation("sdpa")
    except (ValueError, ImportError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def make_batches(loaded: LoadedModel, ids: list[Any], batch_size: int) -> list[Batch]:
    """Sentences of similar length together, right-padded, with each next-token target."""
    batches = []
    for indices in length_batches(ids, batch_size):
        input_ids, mask = pad_batch([ids[i] for i in indices], loaded.device)  # [batch, seq] each
        real = mask.bool()  # [batch, seq]
        predicts = torch.zeros_like(real)  # [batch, seq]
        predicts[:, :-1] = real[:, 1:]  # position t predicts token t + 1 when that token is real
        rows = predicts.nonzero()[:, 0]  # [predicted]
        targets = input_ids[:, 1:][predicts[:, :-1]]  # [predicted]
        batches.append(Batch(indices, input_ids, mask, predicts, targets, rows))
    return batches


# ---- hooks ---------------------------------------------------------------------------------------------


def _split(x: Tensor, stack: Stack) -> Tensor:
    if x.shape[-1] != stack.heads * stack.head_dim:
        raise AttnprobeError(f"the output projection reads {x.shape[-1]} values, not heads x head_dim = "
                             f"{stack.heads} x {stack.head_dim}: this architecture is not supported by ablate")
    return x.unflatten(-1, (stack.heads, stack.head_dim))  # [rows, seq, heads, head_dim]


def ablation_hook(stack: Stack, ablated: Tensor, fill: Tensor) -> Callable:
    """Pre-hook: in row r, the heads where ablated[r] is True get `fill` [heads, head_dim] instead."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        split = _split(args[0], stack)  # [rows, seq, heads, head_dim]
        out = torch.where(ablated[:, None, :, None], fill.to(split.dtype), split)  # [rows, seq, heads, head_dim]
        return (out.flatten(-2), *args[1:])

    return hook


def gate_hook(stack: Stack, gates: Tensor) -> Callable:
    """Pre-hook: multiply each head's slice by its gate; gates [batch, heads]."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        split = _split(args[0], stack)  # [batch, seq, heads, head_dim]
        out = split * gates[:, None, :, None].to(split.dtype)  # [batch, seq, heads, head_dim]
        return (out.flatten(-2), *args[1:])

    return hook


@contextmanager
def hooked(modules: list[nn.Module], hooks: list[Callable]) -> Iterator[None]:
    handles = [module.register_forward_pre_hook(hook) for module, hook in zip(modules, hooks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---- the unablated pass and the suffix -----------------------------------------------------------------


def run_prefix(loaded: LoadedModel, stack: Stack, batch: Batch) -> Prefix:
    """The unablated pass, keeping every block's input and arguments."""
    count = len(stack.layers)
    hidden: list[Any] = [None] * count
    extras: list[Any] = [None] * count

    def capture(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            hidden[layer] = args[0] if args else kwargs["hidden_states"]  # [batch, seq, hidden]
            extras[layer] = (args[1:], rest)

        return hook

    handles = [block.register_forward_pre_hook(capture(i), with_kwargs=True) for i, block in enumerate(stack.layers)]
    try:
        final = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return Prefix(hidden, extras, final)  # final: [batch, seq, hidden]


def tile(value: Any, copies: int, batch: int) -> Any:
    """Stack `copies` copies of every batch-first tensor (2-D or more) in an argument structure."""
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return value.repeat(copies, *([1] * (value.dim() - 1)))  # [copies * batch, ...]
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(tile(v, copies, batch) for v in value)
    if isinstance(value, dict):
        return {k: tile(v, copies, batch) for k, v in value.items()}
    return value


def run_suffix(stack: Stack, prefix: Prefix, layer: int, copies: int) -> Tensor:
    """Blocks layer..L-1 on `copies` stacked copies of the batch; returns the last hidden state."""
    return run_blocks(stack.layers, stack.final, prefix.hidden, prefix.extras, layer, copies)


def run_blocks(blocks: list[nn.Module], final: nn.Module | None, inputs: list[Tensor],
               extras: list[tuple[tuple, dict]], layer: int, copies: int) -> Tensor:
    """Blocks layer..L-1 restarted from a kept pass (each block's input and its other arguments), on `copies`
    stacked copies of its batch, then the final norm: the last hidden state [copies * batch, seq, hidden]. ablate's
    and patching's suffixes both run through it."""
    batch = inputs[layer].shape[0]
    hidden = tile(inputs[layer], copies, batch)  # [copies * batch, seq, hidden]
    for index in range(layer, len(blocks)):
        args, kwargs = tile(extras[index], copies, batch)
        out = blocks[index](hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out  # [copies * batch, seq, hidden]
    return final(hidden) if final is not None else hidden  # [copies * batch, seq, hidden]


def run_full(loaded: LoadedModel, batch: Batch, copies: int) -> Tensor:
    """The whole network on `copies` stacked copies of the batch (the reference for run_suffix)."""
    input_ids = batch.input_ids.repeat(copies, 1)  # [copies * batch, seq]
    mask = batch.mask.repeat(copies, 1)  # [copies * batch, seq]
    return loaded.model(**forward_kwargs(loaded.model, input_ids, mask)).last_hidden_state


# ---- measures ------------------------------------------------------------------------------------------


def _wide(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def sentence_count(batches: list[Batch]) -> int:
    """Rows of a per-sentence result: one past the largest corpus index in the batches."""
    return 1 + max(max(b.indices) for b in batches)


def per_sentence(values: Tensor, rows: Tensor, batch: int) -> Tensor:
    """Mean of values [copies, predicted] over each sentence's positions -> [copies, batch]; NaN if none."""
    sums = values.new_zeros(values.shape[0], batch).index_add(1, rows, values)  # [copies, batch]
    counts = torch.bincount(rows, minlength=batch).to(values.dtype)  # [batch]
    return sums / counts  # [copies, batch]


def chunks(stack: Stack, rows: int) -> Iterator[slice]:
    """Row ranges whose [chunk, vocab] logits fit in LOGIT_MIB (a few float32 copies of them)."""
    step = max(1, LOGIT_MIB * 2**20 // (stack.head.out_features * 4 * 4))
    for start in range(0, rows, step):
        yield slice(start, start + step)


def normalizers(stack: Stack, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of hidden [n, hidden]: log Z, the log-sum-exp of its logits, and the logit of its target; [n] each."""
    log_z, picked = [], []
    for rows in chunks(stack, hidden.shape[0]):
        logits = _wide(stack.head(hidden[rows]))  # [chunk, vocab]
        log_z.append(torch.logsumexp(logits, dim=-1))  # [chunk]
        picked.append(logits.gather(-1, targets[rows][:, None])[:, 0])  # [chunk]
    return torch.cat(log_z), torch.cat(picked)  # [n] each


def expected_logit(ref: dict[str, Tensor], hidden: Tensor) -> Tensor:
    """sum_v p_v logit_v(h) for every row of hidden [copies * predicted, hidden], p the unablated next-token
    distribution at the row's position: the LM head is linear, so it is (p W) . h + p . b, without the logits."""
    copies = hidden.shape[0] // ref["pw"].shape[0]
    dot = (hidden.double() * ref["pw"].double().repeat(copies, 1)).sum(-1)  # [copies * predicted]
    return dot + ref["pb"].double().repeat(copies)  # [copies * predicted]


def reference(stack: Stack, batch: Batch, final: Tensor, causal: bool) -> dict[str, Tensor]:
    """What every ablation of this batch is compared with."""
    if not causal:
        real = batch.mask.double()[..., None]  # [batch, seq, 1]
        return {"hidden": final, "pooled": (final.double() * real).sum(1) / real.sum(1)}  # pooled: [batch, hidden]
    picked = final[batch.predicts]  # [predicted, hidden]
    weight, bias = stack.head.weight, stack.head.bias  # [vocab, hidden], [vocab] or None
    pw, pb = [], []
    for rows in chunks(stack, picked.shape[0]):
        p = torch.softmax(_wide(stack.head(picked[rows])), dim=-1)  # [chunk, vocab]
        pw.append(p.to(weight.dtype) @ weight)  # [chunk, hidden]
        pb.append(p @ _wide(bias) if bias is not None else p.new_zeros(p.shape[0]))  # [chunk]
    ref = {"pw": torch.cat(pw), "pb": torch.cat(pb)}  # [predicted, hidden], [predicted]
    log_z, target = normalizers(stack, picked, batch.targets)  # [predicted] each
    ref["log_z"], ref["expected"] = log_z.double(), expected_logit(ref, picked)  # [predicted] each
    ref["nll"] = log_z.double() - target.double()  # [predicted]
    ref["loss"] = per_sentence(ref["nll"][None], batch.rows, len(batch.indices))[0]  # [batch]
    return ref


def token_measures(stack: Stack, batch: Batch, ref: dict[str, Tensor], final: Tensor) -> tuple[Tensor, Tensor]:
    """Per copy and predicting position: the ablated next-token loss and KL(unablated p || ablated q), each
    [copies, predicted]; final [copies * batch, seq, hidden].

    With log q_v = logit_v - log Z: KL = sum_v p_v log p_v - sum_v p_v log q_v
    = (E_p[logit] - log Z)_unablated - (E_p[logit] - log Z)_ablated, and E_p[logit] needs no logits
    (`expected_logit`): per ablation, one LM-head product and one log-sum-exp.
    """
    size, n = len(batch.indices), batch.targets.shape[0]
    copies = final.shape[0] // size
    picked = final.unflatten(0, (copies, size))[:, batch.predicts].flatten(0, 1)  # [copies * predicted, hidden]
    log_z, target = normalizers(stack, picked, batch.targets.repeat(copies))  # [copies * predicted] each
    nll = (log_z.double() - target.double()).view(copies, n)  # [copies, predicted]
    mine = expected_logit(ref, picked) - log_z.double()  # [copies * predicted]
    kl = ((ref["expected"] - ref["log_z"]).repeat(copies) - mine).view(copies, n)  # [copies, predicted]
    return nll, kl


def decoder_measures(stack: Stack, batch: Batch, ref: dict[str, Tensor], final: Tensor) -> dict[str, Tensor]:
    """Per copy and sentence: the ablated loss, its change and KL(unablated p || ablated q) (`token_measures`,
    averaged over each sentence's positions); final [copies * batch, seq, hidden]."""
    size = len(batch.indices)
    nll, kl = token_measures(stack, batch, ref, final)  # [copies, predicted] each
    loss = per_sentence(nll, batch.rows, size)  # [copies, batch]
    return {"loss": loss, "loss_change": loss - ref["loss"], "kl": per_sentence(kl, batch.rows, size)}


def encoder_measures(batch: Batch, ref: dict[str, Tensor], final: Tensor) -> dict[str, Tensor]:
    """Per copy and sentence: 1 - cosine of the token states (mean over tokens) and of the mean-pooled embedding."""
    size = len(batch.indices)
    hidden = final.unflatten(0, (final.shape[0] // size, size)).double()  # [copies, batch, seq, hidden]
    real = batch.mask.to(hidden.dtype)  # [batch, seq]
    tokens = 1 - torch.cosine_similarity(hidden, ref["hidden"].double()[None], dim=-1)  # [copies, batch, seq]
    pooled = (hidden * real[..., None]).sum(2) / real.sum(1)[:, None]  # [copies, batch, hidden]
    return {
        "embedding_change": 1 - torch.cosine_similarity(pooled, ref["pooled"][None], dim=-1),  # [copies, batch]
        "hidden_change": (tokens * real).sum(-1) / real.sum(-1),  # [copies, batch]
    }


def compare(stack: Stack, batch: Batch, ref: dict[str, Tensor], final: Tensor, causal: bool) -> dict[str, Tensor]:
    return decoder_measures(stack, batch, ref, final) if causal else encoder_measures(batch, ref, final)


# ---- single-head and layer ablation --------------------------------------------------------------------


def zero_fill(loaded: LoadedModel, stack: Stack) -> Tensor:
    return torch.zeros(loaded.num_layers, stack.heads, stack.head_dim, device=loaded.device)  # [layer, heads, dim]


def head_fill(
    loaded: LoadedModel, stack: Stack, batches: list[Batch], method: str, progress: Progress | None = None
) -> Tensor:
    """What an ablated head's slice becomes: zeros, or its mean over every real token of the corpus."""
    return zero_fill(loaded, stack) if method == "zero" else head_means(loaded, stack, batches, progress)


@torch.inference_mode()
def head_means(loaded: LoadedModel, stack: Stack, batches: list[Batch], progress: Progress | None = None) -> Tensor:
    """Each head's mean output (its slice of the projection's input) over the corpus's real tokens."""
    sums = zero_fill(loaded, stack).double()  # [layer, heads, head_dim]
    tokens = 0
    current: dict[str, Tensor] = {}  # the mask of the batch being run, for the hooks

    def accumulate(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            split = _split(args[0], stack).double()  # [batch, seq, heads, head_dim]
            sums[layer] += (split * current["mask"][..., None, None]).sum((0, 1))  # [heads, head_dim]

        return hook

    total, done = sum(len(b.indices) for b in batches), 0
    with hooked(stack.projections, [accumulate(layer) for layer in range(len(stack.projections))]):
        for batch in batches:
            current["mask"] = batch.mask.double()  # [batch, seq]
            loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask))
            tokens += int(batch.mask.sum())
            done += len(batch.indices)
            if progress:
                progress("mean", done, total)
    return (sums / tokens).float()  # [layer, heads, head_dim]


def group_size(batch: Batch, count: int) -> int:
    """How many ablations one pass stacks: COPY_TOKENS positions at most, one at least."""
    return max(1, min(count, COPY_TOKENS // batch.input_ids.numel()))


@torch.inference_mode()
def measure(
    loaded: LoadedModel, stack: Stack, batches: list[Batch], targets: list[Target], fill: Tensor,
    *, reuse: bool = True, group: int | None = None, progress: Progress | None = None,
) -> dict[str, np.ndarray]:
    """Per measure [sentence, target]: what each target's ablation changes in each sentence.

    `reuse` restarts the network at the target's layer from the unablated pass (False: recompute it
    all, the reference for the tests); `group` caps how many targets share one pass.
    """
    names = measure_names(loaded)
    count = sentence_count(batches)
    out = {name: np.full((count, len(targets)), np.nan) for name in names}
    by_layer: dict[int, list[int]] = {}
    for k, (layer, _) in enumerate(targets):
        by_layer.setdefault(layer, []).append(k)
    done = 0
    for batch in batches:
        prefix = run_prefix(loaded, stack, batch)
        ref = reference(stack, batch, prefix.final, loaded.causal)
        for layer, members in by_layer.items():
            size = group or group_size(batch, len(members))
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                values = ablate_group(loaded, stack, batch, prefix, ref, layer, [targets[k][1] for k in chunk],
                                      fill, reuse)
                for name in names:
                    out[name][np.ix_(batch.indices, chunk)] = values[name].T.cpu().double().numpy()
        done += len(batch.indices)
        if progress:
            progress("ablate", done, count)
    return out


def ablate_group(
    loaded: LoadedModel, stack: Stack, batch: Batch, prefix: Prefix, ref: dict[str, Tensor], layer: int,
    heads: list[tuple[int, ...]], fill: Tensor, reuse: bool,
) -> dict[str, Tensor]:
    """One pass: copy c of the batch loses heads[c] of `layer`; returns each measure [copies, batch]."""
    size = len(batch.indices)
    ablated = torch.zeros(len(heads), stack.heads, dtype=torch.bool, device=loaded.device)  # [copies, heads]
    for c, group in enumerate(heads):
        ablated[c, list(group)] = True
    rows = ablated.repeat_interleave(size, dim=0)  # [copies * batch, heads]
    with hooked([stack.projections[layer]], [ablation_hook(stack, rows, fill[layer])]):
        final = run_suffix(stack, prefix, layer, len(heads)) if reuse else run_full(loaded, batch, len(heads))
    return compare(stack, batch, ref, final, loaded.causal)


# ---- gradient importance -------------------------------------------------------------------------------


def gated_objective(loaded: LoadedModel, stack: Stack, batch: Batch, gates: Tensor, probes: Tensor | None = None
                    ) -> Tensor:
    """Per sentence [batch], with each head's slice multiplied by gates [batch, layer, heads].

    Decoders: the mean next-token loss (NaN for a sentence with nothing to predict). Encoders: the
    projection of the unit mean-pooled embedding on probes [batch, hidden].
    """
    hooks = [gate_hook(stack, gates[:, layer]) for layer in range(len(stack.projections))]
    with hooked(stack.projections, hooks):
        final = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    if not loaded.causal:
        real = batch.mask.to(final.dtype)[..., None]  # [batch, seq, 1]
        pooled = _wide((final * real).sum(1) / real.sum(1))  # [batch, hidden]
        unit = pooled / pooled.norm(dim=-1, keepdim=True)  # [batch, hidden]
        return (unit * probes).sum(-1)  # [batch]
    logits = _wide(stack.head(final[batch.predicts]))  # [predicted, vocab]
    nll = torch.nn.functional.cross_entropy(logits, batch.targets, reduction="none")  # [predicted]
    return per_sentence(nll[None], batch.rows, len(batch.indices))[0]  # [batch]


def gradient_importance(
    loaded: LoadedModel, stack: Stack, batches: list[Batch], seed: int = 0, progress: Progress | None = None
) -> np.ndarray:
    """Per sentence [sentence, layer, head]: |d objective / d gate| at gates of 1 (Michel et al. 2019).

    Decoders: the gradient of the sentence's mean next-token loss, one forward and backward per batch.
    Encoders have no loss: the gradient of the unit sentence embedding has the norm
    sqrt(E[(v . d e/d g)^2]) over v ~ N(0, I), estimated with GRADIENT_PROBES random v (one backward each);
    to first order, ablating the head moves the embedding's direction by that much.
    """
    count = sentence_count(batches)
    out = np.full((count, len(stack.layers), stack.heads), np.nan)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    done = 0
    for batch in batches:
        out[batch.indices] = batch_gradient(loaded, stack, batch, generator).cpu().double().numpy()
        done += len(batch.indices)
        if progress:
            progress("gradient", done, count)
    return out


def batch_gradient(loaded: LoadedModel, stack: Stack, batch: Batch, generator: torch.Generator) -> Tensor:
    size = len(batch.indices)
    gates = torch.ones(size, len(stack.layers), stack.heads, device=loaded.device, requires_grad=True)
    with torch.enable_grad():
        if loaded.causal:
            loss = gated_objective(loaded, stack, batch, gates)  # [batch]
            valid = ~torch.isnan(loss)  # [batch]
            (grad,) = torch.autograd.grad(loss[valid].sum(), gates)  # [batch, layer, heads]
            return torch.where(valid[:, None, None], grad.abs(), torch.nan)  # [batch, layer, heads]
        probes = probe_vectors(generator, size, loaded.model.config.hidden_size).to(loaded.device)
        squares = torch.zeros_like(gates)  # [batch, layer, heads]
        for k in range(probes.shape[0]):
            objective = gated_objective(loaded, stack, batch, gates, probes[k])  # [batch]
            (grad,) = torch.autograd.grad(objective.sum(), gates)  # [batch, layer, heads]
            squares = squares + grad.square()
    return (squares / probes.shape[0]).sqrt().detach()  # [batch, layer, heads]


def probe_vectors(generator: torch.Generator, size: int, hidden: int) -> Tensor:
    """GRADIENT_PROBES random directions v ~ N(0, I) per sentence: [probe, batch, hidden], float32, on the CPU."""
    return torch.randn(GRADIENT_PROBES, size, hidden, generator=generator)


# ---- pruning -------------------------------------------------------------------------------------------


def pruning_orders(
    table: pd.DataFrame, grads: np.ndarray, all_heads: bool, primary: str, seed: int
) -> dict[str, list[tuple[int, int]]]:
    """Heads from least to most important: by the ablation measure and, for decoders, by the KL (when every
    head was ablated), by the gradient, and in a seeded random order."""
    layers, heads = grads.shape[1:]
    every = [(layer, head) for layer in range(layers) for head in range(heads)]
    gradient = nanmean(grads)  # [layer, heads]
    orders = {}
    for name, column in (("ablation", primary), ("kl", "kl")):
        if all_heads and column in table.columns:
            ranked = table.sort_values([column, "layer", "head"], kind="stable")
            orders[name] = list(zip(ranked["layer"].astype(int), ranked["head"].astype(int)))
    orders["gradient"] = sorted(every, key=lambda lh: (gradient[lh], lh))
    shuffled = np.random.default_rng([seed, 1]).permutation(len(every))
    orders["random"] = [every[i] for i in shuffled]
    return orders


@torch.inference_mode()
def pruning_curve(
    loaded: LoadedModel, stack: Stack, batches: list[Batch], orders: dict[str, list[tuple[int, int]]], fill: Tensor,
    weights: np.ndarray, progress: Progress | None = None,
) -> pd.DataFrame:
    """Remove heads cumulatively, in each order, and measure the model at 0, 10, ..., 100% removed."""
    points, masks = pruning_points(orders, len(stack.layers), stack.heads)
    values = prune_passes(loaded, stack, batches, masks, fill, progress)  # per measure [sentence, mask]
    rows = []
    for order, percent, removed, column in points:
        row: dict[str, Any] = {"order": order, "percent": percent, "heads_removed": removed}
        for name, per_sentence_values in values.items():
            mean, low, high = summarize(per_sentence_values[:, [column]], weights)
            row.update({name: mean[0], f"{name}_ci_low": low[0], f"{name}_ci_high": high[0]})
        rows.append(row)
    return pd.DataFrame(rows)


def pruning_points(
    orders: dict[str, list[tuple[int, int]]], layers: int, heads: int
) -> tuple[list[tuple[str, int, int, int]], list[np.ndarray]]:
    """(order, percent, heads removed, mask index) per point, and the distinct masks [layer, heads] they use."""
    total = layers * heads
    points, masks = [], {}
    for order, ranked in orders.items():
        for percent in PRUNING_PERCENTS:
            removed = ranked[: round(percent / 100 * total)]
            mask = np.zeros((layers, heads), dtype=bool)  # [layer, heads]
            for layer, head in removed:
                mask[layer, head] = True
            column = masks.setdefault(mask.tobytes(), (len(masks), mask))[0]
            points.append((order, percent, len(removed), column))
    return points, [mask for _, mask in masks.values()]


def prune_passes(
    loaded: LoadedModel, stack: Stack, batches: list[Batch], masks: list[np.ndarray], fill: Tensor,
    progress: Progress | None = None,
) -> dict[str, np.ndarray]:
    """Per measure [sentence, mask]: the whole network with the heads of each mask [layer, heads] removed."""
    names = ("loss", *DECODER_MEASURES) if loaded.causal else ENCODER_MEASURES
    count = sentence_count(batches)
    out = {name: np.full((count, len(masks)), np.nan) for name in names}
    all_masks = torch.as_tensor(np.stack(masks), device=loaded.device)  # [masks, layer, heads]
    done = 0
    for batch in batches:
        final = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
        ref = reference(stack, batch, final, loaded.causal)
        size = group_size(batch, len(masks))
        for start in range(0, len(masks), size):
            chosen = all_masks[start : start + size]  # [copies, layer, heads]
            rows = chosen.repeat_interleave(len(batch.indices), dim=0)  # [copies * batch, layer, heads]
            hooks = [ablation_hook(stack, rows[:, layer], fill[layer]) for layer in range(len(stack.layers))]
            with hooked(stack.projections, hooks):
                pruned = run_full(loaded, batch, chosen.shape[0])  # [copies * batch, seq, hidden]
            values = compare(stack, batch, ref, pruned, loaded.causal)
            for name in names:
                out[name][np.ix_(batch.indices, range(start, start + chosen.shape[0]))] = (
                    values[name].T.cpu().double().numpy())
        done += len(batch.indices)
        if progress:
            progress("pruning", done, count)
    return out


# ---- tables --------------------------------------------------------------------------------------------


def nanmean(values: np.ndarray) -> np.ndarray:
    """Mean over axis 0, skipping NaN; NaN (quietly) where every value is NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=0)


def summarize(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over sentences of values [sentence, k] (NaN skipped), and its 95% Poisson-bootstrap interval."""
    mean = nanmean(values)  # [k]
    low, high = interval(resampled_means(values, weights))  # [k] each
    return mean, low, high


def with_intervals(frame: pd.DataFrame, values: dict[str, np.ndarray], names: tuple[str, ...], weights: np.ndarray,
                   columns: slice) -> pd.DataFrame:
    frame = frame.copy()
    for name in names:
        mean, low, high = summarize(values[name][:, columns], weights)
        frame[name], frame[f"{name}_ci_low"], frame[f"{name}_ci_high"] = mean, low, high
    return frame


def head_table(values: dict[str, np.ndarray], chosen: list[tuple[int, int]], names: tuple[str, ...],
               weights: np.ndarray, grads: np.ndarray) -> pd.DataFrame:
    """importance.csv: one row per ablated head, ranked by the first measure (1 = most important)."""
    frame = pd.DataFrame(chosen, columns=["layer", "head"])
    frame = with_intervals(frame, values, names, weights, slice(0, len(chosen)))
    gradient = nanmean(grads)  # [layer, heads]
    frame["gradient_importance"] = [gradient[layer, head] for layer, head in chosen]
    frame["rank"] = frame[names[0]].rank(ascending=False, method="first").astype("Int64")
    return frame


def layer_rows(values: dict[str, np.ndarray], offset: int, layers: int, names: tuple[str, ...],
               weights: np.ndarray) -> pd.DataFrame:
    """layer_importance.csv: one row per layer with every head ablated."""
    frame = pd.DataFrame({"layer": range(layers)})
    return with_intervals(frame, values, names, weights, slice(offset, offset + layers))


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation (average ranks for ties) over pairs where both are numbers."""
    keep = ~(np.isnan(a) | np.isnan(b))
    if keep.sum() < 3:
        return None
    ra = pd.Series(a[keep]).rank().to_numpy()
    rb = pd.Series(b[keep]).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def record_header(loaded: LoadedModel, corpus: Corpus) -> dict[str, Any]:
    """What every ablation record (ablate.json, streaming.json) starts with: the version, the time, the model and
    the corpus."""
    return {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "spec": loaded.spec, "source": loaded.source, **loaded.origin, "revision": loaded.revision,
            "architecture": type(loaded.model).__name__, "layers": loaded.num_layers, "heads": loaded.num_heads,
            "kv_heads": loaded.num_kv_heads, "head_dim": loaded.head_dim, "causal": loaded.causal,
        },
        "corpus": {"path": str(corpus.path.resolve()), "sha256": corpus.sha256, "split": corpus.split},
    }


def run_info(
    loaded: LoadedModel, corpus: Corpus, ids: list[Any], method: str, heads: list[tuple[int, int]] | None,
    layers: bool, batch_size: int, resamples: int, seed: int, primary: str, rho: float | None,
) -> dict[str, Any]:
    from attnprobe.records import versions

    return {
        **record_header(loaded, corpus),
        "sentences": len(ids),
        "bos": loaded.bos,  # --bos: auto (the tokenizer's own), always or never
        "limit": corpus.limit,  # --limit: only the corpus's first N sentences (None: all)
        "tokens": int(sum(len(t) for t in ids)),
        "method": method,
        "heads": "all" if heads is None else [head_name(layer, head) for layer, head in sorted(heads)],
        "layers": layers,
        "measure": primary,
        "spearman": rho,
        "spearman_of": f"gradient_importance vs {primary}, over the ablated heads",
        "gradient": "mean |d loss/d gate|" if loaded.causal else
        f"mean norm of d(unit embedding)/d gate, {GRADIENT_PROBES} random probes",
        "pruning_percents": list(PRUNING_PERCENTS),
        "device": str(loaded.device),
        "dtype": loaded.dtype,
        "dtype_requested": loaded.dtype_requested,
        "batch_size": batch_size,
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "over": "sentences",
                      "method": "poisson"},
        "notes": [note for note in (few_items_note(len(ids), "sentence"),) if note],
        "versions": versions(),
    }

