"""Corpus -> per-head statistics: tokenize, batch by length, stream maps, reduce, tabulate."""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnprobe import __version__, defaults, distributed, kernel, layer_progress, limits, values
from attnprobe import tokens as token_classes
from attnprobe.accumulate import RESAMPLE_CELLS, Accumulator, Shape, pending_after, resamples_within_budget
from attnprobe.bootstrap import (
    BLOCK,
    CONFIDENCE,
    DEFAULT_RESAMPLES,
    FEW_SEQUENCES,
    BlockResampler,
    block_length,
    bootstrap_method,
    interval,
)
from attnprobe.corpus import IN_MEMORY, Corpus, Sentence, as_corpus, clip_text
from attnprobe.errors import AttnprobeError
from attnprobe.kernel import DEFAULT_BUDGET_MIB
from attnprobe.metrics import (
    METRICS,
    POSITION_METRICS,
    RECENT_WINDOW,
    SINK_TOKENS,
    SPECIAL,
    TOKEN_METRICS,
    SentenceSums,
    TokenClasses,
    bin_count,
    block_row_stats,
    received,
    uniform_received,
    value_weighted,
)
from attnprobe.model import LoadedModel, as_loaded, attention_modules, quiet_transformers, stream_attention
from attnprobe.resume import Checkpointing, Expected, State, Stopped, check_example_maps, check_fingerprint
from attnprobe.scores import OUTPUT_NORM, VW_METRICS, VW_POSITION_METRICS
from attnprobe.sources import tokenizer_fingerprint, weights_fingerprint

UNTAGGED = "untagged"  # the category of sentences above the first `# category:` line of a tagged corpus
EXAMPLE_TARGET_TOKENS = 12  # the example sentence for `plot` is the one closest to this length
EXAMPLE_MAX_TOKENS = 40  # and only its first 40 tokens are kept, so plots stay readable
EXAMPLES = 8  # examples.npz: the example, one sentence per category, then sentences near these lengths
EXAMPLE_LENGTHS = (6, 20, 30, 9, 16, 40, 3)
FEW_SENTENCES = defaults.FEW_SENTENCES

Progress = Callable[[float], None]  # sentences just finished: a fraction of a batch as each layer finishes
# called after each batch with its corpus indices, per score [sentence, layer, head], and its sentences
OnBatch = Callable[[list[int], dict[str, np.ndarray], list[Sentence]], None]


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
    examples: list[dict[str, Any]] = field(default_factory=list)  # up to EXAMPLES sentences' maps (report.html)
    top_tokens: pd.DataFrame | None = None  # per head, the key tokens with the highest lift (top_tokens.csv)


def analyze(
    model: Any,
    corpus: Any,
    *,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "auto",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    split: str = "lines",
    options: Options | None = None,
    keep_per_sentence: bool = False,
    limit: int | None = None,
) -> Analysis:
    """Measure every head of `model` over every sentence (or paragraph, or file: `split`) of `corpus`.

    `model`: a name or path as for `--model` (loaded on `device` in `dtype`), a LoadedModel from
    `load_model`, or a (transformers model, tokenizer) pair. `corpus`: a corpus file (str or Path), a
    list of sentences (str), or a Corpus. `limit`: only the first `limit` sequences (as `--limit`).
    """
    check_options(batch_size, resamples, seed, options)
    text = as_corpus(corpus, split=split).head(limit)
    loaded = as_loaded(model, distributed.device_for(distributed.current(), device), dtype)
    result = analyze_loaded(
        loaded, text, batch_size=batch_size, resamples=resamples, seed=seed, progress=progress, on_start=on_start,
        options=options, keep_per_sentence=keep_per_sentence,
    )
    if result.run["truncated_sentences"]:  # as the CLI prints it; also in run["truncated_lines"]
        warnings.warn(truncation_message(result.run), UserWarning, stacklevel=2)
    return result


def truncation_message(run: dict[str, Any]) -> str:
    """Which sentences were cut to the model's context, and by how many tokens (the first few named)."""
    count, cut = run["truncated_sentences"], run.get("truncated_lines", [])
    named = ", ".join(f"line {c['line']} ({cut_words(c)} over the limit)" for c in cut)
    more = f" and {count - len(cut)} more" if count > len(cut) else ""
    return (f"{count} sentence(s) were longer than the model's {run['model']['max_length']} tokens and were "
            f"truncated: {named}{more}. Shorten or split them to measure all of their tokens.")


