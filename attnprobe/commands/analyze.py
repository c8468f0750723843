"""`attnprobe analyze`: run the model over the corpus and write the results folder (heads.csv, layers.csv, run.json,
example maps; a checkpoint while it runs)."""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from attnprobe import defaults, limits
from attnprobe.commands.common import (
    check_placement,
    err_console,
    freeze_imports,
    friendly_errors,
    loading,
    out_console,
    release_offload,
    resume_threads,
    say_resumed,
    say_written,
    set_bos,
    stop_requests,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BatchSizeOption,
    BosChoice,
    BosOption,
    CorpusOption,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    LimitOption,
    MaxMemoryOption,
    ModelOption,
    OutOption,
    SplitChoice,
    ThreadsOption,
)
from attnprobe.errors import AttnprobeError
from attnprobe.help_panels import in_panel, panel_command
from attnprobe.naming import counted, sequence_noun, visible


class AttentionChoice(str, Enum):
    auto = "auto"
    triton = "triton"
    fused = "fused"
    blocked = "blocked"
    eager = "eager"


# analyze's --help groups its options under these headings (help_panels.PanelCommand)
INPUT, SCORES, RUN, OUTPUT = "Input", "Scores", "Run control", "Output"
AnalyzeCommand = panel_command(INPUT, SCORES, RUN, OUTPUT)  # cli.py registers analyze with it
AnalyzeModel = in_panel(ModelOption, INPUT)
AnalyzeCorpus = in_panel(CorpusOption, INPUT)
AnalyzeOut = in_panel(OutOption, OUTPUT)
AnalyzeLimit = in_panel(LimitOption, INPUT)
AnalyzeThreads = in_panel(ThreadsOption, RUN)
AnalyzeBos = in_panel(BosOption, INPUT)
AnalyzeDevice = in_panel(DeviceOption, RUN)
AnalyzeBatchSize = in_panel(BatchSizeOption, RUN)
AnalyzeDType = in_panel(DTypeOption, RUN)
AnalyzeDeviceMap = in_panel(DeviceMapOption, RUN)
AnalyzeMaxMemory = in_panel(MaxMemoryOption, RUN)


