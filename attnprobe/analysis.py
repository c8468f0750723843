"""Corpus -> per-head statistics: tokenize, batch by length, stream maps, reduce, tabulate."""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnprobe import __version__, distributed, kernel
from attnprobe.accumulate import Accumulator, Shape
from attnprobe.bootstrap import CONFIDENCE, DEFAULT_RESAMPLES, interval
from attnprobe.corpus import Corpus, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.kernel import DEFAULT_BUDGET_MIB
from attnprobe.metrics import (
    METRICS,
    POSITION_METRICS,
    RECENT_WINDOW,
    SINK_TOKENS,
    SPECIAL,
    SentenceSums,
    bin_count,
    sentence_sums,
)
from attnprobe.model import LoadedModel, load_model, quiet_transformers, stream_attention
from attnprobe.resume import Checkpointing, State, Stopped, check_fingerprint

UNTAGGED = "untagged"  # the category of sentences above the first `# category:` line of a tagged corpus
EXAMPLE_TARGET_TOKENS = 12  # the example sentence for `plot` is the one closest to this length
EXAMPLE_MAX_TOKENS = 40  # and only its first 40 tokens are kept, so plots stay readable

Progress = Callable[[int], None]  # called with the number of sentences just finished


@dataclass
class Analysis:
    heads: pd.DataFrame  # one row per (layer, head)
    layers: pd.DataFrame  # one row per layer
    per_sentence: pd.DataFrame | None  # one row per (sentence, layer, head), when asked for
    run: dict[str, Any]  # provenance and the early/late summary
    example: dict[str, Any] = field(default_factory=dict)  # tokens and maps [layer, head, query, key]
    categories: pd.DataFrame | None = None  # category x layer, when the corpus is tagged
    positions: pd.DataFrame | None = None  # layer x head x bin of query positions
    resamples: dict[str, np.ndarray] = field(default_factory=dict)  # per score [resample, layer, head], float32


def analyze(
    model: str,
    corpus: str,
    *,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "float32",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    split: str = "lines",
    options: Options | None = None,
    keep_per_sentence: bool = False,
) -> Analysis:
    """Measure every head of `model` over every sentence (or paragraph, or file: `split`) of `corpus`."""
    check_options(batch_size, resamples, seed, options)
    text = read_corpus(corpus, split=split)
    loaded = load_model(model, distributed.device_for(distributed.current(), device), dtype)
    return analyze_loaded(
        loaded, text, batch_size=batch_size, resamples=resamples, seed=seed, progress=progress, on_start=on_start,
        options=options, keep_per_sentence=keep_per_sentence,
    )


