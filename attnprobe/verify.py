"""Are the maps attnprobe reads the model's true attention? Checks, each with its difference where it is nearest its
tolerance, in the dtype the model runs in (float32, bfloat16 or float16: each dtype's bounds are derived below)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnprobe import kernel, recompute, values
from attnprobe.analysis import map_sums
from attnprobe.batching import pad_batch
from attnprobe.corpus import clip_text
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import SentenceSums, bin_count, valid_keys
from attnprobe.model import LoadedModel, as_loaded, attention_modules, stream_attention
from attnprobe.planning import Options, value_weighted_plan
from attnprobe.tokens import encode

NOTE_WIDTH = 40  # a note fits beside the other columns of verify's table in 80 columns
DEFAULT_SENTENCES = (
    "The cat sat on the mat.",
    "When the engineer opened the panel, she found a loose wire behind the fan.",
    "Rain fell.",
    "The letters that were delivered by the tired courier had been written years before.",
)


@dataclass(frozen=True)
class Check:
    """One check: where a bound varies (per weight, per layer), `max_abs_diff` and `tolerance` are the difference and
    the bound at the point nearest its bound ("diff at tightest"); with one bound, the largest difference."""

    name: str
    max_abs_diff: float | None  # None when the check was skipped
    tolerance: float
    note: str = ""

    @property
    def skipped(self) -> bool:
        return self.max_abs_diff is None

    @property
    def passed(self) -> bool:
        return self.skipped or self.max_abs_diff <= self.tolerance


@dataclass
class Capture:
    maps: list[Tensor]  # per layer [batch, head, query, key]
    inputs: list[tuple[tuple, dict]]  # per layer, the attention module's (args, kwargs)


@torch.inference_mode()  # nothing here needs gradients; a parameter in a result would warn when read with float()
def verify(model: Any, sentences: list[str] | tuple[str, ...] = DEFAULT_SENTENCES, *, device: str = "auto",
           dtype: str = "auto") -> list[Check]:
    """Run every check on `sentences` (a few of different lengths are enough) and return them in order.

    `model`: a LoadedModel, a name or path (loaded on `device` in `dtype`), or a (transformers model, tokenizer)
    pair.
    """
    if isinstance(sentences, str) or not sentences or not all(isinstance(s, str) and s.strip() for s in sentences):
        raise AttnprobeError("sentences: expected a list of non-empty strings, e.g. [\"The cat sat.\", \"Rain fell.\"]")
    loaded = as_loaded(model, device, dtype)
    clipped = [clip_text(s, loaded.max_length) for s in sentences]  # a huge line: only what the model keeps
    ids = [t[: loaded.max_length] for t in encode(loaded, clipped)["input_ids"]]
    input_ids, mask = pad_batch(ids, loaded.device)  # [batch, seq] each
    batched = capture(loaded, input_ids, mask)
    keys = valid_keys(mask, loaded.causal)[:, None]  # [batch, 1, query, key]
    rows = mask.bool()[:, None, :, None]  # [batch, 1, query, 1]
    found = kernel.discover(loaded)
    return [
        rows_sum_to_one(batched, mask, sinks=bool(found.features) and any(f.sinks for f in found.features),
                        dtype=loaded.dtype),
        masked_keys_are_zero(batched, mask, loaded.causal, found.spans(len(batched.maps))),
        batched_equals_unbatched(loaded, batched, ids),
        recomputed_from_projections(loaded, batched, keys, rows),
        eager_equals_sdpa(loaded, input_ids, mask),
        *blocked_equals_eager(loaded, input_ids, mask),
    ]


def capture(loaded: LoadedModel, input_ids: Tensor, mask: Tensor) -> Capture:
    """Every layer's attention map, and the inputs its attention module was called with."""
    inputs: list[tuple[tuple, dict]] = []
    handles = [
        module.register_forward_pre_hook(lambda _m, args, kwargs: inputs.append((args, kwargs)), with_kwargs=True)
        for module, _ in attention_modules(loaded.model)
    ]
    maps: list[Tensor] = []
    try:
        stream_attention(loaded, input_ids, mask, lambda _layer, p: maps.append(p.float().clone()))
    finally:
        for handle in handles:
            handle.remove()
    return Capture(maps=maps, inputs=inputs)


