"""Streaming heads (DuoAttention): what a decoder loses when chosen KV heads keep only a sink and a recent window.

A KV-cache compressor such as DuoAttention or kvpress's `DuoAttentionPress` keeps the full cache for some KV heads
and, for the others (the *streaming* heads), only the first S keys (the attention sinks) and the last W keys. Where
and when it cuts differs by client (`kept`):

- `duo-attention` (DuoAttention's own inference): at every position i, prefill included, a query head reading a
  streaming KV head sees the keys j <= i with j < S or j > i - W, the same keys as `sink_window`;
- `kvpress` (kvpress 0.5.5's DuoAttentionPress): the context is prefilled with full attention; afterwards every
  query (the question, the answer, a continuation) misses the context's keys [S, L - W), L the context's length.

Every other head sees all its keys. Under grouped-query attention the cache is per KV head, so a streaming KV head
makes all of its query heads streaming (`pool`: the pooling of `export.pool_kv_heads` read the other way).

The attention is attnprobe's own, registered with transformers' AttentionInterface under `attnprobe_streaming`
(`streaming`): eager attention in blocks of query rows (as `kernel.attend`), with the client's mask applied per head
and per batch row (each row with its own context length), so stacked copies of a batch can each have other heads
streaming. No [n, n] map exists: a block's scores are [batch, head, rows, keys], sized from a memory budget. The
model's own mask (causal, a sliding window), scale, soft-capping and learned sink logits are kept; anything else is
refused in one line.

`streaming_ablate_loaded` measures, per scored token of each task (`kvtasks`: a continuation of the corpus's
documents, or a needle's answer), the loss, its change, KL(full cache || streaming) and the top-1 accuracy against
the same model with no head streaming, for the chosen heads and along a curve: the share of KV heads made streaming,
in the order a pattern ranks them (lowest score first, as kvpress takes them) and in random orders (their mean).
"""

from __future__ import annotations

import json
import math
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

from attnprobe import defaults, kvtasks
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
from attnprobe.naming import counted, head_name
from attnprobe.retrieval import DEFAULT_DEPTHS, DEFAULT_NEEDLE, DEFAULT_QUESTION

NAME = "attnprobe_streaming"
DUO_SINK, DUO_RECENT = 128, 256  # DuoAttention's sink_size and recent_size, where nothing else gives S and W
SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # the curve's shares of KV heads made streaming
DEFAULT_SPARSITY = 0.5
MEASURES = ("loss", "loss_change", "kl", "accuracy")  # accuracy: the model's top-1 next token is the target
RANDOM_ORDERS = 3  # the curve's random orders (their mean is the "random" row)
MAX_RANDOM_ORDERS = 100
Progress = Any  # ablate.Progress: (stage, done, total)


@dataclass(frozen=True)
class Plan:
    """What the streaming attention needs while a forward pass runs."""

    layers: dict[int, int]  # id(attention module) -> layer index
    streaming: Tensor  # [rows, layer, kv head] bool: rows 1 (every batch row alike) or the batch's rows
    sink: int  # S: the first keys a streaming head keeps
    recent: int  # W: the last keys it keeps, its own included
    budget_bytes: int  # memory for one block of query rows
    context: Tensor | None = None  # [batch] kvpress: each row's context length L; None: duo-attention (every row)


@dataclass
class Pattern:
    """Per KV head, how much it needs its full cache (higher: more), and the S and W that came with it."""

    scores: np.ndarray  # [layer, kv head]
    sink: int | None
    recent: int | None
    source: str  # what it was read from, in words
    model: dict[str, Any] | None = None  # the model record of the run it came from (None: unknown)
    notes: tuple[str, ...] = ()  # what streaming.json's notes should say of it (an unchecked model)


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
    context = None if plan.context is None else tiled(plan.context, query.shape[0])  # [batch]
    output = attend(query, key, value, real, features.scale, pool(streaming, features.groups).to(query.device),
                    plan.sink, plan.recent, plan.budget_bytes, span=features.span, softcap=features.softcap,
                    sinks=sinks, context=context)
    return output, None


