"""Corpus -> per-head statistics: tokenize, batch by length, stream maps, reduce, tabulate."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnprobe import __version__
from attnprobe.corpus import Corpus, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import METRICS, SPECIAL, sentence_stats
from attnprobe.model import LoadedModel, load_model, stream_attention

EXAMPLE_TARGET_TOKENS = 12  # the example sentence for `plot` is the one closest to this length

Progress = Callable[[int], None]  # called with the number of sentences just finished


@dataclass
class Analysis:
    heads: pd.DataFrame  # one row per (layer, head)
    layers: pd.DataFrame  # one row per layer
    per_sentence: pd.DataFrame  # one row per (sentence, layer, head)
    run: dict[str, Any]  # provenance and the early/late summary
    example: dict[str, Any] = field(default_factory=dict)  # tokens and maps [layer, head, query, key]


def analyze(
    model: str,
    corpus: str,
    *,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "float32",
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Analysis:
    """Measure every head of `model` over every sentence of `corpus`."""
    check_batch_size(batch_size)
    text = read_corpus(corpus)
    loaded = load_model(model, device, dtype)
    return analyze_loaded(loaded, text, batch_size=batch_size, progress=progress, on_start=on_start)


def analyze_loaded(
    loaded: LoadedModel,
    corpus: Corpus,
    *,
    batch_size: int = 8,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Analysis:
    check_batch_size(batch_size)
    started = time.perf_counter()
    ids, truncated = tokenize(loaded, corpus)
    if on_start:
        on_start(len(ids))
    n_layers, n_heads = loaded.num_layers, loaded.num_heads
    special_ids = torch.tensor(sorted(set(loaded.tokenizer.all_special_ids)), dtype=torch.long)  # [n_special]
    has_special = any(t in set(special_ids.tolist()) for tokens in ids for t in tokens)
    names = (*METRICS, SPECIAL) if has_special else METRICS
    shape = (len(ids), n_layers, n_heads)  # stays on the device until the end: no sync per layer
    stats = {name: torch.full(shape, torch.nan, device=loaded.device) for name in names}  # [sentence, layer, head]
    example_index = pick_example(ids)
    example_maps = torch.zeros(n_layers, n_heads, len(ids[example_index]), len(ids[example_index]))
    for batch in length_batches(ids, batch_size):
        input_ids, mask = pad_batch([ids[i] for i in batch], loaded.device)  # [batch, seq] each
        rows = torch.tensor(batch, device=loaded.device)  # [batch]
        special = torch.isin(input_ids, special_ids.to(input_ids.device)) & mask.bool() if has_special else None

        def on_layer(layer: int, p: torch.Tensor, rows=rows, mask=mask, batch=batch, special=special) -> None:
            for name, value in sentence_stats(p, mask, loaded.causal, special).items():  # [batch, head]
                stats[name][rows, layer] = value
            if example_index in batch:
                k = batch.index(example_index)
                n = example_maps.shape[-1]
                example_maps[layer] = p[k, :, :n, :n].float().cpu()  # [head, query, key]

        stream_attention(loaded, input_ids, mask, on_layer)
        if progress:
            progress(len(batch))
    per_sentence = tidy({name: values.cpu() for name, values in stats.items()}, corpus)
    heads = summarize_heads(per_sentence)
    layers = summarize_layers(heads)
    run = run_info(loaded, corpus, ids, truncated, batch_size, time.perf_counter() - started)
    run["summary"] = early_late(layers)
    run["example_sentence"] = {"index": example_index, "line": corpus.sentences[example_index].line}
    example = {
        "sentence": corpus.sentences[example_index].text,
        "tokens": token_labels(loaded.tokenizer, ids[example_index]),
        "maps": example_maps.numpy(),
    }
    return Analysis(heads=heads, layers=layers, per_sentence=per_sentence, run=run, example=example)


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise AttnprobeError(f"--batch-size {batch_size} is below 1: use 1 or more (default 8)")


def tokenize(loaded: LoadedModel, corpus: Corpus) -> tuple[list[list[int]], int]:
    """Token ids per sentence, truncated to the model's context; also how many were truncated."""
    full = loaded.tokenizer(corpus.texts, add_special_tokens=True, truncation=False)["input_ids"]
    cut = loaded.tokenizer(
        corpus.texts, add_special_tokens=True, truncation=True, max_length=loaded.max_length
    )["input_ids"]
    for sentence, tokens in zip(corpus.sentences, cut):
        if not tokens:
            raise AttnprobeError(f"corpus line {sentence.line} gives no tokens: remove or fix it")
    truncated = sum(len(a) > len(b) for a, b in zip(full, cut))
    return [list(t) for t in cut], truncated