@friendly_errors
def analyze(
    model: AnalyzeModel,
    corpus: AnalyzeCorpus,
    out: AnalyzeOut = DEFAULT_OUT,
    batch_size: AnalyzeBatchSize = 8,
    device: AnalyzeDevice = DeviceChoice.auto,
    dtype: AnalyzeDType = DTypeChoice.auto,
    resamples: Annotated[
        int, typer.Option("--resamples", help="Bootstrap resamples for the 95% intervals: of the sentences, or below "
                          "10 sequences of blocks of query rows within each.", rich_help_panel=SCORES)
    ] = 1000,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the bootstrap (same seed, same intervals).", rich_help_panel=SCORES)
    ] = 0,
    split: Annotated[
        SplitChoice, typer.Option("--split", help="One sequence per line, per blank-line paragraph, or the whole file.",
                                  rich_help_panel=INPUT)
    ] = SplitChoice.lines,
    attention: Annotated[
        AttentionChoice,
        typer.Option("--attention", help="triton: every statistic inside one Triton attention kernel (CUDA); "
                     "fused: statistics from the fused kernel's logsumexp; blocked: statistics inside attnprobe's "
                     "attention, O(n) memory; eager: hooks on full maps; auto: triton on a CUDA GPU where triton "
                     "imports, else fused from 512 tokens and blocked below (so too the layers triton does not "
                     "cover), where the architecture allows, else eager.",
                     rich_help_panel=RUN),
    ] = AttentionChoice.auto,
    block_mib: Annotated[
        float, typer.Option("--block-mib", help="Memory budget (MiB) for one block of attention rows (blocked).",
                            rich_help_panel=RUN)
    ] = defaults.BLOCK_MIB,
    sink_tokens: Annotated[
        int, typer.Option("--sink-tokens", help="sink_window: the first S keys count as sinks.", rich_help_panel=SCORES)
    ] = defaults.SINK_TOKENS,
    window: Annotated[
        int, typer.Option("--window", help="sink_window: the W most recent keys.", rich_help_panel=SCORES)
    ] = defaults.WINDOW,
    value_weighted: Annotated[
        bool, typer.Option("--value-weighted/--no-value-weighted",
                           help="Also the value-weighted scores (<score>_vw) and output_norm, where the model's output "
                                "projection is found.", rich_help_panel=SCORES)
    ] = True,
    top_tokens: Annotated[
        bool, typer.Option("--top-tokens/--no-top-tokens",
                           help="Also write top_tokens.csv: per head, the key tokens that receive the most attention "
                                "for their frequency (keeps layers x heads x vocabulary sums in memory).",
                           rich_help_panel=SCORES)
    ] = True,
    top_tokens_min: Annotated[
        int, typer.Option("--top-tokens-min", help="top_tokens.csv: only tokens that occur at least this often.",
                          rich_help_panel=SCORES)
    ] = 5,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run whose checkpoint.npz is in --out (same settings).",
                           rich_help_panel=RUN)
    ] = False,
    checkpoint_every: Annotated[
        float,
        typer.Option("--checkpoint-every", help="Seconds between checkpoints of a long run.", rich_help_panel=RUN),
    ] = 300.0,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Start afresh even where --out holds a stopped run's checkpoint "
                           "(it is discarded once this run completes).", rich_help_panel=RUN)
    ] = False,
    per_sentence: Annotated[
        bool, typer.Option("--per-sentence", help="Also write sentences.parquet: every (sentence, layer, head).",
                           rich_help_panel=OUTPUT)
    ] = False,
    head_examples: Annotated[
        bool, typer.Option("--head-examples/--no-head-examples",
                           help="Also write head_examples.npz, each head's page in report.html: per head, the "
                                "sentences (windows of long ones) where entropy, first_token, previous_token, diagonal "
                                "and duplicate_token are highest, lowest and in every decile, with each query's top 3 "
                                "keys. Costs one more forward pass over those sentences (on a corpus of a few hundred, "
                                "nearly all of them).", rich_help_panel=OUTPUT)
    ] = False,
    device_map: AnalyzeDeviceMap = None,
    max_memory: AnalyzeMaxMemory = None,
    limit: AnalyzeLimit = None,
    bos: AnalyzeBos = BosChoice.auto,
    threads: AnalyzeThreads = "auto",
) -> None:
    """Run the model over the corpus; write heads.csv, layers.csv, positions.csv, run.json and example maps."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    from attnprobe import distributed, io, layer_progress
    from attnprobe.analysis import analyze_loaded
    from attnprobe.commands.folder import ResultsFolder
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model, parse_max_memory
    from attnprobe.planning import Options, check_options
    from attnprobe.resume import Checkpointing, Stopped

    freeze_imports()
    folder = ResultsFolder(out, "analyze", {"--corpus": corpus, "--model": model})
    options = Options(attention=attention.value, sink=sink_tokens, window=window, budget_mib=block_mib,
                      value_weighted=value_weighted, top_tokens=top_tokens, top_tokens_min=top_tokens_min)
    check_options(batch_size, resamples, seed, options)
    world = distributed.current()  # under torchrun: this process's rank; rank 0 alone writes and prints
    folder.check()
    sentences = read_corpus(corpus, split=split.value).head(limit)
    if checkpoint_every < 0:
        raise AttnprobeError(f"--checkpoint-every {checkpoint_every} is negative: use 0 or more seconds")
    limits.check_real("--checkpoint-every", checkpoint_every, 0.0, limits.MAX_CHECKPOINT_SECONDS, 300)
    check_placement(device_map, max_memory)
    # under torchrun another rank may be writing already: rank 0 cleans at the end
    folder.take(hold=world.size == 1)
    saved = folder.checkpoint(resume, overwrite, world.rank, world.size)
    checkpointing = Checkpointing(
        save=lambda state: io.write_files(out, {saved: io.npz_writer(**state.to_arrays())}),
        resume_from=io.read_checkpoint(out, saved) if resume else None, every_seconds=checkpoint_every,
    )
    threads_used = resume_threads(threads, checkpointing.resume_from, say=world.is_main)
    if checkpointing.resume_from is not None and world.is_main:
        checkpointing.on_resumed = say_resumed(checkpointing.resume_from.path, "batches")
    with loading(model, world.is_main) as on_status:
        loaded = load_model(model, distributed.device_for(world, device.value), dtype.value,
                            device_map=device_map, max_memory=parse_max_memory(max_memory), on_status=on_status)
    set_bos(loaded, bos.value)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
               TextColumn("ETA"), TimeRemainingColumn())  # advances layer by layer: a single long document moves too
    try:
        with Progress(*columns, console=err_console, transient=True, disable=not world.is_main) as bar, \
                stop_requests() as stop, \
                sentence_writer(out, sentences, per_sentence, world,
                                per_sentence and measures_value_weighted(loaded, options)) as rows:
            if checkpointing is not None:
                checkpointing.should_stop = stop
            task = bar.add_task("sentences", total=None)
            shown = layer_progress.Shown("sentences", log=None if err_console.is_terminal or not world.is_main else
                                         lambda line: err_console.print(line, markup=False, highlight=False))
            result = analyze_loaded(
                loaded, sentences, batch_size=batch_size, resamples=resamples, seed=seed, options=options,
                on_start=lambda total: bar.update(task, total=total),
                progress=lambda done, within=None: shown.advance(bar, task, done, within),
                checkpointing=checkpointing,
                on_batch=rows.write if rows else None, head_examples=head_examples,
            )
            parquet = [rows.commit()] if rows else []
            if rows and world.size > 1:
                distributed.barrier(world)  # every rank's part is in place
                parquet = [io.join_sentence_parts(out, world.size)] if world.is_main else []
    except Stopped as err:
        if world.is_main:
            folder.stopped(err, overwrite)
        raise typer.Exit(130) from None
    finally:
        distributed.leave(world)
        release_offload(loaded)
    if not world.is_main:
        return
    result.run["threads"] = threads_used
    files = {
        io.HEADS_FILE: io.csv_writer(result.heads),
        io.LAYERS_FILE: io.csv_writer(result.layers),
        io.EXAMPLE_FILE: io.npz_writer(
            maps=result.example["maps"], tokens=result.example["tokens"], sentence=result.example["sentence"],
            total_tokens=result.example["total_tokens"],
        ),
    }
    if result.examples:
        files[io.EXAMPLES_FILE] = io.examples_writer(result.examples)
    if result.resamples:
        files[io.RESAMPLES_FILE] = io.npz_writer(compress=False, **result.resamples)
    if result.positions is not None:
        files[io.POSITIONS_FILE] = io.csv_writer(result.positions)
    if result.categories is not None:
        files[io.CATEGORIES_FILE] = io.csv_writer(result.categories)
    if result.top_tokens is not None:
        files[io.TOP_TOKENS_FILE] = io.csv_writer(result.top_tokens)
    if result.head_examples is not None:
        files[io.HEAD_EXAMPLES_FILE] = io.head_examples_writer(result.head_examples)
    # run.json last, with the sha256 of every other file (plot, report, ... refuse one from another run); the earlier
    # run's files that no longer match go
    written, stale = folder.finish(files, result.run, parquet, kept=(io.SENTENCES_FILE,) if per_sentence else ())
    run = result.run
    folder.say_left(stale, run["model"])
    if run["truncated_sentences"]:
        err_console.print(f"Warning: {truncation_message(run)}", markup=False, soft_wrap=True)
    for note in run.get("notes", []):
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    if run["attention"]["requested"] == "auto" and run["attention"]["path"] == "eager":
        why = run["attention"].get("why_eager")
        err_console.print(
            f"Note: {run['model']['architecture']} ran on the eager path (full maps, memory grows with n^2)"
            f"{f': the statistics attention does not implement {why}' if why else ''}; "
            "see `attnprobe analyze --help` for --attention.", markup=False, soft_wrap=True,
        )
    out_console.print(summary_table(run))
    say_written(written)


def truncation_message(run: dict) -> str:
    """Which sentences were cut to the model's context, and by how many tokens (the first few named)."""
    from attnprobe.analysis import truncation_message as message

    return message(run)