def rows_sum_to_one(batched: Capture, mask: Tensor, sinks: bool = False, dtype: str = "float32") -> Check:
    """Each real row sums to 1: to 1e-5 in float32; a model in bfloat16 or float16 stores each weight to u (its
    unit roundoff) of itself, so a row's sum moves by u more."""
    tolerance = 1e-5 + (0.0 if dtype == "float32" else UNIT_ROUNDOFF.get(dtype, 0.0))
    if sinks:
        return Check("rows sum to 1", None, tolerance, "learned sinks: rows sum to less than 1")
    rows = mask.bool()[:, None, :]  # [batch, 1, query]
    worst = max(float(torch.where(rows, p.sum(dim=-1) - 1.0, 0.0).abs().max()) for p in batched.maps)
    return Check("rows sum to 1", worst, tolerance)


def masked_keys_are_zero(batched: Capture, mask: Tensor, causal: bool, spans: list[int | None]) -> Check:
    """Future, padded and (in a windowed layer) out-of-window keys of real queries get exactly 0."""
    rows = mask.bool()[:, None, :, None]  # [batch, 1, query, 1]
    worst, seen = 0.0, False
    for p, span in zip(batched.maps, spans):
        hidden = rows & ~valid_keys(mask, causal, span)[:, None]  # [batch, 1, query, key]
        if hidden.any():
            seen = True
            worst = max(worst, float(torch.where(hidden, p, 0.0).abs().max()))
    if not seen:
        return Check("future/padded keys get 0", None, 1e-7, "nothing is masked: use sentences of different lengths")
    return Check("future/padded keys get 0", worst, 1e-7)


# A batch multiplies other matrix shapes than one sentence alone (and a loaded machine may split a product over
# its threads differently from run to run): float32 rounds each logit to ~1e-7 relative, which is 5e-6 in the
# exponent of a sharp head's logits of +-50, and a weight moves by as much. 1e-4 covers that.
BATCHED_TOLERANCE = 1e-4


def batched_equals_unbatched(loaded: LoadedModel, batched: Capture, ids: list[list[int]]) -> Check:
    """The maps of the padded batch against each sentence's maps alone: to BATCHED_TOLERANCE in float32; in
    bfloat16 or float16, per weight (pair_bound), from each layer's magnitudes as the recomputation finds them."""
    name = "batched = one at a time"
    if len({len(tokens) for tokens in ids}) < 2:
        return Check(name, None, BATCHED_TOLERANCE, "nothing is padded: use sentences of different lengths")
    magnitudes = None
    if loaded.dtype != "float32":
        magnitudes = _magnitudes(loaded, batched)
        if isinstance(magnitudes, str):
            return Check(name, None, BATCHED_TOLERANCE, f"{loaded.dtype}: {magnitudes}"[:NOTE_WIDTH])
    worst: tuple[float, float] = (0.0, BATCHED_TOLERANCE)  # (diff, tolerance) nearest its bound
    for b, tokens in enumerate(ids):
        alone = capture(loaded, *pad_batch([tokens], loaded.device))
        n = len(tokens)
        for layer, (p_batch, p_alone) in enumerate(zip(batched.maps, alone.maps)):
            got, want = p_batch[b : b + 1, :, :n, :n], p_alone[:, :, :n, :n]  # [1, head, query, key]
            if magnitudes is None:
                found = (float((got - want).abs().max()), BATCHED_TOLERANCE)
            else:
                bound = pair_bound(loaded.dtype, layer, got, want, magnitudes[layer][b : b + 1, :, :n])
                found = _worst_against_bound(want, got, bound, torch.ones_like(got, dtype=torch.bool))
            worst = max(worst, found, key=lambda pair: pair[0] / pair[1])
    return Check(name, worst[0], worst[1], "" if magnitudes is None else f"{loaded.dtype}: bound per weight")