def analyze_loaded(
    loaded: LoadedModel,
    corpus: Corpus,
    *,
    batch_size: int = 8,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    options: Options | None = None,
    keep_per_sentence: bool = False,
    checkpointing: Checkpointing | None = None,
    on_batch: Callable[[list[int], dict[str, np.ndarray]], None] | None = None,
) -> Analysis:
    """Measure every head of a loaded model over a corpus.

    Statistics are folded into sums batch by batch, so memory does not grow with the corpus;
    `keep_per_sentence` also returns every sentence's values as `Analysis.per_sentence` (it does grow).
    """
    options = options or Options()
    check_options(batch_size, resamples, seed, options)
    started = time.perf_counter()
    tokens = tokenize(loaded, corpus)
    ids = tokens.ids
    if on_start:
        on_start(len(ids))
    example_index = pick_example(ids)
    longest = max(len(t) for t in ids)
    world = distributed.current()
    distributed.join(world, loaded.device)
    labels = sentence_categories(corpus)
    has_special = any(any(flags) for flags in tokens.special)
    shape = Shape(
        names=(*METRICS, SPECIAL) if has_special else METRICS, bin_names=POSITION_METRICS,
        layers=loaded.num_layers, heads=loaded.num_heads, bins=bin_count(longest),
        resamples=resamples, seed=seed, categories=tuple(dict.fromkeys(labels)) if labels else (),
    )
    if checkpointing is not None and keep_per_sentence:
        raise AttnprobeError("keep_per_sentence cannot be resumed from a checkpoint: use one or the other")
    if on_batch is not None and (world.size > 1 or (checkpointing and checkpointing.resume_from is not None)):
        raise AttnprobeError("--per-sentence works in a single process and without --resume for now")
    if checkpointing is not None and world.size > 1:
        raise AttnprobeError("checkpoints and --resume work in a single process for now: run without torchrun")
    fingerprint = run_fingerprint(loaded, corpus, batch_size, resamples, seed, options)
    if checkpointing is not None and checkpointing.resume_from is not None:
        check_fingerprint(checkpointing.resume_from.fingerprint, fingerprint)
    measured = measure(loaded, tokens, batch_size, example_index, progress, options, world, shape, labels,
                       keep_per_sentence, checkpointing, fingerprint, on_batch)
    totals = measured.totals
    heads = totals.heads()
    layers = summarize_layers(heads)
    heads, layers, summary = add_intervals(heads, layers, totals)
    run = run_info(loaded, corpus, ids, tokens.truncated, batch_size, time.perf_counter() - started)
    run["distributed"] = {"world_size": world.size, "sentences_per_rank": world.counts(len(ids))}
    run["attention"] = {
        "requested": options.attention, "path": measured.path, "block_budget_mib": options.budget_mib,
        "sink_tokens": options.sink, "window": options.window,
    }
    run["summary"] = summary
    run["bootstrap"] = {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "over": "sentences",
                        "method": "poisson"}
    run["example_sentence"] = {"index": example_index, "line": corpus.sentences[example_index].line}
    example = {
        "sentence": corpus.sentences[example_index].text,
        "tokens": token_labels(loaded.tokenizer, ids[example_index][:EXAMPLE_MAX_TOKENS]),
        "maps": measured.example_maps,
        "total_tokens": len(ids[example_index]),
    }
    per_sentence = tidy(measured.per_sentence, corpus) if measured.per_sentence is not None else None
    positions = totals.positions(longest)
    resampled = {name: totals.resampled_head_means(name).astype(np.float32) for name in totals.shape.names}
    return Analysis(heads, layers, per_sentence, run, example, totals.categories(), positions, resampled)


def run_fingerprint(
    loaded: LoadedModel, corpus: Corpus, batch_size: int, resamples: int, seed: int, options: Options
) -> dict[str, Any]:
    """Everything that decides the results of a run: a checkpoint resumes only the same run."""
    return {
        "model": loaded.source, "model_sha256": loaded.origin.get("gguf_sha256"), "dtype": loaded.dtype,
        "corpus_sha256": corpus.sha256, "sentences": len(corpus.sentences), "batch_size": batch_size,
        "resamples": resamples, "seed": seed, "attention": options.attention, "sink": options.sink,
        "window": options.window, "block_mib": options.budget_mib, "version": __version__,
    }


def sentence_categories(corpus: Corpus) -> list[str] | None:
    """Each sentence's category (`untagged` above the first tag), or None for an untagged corpus."""
    labels = [s.category for s in corpus.sentences]
    if all(label is None for label in labels):
        return None
    return [label or UNTAGGED for label in labels]


@dataclass(frozen=True)
class Options:
    """How the statistics are computed; none of these changes a value beyond float rounding."""

    attention: str = "auto"  # auto | blocked | eager
    sink: int = SINK_TOKENS  # sink_window: the first S keys
    window: int = RECENT_WINDOW  # ... and the W most recent
    budget_mib: float = DEFAULT_BUDGET_MIB  # memory for one block of attention rows
    block_rows: int | None = None  # a fixed block size instead (tests)


ATTENTION_CHOICES = ("auto", "blocked", "eager")


def attention_path(loaded: LoadedModel, attention: str) -> str:
    """`blocked` (attnprobe's statistics attention, O(n) memory) or `eager` (hooks on eager maps).

    `attention` is one of ATTENTION_CHOICES (check_options has checked it).
    """
    if attention == "eager":
        return "eager"
    reason = kernel.unsupported(loaded)
    if reason is None:
        return "blocked"
    if attention == "blocked":
        raise AttnprobeError(f"--attention blocked does not implement {reason}: use --attention eager or auto")
    return "eager"