def length_batches(ids: list[list[int]], batch_size: int) -> list[list[int]]:
    """Sentence indices grouped into batches of similar length (least padding)."""
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def pad_batch(batch: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sentence; padded ids are 0 and are masked out everywhere."""
    n = max(len(t) for t in batch)
    input_ids = torch.zeros(len(batch), n, dtype=torch.long)  # [batch, seq]
    mask = torch.zeros(len(batch), n, dtype=torch.long)  # [batch, seq]
    for row, tokens in enumerate(batch):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return input_ids.to(device), mask.to(device)


def pick_example(ids: list[list[int]]) -> int:
    return min(range(len(ids)), key=lambda i: (abs(len(ids[i]) - EXAMPLE_TARGET_TOKENS), i))


def token_labels(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def tidy(stats: dict[str, torch.Tensor], corpus: Corpus) -> pd.DataFrame:
    n_sentences, n_layers, n_heads = stats["entropy"].shape
    grids = np.meshgrid(np.arange(n_sentences), np.arange(n_layers), np.arange(n_heads), indexing="ij")
    frame = pd.DataFrame({key: g.ravel() for key, g in zip(("sentence", "layer", "head"), grids)})
    for name, values in stats.items():
        frame[name] = values.numpy().ravel().astype(np.float64)
    frame["category"] = [corpus.sentences[i].category for i in frame["sentence"]]
    return frame


def metric_columns(frame: pd.DataFrame) -> list[str]:
    return [name for name in (*METRICS, SPECIAL) if name in frame.columns]


def summarize_heads(per_sentence: pd.DataFrame) -> pd.DataFrame:
    """A head's value is the mean over sentences, each sentence weighing the same."""
    grouped = per_sentence.groupby(["layer", "head"], sort=True)
    heads = grouped[metric_columns(per_sentence)].mean()  # NaN-skipping: entropy_norm is NaN for 1-token causal rows
    heads["entropy_std"] = grouped["entropy"].std(ddof=1)
    heads["sentences"] = grouped["entropy"].count()
    return heads.reset_index()


def summarize_layers(heads: pd.DataFrame) -> pd.DataFrame:
    grouped = heads.groupby("layer", sort=True)
    layers = grouped[metric_columns(heads)].mean()
    layers["entropy_head_std"] = grouped["entropy"].std(ddof=0)
    layers["entropy_head_min"] = grouped["entropy"].min()
    layers["entropy_head_max"] = grouped["entropy"].max()
    return layers.reset_index()


def early_late(layers: pd.DataFrame) -> dict[str, Any]:
    """Mean entropy of the first and last third of the layers, and early minus late."""
    n = len(layers)
    third = max(1, n // 3)
    early = layers["entropy"].iloc[:third].mean()
    late = layers["entropy"].iloc[n - third :].mean()
    return {
        "early_layers": [0, third - 1],
        "late_layers": [n - third, n - 1],
        "early_entropy": float(early),
        "late_entropy": float(late),
        "difference": float(early - late),
    }


def run_info(
    loaded: LoadedModel, corpus: Corpus, ids: list[list[int]], truncated: int, batch_size: int, seconds: float
) -> dict[str, Any]:
    import transformers

    return {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "spec": loaded.spec,
            "source": loaded.source,
            **loaded.origin,
            "revision": loaded.revision,
            "architecture": type(loaded.model).__name__,
            "layers": loaded.num_layers,
            "heads": loaded.num_heads,
            "causal": loaded.causal,
            "max_length": loaded.max_length,
        },
        "corpus": {"path": str(corpus.path.resolve()), "sha256": corpus.sha256},
        "sentences": len(ids),
        "tokens": sum(len(t) for t in ids),
        "truncated_sentences": truncated,
        "device": str(loaded.device),
        "dtype": loaded.dtype,
        "batch_size": batch_size,
        "wall_seconds": round(seconds, 3),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
