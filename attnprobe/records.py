"""What a run records of itself: the fingerprint a checkpoint resumes only under, what identifies the model's
weights and tokenizer, the model's provenance and shape, the library versions, run.json's body and its
`bootstrap` entry."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnprobe import __version__
from attnprobe.accumulate import RESAMPLE_CELLS, Shape
from attnprobe.bootstrap import BLOCK, CONFIDENCE, block_length
from attnprobe.corpus import IN_MEMORY, Corpus
from attnprobe.model import LoadedModel
from attnprobe.sources import tokenizer_fingerprint, weights_fingerprint

if TYPE_CHECKING:
    from attnprobe.batching import Scan
    from attnprobe.planning import Options


def run_fingerprint(
    loaded: LoadedModel, corpus: Corpus, batch_size: int, resamples: int, seed: int, options: Options,
    processes: int = 1, weights: bool = True,
) -> dict[str, Any]:
    """Everything that decides the results of a run: a checkpoint resumes only the same run.

    `weights`: fingerprint the model's weights too (model_sha256; see `model_weights`), which reads them."""
    return {
        "model": loaded.source, "model_sha256": model_weights(loaded) if weights else None, "dtype": loaded.dtype,
        "bos": loaded.bos,
        "tokenizer_sha256": model_tokenizer(loaded) if weights else None,
        "corpus_sha256": corpus.sha256, "split": corpus.split, "sentences": len(corpus), "batch_size": batch_size,
        "resamples": resamples, "seed": seed, "attention": options.attention, "sink": options.sink,
        "window": options.window, "block_mib": options.budget_mib, "value_weighted": options.value_weighted,
        "top_tokens": options.top_tokens,
        "version": __version__, "processes": processes,
        "limit": corpus.limit,
    }


def model_weights(loaded: LoadedModel) -> str | None:
    """What identifies the weights: a GGUF file's sha256, a local folder's `sources.weights_fingerprint`, a hub
    model's commit; None for a model the caller loaded (attnprobe cannot tell where its weights came from)."""
    if loaded.origin.get("gguf_sha256"):
        return loaded.origin["gguf_sha256"]
    if loaded.origin.get("loaded_by") == "caller":
        return None
    if Path(loaded.source).is_dir():
        return weights_fingerprint(loaded.source)
    return f"revision:{loaded.revision}" if loaded.revision else None


def model_tokenizer(loaded: LoadedModel) -> str | None:
    """What identifies the tokenizer: a local folder's `sources.tokenizer_fingerprint`; None where `model_weights`
    already covers it (a GGUF file holds its tokenizer, a hub commit its files) or cannot tell (a caller's)."""
    if loaded.origin.get("gguf_sha256") or loaded.origin.get("loaded_by") == "caller":
        return None
    return tokenizer_fingerprint(loaded.source) if Path(loaded.source).is_dir() else None


def model_record(loaded: LoadedModel) -> dict[str, Any]:
    """The model's provenance and shape, as run.json (and probe.json) record it."""
    return {
        "spec": loaded.spec,
        "source": loaded.source,
        **loaded.origin,
        "revision": loaded.revision,
        "architecture": type(loaded.model).__name__,
        "layers": loaded.num_layers,
        "heads": loaded.num_heads,
        "kv_heads": loaded.num_kv_heads,
        "head_dim": loaded.head_dim,
        "causal": loaded.causal,
        "max_length": loaded.max_length,
    }


def versions() -> dict[str, str]:
    """The versions of Python, torch and transformers, as run.json records them."""
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def run_info(
    loaded: LoadedModel, corpus: Corpus, scanned: Scan, batch_size: int, seconds: float
) -> dict[str, Any]:
    """run.json's body: what ran on what (model, corpus, tokens, device, dtype, --bos), and how long it took."""
    return {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model_record(loaded),
        "corpus": {"path": IN_MEMORY if str(corpus.path) == IN_MEMORY else str(corpus.path.resolve()),
                   "sha256": corpus.sha256, "split": corpus.split},
        "sentences": scanned.sentences,
        "limit": corpus.limit,  # --limit: only the corpus's first N sequences were measured (None: all)
        "tokens": scanned.tokens,
        "longest_sequence": scanned.longest,
        "truncated_sentences": scanned.truncated,
        "truncated_lines": [{"line": line, "tokens_cut": cut, "at_least": at_least}
                            for line, cut, at_least in scanned.cut],
        "device": str(loaded.device),
        "dtype": loaded.dtype,  # what ran
        "dtype_requested": loaded.dtype_requested,  # --dtype (auto: the checkpoint's own); None: the caller loaded it
        "bos": loaded.bos,  # --bos: auto (the tokenizer's own), always or never
        "batch_size": batch_size,
        "wall_seconds": round(seconds, 3),
        "versions": versions(),
    }


def bootstrap_record(shape: Shape, lengths: list[int], asked: int | None = None) -> dict[str, Any]:
    """run.json's `bootstrap`: how the intervals were made. Under the block bootstrap (fewer than FEW_SEQUENCES
    sequences), each sequence's query rows (`sequence_rows`) and block length (`block_lengths`), in corpus order.
    Where the model's heads made the run keep fewer resamples than `asked` (resamples_within_budget), both and a
    note."""
    record: dict[str, Any] = {"resamples": shape.resamples, "seed": shape.seed, "confidence": CONFIDENCE,
                              "method": shape.method, "over": "sentences"}
    if asked is not None and asked > shape.resamples:
        heads = shape.layers * shape.heads
        record.update(resamples_asked=asked, resample_budget=RESAMPLE_CELLS, note=(
            f"{shape.resamples} bootstrap resamples, not the {asked} asked: {heads} heads x {len(shape.names)} "
            f"scores keep at most {RESAMPLE_CELLS} resample sums (resamples x scores x heads) so the intervals fit "
            "in memory; their endpoints carry a little more Monte Carlo noise"))
    if shape.method == BLOCK:
        record.update(over="query rows, in blocks within each sequence", sequence_rows=list(lengths),
                      block_lengths=[block_length(n) for n in lengths],
                      block_rule="circular blocks of round(n^(1/3)) consecutive query rows of a sequence of n rows, "
                                 "ceil(n / L) blocks per resample, the last cut to make n rows")
    return record
