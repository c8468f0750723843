"""Trained head patterns: DuoAttention's optimization (Xiao et al. 2024, section 3) for any decoder attnprobe runs.

A gate alpha in [0, 1] per KV head, initialised at 1, mixes each of its query heads' attention outputs:
alpha x full + (1 - alpha) x streaming, streaming being the head restricted to the first `sink` and the last `recent`
keys at every position (DuoAttention's training mask: streamheads.kept with no context). The model's weights are
frozen; only the gates learn, by AdamW on

    loss = mean over the supervised tokens of mean over the hidden units of (h_full - h_gated)^2
           + reg_weight x mean gate

h the base model's last hidden state (after its final norm), h_full the model's own (every gate at 1, computed once
per sample without gradients), on DuoAttention's multi-passkey samples (passkeys.py); the gates are clipped to
[0, 1] after every step. A layer that already attends within a sliding window keeps its own attention and gets no
gate (its cache is bounded already); its KV heads are reported at 1.

The gated attention is registered with transformers' AttentionInterface (`attnprobe_gated`): eager attention in
blocks of query rows as streamheads.attend computes it (its block_scores, hide, softmax and
block_output), both branches from one block of scores, each block under torch.utils.checkpoint so that no block's
weights are kept for the backward pass (no [n, n] map exists), and every decoder layer under activation
checkpointing too. At alpha = 1 a head's output is the model's (streamheads with no head streaming) bit for bit, at
alpha = 0 the streaming head of `ablate --method streaming --client duo-attention` bit for bit; gates, mix and loss
are float32 for every model dtype.

DuoAttention's defaults and where they come from (mit-han-lab/duo-attention at fe93c31): learning rate 0.02 and
penalty weight 0.05 (scripts/run_train.sh, as every pattern it published records in its config.json), AdamW with
weight decay 0 (duo_attn/train.py), the learning rate warmed up over the first fifth of the steps and cooled down over
the last fifth, never below a tenth (train.py's LambdaLR), sink 128 and recent 256 tokens (scripts/train.sh), batch
size 1, 10 passkeys of 32 words at depths 0.05 to 0.95 (train.sh, data.py), gates initialised at 1 (utils.py
--initial_value), seed 42 (utils.py), 2000 steps on contexts from 1,000 to 32,000 tokens (train.sh). attnprobe keeps
the method and the optimizer; its default data are smaller (DEFAULT_*), so that the default run on SmolLM2-135M fits
20 minutes on two CPU cores: docs/kv-cache.md, "Train a pattern".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe import defaults, io, passkeys
from attnprobe.errors import AttnprobeError, plain
from attnprobe.model import LoadedModel, attention_modules, forward_kwargs, using_attention
from attnprobe.threads import recorded_threads

NAME = "attnprobe_gated"
DUO_LR, DUO_REG_WEIGHT, DUO_STEPS = defaults.DUO_LR, defaults.DUO_REG_WEIGHT, defaults.DUO_STEPS
DUO_PASSKEYS, DUO_PASSKEY_WORDS = defaults.DUO_PASSKEYS, defaults.DUO_PASSKEY_WORDS
DUO_SINK, DUO_RECENT, DUO_SEED = defaults.DUO_SINK, defaults.DUO_RECENT, defaults.DUO_SEED
DUO_LENGTHS = "50 evenly spaced from 1,000 to 32,000 haystack tokens"
# attnprobe's defaults: DuoAttention's method at a size a CPU trains SmolLM2-135M in 20 minutes
DEFAULT_LENGTHS, DEFAULT_STEPS = defaults.TRAIN_LENGTHS, defaults.TRAIN_STEPS
DEFAULT_PASSKEYS, DEFAULT_PASSKEY_WORDS = defaults.TRAIN_PASSKEYS, defaults.TRAIN_PASSKEY_WORDS
DEFAULT_CHECKPOINT_EVERY = defaults.TRAIN_CHECKPOINT_EVERY
HALF = 0.5  # training.csv's below_half: the share of gates below it (DuoAttention's --threshold)
MAX_STEPS = 1_000_000
GATES_FILE, RUN_FILE = io.TRAINED_GATES_FILE, io.TRAINED_RUN_FILE  # what `attnprobe export` reads
LOG_FILE, FIGURE_FILE = io.TRAINED_LOG_FILE, io.TRAINED_FIGURE
COMMAND = "attnprobe train-pattern"
Progress = Callable[[int, int, dict[str, float]], None]  # (steps done, steps in all, the last step's row)


@dataclass(frozen=True)
class Settings:
    """Everything that decides a trained pattern (train_pattern.json's `settings`)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    steps: int = DEFAULT_STEPS
    lr: float = DUO_LR
    reg_weight: float = DUO_REG_WEIGHT
    sink: int = DUO_SINK
    recent: int = DUO_RECENT
    passkeys: int = DEFAULT_PASSKEYS
    passkey_words: int = DEFAULT_PASSKEY_WORDS
    seed: int = DUO_SEED
    budget_mib: float = defaults.BLOCK_MIB  # memory for one block of query rows of the blocked attention

    def check(self) -> None:
        """Each setting in range, in one line naming it."""
        from attnprobe import limits, streamheads

        if self.steps < 1:
            raise AttnprobeError(f"--steps {self.steps}: train at least 1 step (DuoAttention trains {DUO_STEPS})")
        limits.check_whole("--steps", self.steps, 1, MAX_STEPS, DEFAULT_STEPS)
        limits.check_real("--lr", self.lr, 0.0, 10.0, DUO_LR, low_open=True)
        limits.check_real("--reg-weight", self.reg_weight, 0.0, 1e6, DUO_REG_WEIGHT)
        streamheads.check_sizes(self.sink, self.recent)
        limits.check_whole("--passkeys", self.passkeys, 1, len(passkeys.ORDINALS), DEFAULT_PASSKEYS)
        limits.check_whole("--passkey-words", self.passkey_words, 1, 10_000, DEFAULT_PASSKEY_WORDS)
        limits.check_whole("--seed", self.seed, 0, limits.MAX_SEED, DUO_SEED)
        limits.check_real("--block-mib", self.budget_mib, 0.0, limits.MAX_BLOCK_MIB, defaults.BLOCK_MIB, low_open=True)
        if not self.lengths:
            raise AttnprobeError("--lengths names no length: give e.g. 1024,1280 (tokens per sample)")
        for length in self.lengths:
            limits.check_whole("--lengths", length, 1, limits.MAX_POSITIONS, ",".join(map(str, DEFAULT_LENGTHS)))
            if length <= self.sink + self.recent:
                raise AttnprobeError(f"--lengths {length} is not longer than --sink-size {self.sink} + --recent-size "
                                     f"{self.recent} = {self.sink + self.recent}: a streaming head would see every "
                                     "key, so nothing would be learned; use lengths above "
                                     f"{self.sink + self.recent}, or smaller sizes")


@dataclass
class TrainedPattern:
    gates: pd.DataFrame  # gates.csv: layer, kv_head, gate, trained
    log: pd.DataFrame  # training.csv: one row per step
    run: dict[str, Any]  # train_pattern.json


# ---- the gated attention ---------------------------------------------------------------------------------


@dataclass
class GatePlan:
    """What the gated attention needs while a forward pass runs."""

    layers: dict[int, int]  # id(attention module) -> layer index
    gates: Tensor  # [gated layer, kv head] float32: alpha per KV head of each gated layer (1 full, 0 streaming)
    rows: dict[int, int]  # layer -> its row of `gates` (a layer absent: no gate, its own attention)
    sink: int
    recent: int
    budget_bytes: int
    spans: dict[int, int | None] = field(default_factory=dict)  # per layer seen: its own window (None: all keys)


# The plans of the gating contexts open now, innermost last. A process-wide list, not a ContextVar: on CUDA the
# backward pass (and with it each checkpointed block's recomputation) runs on autograd's own device thread, which
# sees no context variable of the thread that opened `gating`.
_ACTIVE: list[GatePlan] = []


def gated_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """The AttentionInterface function: eager attention, each gated layer's heads mixed with their streaming
    selves by their KV head's gate; (output [batch, query, head, dim], None)."""
    from attnprobe import kernel, streamheads

    plan = _ACTIVE[-1] if _ACTIVE else None
    if plan is None:
        raise AttnprobeError("attnprobe's gated attention runs only inside attnprobe.trainpattern.gating")
    problems: list[str] = []
    features, sinks = kernel.layer_features(module, query, key, attention_mask, scaling, dropout, kwargs, problems)
    if problems:
        raise AttnprobeError(f"train-pattern cannot gate this model's attention: it does not implement {problems[0]}; "
                             "use a model whose attention is causal, with or without a sliding window")
    if not features.causal:
        raise AttnprobeError("a trained pattern is a decoder's (a KV cache): this attention is bidirectional")
    layer = plan.layers[id(module)]
    plan.spans[layer] = features.span
    real = attention_mask.bool()  # [batch, key]: stats_mask's padding mask
    row = plan.rows.get(layer)
    if row is None or features.span is not None:
        if row is not None:
            raise AttnprobeError(f"layer {layer} attends within a window of {features.span} keys but was given "
                                 "gates: train the pattern again (the model changed)")
        none = torch.zeros(1, query.shape[1], dtype=torch.bool, device=query.device)  # [1, head]
        output = streamheads.attend(query, key, value, real, features.scale, none, plan.sink, plan.recent,
                                    plan.budget_bytes, span=features.span, softcap=features.softcap, sinks=sinks)
        return output, None
    alpha = streamheads.pool(plan.gates[row], features.groups)  # [head] float32
    output = gated_attend(query, key, value, real, features.scale, alpha, plan.sink, plan.recent, plan.budget_bytes,
                          features.softcap, sinks)
    return output, None


def gated_attend(query: Tensor, key: Tensor, value: Tensor, real: Tensor, scale: float, alpha: Tensor, sink: int,
                 recent: int, budget_bytes: int, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """alpha x full + (1 - alpha) x streaming attention per query head, block by block of query rows: output
    [batch, query, head, dim]. query [batch, head, n, dim], key and value [batch, kv head, n, dim], real [batch, key],
    alpha [head] float32. Blocks as streamheads.attend cuts them; while gradients are recorded each block runs under
    torch.utils.checkpoint (recomputed in the backward pass: only its inputs are kept)."""
    from torch.utils.checkpoint import checkpoint

    from attnprobe import kernel, streamheads

    batch, heads, n, dim = query.shape
    keys_t = key.transpose(-1, -2)  # [batch, kv head, dim, key]: a view
    sink_logits = None if sinks is None else sinks.float().view(1, heads, 1, 1)  # [1, head, 1, 1]
    a = alpha.view(1, heads, 1, 1)  # [1, head, 1, 1]
    padded = None if bool(real.all()) else ~real[:, None, None, :]  # [batch, 1, 1, key]
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, alpha))
    blocks = []
    for q0, q1 in streamheads.blocks(batch, heads, n, budget_bytes, None):  # the blocks streamheads.attend runs
        k0, k1 = kernel.block_keys(q0, q1, n, True, None)
        args = (query, keys_t, value, padded, a, sink_logits, q0, q1, k0, k1, scale, softcap, sink, recent)
        out = checkpoint(gated_block, *args, use_reentrant=False, preserve_rng_state=False) if recording \
            else gated_block(*args)  # [batch, head, r, dim]
        blocks.append(out)
    return torch.cat(blocks, dim=2).transpose(1, 2)  # [batch, query, head, dim]


