"""Which heads carry a behaviour: activation, attribution and path patching per head.

A prompt pair is a clean and a corrupt prompt of one length, with the clean prompt's answer and a wrong token;
the metric is the logit difference LD = logit(answer) - logit(wrong) at the last position (or log p(answer)),
averaged over pairs. A head's output is its slice of the input of the attention output projection (`o_proj`,
GPT-2's `c_proj`, OPT's `out_proj`, GPT-NeoX's `dense`: found as the last linear map the attention module calls
on heads x head_dim values), replaced through a forward pre-hook.

- Activation patching, denoising: the corrupt run with one head's output taken from the clean run;
  effect = (LD_patched - LD_corrupt) / (LD_clean - LD_corrupt): 1 = the head alone restores the clean behaviour.
  Noising is the mirror: the clean run with one head's output from the corrupt run;
  effect = (LD_clean - LD_patched) / (LD_clean - LD_corrupt): 1 = the head alone destroys it.
- Attribution patching: the first-order estimate of the same, from one run of each prompt and one backward pass:
  LD_patched ~ LD_base + grad_base . (source - base) over the head's slice (Nanda; Kramar et al. 2024).
- Path patching (Wang et al.): a sender head's source output reaches the receiver heads only through their
  queries, keys, values (`q`, `k`, `v`) or through their whole output (`out`); every other head is frozen at the
  base run's output (the MLPs recompute).

Intervals: a Poisson bootstrap over pairs of the ratio of means (the effect of each resample from its own means).
Speed: a patch at layer l changes nothing below l. The base run keeps every block's input; the patches of layer l
run blocks l..L-1 only, as copies of the pairs stacked along the batch with another head patched in each copy.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe import __version__
from attnprobe.ablate import FINAL_NORMS, block_name, fast_attention, hooked, run_blocks, spearman
from attnprobe.bootstrap import CONFIDENCE, few_items_note, interval, poisson_weights
from attnprobe.errors import AttnprobeError
from attnprobe.ioi import Pair
from attnprobe.model import LoadedModel, attention_modules, forward_kwargs
from attnprobe.naming import head_name

METHODS = ("activation", "attribution", "both", "path")
DIRECTIONS = ("denoise", "noise")
POSITIONS = ("all", "last", "each")
METRICS = ("logit-diff", "logprob")
VIAS = ("q", "k", "v", "out")
COPY_TOKENS = 16_384  # positions (copies x pairs x seq) in one batched patching pass
PAIR_KEYS = ("clean", "corrupt", "answer", "wrong")

Progress = Callable[[str, int, int], None]  # (stage, done, total)
Head = tuple[int, int]


@dataclass(frozen=True)
class Parts:
    """Where a decoder's blocks, head-combining projections, query/key/value maps and LM head are."""

    blocks: list[nn.Module]
    attentions: list[nn.Module]
    projections: list[nn.Module]  # per block, the module whose input is the concatenated head outputs
    qkv: list[tuple[nn.Module, ...]]  # per block: (q, k, v) projections, or one combined (q | k | v) map; or ()
    final: nn.Module | None  # the norm after the last block
    head: nn.Module  # the LM head
    heads: int
    kv_heads: int
    head_dim: int
    logits: Callable[[Tensor], Tensor]  # the model's own transform of the LM head's output (soft-capping, scale)


@dataclass
class Prompts:
    """Tokenized pairs: clean and corrupt ids of one length per pair, right-padded to the longest pair."""

    clean: Tensor  # [pairs, seq]
    corrupt: Tensor  # [pairs, seq]
    mask: Tensor  # [pairs, seq], 1 on real tokens
    last: Tensor  # [pairs] the last real position
    answer: Tensor  # [pairs] the answer's first token
    wrong: Tensor  # [pairs] the wrong answer's first token


@dataclass
class Patching:
    table: pd.DataFrame  # patching.csv
    run: dict[str, Any]  # patch.json
    ld: dict[str, np.ndarray] = field(default_factory=dict)  # per-pair metric: clean, corrupt [pairs]


# ---- pairs -----------------------------------------------------------------------------------------------


def read_pairs(path: str | Path) -> list[Pair]:
    """Prompt pairs from a JSON-lines file: one object per line with clean, corrupt, answer and wrong (strings)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise AttnprobeError(f"--pairs {path}: cannot read it as UTF-8 text ({err.__class__.__name__}): give a "
                             "JSON-lines file of prompt pairs") from None
    pairs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        pairs.append(pair_of(line, f"--pairs {path} line {number}"))
    if not pairs:
        raise AttnprobeError(f"--pairs {path} holds no pair: one JSON object a line, with "
                             f"{', '.join(PAIR_KEYS)}")
    return pairs


def pair_of(line: str, where: str) -> Pair:
    """One pair from one line of JSON, checked."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        raise AttnprobeError(f"{where} is not JSON: one object a line, e.g. "
                             '{"clean": "...", "corrupt": "...", "answer": " Mary", "wrong": " John"}') from None
    if not isinstance(data, dict):
        raise AttnprobeError(f"{where} is not a JSON object with {', '.join(PAIR_KEYS)}")
    for key in PAIR_KEYS:
        if not isinstance(data.get(key), str) or not data[key]:
            raise AttnprobeError(f"{where}: {key!r} is missing or not a non-empty string")
    return Pair(*(data[key] for key in PAIR_KEYS))