def cut_words(cut: dict[str, Any]) -> str:
    """Say "1029 tokens", or "more than 1019 tokens" for a line cut before tokenizing (true count unknown)."""
    count = max(0, int(cut["tokens_cut"]))  # never negative, whatever a run.json says
    return f"more than {count} tokens" if cut.get("at_least") else f"{count} tokens"


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
    on_batch: OnBatch | None = None,
) -> Analysis:
    """Measure every head of a loaded model over a corpus.

    Statistics are folded into sums batch by batch, so memory does not grow with the corpus;
    `keep_per_sentence` also returns every sentence's values as `Analysis.per_sentence` (it does grow).
    """
    options = options or Options()
    check_options(batch_size, resamples, seed, options)
    started = time.perf_counter()
    scanned = scan(loaded, corpus, keep_first_window=True,
                   should_stop=checkpointing.should_stop if checkpointing is not None else None)
    if on_start:
        on_start(scanned.sentences)
    world = distributed.current()
    distributed.join(world, loaded.device)
    path = attention_path(loaded, options.attention)
    projections, weighted = value_weighted_plan(loaded, path, options)
    names = score_names(scanned.special, projections is not None)
    shape = Shape(
        names=names,
        bin_names=(*POSITION_METRICS, *VW_POSITION_METRICS) if projections is not None else POSITION_METRICS,
        layers=loaded.num_layers, heads=loaded.num_heads, bins=bin_count(scanned.longest),
        resamples=resamples_within_budget(resamples, len(names), loaded.num_layers * loaded.num_heads), seed=seed,
        categories=tuple(dict.fromkeys(label or UNTAGGED for label in corpus.labels)) if corpus.tagged else (),
        method=bootstrap_method(scanned.sentences),
        vocab=vocabulary(loaded) if options.top_tokens else 0,
    )
    if checkpointing is not None and keep_per_sentence:
        raise AttnprobeError("keep_per_sentence cannot be resumed from a checkpoint: use one or the other")
    if on_batch is not None and checkpointing and checkpointing.resume_from is not None:
        raise AttnprobeError("--per-sentence cannot continue a stopped run: the rows before the stop are gone; "
                             "drop --resume to start again with --per-sentence, or drop --per-sentence")
    fingerprint = run_fingerprint(loaded, corpus, batch_size, resamples, seed, options, world.size,
                                  weights=checkpointing is not None)
    if checkpointing is not None and checkpointing.resume_from is not None:
        check_fingerprint(checkpointing.resume_from.fingerprint, fingerprint)
    measured = measure(loaded, corpus, scanned, batch_size, progress, options, world, shape,
                       keep_per_sentence, checkpointing, fingerprint, on_batch, projections)
    totals = measured.totals
    heads = totals.heads()
    layers = summarize_layers(heads)
    per_head = {name: totals.resampled_head_means(name) for name in totals.shape.names}  # [resample, layer, head]
    heads, layers, summary = add_intervals(heads, layers, totals, per_head)
    run = run_info(loaded, corpus, scanned, batch_size, time.perf_counter() - started)
    run["distributed"] = {"world_size": world.size, "sentences_per_rank": world.counts(scanned.sentences)}
    # what identifies the weights measured: `related` loads the model again and must find these weights
    run["model"]["weights"] = fingerprint["model_sha256"] if checkpointing is not None else model_weights(loaded)
    run["attention"] = {
        "requested": options.attention, "path": measured.path, "block_budget_mib": options.budget_mib,
        "sink_tokens": options.sink, "window": options.window, "features": kernel.discover(loaded).record(),
    }
    if measured.path == "eager" and options.attention == "auto":
        run["attention"]["why_eager"] = kernel.unsupported(loaded)
    if measured.path == "fused":  # the others (windows, soft-capping, sinks) ran blocked
        run["attention"]["fused_layers"] = kernel.discover(loaded).fused_layers(loaded.device)
        run["attention"]["fused_min_tokens"] = fused_from(measured.path, options.attention)
    run["attention"]["sequences"] = sequence_paths(measured.sequences, scanned.sentences)
    run["value_weighted"] = weighted
    run["summary"] = summary
    run["bootstrap"] = bootstrap_record(shape, scanned.lengths, resamples)
    run["example_sentence"] = {"index": scanned.example_index, "line": scanned.example.line}
    run["notes"] = [note for note in (few_sentences_note(scanned.sentences, run["bootstrap"].get("block_lengths")),
                                      weighted.get("note"), run["bootstrap"].get("note")) if note]
    example = {
        "sentence": scanned.example.text,
        "tokens": token_labels(loaded.tokenizer, scanned.example_ids[:EXAMPLE_MAX_TOKENS], scanned.example.text),
        "maps": measured.example_maps,
        "total_tokens": len(scanned.example_ids),
    }
    per_sentence = tidy(measured.per_sentence, corpus) if measured.per_sentence is not None else None
    positions = totals.positions(scanned.longest)
    resampled = {name: values_.astype(np.float32) for name, values_ in per_head.items()}
    examples = [{**example, "index": scanned.example_index, "line": scanned.example.line,
                 "category": scanned.example.category}]
    if world.is_main:
        examples += more_examples(loaded, measured.path, scanned, shape, options, measured.other_maps)
    top = None
    if shape.vocab:
        top = token_classes.top_tokens(totals.sums["tokmass"], totals.sums["tokuniform"], totals.sums["tokcount"],
                                       token_classes.readable(loaded.tokenizer), min_occurrences=options.top_tokens_min)
        run["top_tokens"] = {"per_head": token_classes.TOP_TOKENS, "min_occurrences": options.top_tokens_min}
    return Analysis(heads, layers, per_sentence, run, example, totals.categories(), positions, resampled, examples,
                    top)