RECOMPUTED = "softmax(QK^T/sqrt(d)) = maps"
# The recomputation rounds other than the model. The model rounds each of about ROUNDINGS steps of a logit's way
# (the q and k projections, a q/k norm, the rotary embedding's products and sum, the q k product, the scale, a
# soft-cap) to u (its dtype's unit roundoff) of the row's magnitude A = max_j sum_d |q_d k_d| * scale, so each logit
# is off by at most e = ROUNDINGS u A. Shifting a row's logits by at most e scales each weight p by a factor within
# exp(+-2e): |p' - p| <= p (exp(2e) - 1); the weight is then stored in the dtype (u p more), and the float32 softmax
# adds 1e-5 at most (as the other map checks allow). In float32 the bound is about 1e-5 (A u is 1e-6 for A near
# 20); in bfloat16 it is a share of each weight, so a map that differs where its weights are large still fails.
ROUNDINGS = 12
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
FLOAT32_MAPS = 1e-5  # float32's rounding of a softmax, as the other map checks allow


# Two runs of one model in bfloat16 or float16 that compute the same thing by different paths (a batch and one
# sentence alone, eager and SDPA attention, the eager maps and the blocked or fused kernels) round differently, and
# what a path rounds in one layer reaches every later layer through the hidden state. To first order these relative
# errors add (as tests/test_dtype.py derives for the statistics): per layer the scores pass about 4 roundings
# before the softmax (the q and k projections, the rotary embedding, the product) and the hidden state about 4
# more on its way to the next layer (attention output, output projection, residual sum, MLP). So at layer l
# (counted from 0) one run's logits are off by PER_LAYER (l + 1) u relative, and so are the statistics, smooth
# functions of them (entropy in nats, distance in tokens, shares in [0, 1]; relative above 1); two runs differ by
# twice that (depth_bound). A logit's absolute error is its relative error times the row's magnitude A (the
# recomputation's); where A is at hand, the recomputation's fuller count of a layer's own roundings (ROUNDINGS, with
# norms, scale and soft-cap) replaces the 4: (ROUNDINGS + PER_LAYER l) u A for one run (pair_bound).
PER_LAYER = 8


def depth_bound(dtype: str, layer: int) -> float:
    """How far two runs in `dtype` may differ at `layer` (from 0), relative: 2 PER_LAYER (layer + 1) u; 0 in float32,
    whose own bounds apply."""
    if dtype == "float32":
        return 0.0
    return 2 * PER_LAYER * (layer + 1) * UNIT_ROUNDOFF.get(dtype, 0.0)


def pair_bound(dtype: str, layer: int, first: Tensor, second: Tensor, magnitude: Tensor) -> Tensor:
    """Per weight, how far the maps `first` and `second` [batch, head, query, key] of two runs in `dtype` may differ
    at `layer`, `magnitude` [batch, head, query] the rows' A. Each run's logits are off by at most
    e = (ROUNDINGS + PER_LAYER layer) u A, so the two by 2e, and the ratio of their weights lies within exp(+-4e):
    |p1 - p2| <= min(p1, p2) (exp(4e) - 1); each weight is stored to u of itself (u (p1 + p2) more), and
    BATCHED_TOLERANCE covers float32's part."""
    u = UNIT_ROUNDOFF.get(dtype, 2.0**-24)
    e = (ROUNDINGS + PER_LAYER * layer) * u * magnitude  # [batch, head, query]
    return torch.minimum(first, second) * torch.expm1(4 * e)[..., None] + u * (first + second) + BATCHED_TOLERANCE


