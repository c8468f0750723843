"""The statistics attention itself: the function registered with transformers' AttentionInterface
(`stats_attention`, which runs each layer on the fused or the blocked path), running one batch under it
(`run_batch`, `statistics_attention`), and discovering what a model's layers ask of it (`discover`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe import defaults, values
from attnprobe.errors import AttnprobeError
from attnprobe.kernel.batch import Batch, LayerSums
from attnprobe.kernel.blocked import attend
from attnprobe.kernel.devices import KERNELS
from attnprobe.kernel.features import LayerFeatures, Unsupported, config_reason, fusable, layer_features
from attnprobe.kernel.fused import ReceivedOnRead, fused_attend
from attnprobe.kernel.masks import stats_mask
from attnprobe.kernel.triton_path import LaunchFailed, remember_failure, triton_attend
from attnprobe.kernel.triton_path import reason as triton_reason
from attnprobe.metrics import RECENT_WINDOW, SINK_TOKENS, SentenceSums, TokenClasses
from attnprobe.model import LastLayerDone, LoadedModel, attention_modules, forward_kwargs, using_attention

NAME = "attnprobe_stats"
DEFAULT_BUDGET_MIB = defaults.BLOCK_MIB
FUSED_MIN_TOKENS = 512  # --attention auto: the fused kernel from this length on (both paths are exact)


_ACTIVE: ContextVar[Batch | None] = ContextVar("attnprobe_batch", default=None)


@dataclass(frozen=True)
class Discovery:
    """Whether the statistics attention runs a model exactly; per layer, what it computes."""

    features: tuple[LayerFeatures, ...] | None  # None where the model's attention could not be read
    reason: str | None  # the first feature not implemented; None when blocked attention applies
    kv_heads: int = 0  # key/value heads per layer

    def spans(self, layers: int) -> list[int | None]:
        """Each layer's attention window (None: every key), for the eager path's counts too."""
        return [f.span for f in self.features] if self.features else [None] * layers

    def record(self) -> dict[str, Any]:
        """The features used, for run.json: what varies by layer is listed by layer."""
        if not self.features:
            return {}
        windows = sorted({f.span for f in self.features if f.span is not None})
        groups = self.features[0].groups
        return {
            "causal": self.features[0].causal,
            "query_heads_per_kv_head": groups,
            "sliding_window": {str(w): [k for k, f in enumerate(self.features) if f.span == w] for w in windows}
            or None,
            "softcap": next((f.softcap for f in self.features if f.softcap is not None), None),
            "attention_sinks": any(f.sinks for f in self.features),
            "scale": sorted({f.scale for f in self.features}),
        }

    def fused_layers(self, device: torch.device | None = None) -> list[int]:
        """The layers the fused path computes on `device` (the others run blocked)."""
        if device is not None and device.type not in KERNELS:
            return []
        return [k for k, f in enumerate(self.features or ()) if fusable(f)]

    def labels(self) -> list[str]:
        """Short names of the features beyond plain multi-head attention (the README's table)."""
        if not self.features:
            return []
        first = self.features[0]
        out = []
        if first.groups > 1:
            out.append("MQA" if self.kv_heads == 1 else "GQA")
        if any(f.span is not None for f in self.features):
            out.append("window" if all(f.span is not None for f in self.features) else "window (some layers)")
        if any(f.softcap is not None for f in self.features):
            out.append("soft-cap")
        if any(f.sinks for f in self.features):
            out.append("sinks")
        if any(f.own_scale for f in self.features):
            out.append("own scale")
        return out


_DISCOVERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Discovery


def discover(loaded: LoadedModel) -> Discovery:
    """Run two tokens through the model under the statistics attention, and learn from each layer's call and
    mask what it computes, or the first thing it does that the function does not implement (cached)."""
    model = loaded.model
    if model in _DISCOVERED:
        return _DISCOVERED[model]
    reason = config_reason(loaded)
    found = Discovery(None, reason)
    if reason is None:
        found = _discover(loaded)
    _DISCOVERED[model] = found
    return found


def unsupported(loaded: LoadedModel) -> str | None:
    """Why the statistics function cannot run this model exactly, or None when it can."""
    return discover(loaded).reason


def _discover(loaded: LoadedModel) -> Discovery:
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = torch.tensor([[1 % vocab, 2 % vocab]], device=loaded.device)  # [1, 2]
    problems: list[str] = []
    features: dict[int, LayerFeatures] = {}

    def keep(_layer: int, _sums: SentenceSums, _maps: Tensor | None) -> None:
        pass

    try:
        with _switched(loaded):
            run_batch(loaded, ids, torch.ones_like(ids), keep, discovering=problems, features=features)
    except Unsupported as err:
        problems.append(err.feature)
    except AttnprobeError as err:
        problems.append(str(err).split(": use --attention")[0])
    layers = len(attention_modules(loaded.model))
    complete = len(features) == layers
    return Discovery(tuple(features[k] for k in range(layers)) if complete else None,
                     problems[0] if problems else None, loaded.num_kv_heads)


def stats_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """Eager attention, block by block; statistics go to the active batch. Returns (output, None)."""
    batch_info = _ACTIVE.get()
    if batch_info is None:
        raise AttnprobeError("attnprobe's statistics attention runs only inside attnprobe.kernel.run_batch")
    features, sinks = layer_features(module, query, key, attention_mask, scaling, dropout, kwargs,
                                     batch_info.discovering)
    layer = batch_info.layers[id(module)]
    batch_info.features[layer] = features
    need_output = layer != batch_info.last_layer
    projections = batch_info.projections
    factors = None if projections is None else values.head_factors(projections[layer], query.shape[1])
    ran = _on_triton(batch_info, features, query, key, value, attention_mask, scaling, need_output, sinks, factors)
    if ran is not None:
        sums, example, output = ran
        batch_info.ran.add("triton")
    elif batch_info.fused is not None and query.shape[2] >= batch_info.fused and fusable(features) \
            and query.device.type in KERNELS:
        sums, example, output = fused_attend(query, key, value, attention_mask, scaling, features.causal, batch_info,
                                             need_output=need_output, factors=factors)
        batch_info.ran.add("fused")
    else:
        batch_info.ran.add("blocked")
        sums, example, output = attend(query, key, value, attention_mask, scaling, features.causal, batch_info,
                                       need_output=need_output, span=features.span, softcap=features.softcap,
                                       sinks=sinks, factors=factors)
    batch_info.on_layer(layer, sums, example)
    if isinstance(sums, ReceivedOnRead):
        sums.forget()  # received is computed only if the callback read it
    if layer == batch_info.last_layer:
        raise LastLayerDone  # nothing after the last attention can change a statistic
    return output, None


def _on_triton(batch_info: Batch, features: LayerFeatures, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None, need_output: bool, sinks: Tensor | None,
               factors: Tensor | None) -> tuple | None:
    """The layer through the Triton kernel (triton_attend's results), or None where it does not run there: not asked
    for, a layer it does not cover (triton_path.reason), or, under --attention auto (Batch.triton_fallback), a kernel
    Triton could not compile or launch here, remembered so that the run's record names it (remember_failure)."""
    if not batch_info.triton or triton_reason(features, query.dtype) is not None:
        return None
    try:
        return triton_attend(query, key, value, attention_mask, scaling, features.causal, batch_info,
                             need_output=need_output, span=features.span, softcap=features.softcap, sinks=sinks,
                             factors=factors)
    except LaunchFailed as err:
        if not batch_info.triton_fallback:
            raise
        remember_failure(features, query.dtype, err)
        return None


@contextmanager
def statistics_attention(loaded: LoadedModel) -> Iterator[None]:
    """Switch the model to the statistics function for the duration; refuse what it cannot do exactly."""
    reason = unsupported(loaded)
    if reason is not None:
        raise Unsupported(reason)
    with _switched(loaded):
        yield


def _switched(loaded: LoadedModel) -> Any:
    """The model on the statistics function (`attnprobe_stats`) for the duration."""
    return using_attention(loaded.model, NAME, stats_attention, stats_mask)


@torch.inference_mode()
def run_batch(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor, on_layer: LayerSums, *,
    special: Tensor | None = None, sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, bins: int = 1,
    budget_mib: float = DEFAULT_BUDGET_MIB, block_rows: int | None = None, example: tuple[int, int] | None = None,
    discovering: list[str] | None = None, features: dict[int, LayerFeatures] | None = None, fused: int | None = None,
    projections: list[nn.Module] | None = None, keep_rows: bool = False, tokens: TokenClasses | None = None,
    triton: bool = False, triton_fallback: bool = False,
) -> str:
    """Run one right-padded batch under `statistics_attention`; `on_layer` gets each layer's sums. Returns the
    batch's path: "triton" when any layer ran the Triton kernel, else "fused" when any ran the fused kernel, else
    "blocked".

    `features`, when given, receives each layer's LayerFeatures; `discovering` collects what is not implemented
    instead of refusing it (discover()). `fused`: run the layers `fusable` accepts through the fused kernel when
    the batch is at least this many tokens long (0: always; None: never). `triton`: run the layers the Triton kernel
    covers (triton_path.reason) through it, before the fused kernel is considered; `triton_fallback` (--attention
    auto): a kernel Triton cannot compile or launch here sends the layer to the fused or blocked path instead of
    stopping the run. `projections`: each layer's output
    projection (values.find_projections), to measure the value-weighted scores and output_norm too. `keep_rows`:
    the sums handed to `on_layer` keep every row's values too (`SentenceSums.rows`).
    `tokens`: the batch's token ids and punctuation flags, for `punctuation`, `duplicate` and the mass each key
    receives (SentenceSums.received, for top_tokens.csv; on the fused path computed only if `on_layer` reads it).
    """
    modules = attention_modules(loaded.model)
    info = Batch(
        layers={id(m): layer for layer, (m, _) in enumerate(modules)}, last_layer=len(modules) - 1,
        special=special, sink=sink, window=window, bins=bins, budget_bytes=int(budget_mib * 2**20),
        block_rows=block_rows, example=example, on_layer=on_layer, discovering=discovering, fused=fused,
        projections=projections, keep_rows=keep_rows, tokens=tokens, triton=triton,
        triton_fallback=triton_fallback,
    )
    if features is not None:
        info.features = features
    seen: list[int] = []

    def record(layer: int, sums: SentenceSums, maps: Tensor | None) -> None:
        seen.append(layer)
        on_layer(layer, sums, maps)

    info.on_layer = record
    token = _ACTIVE.set(info)
    try:
        loaded.model(**forward_kwargs(loaded.model, input_ids, attention_mask))
    except LastLayerDone:
        pass
    finally:
        _ACTIVE.reset(token)
    missing = sorted(set(range(len(modules))) - set(seen))
    if missing:
        raise AttnprobeError(f"model {loaded.spec} did not call attnprobe's statistics attention in layer(s) "
                             f"{missing}: use --attention eager")
    return next(path for path in ("triton", "fused", "blocked") if path in info.ran or path == "blocked")