def gated_block(query: Tensor, keys_t: Tensor, value: Tensor, padded: Tensor | None, a: Tensor,
                sink_logits: Tensor | None, q0: int, q1: int, k0: int, k1: int, scale: float,
                softcap: float | None, sink: int, recent: int) -> Tensor:
    """One block of query rows [q0, q1): the full and the streaming attention weights from the same scores (padded
    [batch, 1, 1, key] or None hides padding, as in streamheads.attend), mixed by a [1, head, 1, 1] in float32
    (float64 where the gates or the model are) and applied to the values in their dtype: [batch, head, r, dim].
    Mixing the weights, a x P_full + (1 - a) x P_streaming, is mixing the outputs (the values are linear in them)
    at one product with the values instead of two; at a = 1 (or 0) the mixed weights are P_full (or P_streaming)
    exactly (torch.lerp computes end - (end - start)(1 - a) for a >= 0.5, start + a (end - start) below), so the
    output is streamheads.attend's bit for bit."""
    from attnprobe import streamheads as sh

    scores = sh.block_scores(query, keys_t, q0, q1, k0, k1, scale, softcap)  # [batch, head, r, keys]
    heads = scores.shape[1]
    full, stream = scores, scores.clone()  # [batch, head, r, keys] each
    sh.hide(full, q0, k0, None, padded, [(0, heads, False)], sink, recent)  # causal and padding
    sh.hide(stream, q0, k0, None, padded, [(0, heads, True)], sink, recent)  # and what `kept` drops
    full = sh.softmax(full, sink_logits)  # [batch, head, r, keys]
    stream = sh.softmax(stream, sink_logits)  # [batch, head, r, keys]
    wide = torch.promote_types(full.dtype, a.dtype)  # float32, or float64
    mixed = torch.lerp(stream.to(wide), full.to(wide), a.to(wide))  # [batch, head, r, keys]: a full + (1 - a) stream
    return sh.block_output(mixed, value, k0, k1)  # [batch, head, r, dim]