def measures_value_weighted(loaded, options) -> bool:
    """Whether this run measures the value-weighted scores (the model's output projection is found)."""
    from attnprobe.planning import attention_path, value_weighted_plan

    return value_weighted_plan(loaded, attention_path(loaded, options.attention), options)[0] is not None


@contextmanager
def sentence_writer(out: Path, corpus, wanted: bool, world=None, weighted: bool = False):
    """io.SentenceWriter for --per-sentence (None otherwise); removed again if the run fails. `weighted`: the run
    measures the value-weighted scores too."""
    if not wanted:
        yield None
        return
    from attnprobe import io
    from attnprobe.planning import score_names

    names = score_names(True, weighted)  # special_tokens is NaN where the tokenizer adds none
    part = world.rank if world is not None and world.size > 1 else None  # one part per rank, joined by rank 0
    with io.SentenceWriter(out, names, corpus.tagged, part=part) as writer:
        yield writer


def summary_table(run: dict) -> Table:
    from attnprobe.bootstrap import interval_basis, over_sentences

    s, n = run["summary"], run["sentences"]
    unit = sequence_noun((run.get("corpus") or {}).get("split", run.get("split")))
    table = Table(
        title=Text(visible(f"{run['model']['spec']}: {run['model']['layers']} layers x {run['model']['heads']} heads, "
                           f"{counted(n, unit)}, {run['tokens']} tokens"))
    )
    table.add_column("layers")
    table.add_column("mean entropy (nats)", justify="right")
    table.add_column("95% interval", justify="right")

    def ci(key: str, sign: str = "") -> str:
        low, high = s.get(f"{key}_ci", (float("nan"), float("nan")))
        return f"[{low:{sign}.3f}, {high:{sign}.3f}]"

    early, late = s["early_layers"], s["late_layers"]
    table.add_row(f"early {early[0]}-{early[1]}", f"{s['early_entropy']:.3f}", ci("early_entropy"))
    table.add_row(f"late {late[0]}-{late[1]}", f"{s['late_entropy']:.3f}", ci("late_entropy"))
    table.add_row("early - late", f"{s['difference']:+.3f}", ci("difference", "+"))
    table.caption = f"intervals: {interval_basis(run)}, {run['bootstrap']['resamples']} resamples"
    if not over_sentences(run):
        table.caption += "; not intervals over sentences (see the warning)"
    return table
