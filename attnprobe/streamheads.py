"""Streaming heads (DuoAttention): what a decoder loses when chosen KV heads keep only a sink and a recent window.

A KV-cache compressor such as DuoAttention or kvpress's `DuoAttentionPress` keeps the full cache for some KV heads
and, for the others (the *streaming* heads), only the first S keys (the attention sinks) and the last W keys. On a
document read token by token this means: a query head reading a streaming KV head sees, at position i, the keys
j <= i with j < S or j > i - W (the W most recent keys, its own included), the same keys as `sink_window`; every
other head sees all its keys. Under grouped-query attention the cache is per KV head, so a streaming KV head makes
all of its query heads streaming (`pool`: the pooling of `export.pool_kv_heads` read the other way).

The attention is attnprobe's own, registered with transformers' AttentionInterface under `attnprobe_streaming`
(`streaming`): eager attention in blocks of query rows (as `kernel.attend`), with the sink + window mask applied
per head and per batch row, so stacked copies of a batch can each have other heads streaming. No [n, n] map exists:
a block's scores are [batch, head, rows, keys], sized from a memory budget. The model's own mask (causal, a sliding
window), scale, soft-capping and learned sink logits are kept; anything else is refused in one line.

`streaming_ablate_loaded` measures, per predicted token, the loss, its change and KL(full cache || streaming)
against the same model with no head streaming, for the chosen heads and along a curve: the share of KV heads made
streaming, in the order a pattern ranks them (lowest score first, as kvpress takes them) and in a random order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from attnprobe import defaults
from attnprobe.bootstrap import (
    BLOCK,
    CONFIDENCE,
    DEFAULT_RESAMPLES,
    POISSON,
    BlockResampler,
    block_length,
    bootstrap_method,
    interval,
    poisson_weights,
)
from attnprobe.corpus import Corpus, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.export import DUO_CONFIG_FILE, DUO_SCORES_FILE
from attnprobe.model import LoadedModel, attention_modules, load_model, using_attention
from attnprobe.naming import head_name

NAME = "attnprobe_streaming"
DUO_SINK, DUO_RECENT = 128, 256  # DuoAttention's sink_size and recent_size, where nothing else gives S and W
SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # the curve's shares of KV heads made streaming
DEFAULT_SPARSITY = 0.5
MEASURES = ("loss", "loss_change", "kl")
Progress = Any  # ablate.Progress: (stage, done, total)


@dataclass(frozen=True)
class Plan:
    """What the streaming attention needs while a forward pass runs."""

    layers: dict[int, int]  # id(attention module) -> layer index
    streaming: Tensor  # [rows, layer, kv head] bool: rows 1 (every batch row alike) or the batch's rows
    sink: int  # S: the first keys a streaming head keeps
    recent: int  # W: the last keys it keeps, its own included
    budget_bytes: int  # memory for one block of query rows


@dataclass
class Pattern:
    """Per KV head, how much it needs its full cache (higher: more), and the S and W that came with it."""

    scores: np.ndarray  # [layer, kv head]
    sink: int | None
    recent: int | None
    source: str  # what it was read from, in words


@dataclass
class StreamingAblation:
    curve: pd.DataFrame  # streaming.csv: the chosen heads, and per order and share of KV heads streaming
    run: dict[str, Any]  # streaming.json: provenance, settings, the chosen heads and their result


_ACTIVE: ContextVar[Plan | None] = ContextVar("attnprobe_streaming_plan", default=None)


# ---- the attention ---------------------------------------------------------------------------------------


def pool(streaming: Tensor, groups: int) -> Tensor:
    """[..., kv head] -> [..., query head]: query head h reads KV head h // groups (repeat_kv), and is streaming
    exactly when its KV head is."""
    return streaming.repeat_interleave(groups, dim=-1)


def streaming_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """The AttentionInterface function: eager attention with the active Plan's heads streaming; (output, None)."""
    from attnprobe import kernel

    plan = _ACTIVE.get()
    if plan is None:
        raise AttnprobeError("attnprobe's streaming attention runs only inside attnprobe.streamheads.streaming")
    problems: list[str] = []
    features, sinks = kernel.layer_features(module, query, key, attention_mask, scaling, dropout, kwargs, problems)
    if problems:
        raise AttnprobeError(f"the streaming-head ablation does not implement {problems[0]}: use a model whose "
                             "attention is causal, with or without a sliding window")
    if not features.causal:
        raise AttnprobeError("streaming heads are a decoder's (a KV cache): this attention is bidirectional")
    streaming = plan.streaming[:, plan.layers[id(module)]]  # [rows, kv head]
    if streaming.shape[0] not in (1, query.shape[0]) or streaming.shape[1] != key.shape[1]:
        raise ValueError(f"streaming heads {tuple(streaming.shape)} for a batch of {query.shape[0]} rows and "
                         f"{key.shape[1]} KV heads")
    real = attention_mask.bool()  # [batch, key]: stats_mask's padding mask
    output = attend(query, key, value, real, features.scale, pool(streaming, features.groups).to(query.device),
                    plan.sink, plan.recent, plan.budget_bytes, span=features.span, softcap=features.softcap,
                    sinks=sinks)
    return output, None