@contextmanager
def gating(loaded: LoadedModel, gates: Tensor, rows: dict[int, int], sink: int, recent: int,
           budget_mib: float = defaults.BLOCK_MIB) -> Iterator[GatePlan]:
    """Run `loaded.model` with the gated attention: layer l's KV heads mixed by gates[rows[l]] (a layer not in
    `rows` runs its own attention); the model's attention is put back afterwards. Yields the plan, whose `spans`
    records each layer's own window as the layers run."""
    from attnprobe import kernel

    layers = {id(module): layer for layer, (module, _) in enumerate(attention_modules(loaded.model))}
    plan = GatePlan(layers, gates, dict(rows), int(sink), int(recent), int(budget_mib * 2**20))
    _ACTIVE.append(plan)
    try:
        with using_attention(loaded.model, NAME, gated_attention, kernel.stats_mask):
            yield plan
    except kernel.Unsupported as err:  # from the mask function: a KV cache, a chunked or custom mask
        raise AttnprobeError(f"train-pattern cannot gate this model's attention: it does not implement "
                             f"{err.feature}; use a model whose attention is causal, with or without a sliding "
                             "window") from None
    finally:
        _ACTIVE.remove(plan)


def decoder_layers(loaded: LoadedModel) -> list[nn.Module]:
    """The decoder layers (the blocks holding each attention module), in order."""
    from attnprobe.ablate import block_name

    names = {id(module): name for name, module in loaded.model.named_modules()}
    return [loaded.model.get_submodule(block_name(names[id(module)])) for module, _ in
            attention_modules(loaded.model)]