def more_examples(
    loaded: LoadedModel, path: str, scanned: Scan, shape: Shape, options: Options,
    captured: dict[int, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """The maps of the other example sentences (`Scan.others`).

    Most were captured during the corpus pass (`captured`, by corpus index); one that was not (its batch's
    slot was taken, it was measured before a resume, or by another rank) runs alone now. A causal model
    runs only the first EXAMPLE_MAX_TOKENS tokens: later tokens cannot change the maps of earlier ones.
    """
    captured = captured or {}
    found = []
    with kernel.statistics_attention(loaded) if path != "eager" else nullcontext():
        for index, sentence, ids in scanned.others:
            n = min(len(ids), EXAMPLE_MAX_TOKENS)
            maps = captured.get(index)
            if maps is None:
                run_ids = ids[:n] if loaded.causal else ids
                buffer = torch.full((shape.layers, shape.heads, n, n), torch.nan, device=loaded.device)  # [l, h, q, k]
                input_ids, mask = pad_batch([run_ids], loaded.device)  # [1, seq] each
                special = torch.zeros_like(mask, dtype=torch.bool) if SPECIAL in shape.names else None  # [1, seq]
                measure_batch(loaded, path, input_ids, mask, special, shape, options, [(0, n, buffer)])
                maps = buffer.cpu().numpy()
            found.append({"maps": maps, "tokens": token_labels(loaded.tokenizer, ids[:n], sentence.text),
                          "sentence": sentence.text, "total_tokens": len(ids), "index": index, "line": sentence.line,
                          "category": sentence.category})
    return found


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


def sentence_categories(corpus: Corpus, sentences: list[Sentence]) -> list[str] | None:
    """These sentences' categories (`untagged` above the first tag), or None for an untagged corpus."""
    return [s.category or UNTAGGED for s in sentences] if corpus.tagged else None


@dataclass(frozen=True)
class Options:
    """How the statistics are computed; none of these changes a value beyond float rounding."""

    attention: str = "auto"  # auto | blocked | eager
    sink: int = SINK_TOKENS  # sink_window: the first S keys
    window: int = RECENT_WINDOW  # ... and the W most recent
    budget_mib: float = DEFAULT_BUDGET_MIB  # memory for one block of attention rows
    block_rows: int | None = None  # a fixed block size instead (tests)
    value_weighted: bool = True  # also the value-weighted scores and output_norm, where the architecture allows
    top_tokens: bool = True  # keep the mass each token id receives, per head (top_tokens.csv)
    top_tokens_min: int = token_classes.MIN_OCCURRENCES  # top_tokens.csv: tokens occurring at least this often


ATTENTION_CHOICES = ("auto", "fused", "blocked", "eager")


def fused_from(path: str, attention: str) -> int | None:
    """The shortest batch the fused kernel runs: always under --attention fused; under auto from
    kernel.FUSED_MIN_TOKENS on (shorter batches run blocked, where the fused kernel's extra calls cost more
    than they save); never otherwise."""
    if path != "fused":
        return None
    return 0 if attention == "fused" else kernel.FUSED_MIN_TOKENS


PATHS = ("fused", "blocked", "eager")


def sequence_paths(counted: dict[str, int], sentences: int) -> dict[str, int]:
    """run.json's `attention.sequences`: how many sequences each path measured (under auto, batches shorter than
    fused_min_tokens run blocked), and `from_checkpoint`, those a resumed run took from its checkpoint."""
    record = {name: counted[name] for name in PATHS if counted.get(name)}
    earlier = sentences - sum(record.values())
    if earlier > 0:
        record["from_checkpoint"] = earlier
    return record


def attention_path(loaded: LoadedModel, attention: str) -> str:
    """`fused` (the fused kernel's logsumexp), `blocked` (attnprobe's statistics attention, O(n) memory) or
    `eager` (hooks on eager maps).

    `attention` is one of ATTENTION_CHOICES (check_options has checked it).
    """
    if attention == "eager":
        return "eager"
    reason = kernel.unsupported(loaded)
    if reason is None:
        return "fused" if attention == "auto" else attention
    if attention != "auto":
        raise AttnprobeError(f"--attention {attention} does not implement {reason}: use --attention eager or auto")
    return "eager"


def score_names(special: bool, weighted: bool) -> tuple[str, ...]:
    """The per-head scores of a run: METRICS, special_tokens where the tokenizer adds special tokens, and the
    value-weighted scores and output_norm where they are measured."""
    return (*METRICS, *((SPECIAL,) if special else ()), *TOKEN_METRICS, *(VW_METRICS if weighted else ()))


def value_weighted_plan(loaded: LoadedModel, path: str, options: Options) -> tuple[list[Any] | None, dict[str, Any]]:
    """Each layer's output projection, when the value-weighted scores are measured (else None), and what run.json
    records about them: `measured`, the projection found, or why not (`why`, and a `note` for run.json's notes
    when the architecture, not the user, is the reason)."""
    if not options.value_weighted:
        return None, {"measured": False, "why": "turned off (--no-value-weighted)"}
    modules = [module for module, _ in attention_modules(loaded.model)]
    projections, found = values.find_projections(loaded.model, modules, loaded.num_heads)
    why = None if projections is not None else found
    if why is None and path == "eager":
        why = eager_values_reason(loaded, modules)
    if why is not None:
        return None, {"measured": False, "why": why,
                      "note": f"value-weighted scores and output_norm not measured: {why}"}
    return projections, {"measured": True, "output_projection": found.removeprefix("found: ")}


def eager_values_reason(loaded: LoadedModel, modules: list[Any]) -> str | None:
    """Why the eager path cannot read this model's values (None when it can): the values are read by calling the
    model's own eager attention function under another name (values.capturing_values), which a model that
    computes attention itself, or changes its eager path by a setting, does not call."""
    reason = kernel.config_reason(loaded)
    if reason is not None:
        return f"the eager path cannot read the values of {reason}"
    if any(values.eager_function(module) is None for module in modules):
        return f"the eager path cannot read the values of {type(modules[0]).__name__}: no eager_attention_forward"
    return None


def attention_context(loaded: LoadedModel, path: str, weighted: bool) -> Any:
    """What the model runs under for `path`: attnprobe's statistics attention, or on the eager path its own eager
    function (under `attnprobe_eager` when the value-weighted scores need its values)."""
    if path != "eager":
        return kernel.statistics_attention(loaded)
    return values.capturing_values(loaded.model) if weighted else nullcontext()


@dataclass
class Measured:
    totals: Accumulator  # every statistic, summed over the sentences (all ranks merged)
    example_maps: np.ndarray  # [layer, head, query, key], the example's first tokens
    path: str  # fused, blocked or eager
    per_sentence: dict[str, np.ndarray] | None = None  # per score [sentence, layer, head], when kept
    other_maps: dict[int, np.ndarray] = field(default_factory=dict)  # corpus index -> maps of `Scan.others`
    sequences: dict[str, int] = field(default_factory=dict)  # path -> sequences it measured (all ranks), by this run


def measure(
    loaded: LoadedModel, corpus: Corpus, scanned: Scan, batch_size: int, progress: Progress | None,
    options: Options, world: distributed.World, shape: Shape, keep_per_sentence: bool = False,
    checkpointing: Checkpointing | None = None, fingerprint: dict[str, Any] | None = None,
    on_batch: OnBatch | None = None, projections: list[Any] | None = None,
) -> Measured:
    """Run every batch of this rank's sentences and fold its statistics into an Accumulator.

    The corpus streams past in windows of WINDOW_SENTENCES: each is tokenized, sorted by length and
    batched, and dropped when done. Under torchrun each rank measures its shard, and the sums are merged.
    `projections`: each layer's output projection, to measure the value-weighted scores (value_weighted_plan).
    """
    path = attention_path(loaded, options.attention)
    totals = Accumulator(shape)
    kept = {name: np.full((scanned.sentences, shape.layers, shape.heads), np.nan) for name in shape.names} \
        if keep_per_sentence else None  # [sentence, layer, head]
    n = min(len(scanned.example_ids), EXAMPLE_MAX_TOKENS)
    example_maps = torch.full((shape.layers, shape.heads, n, n), torch.nan, device=loaded.device)  # [l, h, q, k]
    total = batch_count(scanned.sentences, batch_size, world)
    # the other examples' maps are taken from their batches as they pass (rank 0's only: it writes them)
    others = {index: min(len(ids), EXAMPLE_MAX_TOKENS) for index, _, ids in scanned.others} if world.is_main else {}
    other_maps: dict[int, torch.Tensor] = {}  # corpus index -> [layer, head, query, key]
    slots = batch_size if path == "eager" else 1  # the statistics attention (fused or blocked) hands back one map
    start = 0
    state = checkpointing.resume_from if checkpointing is not None else None
    if state is not None:
        state.check_fits(totals.state(), resume_expected(state, scanned, batch_size, world, total, shape))
        start = state.batches_done
        totals.restore(state.sums, state.token_rows)  # the top-token rows met only: they stay sparse
        if state.example_maps is not None and state.example_maps.shape == tuple(example_maps.shape):
            example_maps = torch.from_numpy(state.example_maps).to(loaded.device)
    example_done = False  # whether the example's batch is among those the checkpoint holds

    def reached_start() -> None:
        """At the last batch the checkpoint holds: its example maps must be there exactly when that batch was."""
        if state is not None and number == start:
            check_resumed_example(loaded, state, example_done, scanned, tuple(example_maps.shape))

    def save(done: int) -> None:
        maps = example_maps.cpu().numpy()
        checkpointing.save(State(fingerprint or {}, done, totals.state(), None if np.isnan(maps).all() else maps))
        checkpointing.last_saved = time.monotonic()

    def run(batch: list[int], sentences: list[Sentence], tokens: Tokens) -> None:
        """Measure one batch (corpus indices `batch`; `tokens` holds theirs) and fold it into the totals; progress
        advances layer by layer (a fraction of the batch's sentences each), so one long document moves too."""
        ids, special_ids = tokens.ids, tokens.special
        input_ids, mask = pad_batch(ids, loaded.device)  # [batch, seq] each
        special_mask = pad_batch(special_ids, loaded.device)[0].bool()  # [batch, seq]
        special = special_mask if SPECIAL in shape.names else None  # [batch, seq]
        classes = key_classes(loaded, input_ids, special_mask)
        wanted = [(batch.index(scanned.example_index), n, example_maps)] if scanned.example_index in batch else []
        for row, index in enumerate(batch):
            if index in others and index not in other_maps and len(wanted) < slots:
                m = others[index]
                other_maps[index] = torch.full((shape.layers, shape.heads, m, m), torch.nan, device=loaded.device)
                wanted.append((row, m, other_maps[index]))
        share = len(batch) * world.size / shape.layers  # the ranks run in step: an estimate of the whole run
        labels = sentence_categories(corpus, sentences)
        resamplers = [BlockResampler.draw(index, len(t), shape.resamples, shape.seed) for index, t in zip(batch, ids)] \
            if shape.method == BLOCK else None
        taken: dict[str, torch.Tensor] = {}
        with layer_progress.watching(loaded.model, input_ids.shape[1], within, rows=len(batch)):  # layer by layer
            stats, bins = measure_batch(loaded, path, input_ids, mask, special, shape, options, wanted,
                                        on_layer=(lambda: progress(share)) if progress else None,
                                        resamplers=resamplers, projections=projections, tokens=classes,
                                        received_by=taken if shape.vocab else None, paths=paths,
                                        on_resampled=lambda layer, means: totals.add_resampled(layer, means, labels))
        if shape.vocab:
            real = mask.bool()  # [batch, seq]
            totals.add_tokens(input_ids[real], taken["mass"][:, :, real], taken["uniform"][:, real])
        check_finite(loaded, stats, sentences, [len(t) for t in ids])
        check_values_finite(loaded, stats, sentences, [len(t) for t in ids])
        totals.add(batch, stats, bins, [len(t) for t in ids], labels)
        if on_batch is not None:
            on_batch(batch, stats, sentences)
        if kept is not None:
            for name, value in stats.items():
                kept[name][batch] = value

    paths: dict[str, int] = {}  # path -> sequences this process ran through it (measure_batch counts them)
    within = layer_progress.reporter(progress, 0.0)  # progress(0.0, within=...) where it takes a `within` keyword
    number = 0  # batches begun, over the whole run
    with attention_context(loaded, path, projections is not None):
        for first, window in windows(corpus.stream(), WINDOW_SENTENCES):
            mine = [i - first for i in world.shard(first + len(window), first)]  # positions in the window
            count = -(-len(mine) // batch_size)
            if number + count <= start:  # done before the checkpoint: skip without tokenizing
                number += count
                example_done |= first <= scanned.example_index < first + len(window) \
                    and scanned.example_index % world.size == world.rank
                reached_start()
                if progress:
                    progress(len(mine) * world.size)
                continue
            cached, scanned.first_window = scanned.first_window, None  # the scan's ids of window 0, if it kept them
            if first == 0 and cached is not None and len(cached.ids) == len(window):
                tokens = cached.take(mine)
            else:
                tokens = tokenize_sentences(loaded, [window[k] for k in mine])
            del cached
            for local in length_batches(tokens.ids, batch_size):
                number += 1
                batch = [first + mine[k] for k in local]
                if number > start:
                    run(batch, [window[mine[k]] for k in local], tokens.take(local))
                else:  # done before the checkpoint
                    example_done |= scanned.example_index in batch
                    reached_start()
                    if progress:
                        progress(len(local) * world.size)
                if checkpointing is not None and start < number < total:
                    if checkpointing.should_stop():
                        save(number)
                        raise Stopped(f"stopped after {number} of {total} batches; the checkpoint keeps them")
                    if checkpointing.due():
                        save(number)
    if checkpointing is not None and world.size > 1:
        save(number)  # a rank done with its shard waits for the others: a stop from now on resumes from here
    try:
        totals.sums = distributed.merge_sums(world, totals.sums, loaded.device)
        counted = distributed.merge_sums(world, {name: np.asarray([paths.get(name, 0)], dtype=np.int64)
                                                 for name in PATHS}, loaded.device)
        example_maps = distributed.merge(world, {"maps": example_maps})["maps"]
    except RuntimeError as err:  # another rank stopped or died before the merge
        if checkpointing is None or world.size == 1:
            raise
        raise Stopped(f"another process stopped before the results were merged; this one finished its {number} "
                      "batches and its checkpoint keeps them") from err
    if kept is not None:
        kept = {name: v.cpu().numpy() for name, v in distributed.merge(
            world, {name: torch.from_numpy(v).to(loaded.device) for name, v in kept.items()}).items()}
    return Measured(totals=totals, example_maps=example_maps.cpu().numpy(), path=path, per_sentence=kept,
                    other_maps={index: maps.cpu().numpy() for index, maps in other_maps.items()},
                    sequences={name: int(count[0]) for name, count in counted.items() if int(count[0])})


def check_finite(loaded: LoadedModel, stats: dict[str, np.ndarray], sentences: list[Sentence],
                 lengths: list[int]) -> None:
    """Refuse a batch whose attention was NaN or infinite (broken weights, or an overflow in a low
    precision): every sentence of 2 or more tokens has an entropy in every head. `stats` per score
    [sentence, layer, head]."""
    entropy = stats["entropy"]  # [sentence, layer, head]
    broken = [k for k, n in enumerate(lengths) if n >= 2 and np.isnan(entropy[k]).any()]
    broken += [k for k in range(len(lengths)) if any(np.isinf(v[k]).any() for v in stats.values())]
    if not broken:
        return
    k = min(broken)
    layer = next((int(i) for i in np.argwhere(~np.isfinite(entropy[k]))[:, 0]), 0)
    fix = "its weights hold NaN or inf: check or re-save them" if loaded.dtype == "float32" else \
        f"its weights hold NaN or inf, or {loaded.dtype} overflows: check the weights, or run with --dtype float32"
    raise AttnprobeError(f"model {loaded.spec} gives NaN or infinite attention (layer {layer}, on corpus line "
                         f"{sentences[k].line}): {fix}")


def check_values_finite(loaded: LoadedModel, stats: dict[str, np.ndarray], sentences: list[Sentence],
                        lengths: list[int]) -> None:
    """Refuse a batch whose output_norm is NaN where the attention itself was finite: a NaN in a head's value or
    output-projection weights leaves its value-weighted scores and output_norm empty, and the next layer cannot show
    it when the head is in the last layer. Every sentence of 2 or more tokens has an output_norm in every head.
    `stats` per score [sentence, layer, head]; runs after `check_finite`."""
    norm = stats.get(OUTPUT_NORM)  # [sentence, layer, head]; absent when the value-weighted scores are not measured
    if norm is None:
        return
    broken = [k for k, n in enumerate(lengths) if n >= 2 and np.isnan(norm[k]).any()]
    if not broken:
        return
    k = min(broken)
    layer, head = (int(i) for i in np.argwhere(np.isnan(norm[k]))[0])
    dtype = "" if loaded.dtype == "float32" else f", or {loaded.dtype} overflows (run with --dtype float32)"
    raise AttnprobeError(
        f"model {loaded.spec} gives NaN value-weighted scores and output_norm in layer {layer}, head {head} (on corpus "
        f"line {sentences[k].line}): the value or output-projection weights of that head hold NaN or inf{dtype}: "
        "check or re-save the weights"
    )


def measure_batch(
    loaded: LoadedModel, path: str, input_ids: torch.Tensor, mask: torch.Tensor, special: torch.Tensor | None,
    shape: Shape, options: Options, examples: list[tuple[int, int, torch.Tensor]] = (),
    on_layer: Callable[[], None] | None = None, projections: list[Any] | None = None,
    resamplers: list[BlockResampler] | None = None,
    on_resampled: Callable[[int, dict[str, np.ndarray]], None] | None = None,
    tokens: TokenClasses | None = None, received_by: dict[str, torch.Tensor] | None = None,
    paths: dict[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-sentence statistics [sentence, layer, head] and position bins [sentence, layer, head, bin] of one batch.

    `examples`: (row in the batch, tokens kept, maps [layer, head, query, key]) of sentences whose maps to write;
    the blocked path writes the first one only. `on_layer` is called as each layer's statistics arrive.
    `projections`: each layer's output projection, for the value-weighted scores (the eager path reads the values
    that values.capturing_values keeps, so it runs inside that context).
    `resamplers`: one per sentence, for the block bootstrap: each layer's rows are resampled as they arrive and
    `on_resampled(layer, per score [resample, sentence, head])` gets the means; the rows are then dropped.
    `tokens`: the batch's ids and punctuation flags (punctuation, duplicate); `received_by`, when given, gets
    "mass" [layer, head, batch, seq], the mass each key position received, and "uniform" [layer, batch, seq], what
    uniform rows would have given it. `paths`, when given, counts the batch's sentences under the path that ran
    them ("fused", "blocked" or "eager").
    """
    b, sink, window = input_ids.shape[0], options.sink, options.window
    k = min(shape.bins, bin_count(input_ids.shape[1]))
    stats = torch.full((len(shape.names), b, shape.layers, shape.heads), torch.nan,
                       device=loaded.device)  # [score, batch, layer, head]
    bins = torch.full((len(shape.bin_names), b, shape.layers, shape.heads, k), torch.nan,
                      device=loaded.device)  # [binned score, batch, layer, head, bin]

    spans = kernel.discover(loaded).spans(shape.layers)  # each layer's attention window, None: every key
    lengths = mask.sum(dim=-1)  # [batch]
    if received_by is not None:
        n = input_ids.shape[1]
        received_by["mass"] = torch.zeros(shape.layers, shape.heads, b, n, device=loaded.device)  # [l, h, b, seq]
        uniform = {span: uniform_received(lengths, n, loaded.causal, span) for span in set(spans)}  # [batch, seq]
        received_by["uniform"] = torch.stack([uniform[span] for span in spans])  # [layer, batch, seq]
    rows_of = Rows(shape.names, shape.bin_names)

    def store(layer: int, sums: SentenceSums) -> None:
        if received_by is not None and sums.received is not None:
            received_by["mass"][layer] = sums.received.transpose(0, 1)  # [head, batch, seq]
        if sums.total is not None:
            stats[rows_of.scores(sums.names), :, layer] = sums.stacked_means()  # [score, batch, head]
        if sums.bin_total is not None:
            bins[rows_of.bins(sums.binned), :, layer] = sums.stacked_bin_means()  # [binned score, batch, head, bin]
        if resamplers and on_resampled is not None:
            on_resampled(layer, resample_rows(sums.rows, shape.names, resamplers))
        if on_layer is not None:
            on_layer()

    if path != "eager":
        def on_sums(layer: int, sums: SentenceSums, maps: torch.Tensor | None) -> None:
            store(layer, sums)
            if maps is not None:
                examples[0][2][layer] = maps  # [head, query, key]

        ran = kernel.run_batch(loaded, input_ids, mask, on_sums, special=special, sink=sink, window=window, bins=k,
                         budget_mib=options.budget_mib, block_rows=options.block_rows,
                         example=examples[0][:2] if examples else None, fused=fused_from(path, options.attention),
                         projections=projections, keep_rows=bool(resamplers), tokens=tokens)
    else:
        modules = [module for module, _ in attention_modules(loaded.model)]

        def on_map(layer: int, p: torch.Tensor) -> None:
            weighted = None if projections is None else (values.take_values(modules[layer]), projections[layer])
            store(layer, map_sums(p, lengths, loaded.causal, special, sink, window, k, spans[layer], weighted, tokens,
                                  keep_rows=bool(resamplers)))
            for row, q, maps in examples:
                maps[layer] = p[row, :, :q, :q].float()  # [head, query, key]

        stream_attention(loaded, input_ids, mask, on_map)
        ran = "eager"
    if paths is not None:
        paths[ran] = paths.get(ran, 0) + b
    return _to_numpy(shape.names, stats), _to_numpy(shape.bin_names, bins)


class Rows:
    """Where a layer's stacked scores (SentenceSums.names, .binned) go in measure_batch's stacked tensors: the
    indices, looked up once per order of names."""

    def __init__(self, names: tuple[str, ...], bin_names: tuple[str, ...]) -> None:
        self.names, self.bin_names = names, bin_names
        self._found: dict[tuple[tuple[str, ...], bool], list[int]] = {}

    def scores(self, names: tuple[str, ...]) -> list[int]:
        return self._find(names, False)

    def bins(self, names: tuple[str, ...]) -> list[int]:
        return self._find(names, True)

    def _find(self, names: tuple[str, ...], binned: bool) -> list[int]:
        if (names, binned) not in self._found:
            order = self.bin_names if binned else self.names
            self._found[names, binned] = [order.index(name) for name in names]  # ValueError: a score not asked for
        return self._found[names, binned]


def resample_rows(
    rows: dict[str, torch.Tensor], names: tuple[str, ...], resamplers: list[BlockResampler]
) -> dict[str, np.ndarray]:
    """Per score [resample, sentence, head]: each sentence's block-bootstrap means of one layer's row values
    (`rows` per score [sentence, head, query]); every score of a sentence goes through one resampler together."""
    heads = rows[names[0]].shape[1]
    out = {name: np.empty((resamplers[0].starts.shape[0], len(resamplers), heads)) for name in names}
    for k, resampler in enumerate(resamplers):
        n = resampler.rows
        stacked = torch.cat([rows[name][k, :, :n] for name in names]).cpu().double().numpy()  # [score x head, query]
        means = resampler.means(stacked)  # [resample, score x head]
        for j, name in enumerate(names):
            out[name][:, k] = means[:, j * heads : (j + 1) * heads]  # [resample, head]
    return out


def vocabulary(loaded: LoadedModel) -> int:
    """How many token ids the model's inputs may hold: the larger of its embedding's and its tokenizer's size."""
    return max(int(getattr(loaded.model.config, "vocab_size", 0) or 0), token_classes.size(loaded.tokenizer))


def key_classes(loaded: LoadedModel, input_ids: torch.Tensor, special: torch.Tensor) -> TokenClasses:
    """The batch's token ids and which positions hold punctuation (never a special token), [batch, seq] each."""
    flags = token_classes.punctuation_of(loaded.tokenizer, input_ids.cpu().numpy(), vocabulary(loaded))  # [b, seq]
    punctuation = torch.from_numpy(flags).to(input_ids.device) & ~special  # [batch, seq]
    return TokenClasses(input_ids, punctuation)


def map_sums(
    p: torch.Tensor, lengths: torch.Tensor, causal: bool, special: torch.Tensor | None, sink: int, window: int,
    bins: int, span: int | None, weighted: tuple[torch.Tensor, Any] | None = None, tokens: TokenClasses | None = None,
    keep_rows: bool = False,
) -> SentenceSums:
    """The sums of a whole eager map p [batch, head, query, key]; with `weighted` (the layer's values and output
    projection) the value-weighted scores and output_norm too; with `tokens`, punctuation, duplicate_token and the
    mass each key received (SentenceSums.received)."""
    per_row = block_row_stats(p, 0, lengths, causal, special, sink, window, span=span, tokens=tokens)
    if weighted is not None:
        per_row.update(eager_value_weighted(p, *weighted, lengths, causal, sink, window, span))
    sums = SentenceSums(rows={} if keep_rows else None)
    sums.add(per_row, 0, lengths, bins)
    if tokens is not None:
        sums.received = received(p.float(), 0, lengths)  # [batch, head, key]
    return sums


def eager_value_weighted(
    p: torch.Tensor, value: torch.Tensor, projection: Any, lengths: torch.Tensor, causal: bool, sink: int,
    window: int, span: int | None,
) -> dict[str, torch.Tensor]:
    """The value-weighted row statistics and output_norm of a whole eager map p [batch, head, query, key], from the
    layer's values [batch, kv head, key, head size] and output projection: [batch, head, query] each."""
    heads = p.shape[1]
    factors = values.head_factors(projection, heads)  # [head, k, head size]
    weighted = values.weighted_map(p, values.key_norms(value, factors))  # [batch, head, query, key]
    per_row = value_weighted(block_row_stats(weighted, 0, lengths, causal, None, sink, window, span=span))
    per_head = value.float().repeat_interleave(heads // value.shape[1], dim=1)  # [batch, head, key, head size]
    per_row[OUTPUT_NORM] = values.head_norms(p.float() @ per_head, factors)  # [batch, head, query]
    return per_row


def _to_numpy(names: tuple[str, ...], stacked: torch.Tensor) -> dict[str, np.ndarray]:
    """Per name, its slice of `stacked` [name, ...] in float64."""
    return dict(zip(names, stacked.cpu().numpy().astype(np.float64)))


def windows(sentences: Iterable[Sentence], size: int) -> Iterator[tuple[int, list[Sentence]]]:
    """(index of the first, sentences) for consecutive windows of `size` sentences."""
    first, window = 0, []
    for sentence in sentences:
        window.append(sentence)
        if len(window) == size:
            yield first, window
            first, window = first + size, []
    if window:
        yield first, window


def batch_count(sentences: int, batch_size: int, world: distributed.World) -> int:
    """How many batches this rank runs over a corpus of `sentences`: windows are batched separately."""
    total = 0
    for first in range(0, sentences, WINDOW_SENTENCES):
        end = min(first + WINDOW_SENTENCES, sentences)
        total += -(-len(world.shard(end, first)) // batch_size)
    return total


def batch_sizes(sentences: int, batch_size: int, world: distributed.World, batches: int) -> tuple[list[int], int]:
    """The sizes of this rank's first `batches` batches, in the order they run, and the corpus index after the
    window the last of them is in: each window's shard is cut into batches of `batch_size`, the last one shorter
    (length_batches), so this needs no tokenizing."""
    sizes: list[int] = []
    end = 0
    for first in range(0, sentences, WINDOW_SENTENCES):
        if len(sizes) >= batches:
            break
        end = min(first + WINDOW_SENTENCES, sentences)
        mine = len(world.shard(end, first))
        sizes += [min(batch_size, mine - k) for k in range(0, mine, batch_size)][: batches - len(sizes)]
    return sizes, end


def resume_expected(state: State, scanned: Scan, batch_size: int, world: distributed.World, total: int,
                    shape: Shape) -> Expected:
    """What the run's own batches say a checkpoint of `state.batches_done` batches holds (resume.Expected)."""
    sizes, reached = batch_sizes(scanned.sentences, batch_size, world, state.batches_done)
    return Expected(batches=total, sentences=sum(sizes), pending=pending_after(sizes, shape.method),
                    corpus=scanned.sentences, reached=reached, rank=world.rank, size=world.size)


def check_resumed_example(loaded: LoadedModel, state: State, done: bool, scanned: Scan, shape: tuple[int, ...]) -> None:
    """The checkpoint's example maps, once the run knows whether the example's batch was among those done: every
    row sums to 1 unless the sentence's later keys were cut (an encoder) or the model has sink logits."""
    dtype = getattr(torch, str(loaded.dtype), torch.float32)
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    sinks = any(f.sinks for f in kernel.discover(loaded).features)
    whole = (loaded.causal or len(scanned.example_ids) <= shape[-1]) and not sinks
    check_example_maps(state, done, shape, eps, whole)


def check_options(
    batch_size: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0, options: Options | None = None
) -> None:
    if batch_size < 1:
        raise AttnprobeError(f"--batch-size {batch_size} is below 1: use 1 or more (default 8)")
    if resamples < 1:
        raise AttnprobeError(f"--resamples {resamples} is below 1: use 1 or more (default {DEFAULT_RESAMPLES})")
    if seed < 0:
        raise AttnprobeError(f"--seed {seed} is negative: use 0 or more")
    limits.check_whole("--batch-size", batch_size, 1, limits.MAX_BATCH_SIZE, 8)
    limits.check_whole("--resamples", resamples, 1, limits.MAX_RESAMPLES, DEFAULT_RESAMPLES)
    limits.check_whole("--seed", seed, 0, limits.MAX_SEED)
    if options is None:
        return
    if options.attention not in ATTENTION_CHOICES:
        raise AttnprobeError(f"unknown --attention {options.attention!r}: use auto, fused, blocked or eager")
    if options.sink < 0:
        raise AttnprobeError(f"--sink-tokens {options.sink} is negative: use 0 or more (default {SINK_TOKENS})")
    if options.window < 1:
        raise AttnprobeError(f"--window {options.window} is below 1: use 1 or more (default {RECENT_WINDOW})")
    if options.budget_mib <= 0:
        raise AttnprobeError(f"--block-mib {options.budget_mib} must be above 0 (default {DEFAULT_BUDGET_MIB})")
    limits.check_real("--block-mib", options.budget_mib, 0.0, limits.MAX_BLOCK_MIB, DEFAULT_BUDGET_MIB, low_open=True)
    limits.check_whole("--sink-tokens", options.sink, 0, limits.MAX_POSITIONS, SINK_TOKENS)
    limits.check_whole("--window", options.window, 1, limits.MAX_POSITIONS, RECENT_WINDOW)
    limits.check_whole("--top-tokens-min", options.top_tokens_min, 1, limits.MAX_POSITIONS,
                       token_classes.MIN_OCCURRENCES)
    if options.block_rows is not None and options.block_rows < 1:
        raise AttnprobeError(f"block_rows {options.block_rows} is below 1: use 1 or more, or None for the budget")


@dataclass
class Tokens:
    ids: list[np.ndarray]  # per sentence, int32, truncated to the model's context
    special: list[np.ndarray]  # per sentence, 1 where the tokenizer added a special token ([CLS], [SEP], BOS)
    # (line, tokens beyond the context, whether the line was clipped before tokenizing so the count is a lower bound)
    cut: list[tuple[int, int, bool]] = field(default_factory=list)

    @property
    def truncated(self) -> int:
        """How many sentences were longer than the context."""
        return len(self.cut)

    def take(self, positions: list[int]) -> Tokens:
        """The sentences at these positions (without the record of truncation)."""
        return Tokens([self.ids[k] for k in positions], [self.special[k] for k in positions])


TOKENIZE_CHUNK = 1024  # sentences per tokenizer call: its per-sentence encodings are large, so keep few alive
WINDOW_SENTENCES = 4096  # sentences tokenized, sorted by length and batched together: all a run holds of the corpus


def tokenize(loaded: LoadedModel, corpus: Corpus) -> Tokens:
    """Token ids of every sentence (int32 arrays), truncated to the model's context; and how many were truncated."""
    return tokenize_sentences(loaded, list(corpus.stream()))


def tokenize_sentences(loaded: LoadedModel, sentences: list[Sentence]) -> Tokens:
    """`tokenize` for a list of sentences, in chunks of TOKENIZE_CHUNK."""
    ids: list[np.ndarray] = []
    special: list[np.ndarray] = []
    cut: list[tuple[int, int]] = []
    for start in range(0, len(sentences), TOKENIZE_CHUNK):
        chunk = sentences[start : start + TOKENIZE_CHUNK]
        texts = [clip_text(s.text, loaded.max_length) for s in chunk]  # a huge line: only what can be kept
        with quiet_transformers():  # it warns about over-long inputs that we truncate anyway
            kept = token_classes.encode(loaded, texts, truncation=True, max_length=loaded.max_length,
                                        return_special_tokens_mask=True)
            # only a sentence that reaches the limit can have been cut: count its full length
            long = [k for k, tokens in enumerate(kept["input_ids"]) if len(tokens) >= loaded.max_length]
            full = dict(zip(long, token_classes.encode(loaded, [texts[k] for k in long],
                                                       truncation=False)["input_ids"])) if long else {}
        for k, (tokens, flags) in enumerate(zip(kept["input_ids"], kept["special_tokens_mask"])):
            if not tokens:
                raise AttnprobeError(f"corpus line {chunk[k].line} gives no tokens: remove or fix it")
            beyond = len(full[k]) - len(tokens) if k in full else 0  # tokens of the (clipped) text past the limit
            if texts[k] is not chunk[k].text:  # clipped before tokenizing: the line has more than `beyond`
                cut.append((chunk[k].line, max(0, beyond), True))
            elif beyond > 0:
                cut.append((chunk[k].line, beyond, False))
            ids.append(np.asarray(tokens, dtype=np.int32))
            special.append(np.asarray(flags, dtype=np.int8))
    return Tokens(ids, special, cut)


@dataclass
class Scan:
    """What a tokenizing pass over the whole corpus tells before the measuring pass; nothing per sentence."""

    sentences: int = 0
    tokens: int = 0
    longest: int = 0
    special: bool = False  # whether the tokenizer adds special tokens
    truncated: int = 0
    cut: list[tuple[int, int, bool]] = field(default_factory=list)  # Tokens.cut of the first truncated ones
    lengths: list[int] = field(default_factory=list)  # tokens of the first FEW_SEQUENCES sequences (block bootstrap)
    example_index: int = -1  # the example sentence for `plot`: the first closest to EXAMPLE_TARGET_TOKENS
    example: Sentence | None = None
    example_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    first_window: Tokens | None = None  # the ids of the first WINDOW_SENTENCES sentences, when asked to keep them
    # candidates for more examples: per category and per target length, the first closest sentence
    candidates: dict[tuple[str, Any], tuple[int, Sentence, np.ndarray]] = field(default_factory=dict)

    def offer(self, index: int, sentence: Sentence, ids: np.ndarray) -> None:
        """Keep `sentence` if it is the closest yet to its category's target or to a target length."""
        keys = [(("length", t), t) for t in EXAMPLE_LENGTHS]
        if sentence.category is not None and (("category", sentence.category) in self.candidates
                                              or len(self.categories) < EXAMPLES):
            keys.append((("category", sentence.category), EXAMPLE_TARGET_TOKENS))
        for key, target in keys:
            best = self.candidates.get(key)
            if best is None or abs(len(ids) - target) < abs(len(best[2]) - target):
                self.candidates[key] = (index, sentence, ids)

    @property
    def categories(self) -> list[str]:
        return [key[1] for key in self.candidates if key[0] == "category"]

    @property
    def others(self) -> list[tuple[int, Sentence, np.ndarray]]:
        """Up to EXAMPLES - 1 sentences besides the example: one per category first, then spread over lengths."""
        chosen = {self.example_index}
        picked = []
        for key in [k for k in self.candidates if k[0] == "category"] + [("length", t) for t in EXAMPLE_LENGTHS]:
            index, sentence, ids = self.candidates.get(key, (None, None, None))
            if index is not None and index not in chosen and len(picked) < EXAMPLES - 1:
                chosen.add(index)
                picked.append((index, sentence, ids))
        return picked


CUT_SHOWN = 5  # truncated sentences named in the warning
STOP_CHECK_SECONDS = 0.5  # how often the counting pass asks whether the run should stop


def scan(loaded: LoadedModel, corpus: Corpus, keep_first_window: bool = False,
         should_stop: Callable[[], bool] | None = None) -> Scan:
    """Tokenize the corpus once, chunk by chunk, keeping only totals, the longest and the example sentence.

    `keep_first_window`: also keep the ids of the first WINDOW_SENTENCES sentences (`Scan.first_window`), so
    that the measuring pass need not tokenize them again: a corpus of one window is tokenized once. At most
    one window is kept, whatever the corpus's size. `should_stop` (Ctrl-C, SIGTERM) is asked between chunks of
    TOKENIZE_CHUNK sentences, every STOP_CHECK_SECONDS: a stop raises Stopped within about that time, not after
    counting a large corpus whole (a corpus of one chunk is not asked: it is counted in a moment).
    """
    result = Scan()
    window = Tokens([], []) if keep_first_window else None
    asked = time.monotonic()
    for first, whole in windows(corpus.stream(), TOKENIZE_CHUNK):
        if should_stop is not None and first > 0 and time.monotonic() - asked >= STOP_CHECK_SECONDS:
            asked = time.monotonic()
            if should_stop():
                raise Stopped(f"stopped while counting the corpus ({first} sentences counted), before any batch "
                              "was measured")
        tokens = tokenize_sentences(loaded, whole)  # clips each text itself, and so knows which it clipped
        chunk = [clipped(s, loaded.max_length) for s in whole]  # an example keeps the cut text, not 50 MB
        del whole
        if window is not None and first < WINDOW_SENTENCES:
            window.ids.extend(tokens.ids[: WINDOW_SENTENCES - first])
            window.special.extend(tokens.special[: WINDOW_SENTENCES - first])
        result.sentences += len(chunk)
        result.truncated += tokens.truncated
        result.cut.extend(tokens.cut[: CUT_SHOWN - len(result.cut)])
        for k, (ids, flags) in enumerate(zip(tokens.ids, tokens.special)):
            if first + k < FEW_SEQUENCES:
                result.lengths.append(len(ids))
            result.tokens += len(ids)
            result.longest = max(result.longest, len(ids))
            result.special = result.special or bool(flags.any())
            if result.example is None or _closer(len(ids), len(result.example_ids)):
                result.example_index, result.example, result.example_ids = first + k, chunk[k], ids
            result.offer(first + k, chunk[k], ids)
    result.first_window = window
    return result


def clipped(sentence: Sentence, max_tokens: int) -> Sentence:
    """`sentence` with its text cut by `clip_text` (the same object when it is short enough)."""
    text = clip_text(sentence.text, max_tokens)
    return sentence if text is sentence.text else replace(sentence, text=text)


def _closer(length: int, best: int) -> bool:
    """Whether a sentence of `length` tokens is a better example than the best so far (earlier wins ties)."""
    return abs(length - EXAMPLE_TARGET_TOKENS) < abs(best - EXAMPLE_TARGET_TOKENS)


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


def token_labels(tokenizer: Any, ids: Any, text: str | None = None) -> list[str]:
    """A label per token id: its span of `text`, so any script reads right.

    With a fast tokenizer and the text the ids came from, token i is labelled with the text from the end of
    the token before it to its own end (a leading space stays with its word, as in GPT-2's `Ġworld`). A
    character that byte-level BPE splits into several tokens (Cyrillic, CJK, emoji) goes to the first of
    them and the others get "" - so the labels of a sentence's tokens join back into the sentence. A special
    token added by the tokenizer keeps its own name (`<s>`, `[CLS]`). Without offsets (a slow tokenizer,
    no `text`, or ids that `text` does not give) the ids are decoded together, each label being what its
    token adds, never a lone `\ufffd`.
    """
    ids = [int(t) for t in ids]
    spans = _offset_labels(tokenizer, ids, text) if text is not None else None
    return spans if spans is not None else _decoded_labels(tokenizer, ids)


def _offset_labels(tokenizer: Any, ids: list[int], text: str) -> list[str] | None:
    """Labels from the fast tokenizer's character offsets, or None when it has none or they do not fit `ids`."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        with quiet_transformers():
            encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True,
                                return_special_tokens_mask=True)
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return None
    encoded_ids = list(encoded["input_ids"])
    if encoded_ids[: len(ids)] != ids:  # --bos prepended a BOS the tokenizer does not add, or stripped the one it adds
        special = set(getattr(tokenizer, "all_special_ids", ()))
        if ids and ids[0] in special and encoded_ids[: len(ids) - 1] == ids[1:]:
            rest = _offset_labels(tokenizer, ids[1:], text)
            return None if rest is None else [str(tokenizer.convert_ids_to_tokens(ids[0])), *rest]
        if list(encoded["special_tokens_mask"][:1]) != [1] or encoded_ids[1 : len(ids) + 1] != ids:
            return None  # ids of another text
        encoded = {key: list(encoded[key])[1:] for key in ("input_ids", "offset_mapping", "special_tokens_mask")}
    labels, done = [], 0  # done: where the text labelled so far ends
    for token, (start, end), special in zip(ids, encoded["offset_mapping"], encoded["special_tokens_mask"]):
        if special and start == end:  # added by the tokenizer, not in the text
            labels.append(str(tokenizer.convert_ids_to_tokens(token)))
        elif end > done:
            labels.append(text[done:end])
            done = end
        else:  # another piece of a character already labelled
            labels.append("")
    return labels


def _decoded_labels(tokenizer: Any, ids: list[int]) -> list[str]:
    """What each token adds to the decoded text; the pieces of one character label its first token."""
    labels: list[str] = []
    done, pending = "", None  # the text decoded so far; the first token of an unfinished character
    for k, token in enumerate(ids):
        decoded = tokenizer.decode(ids[: k + 1], clean_up_tokenization_spaces=False)
        if decoded.endswith("\ufffd") and k + 1 < len(ids):  # a character split over tokens, not yet whole
            pending = k if pending is None else pending
            labels.append("")
            continue
        added = decoded[len(done):] if decoded.startswith(done) else tokenizer.decode([token])
        if pending is not None:
            labels[pending], added = added, ""
            pending = None
        labels.append(added)
        done = decoded
    return labels


def tidy(stats: dict[str, np.ndarray], corpus: Corpus) -> pd.DataFrame:
    n_sentences, n_layers, n_heads = stats["entropy"].shape
    grids = np.meshgrid(np.arange(n_sentences), np.arange(n_layers), np.arange(n_heads), indexing="ij")
    frame = pd.DataFrame({key: g.ravel() for key, g in zip(("sentence", "layer", "head"), grids)})
    for name, column in stats.items():
        frame[name] = column.ravel()
    frame["category"] = [corpus.sentences[i].category for i in frame["sentence"]]
    return frame


def metric_columns(frame: pd.DataFrame) -> list[str]:
    return [name for name in (*METRICS, SPECIAL, *VW_METRICS) if name in frame.columns]


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
    heads: pd.DataFrame, layers: pd.DataFrame, totals: Accumulator, resampled: dict[str, np.ndarray] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """`<name>_ci_low`/`_ci_high` for every score of heads and layers, and the gradient's interval. `resampled`:
    per score, totals.resampled_head_means [resample, layer, head], when the caller has them already."""
    head_columns, layer_columns = {}, {}
    for name in totals.shape.names:
        per_head = resampled[name] if resampled is not None else totals.resampled_head_means(name)  # [r, l, h]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN heads stay NaN
            per_layer = np.nanmean(per_head, axis=2)  # [resample, layer]
        low, high = interval(per_head)
        head_columns[f"{name}_ci_low"], head_columns[f"{name}_ci_high"] = low.ravel(), high.ravel()
        low, high = interval(per_layer)
        layer_columns[f"{name}_ci_low"], layer_columns[f"{name}_ci_high"] = low, high
        if name == "entropy":
            entropy_by_layer = per_layer
    heads = pd.concat([heads, pd.DataFrame(head_columns, index=heads.index)], axis=1)  # one copy, not one per column
    layers = pd.concat([layers, pd.DataFrame(layer_columns, index=layers.index)], axis=1)
    summary = early_late(layers)
    k = third(entropy_by_layer.shape[1])
    early = entropy_by_layer[:, :k].mean(axis=1)  # [resample]
    late = entropy_by_layer[:, -k:].mean(axis=1)  # [resample]
    for key, resampled in (("early_entropy", early), ("late_entropy", late), ("difference", early - late)):
        low, high = interval(resampled)
        summary[f"{key}_ci"] = [float(low), float(high)]
    return heads, layers, summary


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


def few_sentences_note(sentences: int, block_lengths: list[int] | None = None) -> str | None:
    """The warning for a run over fewer than FEW_SENTENCES sentences (its intervals come from the block bootstrap
    over query rows, `block_lengths` rows per block), else None."""
    if sentences >= FEW_SENTENCES:
        return None
    sizes = sorted(set(block_lengths or []))
    blocks = f" (blocks of {sizes[0] if len(sizes) == 1 else f'{sizes[0]}-{sizes[-1]}'} rows)" if sizes else ""
    return (f"only {sentences} sequence{'' if sentences == 1 else 's'}: the 95% intervals come from a block bootstrap "
            f"over the query rows within {'it' if sentences == 1 else 'each'}{blocks}, not over sentences; they show "
            "how the means would vary over another stretch of similar text, assuming rows more than a block apart are "
            "nearly independent, and say nothing about another sample of sentences or documents. Use at least "
            f"{FEW_SENTENCES} sequences for intervals over sentences")


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
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def run_info(
    loaded: LoadedModel, corpus: Corpus, scanned: Scan, batch_size: int, seconds: float
) -> dict[str, Any]:
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