def _magnitudes(loaded: LoadedModel, batched: Capture) -> list[Tensor] | str:
    """Each layer's row magnitudes A [batch, head, query] from the recomputation of the captured inputs, or why
    there are none."""
    scores_of = recompute.RECOMPUTE.get(loaded.model.config.model_type)
    if scores_of is None:
        return f"no bound without a recomputation ({loaded.model.config.model_type})"
    modules = [module for module, _ in attention_modules(loaded.model)]
    found = []
    try:
        for layer, (module, (args, kwargs)) in enumerate(zip(modules, batched.inputs)):
            hidden = (args[0] if args else kwargs["hidden_states"]).float()  # [batch, seq, embed]
            found.append(scores_of(module, hidden, loaded.model.config, layer).magnitude)
    except recompute.CannotRecompute as err:
        return f"no bound: {err}"
    return found


def recompute_bound(dtype: str, expected: Tensor, magnitude: Tensor) -> Tensor:
    """The bound above, per weight: `expected` [batch, head, query, key], `magnitude` [batch, head, query]."""
    u = UNIT_ROUNDOFF.get(dtype, 2.0**-24)
    shift = torch.expm1(2 * ROUNDINGS * u * magnitude)[..., None]  # [batch, head, query, 1]
    return expected * (shift + u) + FLOAT32_MAPS  # [batch, head, query, key]


def recomputed_from_projections(loaded: LoadedModel, batched: Capture, keys: Tensor, rows: Tensor) -> Check:
    """Each layer's softmax(Q K^T * scale + bias), recomputed from the input its attention module was called with,
    its own projection weights and the config (attnprobe.recompute), against the maps read."""
    config = loaded.model.config
    scores_of = recompute.RECOMPUTE.get(config.model_type)
    if scores_of is None:
        return Check(RECOMPUTED, None, 1e-5, f"no recomputation for {config.model_type} models")
    worst: tuple[float, float] = (0.0, 1e-5)  # (diff, tolerance) of the layer nearest its bound
    try:
        for pair in _layer_errors(loaded, batched, keys, rows, scores_of):
            worst = max(worst, pair, key=lambda found: found[0] / found[1])
    except recompute.CannotRecompute as err:
        return Check(RECOMPUTED, None, 1e-5, f"not recomputed: {err}"[:NOTE_WIDTH])
    note = "" if loaded.dtype == "float32" else f"{loaded.dtype}: bound per weight"
    if worst[0] > worst[1] and config.model_type == "falcon" and config.alibi and all(
            diff <= bound for diff, bound in _layer_errors(
                loaded, batched, keys, rows, functools.partial(recompute.falcon_scores, alibi_times=2))):
        note = "maps add ALiBi twice (transformers bug)"  # Falcon's eager path
    return Check(RECOMPUTED, worst[0], worst[1], note)


def _layer_errors(loaded: LoadedModel, batched: Capture, keys: Tensor, rows: Tensor,
                  scores_of: Callable[..., Any]) -> Iterator[tuple[float, float]]:
    """Per layer, (|recomputed - read|, its bound) at the weight nearest its bound: `scores_of(module, hidden,
    config, layer)` recomputes the layer's scores from the input its attention module was called with."""
    modules = [module for module, _ in attention_modules(loaded.model)]
    for layer, (module, p, (args, kwargs)) in enumerate(zip(modules, batched.maps, batched.inputs)):
        hidden = (args[0] if args else kwargs["hidden_states"]).float()  # [batch, seq, embed]
        with torch.inference_mode():
            scores = scores_of(module, hidden, loaded.model.config, layer)
        expected = recompute.probabilities(scores, keys)  # [batch, head, query, key]
        yield _worst_against_bound(expected, p, recompute_bound(loaded.dtype, expected, scores.magnitude), rows)


def _worst_against_bound(expected: Tensor, p: Tensor, bound: Tensor, rows: Tensor) -> tuple[float, float]:
    """(|expected - p|, its bound) at the weight nearest its bound, over the real query rows."""
    ratio = torch.where(rows, (expected - p).abs() / bound, 0.0)  # [batch, head, query, key]
    at = int(ratio.argmax())
    return float((expected - p).abs().flatten()[at]), float(bound.flatten()[at])


