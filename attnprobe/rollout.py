"""Attention rollout (Abnar & Zuidema 2020): how attention mixes tokens when multiplied through the layers.

Per layer the heads are averaged, the residual stream is added as the identity (A' = (1 - r) A + r I,
r = 0.5 by default), rows are renormalised, and the layers are multiplied: R_0 = A'_0,
R_l = A'_l @ R_(l-1). Row i of R_l says how much of token i's representation after layer l is
attributed, under these assumptions, to each input token. Pure torch below `rollout_loaded`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnprobe.errors import AttnprobeError

RESIDUAL = 0.5  # weight of the identity (the residual stream) in A' = (1 - r) A + r I
MAX_SENTENCES = 8  # example sentences per run: one row of panels each in rollout.png


@dataclass
class Rollout:
    """Rollout of a few example sentences, each cut to its first tokens."""

    sentences: list[str]  # the texts
    indices: list[int]  # corpus index of each sentence (0-based), -1 for one given with --example
    tokens: list[list[str]]  # per sentence, the token labels kept
    total_tokens: list[int]  # per sentence, its tokens before the cut
    attention: list[np.ndarray]  # per sentence, head-averaged maps [layer, query, key], float32
    rollout: list[np.ndarray]  # per sentence, cumulative rollout [layer, query, key], float32
    residual: float = RESIDUAL
    info: dict[str, Any] = field(default_factory=dict)  # model provenance and settings

    @property
    def raw(self) -> list[np.ndarray]:
        """Per sentence, the last layer's head-averaged map [query, key]."""
        return [maps[-1] for maps in self.attention]


def head_average(maps: Tensor) -> Tensor:
    """[..., head, query, key] -> [..., query, key]: every head weighted equally, in float32."""
    return maps.float().mean(dim=-3)  # [..., query, key]


def with_residual(attention: Tensor, residual: float = RESIDUAL) -> Tensor:
    """(1 - r) A + r I with rows renormalised to 1; `attention` [..., query, key], square."""
    n = attention.shape[-1]
    eye = torch.eye(n, dtype=attention.dtype, device=attention.device)  # [query, key]
    mixed = (1.0 - residual) * attention + residual * eye  # [..., query, key]
    return mixed / mixed.sum(dim=-1, keepdim=True)  # [..., query, key], rows sum to 1


def rollout_step(previous: Tensor | None, attention: Tensor, residual: float = RESIDUAL) -> Tensor:
    """R_l = A'_l @ R_(l-1) (R_0 = A'_0); `attention` is one layer's head-averaged [query, key]."""
    mixed = with_residual(attention, residual)  # [query, key]
    return mixed if previous is None else mixed @ previous  # [query, key]


def rollout(attention: Tensor | np.ndarray, residual: float = RESIDUAL) -> Tensor | np.ndarray:
    """Cumulative rollout after every layer: [layer, query, key] (head-averaged) -> [layer, query, key].

    Returns what it is given: a torch Tensor (float32) for a Tensor, a float32 numpy array for a numpy array,
    e.g. `attention_maps(model, text).maps.mean(axis=1)`.
    """
    if isinstance(attention, np.ndarray):
        return rollout(torch.from_numpy(attention), residual).numpy()
    if not isinstance(attention, Tensor):
        raise AttnprobeError(f"attention: expected a torch Tensor or numpy array [layer, query, key]; got "
                             f"{type(attention).__name__}")
    if attention.dim() != 3 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(f"rollout needs [layer, query, key] with query == key, got {tuple(attention.shape)}")
    steps: list[Tensor] = []  # each [query, key]
    for layer_map in attention.float():  # [query, key]
        steps.append(rollout_step(steps[-1] if steps else None, layer_map, residual))
    return torch.stack(steps)  # [layer, query, key]


def check_residual(residual: float) -> None:
    if not 0.0 <= residual <= 1.0:
        raise AttnprobeError(f"--residual {residual} is outside [0, 1]: the identity's weight (default {RESIDUAL})")


