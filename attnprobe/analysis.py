"""Corpus -> per-head statistics: the run. `analyze` plans it (planning), counts the corpus (batching.scan),
streams every batch's maps through the statistics (`measure`, `measure_batch`), and hands the sums to the tables
(tables) and the record (records)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnprobe import batching, distributed, headpages, kernel, layer_progress, planning, values
from attnprobe import tokens as token_classes
from attnprobe.accumulate import Accumulator, Shape, pending_after, resamples_within_budget
from attnprobe.batching import Scan, Tokens, pad_batch
from attnprobe.bootstrap import BLOCK, DEFAULT_RESAMPLES, BlockResampler, bootstrap_method
from attnprobe.corpus import Corpus, Sentence, as_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import (
    SPECIAL,
    SentenceSums,
    TokenClasses,
    bin_count,
    block_row_stats,
    received,
    uniform_received,
    value_weighted,
)
from attnprobe.model import LoadedModel, as_loaded, stream_attention
from attnprobe.planning import Options, Plan, check_options
from attnprobe.records import bootstrap_record, model_weights, run_fingerprint, run_info
from attnprobe.resume import (
    Checkpointing,
    Expected,
    State,
    Stopped,
    check_example_maps,
    check_fingerprint,
    check_other_maps,
    check_others_done,
)
from attnprobe.scores import OUTPUT_NORM
from attnprobe.tables import add_intervals, few_sentences_note, summarize_layers, tidy
from attnprobe.tokens import token_labels

UNTAGGED = "untagged"  # the category of sentences above the first `# category:` line of a tagged corpus
EXAMPLE_MAX_TOKENS = 40  # only the example's first 40 tokens are kept, so plots stay readable

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
    examples: list[dict[str, Any]] = field(default_factory=list)  # up to batching.EXAMPLES sentences' maps (report)
    top_tokens: pd.DataFrame | None = None  # per head, the key tokens with the highest lift (top_tokens.csv)
    head_examples: dict[str, np.ndarray] | None = None  # each head's examples and top keys (head_examples.npz)


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
    head_examples: bool = False,
) -> Analysis:
    """Measure every head of `model` over every sentence (or paragraph, or file: `split`) of `corpus`.

    `model`: a name or path as for `--model` (loaded on `device` in `dtype`), a LoadedModel from
    `load_model`, or a (transformers model, tokenizer) pair. `corpus`: a corpus file (str or Path), a
    list of sentences (str), or a Corpus. `limit`: only the first `limit` sequences (as `--limit`).
    `head_examples`: also each head's examples with their top keys (`Analysis.head_examples`, as `--head-examples`).
    """
    check_options(batch_size, resamples, seed, options)
    text = as_corpus(corpus, split=split).head(limit)
    loaded = as_loaded(model, distributed.device_for(distributed.current(), device), dtype)
    result = analyze_loaded(
        loaded, text, batch_size=batch_size, resamples=resamples, seed=seed, progress=progress, on_start=on_start,
        options=options, keep_per_sentence=keep_per_sentence, head_examples=head_examples,
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
    head_examples: bool = False,
) -> Analysis:
    """Measure every head of a loaded model over a corpus.

    Statistics are folded into sums batch by batch, so memory does not grow with the corpus;
    `keep_per_sentence` also returns every sentence's values as `Analysis.per_sentence` (it does grow).
    `head_examples`: also each head's highest, lowest and decile examples with their top keys
    (`Analysis.head_examples`, headpages), the model run again over those sequences (not under torchrun, nor when
    resuming: a note says so).
    """
    options = options or Options()
    check_options(batch_size, resamples, seed, options)
    started = time.perf_counter()
    scanned = batching.scan(loaded, corpus, keep_first_window=True,
                            should_stop=checkpointing.should_stop if checkpointing is not None else None)
    if on_start:
        on_start(scanned.sentences)
    world = distributed.current()
    distributed.join(world, loaded.device)
    plan = planning.plan(loaded, options)
    names = plan.names(scanned.special)
    shape = Shape(
        names=names,
        bin_names=plan.bin_names,
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
    resumed = checkpointing is not None and checkpointing.resume_from is not None
    selection = headpages.Selection(shape.names, shape.layers, shape.heads, seed) \
        if head_examples and world.size == 1 and not resumed else None
    measured = measure(loaded, corpus, scanned, batch_size, progress, plan, world, shape,
                       keep_per_sentence, checkpointing, fingerprint, on_batch, selection)
    totals = measured.totals
    heads = totals.heads()
    layers = summarize_layers(heads)
    per_head = {name: totals.resampled_head_means(name) for name in totals.shape.names}  # [resample, layer, head]
    heads, layers, summary = add_intervals(heads, layers, totals, per_head)
    run = run_info(loaded, corpus, scanned, batch_size, time.perf_counter() - started)
    run["distributed"] = {"world_size": world.size, "sentences_per_rank": world.counts(scanned.sentences)}
    # what identifies the weights measured: `related` loads the model again and must find these weights
    run["model"]["weights"] = fingerprint["model_sha256"] if checkpointing is not None else model_weights(loaded)
    run["attention"] = plan.record(loaded.device, measured.sequences, scanned.sentences,
                                   getattr(torch, loaded.dtype, torch.float32))
    run["value_weighted"] = plan.weighted
    run["summary"] = summary
    run["bootstrap"] = bootstrap_record(shape, scanned.lengths, resamples)
    run["example_sentence"] = {"index": scanned.example_index, "line": scanned.example.line}
    run["notes"] = [note for note in (few_sentences_note(scanned.sentences, run["bootstrap"].get("block_lengths")),
                                      plan.weighted.get("note"), run["bootstrap"].get("note"),
                                      head_examples_note(head_examples, world, resumed)) if note]
    example = {
        "sentence": scanned.example.text,
        "tokens": token_labels(loaded, scanned.example_ids[:EXAMPLE_MAX_TOKENS], scanned.example.text),
        "maps": measured.example_maps,
        "total_tokens": len(scanned.example_ids),
    }
    per_sentence = tidy(measured.per_sentence, corpus) if measured.per_sentence is not None else None
    positions = totals.positions(scanned.longest)
    resampled = {name: values_.astype(np.float32) for name, values_ in per_head.items()}
    examples = [{**example, "index": scanned.example_index, "line": scanned.example.line,
                 "category": scanned.example.category}]
    if world.is_main:
        examples += more_examples(loaded, plan, scanned, shape, measured.other_maps)
    top = None
    if shape.vocab:
        top = token_classes.top_tokens(totals.sums["tokmass"], totals.sums["tokuniform"], totals.sums["tokcount"],
                                       token_classes.readable(loaded.tokenizer), min_occurrences=options.top_tokens_min)
        run["top_tokens"] = {"per_head": token_classes.TOP_TOKENS, "min_occurrences": options.top_tokens_min}
    pages = headpages.head_examples(loaded, corpus, selection, batch_size) if selection is not None else None
    return Analysis(heads, layers, per_sentence, run, example, totals.categories(), positions, resampled, examples,
                    top, pages)


def head_examples_note(wanted: bool, world: distributed.World, resumed: bool) -> str | None:
    """Why a run that asked for head_examples.npz writes none, or None."""
    if wanted and (world.size > 1 or resumed):
        why = "under torchrun" if world.size > 1 else "when a run is resumed from its checkpoint"
        return f"no head_examples.npz {why}: run analyze again in one process, from the start, for the head pages"
    return None


def more_examples(
    loaded: LoadedModel, plan: Plan, scanned: Scan, shape: Shape, captured: dict[int, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """The maps of the other example sentences (`Scan.others`).

    Most were captured during the corpus pass (`captured`, by corpus index); one that was not (its batch's
    slot was taken, it was measured before a resume, or by another rank) runs alone now. A causal model
    runs only the first EXAMPLE_MAX_TOKENS tokens: later tokens cannot change the maps of earlier ones.
    """
    captured = captured or {}
    found = []
    alone = plan.maps_only()  # only the maps are kept: no value-weighted scores
    with planning.attention_context(loaded, alone):
        for index, sentence, ids in scanned.others:
            n = min(len(ids), EXAMPLE_MAX_TOKENS)
            maps = captured.get(index)
            if maps is None:
                run_ids = ids[:n] if loaded.causal else ids
                buffer = torch.full((shape.layers, shape.heads, n, n), torch.nan, device=loaded.device)  # [l, h, q, k]
                input_ids, mask = pad_batch([run_ids], loaded.device)  # [1, seq] each
                special = torch.zeros_like(mask, dtype=torch.bool) if SPECIAL in shape.names else None  # [1, seq]
                measure_batch(loaded, alone, input_ids, mask, special, shape, [(0, n, buffer)])
                maps = buffer.cpu().numpy()
            found.append({"maps": maps, "tokens": token_labels(loaded, ids[:n], sentence.text),
                          "sentence": sentence.text, "total_tokens": len(ids), "index": index, "line": sentence.line,
                          "category": sentence.category})
    return found


def sentence_categories(corpus: Corpus, sentences: list[Sentence]) -> list[str] | None:
    """These sentences' categories (`untagged` above the first tag), or None for an untagged corpus."""
    return [s.category or UNTAGGED for s in sentences] if corpus.tagged else None