@dataclass
class Measured:
    totals: Accumulator  # every statistic, summed over the sentences (all ranks merged)
    example_maps: np.ndarray  # [layer, head, query, key], the example's first tokens
    path: str  # blocked or eager
    per_sentence: dict[str, np.ndarray] | None = None  # per score [sentence, layer, head], when kept


def measure(
    loaded: LoadedModel, tokens: Tokens, batch_size: int, example_index: int, progress: Progress | None,
    options: Options, world: distributed.World, shape: Shape, labels: list[str] | None = None,
    keep_per_sentence: bool = False, checkpointing: Checkpointing | None = None,
    fingerprint: dict[str, Any] | None = None,
    on_batch: Callable[[list[int], dict[str, np.ndarray]], None] | None = None,
) -> Measured:
    """Run every batch of this rank's sentences and fold its statistics into an Accumulator.

    Under torchrun each rank measures its shard of the sentences, and the sums are merged.
    """
    ids = tokens.ids
    path = attention_path(loaded, options.attention)
    totals = Accumulator(shape)
    kept = {name: np.full((len(ids), shape.layers, shape.heads), np.nan) for name in shape.names} \
        if keep_per_sentence else None  # [sentence, layer, head]
    n = min(len(ids[example_index]), EXAMPLE_MAX_TOKENS)
    example_maps = torch.full((shape.layers, shape.heads, n, n), torch.nan, device=loaded.device)  # [l, h, q, k]
    sink, window = options.sink, options.window
    start = 0
    if checkpointing is not None and checkpointing.resume_from is not None:
        state = checkpointing.resume_from
        start = state.batches_done
        totals.sums = {key: value.copy() for key, value in state.sums.items()}
        if state.example_maps is not None:
            example_maps = torch.from_numpy(state.example_maps).to(loaded.device)

    def save(done: int) -> None:
        maps = example_maps.cpu().numpy()
        checkpointing.save(State(fingerprint or {}, done, totals.sums, None if np.isnan(maps).all() else maps))
        checkpointing.last_saved = time.monotonic()

    batches = length_batches(ids, batch_size, world.shard(len(ids)))
    if progress and start:
        progress(sum(len(b) for b in batches[:start]))
    with kernel.statistics_attention(loaded) if path == "blocked" else nullcontext():
        for number, batch in enumerate(batches):
            if number < start:
                continue
            input_ids, mask = pad_batch([ids[i] for i in batch], loaded.device)  # [batch, seq] each
            special = pad_batch([tokens.special[i] for i in batch], loaded.device)[0].bool() \
                if SPECIAL in shape.names else None  # [batch, seq]
            k = min(shape.bins, bin_count(input_ids.shape[1]))
            stats = {name: torch.full((len(batch), shape.layers, shape.heads), torch.nan, device=loaded.device)
                     for name in shape.names}  # [batch, layer, head]
            bins = {name: torch.full((len(batch), shape.layers, shape.heads, k), torch.nan, device=loaded.device)
                    for name in shape.bin_names}  # [batch, layer, head, bin]

            def store(layer: int, sums: SentenceSums, stats=stats, bins=bins) -> None:
                for name, value in sums.means().items():  # [batch, head]
                    stats[name][:, layer] = value
                for name, value in sums.bin_means().items():  # [batch, head, bin]
                    bins[name][:, layer] = value

            example = (batch.index(example_index), n) if example_index in batch else None
            if path == "blocked":
                def on_sums(layer: int, sums: SentenceSums, maps: torch.Tensor | None, store=store) -> None:
                    store(layer, sums)
                    if maps is not None:
                        example_maps[layer] = maps  # [head, query, key]

                kernel.run_batch(loaded, input_ids, mask, on_sums, special=special, sink=sink, window=window,
                                 bins=k, budget_mib=options.budget_mib, block_rows=options.block_rows,
                                 example=example)
            else:
                def on_map(layer: int, p: torch.Tensor, mask=mask, special=special, store=store, example=example,
                           k=k) -> None:
                    store(layer, sentence_sums(p, mask, loaded.causal, special, sink, window, k))
                    if example is not None:
                        example_maps[layer] = p[example[0], :, :n, :n].float()  # [head, query, key]

                stream_attention(loaded, input_ids, mask, on_map)
            values = {name: v.cpu().numpy().astype(np.float64) for name, v in stats.items()}
            totals.add(batch, values, {name: v.cpu().numpy().astype(np.float64) for name, v in bins.items()},
                       [len(ids[i]) for i in batch], [labels[i] for i in batch] if labels else None)
            if on_batch is not None:
                on_batch(batch, values)
            if kept is not None:
                for name, value in values.items():
                    kept[name][batch] = value
            if progress:
                progress(len(batch) * world.size)  # the ranks run in step: an estimate of the whole run
            if checkpointing is not None and number + 1 < len(batches):
                if checkpointing.should_stop():
                    save(number + 1)
                    raise Stopped(f"stopped after {number + 1} of {len(batches)} batches; the checkpoint keeps them")
                if checkpointing.due():
                    save(number + 1)
    totals.sums = distributed.merge_sums(world, totals.sums, loaded.device)
    example_maps = distributed.merge(world, {"maps": example_maps})["maps"]
    if kept is not None:
        kept = {name: v.cpu().numpy() for name, v in distributed.merge(
            world, {name: torch.from_numpy(v).to(loaded.device) for name, v in kept.items()}).items()}
    return Measured(totals=totals, example_maps=example_maps.cpu().numpy(), path=path, per_sentence=kept)