class BatchRollout:
    """Rollout of a right-padded batch, fed one layer at a time: each sentence cut to its own length.

    `add(p)` takes one layer's maps [batch, head, query, key]; padded queries and keys are dropped
    before the head average, so a sentence's result does not depend on what it was batched with.
    """

    def __init__(self, lengths: list[int], residual: float = RESIDUAL) -> None:
        self.lengths, self.residual = lengths, residual
        self.attention: list[list[Tensor]] = [[] for _ in lengths]  # per sentence, per layer [query, key]
        self.rollout: list[list[Tensor]] = [[] for _ in lengths]  # per sentence, per layer [query, key]

    def add(self, maps: Tensor) -> None:
        for b, n in enumerate(self.lengths):
            averaged = head_average(maps[b, :, :n, :n])  # [query, key]
            previous = self.rollout[b][-1] if self.rollout[b] else None  # [query, key] or None
            self.attention[b].append(averaged)
            self.rollout[b].append(rollout_step(previous, averaged, self.residual))  # [query, key]

    def results(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per sentence: head-averaged maps and cumulative rollout, each [layer, query, key] float32 numpy."""
        attention = [torch.stack(layers).cpu().numpy() for layers in self.attention]  # each [layer, q, k]
        rolled = [torch.stack(layers).cpu().numpy() for layers in self.rollout]  # each [layer, q, k]
        return attention, rolled


def rollout_batch(
    maps_per_layer: list[Tensor], lengths: list[int], residual: float = RESIDUAL
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`BatchRollout` over every layer's maps [batch, head, query, key] at once (for tests and callers)."""
    batch = BatchRollout(lengths, residual)
    for maps in maps_per_layer:
        batch.add(maps)
    return batch.results()


def choose_sentences(
    loaded: Any, corpus: Any | None, indices: list[int] | None = None, examples: list[str] | None = None,
) -> tuple[list[str], list[int]]:
    """The example sentences and their corpus indices (-1 for one given as text).

    `indices` pick sentences of `corpus` (a corpus.Corpus) by 0-based position, `examples` add texts;
    with neither, the sentence `analyze` keeps as its example (the first closest to 12 tokens).
    """
    from attnprobe.batching import scan

    indices, examples = list(indices or []), list(examples or [])
    check_choice(corpus, indices, examples)
    if not indices and not examples:
        picked = scan(loaded, corpus)
        if picked.example is None:
            raise AttnprobeError(f"corpus {corpus.path} has no sentences: add some or pass --example TEXT")
        return [picked.example.text], [picked.example_index]
    chosen = _corpus_sentences(corpus, indices) if indices else []
    return chosen + examples, indices + [-1] * len(examples)


def check_choice(corpus: Any | None, indices: list[int] | None, examples: list[str] | None) -> None:
    """Refuse a choice of sentences that cannot work, before any model is loaded."""
    indices, examples = list(indices or []), list(examples or [])
    if any(not t.strip() for t in examples):
        raise AttnprobeError("--example is empty: pass a sentence, e.g. --example 'The cat sat on the mat.'")
    from attnprobe.corpus import unencodable

    for text in examples:
        position = unencodable(text)
        if position is not None:
            raise AttnprobeError(f"--example holds a byte that is not UTF-8 (character {position + 1}, "
                                 f"\\u{ord(text[position]):04x}): pass the sentence as UTF-8 text")
    if indices and corpus is None:
        raise AttnprobeError("--index picks a sentence of the corpus: pass --corpus too")
    if not indices and not examples and corpus is None:
        raise AttnprobeError("no sentence to roll out: pass --corpus FILE or --example TEXT")
    if len(indices) + len(examples) > MAX_SENTENCES:
        raise AttnprobeError(f"{len(indices) + len(examples)} example sentences: rollout draws at most "
                             f"{MAX_SENTENCES}; pass fewer")
    count = len(corpus) if corpus is not None else 0
    outside = [i for i in indices if not 0 <= i < count]
    if outside:
        span = f"numbered 0 to {count - 1}" if count else "none to pick"
        raise AttnprobeError(f"--index {outside[0]}: corpus {corpus.path} has {count} sentences, {span}")


def _corpus_sentences(corpus: Any, indices: list[int]) -> list[str]:
    """The texts at these 0-based positions of a streamed corpus (checked by `check_choice`), in the order asked."""
    wanted = set(indices)
    found = {k: sentence.text for k, sentence in enumerate(corpus.stream()) if k in wanted}
    return [found[i] for i in indices]


def rollout_loaded(
    loaded: Any, texts: list[str], indices: list[int] | None = None, max_tokens: int | None = None,
    residual: float = RESIDUAL,
) -> Rollout:
    """Run `loaded` (a model.LoadedModel) once over `texts` and roll out their attention.

    Each sentence is cut to its first `max_tokens` tokens before the forward pass (for a decoder
    this equals cropping the full sentence's maps; an encoder sees only those tokens).
    """
    from attnprobe.analysis import EXAMPLE_MAX_TOKENS
    from attnprobe.batching import pad_batch
    from attnprobe.model import quiet_transformers, stream_attention

    check_residual(residual)
    limit = min(EXAMPLE_MAX_TOKENS if max_tokens is None else max_tokens, loaded.max_length)
    if limit < 1:
        raise AttnprobeError(f"--max-tokens {max_tokens} is below 1: use 1 or more (default {EXAMPLE_MAX_TOKENS})")
    if not texts:
        raise AttnprobeError("no example sentence: pass --example TEXT or a corpus with at least one sentence")
    if len(texts) > MAX_SENTENCES:
        raise AttnprobeError(f"{len(texts)} example sentences: rollout draws at most {MAX_SENTENCES}; pass fewer")
    from attnprobe.corpus import clip_text
    from attnprobe.tokens import encode, token_labels

    with quiet_transformers():
        full = [list(ids) for ids in encode(loaded, [clip_text(t, loaded.max_length) for t in texts])["input_ids"]]
    empty = [k for k, ids in enumerate(full) if not ids]
    if empty:
        raise AttnprobeError(f"example sentence {texts[empty[0]]!r} gives no tokens: pass another one")
    kept = [ids[:limit] for ids in full]
    input_ids, mask = pad_batch(kept, loaded.device)  # [batch, seq] each
    batch = BatchRollout([len(ids) for ids in kept], residual)
    stream_attention(loaded, input_ids, mask, lambda _layer, p: batch.add(p))
    attention, rolled = batch.results()
    return Rollout(
        sentences=list(texts), indices=list(indices) if indices is not None else [-1] * len(texts),
        tokens=[token_labels(loaded, ids, text) for ids, text in zip(kept, texts)],
        total_tokens=[len(ids) for ids in full],
        attention=attention, rollout=rolled, residual=residual,
        info={"model": loaded.spec, "source": loaded.source, **loaded.origin, "causal": loaded.causal,
              "dtype": loaded.dtype, "dtype_requested": loaded.dtype_requested, "layers": loaded.num_layers,
              "heads": loaded.num_heads, "max_tokens": limit, "limit": None, "bos": loaded.bos},
    )


def first_token_share(matrix: np.ndarray) -> float:
    """Mean weight on key 0 over the query rows after the first: how much a sink-like first token dominates.

    `matrix` [query, key]; row 0 is left out (in a decoder it can only look at itself).
    """
    rows = matrix[1:] if matrix.shape[0] > 1 else matrix  # [query, key]
    return float(rows[:, 0].mean())