def block_rows(batch: int, heads: int, keys: int, budget_bytes: int, span: int | None) -> int:
    """Query rows per block: `kernel.block_size`'s rule (a windowed layer's block sees its rows + span - 1 keys)."""
    from attnprobe import kernel

    return kernel.block_size(batch, heads, keys, budget_bytes, None if span is None else span - 1)


def attend(
    query: Tensor, key: Tensor, value: Tensor, real: Tensor, scale: float, streaming: Tensor, sink: int, recent: int,
    budget_bytes: int, span: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Causal eager attention, block by block of query rows: output [batch, query, head, dim].

    query [batch, head, n, dim], key and value [batch, kv head, n, dim], real [batch, key] (padding mask),
    streaming [rows, head] (rows 1 or batch): where True, the head's row i sees only keys j < sink or
    j > i - recent. `span`: the layer's own window (i - span < j); `softcap`: scores -> softcap tanh(scores /
    softcap); `sinks` [head]: a learned logit per head that joins each row's softmax. Scores are scaled in the
    model's dtype and the softmax taken in float32, as eager attention does.
    """
    from attnprobe import kernel

    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query heads sharing one KV head
    keys_t = key.transpose(-1, -2)  # [batch, kv head, dim, key]: a view
    output = query.new_empty(batch, n, heads, dim)  # [batch, query, head, dim]
    rows = block_rows(batch, heads, n, budget_bytes, span)
    chosen = streaming[:, :, None, None] if bool(streaming.any()) else None  # [rows, head, 1, 1]
    sink_logits = None if sinks is None else sinks.float().view(1, heads, 1, 1)  # [1, head, 1, 1]
    lowest = torch.finfo(torch.float32).min
    for q0 in range(0, n, rows):
        q1 = min(n, q0 + rows)
        k0, k1 = kernel.block_keys(q0, q1, n, True, span)
        q_block = query[:, :, q0:q1].reshape(batch, kv_heads, groups * (q1 - q0), dim)  # [batch, kv, g*r, dim]
        scores = (q_block @ keys_t[..., k0:k1]).mul_(scale)  # [batch, kv, g*r, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap  # [batch, kv, g*r, keys]
        scores = scores.view(batch, heads, q1 - q0, k1 - k0).float()  # [batch, head, r, keys]
        allowed = block_mask(real, q0, q1, k0, k1, span, chosen, sink, recent)  # [batch, 1 or head, r, keys]
        scores.masked_fill_(~allowed, lowest)
        p = softmax(scores, sink_logits)  # [batch, head, r, keys]
        weights = p.to(value.dtype).view(batch, kv_heads, groups * (q1 - q0), k1 - k0)  # [batch, kv, g*r, keys]
        out = (weights @ value[:, :, k0:k1]).view(batch, heads, q1 - q0, dim)  # [batch, head, r, dim]
        output[:, q0:q1] = out.transpose(1, 2)  # [batch, r, head, dim]
    return output


def block_mask(real: Tensor, q0: int, q1: int, k0: int, k1: int, span: int | None, chosen: Tensor | None,
               sink: int, recent: int) -> Tensor:
    """The keys [k0, k1) each query row [q0, q1) may see: real, causal, within the layer's window, and for the
    streaming heads (chosen [rows, head, 1, 1], None: none) a sink or a recent key. [batch, 1 or head, r, keys]."""
    i = torch.arange(q0, q1, device=real.device)[:, None]  # [r, 1]
    j = torch.arange(k0, k1, device=real.device)[None, :]  # [1, keys]
    visible = j <= i  # [r, keys]
    if span is not None:
        visible = visible & (j > i - span)
    allowed = visible[None, None] & real[:, None, None, k0:k1]  # [batch, 1, r, keys]
    if chosen is None:
        return allowed
    near = (j < sink) | (j > i - recent)  # [r, keys]: what a sink + window cache keeps
    return allowed & (near[None, None] | ~chosen)  # [batch, head, r, keys]


def softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """softmax over the keys [batch, head, r, keys]; `sinks` [1, head, 1, 1] join each row as one more column,
    dropped from the result (its rows then sum to less than 1)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)  # [batch, head, r, keys]
    extra = sinks.expand(*scores.shape[:-1], 1)  # [batch, head, r, 1]
    return torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]  # [batch, head, r, keys]