def eager_equals_sdpa(loaded: LoadedModel, input_ids: Tensor, mask: Tensor) -> Check:
    """The model's output under eager attention (what attnprobe reads) and under SDPA agree, layer by layer: each
    layer's output (hidden state) to 1e-5 of its largest value in float32, which sums in another order; in
    bfloat16 or float16 to depth_bound (2 PER_LAYER (l + 1) u) more, as SDPA rounds other sums than eager attention
    (its fused kernels keep the logits in float32), and what one layer rounds reaches the next."""
    model = loaded.model
    name = "eager output = SDPA output"
    if getattr(model.config, "attn_logit_softcapping", None):  # SDPA has no soft-capping: its output must differ
        return Check(name, None, 0.0, "SDPA cannot soft-cap scores")
    with torch.inference_mode():
        eager = _layer_outputs(model, input_ids, mask)
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):
            return Check(name, None, 0.0, "this model has no SDPA attention")
        if model.config._attn_implementation != "sdpa":  # transformers only warns: the same eager run twice
            return Check(name, None, 0.0, "the model cannot switch to SDPA")
        try:
            sdpa = _layer_outputs(model, input_ids, mask)
        finally:
            model.set_attn_implementation("eager")
    real = mask.bool()[..., None]  # [batch, seq, 1]
    layers = loaded.num_layers
    found = []  # (diff, tolerance, scale) per layer output, the last one the model's output
    for layer, (want, got) in zip(range(layers - len(eager), layers), zip(eager, sdpa)):
        scale = float(torch.where(real, want, 0.0).abs().max())  # relative to the output's size
        tolerance = (1e-5 + depth_bound(loaded.dtype, layer)) * max(1.0, scale)
        found.append((float(torch.where(real, want - got, 0.0).abs().max()), tolerance, scale))
    diff, tolerance, scale = max(found, key=lambda each: each[0] / each[1])
    at = found.index((diff, tolerance, scale))
    return Check(name, diff, tolerance, f"|output| <= {scale:.3g}" + (f" (layer {at})" if len(found) > 1 else ""))


def _layer_outputs(model: Any, input_ids: Tensor, mask: Tensor) -> list[Tensor]:
    """Each layer's output [batch, seq, embed] (the last one the model's output), or the model's output alone where
    its hidden states are not one per layer."""
    out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    states = getattr(out, "hidden_states", None)
    layers = len(attention_modules(model))
    if states is None or len(states) != layers + 1:
        states = ()
    return [s.float().to(mask.device) for s in (*states[1:-1], out.last_hidden_state)]  # on the mask's device


STATS_TOLERANCE = 1e-5  # blocked vs eager statistics, relative above 1: float32's bound through the layers