def tiled(context: Tensor, rows: int) -> Tensor:
    """[batch] -> [rows]: the context lengths of a batch for `rows` stacked copies of it (copy-major, as
    ablate.run_full stacks them)."""
    if rows % context.shape[0]:
        raise ValueError(f"{context.shape[0]} context lengths for a batch of {rows} rows")
    return context.repeat(rows // context.shape[0])  # [rows]


def blocks(batch: int, heads: int, n: int, budget_bytes: int, span: int | None) -> list[tuple[int, int]]:
    """The blocks of query rows [q0, q1) of a causal layer of n rows, each within the budget (`kernel.block_size`'s
    bytes per row and key). A block of rows [q0, q1) sees keys [0, q1), so later blocks take fewer rows and every
    block is about the same size (a windowed layer's blocks, which see their rows + span - 1 keys, are alike already).
    Blocks of one size matter to train-pattern on the CPU: with rows fixed for the last block, the blocks grew from
    one to the next, and under the backward pass glibc's heap fragmented around them (peak memory grew with n^2)."""
    from attnprobe import kernel

    if span is not None:
        rows = kernel.block_size(batch, heads, n, budget_bytes, span - 1)
        return [(q0, min(n, q0 + rows)) for q0 in range(0, n, rows)]
    cells = budget_bytes // (batch * heads * 4 * kernel.blocked.TEMPORARIES)  # rows x keys a block may hold
    found, q0 = [], 0
    while q0 < n:
        rows = max(1, int((math.sqrt(q0 * q0 + 4 * cells) - q0) / 2))  # the most r with r (q0 + r) <= cells
        while rows > 1 and rows * (q0 + rows) > cells:  # the square root's rounding
            rows -= 1
        found.append((q0, min(n, q0 + rows)))
        q0 += rows
    return found


def attend(
    query: Tensor, key: Tensor, value: Tensor, real: Tensor, scale: float, streaming: Tensor, sink: int, recent: int,
    budget_bytes: int, span: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
    context: Tensor | None = None,
) -> Tensor:
    """Causal eager attention, block by block of query rows: output [batch, query, head, dim].

    query [batch, head, n, dim], key and value [batch, kv head, n, dim], real [batch, key] (padding mask),
    streaming [rows, head] (rows 1 or batch): where True, the head's row i sees only keys j < sink or
    j > i - recent (DuoAttention), or with `context` [batch] (kvpress, each row's context length L) every key
    while i < L and afterwards every key but those of [sink, L - recent). `span`: the layer's own window
    (i - span < j); `softcap`: scores -> softcap tanh(scores / softcap); `sinks` [head]: a learned logit per
    head that joins each row's softmax. Scores are scaled in the model's dtype and the softmax taken in float32,
    as eager attention does.
    """
    from attnprobe import kernel

    batch, heads, n, dim = query.shape
    keys_t = key.transpose(-1, -2)  # [batch, kv head, dim, key]: a view
    output = query.new_empty(batch, n, heads, dim)  # [batch, query, head, dim]
    padded = None if bool(real.all()) else ~real[:, None, None, :]  # [batch, 1, 1, key]
    runs = streaming_runs(streaming)
    sink_logits = None if sinks is None else sinks.float().view(1, heads, 1, 1)  # [1, head, 1, 1]
    for q0, q1 in blocks(batch, heads, n, budget_bytes, span):
        k0, k1 = kernel.block_keys(q0, q1, n, True, span)
        scores = block_scores(query, keys_t, q0, q1, k0, k1, scale, softcap)  # [batch, head, r, keys]
        hide(scores, q0, k0, span, padded, runs, sink, recent, context)
        out = block_output(softmax(scores, sink_logits), value, k0, k1)  # [batch, head, r, dim]
        output[:, q0:q1] = out.transpose(1, 2)  # [batch, r, head, dim]
    return output


def block_scores(query: Tensor, keys_t: Tensor, q0: int, q1: int, k0: int, k1: int, scale: float,
                 softcap: float | None) -> Tensor:
    """The scores of query rows [q0, q1) against keys [k0, k1) in float32 (float64 for a float64 model): query
    [batch, head, n, dim], keys_t [batch, kv head, dim, n]; scaled (and soft-capped) in the model's dtype as eager
    attention does. Returns [batch, head, r, keys]."""
    batch, heads, _, dim = query.shape
    kv_heads = keys_t.shape[1]
    groups = heads // kv_heads  # query heads sharing one KV head
    q_block = query[:, :, q0:q1].reshape(batch, kv_heads, groups * (q1 - q0), dim)  # [batch, kv, g*r, dim]
    scores = (q_block @ keys_t[..., k0:k1]).mul_(scale)  # [batch, kv, g*r, keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # [batch, kv, g*r, keys]
    return scores.view(batch, heads, q1 - q0, k1 - k0).to(wide(scores.dtype))  # [batch, head, r, keys]


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax: float32, or float64 for a float64 model (a test's exact reference)."""
    return torch.promote_types(dtype, torch.float32)


def block_output(p: Tensor, value: Tensor, k0: int, k1: int) -> Tensor:
    """The weights p [batch, head, r, keys] (`wide`) applied to the values [k0, k1) of value [batch, kv head, n,
    dim], in the values' dtype: [batch, head, r, dim]."""
    batch, heads, rows, keys = p.shape
    kv_heads = value.shape[1]
    weights = p.to(value.dtype).view(batch, kv_heads, heads // kv_heads * rows, keys)  # [batch, kv, g*r, keys]
    return (weights @ value[:, :, k0:k1]).view(batch, heads, rows, value.shape[-1])  # [batch, head, r, dim]


def streaming_runs(streaming: Tensor) -> list[tuple[int, int, Tensor | bool]]:
    """The heads of `streaming` [rows, head] as runs of neighbouring heads that stream in the same batch rows (a KV
    head's query heads make one): (first head, last head + 1, which rows stream them: True every row, False none,
    else [rows, 1, 1, 1] bool)."""
    columns = list(zip(*streaming.tolist()))  # per head, whether each row streams it
    runs: list[tuple[int, int, Tensor | bool]] = []
    first = 0
    for end in range(1, len(columns) + 1):
        if end < len(columns) and columns[end] == columns[first]:
            continue
        every, none = all(columns[first]), not any(columns[first])
        runs.append((first, end, every if every or none else streaming[:, first, None, None, None]))  # [rows, 1, 1, 1]
        first = end
    return runs


def hide(scores: Tensor, q0: int, k0: int, span: int | None, padded: Tensor | None,
         runs: list[tuple[int, int, Tensor | bool]], sink: int, recent: int, context: Tensor | None = None) -> None:
    """Set to the float32 minimum, in place, the scores [batch, head, r, keys] (rows from q0, keys from k0) of the keys
    a row may not see: later keys and those outside the layer's window (`span`), padded keys (`padded` [batch, 1, 1,
    key] or None), and in the streaming heads (the `runs` of streaming_runs) the keys `kept` drops.

    As kernel.mask_plan, only a strip of columns where some row sees less is touched and no [batch, head, r, keys]
    mask is built; here the strip follows from the positions alone (no device sync): it runs to the block's end from
    row q0's next key (from the block's first key where the window or padding may hide it), in a streaming head from
    the first key after the sinks at the latest. Each head's scores are filled once."""
    rows, keys = scores.shape[-2:]
    q1, k1 = q0 + rows, k0 + keys
    lo = k0 if padded is not None or (span is not None and k0 <= q1 - 1 - span) else max(k0, q0 + 1)  # every head's
    streams = any(chosen is not False for _, _, chosen in runs) and max(k0, sink) < min(k1, q1 - recent)
    first_key = min(lo, max(k0, sink)) if streams else lo  # the strip: [first_key, k1)
    if first_key >= k1:
        return
    i = torch.arange(q0, q1, device=scores.device)[:, None]  # [r, 1]
    j = torch.arange(first_key, k1, device=scores.device)[None, :]  # [1, strip]
    hidden = j > i  # [r, strip]
    if span is not None:
        hidden |= j <= i - span
    if padded is not None:
        hidden = hidden | padded[..., first_key:k1]  # [batch, 1, r, strip]
    missed = ~kept(i, j, sink, recent, context) if streams else None  # [1 or batch, 1, r, strip]
    lowest = torch.finfo(torch.float32).min
    for first, end, chosen in runs:
        if chosen is False or not streams:
            if lo < k1:
                scores[:, first:end, :, lo - k0 :].masked_fill_(hidden[..., lo - first_key :], lowest)  # [b, run, r, .]
            continue
        either = hidden | (missed if chosen is True else missed & chosen)  # [1 or batch, 1, r, strip]
        scores[:, first:end, :, first_key - k0 :].masked_fill_(either, lowest)  # [batch, run, r, strip]


def kept(i: Tensor, j: Tensor, sink: int, recent: int, context: Tensor | None) -> Tensor:
    """What a streaming head's query i [r, 1] sees of keys j [1, keys] (both absolute positions), [1 or batch, 1,
    r, keys]. DuoAttention (context None): a sink or one of the `recent` latest keys, at every position. kvpress
    (context [batch], each row's context length L): kvpress 0.5.5's DuoAttentionPress prefills the context with full
    attention, then hides the context keys [sink, L - recent) from every later query (`sink : -recent` of the
    prefill's keys), so queries i < L see every key and later ones all but those."""
    if context is None:
        return ((j < sink) | (j > i - recent))[None, None]  # [1, 1, r, keys]
    length = context[:, None, None, None]  # [batch, 1, 1, 1]
    return (i < length) | (j < sink) | (j >= length - recent)  # [batch, 1, r, keys]


def softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """softmax over the keys [batch, head, r, keys]; `sinks` [1, head, 1, 1] join each row as one more column,
    dropped from the result (its rows then sum to less than 1)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)  # [batch, head, r, keys]
    extra = sinks.expand(*scores.shape[:-1], 1)  # [batch, head, r, 1]
    return torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]  # [batch, head, r, keys]


@contextmanager
def streaming(loaded: LoadedModel, heads: Tensor | np.ndarray, sink: int, recent: int,
              budget_mib: float = defaults.BLOCK_MIB, context: Tensor | list[int] | None = None) -> Iterator[None]:
    """Run `loaded.model` with the KV heads `heads` [layer, kv head] (or [rows, layer, kv head], per batch row)
    streaming, keeping the first `sink` and last `recent` keys; the model's attention is put back afterwards.
    `context` [batch]: each batch row's context length, for the kvpress client (`kept`); None: DuoAttention's."""
    from attnprobe import kernel

    check_sizes(sink, recent)
    mask = torch.as_tensor(np.asarray(heads) if isinstance(heads, np.ndarray) else heads, dtype=torch.bool)
    mask = mask[None] if mask.dim() == 2 else mask  # [rows, layer, kv head]
    if tuple(mask.shape[1:]) != (loaded.num_layers, loaded.num_kv_heads):
        raise AttnprobeError(f"streaming heads of shape {tuple(mask.shape[1:])} for {loaded.spec}, which has "
                             f"{loaded.num_layers} layers x {loaded.num_kv_heads} KV heads")
    layers = {id(module): layer for layer, (module, _) in enumerate(attention_modules(loaded.model))}
    lengths = None if context is None else torch.as_tensor(context, dtype=torch.long, device=loaded.device)
    plan = Plan(layers, mask.to(loaded.device), int(sink), int(recent), int(budget_mib * 2**20), lengths)
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
    check_decoder(loaded, "so no head can be streaming; use --method zero or mean",
                  "the streaming-head ablation cannot run")


def check_decoder(loaded: LoadedModel, encoder_fix: str, cannot: str) -> None:
    """Refuse, in one line, an encoder (`encoder_fix` ends the line) or a model whose attention does not run
    through transformers' AttentionInterface (`cannot` begins the line)."""
    from attnprobe import kernel

    if not loaded.causal:
        raise AttnprobeError(f"{loaded.spec} is an encoder: it keeps no KV cache, {encoder_fix}")
    reason = kernel.config_reason(loaded)
    if reason is not None:
        raise AttnprobeError(f"{cannot} {reason}: use another decoder")


def check_sizes(sink: int, recent: int, default_sink: object = DUO_SINK, default_recent: object = DUO_RECENT) -> None:
    """S and W of a streaming head; the defaults the message quotes are the run's (a --pattern's config.json's)."""
    from attnprobe import limits

    if sink < 0:
        raise AttnprobeError(f"--sink-size {sink} is below 0: use 0 or more (DuoAttention uses {DUO_SINK})")
    if recent < 1:
        raise AttnprobeError(f"--recent-size {recent} is below 1: a streaming head keeps at least its own key; use "
                             f"1 or more (DuoAttention uses {DUO_RECENT})")
    limits.check_whole("--sink-size", sink, 0, limits.MAX_POSITIONS, default_sink)
    limits.check_whole("--recent-size", recent, 1, limits.MAX_POSITIONS, default_recent)


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
        if not any((folder / name).is_file() for name in (io.RUN_FILE, io.RETRIEVAL_RUN_FILE, export.TRAINED_RUN_FILE)):
            raise AttnprobeError(f"--pattern {folder} holds no {DUO_SCORES_FILE} and no results: write one with "
                                 "`attnprobe export --format duo-attention --to DIR`, or pass an analyze --out folder")
        scores = export.load_scores(folder)
        pooled, _ = export.duo_attention(scores)  # [layer, kv head], as `export` writes it (ties broken)
        return Pattern(pooled, scores.sink, scores.recent, f"{folder} ({scores.source} scores)", scores.model)
    try:
        values = np.loadtxt(table, dtype=float, delimiter="\t", ndmin=2)  # [layer, kv head]
    except (ValueError, OSError, UnicodeDecodeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AttnprobeError(f"{table} is not a tab-separated table of numbers ({first}): write it again with "
                             "`attnprobe export --format duo-attention`") from None
    if values.size == 0 or not np.isfinite(values).all():
        raise AttnprobeError(f"{table} is empty or holds a value that is not a finite number: write it again with "
                             "`attnprobe export --format duo-attention`")
    outside = values[(values < 0) | (values > 1)]
    if outside.size:
        raise AttnprobeError(f"{table} holds {outside[0]:g}, outside [0, 1] (a score of how much a KV head needs its "
                             "full cache): write it again with `attnprobe export --format duo-attention`")
    sink, recent = read_pattern_config(folder / DUO_CONFIG_FILE)
    model, notes = pattern_model(folder, table)
    return Pattern(values, sink, recent, str(table), model, notes)


def pattern_model(folder: Path, table: Path) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The model a DuoAttention folder was exported from: attnprobe.json's duo-attention record (where it records
    this table unchanged), else the run.json or retrieval.json beside it; (None, a note) where nothing tells."""
    from attnprobe import export, io

    record = export.read_provenance(folder, "--pattern").get("exports", {}).get("duo-attention")
    if isinstance(record, dict) and isinstance(record.get("model"), dict):
        if record.get("files", {}).get(DUO_SCORES_FILE) == io.hash_file(table):
            return record["model"], ()
        return None, (f"--pattern {table} changed since `attnprobe export` wrote it: the model it scores was not "
                      "checked",)
    for name in (io.RUN_FILE, io.RETRIEVAL_RUN_FILE):
        if (folder / name).is_file():
            run = io.read_json(folder, name, "attnprobe analyze" if name == io.RUN_FILE else "attnprobe retrieval")
            if isinstance(run.get("model"), dict):
                return run["model"], ()
    return None, (f"--pattern {folder} records no model (no {export.PROVENANCE_FILE}, {io.RUN_FILE} or "
                  f"{io.RETRIEVAL_RUN_FILE} beside {DUO_SCORES_FILE}): only its shape was checked against the "
                  "model's; export it again with `attnprobe export` to have it checked",)


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
    from attnprobe import limits

    if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= limits.MAX_POSITIONS
               for v, low in zip(sizes, (0, 1))):
        raise AttnprobeError(f"{path} needs whole numbers sink_size from 0 and recent_size from 1, up to "
                             f"{limits.MAX_POSITIONS:,}: write it again with `attnprobe export --format duo-attention`")
    return int(sizes[0]), int(sizes[1])


def check_pattern(pattern: Pattern, loaded: LoadedModel) -> list[str]:
    """Refuse a pattern of another shape or of another model than `loaded` (the model its run.json or attnprobe.json
    records: the weights fingerprint where both sides have one, else the spec or source). Returns the notes for
    streaming.json (a pattern that records no model)."""
    shape = (loaded.num_layers, loaded.num_kv_heads)
    if pattern.scores.shape != shape:
        rows, columns = pattern.scores.shape
        raise AttnprobeError(f"--pattern {pattern.source} has {rows} layers x {columns} KV heads but {loaded.spec} "
                             f"has {shape[0]} x {shape[1]}: export the pattern of this model")
    if pattern.model is not None:
        from attnprobe.records import model_weights

        recorded = pattern.model.get("weights")
        found = model_weights(loaded) if recorded else None
        names = {str(pattern.model.get(k)) for k in ("spec", "source") if pattern.model.get(k)}
        same = found == recorded if recorded and found else bool(names & {str(loaded.spec), str(loaded.source)})
        if not same:
            why = f"weights fingerprint {str(recorded)[:20]}, not {str(found)[:20]}" if recorded and found else \
                f"model {pattern.model.get('spec')}"
            raise AttnprobeError(f"--pattern {pattern.source} is of another model ({why}) than {loaded.spec}: "
                                 "export the pattern of this model (`attnprobe analyze` or `retrieval` on it, then "
                                 "`attnprobe export`)")
    return list(pattern.notes)


def check_random_orders(count: int) -> None:
    from attnprobe import limits

    limits.check_whole("--random-orders", count, 1, MAX_RANDOM_ORDERS, RANDOM_ORDERS)


def check_fraction(option: str, value: float) -> None:
    if not (0.0 <= value <= 1.0):  # NaN too
        raise AttnprobeError(f"{option} {value}: use a share of the KV heads from 0 to 1 (0.5 = half of them)")


def ranked(scores: np.ndarray) -> list[tuple[int, int]]:
    """KV heads (layer, kv head) from the lowest score (streaming first) to the highest; ties in layer, head order
    (kvpress's np.argsort(axis=None) breaks ties its own way)."""
    layers, kv_heads = scores.shape
    order = np.argsort(scores.reshape(-1), kind="stable")
    return [(int(k) // kv_heads, int(k) % kv_heads) for k in order]


def random_order(layers: int, kv_heads: int, seed: int, draw: int = 0) -> list[tuple[int, int]]:
    """The `draw`-th random order of the KV heads under `seed` (draw 0 is the order of earlier releases)."""
    every = [(layer, head) for layer in range(layers) for head in range(kv_heads)]
    rng = np.random.default_rng([seed, 2] if draw == 0 else [seed, 2, draw])
    return [every[int(k)] for k in rng.permutation(len(every))]


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


@dataclass(frozen=True)
class Needle:
    """The needle task's settings (`attnprobe retrieval`'s prompt construction)."""

    haystack: str  # the haystack's text
    haystack_name: str | None = None
    needle: str = DEFAULT_NEEDLE
    question: str = DEFAULT_QUESTION
    lengths: tuple[int, ...] | None = None  # None: kvtasks.NEEDLE_LENGTHS that fit the model
    depths: tuple[float, ...] = DEFAULT_DEPTHS


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
    resamples: int = DEFAULT_RESAMPLES, seed: int = 0, progress: Progress | None = None, client: str = "kvpress",
    task: str = "text", needle: Needle | None = None, continuation: int = kvtasks.CONTINUATION,
    random_orders: int = RANDOM_ORDERS,
) -> StreamingAblation:
    """Make KV heads streaming as `client` does (kvtasks.CLIENTS) and measure, per scored token of each `task`
    (kvtasks), the loss, its change, the KL and the top-1 accuracy against no head streaming: for the chosen heads
    (the `sparsity` share of `pattern`'s lowest-scoring KV heads, or the KV heads `heads`) and, with `curve`, at each
    of `shares` in the pattern's order and in `random_orders` random orders (seeded; their mean). S and W: `sink` and
    `recent`, else the pattern's, else 128 and 256. The needle task needs `needle` (its haystack and settings)."""
    from attnprobe import ablate as ab
    from attnprobe.batching import tokenize
    from attnprobe.planning import check_options

    started = time.perf_counter()
    check_options(batch_size, resamples, seed)
    kvtasks.check_choice("--client", client, kvtasks.CLIENTS)
    wanted = kvtasks.tasks_of(task)
    kvtasks.check_continuation(continuation)
    check_random_orders(random_orders)
    check_fraction("--sparsity", sparsity)
    for share in shares:
        check_fraction("--shares", share)
    check_model(loaded)
    if (pattern is None) == (heads is None):
        raise AttnprobeError("--method streaming needs the heads to make streaming: --pattern DIR (an `attnprobe "
                             "export` folder; --sparsity picks its lowest-scoring share) or --heads L0H1,... (KV "
                             "heads), not both")
    if "needle" in wanted and needle is None:
        raise AttnprobeError("the needle task needs a haystack: pass --haystack FILE (a long text), or --task text")
    layers, kv_heads = loaded.num_layers, loaded.num_kv_heads
    found = None if pattern is None else read_pattern(pattern)
    pattern_notes = [] if found is None else check_pattern(found, loaded)  # before any measuring
    sink = sink if sink is not None else (found.sink if found is not None and found.sink is not None else DUO_SINK)
    recent = recent if recent is not None else (
        found.recent if found is not None and found.recent is not None else DUO_RECENT)
    check_sizes(sink, recent)
    sequences = kvtasks.Sequences()
    cut: list[tuple[int, int]] = []
    dropped: list[str] = []
    if "text" in wanted:
        tokens = tokenize(loaded, corpus)
        cut = tokens.cut
        kvtasks.add_text(sequences, tokens.ids, client, continuation)
        if not sequences.of("text"):
            if task == "text":
                raise AttnprobeError(text_refusal(client, continuation))
            wanted = tuple(t for t in wanted if t != "text")  # --task both: the needle task alone, with a note
            dropped.append(f"the text task was left out: {text_refusal(client, continuation)}")
    if "needle" in wanted:
        from attnprobe.retrieval import distinct

        lengths, merged = distinct(needle.lengths, "--lengths")
        depths, merged_depths = distinct(needle.depths, "--depths")
        dropped += merged + merged_depths
        kvtasks.add_needle(sequences, loaded, needle.haystack, client, lengths=lengths, depths=depths,
                           needle=needle.needle, question=needle.question)
    orders = {"pattern": ranked(found.scores)} if found is not None else {}
    chosen = first_share(orders["pattern"], sparsity, layers, kv_heads) if found is not None else \
        heads_mask(heads, layers, kv_heads)
    draws = [random_order(layers, kv_heads, seed, k) for k in range(random_orders)]
    points = [("chosen", int(chosen.sum()) / chosen.size, [chosen])]
    if curve:
        points += [("pattern", share, [first_share(orders["pattern"], share, layers, kv_heads)])
                   for share in shares if found is not None]
        points += [("random", share, [first_share(draw, share, layers, kv_heads) for draw in draws])
                   for share in shares]
    masks: dict[bytes, tuple[int, np.ndarray]] = {}
    columns = [[masks.setdefault(m.tobytes(), (len(masks), m))[0] for m in group] for _, _, group in points]
    stack = ab.find_stack(loaded)
    batches = scored_batches(loaded, sequences, batch_size)
    every_token = any(bootstrap_method(len(sequences.of(t))) == BLOCK for t in wanted)  # the block bootstrap's
    values, counts = measure(loaded, stack, batches, [mask for _, mask in masks.values()], sink, recent, every_token,
                             progress, contexts=sequences.context)
    rows = []
    bases = {}
    for name in wanted:
        mine = {i: v for i, v in values.items() if sequences.task[i] == name}
        per_point = {i: np.stack([v[:, cols].mean(1) for cols in columns], axis=1) for i, v in mine.items()}
        summary, bases[name] = summarize(per_point, counts, len(points), resamples, seed)
        for k, (order, share, group) in enumerate(points):
            row: dict[str, Any] = {"task": name, "order": order, "share": share,
                                   "kv_heads_streaming": int(group[0].sum())}
            for measure_name in MEASURES:
                at = MEASURES.index(measure_name)
                mean, low, high = (summary[part][at, k] for part in ("mean", "low", "high"))
                row.update({measure_name: mean, f"{measure_name}_ci_low": low, f"{measure_name}_ci_high": high})
            rows.append(row)
    frame = pd.DataFrame(rows)
    run = run_info(loaded, corpus, sequences, counts, found, chosen, sink, recent, sparsity,
                   shares if curve else (), (["pattern"] if found is not None else []) + ["random"] if curve else [],
                   batch_size, resamples, seed, bases, frame, client, continuation, random_orders if curve else None,
                   needle)
    run["notes"] += pattern_notes + dropped
    if cut:
        run["notes"].append(f"{len(cut)} sequence{'' if len(cut) == 1 else 's'} cut to the model's "
                            f"context of {loaded.max_length} tokens (the first at corpus line {cut[0][0]})")
    run["wall_seconds"] = round(time.perf_counter() - started, 3)
    return StreamingAblation(frame, run)


def text_refusal(client: str, continuation: int) -> str:
    if client == "kvpress":
        return (f"every sequence of the corpus is shorter than --continuation {continuation} + 2 tokens: the kvpress "
                "client scores a continuation after a context; use longer documents (--split file or paragraphs) "
                "or a smaller --continuation")
    return "every sequence of the corpus is a single token: a decoder has nothing to predict"


def scored_batches(loaded: LoadedModel, sequences: kvtasks.Sequences, batch_size: int) -> list[Any]:
    """ablate's right-padded batches of the sequences, predicting only each sequence's scored tokens (from
    `sequences.first` on)."""
    from attnprobe import ablate as ab

    out = []
    for batch in ab.make_batches(loaded, sequences.ids, batch_size):
        first = torch.tensor([sequences.first[i] for i in batch.indices], device=batch.mask.device)  # [batch]
        target = torch.arange(batch.input_ids.shape[1], device=batch.mask.device) + 1  # [seq]: t predicts t + 1
        predicts = batch.predicts & (target[None] >= first[:, None])  # [batch, seq]
        rows = predicts.nonzero()[:, 0]  # [predicted]
        targets = batch.input_ids[:, 1:][predicts[:, :-1]]  # [predicted]
        out.append(ab.Batch(batch.indices, batch.input_ids, batch.mask, predicts, targets, rows))
    return out


def top1(stack: Any, hidden: Tensor, targets: Tensor) -> Tensor:
    """1.0 where the LM head's most likely next token at a row of hidden [n, hidden] is its target [n], else 0."""
    from attnprobe import ablate as ab

    hits = [stack.head(hidden[rows]).argmax(-1) == targets[rows] for rows in ab.chunks(stack, hidden.shape[0])]
    return torch.cat(hits).double() if hits else hidden.new_zeros(0, dtype=torch.float64)  # [n]


@torch.inference_mode()
def measure(loaded: LoadedModel, stack: Any, batches: list[Any], masks: list[np.ndarray], sink: int, recent: int,
            every_token: bool = True, progress: Progress | None = None, contexts: list[int | None] | None = None,
            ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Per sequence (corpus index) with a token to predict: [measure, mask, predicted token] of MEASURES against
    the same model with no head streaming (a mask with no head streaming: loss change and KL exactly 0), or without
    `every_token` their sums over the tokens [measure, mask, 1]; and the tokens predicted per sequence. `contexts`:
    per sequence its context length (the kvpress client) or None (duo-attention)."""
    from attnprobe import ablate as ab
    from attnprobe import layer_progress

    none = np.zeros((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    busy = [k for k, mask in enumerate(masks) if mask.any()]
    all_masks = torch.as_tensor(np.stack(masks), device=loaded.device)  # [mask, layer, kv head]
    out: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    total, done = sum(len(b.indices) for b in batches), 0
    for batch in batches:
        context = None if contexts is None or contexts[batch.indices[0]] is None else \
            [contexts[i] for i in batch.indices]  # [batch]
        size = ab.group_size(batch, len(busy)) if busy else 1
        on_layer = layer_progress.reporter(progress, "streaming", done, total)
        with layer_progress.watching(loaded.model, batch.input_ids.shape[1], on_layer,
                                     runs=1 + -(-len(busy) // size), rows=len(batch.indices)):
            with streaming(loaded, none, sink, recent):
                final = ab.run_full(loaded, batch, 1)  # [batch, seq, hidden]
            ref = ab.reference(stack, batch, final, True)
            hit_ref = top1(stack, final[batch.predicts], batch.targets)  # [predicted]
            nll = ref["nll"][None].repeat(len(masks), 1)  # [mask, predicted]
            kl = torch.zeros_like(nll)  # [mask, predicted]
            hit = hit_ref[None].repeat(len(masks), 1)  # [mask, predicted]
            for start in range(0, len(busy), size):
                chunk = busy[start : start + size]
                rows = all_masks[chunk].repeat_interleave(len(batch.indices), dim=0)  # [copies * batch, layer, kv]
                with streaming(loaded, rows, sink, recent, context=context):
                    final = ab.run_full(loaded, batch, len(chunk))  # [copies * batch, seq, hidden]
                nll[chunk], kl[chunk] = ab.token_measures(stack, batch, ref, final)  # [copies, predicted] each
                picked = final.unflatten(0, (len(chunk), len(batch.indices)))[:, batch.predicts]  # [copies, pred, h]
                hit[chunk] = top1(stack, picked.flatten(0, 1), batch.targets.repeat(len(chunk))).view(len(chunk), -1)
        both = torch.stack([nll, nll - ref["nll"][None], kl, hit]).cpu().numpy()  # [measure, mask, predicted]
        owner = batch.rows.cpu().numpy()  # [predicted]: the batch row of each predicted token
        for row, index in enumerate(batch.indices):
            mine = owner == row
            if mine.any():
                kept_values = both[:, :, mine]  # [measure, mask, tokens], in position order
                out[index] = kept_values if every_token else kept_values.sum(-1, keepdims=True)
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
    loaded: LoadedModel, corpus: Corpus, sequences: kvtasks.Sequences, counts: dict[int, int],
    pattern: Pattern | None, chosen: np.ndarray, sink: int, recent: int, sparsity: float, shares: tuple[float, ...],
    orders: list[str], batch_size: int, resamples: int, seed: int, bases: dict[str, dict[str, Any]],
    frame: pd.DataFrame, client: str, continuation: int, random_orders: int | None, needle: Needle | None,
) -> dict[str, Any]:
    from attnprobe.ablate import record_header
    from attnprobe.records import versions

    tasks = list(bases)
    lengths = [len(t) for t in sequences.ids]
    notes = [*task_notes(sequences, counts, bases, sink, recent, client, continuation)]
    chosen_rows = frame[frame["order"] == "chosen"].set_index("task")
    result_keys = [c for c in frame.columns if c not in ("task", "order", "share", "kv_heads_streaming")]
    return {
        **record_header(loaded, corpus),
        "sequences": len(sequences.ids),
        "bos": loaded.bos,
        "limit": corpus.limit,
        "tokens": int(sum(lengths)),
        "predicted_tokens": int(sum(counts.values())),
        "longest": int(max(lengths)),
        "method": "streaming",
        "client": client,
        "client_semantics": CLIENT_SEMANTICS[client],
        "tasks": {name: task_record(name, sequences, counts) for name in tasks},
        "continuation": int(continuation) if client == "kvpress" and "text" in tasks else None,
        "needle": None if "needle" not in tasks or needle is None else {
            "haystack": needle.haystack_name, "needle": needle.needle, "question": needle.question,
            "answer": "the needle, after a space", "trials": sequences.trials},
        "sink_size": int(sink),
        "recent_size": int(recent),
        "pattern": None if pattern is None else pattern.source,
        "sparsity": float(sparsity) if pattern is not None else None,
        "streaming_heads": [head_name(layer, head) for layer, head in zip(*np.nonzero(chosen))],
        "kv_heads_streaming": int(chosen.sum()),
        "kv_heads": int(chosen.size),
        "result": {name: {k: float(chosen_rows.loc[name, k]) for k in result_keys} for name in tasks},
        "shares": [float(s) for s in shares],
        "orders": orders,
        "random_orders": None if random_orders is None else int(random_orders),  # None: no curve (--no-pruning)
        "attention": f"{NAME}: eager, in blocks of query rows (no n x n map)",
        "device": str(loaded.device),
        "dtype": loaded.dtype,
        "batch_size": batch_size,
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "per_task": bases},
        "notes": notes,
        "versions": versions(),
    }


CLIENT_SEMANTICS = {
    "kvpress": f"kvpress {kvtasks.KVPRESS_VERSION} DuoAttentionPress: the context is prefilled with full attention; "
               "afterwards every query (question, answer, continuation) of a streaming KV head misses the context "
               "keys [sink, L - recent), L the context's length",
    "duo-attention": "DuoAttention's own inference: a streaming KV head's query i sees only keys j < sink or "
                     "j > i - recent, at every position, prefill included",
}


def task_record(name: str, sequences: kvtasks.Sequences, counts: dict[int, int]) -> dict[str, Any]:
    mine = sequences.of(name)
    return {"sequences": len(mine), "scored_tokens": int(sum(counts.get(i, 0) for i in mine)),
            "skipped": int(sequences.skipped.get(name, 0))}


def task_notes(sequences: kvtasks.Sequences, counts: dict[int, int], bases: dict[str, dict[str, Any]], sink: int,
               recent: int, client: str, continuation: int) -> list[str]:
    from attnprobe.bootstrap import few_items_note

    notes = []
    for name, basis in bases.items():
        mine = [i for i in sequences.of(name) if i in counts]
        words = "trials" if name == "needle" else "sequences"
        if basis["method"] == BLOCK:
            notes.append(f"{name}: only {counted(len(mine), words[:-1])}: the 95% intervals resample blocks of "
                         "consecutive scored tokens within each sequence (another stretch of similar text), not other "
                         "documents")
        else:
            note = few_items_note(len(mine), "sequence")
            notes += [f"{name}: {note}"] if note else []
        if client == "kvpress":
            short = [i for i in mine if sequences.context[i] <= sink + recent]
            what = "context"
        else:
            short = [i for i in mine if len(sequences.ids[i]) <= sink + recent]
            what = "sequence"
        if short:
            notes.append(f"{name}: {len(short)} of {len(mine)} {words} have a {what} no longer than sink + recent = "
                         f"{sink + recent} tokens: a streaming head there still sees every key, so they cannot "
                         "change; use longer documents (--split file or paragraphs) or longer --lengths")
        skipped = sequences.skipped.get(name, 0)
        if skipped:
            notes.append(f"{name}: {skipped} sequence{'' if skipped == 1 else 's'} shorter than --continuation "
                         f"{continuation} + 2 tokens left out (the kvpress client scores a continuation after a "
                         "context)")
    return notes