@contextmanager
def streaming(loaded: LoadedModel, heads: Tensor | np.ndarray, sink: int, recent: int,
              budget_mib: int = defaults.BLOCK_MIB) -> Iterator[None]:
    """Run `loaded.model` with the KV heads `heads` [layer, kv head] (or [rows, layer, kv head], per batch row)
    streaming, keeping the first `sink` and last `recent` keys; the model's attention is put back afterwards."""
    from attnprobe import kernel

    check_sizes(sink, recent)
    mask = torch.as_tensor(np.asarray(heads) if isinstance(heads, np.ndarray) else heads, dtype=torch.bool)
    mask = mask[None] if mask.dim() == 2 else mask  # [rows, layer, kv head]
    if tuple(mask.shape[1:]) != (loaded.num_layers, loaded.num_kv_heads):
        raise AttnprobeError(f"streaming heads of shape {tuple(mask.shape[1:])} for {loaded.spec}, which has "
                             f"{loaded.num_layers} layers x {loaded.num_kv_heads} KV heads")
    layers = {id(module): layer for layer, (module, _) in enumerate(attention_modules(loaded.model))}
    plan = Plan(layers, mask.to(loaded.device), int(sink), int(recent), budget_mib * 2**20)
    token = _ACTIVE.set(plan)
    try:
        with using_attention(loaded.model, NAME, streaming_attention, kernel.stats_mask):
            yield
    except kernel.Unsupported as err:  # from the mask function: a KV cache, a chunked or custom mask
        raise AttnprobeError(f"the streaming-head ablation does not implement {err.feature}: use a model whose "
                             "attention is causal, with or without a sliding window") from None
    finally:
        _ACTIVE.reset(token)


def check_model(loaded: LoadedModel) -> None:
    """A decoder whose attention runs through transformers' AttentionInterface."""
    from attnprobe import kernel

    if not loaded.causal:
        raise AttnprobeError(f"{loaded.spec} is an encoder: it keeps no KV cache, so no head can be streaming; use "
                             "--method zero or mean")
    reason = kernel.config_reason(loaded)
    if reason is not None:
        raise AttnprobeError(f"the streaming-head ablation cannot run {reason}: use another decoder")


def check_sizes(sink: int, recent: int) -> None:
    if sink < 0:
        raise AttnprobeError(f"--sink-size {sink} is below 0: use 0 or more (DuoAttention uses {DUO_SINK})")
    if recent < 1:
        raise AttnprobeError(f"--recent-size {recent} is below 1: a streaming head keeps at least its own key; use "
                             f"1 or more (DuoAttention uses {DUO_RECENT})")


# ---- which heads ---------------------------------------------------------------------------------------