def blocked_equals_eager(loaded: LoadedModel, input_ids: Tensor, mask: Tensor) -> list[Check]:
    """attnprobe's blocked and fused statistics against the same statistics of the eager maps, padded batch
    included.

    The block size is chosen not to divide the length, so that a block border falls mid-sequence.
    Differences are relative for values above 1 (distance is in tokens). Per-sentence statistics must
    agree to 1e-5: the block products sum in another order, and that float32 rounding (1e-7) carries
    through the layers (1.2e-6 on SmolLM2's 30 layers here; other CPUs round differently), so the bound is
    float32's through several layers, not one machine's digits. Position bins, whose mean can rest on a
    single row, to 1e-5 as well. In bfloat16 or float16 each layer l adds depth_bound (2 PER_LAYER (l + 1) u):
    the kernels round other sums than the eager maps (the fused path's logits are never rounded to the dtype),
    and what one layer rounds reaches the next through the hidden state.
    """
    names = ("blocked statistics = eager", "blocked position bins = eager", "fused statistics = eager")
    reason = kernel.unsupported(loaded)
    if reason is not None:
        note = f"blocked attention does not implement {reason}"
        return [Check(names[0], None, STATS_TOLERANCE, note), Check(names[1], None, 1e-5, note),
                Check(names[2], None, STATS_TOLERANCE, note)]
    n = input_ids.shape[1]
    rows = next(r for r in range(max(2, n // 3 + 1), n + 2) if n % r)  # a border mid-sequence
    sink, window, bins = 1, 3, bin_count(n)  # a small window, so that sink_window is defined on short sentences
    eager: dict[int, SentenceSums] = {}
    blocked: dict[int, SentenceSums] = {}
    spans = kernel.discover(loaded).spans(loaded.num_layers)  # each layer's attention window
    projections = value_weighted_plan(loaded, "blocked", Options())[0]  # the value-weighted scores, where found
    modules = [module for module, _ in attention_modules(loaded.model)]
    lengths = mask.sum(dim=-1)  # [batch]

    def on_map(layer: int, p: Tensor) -> None:
        weighted = None if projections is None else (values.take_values(modules[layer]), projections[layer])
        eager[layer] = map_sums(p, lengths, loaded.causal, None, sink, window, bins, spans[layer], weighted)

    with values.capturing_values(loaded.model) if projections is not None else nullcontext():
        stream_attention(loaded, input_ids, mask, on_map)
    fused: dict[int, SentenceSums] = {}
    with kernel.statistics_attention(loaded):
        kernel.run_batch(loaded, input_ids, mask, lambda layer, sums, _maps: blocked.__setitem__(layer, sums),
                         sink=sink, window=window, bins=bins, block_rows=rows, projections=projections)
        kernel.run_batch(loaded, input_ids, mask, lambda layer, sums, _maps: fused.__setitem__(layer, sums),
                         sink=sink, window=window, bins=bins, block_rows=rows, fused=0, projections=projections)
    note = f"blocks of {rows} rows over {n} positions" + (", value-weighted scores included" if projections else "")
    means = [(eager[layer].means(), blocked[layer].means()) for layer in eager]
    by_bin = [(eager[layer].bin_means(), blocked[layer].bin_means()) for layer in eager]
    layers = kernel.discover(loaded).fused_layers(loaded.device)
    fused_note = ("every layer fused" if len(layers) == len(eager) else
                  f"layers {_ranges(layers)} fused, the others blocked" if layers else "no layer is fused: all blocked")
    bounds = [depth_bound(loaded.dtype, layer) for layer in eager]  # 0 in float32
    fused_pairs = [(eager[layer].means(), fused[layer].means()) for layer in eager]
    return [Check(names[0], *_worst_layer(means, [STATS_TOLERANCE + b for b in bounds]), note),
            Check(names[1], *_worst_layer(by_bin, [1e-5 + b for b in bounds]), note),
            Check(names[2], *_worst_layer(fused_pairs, [STATS_TOLERANCE + b for b in bounds]), fused_note)]


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and layer == spans[-1][1] + 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _worst_layer(pairs: list[tuple[dict[str, Tensor], dict[str, Tensor]]],
                 tolerances: list[float]) -> tuple[float, float]:
    """(difference, tolerance) of the layer nearest its tolerance: each layer's (want, got) statistics and its
    tolerance, in order."""
    return max(((_relative_diff([pair]), tolerance) for pair, tolerance in zip(pairs, tolerances)),
               key=lambda found: found[0] / found[1])


def _relative_diff(pairs: list[tuple[dict[str, Tensor], dict[str, Tensor]]]) -> float:
    """Largest |got - want| / max(1, |want|); infinite when a value is defined in one and not the other."""
    worst = 0.0
    for want, got in pairs:
        for key, value in want.items():
            if not bool((value.isnan() == got[key].isnan()).all()):
                return math.inf
            diff = ((got[key] - value).abs() / value.abs().clamp(min=1.0)).nan_to_num(0.0)
            worst = max(worst, float(diff.max()))
    return worst