def check_options(
    batch_size: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0, options: Options | None = None
) -> None:
    if batch_size < 1:
        raise AttnprobeError(f"--batch-size {batch_size} is below 1: use 1 or more (default 8)")
    if resamples < 1:
        raise AttnprobeError(f"--resamples {resamples} is below 1: use 1 or more (default {DEFAULT_RESAMPLES})")
    if seed < 0:
        raise AttnprobeError(f"--seed {seed} is negative: use 0 or more")
    if options is None:
        return
    if options.attention not in ATTENTION_CHOICES:
        raise AttnprobeError(f"unknown --attention {options.attention!r}: use auto, blocked or eager")
    if options.sink < 0:
        raise AttnprobeError(f"--sink-tokens {options.sink} is negative: use 0 or more (default {SINK_TOKENS})")
    if options.window < 1:
        raise AttnprobeError(f"--window {options.window} is below 1: use 1 or more (default {RECENT_WINDOW})")
    if not options.budget_mib > 0:
        raise AttnprobeError(f"--block-mib {options.budget_mib} must be above 0 (default {DEFAULT_BUDGET_MIB})")
    if options.block_rows is not None and options.block_rows < 1:
        raise AttnprobeError(f"block_rows {options.block_rows} is below 1: use 1 or more, or None for the budget")


@dataclass
class Tokens:
    ids: list[np.ndarray]  # per sentence, int32, truncated to the model's context
    special: list[np.ndarray]  # per sentence, 1 where the tokenizer added a special token ([CLS], [SEP], BOS)
    truncated: int  # how many sentences were longer than the context


TOKENIZE_CHUNK = 1024  # sentences per tokenizer call: its per-sentence encodings are large, so keep few alive


def tokenize(loaded: LoadedModel, corpus: Corpus) -> Tokens:
    """Token ids per sentence (int32 arrays), truncated to the model's context; and how many were truncated."""
    ids: list[np.ndarray] = []
    special: list[np.ndarray] = []
    truncated = 0
    texts = corpus.texts
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start : start + TOKENIZE_CHUNK]
        with quiet_transformers():  # it warns about over-long inputs that we truncate anyway
            full = loaded.tokenizer(chunk, add_special_tokens=True, truncation=False)["input_ids"]
            cut = loaded.tokenizer(
                chunk, add_special_tokens=True, truncation=True, max_length=loaded.max_length,
                return_special_tokens_mask=True,
            )
        for k, (tokens, flags) in enumerate(zip(cut["input_ids"], cut["special_tokens_mask"])):
            if not tokens:
                line = corpus.sentences[start + k].line
                raise AttnprobeError(f"corpus line {line} gives no tokens: remove or fix it")
            truncated += len(full[k]) > len(tokens)
            ids.append(np.asarray(tokens, dtype=np.int32))
            special.append(np.asarray(flags, dtype=np.int8))
    return Tokens(ids, special, truncated)