def read_pattern(folder: str | Path) -> Pattern:
    """The per-KV-head scores of `folder`: a DuoAttention pattern (full_attention_heads.tsv, read as DuoAttention
    and kvpress read it: tab-separated, clipped to [0, 1]; config.json's sink_size and recent_size if present),
    or an attnprobe results folder (`export.load_scores`, pooled over each KV head's query heads)."""
    from attnprobe import export, io

    folder = Path(folder)
    if not folder.is_dir():
        raise AttnprobeError(f"--pattern {folder} is not a folder: pass an `attnprobe export --format duo-attention` "
                             "folder or an `attnprobe analyze` results folder")
    table = folder / DUO_SCORES_FILE
    if not table.is_file():
        if not (folder / io.RUN_FILE).is_file() and not (folder / io.RETRIEVAL_RUN_FILE).is_file():
            raise AttnprobeError(f"--pattern {folder} holds no {DUO_SCORES_FILE} and no results: write one with "
                                 "`attnprobe export --format duo-attention --to DIR`, or pass an analyze --out folder")
        scores = export.load_scores(folder)
        pooled = export.pool_kv_heads(scores.per_query, scores.model["kv_heads"])  # [layer, kv head]
        return Pattern(pooled, scores.sink, scores.recent, f"{folder} ({scores.source} scores)")
    try:
        values = np.loadtxt(table, dtype=float, delimiter="\t", ndmin=2)  # [layer, kv head]
    except (ValueError, OSError, UnicodeDecodeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AttnprobeError(f"{table} is not a tab-separated table of numbers ({first}): write it again with "
                             "`attnprobe export --format duo-attention`") from None
    if values.size == 0 or not np.isfinite(values).all():
        raise AttnprobeError(f"{table} is empty or holds a value that is not a finite number: write it again with "
                             "`attnprobe export --format duo-attention`")
    sink, recent = read_pattern_config(folder / DUO_CONFIG_FILE)
    return Pattern(np.clip(values, 0.0, 1.0), sink, recent, str(table))


def read_pattern_config(path: Path) -> tuple[int | None, int | None]:
    """config.json's sink_size and recent_size (None, None without the file)."""
    if not path.is_file():
        return None, None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise AttnprobeError(f"{path} is not readable JSON ({type(err).__name__}): write it again with `attnprobe "
                             "export --format duo-attention`") from None
    sizes = [config.get(k) if isinstance(config, dict) else None for k in ("sink_size", "recent_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes):
        raise AttnprobeError(f"{path} needs whole numbers sink_size and recent_size of 0 or more: write it again "
                             "with `attnprobe export --format duo-attention`")
    return int(sizes[0]), int(sizes[1])


def check_pattern(pattern: Pattern, loaded: LoadedModel) -> None:
    shape = (loaded.num_layers, loaded.num_kv_heads)
    if pattern.scores.shape != shape:
        rows, columns = pattern.scores.shape
        raise AttnprobeError(f"--pattern {pattern.source} has {rows} layers x {columns} KV heads but {loaded.spec} "
                             f"has {shape[0]} x {shape[1]}: export the pattern of this model")


def check_fraction(option: str, value: float) -> None:
    if not (0.0 <= value <= 1.0):  # NaN too
        raise AttnprobeError(f"{option} {value}: use a share of the KV heads from 0 to 1 (0.5 = half of them)")


def ranked(scores: np.ndarray) -> list[tuple[int, int]]:
    """KV heads (layer, kv head) from the lowest score (streaming first) to the highest; ties in layer, head order
    (kvpress's np.argsort(axis=None) breaks ties its own way)."""
    layers, kv_heads = scores.shape
    order = np.argsort(scores.reshape(-1), kind="stable")
    return [(int(k) // kv_heads, int(k) % kv_heads) for k in order]


def random_order(layers: int, kv_heads: int, seed: int) -> list[tuple[int, int]]:
    every = [(layer, head) for layer in range(layers) for head in range(kv_heads)]
    return [every[int(k)] for k in np.random.default_rng([seed, 2]).permutation(len(every))]


def first_share(order: list[tuple[int, int]], share: float, layers: int, kv_heads: int) -> np.ndarray:
    """[layer, kv head] bool: the first round(size x share) KV heads of `order` streaming (kvpress's count)."""
    mask = np.zeros((layers, kv_heads), dtype=bool)
    for layer, head in order[: round(layers * kv_heads * share)]:
        mask[layer, head] = True
    return mask


def heads_mask(heads: list[tuple[int, int]], layers: int, kv_heads: int) -> np.ndarray:
    """[layer, kv head] bool from named KV heads, each checked against the model."""
    from attnprobe.naming import check_heads_exist

    if not heads:
        raise AttnprobeError("--heads names no KV head: give e.g. L0H1,L2H0 (layer, KV head)")
    check_heads_exist(heads, layers, kv_heads)
    mask = np.zeros((layers, kv_heads), dtype=bool)
    for layer, head in heads:
        mask[layer, head] = True
    return mask


# ---- measuring -----------------------------------------------------------------------------------------


def streaming_ablate(model: str, corpus: str, *, split: str = "lines", limit: int | None = None, device: str = "auto",
                     dtype: str = "float32", **kwargs: Any) -> StreamingAblation:
    """`streaming_ablate_loaded` on `model` (loaded with its LM head) over `corpus` (read with `split`)."""
    text = read_corpus(corpus, split=split).head(limit)
    loaded = load_model(model, device, dtype, lm_head=True)
    return streaming_ablate_loaded(loaded, text, **kwargs)


def streaming_ablate_loaded(
    loaded: LoadedModel, corpus: Corpus, *, pattern: str | Path | None = None,
    heads: list[tuple[int, int]] | None = None, sparsity: float = DEFAULT_SPARSITY, sink: int | None = None,
    recent: int | None = None, shares: tuple[float, ...] = SHARES, curve: bool = True, batch_size: int = 1,
    resamples: int = DEFAULT_RESAMPLES, seed: int = 0, progress: Progress | None = None,
) -> StreamingAblation:
    """Make KV heads streaming and measure the loss change per token, for the chosen heads (the `sparsity` share of
    `pattern`'s lowest-scoring KV heads, or the KV heads `heads`) and, with `curve`, at each of `shares` in the
    pattern's order and a random one (seeded). S and W: `sink` and `recent`, else the pattern's, else 128 and 256."""
    from attnprobe import ablate as ab
    from attnprobe.analysis import check_options, tokenize

    started = time.perf_counter()
    check_options(batch_size, resamples, seed)
    check_fraction("--sparsity", sparsity)
    for share in shares:
        check_fraction("--shares", share)
    check_model(loaded)
    if (pattern is None) == (heads is None):
        raise AttnprobeError("--method streaming needs the heads to make streaming: --pattern DIR (an `attnprobe "
                             "export` folder; --sparsity picks its lowest-scoring share) or --heads L0H1,... (KV "
                             "heads), not both")
    layers, kv_heads = loaded.num_layers, loaded.num_kv_heads
    found = None if pattern is None else read_pattern(pattern)
    if found is not None:
        check_pattern(found, loaded)
    sink = sink if sink is not None else (found.sink if found is not None and found.sink is not None else DUO_SINK)
    recent = recent if recent is not None else (
        found.recent if found is not None and found.recent is not None else DUO_RECENT)
    check_sizes(sink, recent)
    orders = {"pattern": ranked(found.scores)} if found is not None else {}
    chosen = first_share(orders["pattern"], sparsity, layers, kv_heads) if found is not None else \
        heads_mask(heads, layers, kv_heads)
    orders["random"] = random_order(layers, kv_heads, seed)
    points = [("chosen", int(chosen.sum()) / chosen.size, chosen)]
    if curve:
        points += [(order, share, first_share(ranked_heads, share, layers, kv_heads))
                   for order, ranked_heads in orders.items() for share in shares]
    masks: dict[bytes, tuple[int, np.ndarray]] = {}
    columns = [masks.setdefault(mask.tobytes(), (len(masks), mask))[0] for _, _, mask in points]
    tokens = tokenize(loaded, corpus)
    ids = tokens.ids
    if all(len(t) < 2 for t in ids):
        raise AttnprobeError("every sequence of the corpus is a single token: a decoder has nothing to predict")
    stack = ab.find_stack(loaded)
    batches = ab.make_batches(loaded, ids, batch_size)
    every_token = bootstrap_method(sum(len(t) > 1 for t in ids)) == BLOCK  # the block bootstrap needs each token's
    values, counts = measure(loaded, stack, batches, [mask for _, mask in masks.values()], sink, recent,
                             every_token, progress)
    summary, basis = summarize(values, counts, len(masks), resamples, seed)
    rows = []
    for (order, share, mask), column in zip(points, columns):
        row: dict[str, Any] = {"order": order, "share": share, "kv_heads_streaming": int(mask.sum())}
        for name in MEASURES:
            mean, low, high = (summary[part][MEASURES.index(name), column] for part in ("mean", "low", "high"))
            row.update({name: mean, f"{name}_ci_low": low, f"{name}_ci_high": high})
        rows.append(row)
    frame = pd.DataFrame(rows)
    run = run_info(loaded, corpus, ids, found, chosen, sink, recent, sparsity, shares if curve else (),
                   list(orders) if curve else [], batch_size, resamples, seed, basis, frame.iloc[0])
    if tokens.cut:
        run["notes"].append(f"{len(tokens.cut)} sequence{'' if len(tokens.cut) == 1 else 's'} cut to the model's "
                            f"context of {loaded.max_length} tokens (the first at corpus line {tokens.cut[0][0]})")
    run["wall_seconds"] = round(time.perf_counter() - started, 3)
    return StreamingAblation(frame, run)


@torch.inference_mode()
def measure(loaded: LoadedModel, stack: Any, batches: list[Any], masks: list[np.ndarray], sink: int, recent: int,
            every_token: bool = True, progress: Progress | None = None
            ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Per sequence (corpus index) with a token to predict: [measure, mask, predicted token] of the loss, its change
    and the KL against the same model with no head streaming (a mask with no head streaming: exactly 0), or without
    `every_token` their sums over the tokens [measure, mask, 1]; and the tokens predicted per sequence."""
    from attnprobe import ablate as ab

    none = np.zeros((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    busy = [k for k, mask in enumerate(masks) if mask.any()]
    all_masks = torch.as_tensor(np.stack(masks), device=loaded.device)  # [mask, layer, kv head]
    out: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    total, done = sum(len(b.indices) for b in batches), 0
    for batch in batches:
        with streaming(loaded, none, sink, recent):
            final = ab.run_full(loaded, batch, 1)  # [batch, seq, hidden]
        ref = ab.reference(stack, batch, final, True)
        nll = ref["nll"][None].repeat(len(masks), 1)  # [mask, predicted]
        kl = torch.zeros_like(nll)  # [mask, predicted]
        size = ab.group_size(batch, len(busy)) if busy else 1
        for start in range(0, len(busy), size):
            chunk = busy[start : start + size]
            rows = all_masks[chunk].repeat_interleave(len(batch.indices), dim=0)  # [copies * batch, layer, kv]
            with streaming(loaded, rows, sink, recent):
                final = ab.run_full(loaded, batch, len(chunk))  # [copies * batch, seq, hidden]
            nll[chunk], kl[chunk] = ab.token_measures(stack, batch, ref, final)  # [copies, predicted] each
        both = torch.stack([nll, nll - ref["nll"][None], kl]).cpu().numpy()  # [measure, mask, predicted]
        owner = batch.rows.cpu().numpy()  # [predicted]: the batch row of each predicted token
        for row, index in enumerate(batch.indices):
            mine = owner == row
            if mine.any():
                kept = both[:, :, mine]  # [measure, mask, tokens], in position order
                out[index] = kept if every_token else kept.sum(-1, keepdims=True)  # [measure, mask, tokens or 1]
                counts[index] = int(mine.sum())
        done += len(batch.indices)
        if progress:
            progress("streaming", done, total)
    return out, counts


def summarize(values: dict[int, np.ndarray], tokens: dict[int, int], masks: int, resamples: int, seed: int
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The mean per predicted token over every sequence ([measure, mask]) and its 95% bootstrap interval: Poisson
    over sequences (a resample's tokens of the drawn sequences, pooled), or below FEW_SEQUENCES sequences the
    circular block bootstrap over each sequence's tokens (bootstrap.BlockResampler), which needs `values` per token
    ([measure, mask, token]; the Poisson bootstrap takes their sums [measure, mask, 1] too)."""
    indices = sorted(values)
    width = len(MEASURES) * masks
    sums = np.stack([values[i].reshape(width, -1).sum(-1) for i in indices])  # [sequence, measure x mask]
    counts = np.array([tokens[i] for i in indices], dtype=np.float64)  # [sequence]
    mean = (sums.sum(0) / counts.sum()).reshape(len(MEASURES), masks)  # [measure, mask]
    method = bootstrap_method(len(indices))
    if method == POISSON:
        weights = poisson_weights(indices, resamples, seed)  # [resample, sequence]
        with np.errstate(invalid="ignore", divide="ignore"):
            resampled = (weights @ sums) / (weights @ counts)[:, None]  # [resample, measure x mask]
        basis = {"method": POISSON, "over": "sequences"}
    else:
        total = np.zeros((resamples, width))
        for i in indices:
            rows = tokens[i]
            if values[i].shape[-1] != rows:
                raise ValueError(f"the block bootstrap needs every token's values: sequence {i} has "
                                 f"{values[i].shape[-1]} of {rows}")
            total += BlockResampler.draw(i, rows, resamples, seed).sums(values[i].reshape(width, rows))
        resampled = total / counts.sum()  # [resample, measure x mask]: each resample has every sequence's length
        basis = {"method": BLOCK, "over": "the predicted tokens of each sequence",
                 "block_lengths": [block_length(int(c)) for c in counts]}
    low, high = interval(resampled)  # [measure x mask] each
    shape = (len(MEASURES), masks)
    return {"mean": mean, "low": low.reshape(shape), "high": high.reshape(shape)}, basis


def run_info(
    loaded: LoadedModel, corpus: Corpus, ids: list[Any], pattern: Pattern | None, chosen: np.ndarray, sink: int,
    recent: int, sparsity: float, shares: tuple[float, ...], orders: list[str], batch_size: int, resamples: int,
    seed: int, basis: dict[str, Any], result: pd.Series,
) -> dict[str, Any]:
    from attnprobe.analysis import versions
    from attnprobe.bootstrap import few_items_note

    predicted = [len(t) - 1 for t in ids if len(t) > 1]
    notes = []
    if basis["method"] == BLOCK:
        notes.append(f"only {len(predicted)} sequence{'' if len(predicted) == 1 else 's'}: the 95% intervals "
                     "resample blocks of consecutive tokens within each sequence (another stretch of similar text), "
                     "not other documents")
    short = [n for n in predicted if n + 1 <= sink + recent]
    if short:
        notes.append(f"{len(short)} of {len(predicted)} sequences are no longer than sink + recent = "
                     f"{sink + recent} tokens: a streaming head there still sees every key, so they cannot change; "
                     "use longer documents (--split file or paragraphs)")
    note = few_items_note(len(predicted), "sequence") if basis["method"] == POISSON else None
    notes += [note] if note else []
    from attnprobe.ablate import record_header

    return {
        **record_header(loaded, corpus),
        "sequences": len(ids),
        "bos": loaded.bos,
        "limit": corpus.limit,
        "tokens": int(sum(len(t) for t in ids)),
        "predicted_tokens": int(sum(predicted)),
        "longest": int(max(len(t) for t in ids)),
        "method": "streaming",
        "sink_size": int(sink),
        "recent_size": int(recent),
        "pattern": None if pattern is None else pattern.source,
        "sparsity": float(sparsity) if pattern is not None else None,
        "streaming_heads": [head_name(layer, head) for layer, head in zip(*np.nonzero(chosen))],
        "kv_heads_streaming": int(chosen.sum()),
        "kv_heads": int(chosen.size),
        "result": {k: float(result[k]) for k in result.index if k not in ("order", "share", "kv_heads_streaming")},
        "shares": [float(s) for s in shares],
        "orders": orders,
        "attention": f"{NAME}: eager, in blocks of query rows (no n x n map)",
        "device": str(loaded.device),
        "dtype": loaded.dtype,
        "batch_size": batch_size,
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, **basis},
        "notes": notes,
        "versions": versions(),
    }