@contextmanager
def checkpointed(layers: list[nn.Module]) -> Iterator[None]:
    """Activation checkpointing per decoder layer for the duration: each layer keeps only its inputs for the
    backward pass and runs again there (torch.utils.checkpoint, non-reentrant). The model stays in eval mode (no
    dropout), unlike transformers' gradient_checkpointing_enable, which acts only in training mode."""
    from torch.utils.checkpoint import checkpoint

    def wrapped(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    own = [layer.__dict__.get("forward") for layer in layers]  # a forward set on the instance (accelerate's hooks)
    for layer in layers:
        layer.forward = partial(wrapped, layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward


def last_hidden(loaded: LoadedModel, ids: Tensor) -> Tensor:
    """The base model's last hidden state [1, n, hidden] of ids [1, n]."""
    return loaded.model(**forward_kwargs(loaded.model, ids, torch.ones_like(ids))).last_hidden_state


# ---- which layers get gates --------------------------------------------------------------------------------


def check_model(loaded: LoadedModel) -> None:
    """A decoder whose attention runs through transformers' AttentionInterface."""
    from attnprobe import streamheads

    streamheads.check_decoder(loaded, "so there is no pattern to train; use a decoder", "train-pattern cannot gate")


def layer_spans(loaded: LoadedModel, sink: int, recent: int) -> list[int | None]:
    """Each layer's own window (None: it sees every earlier key), from a two-token pass through the gated
    attention: what the model hands each attention call. Refuses, in one line, a model it cannot run."""
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = torch.tensor([[1 % vocab, 2 % vocab]], device=loaded.device)  # [1, 2]
    gates = torch.ones(0, loaded.num_kv_heads, device=loaded.device)  # no gate: every layer its own attention
    with torch.no_grad(), gating(loaded, gates, {}, sink, recent) as plan:
        last_hidden(loaded, ids)
    missing = [layer for layer in range(loaded.num_layers) if layer not in plan.spans]
    if missing:
        raise AttnprobeError(f"train-pattern cannot gate {loaded.spec}: layer {missing[0]}'s attention did not run "
                             "through transformers' AttentionInterface; use another decoder")
    return [plan.spans[layer] for layer in range(loaded.num_layers)]


# ---- training --------------------------------------------------------------------------------------------


def lr_factor(step: int, steps: int) -> float:
    """DuoAttention's schedule (train.py's LambdaLR) at step `step` (0-based) of `steps`: warm-up over the first
    fifth, cool-down over the last fifth, never below 0.1. DuoAttention divides by steps // 5 (zero below 5
    steps); here by at least 1."""
    fifth = max(1, steps // 5)
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


@dataclass
class State:
    """Where a training run is after `done` steps: what a checkpoint holds."""

    fingerprint: dict[str, Any]
    done: int  # steps finished
    gates: np.ndarray  # [gated layer, kv head] float32
    exp_avg: np.ndarray  # AdamW's first moment, like gates
    exp_avg_sq: np.ndarray  # and its second
    rows: np.ndarray  # [done, LOG_COLUMNS] float64: training.csv's rows so far
    path: str | None = None
    threads: int = 0  # the torch threads the run used (threads.resumed_threads); 0: not recorded
    seconds: float | None = None  # wall seconds the training ran until this state, all its parts; None: not recorded

    def to_arrays(self) -> dict[str, np.ndarray]:
        meta = json.dumps({"fingerprint": self.fingerprint, "done": self.done, "command": COMMAND,
                           "threads": self.threads, "seconds": self.seconds})
        return {"meta": np.array(meta), "gates": self.gates, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "rows": self.rows}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], path: str | None = None) -> State:
        """The state `to_arrays` saved; ValueError naming the first field missing or not as saved."""
        needed = ("meta", "gates", "exp_avg", "exp_avg_sq", "rows")
        odd = [name for name in needed if name not in arrays] + sorted(set(arrays) - set(needed))
        if odd:
            raise ValueError(f"it is not a train-pattern checkpoint ({odd[0]})")
        meta_array = arrays["meta"]
        if meta_array.shape != () or meta_array.dtype.kind != "U":
            raise ValueError("no meta record")
        try:
            meta = json.loads(str(meta_array))
        except (ValueError, RecursionError):
            raise ValueError("its meta record is not the JSON attnprobe writes") from None
        if not isinstance(meta, dict) or meta.get("command") != COMMAND or not isinstance(meta.get("fingerprint"),
                                                                                          dict):
            raise ValueError(f"it is not a checkpoint of `{COMMAND}`")
        done = meta.get("done")
        if not isinstance(done, int) or isinstance(done, bool) or done < 1:
            raise ValueError(f"done = {plain(done)} is not a whole number of steps of at least 1")
        threads = recorded_threads(meta)
        seconds = meta.get("seconds")
        if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                    or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"seconds = {plain(seconds)} is not a number of seconds of 0 or more")
        gates = arrays["gates"]
        for name in ("gates", "exp_avg", "exp_avg_sq"):
            value = arrays[name]
            if value.dtype != np.float32 or value.ndim != 2 or value.shape != gates.shape \
                    or not np.isfinite(value).all():
                raise ValueError(f"{name} is not a finite float32 [layer, kv head] array like the gates")
        if ((gates < 0) | (gates > 1)).any() or (arrays["exp_avg_sq"] < 0).any():
            raise ValueError("a gate outside [0, 1] or a negative second moment")
        rows = arrays["rows"]
        if rows.dtype != np.float64 or rows.shape != (done, len(LOG_COLUMNS)) or not np.isfinite(rows).all():
            raise ValueError(f"its training rows are not {done} rows of {len(LOG_COLUMNS)} finite numbers")
        return cls(meta["fingerprint"], done, gates, arrays["exp_avg"], arrays["exp_avg_sq"], rows, path, threads,
                   None if seconds is None else float(seconds))


