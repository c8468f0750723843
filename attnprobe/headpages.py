"""Each head's own examples across the corpus (head_examples.npz, the head pages of report.html).

Two parts. `Selection`, pure numpy and bounded in memory: batch by batch, the units (a sentence, or a window of
SEGMENT_TOKENS query rows of a longer sequence) where each head's statistic is highest and lowest, and a uniform
sample of units that places one example in every decile. `top_keys`: the model run again over the chosen sequences
with an attention function of its own that keeps, per query row, its TOP_KEYS largest weights and their keys, block
of rows by block of rows (O(rows x keys) at a time, never an n x n map), and computes the layer's output as the
statistics attention does (SDPA where the plain softmax applies, else the same blocks). `head_examples` ties them
into the arrays of head_examples.npz (io.head_examples_writer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from attnprobe import defaults
from attnprobe.batching import length_batches, pad_batch, tokenize_sentences
from attnprobe.corpus import Corpus
from attnprobe.kernel.attention import unsupported
from attnprobe.kernel.blocked import softmax_with_entropy
from attnprobe.kernel.features import fusable, layer_features
from attnprobe.kernel.masks import apply_mask, block_keys, mask_plan, stats_mask
from attnprobe.model import (
    LastLayerDone,
    LoadedModel,
    attention_modules,
    forward_kwargs,
    stream_attention,
    using_attention,
)
from attnprobe.tokens import token_labels

SEGMENT_TOKENS = 64  # a longer sequence is judged, and shown, in windows of this many query rows
TOP_KEYS = 3  # keys kept per query row
EXTREMES = 3  # the highest and the lowest units of every head and statistic
DECILES = 10
SAMPLE = 512  # units kept uniformly at random (reservoir) to place the deciles: exact up to this many units
SCORES = ("entropy", "first_token", "previous_token", "diagonal", "duplicate_token")  # the statistics judged on
WINDOW_SHIFT = 20  # a unit's id: sentence << WINDOW_SHIFT | window (2**20 windows of 64 rows: any context)
NAME = "attnprobe_topkeys"


def unit_id(sentence: int, window: int = 0) -> int:
    return (sentence << WINDOW_SHIFT) | window


def unit_parts(unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sentence, window) of unit ids."""
    unit = np.asarray(unit, dtype=np.int64)
    return unit >> WINDOW_SHIFT, unit & ((1 << WINDOW_SHIFT) - 1)