def pairs_sha256(pairs: list[Pair]) -> str:
    """The sha256 of the pairs as canonical JSON lines (the same pairs give the same hash, from a file or --task)."""
    text = "".join(json.dumps({k: getattr(p, k) for k in PAIR_KEYS}, sort_keys=True) + "\n" for p in pairs)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def first_token(loaded: LoadedModel, text: str, where: str) -> int:
    """The first token of an answer, tokenized without special tokens (as it follows the prompt)."""
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise AttnprobeError(f"{where}: {text!r} makes no token")
    return int(ids[0])


def tokenize_pairs(loaded: LoadedModel, pairs: list[Pair]) -> Prompts:
    """Prompts tokenized as `analyze` tokenizes (tokens.encode, under --bos); a pair whose prompts differ in length,
    or whose answer and wrong token are one token, is refused with its number."""
    from attnprobe.batching import pad_batch
    from attnprobe.tokens import encode

    clean = encode(loaded, [p.clean for p in pairs])["input_ids"]
    corrupt = encode(loaded, [p.corrupt for p in pairs])["input_ids"]
    answers, wrongs = [], []
    for k, (pair, a, b) in enumerate(zip(pairs, clean, corrupt), start=1):
        if len(a) != len(b):
            raise AttnprobeError(f"pair {k}: the clean prompt is {len(a)} tokens and the corrupt one {len(b)}: "
                                 "patching needs both of one length (change a word so they tokenize alike)")
        if len(a) > loaded.max_length:
            raise AttnprobeError(f"pair {k}: {len(a)} tokens, more than the model's {loaded.max_length}")
        answers.append(first_token(loaded, pair.answer, f"pair {k}'s answer"))
        wrongs.append(first_token(loaded, pair.wrong, f"pair {k}'s wrong answer"))
        if answers[-1] == wrongs[-1]:
            raise AttnprobeError(f"pair {k}: the answer {pair.answer!r} and the wrong answer {pair.wrong!r} start "
                                 "with the same token: the logit difference would be 0")
    clean_ids, mask = pad_batch([list(t) for t in clean], loaded.device)  # [pairs, seq] each
    corrupt_ids, _ = pad_batch([list(t) for t in corrupt], loaded.device)  # [pairs, seq]
    last = mask.sum(1) - 1  # [pairs]
    device = loaded.device
    return Prompts(clean_ids, corrupt_ids, mask, last, torch.tensor(answers, device=device),
                   torch.tensor(wrongs, device=device))


# ---- the model's parts -----------------------------------------------------------------------------------