LOG_COLUMNS = ("step", "length", "distill_loss", "penalty", "loss", "mean_gate", "below_half", "lr")


@dataclass
class Checkpointing:
    """How a run saves (`save`, every `every` steps) and resumes (`resume_from`)."""

    save: Callable[[State], None]
    every: int = DEFAULT_CHECKPOINT_EVERY
    resume_from: State | None = None
    should_stop: Callable[[], bool] = lambda: False
    on_resumed: Callable[[int, int], None] | None = None  # told (steps done, steps) once resume_from is restored


class Stopped(AttnprobeError):
    """The run was asked to stop (Ctrl-C, SIGTERM); a checkpoint of every finished step was saved."""


def fingerprint(loaded: LoadedModel, settings: Settings, haystack_sha256: str) -> dict[str, Any]:
    """Everything that decides the gates: a checkpoint resumes only the same run."""
    from attnprobe import __version__
    from attnprobe.records import model_tokenizer, model_weights

    return {"model": loaded.source, "model_sha256": model_weights(loaded), "tokenizer_sha256": model_tokenizer(loaded),
            "dtype": loaded.dtype, "device": loaded.device.type, "bos": loaded.bos, "haystack_sha256": haystack_sha256,
            "version": __version__, **{k: (",".join(map(str, v)) if isinstance(v, tuple) else v)
                                       for k, v in asdict(settings).items()}}


def train_pattern_loaded(loaded: LoadedModel, haystack: str, settings: Settings = Settings(), *,
                         haystack_name: str = "the haystack", progress: Progress | None = None,
                         checkpointing: Checkpointing | None = None,
                         samples: Callable[[int], passkeys.Sample] | None = None) -> TrainedPattern:
    """Train one gate per KV head of `loaded` (a decoder) on DuoAttention's multi-passkey samples drawn from
    `haystack`; returns the gates, the per-step log and the run's record. Checkpoints through `checkpointing`.
    `samples`: step -> Sample, other samples in place of the passkeys' (a test's task; `haystack` is then only
    fingerprinted)."""
    import hashlib

    from attnprobe import resume

    started = time.perf_counter()
    settings.check()
    check_model(loaded)
    too_long = [n for n in settings.lengths if n > loaded.max_length]
    if too_long:
        raise AttnprobeError(f"--lengths {too_long[0]} is longer than {loaded.spec}'s context of "
                             f"{loaded.max_length:,} tokens: use lengths up to {loaded.max_length:,}")
    samples = samples or passkey_samples(loaded, haystack, settings, haystack_name)
    spans = layer_spans(loaded, settings.sink, settings.recent)
    gated = [layer for layer, span in enumerate(spans) if span is None]
    if not gated:
        raise AttnprobeError(f"every layer of {loaded.spec} attends within a sliding window already: its KV cache "
                             "is bounded, there is no pattern to train")
    rows = {layer: k for k, layer in enumerate(gated)}
    hay_sha = hashlib.sha256(haystack.encode("utf-8")).hexdigest()
    finger = fingerprint(loaded, settings, hay_sha)
    gates = nn.Parameter(torch.ones(len(gated), loaded.num_kv_heads, dtype=torch.float32, device=loaded.device))
    optimizer = torch.optim.AdamW([gates], lr=settings.lr, weight_decay=0.0, foreach=False)
    log: list[list[float]] = []
    first, earlier = 0, 0.0  # steps and wall seconds of the stopped run's parts
    if checkpointing is not None and checkpointing.resume_from is not None:
        state = checkpointing.resume_from
        resume.check_fingerprint(state.fingerprint, finger)
        first, earlier = restore(state, gates, optimizer, settings.steps), state.seconds
        log = [list(row) for row in state.rows]
        if checkpointing.on_resumed is not None:
            checkpointing.on_resumed(first, settings.steps)

    def elapsed() -> float | None:
        """Wall seconds of the whole training so far (None after a checkpoint that did not record its own)."""
        return None if earlier is None else earlier + time.perf_counter() - started

    with frozen(loaded.model):
        run_steps(loaded, settings, samples, gates, rows, optimizer, log, first, finger, progress, checkpointing,
                  elapsed)
    return result(loaded, settings, spans, gated, gates.detach().cpu().numpy(), log, haystack_name, hay_sha, finger,
                  Timing(time.perf_counter() - started, elapsed()), first)


