"""Related heads: how alike every pair of heads attends, as the Jensen-Shannon divergence of their rows.

For two heads a and b and one query row, P and Q are the two heads' attention over the row's keys and
M = (P + Q) / 2. JS(P, Q) = H(M) - (H(P) + H(Q)) / 2 in nats: 0 for identical rows, ln 2 for rows on
disjoint keys, symmetric. `head_similarity` averages it over every unforced query row (a row with 2 or
more keys) of a sample of sentences, for all pairs of heads at once. Pure torch below `head_similarity`, which
runs the model; what the matrix says about the heads (nearest heads, clusters, 2-D coordinates) is headspace.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnprobe import limits
from attnprobe.batching import clipped, length_batches, pad_batch, tokenize_sentences
from attnprobe.corpus import IN_MEMORY, as_corpus, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.headspace import LN2, NEAREST, classical_mds, cluster, nearest_heads  # noqa: F401 (API: as before)
from attnprobe.model import as_loaded, stream_attention
from attnprobe.records import model_weights

SENTENCES = 200  # default sample: at most this many sentences, spread evenly over the corpus
MAX_TOKENS = 64  # default: each sentence cut to its first 64 tokens
# default budget in head-pair rows (pairs of heads x query rows): the pairwise JS costs one log per pair and entry,
# so a 32 x 32 model (523,776 pairs) would take ~20 min on 200 sentences of 64 tokens on 2 CPU cores; within the
# budget it samples 30 (minutes), while up to 12 x 12 heads (and 30 x 9) the default 200 sentences fit in it whole
PAIR_ROWS = 10**9
BUDGET = 1 << 16  # elements (float32) of `pairwise_js_sums`' temporary per CPU thread: 256 KiB, in its cache
GPU_BUDGET = 1 << 26  # on an accelerator: 256 MiB, so that few kernels are launched
FLUSH = 1 << 22  # weights buffered (heads x entries) before `PairwiseJS` folds them into the sums: 16 MiB
TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number, 1.2e-38


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """JS(P, Q) = H((P + Q) / 2) - (H(P) + H(Q)) / 2 in nats over the last axis: 0 for P = Q, ln 2 for P and Q
    on disjoint keys. Use it to compare two attention rows (each summing to 1) of the same keys."""
    mixed = (p + q) * 0.5  # [..., key]
    terms = torch.special.entr(mixed) - 0.5 * (torch.special.entr(p) + torch.special.entr(q))  # [..., key]
    return terms.sum(dim=-1)  # [...]


def pairwise_js_sums(weights: Tensor, budget: int | None = None) -> Tensor:
    """[head, entry] weights -> [head, head] float64: for every pair of heads a, b, the sum over the entries of
    entr(m) - (entr(p) + entr(q)) / 2 with p, q their weights and m = (p + q) / 2.

    An entry is one (row, key) weight; summed over every entry of a set of rows this is the sum of those rows'
    JS divergences. With s = p + q, entr(s / 2) = entr(s) / 2 + s ln 2 / 2, so each pair costs one add, one
    log and one product per entry; the per-head sums of entr(p) and of p are taken once. Pairs a < b only,
    in blocks of heads and entries whose temporary holds at most `budget` elements (default: BUDGET per CPU
    thread, so that each thread's share stays in its cache; GPU_BUDGET on an accelerator); sums in float64.
    The diagonal is 0, and rounding's tiny negatives are clipped to 0.
    """
    heads, entries = weights.shape
    sums = torch.zeros(heads, heads, dtype=torch.float64, device=weights.device)  # [head, head]
    if entries == 0 or heads == 0:
        return sums
    budget = budget or (BUDGET * torch.get_num_threads() if weights.device.type == "cpu" else GPU_BUDGET)
    weights = weights.float()  # [head, entry]
    # a weight below float32's smallest normal number (a sink head's other keys) counts as 0: each moves a row's JS
    # by less than 1e-35 nats, and arithmetic on subnormal numbers runs 10x slower
    weights = torch.where(weights < TINY, 0.0, weights)  # [head, entry]
    columns = max(1, min(entries, budget // heads))  # entries per chunk: at least one head against all
    for start in range(0, entries, columns):
        p = weights[:, start : start + columns]  # [head, entry]
        block = max(1, budget // (heads * p.shape[1]))  # heads a per step, each against every b >= the block's first
        for a0 in range(0, heads, block):
            a1 = min(heads, a0 + block)
            both = p[a0:a1, None, :] + p[None, a0:, :]  # [a, b, entry]: s = p + q, 0 or at least TINY
            logs = torch.log(both.clamp_min(TINY)).mul_(both)  # [a, b, entry]: s ln s (3x faster than entr here)
            sums[a0:a1, a0:] -= logs.sum(dim=-1, dtype=torch.float64)  # [a, b]: sum of entr(s)
    own = torch.special.entr(weights).sum(dim=-1, dtype=torch.float64)  # [head]: sum of entr(p)
    mass = weights.sum(dim=-1, dtype=torch.float64)  # [head]: sum of p (1 per row)
    mixed = 0.5 * sums + 0.5 * LN2 * (mass[:, None] + mass[None, :])  # [head, head]: sum of entr(m)
    js = (mixed - 0.5 * (own[:, None] + own[None, :])).clamp_min(0.0)  # [head, head]
    upper = torch.triu(js, diagonal=1)  # [head, head]: the pairs a < b, each computed once
    return upper + upper.T  # [head, head], symmetric, zero diagonal


class PairwiseJS:
    """The running sum of `pairwise_js_sums` over batches of rows: `add` buffers weights [head, entry] and
    folds them in once FLUSH weights wait (memory stays bounded whatever the sample); `mean` divides by the
    rows added."""

    def __init__(self, heads: int, device: torch.device | str = "cpu", budget: int | None = None) -> None:
        self.heads, self.budget = heads, budget
        self.sums = torch.zeros(heads, heads, dtype=torch.float64, device=device)  # [head, head]
        self.rows = 0
        self._pending: list[Tensor] = []  # each [head, entry]
        self._waiting = 0  # weights in _pending

    def add(self, weights: Tensor, rows: int) -> None:
        """`weights` [head, entry]: every (row, key) weight of `rows` query rows, the same entries for each head."""
        if weights.shape[0] != self.heads:
            raise ValueError(f"weights for {weights.shape[0]} heads, expected {self.heads}")
        self._pending.append(weights.float())
        self._waiting += weights.numel()
        self.rows += rows
        if self._waiting >= FLUSH:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            joined = torch.cat(self._pending, dim=1)  # [head, entry]
            self.sums += pairwise_js_sums(joined, self.budget).to(self.sums.device)
            self._pending, self._waiting = [], 0

    def mean(self) -> np.ndarray:
        """[head, head] float64: the JS divergence averaged over every row added (nats)."""
        self.flush()
        if self.rows == 0:
            raise AttnprobeError("no query row with 2 or more keys to compare heads on: use sentences of 2 or more "
                                 "tokens (and --max-tokens 2 or more)")
        return (self.sums / self.rows).cpu().numpy()


def row_entries(maps: Tensor, length: int, causal: bool) -> tuple[Tensor, int]:
    """One sentence's weights of its unforced rows, flattened: `maps` [head, query, key] (right-padded) ->
    ([head, entry], rows).

    A decoder's row i has keys 0..i (row 0, one key, is forced and left out); an encoder's rows have all
    `length` keys (none left out unless the sentence is one token). Padded queries and keys are dropped.
    """
    if causal:
        queries, keys = torch.tril_indices(length, length, offset=0, device=maps.device)  # [entry] each
        kept = queries > 0  # [entry]: row 0 has one key
        queries, keys = queries[kept], keys[kept]  # [entry] each
        rows = length - 1
    else:
        if length < 2:
            return maps.new_zeros(maps.shape[0], 0), 0
        square = maps[:, :length, :length]  # [head, query, key]
        return square.reshape(maps.shape[0], -1), length  # [head, entry]
    return maps[:, queries, keys], rows  # [head, entry]


def sample_indices(total: int, wanted: int) -> list[int]:
    """0-based positions of `wanted` sentences spread evenly over a corpus of `total` (all of them when it has
    no more): position floor(k * total / wanted) for k = 0 .. wanted - 1, so the sample covers the whole file."""
    if total <= wanted:
        return list(range(total))
    return [k * total // wanted for k in range(wanted)]


def check_settings(sentences: int, max_tokens: int, batch_size: int = 8, pair_rows: int = PAIR_ROWS) -> None:
    """Refuse a sample size, token cut, batch size or budget that cannot work, in one line."""
    limits.check_whole("--sentences", sentences, 1, limits.MAX_SENTENCES, SENTENCES)
    limits.check_whole("--max-tokens", max_tokens, 2, limits.MAX_POSITIONS, MAX_TOKENS)
    limits.check_whole("--batch-size", batch_size, 1, limits.MAX_BATCH_SIZE, 8)
    limits.check_whole("--pair-rows", pair_rows, 0, 10**18, PAIR_ROWS)


def budgeted_sentences(asked: int, heads: int, rows_per_sentence: int, pair_rows: int = PAIR_ROWS) -> int:
    """How many of the `asked` sentences the sample keeps so that head pairs x query rows stays within `pair_rows`
    (0: no budget), counting each sentence as its most rows (`rows_per_sentence`: the token cut); at least one."""
    if pair_rows == 0:
        return asked
    per_sentence = max(1, heads * (heads - 1) // 2 * rows_per_sentence)  # head pairs x rows of one sentence
    return max(1, min(asked, pair_rows // per_sentence))


@dataclass
class HeadSimilarity:
    """The JS divergence of every pair of heads, averaged over the rows of a sample of sentences.

    Heads are numbered layer-major: index layer * heads_per_layer + head, as `layer` and `head` say.
    """

    js: np.ndarray  # [head, head] float64, nats: 0 = the same attention, ln 2 = disjoint keys on every row
    layer: np.ndarray  # [head] int64: each index's layer
    head: np.ndarray  # [head] int64: each index's head within its layer
    indices: list[int]  # 0-based corpus positions of the sampled sentences
    rows: int  # query rows averaged over (rows with 2 or more keys)
    tokens: int  # tokens in the sample, after the cut
    max_tokens: int  # each sentence cut to its first max_tokens tokens
    cut: int  # sentences of the sample that were longer than max_tokens
    info: dict[str, Any] = field(default_factory=dict)  # model, corpus sha256, causal

    @property
    def sentences(self) -> int:
        return len(self.indices)

    def nearest(self, layer: int, head: int, count: int = NEAREST) -> list[tuple[int, int, float]]:
        """The `count` heads whose attention is closest to this head's: (layer, head, JS), nearest first."""
        return nearest_heads(self.js, self.layer, self.head, layer, head, count)


def batch_rows(loaded: Any, batch: list[list[int]]) -> list[tuple[Tensor, int]]:
    """Run one batch of token ids (a model.LoadedModel); per sentence, the weights of its unforced rows for
    every layer and head, [layer * head, entry] (layer-major), and how many rows they are (`row_entries`)."""
    lengths = [len(ids) for ids in batch]
    input_ids, mask = pad_batch(batch, loaded.device)  # [batch, seq] each
    found: list[list[Tensor]] = [[] for _ in batch]  # per sentence, per layer [head, entry]
    counted = [0] * len(batch)

    def on_layer(_layer: int, maps: Tensor) -> None:
        for b, n in enumerate(lengths):  # maps: [batch, head, query, key]
            entries, counted[b] = row_entries(maps[b].float(), n, loaded.causal)  # [head, entry]
            found[b].append(entries)

    stream_attention(loaded, input_ids, mask, on_layer)
    return [(torch.cat(layers, dim=0), rows) for layers, rows in zip(found, counted)]  # [layer * head, entry]


def head_similarity(
    model: Any, corpus: Any, *, sentences: int = SENTENCES, max_tokens: int = MAX_TOKENS, batch_size: int = 8,
    device: str = "auto", dtype: str = "auto", pair_rows: int = PAIR_ROWS,
) -> HeadSimilarity:
    """JS divergence between every pair of heads' attention, averaged over the unforced query rows of up to
    `sentences` sentences of `corpus` (spread evenly over it), each cut to its first `max_tokens` tokens.
    A model of many heads samples fewer sentences, so that head pairs x query rows stays within `pair_rows`
    (`budgeted_sentences`; 0: no budget); `info` records the sentences asked and the budget.

    `model`: a LoadedModel, a name or path (loaded on `device` in `dtype`), or a (transformers model,
    tokenizer) pair; `corpus`: a file, a Corpus or a list of sentences. A decoder's maps of a prefix equal its
    full maps cropped; an encoder sees only the tokens kept.
    """
    check_settings(sentences, max_tokens, batch_size, pair_rows)
    corpus = as_corpus(corpus)
    loaded = as_loaded(model, device, dtype)
    limit = min(max_tokens, loaded.max_length)
    kept = budgeted_sentences(sentences, loaded.num_layers * loaded.num_heads, limit, pair_rows)
    indices = sample_indices(len(corpus), kept)
    wanted = set(indices)
    chosen = [clipped(s, max_tokens) for k, s in enumerate(corpus.stream()) if k in wanted]
    if not chosen:
        raise AttnprobeError(f"corpus {corpus.path} has no sentences: add some")
    full = tokenize_sentences(loaded, chosen).ids
    ids = [list(map(int, tokens[:limit])) for tokens in full]
    layers, per_layer = loaded.num_layers, loaded.num_heads
    total = PairwiseJS(layers * per_layer, loaded.device)
    for batch in length_batches(ids, batch_size):
        for weights, rows in batch_rows(loaded, [ids[i] for i in batch]):
            total.add(weights, rows)  # [layer * head, entry]
    layer, head = np.divmod(np.arange(layers * per_layer, dtype=np.int64), per_layer)
    return HeadSimilarity(
        js=total.mean(), layer=layer, head=head, indices=indices, rows=total.rows,
        tokens=sum(len(t) for t in ids), max_tokens=limit, cut=sum(len(t) > limit for t in full),
        info={"model": loaded.spec, "corpus_sha256": corpus.sha256, "causal": loaded.causal,
              "sentences_asked": sentences, "pair_rows": pair_rows, "bos": loaded.bos, "dtype": loaded.dtype},
    )


def run_model(run: dict[str, Any]) -> str:
    """The model a results folder's run.json names, as `load_model` takes it: its spec (what --model was), or,
    when the spec is a path, the folder it resolved to when the run was made (a relative spec leads elsewhere
    from another working folder), while that folder is there."""
    import os

    spec, source = str(run["model"]["spec"]), run["model"].get("source")
    path_like = os.sep in spec or "/" in spec or spec.startswith(".")
    if path_like and isinstance(source, str) and Path(source).is_dir():
        return source
    return spec


def check_same_weights(run: dict[str, Any], loaded: Any, out: str | Path) -> None:
    """Refuse to measure a model whose weights are not those the run in `out` measured (re-saved, or another
    folder of the same name from here): run.json's `model.weights` fingerprint (records.model_weights) must be
    the loaded model's. A run.json without one (older, or a model the caller loaded) is not checked."""
    recorded = run["model"].get("weights")
    if not recorded:
        return
    found = model_weights(loaded)
    if found != recorded:
        raise AttnprobeError(
            f"the model at {loaded.source} is not the one the run in {out} measured (its weights fingerprint "
            f"{str(found)[:20]} differs from run.json's {str(recorded)[:20]}): put the measured weights back, or "
            f"run `attnprobe analyze --out {out}` again on this model"
        )


def run_corpus(run: dict[str, Any], out: str | Path) -> Any:
    """The corpus `analyze` measured (run.json's path, split and --limit), refused when it changed since."""
    corpus = run.get("corpus") or {}
    path = corpus.get("path")
    if path == IN_MEMORY:
        raise AttnprobeError(f"the run in {out} measured sentences given in memory (the Python API): compute the "
                             "similarity with attnprobe.head_similarity(model, sentences) instead")
    if not isinstance(path, str) or not Path(path).is_file():
        raise AttnprobeError(f"the corpus of the run in {out} ({path}) is not there any more: put it back, or run "
                             f"`attnprobe analyze --out {out}` again on another corpus")
    sentences = read_corpus(path, split=str(corpus.get("split") or "lines")).head(run.get("limit"))
    if corpus.get("sha256") not in (None, sentences.sha256):
        raise AttnprobeError(f"corpus {path} changed since `attnprobe analyze` measured it (its sha256 differs from "
                             f"run.json's): run `attnprobe analyze --out {out}` again")
    return sentences