@dataclass
class Measured:
    totals: Accumulator  # every statistic, summed over the sentences (all ranks merged)
    example_maps: np.ndarray  # [layer, head, query, key], the example's first tokens
    per_sentence: dict[str, np.ndarray] | None = None  # per score [sentence, layer, head], when kept
    other_maps: dict[int, np.ndarray] = field(default_factory=dict)  # corpus index -> maps of `Scan.others`
    sequences: dict[str, int] = field(default_factory=dict)  # path -> sequences it measured (all ranks), by this run


def measure(
    loaded: LoadedModel, corpus: Corpus, scanned: Scan, batch_size: int, progress: Progress | None,
    plan: Plan, world: distributed.World, shape: Shape, keep_per_sentence: bool = False,
    checkpointing: Checkpointing | None = None, fingerprint: dict[str, Any] | None = None,
    on_batch: OnBatch | None = None, selection: headpages.Selection | None = None,
) -> Measured:
    """Run every batch of this rank's sentences and fold its statistics into an Accumulator.

    The corpus streams past in windows of WINDOW_SENTENCES: each is tokenized, sorted by length and
    batched, and dropped when done. Under torchrun each rank measures its shard, and the sums are merged.
    `plan` (planning.plan): the path every batch runs, and the output projections of the value-weighted scores.
    `selection`: offered every batch's sentences (and windows of the longer ones, from their rows) for the head pages.
    """
    totals = Accumulator(shape)
    kept = {name: np.full((scanned.sentences, shape.layers, shape.heads), np.nan) for name in shape.names} \
        if keep_per_sentence else None  # [sentence, layer, head]
    n = min(len(scanned.example_ids), EXAMPLE_MAX_TOKENS)
    example_maps = torch.full((shape.layers, shape.heads, n, n), torch.nan, device=loaded.device)  # [l, h, q, k]
    total = batching.batch_count(scanned.sentences, batch_size, world)
    # the other examples' maps are taken from their batches as they pass (rank 0's only: it writes them)
    others = {index: min(len(ids), EXAMPLE_MAX_TOKENS) for index, _, ids in scanned.others} if world.is_main else {}
    other_maps: dict[int, torch.Tensor] = {}  # corpus index -> [layer, head, query, key]
    slots = batch_size if plan.path == "eager" else 1  # the statistics attention (fused or blocked) hands back one map
    start = 0
    state = checkpointing.resume_from if checkpointing is not None else None
    if state is not None:
        state.check_fits(totals.state(), resume_expected(state, scanned, batch_size, world, total, shape))
        start = state.batches_done
        totals.restore(state.sums, state.token_rows)  # the top-token rows met only: they stay sparse
        if state.example_maps is not None and state.example_maps.shape == tuple(example_maps.shape):
            example_maps = torch.from_numpy(state.example_maps).to(loaded.device)
        check_resumed_others(loaded, state, scanned, shape, others)
        other_maps = {index: torch.from_numpy(maps).to(loaded.device) for index, maps in state.other_maps.items()}
    example_done = False  # whether the example's batch is among those the checkpoint holds
    others_done: set[int] = set()  # the other examples whose batches the checkpoint holds

    def reached_start() -> None:
        """At the last batch the checkpoint holds: its example maps must be there exactly when that batch was."""
        if state is not None and number == start:
            check_resumed_example(loaded, state, example_done, scanned, tuple(example_maps.shape))
            check_others_done(state, others_done)
            if checkpointing.on_resumed is not None:
                checkpointing.on_resumed(start, total)

    def save(done: int) -> None:
        maps = example_maps.cpu().numpy()
        checkpointing.save(State(fingerprint or {}, done, totals.state(), None if np.isnan(maps).all() else maps,
                                 threads=torch.get_num_threads(),
                                 other_maps={index: m.cpu().numpy() for index, m in other_maps.items()}))
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
        lengths = [len(t) for t in ids]
        windows = WindowValues(selection, lengths, shape) if selection is not None else None
        with layer_progress.watching(loaded.model, input_ids.shape[1], within, rows=len(batch)):  # layer by layer
            stats, bins = measure_batch(loaded, plan, input_ids, mask, special, shape, wanted,
                                        on_layer=(lambda: progress(share)) if progress else None,
                                        resamplers=resamplers, tokens=classes,
                                        received_by=taken if shape.vocab else None, paths=paths,
                                        on_resampled=lambda layer, means: totals.add_resampled(layer, means, labels),
                                        on_rows=windows.add if windows is not None and windows.wanted else None)
        if shape.vocab:
            real = mask.bool()  # [batch, seq]
            totals.add_tokens(input_ids[real], taken["mass"][:, :, real], taken["uniform"][:, real])
        check_finite(loaded, stats, sentences, lengths)
        check_values_finite(loaded, stats, sentences, lengths)
        totals.add(batch, stats, bins, lengths, labels)
        if windows is not None:
            windows.offer(batch, stats)
        if on_batch is not None:
            on_batch(batch, stats, sentences)
        if kept is not None:
            for name, value in stats.items():
                kept[name][batch] = value

    paths: dict[str, int] = {}  # path -> sequences this process ran through it (measure_batch counts them)
    within = layer_progress.reporter(progress, 0.0)  # progress(0.0, within=...) where it takes a `within` keyword
    number = 0  # batches begun, over the whole run
    with planning.attention_context(loaded, plan):
        for first, window in batching.windows(corpus.stream(), batching.WINDOW_SENTENCES):
            mine = [i - first for i in world.shard(first + len(window), first)]  # positions in the window
            count = -(-len(mine) // batch_size)
            if number + count <= start:  # done before the checkpoint: skip without tokenizing
                number += count
                example_done |= first <= scanned.example_index < first + len(window) \
                    and scanned.example_index % world.size == world.rank
                others_done.update(index for index in others if first <= index < first + len(window)
                                   and index % world.size == world.rank)
                reached_start()
                if progress:
                    progress(len(mine) * world.size)
                continue
            cached, scanned.first_window = scanned.first_window, None  # the scan's ids of window 0, if it kept them
            if first == 0 and cached is not None and len(cached.ids) == len(window):
                tokens = cached.take(mine)
            else:
                tokens = batching.tokenize_sentences(loaded, [window[k] for k in mine])
            del cached
            for local in batching.length_batches(tokens.ids, batch_size):
                number += 1
                batch = [first + mine[k] for k in local]
                if number > start:
                    run(batch, [window[mine[k]] for k in local], tokens.take(local))
                else:  # done before the checkpoint
                    example_done |= scanned.example_index in batch
                    others_done.update(index for index in batch if index in others)
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
                                                 for name in planning.PATHS}, loaded.device)
        example_maps = distributed.merge(world, {"maps": example_maps})["maps"]
    except RuntimeError as err:  # another rank stopped or died before the merge
        if checkpointing is None or world.size == 1:
            raise
        raise Stopped(f"another process stopped before the results were merged; this one finished its {number} "
                      "batches and its checkpoint keeps them") from err
    if kept is not None:
        kept = {name: v.cpu().numpy() for name, v in distributed.merge(
            world, {name: torch.from_numpy(v).to(loaded.device) for name, v in kept.items()}).items()}
    return Measured(totals=totals, example_maps=example_maps.cpu().numpy(), per_sentence=kept,
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
    loaded: LoadedModel, plan: Plan, input_ids: torch.Tensor, mask: torch.Tensor, special: torch.Tensor | None,
    shape: Shape, examples: list[tuple[int, int, torch.Tensor]] = (), on_layer: Callable[[], None] | None = None,
    resamplers: list[BlockResampler] | None = None,
    on_resampled: Callable[[int, dict[str, np.ndarray]], None] | None = None,
    tokens: TokenClasses | None = None, received_by: dict[str, torch.Tensor] | None = None,
    paths: dict[str, int] | None = None, on_rows: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-sentence statistics [sentence, layer, head] and position bins [sentence, layer, head, bin] of one batch.

    `examples`: (row in the batch, tokens kept, maps [layer, head, query, key]) of sentences whose maps to write;
    the blocked path writes the first one only. `on_layer` is called as each layer's statistics arrive.
    `plan`: the path, the options, and each layer's output projection for the value-weighted scores (the eager
    path reads the values that values.capturing_values keeps, so it runs inside planning.attention_context).
    `resamplers`: one per sentence, for the block bootstrap: each layer's rows are resampled as they arrive and
    `on_resampled(layer, per score [resample, sentence, head])` gets the means; the rows are then dropped.
    `tokens`: the batch's ids and punctuation flags (punctuation, duplicate); `received_by`, when given, gets
    "mass" [layer, head, batch, seq], the mass each key position received, and "uniform" [layer, batch, seq], what
    uniform rows would have given it. `paths`, when given, counts the batch's sentences under the path that ran
    them ("fused", "blocked" or "eager"). `on_rows(layer, per score [sentence, head, query])`, when given, gets
    every row's values of each layer (headpages' windows of long sequences).
    """
    options, projections = plan.options, plan.projections
    b, sink, window = input_ids.shape[0], options.sink, options.window
    k = min(shape.bins, bin_count(input_ids.shape[1]))
    stats = torch.full((len(shape.names), b, shape.layers, shape.heads), torch.nan,
                       device=loaded.device)  # [score, batch, layer, head]
    bins = torch.full((len(shape.bin_names), b, shape.layers, shape.heads, k), torch.nan,
                      device=loaded.device)  # [binned score, batch, layer, head, bin]

    spans = plan.spans  # each layer's attention window, None: every key
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
        if on_rows is not None and sums.rows is not None:
            on_rows(layer, sums.rows)
        if on_layer is not None:
            on_layer()

    if plan.path != "eager":
        def on_sums(layer: int, sums: SentenceSums, maps: torch.Tensor | None) -> None:
            store(layer, sums)
            if maps is not None:
                examples[0][2][layer] = maps  # [head, query, key]

        ran = kernel.run_batch(loaded, input_ids, mask, on_sums, special=special, sink=sink, window=window, bins=k,
                         budget_mib=options.budget_mib, block_rows=options.block_rows,
                         example=examples[0][:2] if examples else None, fused=plan.fused,
                         projections=projections, keep_rows=bool(resamplers) or on_rows is not None, tokens=tokens,
                         triton=plan.triton, triton_fallback=plan.options.attention == "auto")
    else:
        modules = plan.modules

        def on_map(layer: int, p: torch.Tensor) -> None:
            weighted = None if projections is None else (values.take_values(modules[layer]), projections[layer])
            store(layer, map_sums(p, lengths, loaded.causal, special, sink, window, k, spans[layer], weighted, tokens,
                                  keep_rows=bool(resamplers) or on_rows is not None))
            for row, q, maps in examples:
                maps[layer] = p[row, :, :q, :q].float()  # [head, query, key]

        stream_attention(loaded, input_ids, mask, on_map)
        ran = "eager"
    if paths is not None:
        paths[ran] = paths.get(ran, 0) + b
    return _to_numpy(shape.names, stats), _to_numpy(shape.bin_names, bins)


class WindowValues:
    """The head pages' units of one batch: a sentence of up to headpages.SEGMENT_TOKENS tokens is one unit (its
    per-sentence values); a longer one is one unit per window of that many query rows, whose values `add` takes from
    each layer's rows as they arrive (O(windows) kept, never the rows)."""

    def __init__(self, selection: headpages.Selection, lengths: list[int], shape: Shape) -> None:
        self.selection, self.lengths, self.shape = selection, lengths, shape
        self.long = [k for k, n in enumerate(lengths) if n > headpages.SEGMENT_TOKENS]
        self.wanted = bool(self.long and selection.names)
        self.values = {k: {name: np.full((-(-lengths[k] // headpages.SEGMENT_TOKENS), shape.layers, shape.heads),
                                         np.nan) for name in selection.names} for k in self.long}  # [window, l, h]

    def add(self, layer: int, rows: dict[str, torch.Tensor]) -> None:
        """One layer's rows, per score [sentence, head, query]: the long sentences' window means."""
        for k in self.long:
            for name in self.selection.names:
                if name in rows:
                    means = headpages.window_means(rows[name][k], self.lengths[k])  # [window, head]
                    self.values[k][name][:, layer] = means.cpu().numpy()

    def offer(self, batch: list[int], stats: dict[str, np.ndarray]) -> None:
        """The batch's units and their values (`stats` per score [sentence, layer, head]) to the selection."""
        short = [k for k in range(len(batch)) if k not in self.values]
        names = self.selection.names
        self.selection.offer(np.array([headpages.unit_id(batch[k]) for k in short], dtype=np.int64),
                             {name: stats[name][short] for name in names})
        for k, windows in self.values.items():
            count = windows[names[0]].shape[0] if names else 0
            self.selection.offer(np.array([headpages.unit_id(batch[k], w) for w in range(count)], dtype=np.int64),
                                 windows)


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


def resume_expected(state: State, scanned: Scan, batch_size: int, world: distributed.World, total: int,
                    shape: Shape) -> Expected:
    """What the run's own batches say a checkpoint of `state.batches_done` batches holds (resume.Expected)."""
    sizes, reached = batching.batch_sizes(scanned.sentences, batch_size, world, state.batches_done)
    return Expected(batches=total, sentences=sum(sizes), pending=pending_after(sizes, shape.method),
                    corpus=scanned.sentences, reached=reached, rank=world.rank, size=world.size)


def map_eps(loaded: LoadedModel) -> float:
    """The rounding a checkpoint's maps are checked within (resume.check_maps): the model dtype's epsilon."""
    dtype = getattr(torch, str(loaded.dtype), torch.float32)
    return torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps


def whole_rows(loaded: LoadedModel, kept: int, tokens: int) -> bool:
    """Whether every row of the maps of a sentence of `tokens` tokens, `kept` of them, sums to 1: not where an
    encoder's later keys were cut, nor where the model has sink logits."""
    sinks = any(f.sinks for f in kernel.discover(loaded).features)
    return (loaded.causal or tokens <= kept) and not sinks


def check_resumed_others(loaded: LoadedModel, state: State, scanned: Scan, shape: Shape,
                         others: dict[int, int]) -> None:
    """The checkpoint's maps of the other examples (`others`: corpus index -> tokens kept, rank 0's): the shape this
    run gives each, and attention maps (as check_resumed_example's)."""
    whole = {index: whole_rows(loaded, others[index], len(ids)) for index, _, ids in scanned.others if index in others}
    check_other_maps(state, {index: (shape.layers, shape.heads, m, m) for index, m in others.items()}, map_eps(loaded),
                     whole)


def check_resumed_example(loaded: LoadedModel, state: State, done: bool, scanned: Scan, shape: tuple[int, ...]) -> None:
    """The checkpoint's example maps, once the run knows whether the example's batch was among those done: every
    row sums to 1 unless the sentence's later keys were cut (an encoder) or the model has sink logits."""
    check_example_maps(state, done, shape, map_eps(loaded), whole_rows(loaded, shape[-1], len(scanned.example_ids)))