def passkey_samples(loaded: LoadedModel, haystack: str, settings: Settings,
                    haystack_name: str) -> Callable[[int], passkeys.Sample]:
    """step -> DuoAttention's multi-passkey sample of that step, the haystack checked long enough first."""
    from attnprobe.probe import special_frame

    prefix, _ = special_frame(loaded)  # the BOS token under --bos, as retrieval's prompts begin
    parts = passkeys.pieces(loaded.tokenizer, prefix, haystack, max(settings.lengths), settings.passkeys)
    passkeys.check_lengths(parts, settings.lengths, settings.passkey_words, haystack_name)
    return partial(passkeys.sample_at, parts, settings.lengths, settings.passkey_words, settings.seed)


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """The model's weights without gradients (no gradient, no optimizer state for them) for the duration; each
    parameter's requires_grad is put back afterwards."""
    parameters = list(model.parameters())
    before = [parameter.requires_grad for parameter in parameters]
    for parameter in parameters:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter, wanted in zip(parameters, before):
            parameter.requires_grad_(wanted)


def run_steps(loaded: LoadedModel, settings: Settings, samples: Callable[[int], passkeys.Sample],
              gates: nn.Parameter, rows: dict[int, int], optimizer: torch.optim.Optimizer, log: list[list[float]],
              first: int, finger: dict[str, Any], progress: Progress | None,
              checkpointing: Checkpointing | None, elapsed: Callable[[], float | None] = lambda: None) -> None:
    """Steps `first` to settings.steps - 1, appending each step's row to `log`; checkpoints every
    `checkpointing.every` steps, and on a stop request (Stopped) or a loss that is not a number (the last good
    state saved, AttnprobeError naming the step)."""
    layers = decoder_layers(loaded)
    last_saved = first
    for step in range(first, settings.steps):
        if checkpointing is not None and step > first and checkpointing.should_stop():
            if step > last_saved:
                checkpointing.save(snapshot(finger, step, gates, optimizer, log, elapsed()))
            raise Stopped(f"stopped after {step} of {settings.steps} steps")
        row = train_step(loaded, layers, gates, rows, optimizer, samples(step), settings, step)
        if not all(math.isfinite(v) for v in row):
            if checkpointing is not None and step > last_saved:
                checkpointing.save(snapshot(finger, step, gates, optimizer, log, elapsed()))
                last_saved = step
            kept = f" (the checkpoint of step {last_saved}, the last good one, is kept)" \
                if checkpointing is not None and last_saved else ""
            raise AttnprobeError(f"the loss is not a number (NaN or infinite) at step {step + 1}: training stopped "
                                 f"there{kept}; lower --lr, or use --dtype float32, and run again")
        log.append(row)
        if progress is not None:
            progress(step + 1, settings.steps, dict(zip(LOG_COLUMNS, row)))
        if checkpointing is not None and (step + 1) % checkpointing.every == 0 and step + 1 < settings.steps:
            checkpointing.save(snapshot(finger, step + 1, gates, optimizer, log, elapsed()))
            last_saved = step + 1


