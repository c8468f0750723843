"""Synthetic probes in the style of Olsson et al.: random tokens repeated twice.

In a sequence r r (r of T random tokens), the query at the second occurrence of r[s]
(position T + s) scores:
  induction - its attention to the token that followed the first occurrence (position s + 1);
  duplicate - its attention to the first occurrence itself (position s);
  previous  - on the same sequences, every query from the second random token to the last one,
              its attention to the token just before it.
A head's score is the mean over the scored queries of a sequence, then over sequences.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from attnprobe import __version__, limits
from attnprobe.bootstrap import DEFAULT_RESAMPLES, few_items_note, interval, poisson_weights, resampled_means
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, as_loaded, stream_attention
from attnprobe.planning import check_options
from attnprobe.records import model_record, versions
from attnprobe.tokens import encode

Kind = Literal["induction", "duplicate", "previous"]
KINDS: tuple[Kind, ...] = ("induction", "duplicate", "previous")
DEFAULT_LENGTHS = (10, 20, 40)
DEFAULT_SEQUENCES = 16  # per length


@dataclass
class Probe:
    scores: pd.DataFrame  # layer, head, and per kind: score, ci_low, ci_high, above_chance
    info: dict[str, Any]  # settings, chance levels, heads above chance, provenance (model, versions, time)


def special_frame(loaded: LoadedModel) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after plain text (e.g. [CLS] ... [SEP]), under --bos."""
    plain = loaded.tokenizer("hello", add_special_tokens=False)["input_ids"]
    full = encode(loaded, "hello")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def targets(kind: Kind, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(query positions, key positions) that a kind scores, in a sequence r r after `offset` specials."""
    s = np.arange(length)
    if kind == "induction":
        return offset + length + s, offset + s + 1
    if kind == "duplicate":
        return offset + length + s, offset + s
    rows = np.arange(offset + 1, offset + 2 * length)
    return rows, rows - 1


def chance(kind: Kind, offset: int, length: int, total: int, causal: bool) -> float:
    """What a head attending uniformly to every key it may see would score."""
    queries, _ = targets(kind, offset, length)
    keys = queries + 1 if causal else np.full(len(queries), total)
    return float(np.mean(1.0 / keys))


def random_sequences(loaded: LoadedModel, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` sequences r r, each r `length` distinct non-special tokens: [count, 2 * length]."""
    vocabulary = min(len(loaded.tokenizer), int(loaded.model.config.vocab_size))
    allowed = np.setdiff1d(np.arange(vocabulary), np.array(loaded.tokenizer.all_special_ids, dtype=np.int64))
    if len(allowed) < length:
        raise AttnprobeError(f"--lengths {length} needs {length} distinct tokens; the vocabulary has {len(allowed)}")
    halves = np.stack([rng.choice(allowed, size=length, replace=False) for _ in range(count)])
    return np.concatenate([halves, halves], axis=1)


def probe(
    model: Any,
    *,
    device: str = "auto",
    dtype: str = "auto",
    kinds: tuple[Kind, ...] = KINDS,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    sequences: int = DEFAULT_SEQUENCES,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    limit: int | None = None,
) -> Probe:
    """Score every head on every kind; intervals are a bootstrap over sequences.

    `limit` (`--limit`): score only the first `limit` of each length's `sequences` random sequences; they are
    the same tokens as in the run without it (the seed draws all `sequences` of each length either way).

    `model`: a LoadedModel, a name or path (loaded on `device` in `dtype`), or a (transformers model, tokenizer) pair.
    A head is `<kind>_above_chance` when its whole 95% interval lies above what uniform attention scores.
    """
    started = time.perf_counter()
    loaded = as_loaded(model, device, dtype)
    kinds = tuple(dict.fromkeys(kinds))  # each kind once, in the order asked
    prefix, suffix = special_frame(loaded)
    check(loaded, kinds, lengths, sequences, resamples, batch_size, seed, len(prefix) + len(suffix))
    if limit is not None:
        from attnprobe.corpus import check_limit

        check_limit(limit)
    scored = sequences if limit is None else min(limit, sequences)  # per length
    rng = np.random.default_rng(seed)
    per_kind: dict[str, list[np.ndarray]] = {kind: [] for kind in kinds}  # each [sequence, layer, head]
    chances: dict[str, list[float]] = {kind: [] for kind in kinds}
    for length in lengths:
        body = random_sequences(loaded, length, sequences, rng)[:scored]  # [sequence, 2 * length]
        total = len(prefix) + 2 * length + len(suffix)
        for kind in kinds:
            chances[kind].append(chance(kind, len(prefix), length, total, loaded.causal))
        ids = np.concatenate([np.tile(prefix, (scored, 1)), body, np.tile(suffix, (scored, 1))], axis=1)
        for start in range(0, scored, batch_size):
            batch = torch.tensor(ids[start : start + batch_size], dtype=torch.long, device=loaded.device)  # [b, n]
            scores = score_batch(loaded, batch, kinds, len(prefix), length)
            for kind in kinds:
                per_kind[kind].append(scores[kind])
            if progress:
                progress(len(batch))
    values = {kind: np.concatenate(per_kind[kind]) for kind in kinds}  # [sequence, layer, head]
    frame = tabulate(values, poisson_weights(range(len(lengths) * scored), resamples, seed))
    levels = {kind: float(np.mean(chances[kind])) for kind in kinds}
    for kind in kinds:
        frame[f"{kind}_above_chance"] = above_chance(frame, kind, levels[kind])
    info = {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model_record(loaded),
        "kinds": list(kinds), "lengths": list(lengths), "sequences_per_length": sequences, "limit": limit,
        "sequences_scored_per_length": scored, "seed": seed,
        "resamples": resamples, "bos": loaded.bos, "special_prefix": prefix, "special_suffix": suffix,
        "chance": levels,
        "above_chance": {kind: int(frame[f"{kind}_above_chance"].sum()) for kind in kinds},
        "device": str(loaded.device), "dtype": loaded.dtype,
        "dtype_requested": loaded.dtype_requested, "batch_size": batch_size,
        "wall_seconds": round(time.perf_counter() - started, 3),
        "versions": versions(),
        # the bootstrap is over the random sequences, every length's together: few make `above_chance` unsure
        "notes": [note for note in (few_items_note(len(lengths) * scored, "random sequence"),) if note],
    }
    return Probe(scores=frame, info=info)


ABOVE_CHANCE_MARGIN = 1e-6  # float32 rounding: a uniform head's interval may sit a hair above its chance level


def above_chance(scores: pd.DataFrame, kind: str, level: float) -> pd.Series:
    """Heads whose whole 95% interval of `kind` lies above the chance `level` (uniform attention's score)."""
    return scores[f"{kind}_ci_low"] > level + ABOVE_CHANCE_MARGIN


def score_batch(
    loaded: LoadedModel, batch: torch.Tensor, kinds: tuple[Kind, ...], offset: int, length: int
) -> dict[str, np.ndarray]:
    n_layers, n_heads = loaded.num_layers, loaded.num_heads
    out = {kind: torch.zeros(len(batch), n_layers, n_heads) for kind in kinds}  # [batch, layer, head]
    picks = {kind: [torch.as_tensor(a, device=batch.device) for a in targets(kind, offset, length)] for kind in kinds}

    def on_layer(layer: int, p: torch.Tensor) -> None:
        for kind, (queries, keys) in picks.items():
            out[kind][:, layer] = p[:, :, queries, keys].float().mean(dim=-1).cpu()  # [batch, head]

    stream_attention(loaded, batch, torch.ones_like(batch), on_layer)
    return {kind: values.numpy().astype(np.float64) for kind, values in out.items()}


def tabulate(values: dict[str, np.ndarray], counts: np.ndarray) -> pd.DataFrame:
    n_layers, n_heads = next(iter(values.values())).shape[1:]
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    frame = pd.DataFrame({"layer": layer.ravel(), "head": head.ravel()})
    for kind, v in values.items():  # v: [sequence, layer, head]
        low, high = interval(resampled_means(v, counts))
        frame[kind] = v.mean(axis=0).ravel()
        frame[f"{kind}_ci_low"], frame[f"{kind}_ci_high"] = low.ravel(), high.ravel()
    return frame


def top_heads(scores: pd.DataFrame, kind: str, n: int = 5) -> pd.DataFrame:
    columns = ["layer", "head", kind, f"{kind}_ci_low", f"{kind}_ci_high"]
    if f"{kind}_above_chance" in scores.columns:
        columns.append(f"{kind}_above_chance")
    return scores.nlargest(n, kind)[columns]


def check_numbers(lengths: tuple[int, ...], sequences: int, resamples: int, batch_size: int, seed: int) -> None:
    """The numeric options on their own (before a model is loaded); `check` adds the model's context."""
    if not lengths or min(lengths) < 2:
        raise AttnprobeError(f"--lengths {','.join(map(str, lengths))}: every length must be 2 or more")
    if sequences < 1:
        raise AttnprobeError(f"--sequences {sequences} is below 1: use 1 or more (default {DEFAULT_SEQUENCES})")
    limits.check_whole("--sequences", sequences, 1, limits.MAX_SEQUENCES, DEFAULT_SEQUENCES)
    check_options(batch_size, resamples, seed)


def check(
    loaded: LoadedModel, kinds: tuple[str, ...], lengths: tuple[int, ...], sequences: int, resamples: int,
    batch_size: int, seed: int, n_special: int,
) -> None:
    """Refuse bad options before any work; `n_special` tokens frame every sequence."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise AttnprobeError(f"unknown --kind {', '.join(unknown) or '(none)'}: use induction, duplicate or previous")
    check_numbers(lengths, sequences, resamples, batch_size, seed)
    longest = n_special + 2 * max(lengths)
    if longest > loaded.max_length:
        raise AttnprobeError(
            f"--lengths {max(lengths)} makes sequences of {longest} tokens, longer than the model's "
            f"{loaded.max_length}: use lengths up to {(loaded.max_length - n_special) // 2}"
        )