def window_means(rows: Tensor, length: int) -> Tensor:
    """Each window of SEGMENT_TOKENS query rows' mean (NaN rows left out) of one sequence's row values
    rows [head, query] (its real rows first): [window, head]."""
    count = -(-length // SEGMENT_TOKENS)
    padded = rows.new_full((rows.shape[0], count * SEGMENT_TOKENS), torch.nan)  # [head, windows x rows]
    padded[:, :length] = rows[:, :length]
    blocks = padded.view(rows.shape[0], count, SEGMENT_TOKENS).double()  # [head, window, rows]
    return blocks.nanmean(dim=-1).T  # [window, head]


@dataclass
class Pick:
    score: str
    layer: int
    head: int
    unit: int
    value: float
    decile: int  # 0 = the lowest tenth of this head's units, 9 = the highest
    extreme: int  # +1: among the EXTREMES highest, -1: among the lowest, 0: a decile's example


class Selection:
    """The units each head scores highest and lowest on each statistic of SCORES, and a uniform sample of units,
    offered batch by batch (`offer`); `picks` then names every example. Memory: O(SAMPLE x scores x heads)."""

    def __init__(self, names: tuple[str, ...] | list[str], layers: int, heads: int, seed: int = 0) -> None:
        self.names = [name for name in SCORES if name in names]
        shape = (len(self.names), EXTREMES, layers, heads)
        self.top = (np.full(shape, -np.inf), np.full(shape, -1, dtype=np.int64))  # value, unit: [score, rank, l, h]
        self.bottom = (np.full(shape, np.inf), np.full(shape, -1, dtype=np.int64))
        self.sample = np.full((SAMPLE, len(self.names), layers, heads), np.nan)  # [unit, s, l, h]
        self.sample_unit = np.full(SAMPLE, -1, dtype=np.int64)
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def offer(self, units: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Units (unit_id) and per statistic their values [unit, layer, head]; NaN: not defined there."""
        if not self.names or not len(units):
            return
        stacked = np.stack([np.asarray(values[name], dtype=np.float64) for name in self.names])  # [s, u, l, h]
        ids = np.broadcast_to(np.asarray(units, dtype=np.int64)[None, :, None, None], stacked.shape)  # [s, u, l, h]
        finite = np.isfinite(stacked)
        self.top = _keep(self.top, np.where(finite, stacked, -np.inf), ids, descending=True)
        self.bottom = _keep(self.bottom, np.where(finite, stacked, np.inf), ids, descending=False)
        for k, unit in enumerate(units):  # reservoir sampling (Algorithm R): every unit kept with equal chance
            slot = self.seen if self.seen < SAMPLE else int(self.rng.integers(0, self.seen + 1))
            self.seen += 1
            if slot < SAMPLE:
                self.sample[slot] = stacked[:, k]
                self.sample_unit[slot] = unit

    def picks(self) -> list[Pick]:
        """Per statistic and head: the EXTREMES highest and lowest units, and one unit per decile of the sampled
        values: the first sampled unit (in sample order) that falls in it, a uniform draw from that tenth, which
        heads share wherever they can, so that few sequences are run again."""
        found: list[Pick] = []
        kept = min(self.seen, SAMPLE)
        sample, units = self.sample[:kept], self.sample_unit[:kept]  # [unit, s, l, h], [unit]
        order = np.argsort(np.where(np.isnan(sample), np.inf, sample), axis=0, kind="stable")  # NaN last
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(kept)[:, None, None, None], axis=0)  # [unit, s, l, h]
        counts = np.isfinite(sample).sum(axis=0)  # [s, l, h]
        tenth = np.where(np.isfinite(sample), np.minimum(DECILES - 1, DECILES * ranks // np.maximum(counts, 1)), -1)
        ordered = np.sort(np.where(np.isnan(sample), np.inf, sample), axis=0)  # [unit, s, l, h] ascending
        for s, name in enumerate(self.names):
            for layer in range(sample.shape[2]):
                for head in range(sample.shape[3]):
                    m = int(counts[s, layer, head])
                    values = ordered[:m, s, layer, head]  # [m] ascending
                    for sign, (value, unit) in ((1, self.top), (-1, self.bottom)):
                        for rank in range(EXTREMES):
                            v, u = float(value[s, rank, layer, head]), int(unit[s, rank, layer, head])
                            if u >= 0 and np.isfinite(v):
                                d = min(DECILES - 1, int(DECILES * np.searchsorted(values, v, "left") / max(m, 1)))
                                found.append(Pick(name, layer, head, u, v, d, sign))
                    column = tenth[:, s, layer, head]  # [unit]
                    for d in range(DECILES):
                        inside = np.flatnonzero(column == d)
                        if len(inside):
                            k = int(inside[0])
                            found.append(Pick(name, layer, head, int(units[k]), float(sample[k, s, layer, head]), d, 0))
        return found


def _keep(best: tuple[np.ndarray, np.ndarray], values: np.ndarray, ids: np.ndarray,
          descending: bool) -> tuple[np.ndarray, np.ndarray]:
    """The EXTREMES best of `best` and the new values [s, u, l, h] along axis 1 (earlier units win ties)."""
    value = np.concatenate([best[0], values], axis=1)  # [s, rank + u, l, h]
    unit = np.concatenate([best[1], ids], axis=1)
    order = np.argsort(-value if descending else value, axis=1, kind="stable")[:, :EXTREMES]
    return np.take_along_axis(value, order, axis=1), np.take_along_axis(unit, order, axis=1)


# ---------- the top keys of every query row ----------


@dataclass
class _Run:
    layers: dict[int, int]  # id(attention module) -> layer
    last_layer: int
    rows: list[int] | None  # the query rows whose top keys to keep (None: every row)
    k: int
    budget_bytes: int
    found: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> keys, weights [b, h, r, k]


_ACTIVE: ContextVar[_Run | None] = ContextVar("attnprobe_topkeys", default=None)


def topkeys_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor | None, None]:
    """The attention function of `top_keys`: the layer's output, and its top keys per kept query row."""
    run = _ACTIVE.get()
    if run is None:
        raise RuntimeError("attnprobe's top-keys attention runs only inside headpages.top_keys")
    features, sinks = layer_features(module, query, key, attention_mask, scaling, dropout, kwargs, None)
    layer = run.layers[id(module)]
    need_output = layer != run.last_layer
    fast = fusable(features)  # plain softmax: SDPA gives the output, the blocks only the kept rows
    keys, weights, output = _blocks(query, key, value, attention_mask, features, sinks, run, need_output and not fast)
    run.found[layer] = (keys, weights)
    if not need_output:
        raise LastLayerDone
    if fast:
        output = _sdpa(query, key, value, attention_mask, features)
    return output, None


def _sdpa(query: Tensor, key: Tensor, value: Tensor, real: Tensor, features: Any) -> Tensor:
    """The plain softmax attention's output [batch, query, head, dim] (right padding: a causal row never sees a
    padded key, which comes after it; a bidirectional one masks them)."""
    mask = None if features.causal else real[:, None, None, :].bool()  # [batch, 1, 1, key]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=features.causal, scale=features.scale,
        enable_gqa=features.groups > 1)  # [batch, head, query, dim]
    return out.transpose(1, 2)


def _blocks(query: Tensor, key: Tensor, value: Tensor, real: Tensor, features: Any, sinks: Tensor | None, run: _Run,
            need_output: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Top keys [batch, head, rows, k] (-1 past the keys a row may see) and their weights (float32) of the kept
    rows; with `need_output`, every row's output [batch, query, head, dim] from the same blocks."""
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    keys_t = key.transpose(-1, -2)  # [batch, kv, dim, key]
    wanted = list(range(n)) if run.rows is None else run.rows
    k = run.k
    top_keys = torch.full((batch, heads, len(wanted), k), -1, dtype=torch.long, device=query.device)  # [b, h, r, k]
    top_weights = torch.zeros(batch, heads, len(wanted), k, device=query.device)  # [b, h, r, k]
    output = query.new_empty(batch, n, heads, dim) if need_output else None  # [batch, query, head, dim]
    rows_per_block = max(1, run.budget_bytes // max(batch * heads * n * 4 * 4, 1))
    where = {q: i for i, q in enumerate(wanted)}
    for q0, q1 in _spans(range(n) if need_output else wanted, rows_per_block):
        k0, k1 = block_keys(q0, q1, n, features.causal, features.span)
        q_block = query[:, :, q0:q1].reshape(batch, kv_heads, groups * (q1 - q0), dim)  # [batch, kv, g*r, dim]
        scores = (q_block @ keys_t[..., k0:k1]).mul_(features.scale)  # [batch, kv, g*r, keys]
        if features.softcap is not None:
            scores = torch.tanh(scores / features.softcap) * features.softcap
        scores = scores.view(batch, heads, q1 - q0, k1 - k0).float()  # [batch, head, r, keys]
        apply_mask(scores, mask_plan(real, q0, q1 - q0, k1 - k0, features.causal, k0, features.span))
        sink = None if sinks is None else sinks.float().view(1, heads, 1, 1)  # [1, head, 1, 1]
        p = torch.softmax(scores, dim=-1) if sink is None else softmax_with_entropy(scores, sink)[0]  # [b, h, r, keys]
        inside = [q for q in range(q0, q1) if q in where]
        if inside:
            local = torch.tensor([q - q0 for q in inside], device=query.device)  # [r']
            w, j = p[:, :, local].topk(min(k, k1 - k0), dim=-1)  # [batch, head, r', k'] each
            j = torch.where(w > 0, j + k0, -1)  # a masked key (weight exactly 0) is no key
            slots = torch.tensor([where[q] for q in inside], device=query.device)  # [r']
            top_keys[:, :, slots, : w.shape[-1]] = j
            top_weights[:, :, slots, : w.shape[-1]] = w
        if output is not None:
            weights = p.to(value.dtype).view(batch, kv_heads, groups * (q1 - q0), k1 - k0)  # [batch, kv, g*r, keys]
            output[:, q0:q1] = (weights @ value[:, :, k0:k1]).view(batch, heads, q1 - q0, dim).transpose(1, 2)
    return top_keys, top_weights, output


def _spans(rows: Any, size: int) -> Iterator[tuple[int, int]]:
    """Runs of consecutive rows, each cut to at most `size` rows: (first, after last)."""
    start = previous = None
    for q in rows:
        if start is not None and (q != previous + 1 or q - start >= size):
            yield start, previous + 1
            start = None
        if start is None:
            start = q
        previous = q
    if start is not None:
        yield start, previous + 1


@torch.inference_mode()
def top_keys(loaded: LoadedModel, input_ids: Tensor, mask: Tensor, rows: list[int] | None = None,
             k: int = TOP_KEYS, budget_mib: float = defaults.BLOCK_MIB) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the `k` keys each query row attends to most and their weights, of one right-padded batch:
    keys [layer, batch, head, row, k] (int64, -1 where a row sees fewer keys) and weights (float32). `rows`: only
    these query rows (sorted), else every row. Runs attnprobe's top-keys attention, or, for a model the statistics
    attention does not run exactly, the eager maps layer by layer (as analyze's eager path)."""
    modules = attention_modules(loaded.model)
    if unsupported(loaded) is not None:
        return _eager_top_keys(loaded, input_ids, mask, rows, k)
    run = _Run({id(m): layer for layer, (m, _) in enumerate(modules)}, len(modules) - 1, rows, k,
               int(budget_mib * 2**20))
    token = _ACTIVE.set(run)
    try:
        with using_attention(loaded.model, NAME, topkeys_attention, stats_mask):
            loaded.model(**forward_kwargs(loaded.model, input_ids, mask))
    except LastLayerDone:
        pass
    finally:
        _ACTIVE.reset(token)
    return _stacked(run.found, len(modules))


def _eager_top_keys(loaded: LoadedModel, input_ids: Tensor, mask: Tensor, rows: list[int] | None,
                    k: int) -> tuple[np.ndarray, np.ndarray]:
    found: dict[int, tuple[Tensor, Tensor]] = {}

    def on_map(layer: int, p: Tensor) -> None:
        p = p.float() if rows is None else p[:, :, rows].float()  # [batch, head, r, key]
        w, j = p.topk(min(k, p.shape[-1]), dim=-1)  # [batch, head, r, k']
        keys = torch.full((*p.shape[:-1], k), -1, dtype=torch.long, device=p.device)  # [batch, head, r, k]
        weights = torch.zeros(*p.shape[:-1], k, device=p.device)  # [batch, head, r, k]
        keys[..., : w.shape[-1]] = torch.where(w > 0, j, -1)
        weights[..., : w.shape[-1]] = w
        found[layer] = (keys, weights)

    stream_attention(loaded, input_ids, mask, on_map)
    return _stacked(found, len(attention_modules(loaded.model)))


def _stacked(found: dict[int, tuple[Tensor, Tensor]], layers: int) -> tuple[np.ndarray, np.ndarray]:
    keys = torch.stack([found[layer][0] for layer in range(layers)])  # [layer, batch, head, row, k]
    weights = torch.stack([found[layer][1] for layer in range(layers)])  # [layer, batch, head, row, k]
    return keys.cpu().numpy(), weights.cpu().numpy()


# ---------- head_examples.npz ----------


def head_examples(loaded: LoadedModel, corpus: Corpus, selection: Selection, batch_size: int = 8,
                  k: int = TOP_KEYS) -> dict[str, np.ndarray] | None:
    """The arrays of head_examples.npz (io.head_examples_writer documents them) for the picks of `selection`, the
    model run again over their sequences only; None when nothing was picked."""
    picks = selection.picks()
    if not picks:
        return None
    sentences, windows = unit_parts(np.array([p.unit for p in picks]))
    wanted: dict[int, set[int]] = {}
    for s, w in zip(sentences.tolist(), windows.tolist()):
        wanted.setdefault(s, set()).add(w)
    chosen = {index: sentence for index, sentence in enumerate(corpus.stream()) if index in wanted}
    order = sorted(chosen)
    tokens = tokenize_sentences(loaded, [chosen[i] for i in order])
    ids = dict(zip(order, tokens.ids))
    segments = Segments(k)
    entries: dict[tuple[int, int, int], int] = {}  # (layer, head, unit) -> entry
    heads_of: dict[int, set[tuple[int, int]]] = {}  # unit -> (layer, head) that show it
    for p in picks:
        heads_of.setdefault(p.unit, set()).add((p.layer, p.head))
    short = [i for i in order if len(ids[i]) <= SEGMENT_TOKENS]
    for batch in length_batches([ids[i].tolist() for i in short], batch_size):
        members = [short[b] for b in batch]
        input_ids, mask = pad_batch([ids[i].tolist() for i in members], loaded.device)  # [batch, seq] each
        keys, weights = top_keys(loaded, input_ids, mask, None, k)  # [layer, batch, head, row, k]
        for row, index in enumerate(members):
            n = len(ids[index])
            unit = unit_id(index)
            labels = token_labels(loaded, ids[index], chosen[index].text)
            segment = segments.add(chosen[index], index, labels, 0, n, keys[:, row, :, :n])
            for layer, head in sorted(heads_of[unit]):
                entries[layer, head, unit] = segments.entry(segment, layer, head, keys[layer, row, head, :n],
                                                            weights[layer, row, head, :n])
    for index in (i for i in order if len(ids[i]) > SEGMENT_TOKENS):  # a long sequence alone, only its windows
        n = len(ids[index])
        spans = [(w * SEGMENT_TOKENS, min(n, (w + 1) * SEGMENT_TOKENS)) for w in sorted(wanted[index])]
        rows = [q for a, b in spans for q in range(a, b)]
        input_ids, mask = pad_batch([ids[index].tolist()], loaded.device)  # [1, seq] each
        keys, weights = top_keys(loaded, input_ids, mask, rows, k)  # [layer, 1, head, row, k]
        labels = token_labels(loaded, ids[index], chosen[index].text)
        at = 0
        for w, (a, b) in zip(sorted(wanted[index]), spans):
            unit = unit_id(index, w)
            part = slice(at, at + b - a)
            at += b - a
            segment = segments.add(chosen[index], index, labels, a, b, keys[:, 0, :, part])
            for layer, head in sorted(heads_of.get(unit, ())):
                entries[layer, head, unit] = segments.entry(segment, layer, head, keys[layer, 0, head, part],
                                                            weights[layer, 0, head, part])
    return segments.arrays(selection.names, picks, entries)


class Segments:
    """The growing arrays of head_examples.npz: segments (a window of a sequence, its tokens and the far keys its
    rows attend to), entries (one head's top keys on one segment) and the picks that point at them."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.segment: list[tuple[int, int, int, int, int]] = []  # sentence, line, start, stop, total tokens
        self.positions: list[np.ndarray] = []  # per segment, the positions whose labels are kept
        self.labels: list[list[str]] = []
        self.entry_rows: list[tuple[int, int, int]] = []  # segment, layer, head
        self.keys: list[np.ndarray] = []  # per entry [row, k]
        self.weights: list[np.ndarray] = []
        self.text: list[str] = []
        self.category: list[str] = []

    def add(self, sentence: Any, index: int, labels: list[str], start: int, stop: int, keys: np.ndarray) -> int:
        """A segment: rows start .. stop - 1 of sequence `index` (its token `labels`), keeping the labels of those
        tokens and of every key `keys` [layer, head, row, k] names; returns its number."""
        far = np.unique(keys[keys >= 0])
        positions = np.union1d(np.arange(start, stop), far).astype(np.int64)  # [p] sorted
        self.segment.append((index, sentence.line, start, stop, len(labels)))
        self.positions.append(positions)
        self.labels.append([labels[p] for p in positions])
        self.text.append(sentence.text if len(labels) <= SEGMENT_TOKENS else "")
        self.category.append(sentence.category or "")
        return len(self.segment) - 1

    def entry(self, segment: int, layer: int, head: int, keys: np.ndarray, weights: np.ndarray) -> int:
        self.entry_rows.append((segment, layer, head))
        self.keys.append(keys.astype(np.int64))
        self.weights.append(weights.astype(np.float32))
        return len(self.entry_rows) - 1

    def arrays(self, names: list[str], picks: list[Pick], entries: dict[tuple[int, int, int], int]
               ) -> dict[str, np.ndarray]:
        segment = np.array(self.segment, dtype=np.int64).reshape(-1, 5)
        rows = np.array([len(k) for k in self.keys], dtype=np.int64)
        label_counts = np.array([len(p) for p in self.positions], dtype=np.int64)
        entry = np.array(self.entry_rows, dtype=np.int64).reshape(-1, 3)
        kept = [p for p in picks if (p.layer, p.head, p.unit) in entries]
        return {
            "scores": np.array(names, dtype=str),
            "top_keys": np.asarray(self.k, dtype=np.int64),
            "segment_sentence": segment[:, 0], "segment_line": segment[:, 1], "segment_start": segment[:, 2],
            "segment_stop": segment[:, 3], "segment_tokens": segment[:, 4],
            "segment_text": np.array(self.text, dtype=str), "segment_category": np.array(self.category, dtype=str),
            "label_offsets": np.concatenate([[0], np.cumsum(label_counts)]).astype(np.int64),
            "label_positions": np.concatenate(self.positions).astype(np.int64),
            "labels": np.array([t for labels in self.labels for t in labels], dtype=str),
            "entry_segment": entry[:, 0], "entry_layer": entry[:, 1], "entry_head": entry[:, 2],
            "row_offsets": np.concatenate([[0], np.cumsum(rows)]).astype(np.int64),
            "keys": np.concatenate(self.keys).reshape(-1, self.k),
            "weights": np.concatenate(self.weights).reshape(-1, self.k),
            "pick_score": np.array([names.index(p.score) for p in kept], dtype=np.int64),
            "pick_entry": np.array([entries[p.layer, p.head, p.unit] for p in kept], dtype=np.int64),
            "pick_value": np.array([p.value for p in kept], dtype=np.float64),
            "pick_decile": np.array([p.decile for p in kept], dtype=np.int64),
            "pick_extreme": np.array([p.extreme for p in kept], dtype=np.int64),
        }