def full_hidden(loaded: LoadedModel, ids: Tensor, span: Tensor, settings: Settings) -> Tensor:
    """The model's own last hidden states [span, hidden] (float32, or float64 for a float64 model) at the
    supervised positions span [n] of ids [1, n], without gradients: every KV head full, through the same blocked
    attention the gated pass runs (streamheads with no head streaming), so that at gates of 1 the loss is 0
    exactly."""
    from attnprobe import streamheads

    none = np.zeros((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    with torch.no_grad(), streamheads.streaming(loaded, none, settings.sink, settings.recent, settings.budget_mib):
        hidden = last_hidden(loaded, ids)[0, span]  # [span, hidden]
    return hidden.to(torch.promote_types(hidden.dtype, torch.float32))


def loss_terms(loaded: LoadedModel, gates: Tensor, ids: Tensor, span: Tensor, full: Tensor,
               reg_weight: float) -> tuple[Tensor, Tensor]:
    """DuoAttention's two terms at `gates` [gated layer, kv head]: the mean over the supervised positions span [n]
    of ids [1, n] of the mean over the hidden units of (full - gated)^2, full from `full_hidden`, and reg_weight x
    the mean gate (DuoAttention's l1_loss of gates in [0, 1]). Run it, and `.backward()` on the sum, inside one
    `gating(loaded, gates, ...)`: the checkpointed blocks (and layers) run again in the backward pass."""
    mixed = last_hidden(loaded, ids)[0, span]  # [span, hidden]
    distill = (full - mixed.to(full.dtype)).square().mean(-1).mean()
    return distill, reg_weight * gates.mean()


def train_step(loaded: LoadedModel, layers: list[nn.Module], gates: nn.Parameter, rows: dict[int, int],
               optimizer: torch.optim.Optimizer, sample: passkeys.Sample, settings: Settings, step: int) -> list[float]:
    """One step on one sample: the full model's hidden states (no gradients), the gated pass, the loss, AdamW at
    DuoAttention's scheduled learning rate, the gates clipped to [0, 1]. Returns training.csv's row; the gates are
    left as they were when the loss or its gradient is not finite (the row then holds NaN)."""
    ids = torch.as_tensor(sample.ids, device=loaded.device)[None]  # [1, n]
    span = torch.as_tensor(sample.span, device=loaded.device)  # [n]
    full = full_hidden(loaded, ids, span, settings)  # [span, hidden]
    lr = settings.lr * lr_factor(step, settings.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad(), gating(loaded, gates, rows, settings.sink, settings.recent, settings.budget_mib), \
            checkpointed(layers):
        distill, penalty = loss_terms(loaded, gates, ids, span, full, settings.reg_weight)
        loss = distill + penalty
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
            finite = bool(torch.isfinite(gates.grad).all())
    values = [float(distill.detach()), float(penalty.detach()), float(loss.detach())]
    if not finite:
        return [float(step + 1), float(len(sample.ids)), *values, math.nan, math.nan, lr]
    optimizer.step()
    with torch.no_grad():
        gates.clamp_(0.0, 1.0)
    now = gates.detach()
    return [float(step + 1), float(len(sample.ids)), *values, float(now.double().mean()),
            float((now < HALF).double().mean()), lr]


def snapshot(finger: dict[str, Any], done: int, gates: nn.Parameter, optimizer: torch.optim.Optimizer,
             log: list[list[float]], seconds: float | None = None) -> State:
    """The state after `done` steps, `seconds` into the training (all its parts), for a checkpoint."""
    state = optimizer.state.get(gates, {})
    zeros = np.zeros(tuple(gates.shape), dtype=np.float32)

    def moment(name: str) -> np.ndarray:
        return state[name].detach().cpu().numpy().astype(np.float32) if name in state else zeros

    return State(finger, done, gates.detach().cpu().numpy().astype(np.float32), moment("exp_avg"),
                 moment("exp_avg_sq"), np.asarray(log, dtype=np.float64).reshape(done, len(LOG_COLUMNS)),
                 threads=torch.get_num_threads(), seconds=seconds)


def restore(state: State, gates: nn.Parameter, optimizer: torch.optim.Optimizer, steps: int) -> int:
    """Put a checkpoint's gates and AdamW moments back; returns the steps already done."""
    if state.done >= steps:
        raise state_error(state, f"it has {state.done} steps done, this run trains {steps}")
    if tuple(state.gates.shape) != tuple(gates.shape):
        raise state_error(state, f"its gates are {state.gates.shape[0]} layers x {state.gates.shape[1]} KV heads, "
                                 f"this model's {gates.shape[0]} x {gates.shape[1]}")
    if not np.array_equal(state.rows[:, 0], np.arange(1, state.done + 1)):
        raise state_error(state, "its training rows are not steps 1 to done in order")
    with torch.no_grad():
        gates.copy_(torch.from_numpy(state.gates))
    device = gates.device
    optimizer.state[gates] = {"step": torch.tensor(float(state.done)),
                              "exp_avg": torch.from_numpy(state.exp_avg.copy()).to(device),
                              "exp_avg_sq": torch.from_numpy(state.exp_avg_sq.copy()).to(device)}
    return state.done


def state_error(state: State, problem: str) -> AttnprobeError:
    return AttnprobeError(f"{state.path or 'the checkpoint'}: {problem}: delete it and run without --resume")


# ---- results ---------------------------------------------------------------------------------------------


def gates_table(layers: int, kv_heads: int, gated: list[int], trained: np.ndarray) -> pd.DataFrame:
    """gates.csv: every KV head of every layer, its gate (1 for a layer with no gate) and whether it was trained."""
    table = np.ones((layers, kv_heads))  # [layer, kv head]
    table[gated] = trained.astype(np.float64)
    has = np.zeros(layers, dtype=bool)
    has[gated] = True
    layer, head = np.divmod(np.arange(layers * kv_heads), kv_heads)
    return pd.DataFrame({"layer": layer, "kv_head": head, "gate": table.reshape(-1), "trained": has[layer]})


@dataclass(frozen=True)
class Timing:
    """The wall time of a training: this process's part and the whole (the earlier parts of a resumed run until its
    checkpoint, and this one; None where the checkpoint did not record its own)."""

    this_part: float
    whole: float | None


def result(loaded: LoadedModel, settings: Settings, spans: list[int | None], gated: list[int], trained: np.ndarray,
           log: list[list[float]], haystack_name: str, haystack_sha256: str, finger: dict[str, Any], timing: Timing,
           resumed_at: int) -> TrainedPattern:
    from attnprobe import __version__
    from attnprobe.records import model_record, versions

    gates = gates_table(loaded.num_layers, loaded.num_kv_heads, gated, trained)
    frame = pd.DataFrame(log, columns=list(LOG_COLUMNS))
    for name in ("step", "length"):
        frame[name] = frame[name].astype(np.int64)
    windowed = [layer for layer, span in enumerate(spans) if span is not None]
    notes = []
    if windowed:
        notes.append(f"{len(windowed)} of {loaded.num_layers} layers attend within a sliding window already (layers "
                     f"{', '.join(map(str, windowed[:8]))}{', ...' if len(windowed) > 8 else ''}: "
                     f"{sorted({spans[k] for k in windowed})[0]} keys or so): their KV cache is bounded, so they got "
                     "no gate; gates.csv gives their KV heads 1 (trained: false)")
    if resumed_at and timing.whole is None:
        notes.append(f"resumed at step {resumed_at} from a checkpoint that does not record how long the training ran "
                     "until then: wall_seconds counts the resumed part only")
    run = {
        "attnprobe_version": __version__,
        "command": COMMAND,
        "model": {**model_record(loaded), "weights": finger["model_sha256"], "tokenizer": finger["tokenizer_sha256"]},
        "settings": {**asdict(settings), "lengths": list(settings.lengths)},
        "bos": loaded.bos,  # --bos: auto (the tokenizer's own), always or never; the samples begin with it or not
        "method": "DuoAttention (Xiao et al. 2024): alpha x full + (1 - alpha) x streaming per KV head; loss = mean "
                  "over the question-and-answer tokens of the mean squared difference of the last hidden states "
                  "from the full model's + reg_weight x mean gate; AdamW, gates clipped to [0, 1] after each step",
        "duo_attention_defaults": {"lr": DUO_LR, "reg_weight": DUO_REG_WEIGHT, "steps": DUO_STEPS,
                                   "passkeys": DUO_PASSKEYS, "passkey_words": DUO_PASSKEY_WORDS, "sink": DUO_SINK,
                                   "recent": DUO_RECENT, "seed": DUO_SEED, "lengths": DUO_LENGTHS,
                                   "source": "mit-han-lab/duo-attention fe93c31: scripts/train.sh, run_train.sh, "
                                             "duo_attn/train.py, data.py, utils.py"},
        "haystack": {"name": haystack_name, "sha256": haystack_sha256},
        "gated_layers": gated,
        "windowed_layers": windowed,
        "kv_heads": int(loaded.num_kv_heads) * len(gated),
        "result": {"distill_loss_last": float(frame["distill_loss"].iloc[-1]),
                   "mean_gate": float(trained.astype(np.float64).mean()),
                   "below_half": float((trained < HALF).mean())},
        "attention": f"{NAME}: eager, in blocks of query rows under torch.utils.checkpoint (no n x n map), "
                     "activation checkpointing per decoder layer",
        "device": str(loaded.device),
        "dtype": loaded.dtype,
        "resumed_at_step": resumed_at or None,
        # the whole training: a resumed run's earlier parts (until their checkpoint) and this process's part
        "wall_seconds": round(timing.this_part if timing.whole is None else timing.whole, 3),
        "wall_seconds_this_process": round(timing.this_part, 3) if resumed_at else None,
        "notes": notes,
        "versions": versions(),
    }
    return TrainedPattern(gates, frame, run)


def training_figure(pattern: TrainedPattern, title: str | None = None) -> Any:
    """training.png: the distillation loss and the mean gate per step, and the gates [layer, kv head]."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    log = pattern.log
    figure = Figure(figsize=(13.0, 4.4), layout="constrained")
    loss_ax, gate_ax, map_ax = figure.subplots(1, 3, width_ratios=(1.2, 1.0, 0.9))
    loss_ax.plot(log["step"], log["distill_loss"], color="#4575b4", label="distillation loss")
    loss_ax.plot(log["step"], log["penalty"], color="#d73027", label="penalty (reg_weight x mean gate)")
    loss_ax.set_yscale("symlog", linthresh=1e-4)
    loss_ax.set_xlabel("step")
    loss_ax.set_title("loss", fontsize=10)
    loss_ax.legend(fontsize=8)
    gate_ax.plot(log["step"], log["mean_gate"], color="#1b9e77", label="mean gate")
    gate_ax.plot(log["step"], log["below_half"], color="#7570b3", label=f"share of gates below {HALF}")
    gate_ax.set_ylim(-0.02, 1.02)
    gate_ax.set_xlabel("step")
    gate_ax.set_title("gates", fontsize=10)
    gate_ax.legend(fontsize=8)
    table = pattern.gates.pivot(index="layer", columns="kv_head", values="gate").to_numpy()  # [layer, kv head]
    image = map_ax.imshow(table, cmap="coolwarm", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    map_ax.set_xlabel("KV head")
    map_ax.set_ylabel("layer")
    map_ax.set_title("gate per KV head (1: full cache)", fontsize=10)
    for ax in (loss_ax, gate_ax, map_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    map_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    figure.colorbar(image, ax=map_ax, fraction=0.08)
    if title:
        figure.suptitle(title)
    return figure


def train_pattern(model: str, haystack: str | None = None, settings: Settings = Settings(), *,
                  device: str = "auto", dtype: str = "auto", progress: Progress | None = None) -> TrainedPattern:
    """`train_pattern_loaded` on `model` (loaded without its LM head) with the haystack file `haystack` (default:
    passkeys.default_haystack)."""
    from pathlib import Path

    from attnprobe.model import load_model

    text, name = passkeys.read_haystack(None if haystack is None else Path(haystack))
    loaded = load_model(model, device, dtype)
    return train_pattern_loaded(loaded, text, settings, haystack_name=name, progress=progress)