def length_batches(ids: list[list[int]], batch_size: int, indices: list[int] | None = None) -> list[list[int]]:
    """Sentence indices (all, or the given ones) grouped into batches of similar length (least padding)."""
    chosen = range(len(ids)) if indices is None else indices
    order = sorted(chosen, key=lambda i: (len(ids[i]), i))
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


def token_labels(tokenizer: Any, ids: Any) -> list[str]:
    return [tokenizer.decode([int(t)]) for t in ids]


def tidy(stats: dict[str, np.ndarray], corpus: Corpus) -> pd.DataFrame:
    n_sentences, n_layers, n_heads = stats["entropy"].shape
    grids = np.meshgrid(np.arange(n_sentences), np.arange(n_layers), np.arange(n_heads), indexing="ij")
    frame = pd.DataFrame({key: g.ravel() for key, g in zip(("sentence", "layer", "head"), grids)})
    for name, values in stats.items():
        frame[name] = values.ravel()
    frame["category"] = [corpus.sentences[i].category for i in frame["sentence"]]
    return frame


def metric_columns(frame: pd.DataFrame) -> list[str]:
    return [name for name in (*METRICS, SPECIAL) if name in frame.columns]


def summarize_layers(heads: pd.DataFrame) -> pd.DataFrame:
    grouped = heads.groupby("layer", sort=True)
    layers = grouped[metric_columns(heads)].mean()
    layers["entropy_head_std"] = grouped["entropy"].std(ddof=0)
    layers["entropy_head_min"] = grouped["entropy"].min()
    layers["entropy_head_max"] = grouped["entropy"].max()
    return layers.reset_index()


def third(n_layers: int) -> int:
    """How many layers are "early" and how many "late": a third of them, at least one."""
    return max(1, n_layers // 3)


def early_late(layers: pd.DataFrame) -> dict[str, Any]:
    """Mean entropy of the first and last third of the layers, and early minus late."""
    n = len(layers)
    k = third(n)
    early = layers["entropy"].iloc[:k].mean()
    late = layers["entropy"].iloc[n - k :].mean()
    return {
        "early_layers": [0, k - 1],
        "late_layers": [n - k, n - 1],
        "early_entropy": float(early),
        "late_entropy": float(late),
        "difference": float(early - late),
    }


def add_intervals(
    heads: pd.DataFrame, layers: pd.DataFrame, totals: Accumulator
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """`<name>_ci_low`/`_ci_high` for every score of heads and layers, and the gradient's interval."""
    heads, layers = heads.copy(), layers.copy()
    for name in totals.shape.names:
        per_head = totals.resampled_head_means(name)  # [resample, layer, head]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN heads stay NaN
            per_layer = np.nanmean(per_head, axis=2)  # [resample, layer]
        low, high = interval(per_head)
        heads[f"{name}_ci_low"], heads[f"{name}_ci_high"] = low.ravel(), high.ravel()
        low, high = interval(per_layer)
        layers[f"{name}_ci_low"], layers[f"{name}_ci_high"] = low, high
        if name == "entropy":
            entropy_by_layer = per_layer
    summary = early_late(layers)
    k = third(entropy_by_layer.shape[1])
    early = entropy_by_layer[:, :k].mean(axis=1)  # [resample]
    late = entropy_by_layer[:, -k:].mean(axis=1)  # [resample]
    for key, resampled in (("early_entropy", early), ("late_entropy", late), ("difference", early - late)):
        low, high = interval(resampled)
        summary[f"{key}_ci"] = [float(low), float(high)]
    return heads, layers, summary


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
            "kv_heads": loaded.num_kv_heads,
            "head_dim": loaded.head_dim,
            "causal": loaded.causal,
            "max_length": loaded.max_length,
        },
        "corpus": {"path": str(corpus.path.resolve()), "sha256": corpus.sha256},
        "sentences": len(ids),
        "tokens": sum(len(t) for t in ids),
        "longest_sequence": max(len(t) for t in ids),
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