def find_parts(loaded: LoadedModel) -> Parts:
    """The parts of a decoder that patching reads and replaces, found by what they do, not by their names."""
    if not loaded.causal:
        raise AttnprobeError(f"{loaded.spec} is an encoder: patching compares next-token logits; use a decoder")
    if loaded.lm_head is None:
        raise AttnprobeError(f"patching {loaded.spec} needs its LM head: load it with load_model(..., lm_head=True)")
    model = loaded.model
    attentions = [module for module, _ in attention_modules(model)]
    if not attentions:
        raise AttnprobeError(f"found no attention modules in {type(model).__name__}: patching needs a decoder whose "
                             "attention modules transformers can record")
    names = {id(module): name for name, module in model.named_modules()}
    blocks = [model.get_submodule(block_name(names[id(module)])) for module in attentions]
    order = linear_order(loaded, attentions[0])
    width = loaded.num_heads * loaded.head_dim
    outputs = [name for name, given in order if given == width]
    if not outputs:
        raise AttnprobeError(f"found no map of heads x head_dim = {width} values in {type(attentions[0]).__name__}: "
                             "patching does not know where this architecture combines its heads")
    projections = [attention.get_submodule(outputs[-1]) for attention in attentions]
    before = [name for name, _ in order[: [n for n, _ in order].index(outputs[-1])]]
    qkv = [tuple(attention.get_submodule(name) for name in before) for attention in attentions]
    return Parts(blocks, attentions, projections, qkv, final_norm(model), loaded.lm_head, loaded.num_heads,
                 loaded.num_kv_heads, loaded.head_dim, logit_transform(model.config))


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last block (GPT-2's ln_f, Llama's norm, OPT's decoder.final_layer_norm, Phi's
    final_layernorm, MPT's norm_f): the last module outside the blocks whose name says norm (check_rerun proves it)."""
    found = [module for name, module in model.named_modules()
             if name and not any(part.isdigit() for part in name.split("."))
             and (name.split(".")[-1] in FINAL_NORMS or "norm" in name.split(".")[-1].lower())]
    return found[-1] if found else None


def linear_order(loaded: LoadedModel, attention: nn.Module) -> list[tuple[str, int]]:
    """The linear maps an attention module calls, in call order, with the width of their input (one short run)."""
    called: list[tuple[str, int]] = []

    def note(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], Tensor) and name not in [n for n, _ in called]:
                called.append((name, args[0].shape[-1]))

        return hook

    maps = [(name, module) for name, module in attention.named_modules()
            if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")]
    ids = torch.zeros(1, 2, dtype=torch.long, device=loaded.device)  # [1, 2]
    with torch.no_grad(), hooked([m for _, m in maps], [note(n) for n, _ in maps]):
        loaded.model(**forward_kwargs(loaded.model, ids, torch.ones_like(ids)))
    return called


def logit_transform(config: Any) -> Callable[[Tensor], Tensor]:
    """What the model does to its LM head's output: Gemma 2's final soft-capping, Cohere's logit_scale, Granite's
    logits_scaling (the identity for the rest)."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None) if getattr(config, "model_type", "") == "cohere" else None
    divide = getattr(config, "logits_scaling", None)

    def transform(logits: Tensor) -> Tensor:
        if scale:
            logits = logits * scale
        if divide:
            logits = logits / divide
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


# ---- runs ------------------------------------------------------------------------------------------------


@dataclass
class Prefix:
    """One run over the pairs, kept to restart the network at any layer."""

    hidden: list[Tensor]  # per layer, the residual stream at its input [pairs, seq, hidden]
    extras: list[tuple[tuple, dict]]  # per layer, the other arguments the model passed it
    outputs: list[Tensor]  # per layer, the heads' outputs [pairs, seq, heads, head_dim]
    final: Tensor  # the base model's last hidden state [pairs, seq, hidden]
    implementation: str  # the attention it ran with: the blocks' arguments (the mask) are made for it


def split_heads(x: Tensor, parts: Parts) -> Tensor:
    if x.shape[-1] != parts.heads * parts.head_dim:
        raise AttnprobeError(f"the output projection reads {x.shape[-1]} values, not heads x head_dim = "
                             f"{parts.heads} x {parts.head_dim}: patching does not support this architecture")
    return x.unflatten(-1, (parts.heads, parts.head_dim))  # [rows, seq, heads, head_dim]


def run_prefix(loaded: LoadedModel, parts: Parts, ids: Tensor, mask: Tensor) -> Prefix:
    """A whole run keeping every block's input and arguments and every head's output."""
    count = len(parts.blocks)
    hidden: list[Any] = [None] * count
    extras: list[Any] = [None] * count
    outputs: list[Any] = [None] * count

    def block_hook(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden[layer] = args[0] if args else kwargs["hidden_states"]  # [pairs, seq, hidden]
            extras[layer] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})

        return hook

    def output_hook(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            outputs[layer] = split_heads(args[0], parts).detach()  # [pairs, seq, heads, head_dim]

        return hook

    handles = [block.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, block in enumerate(parts.blocks)]
    try:
        with hooked(parts.projections, [output_hook(i) for i in range(count)]):
            final = loaded.model(**forward_kwargs(loaded.model, ids, mask)).last_hidden_state  # [pairs, seq, hidden]
    finally:
        for handle in handles:
            handle.remove()
    return Prefix(hidden, extras, outputs, final, loaded.model.config._attn_implementation)


def run_suffix(parts: Parts, prefix: Prefix, layer: int, copies: int) -> Tensor:
    """Blocks layer..L-1 on `copies` stacked copies of the pairs; returns the last hidden state."""
    return run_blocks(parts.blocks, parts.final, prefix.hidden, prefix.extras, layer, copies)


def check_rerun(loaded: LoadedModel, parts: Parts, run: Prefix) -> None:
    """The last block rerun from its kept input, as two stacked copies of the pairs, gives the run's own last hidden
    state in both (else this architecture does something between or inside its blocks that patching does not know,
    such as BLOOM's ALiBi of batch x heads rows, and every patched number would be wrong)."""
    try:
        again = run_suffix(parts, run, len(parts.blocks) - 1, 2).unflatten(0, (2, -1))  # [2, pairs, seq, hidden]
    except RuntimeError as err:
        raise AttnprobeError(f"{loaded.spec}: its blocks cannot be rerun on stacked copies of the pairs "
                             f"({str(err).splitlines()[0][:80]}): patching does not support "
                             f"{type(loaded.model).__name__}") from None
    finite = torch.isfinite(again).all(-1) & torch.isfinite(run.final).all(-1)  # [2, pairs, seq]: padded rows
    gap = float((again - run.final).abs()[finite].max()) if finite.any() else 0.0
    scale = float(run.final.abs().max()) or 1.0
    if gap > 1e-3 * scale:
        raise AttnprobeError(f"{loaded.spec}: rerunning its last block does not give its output (off by {gap:.3g}): "
                             f"patching does not support {type(loaded.model).__name__}")


def check_attention(loaded: LoadedModel, *runs: Prefix) -> None:
    """The blocks rerun with the attention their prefix ran with (an eager block given SDPA's mask, None on a causal
    batch without padding, would attend both ways)."""
    now = loaded.model.config._attn_implementation
    if any(run.implementation != now for run in runs):
        raise AttnprobeError(f"the kept runs used {runs[0].implementation} attention, the model now {now}: run both "
                             "under one (patching.fast_attention)")


def metric(parts: Parts, prompts: Prompts, final: Tensor, kind: str) -> Tensor:
    """The metric per row of final [copies * pairs, seq, hidden] at each pair's last position: [copies, pairs]
    float64 (logit-diff: logit(answer) - logit(wrong); logprob: log p(answer))."""
    pairs = prompts.last.shape[0]
    copies = final.shape[0] // pairs
    rows = torch.arange(final.shape[0], device=final.device)  # [copies * pairs]
    last = final[rows, prompts.last.repeat(copies)]  # [copies * pairs, hidden]
    answer, wrong = prompts.answer.repeat(copies), prompts.wrong.repeat(copies)  # [copies * pairs] each
    if kind == "logprob":
        logits = parts.logits(parts.head(last)).double()  # [copies * pairs, vocab]
        value = torch.log_softmax(logits, -1).gather(-1, answer[:, None])[:, 0]  # [copies * pairs]
    else:
        weight = parts.head.weight  # [vocab, hidden]
        picked = torch.stack([weight[answer], weight[wrong]], 1)  # [copies * pairs, 2, hidden]
        logits = (picked.float() * last.float()[:, None]).sum(-1)  # [copies * pairs, 2], float32 under bf16
        if getattr(parts.head, "bias", None) is not None:
            logits = logits + torch.stack([parts.head.bias[answer], parts.head.bias[wrong]], 1).float()  # [.., 2]
        logits = parts.logits(logits).double()  # [copies * pairs, 2]
        value = logits[:, 0] - logits[:, 1]  # [copies * pairs]
    return value.view(copies, pairs)  # [copies, pairs]


def base_and_source(prompts: Prompts, direction: str) -> tuple[Tensor, Tensor]:
    """The run patched into (corrupt when denoising) and the run the patch comes from."""
    return (prompts.corrupt, prompts.clean) if direction == "denoise" else (prompts.clean, prompts.corrupt)


# ---- activation patching ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    layer: int
    head: int
    position: int | None  # None: every position (--positions all); else one position


def targets_of(heads: list[Head], positions: str, seq: int) -> list[Target]:
    """What is patched, one target a copy: each head at all positions, at the last, or at each position."""
    if positions == "each":
        return [Target(layer, head, p) for layer, head in heads for p in range(seq)]
    return [Target(layer, head, None) for layer, head in heads]


def patch_mask(targets: list[Target], prompts: Prompts, positions: str, parts: Parts) -> Tensor:
    """Per copy, where the source replaces the base: [copies, pairs, seq, heads] bool."""
    pairs, seq = prompts.mask.shape
    mask = torch.zeros(len(targets), pairs, seq, parts.heads, dtype=torch.bool, device=prompts.mask.device)
    for c, target in enumerate(targets):
        if positions == "last":
            mask[c, torch.arange(pairs), prompts.last, target.head] = True
        elif target.position is None:
            mask[c, :, :, target.head] = True
        else:
            mask[c, :, target.position, target.head] = True
    return mask  # [copies, pairs, seq, heads]


def replace_hook(parts: Parts, mask: Tensor, source: Tensor) -> Callable:
    """Pre-hook: where mask [rows, seq, heads] is True, the head's slice becomes source's [rows, seq, heads, dim]."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        split = split_heads(args[0], parts)  # [rows, seq, heads, head_dim]
        out = torch.where(mask[..., None], source.to(split.dtype), split)  # [rows, seq, heads, head_dim]
        return (out.flatten(-2), *args[1:])

    return hook


def group_size(prompts: Prompts) -> int:
    """Copies of the pairs in one batched pass: COPY_TOKENS positions."""
    return max(1, COPY_TOKENS // prompts.mask.numel())


@torch.inference_mode()
def activation_patching(
    loaded: LoadedModel, parts: Parts, prompts: Prompts, heads: list[Head], *, positions: str, kind: str,
    base: Prefix, source: Prefix, progress: Progress | None = None,
) -> tuple[list[Target], np.ndarray]:
    """The metric [pairs, target] with each target's source output patched into the base run (denoising: base =
    the corrupt run, source = the clean one; noising the other way)."""
    check_attention(loaded, base, source)
    seq = prompts.mask.shape[1]
    targets = targets_of(heads, positions, seq)
    pairs = prompts.last.shape[0]
    values = np.full((pairs, len(targets)), np.nan)
    size = group_size(prompts)
    done = 0
    for layer in sorted({t.layer for t in targets}):
        mine = [k for k, t in enumerate(targets) if t.layer == layer]
        for start in range(0, len(mine), size):
            chosen = mine[start : start + size]
            mask = patch_mask([targets[k] for k in chosen], prompts, positions, parts).flatten(0, 1)
            stacked = source.outputs[layer].repeat(len(chosen), 1, 1, 1)  # [copies * pairs, seq, heads, head_dim]
            with hooked([parts.projections[layer]], [replace_hook(parts, mask, stacked)]):
                final = run_suffix(parts, base, layer, len(chosen))  # [copies * pairs, seq, hidden]
            values[:, chosen] = metric(parts, prompts, final, kind).T.cpu().numpy()  # [pairs, copies]
            done += len(chosen)
            if progress:
                progress("activation patching", done, len(targets))
    if positions == "each":  # a position past a pair's end patches padding: no value
        where = np.array([t.position for t in targets])  # [target]
        values[where[None, :] > prompts.last.cpu().numpy()[:, None]] = np.nan
    return targets, values


# ---- attribution patching --------------------------------------------------------------------------------


def attribution_patching(
    loaded: LoadedModel, parts: Parts, prompts: Prompts, heads: list[Head], *, direction: str, positions: str,
    kind: str, source: Prefix, progress: Progress | None = None,
) -> tuple[list[Target], np.ndarray]:
    """The first-order estimate of the metric [pairs, target]: base metric + grad . (source - base), over each
    target's slice and positions; one base run with gradients and one backward pass."""
    base_ids, _ = base_and_source(prompts, direction)
    count = len(parts.blocks)
    deltas: list[Tensor] = []
    seen: list[Any] = [None] * count

    def hook(layer: int) -> Callable:
        def add(_module: nn.Module, args: tuple) -> tuple:
            seen[layer] = split_heads(args[0], parts).detach()  # [pairs, seq, heads, head_dim]
            zero = torch.zeros_like(args[0], requires_grad=True)  # [pairs, seq, heads * head_dim]
            deltas.append(zero)
            return (args[0] + zero, *args[1:])

        return add

    with torch.enable_grad(), hooked(parts.projections, [hook(i) for i in range(count)]):
        final = loaded.model(**forward_kwargs(loaded.model, base_ids, prompts.mask)).last_hidden_state
        value = metric(parts, prompts, final, kind)[0]  # [pairs]
        grads = torch.autograd.grad(value.sum(), deltas)  # per layer [pairs, seq, heads * head_dim]
    if progress:
        progress("attribution patching", 1, 1)
    per_layer = [(split_heads(g, parts).double() * (source.outputs[i].double() - seen[i].double())).sum(-1)
                 for i, g in enumerate(grads)]  # per layer [pairs, seq, heads]
    pairs, seq = prompts.mask.shape
    targets = targets_of(heads, positions, seq)
    base_value = value.detach().double()  # [pairs]
    real = prompts.mask.bool()  # [pairs, seq]
    out = torch.full((pairs, len(targets)), float("nan"), dtype=torch.float64)
    rows = torch.arange(pairs)
    for k, t in enumerate(targets):
        terms = per_layer[t.layer][..., t.head].cpu()  # [pairs, seq]
        if positions == "last":
            change = terms[rows, prompts.last.cpu()]  # [pairs]
        elif t.position is None:
            change = (terms * real.cpu()).sum(1)  # [pairs]
        else:
            change = torch.where(real[:, t.position].cpu(), terms[:, t.position], float("nan"))  # [pairs]
        out[:, k] = base_value.cpu() + change
    return targets, out.numpy()


# ---- path patching ---------------------------------------------------------------------------------------


def receivers_of(sender: Head, receivers: list[Head] | None, layers: int, heads: int) -> list[Head]:
    """The receivers of one sender: those given, or (None: all) every head of every later layer."""
    if receivers is None:
        return [(layer, head) for layer in range(sender[0] + 1, layers) for head in range(heads)]
    return list(receivers)


def freeze_hooks(parts: Parts, frozen: Prefix, source: Prefix, sender: Head) -> list[Callable]:
    """Pre-hooks on every layer's projection: every head's output is the frozen run's, the sender's the source's."""
    hooks = []
    for layer in range(len(parts.blocks)):
        value = frozen.outputs[layer].clone()  # [pairs, seq, heads, head_dim]
        if layer == sender[0]:
            value[:, :, sender[1]] = source.outputs[layer][:, :, sender[1]]
        mask = torch.ones(value.shape[:3], dtype=torch.bool, device=value.device)  # [pairs, seq, heads]
        hooks.append(replace_hook(parts, mask, value))
    return hooks


def qkv_slices(parts: Parts, layer: int, via: str, head: int) -> tuple[nn.Module, slice]:
    """The module whose output carries a receiver head's query, key or value, and the slice of it that is the
    head's (a key or value: its key/value head's, shared under grouped-query attention)."""
    maps = parts.qkv[layer]
    d, q_width, kv_width = parts.head_dim, parts.heads * parts.head_dim, parts.kv_heads * parts.head_dim
    norm = getattr(parts.attentions[layer], f"{via}_norm", None) if via in ("q", "k") else None
    if isinstance(norm, nn.Module) and getattr(getattr(norm, "weight", None), "shape", (0,))[0] > d:
        raise AttnprobeError(f"--via {via}: {type(parts.attentions[layer]).__name__}'s {via}_norm normalises every "
                             f"head's {'queries' if via == 'q' else 'keys'} together, so one head's cannot be patched "
                             "alone; use --via v or out")
    group = parts.heads // parts.kv_heads
    own = {"q": slice(head * d, (head + 1) * d),
           "k": slice((head // group) * d, (head // group + 1) * d),
           "v": slice((head // group) * d, (head // group + 1) * d)}
    widths = [module_width(m) for m in maps]
    if len(maps) >= 3 and widths[-3:] == [q_width, kv_width, kv_width]:
        return maps[-3 + "qkv".index(via)], own[via]
    if maps and widths[-1] == q_width + 2 * kv_width and hasattr(parts.attentions[layer], "split_size"):
        offset = {"q": 0, "k": q_width, "v": q_width + kv_width}[via]  # GPT-2's c_attn: [q | k | v]
        return maps[-1], slice(own[via].start + offset, own[via].stop + offset)
    raise AttnprobeError(f"--via {via}: {type(parts.attentions[layer]).__name__} computes its queries, keys and values "
                         "in a layout patching does not know; use --via out")


def module_width(module: nn.Module) -> int:
    """The width of a linear map's output (nn.Linear or GPT-2's Conv1D)."""
    weight = module.weight
    return module.out_features if isinstance(module, nn.Linear) else weight.shape[-1]


def path_receiver_hooks(
    parts: Parts, receivers: list[Head], via: str, store: dict, replace: bool
) -> tuple[list[nn.Module], list[Callable], bool]:
    """Hooks that record (replace=False) or put back (True) the receivers' q/k/v or output slices.
    Returns (modules, hooks, pre): pre-hooks on the projections for `out`, forward hooks on q/k/v maps otherwise."""
    modules, hooks = [], []
    by_layer: dict[int, list[int]] = {}
    for layer, head in receivers:
        by_layer.setdefault(layer, []).append(head)
    for layer, heads in sorted(by_layer.items()):
        if via == "out":
            modules.append(parts.projections[layer])
            hooks.append(out_slice_hook(parts, layer, heads, store, replace))
        else:
            found = {cut.start: (module, cut) for module, cut in (qkv_slices(parts, layer, via, h) for h in heads)}
            for module, cut in found.values():  # receivers that share a key/value head share its slice
                modules.append(module)
                hooks.append(qkv_slice_hook((layer, cut.start), cut, store, replace))
    return modules, hooks, via == "out"


def out_slice_hook(parts: Parts, layer: int, heads: list[int], store: dict, replace: bool) -> Callable:
    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        split = split_heads(args[0], parts)  # [pairs, seq, heads, head_dim]
        if not replace:
            store[layer] = split[:, :, heads].clone()  # [pairs, seq, chosen, head_dim]
            return None
        out = split.clone()  # [pairs, seq, heads, head_dim]
        out[:, :, heads] = store[layer].to(out.dtype)
        return (out.flatten(-2), *args[1:])

    return hook


def qkv_slice_hook(key: tuple[int, int], cut: slice, store: dict, replace: bool) -> Callable:
    def hook(_module: nn.Module, _args: tuple, output: Tensor) -> Tensor | None:
        if not replace:
            store[key] = output[..., cut].clone()  # [pairs, seq, head_dim]
            return None
        out = output.clone()  # [pairs, seq, width]
        out[..., cut] = store[key].to(out.dtype)
        return out

    return hook


@torch.inference_mode()
def path_patching(
    loaded: LoadedModel, parts: Parts, prompts: Prompts, senders: list[Head], receivers: list[Head] | None, *,
    direction: str, via: str, kind: str, base: Prefix, source: Prefix, progress: Progress | None = None,
) -> tuple[list[tuple[Head, list[Head]]], np.ndarray]:
    """Per sender, the metric [pairs, sender] with its source output reaching the receivers only through `via`:
    run 1 (base prompt, every head frozen at the base run but the sender) records the receivers' inputs, run 2 (the
    base run) takes them."""
    check_attention(loaded, base, source)
    base_ids, _ = base_and_source(prompts, direction)
    kwargs = forward_kwargs(loaded.model, base_ids, prompts.mask)
    rows, values = [], np.full((prompts.last.shape[0], len(senders)), np.nan)
    for k, sender in enumerate(senders):
        chosen = [r for r in receivers_of(sender, receivers, len(parts.blocks), parts.heads) if r[0] > sender[0]]
        rows.append((sender, chosen))
        if chosen:
            store: dict = {}
            modules, hooks, pre = path_receiver_hooks(parts, chosen, via, store, replace=False)
            with attached(modules, hooks, pre), hooked(parts.projections, freeze_hooks(parts, base, source, sender)):
                loaded.model(**kwargs)  # the recording hooks come first: they see the receivers' own outputs
            modules, hooks, pre = path_receiver_hooks(parts, chosen, via, store, replace=True)
            with attached(modules, hooks, pre):
                final = loaded.model(**kwargs).last_hidden_state  # [pairs, seq, hidden]
            values[:, k] = metric(parts, prompts, final, kind)[0].cpu().numpy()
        if progress:
            progress("path patching", k + 1, len(senders))
    return rows, values


@contextmanager
def attached(modules: list[nn.Module], hooks: list[Callable], pre: bool) -> Iterator[None]:
    """Forward pre-hooks (pre) or forward hooks on modules, for the duration (hooks on one module run in the order
    they were registered)."""
    if pre:
        with hooked(modules, hooks):
            yield
        return
    handles = [module.register_forward_hook(hook) for module, hook in zip(modules, hooks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---- effects and tables ----------------------------------------------------------------------------------


def effects(patched: np.ndarray, clean: np.ndarray, corrupt: np.ndarray, direction: str,
            weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Effect per target from the means over pairs (patched [pairs, target], clean and corrupt [pairs]) and its
    bootstrap interval from each resample's means (weights [resample, pairs]); and the mean patched metric. A target
    a pair does not have (NaN: a position past its end under --positions each) takes its clean and corrupt means
    over the pairs that have it, so that the three means are of the same pairs."""
    def ratio(p: np.ndarray, c: np.ndarray, r: np.ndarray) -> np.ndarray:  # each [target] or [resample, target]
        with np.errstate(invalid="ignore", divide="ignore"):
            return (p - r) / (c - r) if direction == "denoise" else (c - p) / (c - r)

    present = (~np.isnan(patched)).astype(float)  # [pairs, target]: a position past a pair's end has no value
    with np.errstate(invalid="ignore", divide="ignore"):
        count = present.sum(0)  # [target]
        mean_p = np.where(present > 0, patched, 0).sum(0) / count  # [target]
        mean_c, mean_r = clean @ present / count, corrupt @ present / count  # [target] each: the same pairs
        effect = ratio(mean_p, mean_c, mean_r)  # [target]
        w_p = weights @ present  # [resample, target]
        r_p = (weights @ np.where(present > 0, patched, 0)) / w_p  # [resample, target]
        r_c = (weights @ (present * clean[:, None])) / w_p  # [resample, target]
        r_r = (weights @ (present * corrupt[:, None])) / w_p  # [resample, target]
    low, high = interval(ratio(r_p, r_c, r_r))  # [target] each
    return effect, low, high, mean_p


def table_of(targets: list[Target], positions: str, values: dict[str, tuple]) -> pd.DataFrame:
    """patching.csv: layer, head[, position], then per method its effect, interval and mean metric."""
    frame = pd.DataFrame({"layer": [t.layer for t in targets], "head": [t.head for t in targets]})
    if positions == "each":
        frame["position"] = [t.position for t in targets]
    for prefix, (effect, low, high, mean) in values.items():
        frame[prefix] = effect
        frame[f"{prefix}_lo"], frame[f"{prefix}_hi"] = low, high
        frame["ld" if prefix == "effect" else f"{prefix}_ld"] = mean
    return frame


def check_settings(method: str, direction: str, positions: str, kind: str, via: str | None, resamples: int) -> None:
    for value, allowed, option in ((method, METHODS, "--method"), (direction, DIRECTIONS, "--direction"),
                                   (positions, POSITIONS, "--positions"), (kind, METRICS, "--metric")):
        if value not in allowed:
            raise AttnprobeError(f"{option} {value!r}: use one of {', '.join(allowed)}")
    if via is not None and via not in VIAS:
        raise AttnprobeError(f"--via {via!r}: use one of {', '.join(VIAS)}")
    if resamples < 1:
        raise AttnprobeError(f"--resamples {resamples}: give at least 1")


def check_heads(heads: list[Head] | None, layers: int, per_layer: int, option: str) -> list[Head]:
    from attnprobe import naming

    if heads is None:
        return [(layer, head) for layer in range(layers) for head in range(per_layer)]
    if not heads:
        raise AttnprobeError(f"{option} names no head: give e.g. L0H1,L2H3")
    naming.check_heads_exist(heads, layers, per_layer)
    return sorted(set(heads))


# ---- the whole run ---------------------------------------------------------------------------------------


def patch(
    loaded: LoadedModel, pairs: list[Pair], *, method: str = "activation", direction: str = "denoise",
    positions: str = "all", kind: str = "logit-diff", heads: list[Head] | None = None,
    senders: list[Head] | None = None, receivers: list[Head] | None = None, via: str | None = None,
    resamples: int = 1000, seed: int = 0, source: dict[str, Any] | None = None, progress: Progress | None = None,
) -> Patching:
    """Patch each head (or the senders' paths) over the pairs; the table of effects and the run's record."""
    check_settings(method, direction, positions, kind, via, resamples)
    started = time.perf_counter()
    parts = find_parts(loaded)
    prompts = tokenize_pairs(loaded, pairs)
    layers = len(parts.blocks)
    chosen = check_heads(heads, layers, parts.heads, "--heads")
    weights = poisson_weights(range(len(pairs)), resamples, seed)  # [resample, pairs]
    base_ids, source_ids = base_and_source(prompts, direction)
    with fast_attention(loaded.model), torch.inference_mode():
        base = run_prefix(loaded, parts, base_ids, prompts.mask)
        check_rerun(loaded, parts, base)
        other = run_prefix(loaded, parts, source_ids, prompts.mask)
        ends = {name: metric(parts, prompts, run.final, kind)[0].cpu().numpy() for name, run in
                (("base", base), ("source", other))}
    clean, corrupt = (ends["source"], ends["base"]) if direction == "denoise" else (ends["base"], ends["source"])
    values: dict[str, tuple] = {}
    extra: dict[str, Any] = {}
    with fast_attention(loaded.model):
        if method == "path":
            found = check_heads(senders, layers, parts.heads, "--senders")
            wanted = None if receivers is None else check_heads(receivers, layers, parts.heads, "--receivers")
            rows, patched = path_patching(loaded, parts, prompts, found, wanted, direction=direction, via=via or "out",
                                          kind=kind, base=base, source=other, progress=progress)
            table = path_table(rows, via or "out", effects(patched, clean, corrupt, direction, weights))
        else:
            targets: list[Target] = []
            if method in ("activation", "both"):
                targets, patched = activation_patching(loaded, parts, prompts, chosen, positions=positions,
                                                       kind=kind, base=base, source=other, progress=progress)
                values["effect"] = effects(patched, clean, corrupt, direction, weights)
            if method in ("attribution", "both"):
                targets, estimated = attribution_patching(loaded, parts, prompts, chosen, direction=direction,
                                                          positions=positions, kind=kind, source=other,
                                                          progress=progress)
                values["attribution"] = effects(estimated, clean, corrupt, direction, weights)
            table = table_of(targets, positions, values)
            if method == "both":
                extra = agreement(table)
    run = record(loaded, pairs, prompts, method=method, direction=direction, positions=positions, kind=kind,
                 heads=heads, senders=senders, receivers=receivers, via=via, resamples=resamples, seed=seed,
                 clean=clean, corrupt=corrupt, weights=weights, source=source)
    run.update(extra)
    run["wall_seconds"] = round(time.perf_counter() - started, 3)
    return Patching(table, run, {"clean": clean, "corrupt": corrupt})


def path_table(rows: list[tuple[Head, list[Head]]], via: str, values: tuple) -> pd.DataFrame:
    """patching.csv of path patching: one row per sender, with its receivers and --via."""
    effect, low, high, mean = values
    return pd.DataFrame({
        "layer": [s[0] for s, _ in rows], "head": [s[1] for s, _ in rows],
        "receivers": [" ".join(head_name(*r) for r in rec) for _, rec in rows], "via": via,
        "effect": effect, "effect_lo": low, "effect_hi": high, "ld": mean,
    })


def agreement(table: pd.DataFrame, shown: int = 5) -> dict[str, Any]:
    """Spearman's rank correlation of attribution with activation patching, and the targets where they differ most
    (attribution misses saturated heads: Kramar et al. 2024)."""
    gap = (table["attribution"] - table["effect"]).abs()
    worst = table.assign(gap=gap).sort_values("gap", ascending=False, kind="stable").head(shown)
    return {
        "spearman": spearman(table["attribution"].to_numpy(), table["effect"].to_numpy()),
        "disagreements": [{"head": head_name(int(r.layer), int(r.head)),
                           **({"position": int(r.position)} if "position" in table.columns else {}),
                           "effect": float(r.effect), "attribution": float(r.attribution)}
                          for r in worst.itertuples()],
    }


def record(
    loaded: LoadedModel, pairs: list[Pair], prompts: Prompts, *, method: str, direction: str, positions: str,
    kind: str, heads: list[Head] | None, senders: list[Head] | None, receivers: list[Head] | None,
    via: str | None, resamples: int, seed: int, clean: np.ndarray, corrupt: np.ndarray, weights: np.ndarray,
    source: dict[str, Any] | None,
) -> dict[str, Any]:
    """patch.json: what was patched, how, on what, and the clean and corrupt metric with their intervals."""
    from attnprobe.records import model_record, model_weights, versions

    def summary(values: np.ndarray) -> dict[str, Any]:
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample that drew no pair: NaN, skipped
            low, high = interval((weights @ values / weights.sum(1))[:, None])
        return {"mean": float(values.mean()), "ci_low": float(low[0]), "ci_high": float(high[0])}

    names = lambda given: "all" if given is None else [head_name(*h) for h in sorted(given)]  # noqa: E731
    return {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {**model_record(loaded), "weights_sha256": model_weights(loaded)},
        "pairs": {**(source or {"from": "caller"}), "count": len(pairs), "sha256": pairs_sha256(pairs),
                  "tokens": int(prompts.mask.sum())},
        "method": method, "direction": direction, "positions": positions if method != "path" else None,
        "metric": kind, "heads": names(heads) if method != "path" else None,
        "senders": names(senders) if method == "path" else None,
        "receivers": (names(receivers) if method == "path" else None), "via": via if method == "path" else None,
        "ld_clean": summary(clean), "ld_corrupt": summary(corrupt),
        "effect": ("(LD_patched - LD_corrupt) / (LD_clean - LD_corrupt)" if direction == "denoise" else
                   "(LD_clean - LD_patched) / (LD_clean - LD_corrupt)"),
        "bos": loaded.bos, "device": str(loaded.device), "dtype": loaded.dtype,
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "over": "pairs",
                      "method": "poisson", "of": "the ratio of the resample's means"},
        "notes": [note for note in (few_items_note(len(pairs), "pair"), gap_note(clean, corrupt)) if note],
        "versions": versions(),
    }


def gap_note(clean: np.ndarray, corrupt: np.ndarray) -> str | None:
    """A warning when the clean and corrupt metric hardly differ: every effect divides by their difference."""
    if abs(clean.mean() - corrupt.mean()) < 0.1:
        return (f"the clean and corrupt metric differ by only {clean.mean() - corrupt.mean():+.3f}: the effects "
                "divide by it and are unreliable; choose pairs the model answers differently")
    return None
