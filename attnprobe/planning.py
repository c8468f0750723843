"""How a run measures: its options (`Options`, `check_options`), the attention path (fused, blocked or eager), the
value-weighted plan and the score names, decided once per run and held by one `Plan` that the measuring pass
(analysis.measure, measure_batch) and the run record read instead of asking the model again at every step."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from attnprobe import kernel, limits, values
from attnprobe import tokens as token_classes
from attnprobe.bootstrap import DEFAULT_RESAMPLES
from attnprobe.errors import AttnprobeError
from attnprobe.kernel import DEFAULT_BUDGET_MIB, triton_path
from attnprobe.metrics import METRICS, POSITION_METRICS, RECENT_WINDOW, SINK_TOKENS, SPECIAL, TOKEN_METRICS
from attnprobe.model import LoadedModel, attention_modules
from attnprobe.scores import VW_METRICS, VW_POSITION_METRICS


@dataclass(frozen=True)
class Options:
    """How the statistics are computed; none of these changes a value beyond float rounding."""

    attention: str = "auto"  # auto | triton | fused | blocked | eager
    sink: int = SINK_TOKENS  # sink_window: the first S keys
    window: int = RECENT_WINDOW  # ... and the W most recent
    budget_mib: float = DEFAULT_BUDGET_MIB  # memory for one block of attention rows
    block_rows: int | None = None  # a fixed block size instead (tests)
    value_weighted: bool = True  # also the value-weighted scores and output_norm, where the architecture allows
    top_tokens: bool = True  # keep the mass each token id receives, per head (top_tokens.csv)
    top_tokens_min: int = token_classes.MIN_OCCURRENCES  # top_tokens.csv: tokens occurring at least this often


ATTENTION_CHOICES = ("auto", "triton", "fused", "blocked", "eager")


def check_options(
    batch_size: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0, options: Options | None = None
) -> None:
    """Refuse a batch size, resample count, seed or option out of range, naming the value and the fix."""
    if batch_size < 1:
        raise AttnprobeError(f"--batch-size {batch_size} is below 1: use 1 or more (default 8)")
    if resamples < 1:
        raise AttnprobeError(f"--resamples {resamples} is below 1: use 1 or more (default {DEFAULT_RESAMPLES})")
    if seed < 0:
        raise AttnprobeError(f"--seed {seed} is negative: use 0 or more")
    limits.check_whole("--batch-size", batch_size, 1, limits.MAX_BATCH_SIZE, 8)
    limits.check_whole("--resamples", resamples, 1, limits.MAX_RESAMPLES, DEFAULT_RESAMPLES)
    limits.check_whole("--seed", seed, 0, limits.MAX_SEED)
    if options is None:
        return
    if options.attention not in ATTENTION_CHOICES:
        raise AttnprobeError(f"unknown --attention {options.attention!r}: use auto, triton, fused, blocked or eager")
    if options.sink < 0:
        raise AttnprobeError(f"--sink-tokens {options.sink} is negative: use 0 or more (default {SINK_TOKENS})")
    if options.window < 1:
        raise AttnprobeError(f"--window {options.window} is below 1: use 1 or more (default {RECENT_WINDOW})")
    if options.budget_mib <= 0:
        raise AttnprobeError(f"--block-mib {options.budget_mib} must be above 0 (default {DEFAULT_BUDGET_MIB})")
    limits.check_real("--block-mib", options.budget_mib, 0.0, limits.MAX_BLOCK_MIB, DEFAULT_BUDGET_MIB, low_open=True)
    limits.check_whole("--sink-tokens", options.sink, 0, limits.MAX_POSITIONS, SINK_TOKENS)
    limits.check_whole("--window", options.window, 1, limits.MAX_POSITIONS, RECENT_WINDOW)
    limits.check_whole("--top-tokens-min", options.top_tokens_min, 1, limits.MAX_POSITIONS,
                       token_classes.MIN_OCCURRENCES)
    if options.block_rows is not None and options.block_rows < 1:
        raise AttnprobeError(f"block_rows {options.block_rows} is below 1: use 1 or more, or None for the budget")


def fused_from(path: str, attention: str) -> int | None:
    """The shortest batch the fused kernel runs: always under --attention fused; under auto from
    kernel.FUSED_MIN_TOKENS on (shorter batches run blocked, where the fused kernel's extra calls cost more
    than they save), and likewise for the layers the Triton path leaves to the others; never otherwise."""
    if path not in ("fused", "triton"):
        return None
    return 0 if attention == "fused" else kernel.FUSED_MIN_TOKENS


PATHS = ("triton", "fused", "blocked", "eager")


def sequence_paths(counted: dict[str, int], sentences: int) -> dict[str, int]:
    """run.json's `attention.sequences`: how many sequences each path measured (under auto, batches shorter than
    fused_min_tokens run blocked), and `from_checkpoint`, those a resumed run took from its checkpoint."""
    record = {name: counted[name] for name in PATHS if counted.get(name)}
    earlier = sentences - sum(record.values())
    if earlier > 0:
        record["from_checkpoint"] = earlier
    return record


def attention_path(loaded: LoadedModel, attention: str) -> str:
    """`triton` (the statistics inside a Triton attention kernel), `fused` (the fused kernel's logsumexp), `blocked`
    (attnprobe's statistics attention, O(n) memory) or `eager` (hooks on eager maps). auto takes triton on a CUDA
    device where triton imports (triton_path.AUTO_ON_CUDA), else fused (run.json's `why_not_triton` says why, see
    Plan.record); --attention triton elsewhere is refused (triton_path.unavailable).

    `attention` is one of ATTENTION_CHOICES (check_options has checked it).
    """
    if attention == "eager":
        return "eager"
    if attention == "triton":
        why_not = triton_path.unavailable(loaded.device)
        if why_not is not None:
            raise AttnprobeError(why_not)
    reason = kernel.unsupported(loaded)
    if reason is None:
        if attention == "auto":
            on_gpu = loaded.device.type == "cuda" and triton_path.unavailable(loaded.device) is None
            return "triton" if on_gpu and triton_path.AUTO_ON_CUDA else "fused"
        return attention
    if attention != "auto":
        raise AttnprobeError(f"--attention {attention} does not implement {reason}: use --attention eager or auto")
    return "eager"


def auto_not_triton(device: torch.device) -> str:
    """Why --attention auto left the Triton path on a CUDA `device` for the fused one (run.json's
    `attention.why_not_triton`): triton missing or broken there (triton_path.unavailable), or AUTO_ON_CUDA off."""
    return triton_path.unavailable(device) or "triton_path.AUTO_ON_CUDA is off"


def score_names(special: bool, weighted: bool) -> tuple[str, ...]:
    """The per-head scores of a run: METRICS, special_tokens where the tokenizer adds special tokens, and the
    value-weighted scores and output_norm where they are measured."""
    return (*METRICS, *((SPECIAL,) if special else ()), *TOKEN_METRICS, *(VW_METRICS if weighted else ()))


def value_weighted_plan(loaded: LoadedModel, path: str, options: Options) -> tuple[list[Any] | None, dict[str, Any]]:
    """Each layer's output projection, when the value-weighted scores are measured (else None), and what run.json
    records about them: `measured`, the projection found, or why not (`why`, and a `note` for run.json's notes
    when the architecture, not the user, is the reason)."""
    if not options.value_weighted:
        return None, {"measured": False, "why": "turned off (--no-value-weighted)"}
    modules = [module for module, _ in attention_modules(loaded.model)]
    projections, found = values.find_projections(loaded.model, modules, loaded.num_heads)
    why = None if projections is not None else found
    if why is None and path == "eager":
        why = eager_values_reason(loaded, modules)
    if why is not None:
        return None, {"measured": False, "why": why,
                      "note": f"value-weighted scores and output_norm not measured: {why}"}
    return projections, {"measured": True, "output_projection": found.removeprefix("found: ")}


def eager_values_reason(loaded: LoadedModel, modules: list[Any]) -> str | None:
    """Why the eager path cannot read this model's values (None when it can): the values are read by calling the
    model's own eager attention function under another name (values.capturing_values), which a model that
    computes attention itself, or changes its eager path by a setting, does not call."""
    reason = kernel.config_reason(loaded)
    if reason is not None:
        return f"the eager path cannot read the values of {reason}"
    if any(values.eager_function(module) is None for module in modules):
        return f"the eager path cannot read the values of {type(modules[0]).__name__}: no eager_attention_forward"
    return None


@dataclass(frozen=True)
class Plan:
    """What a run measures and how, decided once from the model and the options (`plan`): the path every batch
    runs, the output projections of the value-weighted scores, and what the model's attention computes per layer.
    """

    options: Options
    path: str  # triton | fused | blocked | eager (attention_path)
    projections: list[Any] | None  # each layer's output projection when the value-weighted scores are measured
    weighted: dict[str, Any]  # run.json's `value_weighted`: measured, or why not (value_weighted_plan)
    discovery: kernel.Discovery  # what the statistics attention learnt of each layer (kernel.discover)
    modules: list[Any]  # each layer's attention module (the eager path reads their values)
    spans: list[int | None]  # each layer's attention window (None: every key)

    @property
    def measures_values(self) -> bool:
        """Whether the value-weighted scores and output_norm are measured."""
        return self.projections is not None

    @property
    def fused(self) -> int | None:
        """The shortest batch the fused kernel runs (fused_from)."""
        return fused_from(self.path, self.options.attention)

    @property
    def triton(self) -> bool:
        """Whether the layers the Triton kernel covers run through it."""
        return self.path == "triton"

    def names(self, special: bool) -> tuple[str, ...]:
        """The per-head scores (score_names); `special`: the tokenizer adds special tokens."""
        return score_names(special, self.measures_values)

    @property
    def bin_names(self) -> tuple[str, ...]:
        """The scores binned by query position."""
        return (*POSITION_METRICS, *VW_POSITION_METRICS) if self.measures_values else POSITION_METRICS

    def maps_only(self) -> Plan:
        """This plan without the value-weighted scores: for a pass that keeps only attention maps."""
        return replace(self, projections=None)

    def record(self, device: torch.device, sequences: dict[str, int], sentences: int,
               dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """run.json's `attention`: what was asked, the path that ran and the features it saw, and how many of the
        run's `sentences` sequences each path measured (`sequences`, path -> count, see sequence_paths)."""
        options = self.options
        record: dict[str, Any] = {
            "requested": options.attention, "path": self.path, "block_budget_mib": options.budget_mib,
            "sink_tokens": options.sink, "window": options.window, "features": self.discovery.record(),
        }
        if self.path == "eager" and options.attention == "auto":
            record["why_eager"] = self.discovery.reason
        if self.path == "triton":  # the layers it leaves (not_triton) run fused from fused_min_tokens, or blocked
            record.update(triton_path.record(self.discovery.features, dtype))
            if record["not_triton"]:
                record["fused_min_tokens"] = self.fused
        if self.path == "fused" and options.attention == "auto" and device.type == "cuda":
            record["why_not_triton"] = auto_not_triton(device)
        if self.path == "fused":  # the others (windows, soft-capping, sinks) ran blocked
            record["fused_layers"] = self.discovery.fused_layers(device)
            record["fused_min_tokens"] = self.fused
        record["sequences"] = sequence_paths(sequences, sentences)
        return record


def plan(loaded: LoadedModel, options: Options) -> Plan:
    """Decide how to measure `loaded` under `options` (check_options has checked them): refuses an --attention
    that the model's attention does not allow."""
    path = attention_path(loaded, options.attention)
    projections, weighted = value_weighted_plan(loaded, path, options)
    discovery = kernel.discover(loaded)
    modules = [module for module, _ in attention_modules(loaded.model)]
    return Plan(options, path, projections, weighted, discovery, modules, discovery.spans(loaded.num_layers))


def attention_context(loaded: LoadedModel, plan: Plan) -> Any:
    """What the model runs under for the plan's path: attnprobe's statistics attention, or on the eager path its
    own eager function (under `attnprobe_eager` when the value-weighted scores need its values)."""
    if plan.path != "eager":
        return kernel.statistics_attention(loaded)
    return values.capturing_values(loaded.model) if plan.measures_values else nullcontext()
