"""The `attnprobe` command line: a thin layer over the library. Heavy imports stay inside commands."""

from __future__ import annotations

import functools
import gc
import itertools
import os
import re
import sys
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnprobe import __version__, defaults, limits
from attnprobe.allocator import reuse_freed_memory
from attnprobe.errors import AttnprobeError
from attnprobe.help_panels import in_panel, panel_command
from attnprobe.naming import counted, head_name, sequence_noun, visible
from attnprobe.threads import apply as apply_threads
from attnprobe.threads import limit_numpy_threads
from attnprobe.threads import parse as parse_threads

app = typer.Typer(
    help="Measure what the attention heads of a transformer do: entropy, locality, head types, plots.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
)
PIPE_WIDTH = 120  # columns of stdout's tables when it is a pipe or a file and COLUMNS does not say


def stdout_width() -> int | None:
    """The width of stdout's tables: the terminal's (None: Rich measures it) when stdout is one; else COLUMNS when
    set, or PIPE_WIDTH. Rich would otherwise take the size of whichever of stdin, stdout, stderr is a terminal, so
    `attnprobe analyze ... | tee log` from a narrow terminal (or an editor's 50-column pane) wrapped every table
    row in the log."""
    try:
        if sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):  # no stdout (pythonw), or a closed one
        pass
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH


out_console = Console(width=stdout_width())
err_console = Console(stderr=True)



def folder(text: str | Path) -> Path:
    """A folder option's value: an empty one would mean the current folder (and write results there), so it is
    refused."""
    if not str(text).strip():
        raise typer.BadParameter("is empty: name a folder, e.g. --out outputs")
    return Path(text)


OutOption = Annotated[
    Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder (created if missing).")
]
ModelOption = Annotated[str, typer.Option("--model", "-m", help="Hub id, folder, .gguf file or a short name.")]
CorpusOption = Annotated[
    Path, typer.Option("--corpus", "-c", help="UTF-8 text, one sentence per line ('#' lines skipped; a '# category: "
                       "NAME' line tags the lines below it), or a .jsonl / .parquet file: one row per sequence, a "
                       "'text' field and an optional 'category'.")
]


def thread_count(text: str) -> str:
    """A --threads value: `auto` or a whole number, 1 or more (anything else is a usage error)."""
    try:
        return str(parse_threads(text))
    except AttnprobeError as err:
        raise typer.BadParameter(str(err).removeprefix("--threads ")) from None


ThreadsOption = Annotated[
    str, typer.Option("--threads", parser=thread_count, metavar="N|auto",
                      help="CPU threads for torch; auto: one per core, less the cores other work keeps busy.")
]
ResultsOption = Annotated[
    Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder written by `attnprobe analyze`.")
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", metavar="N", help="Use only the corpus's first N sequences (a quick look "
                             "at a large corpus); recorded in the results.")
]
class BosChoice(str, Enum):
    auto = "auto"
    always = "always"
    never = "never"


BOS_HELP = ("BOS token: auto does what the tokenizer does; always puts one first where the tokenizer adds none "
            "(as TransformerLens does by default); never removes the one the tokenizer adds.")
BosOption = Annotated[BosChoice, typer.Option("--bos", help=BOS_HELP)]
DEFAULT_OUT = Path("outputs")
DEFAULT_PROBE_OUT = DEFAULT_OUT / "probe"  # its own folder: a probe's files never mix with an analysis's
POSITION_FIGURE = "position_profile.png"


class DTypeChoice(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DTYPE_NAMES = tuple(choice.value for choice in DTypeChoice)
DTYPE_HELP = "Model precision; auto: the checkpoint's own (bfloat16 stays bfloat16); statistics are kept in float32."
DTypeOption = Annotated[DTypeChoice, typer.Option("--dtype", help=DTYPE_HELP)]
DeviceMapOption = Annotated[
    str | None, typer.Option("--device-map", help="'auto': spread a large model over GPUs, CPU and disk.")
]
MaxMemoryOption = Annotated[
    str | None, typer.Option("--max-memory", help="With --device-map: limits per device, e.g. 0=20GiB,cpu=60GiB.")
]


class SplitChoice(str, Enum):
    lines = "lines"
    paragraphs = "paragraphs"
    file = "file"


class AttentionChoice(str, Enum):
    auto = "auto"
    fused = "fused"
    blocked = "blocked"
    eager = "eager"


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


def friendly_errors(command):
    """Turn the library's errors into one line on stderr and exit code 1 (printed by torchrun's rank 0 alone); and
    hand what the command froze (`freeze_imports`) back to the garbage collector when it ends."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        ours = gc.get_freeze_count() == 0  # what is frozen from now on was frozen by the command
        try:
            return command(*args, **kwargs)
        except AttnprobeError as err:
            if is_main_process():
                err_console.print(f"Error: {err}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        finally:
            while AT_END:  # what the command holds until it ends (hold_out's lock)
                AT_END.pop()()
            if ours:  # a caller's process (a notebook, the tests) lives on: its garbage is collected again
                gc.unfreeze()

    return wrapper


AT_END: list = []  # callables friendly_errors runs (last first) when the command ends, however it ends


def freeze_imports() -> None:
    """Leave the objects alive now (the modules a command has just imported: torch's, numpy's, pandas', millions of
    objects) out of the garbage collector's full collections until the command ends: each full collection while
    transformers and the model load would walk them all again. Not where the caller froze objects itself."""
    if gc.get_freeze_count() == 0:
        gc.freeze()


def is_main_process() -> bool:
    """Not a torchrun rank other than 0: every rank checks the same inputs, so rank 0 alone says what is wrong
    (read from the environment: no torch import)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


@contextmanager
def loading(model: str, enabled: bool = True):
    """The `Loading MODEL` spinner; yields the `on_status` for load_model, whose messages (a first-time GGUF
    conversion's steps) are printed on stderr as they come and shown beside the spinner."""
    if not enabled:
        yield None
        return
    with err_console.status(f"Loading {model}") as status:
        def on_status(message: str) -> None:
            err_console.print(message, markup=False, highlight=False, soft_wrap=True)
            status.update(f"Loading {model}: {message}")

        yield on_status


def version_callback(value: bool) -> None:
    if value:
        print(f"attnprobe {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """attnprobe: per-head attention entropy, diagonal score and head types, layer by layer."""


# analyze's --help groups its options under these headings (help_panels.PanelCommand)
INPUT, SCORES, RUN, OUTPUT = "Input", "Scores", "Run control", "Output"
AnalyzeModel = in_panel(ModelOption, INPUT)
AnalyzeCorpus = in_panel(CorpusOption, INPUT)
AnalyzeOut = in_panel(OutOption, OUTPUT)
AnalyzeLimit = in_panel(LimitOption, INPUT)
AnalyzeThreads = in_panel(ThreadsOption, RUN)
AnalyzeBos = in_panel(BosOption, INPUT)


@app.command(cls=panel_command(INPUT, SCORES, RUN, OUTPUT))
@friendly_errors
def analyze(
    model: AnalyzeModel,
    corpus: AnalyzeCorpus,
    out: AnalyzeOut = DEFAULT_OUT,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", help="Sentences per forward pass.", rich_help_panel=RUN)
    ] = 8,
    device: Annotated[
        DeviceChoice, typer.Option("--device", help="Where to run the model.", rich_help_panel=RUN)
    ] = DeviceChoice.auto,
    dtype: Annotated[
        DTypeChoice,
        typer.Option("--dtype", help=DTYPE_HELP, rich_help_panel=RUN),
    ] = DTypeChoice.auto,
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
        typer.Option("--attention", help="fused: statistics from the fused kernel's logsumexp; blocked: "
                     "statistics inside attnprobe's attention, O(n) memory; eager: hooks on full maps; auto: fused "
                     "from 512 tokens and blocked below, where the architecture allows, else eager.",
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
    device_map: Annotated[
        str | None, typer.Option("--device-map", help="'auto': spread a large model over GPUs, CPU and disk.",
                                 rich_help_panel=RUN)
    ] = None,
    max_memory: Annotated[
        str | None, typer.Option("--max-memory", help="With --device-map: limits per device, e.g. 0=20GiB,cpu=60GiB.",
                                 rich_help_panel=RUN)
    ] = None,
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
    from attnprobe.analysis import Options, analyze_loaded, check_options
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model, parse_max_memory
    from attnprobe.resume import Checkpointing, Stopped

    freeze_imports()
    started = time.time()
    options = Options(attention=attention.value, sink=sink_tokens, window=window, budget_mib=block_mib,
                      value_weighted=value_weighted, top_tokens=top_tokens, top_tokens_min=top_tokens_min)
    check_options(batch_size, resamples, seed, options)
    world = distributed.current()  # under torchrun: this process's rank; rank 0 alone writes and prints
    io.check_out_dir(out)
    sentences = read_corpus(corpus, split=split.value).head(limit)
    if checkpoint_every < 0:
        raise AttnprobeError(f"--checkpoint-every {checkpoint_every} is negative: use 0 or more seconds")
    limits.check_real("--checkpoint-every", checkpoint_every, 0.0, limits.MAX_CHECKPOINT_SECONDS, 300)
    check_placement(device_map, max_memory)
    io.check_inputs_apart(out, {"--corpus": corpus, "--model": model})
    if world.size == 1:  # under torchrun another rank may be writing already: rank 0 cleans at the end
        hold_out(out)  # a second run into this folder is refused
        # what a killed run left (a half-written checkpoint, rows), never the run's inputs
        io.remove_stale_temps(out, started, keep=(corpus, model))
    io.check_checkpoint_slots(out)  # a folder named checkpoint.npz: refused now, not at the first save
    # under torchrun every rank saves its own; under --overwrite under another name, so that the stopped run's
    # checkpoint stays until this run completes (and --resume continues the replacing run where it left one)
    saved = io.resumed_name(out, world.rank, world.size) if resume else \
        io.checkpoint_name(world.rank, world.size, replacing=overwrite)
    waiting = io.checkpoint_files(out)  # of this process count or any other
    if waiting and not resume and not overwrite:
        raise AttnprobeError(f"{Path(out) / waiting[0]} holds a stopped run: add --resume to continue it (with as "
                             "many processes as it had), or --overwrite to discard it and start again")
    if resume and overwrite:
        raise AttnprobeError("--resume and --overwrite contradict each other: --resume continues the stopped run, "
                             "--overwrite discards it; pass one")
    checkpointing = Checkpointing(
        save=lambda state: io.write_files(out, {saved: io.npz_writer(**state.to_arrays())}),
        resume_from=io.read_checkpoint(out, saved) if resume else None, every_seconds=checkpoint_every,
    )
    threads_used = apply_threads(threads)
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
                on_batch=rows.write if rows else None,
            )
            parquet = [rows.commit()] if rows else []
            if rows and world.size > 1:
                distributed.barrier(world)  # every rank's part is in place
                parquet = [io.join_sentence_parts(out, world.size)] if world.is_main else []
    except Stopped as err:
        if world.is_main:
            how = "the same command with --resume in place of --overwrite (the stopped run it replaces is kept " \
                "until this one completes)" if overwrite else "the same command and --resume"
            again = f"Continue with {how}" if io.checkpoint_files(out) else \
                "Nothing was measured: run the same command again"  # stopped before the first checkpoint
            err_console.print(f"Interrupted: {err}. {again}.", markup=False, soft_wrap=True)
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
    # from an earlier run that wrote what this one did not (a tagged corpus' categories.csv, --top-tokens, resamples,
    # --per-sentence's sentences.parquet): run.json's record of this run's files would refuse them anyway
    stale = [name for name in io.RUN_FILES if name not in files and not (per_sentence and name == io.SENTENCES_FILE)]
    # and what classify, plot, report and compare made from the earlier run: only in a folder that held one
    earlier = (Path(out) / io.RUN_FILE).is_file()
    stale = [name for name in stale if (Path(out) / name).is_file()] + io.derived_files(out) if earlier else []
    before = io.readable_record(out) if earlier else None
    # run.json last, with the sha256 of every other file (plot, report, ... refuse one from another run)
    written = [*io.write_run(out, files, result.run, remove=io.checkpoint_files(out), written=parquet), *parquet]
    if before is not None and before == io.readable_record(out):
        stale = []  # the same results, file for file (a rerun): what classify, plot, ... made from them still match
    io.remove_files(out, stale)
    io.remove_stale_temps(out, started, keep=(corpus, model))
    run = result.run
    if stale:
        err_console.print(f"Note: removed {len(stale)} file(s) made from the earlier run in {out}, which no longer "
                          f"match its results: {', '.join(stale)}; run classify, plot or report again to remake them",
                          markup=False, highlight=False, soft_wrap=True)
    for command, names, theirs in io.other_model_files(out, run["model"]):
        err_console.print(f"Note: kept {', '.join(names)} in {out}: `attnprobe {command}` results for {theirs}, not "
                          f"{run['model']['spec']}; move them, or run `attnprobe {command}` again",
                          markup=False, highlight=False, soft_wrap=True)
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
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


def hold_out(out: Path, command: str = "analyze") -> None:
    """Lock results folder `out` for this command (attnprobe.lock) until the command ends, however it ends."""
    from attnprobe import lock

    AT_END.append(lock.take(out, command).release)


def check_placement(device_map: str | None, max_memory: str | None) -> None:
    """--max-memory needs --device-map."""
    if max_memory and not device_map:
        raise AttnprobeError("--max-memory applies with --device-map: add --device-map auto")


def load(model: str, device: str, dtype: str, device_map: str | None = None, max_memory: str | None = None,
         lm_head: bool = False, enabled: bool = True):
    """load_model under the `Loading MODEL` spinner, with --dtype, --device-map and --max-memory."""
    from attnprobe.model import load_model, parse_max_memory

    with loading(model, enabled) as on_status:
        return load_model(model, device, dtype, device_map=device_map, max_memory=parse_max_memory(max_memory),
                          lm_head=lm_head, on_status=on_status)


def dtype_label(loaded) -> str:
    """'bfloat16' or, where --dtype auto chose it, 'bfloat16 (auto)': what ran, for the tables' titles."""
    return loaded.dtype if loaded.dtype_requested != "auto" else f"{loaded.dtype} (auto)"


def release_offload(loaded) -> None:
    """Remove the temporary folder --device-map offloaded weights to (model.release_offload)."""
    from attnprobe.model import release_offload as release

    release(loaded)


def truncation_message(run: dict) -> str:
    """Which sentences were cut to the model's context, and by how many tokens (the first few named)."""
    from attnprobe.analysis import truncation_message as message

    return message(run)


def measures_value_weighted(loaded, options) -> bool:
    """Whether this run measures the value-weighted scores (the model's output projection is found)."""
    from attnprobe.analysis import attention_path, value_weighted_plan

    return value_weighted_plan(loaded, attention_path(loaded, options.attention), options)[0] is not None


@contextmanager
def sentence_writer(out: Path, corpus, wanted: bool, world=None, weighted: bool = False):
    """io.SentenceWriter for --per-sentence (None otherwise); removed again if the run fails. `weighted`: the run
    measures the value-weighted scores too."""
    if not wanted:
        yield None
        return
    from attnprobe import io
    from attnprobe.analysis import score_names

    names = score_names(True, weighted)  # special_tokens is NaN where the tokenizer adds none
    part = world.rank if world is not None and world.size > 1 else None  # one part per rank, joined by rank 0
    with io.SentenceWriter(out, names, corpus.tagged, part=part) as writer:
        yield writer


@contextmanager
def stop_requests():
    """Ctrl-C or SIGTERM asks the run to stop after its current batch (and save a checkpoint); a second
    Ctrl-C stops at once."""
    import signal
    import threading

    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, _frame):
        if asked and signum == signal.SIGINT:
            raise KeyboardInterrupt
        asked.append(signum)
        err_console.print("Stopping after this batch (Ctrl-C again to stop now)...", markup=False)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(asked)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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


class SchemeChoice(str, Enum):
    default = "default"
    extended = "extended"
    kv = "kv"


@app.command()
@friendly_errors
def classify(
    out: ResultsOption = DEFAULT_OUT,
    scheme: Annotated[
        SchemeChoice, typer.Option(help="default: local/copy/broad/mixed; extended adds previous, sink and dormant; "
                                   "kv: streaming/retrieval from sink_window, with a KV-cache estimate.")
    ] = SchemeChoice.default,
    local_min_diagonal: Annotated[
        float, typer.Option(help="Local if at least this share of attention is within +-2 tokens "
                            "(over rows with keys outside the window).")
    ] = defaults.LOCAL_MIN_DIAGONAL,
    copy_max_entropy: Annotated[
        float, typer.Option(help="Copy if mean entropy (over rows with 2+ keys) is at most this (nats); "
                            "ln 2 = an even split over 2 tokens.  [default: ln 2 = 0.693]", show_default=False)
    ] = defaults.COPY_MAX_ENTROPY,
    broad_min_entropy_norm: Annotated[
        float, typer.Option(help="Broad if normalized entropy H/ln(k) is at least this.")
    ] = defaults.BROAD_MIN_ENTROPY_NORM,
    sink_min_first_token: Annotated[
        float, typer.Option(help="Extended: a copy head is a sink if more than this share goes to the first token "
                            "(over rows with 2+ keys).")
    ] = defaults.SINK_MIN_FIRST_TOKEN,
    previous_min_previous_token: Annotated[
        float, typer.Option(help="Extended: a local head is previous if at least this share goes to token i-1.")
    ] = defaults.PREVIOUS_MIN_PREVIOUS_TOKEN,
    streaming_min_sink_window: Annotated[
        float, typer.Option(help="kv: a head is streaming if at least this share sits on the sinks + recent window.")
    ] = defaults.STREAMING_MIN_SINK_WINDOW,
    dormant_max_output_ratio: Annotated[
        float, typer.Option(help="Extended: a sink is dormant if its output_norm is below this share of its layer's "
                            "median output_norm (where heads.csv has output_norm).")
    ] = defaults.DORMANT_MAX_OUTPUT_RATIO,
) -> None:
    """Label each head (local, copy, broad, mixed; extended; or kv) from heads.csv; write head_types.csv."""
    from attnprobe import io
    from attnprobe.classify import Thresholds, counts_per_layer, has_output_norm, required_columns
    from attnprobe.classify import classify as run_classify

    thresholds = Thresholds(
        local_min_diagonal, copy_max_entropy, broad_min_entropy_norm, sink_min_first_token, previous_min_previous_token,
        streaming_min_sink_window, dormant_max_output_ratio,
    )
    heads = io.read_table(out, io.HEADS_FILE, required_columns(scheme.value), "attnprobe analyze")
    if scheme is SchemeChoice.kv:
        types, estimate = classify_kv(out, heads, thresholds)
        files = {io.TYPES_FILE: io.csv_writer(types), io.KV_CACHE_FILE: io.json_writer(estimate)}
    else:
        types = run_classify(heads, thresholds, scheme.value)
        files = {io.TYPES_FILE: io.csv_writer(types)}
    stale = [] if scheme is SchemeChoice.kv else [io.KV_CACHE_FILE]  # from an earlier kv run
    written = io.write_files(out, files, remove=stale)
    counts = counts_per_layer(types)
    table = Table(title=f"Head types per layer ({scheme.value} scheme)")
    table.add_column("layer", justify="right")
    for kind in counts.columns:
        table.add_column(kind, justify="right")
    for layer, row in counts.iterrows():
        table.add_row(str(layer), *(str(int(v)) for v in row))
    table.add_row("all", *(str(int(v)) for v in counts.sum()), style="bold")
    out_console.print(table)
    if scheme is SchemeChoice.kv:
        out_console.print(kv_table(estimate))
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)
    if scheme is SchemeChoice.extended and not has_output_norm(heads):
        err_console.print(f"Note: {io.HEADS_FILE} has no output_norm, so no sink is told apart as dormant: run "
                          "`attnprobe analyze` again (its value-weighted scores need the model's output projection; "
                          "run.json's value_weighted says why they are missing)", markup=False, highlight=False,
                          soft_wrap=True)


def classify_kv(out: Path, heads, thresholds) -> tuple:
    """The kv scheme needs the model's KV shape and the run's sink/window, from run.json."""
    from attnprobe import io
    from attnprobe.classify import classify as run_classify
    from attnprobe.classify import kv_cache_estimate

    run = io.read_run(out)
    model, attention = run["model"], run["attention"]
    if not model.get("causal", True):
        raise AttnprobeError(f"{model['spec']} is an encoder: it keeps no KV cache, so --scheme kv does not apply")
    types = run_classify(heads, thresholds, "kv", kv_heads=int(model["kv_heads"]))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(run.get("dtype", "float32"), 4)
    lengths = {"longest_sequence": int(run["longest_sequence"]), "32k": 32_768, "128k": 131_072}
    estimate = kv_cache_estimate(
        types, layers=int(model["layers"]), kv_heads=int(model["kv_heads"]), head_dim=int(model["head_dim"]),
        dtype_bytes=dtype_bytes, sink=int(attention["sink_tokens"]), window=int(attention["window"]),
        lengths=lengths,
    )
    estimate["model"] = model["spec"]
    estimate["threshold"] = {"streaming_min_sink_window": thresholds.streaming_min_sink_window}
    return types, estimate


def kv_table(estimate: dict) -> Table:
    counts, a = estimate["counts"], estimate["assumptions"]
    query_heads = counts["query_heads_streaming"] + counts["query_heads_retrieval"]
    table = Table(
        title=f"KV cache if streaming KV heads keep only {a['sink']} sink + {a['window']} recent tokens",
        caption=f"{counts['query_heads_streaming']} of {query_heads} query heads streaming; "
        f"{counts['kv_heads_streaming']} of {counts['kv_heads_total']} KV heads usable "
        "(all their query heads streaming). Attention mass, not accuracy.",
    )
    for column in ("sequence", "tokens", "full cache", "sink+window cache", "ratio"):
        table.add_column(column, justify="right")
    for name, row in estimate["lengths"].items():
        table.add_row(name, f"{row['tokens']:,}", _mib(row["full_bytes"]), _mib(row["streaming_bytes"]),
                      f"{row['ratio']:.3f}")
    return table


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


class FormatChoice(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


MAX_PATTERN_HEADS = 12  # panels of head_patterns_selected, chosen with --heads
SELECTED_PATTERNS = "head_patterns_selected"  # plot --heads: the chosen heads' figure, beside head_patterns


@app.command()
@friendly_errors
def plot(
    out: ResultsOption = DEFAULT_OUT,
    example: Annotated[
        str | None, typer.Option("--example", metavar="N|TEXT", help="The sentence of head_patterns: the number "
                                 "(0-7) or text of one of the example sentences analyze kept (default: 0).")
    ] = None,
    heads_option: Annotated[
        str | None, typer.Option("--heads", metavar="L17H4,L18H6", help="Also draw these heads (at most "
                                 f"{MAX_PATTERN_HEADS}) on the example sentence, in head_patterns_selected "
                                 "(head_patterns, one head of each type, is drawn as ever).")
    ] = None,
    figure_format: Annotated[
        FormatChoice, typer.Option("--format", help="File format of the figures.")
    ] = FormatChoice.png,
    dpi: Annotated[float, typer.Option("--dpi", help="Pixels per inch of png figures (and of images in svg/pdf).")] = (
        120.0),
) -> None:
    """Draw entropy_heatmap, layer_gradient, head_patterns, position_profile (and importance, head_similarity and
    head_map) figures."""
    from attnprobe import io, naming, plotting
    from attnprobe.classify import RULE_COLUMNS
    from attnprobe.classify import classify as run_classify

    if not 10 <= dpi <= 1200:
        raise AttnprobeError(f"--dpi {dpi:g} is outside 10-1200: use e.g. 120 (screen) or 300 (print)")
    chosen = naming.parse_heads(heads_option) if heads_option is not None else None
    if chosen is not None and len(chosen) > MAX_PATTERN_HEADS:
        raise AttnprobeError(f"--heads names {len(chosen)} heads: head_patterns draws at most {MAX_PATTERN_HEADS}")

    heads = io.read_table(out, io.HEADS_FILE, ["layer", "head", "entropy", *RULE_COLUMNS], "attnprobe analyze")
    layers = io.read_table(out, io.LAYERS_FILE, ["layer", "entropy", "entropy_head_std"], "attnprobe analyze")
    io.check_fits_heads(heads, layers, io.LAYERS_FILE, f"attnprobe analyze --out {out}")
    if (Path(out) / io.TYPES_FILE).exists():
        kv = "kv_head" in io.read_columns(out, io.TYPES_FILE)  # the kv scheme labels streaming / retrieval
        rule = ["sink_window"] if kv else list(RULE_COLUMNS)
        types = io.read_table(out, io.TYPES_FILE, ["layer", "head", "head_type", *rule], "attnprobe classify")
        io.check_same_heads(heads, types, io.TYPES_FILE, f"attnprobe classify --out {out}")
    else:
        types = run_classify(heads)
        err_console.print("No head_types.csv: using the default classification thresholds.", markup=False)
    categories = None
    if (Path(out) / io.CATEGORIES_FILE).exists():
        categories = io.read_table(out, io.CATEGORIES_FILE, ["category", "layer", "entropy"], "attnprobe analyze")
        io.check_fits_heads(heads, categories, io.CATEGORIES_FILE, f"attnprobe analyze --out {out}")
    examples = io.read_examples(out)
    if not examples:
        raise AttnprobeError(f"no {io.EXAMPLE_FILE} in {out}: run `attnprobe analyze --out {out}` first")
    shape = (heads["layer"].nunique(), heads["head"].nunique())
    if any(e["maps"].shape[:2] != shape for e in examples):
        raise AttnprobeError(f"{io.EXAMPLE_FILE} does not match heads.csv: run `attnprobe analyze --out {out}` again")
    picked = plotting.choose_example(examples, example)
    if chosen is not None:
        naming.check_heads_exist(chosen, *shape)
    skipped: list[str] = []
    figures = drawable({
        "entropy_heatmap": lambda: plotting.entropy_heatmap_figure(
            heads, run_title(out, "Mean attention entropy per head")),
        "layer_gradient": lambda: plotting.layer_gradient_figure(heads, layers, types, categories,
                                                                 run_title(out, "Entropy by depth and head types")),
        "head_patterns": lambda: plotting.head_patterns_figure(picked, types, heads, None,
                                                               run_title(out, "Attention patterns")),
    }, skipped, out)
    if chosen is not None:  # its own file: the by-type head_patterns stays as it is
        figures[SELECTED_PATTERNS] = plotting.head_patterns_figure(picked, types, heads, chosen,
                                                                   run_title(out, "Attention patterns"))
    if (Path(out) / io.POSITIONS_FILE).exists():
        positions = io.read_table(
            out, io.POSITIONS_FILE, ["layer", "head", "bin", "position_min", "position_max", "entropy", "first_token"],
            "attnprobe analyze",
        )
        io.check_fits_heads(heads, positions, io.POSITIONS_FILE, f"attnprobe analyze --out {out}")
        title = run_title(out, "Attention by query position")
        figures[Path(POSITION_FIGURE).stem] = plotting.position_profile_figure(positions, title)
    figures.update({Path(name).stem: f for name, f in importance_figures(out, heads, types).items()})
    figures.update(similarity_figures(out, heads, types, chosen))
    suffix = figure_format.value
    position = f"{Path(POSITION_FIGURE).stem}.{suffix}"
    files = {f"{stem}.{suffix}": io.figure_writer(f, suffix, dpi) for stem, f in figures.items()}
    stale = [name for name in (position, *(f"{stem}.{suffix}" for stem in io.ABLATE_PLOT_FIGURES))
             if name not in files]  # from an earlier run
    stale += [name for name in (f"{stem}.{suffix}" for stem in SIMILARITY_FIGURES) if name not in files]
    stale += [f"{stem}.{suffix}" for stem in skipped]  # an earlier run's figure would pass for this one's
    written = io.write_files(out, files, remove=stale)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)
    if chosen is not None:
        out_console.print(f"The heads chosen with --heads are in {SELECTED_PATTERNS}.{suffix}; head_patterns.{suffix} "
                          "shows one head of each type.", markup=False, highlight=False)


@app.command()
@friendly_errors
def report(out: ResultsOption = DEFAULT_OUT) -> None:
    """Write report.html: one self-contained page to explore every head, its attention on the example sentences,
    the layer charts and the run's provenance (no model, no network)."""
    from attnprobe import io
    from attnprobe.report import build_report

    page = build_report(out)
    path = io.write_report(out, page.html)
    for note in page.notes:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    size = path.stat().st_size / 2**20
    out_console.print(f"Wrote {path} ({size:.1f} MiB, {page.examples} example sentence"
                      f"{'' if page.examples == 1 else 's'}); open it in a browser", markup=False, highlight=False,
                      soft_wrap=True)


@app.command()
@friendly_errors
def verify(
    model: ModelOption,
    corpus: Annotated[
        Path | None, typer.Option("--corpus", "-c", help="Take the sentences from this file (default: 4 built in).")
    ] = None,
    sentences: Annotated[int, typer.Option("--sentences", "-n", help="How many sentences to use (first n).")] = 4,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    bos: BosOption = BosChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    threads: ThreadsOption = "auto",
) -> None:
    """Check that the maps attnprobe reads are the model's true attention; exit 1 if any check fails."""
    from attnprobe.corpus import read_corpus
    from attnprobe.verify import DEFAULT_SENTENCES
    from attnprobe.verify import verify as run_verify

    if sentences < 1:
        raise AttnprobeError(f"--sentences {sentences} is below 1: use 1 or more (default 4)")
    limits.check_whole("--sentences", sentences, 1, limits.MAX_SENTENCES, 4)
    check_placement(device_map, max_memory)
    if corpus:
        texts = [s.text for s in itertools.islice(read_corpus(corpus).stream(), sentences)]
    else:
        texts = list(DEFAULT_SENTENCES)[:sentences]
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        checks = run_verify(loaded, texts)
    finally:
        release_offload(loaded)
    shape = f"{loaded.num_layers} layers x {loaded.num_heads} heads"
    table = Table(title=Text(visible(f"verify {model}: {counted(len(texts), 'sentence')}, {shape}, "
                                     f"{dtype_label(loaded)}, {threads_used['threads']} torch thread(s)")))
    table.add_column("check", no_wrap=True)
    table.add_column("diff at tightest", justify="right")  # the difference where it is nearest its tolerance
    table.add_column("tolerance", justify="right")
    table.add_column("result")
    table.add_column("note")
    for check in checks:
        diff = "-" if check.skipped else f"{check.max_abs_diff:.3g}"
        result = "skipped" if check.skipped else ("pass" if check.passed else "FAIL")
        table.add_row(check.name, diff, f"{check.tolerance:.3g}", result, check.note)
    out_console.print(table)
    failed = [c.name for c in checks if not c.passed]
    if failed:
        err_console.print(f"Error: {len(failed)} check(s) failed: {'; '.join(failed)}", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1)


class KindChoice(str, Enum):
    induction = "induction"
    duplicate = "duplicate"
    previous = "previous"


@app.command()
@friendly_errors
def probe(
    model: ModelOption,
    kind: Annotated[
        list[KindChoice] | None, typer.Option("--kind", "-k", help="Probe to run; repeat for several (default: all).")
    ] = None,
    out: OutOption = DEFAULT_PROBE_OUT,
    lengths: Annotated[str, typer.Option(help="Lengths of the random half, comma-separated.")] = "10,20,40",
    sequences: Annotated[int, typer.Option(help="Random sequences per length.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the random tokens and of the bootstrap.")] = 0,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples of the sequences.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sequences per forward pass.")] = 8,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="Score only the first N of each length's --sequences "
                                 "(the same random tokens as without it); recorded in probe.json.")
    ] = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Score induction, duplicate-token and previous-token heads on repeated random tokens."""
    from attnprobe import io, plotting
    from attnprobe.probe import KINDS, check_numbers, top_heads
    from attnprobe.probe import probe as run_probe

    try:
        length_list = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        raise AttnprobeError(f"--lengths {lengths!r}: give whole numbers separated by commas, e.g. 10,20,40") from None
    kinds = tuple(k.value for k in kind) if kind else KINDS
    check_numbers(length_list, sequences, resamples, batch_size, seed)
    check_placement(device_map, max_memory)
    if limit is not None:
        from attnprobe.corpus import check_limit

        check_limit(limit)
    io.check_out_dir(out)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        with err_console.status("Probing"):
            result = run_probe(loaded, kinds=kinds, lengths=length_list, sequences=sequences, seed=seed,
                               resamples=resamples, batch_size=batch_size, limit=limit)
    finally:
        release_offload(loaded)
    kinds = tuple(result.info["kinds"])  # each asked kind once, as the probe ran them
    result.info["threads"] = threads_used
    written = io.write_files(out, {
        io.PROBE_FILE: io.csv_writer(result.scores),
        io.PROBE_RUN_FILE: io.json_writer(result.info),
        io.PROBE_FIGURE: io.figure_writer(plotting.probe_heatmap_figure(result.scores, list(kinds), model,
                                                                            result.info["chance"])),
    })
    for note in result.info.get("notes", []):  # after writing: a failed write stays one line
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    for k in kinds:
        chance, above = result.info["chance"][k], result.info["above_chance"][k]
        table = Table(title=f"Top {k} heads (uniform attention would score {chance:.3f})",
                      caption=f"above chance: 95% interval above {chance:.3f} ({above} of {len(result.scores)} heads)")
        for column in ("head", "score", "95% interval", "above chance"):
            table.add_column(column, justify="right")
        for _, row in top_heads(result.scores, k).iterrows():
            table.add_row(head_name(row["layer"], row["head"]), f"{row[k]:.3f}",
                          f"[{row[f'{k}_ci_low']:.3f}, {row[f'{k}_ci_high']:.3f}]",
                          "yes" if row[f"{k}_above_chance"] else "no")
        out_console.print(table)
        if not above:
            out_console.print(f"No head scores above chance on {k}: every head's 95% interval reaches down to "
                              f"{chance:.3f} or below, so these top heads are no {k} heads.", markup=False,
                              highlight=False, soft_wrap=True)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


@app.command()
@friendly_errors
def compare(
    out_a: Annotated[
        Path, typer.Argument(parser=folder, metavar="OUT_A",
                             help="Results folder A, the baseline (written by `attnprobe analyze`).")
    ],
    out_b: Annotated[
        Path, typer.Argument(parser=folder, metavar="OUT_B", help="Results folder B: every difference is B - A.")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", parser=folder, metavar="PATH",
                                  help="Where compare_*.csv, compare.json and compare.png go "
                                  "(default: OUT_B/compare).")
    ] = None,
    score: Annotated[str, typer.Option("--score", help="The score printed and drawn (every score is written).")] = (
        "entropy"),
    paired_flag: Annotated[
        bool, typer.Option("--paired", help="Insist on the paired bootstrap (refused unless the corpus and "
                           "bootstrap match); default: paired when they match.")
    ] = False,
    unpaired_flag: Annotated[
        bool, typer.Option("--unpaired", help="Decline the paired bootstrap: resample each run on its own.")
    ] = False,
    top: Annotated[int, typer.Option("--top", help="How many of the most changed heads to print.")] = 10,
) -> None:
    """B - A of every score of two runs, with 95% intervals: per head, or by relative depth when shapes differ."""
    from attnprobe import io, plotting
    from attnprobe.compare import compare as run_compare

    if paired_flag and unpaired_flag:
        raise AttnprobeError("--paired and --unpaired contradict each other: pass one (or neither, to pair "
                             "when the corpus and bootstrap match)")
    paired = True if paired_flag else False if unpaired_flag else None
    result = run_compare(out_a, out_b, score=score, paired=paired, top=top)
    target = out if out is not None else Path(out_b) / "compare"
    io.check_out_dir(target)
    files = {io.COMPARE_LAYERS_FILE: io.csv_writer(result.layers), io.COMPARE_RUN_FILE: io.json_writer(result.info)}
    if result.heads is not None:
        files[io.COMPARE_HEADS_FILE] = io.csv_writer(result.heads)
    if result.types is not None:
        files[io.COMPARE_TYPES_FILE] = io.csv_writer(result.types)
    figure = plotting.compare_figure(result.layers, result.info, result.heads, result.types)
    files[io.COMPARE_FIGURE] = io.figure_writer(figure)
    stale = [name for name in (io.COMPARE_HEADS_FILE, io.COMPARE_TYPES_FILE) if name not in files]
    written = io.write_files(target, files, remove=stale)
    for note in result.info["notes"]:
        err_console.print(f"Note: {note}", markup=False, soft_wrap=True)
    print_comparison(result.info, result.types)
    written += refresh_reports(target)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


def refresh_reports(target: Path) -> list[Path]:
    """Rebuild the report.html of the results folder the comparison went into (`target` or its parent,
    for the default OUT_B/compare), so the page gains its comparison section."""
    from attnprobe import io
    from attnprobe.report import COMPARE_FOLDER, build_report

    folders = [target, target.parent] if target.name == COMPARE_FOLDER else [target]
    return [io.write_report(folder, build_report(folder).html) for folder in folders
            if (folder / io.REPORT_FILE).is_file() and (folder / io.HEADS_FILE).is_file()]


def print_comparison(info: dict, types) -> None:
    """The pairing and why, the overall difference, and the heads (or depths) that changed most."""
    score, a, b = info["score"], info["a"], info["b"]
    out_console.print(visible(f"A = {a['label']}, B = {b['label']}"), markup=False, highlight=False)
    out_console.print(f"{info['pairing']}: {info['pairing_reason']}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(info["matching"], markup=False, highlight=False, soft_wrap=True)
    whole = info["overall"][score]
    out_console.print(f"mean {score} over all heads: A {_f(whole['a'])}, B {_f(whole['b'])}, B - A "
                      f"{_f(whole['diff'], '+')} {_ci(whole['ci'])}", markup=False, highlight=False, soft_wrap=True)
    unit = info["changed_unit"]
    changed = info["changed"][score]
    if not info["top"]:
        out_console.print(f"No {unit[:-1]}'s {score} changed: every 95% interval of B - A includes 0 "
                          f"({info['changed_of']} {unit}).", markup=False, highlight=False)
    else:
        by_head = info["same_shape"]
        table = Table(title=f"{score}: most changed {unit}", caption=f"the 95% interval of B - A excludes 0 "
                      f"for {changed} of {info['changed_of']} {unit}")
        for column in ("head" if by_head else "relative depth", "A", "B", "B - A", "95% interval"):
            table.add_column(column, justify="right")
        for row in info["top"]:
            where = row["name"] if by_head else f"{row['depth']:.3f}"
            table.add_row(where, _f(row["a"]), _f(row["b"]), _f(row["diff"], "+"), _ci(row["ci"]))
        out_console.print(table)
    moved = info.get("type_changes", [])
    if moved:
        shown = ", ".join(f"{m['name']} {m['a']} -> {m['b']}" for m in moved[:10])
        more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
        out_console.print(f"{len(moved)} head(s) changed type: {shown}{more}", markup=False, highlight=False,
                          soft_wrap=True)
    if types is not None:
        table = Table(title="Head types (share of all heads)")
        for column in ("type", "A", "B", "B - A"):
            table.add_column(column, justify="right")
        for _, row in types.iterrows():
            table.add_row(row["head_type"], f"{row['fraction_a']:.3f} ({int(row['count_a'])})",
                          f"{row['fraction_b']:.3f} ({int(row['count_b'])})", f"{row['fraction_diff']:+.3f}")
        out_console.print(table)


def _f(value, sign: str = "") -> str:
    return "n/a" if value is None else f"{value:{sign}.4f}"


def _ci(bounds) -> str:
    return f"[{_f(bounds[0], '+')}, {_f(bounds[1], '+')}]"


class MethodChoice(str, Enum):
    zero = "zero"
    mean = "mean"
    streaming = "streaming"


STREAMING_ONLY = ("--pattern", "--sparsity", "--sink-size", "--recent-size", "--shares", "--client", "--task",
                  "--continuation", "--random-orders", "--haystack", "--needle", "--question", "--lengths",
                  "--depths")  # need --method streaming


@app.command()
@friendly_errors
def ablate(
    model: ModelOption,
    corpus: CorpusOption,
    out: OutOption = DEFAULT_OUT,
    method: Annotated[
        MethodChoice, typer.Option("--method", help="zero: an ablated head outputs 0; mean: its mean over the corpus; "
                                   "streaming: chosen KV heads see only the first --sink-size and last --recent-size "
                                   "keys (DuoAttention's streaming heads).")
    ] = MethodChoice.zero,
    heads: Annotated[str, typer.Option("--heads", help="all, or the heads to ablate, e.g. L0H1,L2H3 (or 0.1,2.3); "
                                       "with --method streaming, the KV heads to make streaming.")] = "all",
    layers: Annotated[bool, typer.Option("--layers", help="Also ablate each whole attention layer.")] = False,
    pruning: Annotated[
        bool, typer.Option("--pruning/--no-pruning", help="Also remove heads cumulatively (pruning.csv); with "
                           "--method streaming, the curve over --shares of KV heads streaming.")
    ] = True,
    pattern: Annotated[
        Path | None, typer.Option("--pattern", parser=folder, metavar="DIR", help="--method streaming: the heads' "
                                  "scores, an `attnprobe export --format duo-attention` folder (or an analyze --out "
                                  "folder); the lowest-scoring --sparsity share of KV heads become streaming.")
    ] = None,
    sparsity: Annotated[
        float | None, typer.Option("--sparsity", help="--method streaming with --pattern: the share of KV heads made "
                                   "streaming, lowest scores first (kvpress's head_compression_ratio).  [default: 0.5]",
                                   show_default=False)
    ] = None,
    sink_size: Annotated[
        int | None, typer.Option("--sink-size", metavar="S", help="--method streaming: the first keys a streaming "
                                 "head keeps (default: the pattern's config.json, else 128).")
    ] = None,
    recent_size: Annotated[
        int | None, typer.Option("--recent-size", metavar="W", help="--method streaming: the last keys a streaming "
                                 "head keeps, its own included (default: the pattern's config.json, else 256).")
    ] = None,
    shares: Annotated[
        str | None, typer.Option("--shares", help="--method streaming: the curve's shares of KV heads made "
                                 "streaming.  [default: 0,0.25,0.5,0.75,1]", show_default=False)
    ] = None,
    client: Annotated[
        str | None, typer.Option("--client", metavar="kvpress|duo-attention", help="--method streaming: whose "
                                 "streaming heads to model. kvpress (0.5.5's DuoAttentionPress): the context is "
                                 "prefilled in full, then what follows misses the context keys [S, L - W); "
                                 "duo-attention: sink + recent keys at every position.  [default: kvpress]",
                                 show_default=False)
    ] = None,
    task: Annotated[
        str | None, typer.Option("--task", metavar="both|text|needle", help="--method streaming: what to score. "
                                 "text: the corpus (kvpress: each document's last --continuation tokens after its "
                                 "context); needle: the needle answered after `retrieval`'s prompts.  [default: both]",
                                 show_default=False)
    ] = None,
    continuation: Annotated[
        int | None, typer.Option("--continuation", metavar="N", help="--method streaming --client kvpress: the "
                                 "tokens scored after each document's context.  [default: 64]", show_default=False)
    ] = None,
    random_orders: Annotated[
        int | None, typer.Option("--random-orders", metavar="N", help="--method streaming: random orders of the KV "
                                 "heads the curve compares with (their mean).  [default: 3]", show_default=False)
    ] = None,
    haystack: Annotated[
        Path | None, typer.Option("--haystack", metavar="FILE", help="--method streaming, needle task: the text the "
                                  "needle is hidden in [default: --corpus].", show_default=False)
    ] = None,
    needle: Annotated[
        str | None, typer.Option("--needle", metavar="TEXT", help="--method streaming, needle task: the sentence "
                                 "hidden and then scored as the answer [default: Wu et al.'s].", show_default=False)
    ] = None,
    question: Annotated[
        str | None, typer.Option("--question", metavar="TEXT", help="--method streaming, needle task: the question "
                                 "after the context [default: Wu et al.'s].", show_default=False)
    ] = None,
    lengths: Annotated[
        str | None, typer.Option("--lengths", metavar="N,N", help="--method streaming, needle task: prompt lengths "
                                 "in tokens.  [default: 1000,2000, those that fit]", show_default=False)
    ] = None,
    depths: Annotated[
        str | None, typer.Option("--depths", metavar="P,P", help="--method streaming, needle task: percent of the "
                                 "context before the needle.  [default: 0,25,50,75,100]", show_default=False)
    ] = None,
    split: Annotated[
        SplitChoice, typer.Option("--split", help="One sequence per line, per blank-line paragraph, or the whole file "
                                  "(long documents for --method streaming).")
    ] = SplitChoice.lines,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sentences per forward pass.")] = 8,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    resamples: Annotated[
        int, typer.Option("--resamples", help="Bootstrap resamples of the sentences for the 95% intervals.")
    ] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap and the random pruning order.")] = 0,
    limit: LimitOption = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Ablate each head: loss change and KL (decoders) or embedding change (encoders), gradient importance, pruning;
    or make KV heads streaming (sink + recent keys only) and measure the loss change."""
    from attnprobe import io, plotting
    from attnprobe.ablate import ablate_loaded, check_settings, parse_heads
    from attnprobe.corpus import read_corpus

    streaming_options = (pattern, sparsity, sink_size, recent_size, shares, client, task, continuation,
                         random_orders, haystack, needle, question, lengths, depths)
    given = dict(zip(STREAMING_ONLY, streaming_options))
    if method is MethodChoice.streaming:
        from attnprobe.commands.streaming import StreamingOptions, ablate_streaming

        options = StreamingOptions(*streaming_options)
        return ablate_streaming(model, corpus, out, options, heads=heads, curve=pruning, layers=layers,
                                split=split.value, batch_size=batch_size, device=device.value, dtype=dtype.value,
                                device_map=device_map, max_memory=max_memory, resamples=resamples, seed=seed,
                                limit=limit, bos=bos.value, threads=threads)
    misplaced = [name for name, value in given.items() if value is not None]
    if misplaced:
        raise AttnprobeError(f"{misplaced[0]} applies to --method streaming only: add --method streaming, or drop "
                             f"{misplaced[0]}")
    check_settings(method.value, batch_size, resamples, seed)
    check_placement(device_map, max_memory)
    chosen = parse_heads(heads)
    io.check_out_dir(out)
    io.check_inputs_apart(out, {"--corpus": corpus, "--model": model})
    sentences = read_corpus(corpus, split=split.value).head(limit)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    try:
        with stage_progress() as progress:
            result = ablate_loaded(loaded, sentences, method=method.value, heads=chosen, layers=layers,
                                   batch_size=batch_size, resamples=resamples, seed=seed, pruning=pruning,
                                   progress=progress)
    finally:
        release_offload(loaded)
    result.run["threads"] = threads_used
    title = f"{model} on {Path(corpus).name}, {method.value} ablation"
    shape = (result.run["model"]["layers"], result.run["model"]["heads"])  # the model's, whatever --heads chose
    written = io.write_ablation(out, result, {io.IMPORTANCE_FIGURE: plotting.importance_heatmap_figure(
        result.heads, title, shape)})
    for note in result.run.get("notes", []):
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(importance_table(result.heads, result.run))
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


@contextmanager
def stage_progress(unit: str = "sentences"):
    """A progress bar per stage (mean, ablate, gradient, pruning), fed with (stage, done, total); where stderr is
    no terminal (a log file, a job scheduler) a bar shows nothing, so each step is one plain line on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from attnprobe.layer_progress import Shown

    shown = Shown(unit)  # `within`: a long sequence's layer (layer_progress), next to the bar or as a line
    if not err_console.is_terminal:
        def log(stage: str, done: int, total: int, within=None) -> None:
            line = shown.line(stage, done, total, within)
            if line is not None:
                err_console.print(line, markup=False, highlight=False, soft_wrap=True)

        yield log
        return

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int, within=None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, description=shown.description(stage, done, total, within))

        yield update


def importance_table(frame, run: dict) -> Table:
    """The five most and five least important heads, with the Spearman correlation of the gradient screen."""
    measure = run["measure"]
    ranked = frame.sort_values("rank")
    shown = ranked if len(ranked) <= 10 else ranked.iloc[list(range(5)) + list(range(len(ranked) - 5, len(ranked)))]
    rho = "n/a" if run["spearman"] is None else f"{run['spearman']:.3f}"
    heading = f"{run['model']['spec']}: {run['method']} ablation, {counted(run['sentences'], 'sentence')}"
    table = Table(title=Text(visible(heading)),
                  caption=f"rank 1 = most important; Spearman(gradient, {measure}) = {rho}")
    for column in ("rank", "head", measure, "95% interval", "gradient"):
        table.add_column(column, justify="right")
    for _, row in shown.iterrows():
        table.add_row(str(row["rank"]), head_name(row["layer"], row["head"]), f"{row[measure]:+.4f}",
                      f"[{row[f'{measure}_ci_low']:+.4f}, {row[f'{measure}_ci_high']:+.4f}]",
                      f"{row['gradient_importance']:.4f}")
    return table


def importance_figures(out: Path, heads, types) -> dict:
    """importance.png and importance_vs_type.png for `plot`, when `attnprobe ablate` wrote importance.csv to `out`;
    pruning.png and layer_importance.png when it wrote pruning.csv and layer_importance.csv."""
    from attnprobe import io, plotting

    figures = {}
    for name, stem, key, draw in ((io.PRUNING_FILE, "pruning", "percent", plotting.pruning_figure),
                                  (io.LAYER_IMPORTANCE_FILE, "layer_importance", "layer",
                                   plotting.layer_importance_figure)):
        if (Path(out) / name).exists():
            measures = [c for c in io.read_columns(out, name)
                        if c.removesuffix("_ci_low").removesuffix("_ci_high") in plotting.PRUNING_LABELS]
            frame = io.read_table(out, name, [key, *measures], "attnprobe ablate")
            figures[f"{stem}.png"] = draw(frame, run_title(out, "Head ablation"))
    if not (Path(out) / io.IMPORTANCE_FILE).exists():
        return figures
    measure = "loss_change" if "loss_change" in io.read_columns(out, io.IMPORTANCE_FILE) else "embedding_change"
    columns = ["layer", "head", measure, f"{measure}_ci_low", f"{measure}_ci_high"]
    importance = io.read_table(out, io.IMPORTANCE_FILE, columns, "attnprobe ablate")
    if not set(zip(importance["layer"], importance["head"])) <= set(zip(heads["layer"], heads["head"])):
        raise AttnprobeError(f"{io.IMPORTANCE_FILE} does not match heads.csv (another model): run `attnprobe ablate "
                             f"--out {out}` again")
    title = run_title(out, "Head ablation")
    shape = (int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1)
    return {**figures, io.IMPORTANCE_FIGURE: plotting.importance_heatmap_figure(importance, title, shape),
            io.IMPORTANCE_TYPE_FIGURE: plotting.importance_vs_type_figure(importance, heads, types, title)}


def drawable(builds: dict, skipped: list[str], out: Path) -> dict:
    """The figures (name -> Figure) of `builds` (name -> function drawing it) whose data hold values; a figure
    whose scores are all NaN (plotting.Undrawable) is skipped with a warning line and its name added to
    `skipped`; when none can be drawn, one error line."""
    from attnprobe import plotting

    figures, reasons = {}, []
    for name, build in builds.items():
        try:
            figures[name] = build()
        except plotting.Undrawable as err:
            skipped.append(name)
            reasons.append(str(err))
            err_console.print(f"Warning: {name} not drawn: {err}; run `attnprobe analyze --out {out}` again to "
                              "draw it", markup=False, highlight=False, soft_wrap=True)
    if not figures:
        raise AttnprobeError(f"nothing to draw in {out}: {'; '.join(dict.fromkeys(reasons))}: run `attnprobe "
                             f"analyze --out {out}` again")
    return figures


SIMILARITY_FIGURES = ("head_similarity", "head_map")  # plot's figures of `related`'s head_similarity.npz


def similarity_figures(out: Path, heads, types, chosen: list[tuple[int, int]] | None) -> dict:
    """head_similarity and head_map for `plot`, when `attnprobe related` wrote head_similarity.npz to `out`: the
    heads named in them are the --heads ones, else one head of each type (those of head_patterns)."""
    from attnprobe import io, plotting

    similarity = io.read_similarity(out)
    if similarity is None:
        return {}
    pairs = set(zip(similarity["layer"].tolist(), similarity["head"].tolist()))
    recorded = run_model_spec(out)
    if pairs != set(zip(heads["layer"], heads["head"])) or recorded not in (None, similarity["model"]):
        raise AttnprobeError(f"{io.SIMILARITY_FILE} does not match heads.csv (another model): run `attnprobe related "
                             f"--out {out}` again")
    labelled = list(chosen) if chosen else list(plotting.representatives(types, heads).values())
    title = run_title(out, "Related heads")
    arrays = (similarity["js"], similarity["layer"], similarity["head"])
    return {"head_similarity": plotting.head_similarity_figure(*arrays, types, labelled, title),
            "head_map": plotting.head_map_figure(*arrays, types, labelled, title)}


def set_bos(loaded, policy: str) -> None:
    """tokens.set_bos, imported when a command has loaded its model (tokens.py needs numpy and pandas)."""
    from attnprobe.tokens import set_bos as set_policy

    set_policy(loaded, policy)


def run_bos(run: dict) -> str:
    """The --bos a run.json records (auto for a run made before --bos existed)."""
    from attnprobe.tokens import BOS_POLICIES

    bos = run.get("bos", "auto")
    if bos not in BOS_POLICIES:
        raise AttnprobeError(f"run.json holds bos {bos!r}, not one of {', '.join(BOS_POLICIES)}: run `attnprobe "
                             "analyze` again, or pass --bos")
    return bos


def run_model_spec(out: Path) -> str | None:
    """The model run.json in `out` names (its spec), or None when it cannot be read."""
    import json

    try:
        return str(json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))["model"]["spec"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def run_title(out: Path, what: str) -> str:
    """`what: model on corpus`, from run.json when it can be read."""
    import json

    try:
        run = json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))
        return f"{what}: {run['model']['spec']} on {Path(run['corpus']['path']).name}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return what


@app.command()
@friendly_errors
def rollout(
    model: ModelOption,
    corpus: Annotated[
        Path | None, typer.Option("--corpus", "-c", help="Corpus whose example sentence (the one analyze keeps) "
                                  "is rolled out; optional with --example.")
    ] = None,
    out: OutOption = DEFAULT_OUT,
    example: Annotated[
        list[str] | None,
        typer.Option("--example", metavar="TEXT", help="A sentence to roll out instead; repeat for several."),
    ] = None,
    index: Annotated[
        list[int] | None,
        typer.Option("--index", metavar="N", help="Roll out the corpus's sentence N (0-based); repeatable."),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Keep each sentence's first N tokens (default 40).")
    ] = None,
    residual: Annotated[
        float, typer.Option("--residual", help="Weight of the identity (residual stream): (1-r) A + r I.")
    ] = 0.5,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="Treat the corpus as its first N sentences: the "
                                 "example and --index are chosen among them.")
    ] = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Attention rollout (Abnar & Zuidema 2020) of example sentences; write rollout.npz and rollout.png."""
    from attnprobe import io, plotting
    from attnprobe.corpus import read_corpus
    from attnprobe.rollout import check_choice, check_residual, choose_sentences, first_token_share, rollout_loaded

    check_residual(residual)
    check_placement(device_map, max_memory)
    if max_tokens is not None and max_tokens < 1:
        raise AttnprobeError(f"--max-tokens {max_tokens} is below 1: use 1 or more (default 40)")
    io.check_out_dir(out)
    io.check_inputs_apart(out, {"--corpus": corpus, "--model": model})
    if limit is not None and corpus is None:
        raise AttnprobeError("--limit picks the first sentences of the corpus: pass --corpus too")
    sentences = read_corpus(corpus).head(limit) if corpus is not None else None
    check_choice(sentences, index, example)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        texts, indices = choose_sentences(loaded, sentences, index, example)
        result = rollout_loaded(loaded, texts, indices, max_tokens=max_tokens, residual=residual)
    finally:
        release_offload(loaded)
    result.info["limit"] = limit
    result.info["threads"] = threads_used["threads"]
    source = Path(corpus).name if corpus is not None and not example else None
    written = io.write_rollout(out, result, plotting.rollout_figure(result, model, source))
    heading = f"{model}: attention rollout, {result.info['layers']} layers, residual {residual:g}"
    table = Table(title=Text(visible(heading)),
                  caption="mean share of the rows after the first on token 0 (a sink draws rollout to itself)")
    for column in ("sentence", "tokens", "rollout -> first token", "last layer -> first token"):
        table.add_column(column, justify="right" if column != "sentence" else "left")
    for s, text in enumerate(result.sentences):
        table.add_row(Text(visible(text if len(text) <= 50 else text[:47] + "...")), str(len(result.tokens[s])),
                      f"{first_token_share(result.rollout[s][-1]):.3f}", f"{first_token_share(result.raw[s]):.3f}")
    out_console.print(table)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


@app.command()
@friendly_errors
def related(
    out: ResultsOption = DEFAULT_OUT,
    sentences: Annotated[
        int, typer.Option("--sentences", "-n", metavar="N", help="Sample at most N sentences of the run's corpus, "
                          "spread evenly over it.")
    ] = 200,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", metavar="N", help="Cut each sampled sentence to its first N tokens.")
    ] = 64,
    heads_option: Annotated[
        str | None, typer.Option("--heads", metavar="L17H4,L18H6", help="Also print these heads' 5 nearest heads.")
    ] = None,
    pair_rows: Annotated[
        int, typer.Option("--pair-rows", metavar="N", help="Sample fewer sentences when pairs of heads x query rows "
                          "would pass N, so a model of many heads finishes in minutes (0: no limit).")
    ] = 10**9,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sentences per forward pass.")] = 8,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    bos: Annotated[
        BosChoice | None, typer.Option("--bos", help="BOS token, as for analyze (default: the run's, from run.json).")
    ] = None,
    dtype: Annotated[
        DTypeChoice | None, typer.Option("--dtype", help="Model precision (default: the dtype the run's run.json "
                                         "records as having run); auto: the checkpoint's own.")
    ] = None,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    threads: ThreadsOption = "auto",
) -> None:
    """Jensen-Shannon divergence between every pair of heads' attention on a sample of the run's corpus; write
    head_similarity.npz (plot draws it, report lists each head's nearest heads)."""
    from attnprobe import io, naming
    from attnprobe.similarity import NEAREST, check_same_weights, check_settings, head_similarity, run_corpus, run_model

    started = time.monotonic()
    check_settings(sentences, max_tokens, batch_size, pair_rows)
    check_placement(device_map, max_memory)
    chosen = naming.parse_heads(heads_option) if heads_option is not None else []
    run = io.read_run(out)
    naming.check_heads_exist(chosen, run["model"]["layers"], run["model"]["heads"])
    corpus = run_corpus(run, out)
    spec = run_model(run)
    threads_used = apply_threads(threads)
    ran = run.get("dtype", "float32")  # before --dtype auto, runs were float32 unless asked otherwise
    loaded = load(spec, device.value, dtype.value if dtype else ran if ran in DTYPE_NAMES else "auto", device_map,
                  max_memory)
    set_bos(loaded, bos.value if bos is not None else run_bos(run))
    if (loaded.num_layers, loaded.num_heads) != (run["model"]["layers"], run["model"]["heads"]):
        raise AttnprobeError(f"{spec} has {loaded.num_layers} x {loaded.num_heads} heads, but run.json in {out} "
                             f"records {run['model']['layers']} x {run['model']['heads']}: run `attnprobe analyze "
                             f"--out {out}` again")
    try:
        check_same_weights(run, loaded, out)
        with err_console.status(f"Comparing {loaded.num_layers * loaded.num_heads} heads"):
            result = head_similarity(loaded, corpus, sentences=sentences, max_tokens=max_tokens,
                                     batch_size=batch_size, pair_rows=pair_rows)
    finally:
        release_offload(loaded)
    result.info["model"] = run["model"]["spec"]  # as run.json names it, whatever path loaded it
    result.info["threads"] = threads_used["threads"]
    written = io.write_similarity(out, result)
    seconds = time.monotonic() - started
    out_console.print(similarity_table(result), soft_wrap=True)
    for layer, head in chosen:
        nearest = ", ".join(f"{head_name(other, index)} {value:.4f}"
                            for other, index, value in result.nearest(layer, head, NEAREST))
        out_console.print(f"{head_name(layer, head)}: nearest {nearest}", markup=False, highlight=False,
                          soft_wrap=True)
    cut = f", {result.cut} cut to {result.max_tokens} tokens" if result.cut else ""
    if len(result.indices) < min(sentences, len(corpus)):
        cut += (f" (not {sentences}: {result.js.shape[0]} heads keep pairs of heads x query rows within "
                f"--pair-rows {pair_rows})")
    out_console.print(f"{counted(result.sentences, 'sentence')}{cut}, {counted(result.rows, 'query row')}, "
                      f"{seconds:.1f} s", markup=False, highlight=False)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False, soft_wrap=True)


class DecodeChoice(str, Enum):
    greedy = "greedy"
    forced = "forced"


def number_list(text: str, kind: type, option: str) -> list:
    """A comma-separated list of numbers (--lengths 1000,2000; --depths 0,50,100)."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise AttnprobeError(f"{option} {text!r}: give numbers separated by commas, e.g. {option} "
                             f"{'1000,2000' if kind is int else '0,50,100'}") from None


@app.command()
@friendly_errors
def retrieval(
    model: ModelOption,
    haystack: Annotated[
        Path, typer.Option("--haystack", metavar="FILE", help="Long UTF-8 text the needle is hidden in (repeated "
                           "when shorter than a context).")
    ],
    out: OutOption = DEFAULT_OUT,
    lengths: Annotated[
        str | None, typer.Option("--lengths", metavar="N,N", help="Prompt lengths in tokens [default: 1000,2000,"
                                 "4000,8000, those that fit the model's context].", show_default=False)
    ] = None,
    depths: Annotated[
        str, typer.Option("--depths", metavar="P,P", help="Where the needle goes: percent of the context before it.")
    ] = "0,25,50,75,100",
    needle: Annotated[
        str | None, typer.Option("--needle", metavar="TEXT", help="The sentence hidden in the haystack [default: "
                                 "Wu et al.'s San Francisco sentence].", show_default=False)
    ] = None,
    question: Annotated[
        str | None, typer.Option("--question", metavar="TEXT", help="The question asked after the context [default: "
                                 "What is the best thing to do in San Francisco?].", show_default=False)
    ] = None,
    decode: Annotated[
        DecodeChoice, typer.Option("--decode", help="greedy: the model's own answer, trials that copy the needle "
                                   "count (Wu et al.); forced: the needle's tokens fed as the answer, every trial "
                                   "counts (deterministic; for models too small to copy).")
    ] = DecodeChoice.greedy,
    device: Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")] = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    resamples: Annotated[int, typer.Option("--resamples", help="Bootstrap resamples of the trials.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap.")] = 0,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Find retrieval heads, the heads that copy a needle from a long context; write retrieval_heads.csv,
    head_score.json and retrieval.json. The method of Wu et al. 2024."""
    from attnprobe import io
    from attnprobe import retrieval as finding

    length_list = number_list(lengths, int, "--lengths") if lengths is not None else None
    depth_list = number_list(depths, float, "--depths")
    finding.check_settings(length_list or list(finding.DEFAULT_LENGTHS), depth_list, decode.value, resamples)
    finding.check_text("--needle", needle)
    finding.check_text("--question", question)
    text = finding.read_haystack(haystack)
    io.check_out_dir(out)
    io.check_inputs_apart(out, {"--haystack": haystack, "--model": model})
    check_placement(device_map, max_memory)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    try:
        with stage_progress("trials") as progress:
            result = finding.retrieval(
                loaded, text, lengths=length_list, depths=depth_list, needle=needle or finding.DEFAULT_NEEDLE,
                question=question or finding.DEFAULT_QUESTION, decode=decode.value, resamples=resamples, seed=seed,
                haystack_name=str(haystack),
                progress=lambda done, total, within=None: progress("retrieval", done, total, within))
    finally:
        release_offload(loaded)
    result.info["threads"] = threads_used["threads"]
    result.info.setdefault("dtype", loaded.dtype)
    result.info.setdefault("dtype_requested", loaded.dtype_requested)
    written = io.write_retrieval(out, result)
    info = result.info
    out_console.print(f"{model}: {info['trials_total']} trials ({decode.value}), the needle copied in "
                      f"{info['trials_copied']}; {info['trials_scored']} scored", markup=False, highlight=False)
    if not result.heads.empty:
        top = result.heads.sort_values("mean", ascending=False, kind="stable").head(10)
        table = Table(title="Top retrieval heads (mean score over the scored trials)")
        for column in ("head", "kv head", "mean", "95% interval"):
            table.add_column(column, justify="right")
        for row in top.itertuples():
            table.add_row(head_name(int(row.layer), int(row.head)), str(int(row.kv_head)), f"{row.mean:.3f}",
                          f"[{row.ci_low:.3f}, {row.ci_high:.3f}]")
        out_console.print(table)
    for note in info["notes"]:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


class ExportFormat(str, Enum):
    duo_attention = "duo-attention"
    retrieval_head = "retrieval-head"


class ExportScores(str, Enum):
    auto = "auto"
    retrieval = "retrieval"
    kv = "kv"
    trained = "trained"


@app.command()
@friendly_errors
def export(
    to: Annotated[
        Path, typer.Option("--to", parser=folder, metavar="PATH", help="Folder to write the exported files into "
                           "(created if missing).")
    ],
    out: Annotated[
        Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder to read the scores from: "
                           "`attnprobe retrieval`'s and `attnprobe analyze`'s (see --scores).")
    ] = DEFAULT_OUT,
    format: Annotated[
        ExportFormat, typer.Option("--format", help="duo-attention: full_attention_heads.tsv [layer, KV head] and "
                                   "config.json, as DuoAttention and kvpress's DuoAttentionPress load them; "
                                   "retrieval-head: Wu et al.'s {\"L-H\": [scores]} JSON (HeadKV reads it too).")
    ] = ExportFormat.duo_attention,
    scores: Annotated[
        ExportScores, typer.Option("--scores", help="Per-head scores: retrieval (from `attnprobe retrieval`), kv "
                                   "(the far share (1 - sink_window) / (1 - first_token) from `attnprobe analyze`), "
                                   "trained (the gates of `attnprobe train-pattern`, one per KV head), or auto: "
                                   "trained where train-pattern ran into --out, else retrieval where it ran "
                                   "there, else kv.")
    ] = ExportScores.auto,
    sink_size: Annotated[
        int | None, typer.Option("--sink-size", metavar="S", help="config.json's sink_size, 0 to 10,000,000 "
                                 "(default: run.json's --sink-tokens; without run.json analyze's default 4).")
    ] = None,
    recent_size: Annotated[
        int | None, typer.Option("--recent-size", metavar="W", help="config.json's recent_size, 1 to 10,000,000 "
                                 "(default: run.json's --window; without run.json analyze's default 256).")
    ] = None,
) -> None:
    """Write the heads that need a full KV cache in the files KV-cache compression tools load."""
    from attnprobe import export as exporting

    head_scores = exporting.load_scores(out, scores.value, sink_size, recent_size)
    written = exporting.write_export(to, head_scores, format.value)
    model = head_scores.model
    what = exporting.source_words(head_scores)
    sizes = f"; sink {head_scores.sink}, recent {head_scores.recent} (from {head_scores.sizes_from})" \
        if format is ExportFormat.duo_attention else ""
    out_console.print(f"{model['spec']}: {model['layers']} layers x {model['kv_heads']} KV heads "
                      f"({model['heads']} query heads) from {what}{sizes}", markup=False, highlight=False)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False)


from attnprobe.commands import train_pattern as _train_pattern  # noqa: E402 (its options and body)

_train_pattern.register(app)


def similarity_table(result) -> Table:
    """The ten most alike pairs of different heads, and the mean over all pairs."""
    import numpy as np

    js = result.js
    upper = np.triu_indices(js.shape[0], k=1)
    order = np.argsort(js[upper], kind="stable")[:10]
    mean = float(js[upper].mean()) if len(upper[0]) else float("nan")
    table = Table(title="Most alike heads (Jensen-Shannon divergence, nats; 0 = same attention, ln 2 = 0.693 = "
                  "disjoint)", caption=f"mean over all {len(upper[0])} pairs: {mean:.4f}")
    for column in ("head", "head", "JS"):
        table.add_column(column, justify="right")
    for k in order:
        a, b = upper[0][k], upper[1][k]
        table.add_row(head_name(result.layer[a], result.head[a]), head_name(result.layer[b], result.head[b]),
                      f"{js[a, b]:.4f}")
    return table


def is_usage_error(err: BaseException) -> bool:
    """Click's UsageError (bad option, value or command), whichever click typer bundles."""
    return any(cls.__name__ == "UsageError" for cls in type(err).__mro__) and hasattr(err, "format_message")


# typer checks values with pydantic: plain words for its messages
_CHOICE_ERROR = re.compile(r"(?:Value error, |: )(?P<value>'[^']*'|\"[^\"]*\") is not one of (?P<choices>'.*?)\.?$")
_PYDANTIC_WORDS = {
    "Value error, ": "",
    "Input should be a valid integer, unable to parse string as an integer": "not a whole number",
    "Input should be a valid number, unable to parse string as a number": "not a number",
}


def usage_message(err: BaseException) -> str:
    """The one line for a usage error: `--scheme 'extnded' is not one of default, extended, kv` for a misspelt
    choice, else click's message in plain words with a pointer to --help."""
    message = err.format_message()  # type: ignore[attr-defined]
    param = getattr(err, "param", None)
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    choice = _CHOICE_ERROR.search(message)
    if choice and opts:
        choices = ", ".join(c.strip().strip("'") for c in choice["choices"].split(","))
        return f"{opts[0]} {choice['value']} is not one of {choices}"
    for words, plain in _PYDANTIC_WORDS.items():
        message = message.replace(words, plain)
    ctx = getattr(err, "ctx", None)
    command = ctx.command_path if ctx is not None else "attnprobe"
    return f"{message} (see `{command} --help`)"


def main() -> None:
    """Run the CLI; a misspelt option or value is one `Error:` line too (exit 2), not a usage block."""
    limit_numpy_threads()
    reuse_freed_memory()
    freeze_at_exit()
    try:
        code = app(prog_name="attnprobe", standalone_mode=False)
    except typer.Abort:
        err_console.print("Aborted.", markup=False)
        sys.exit(1)
    except Exception as err:
        if not is_usage_error(err):
            raise
        if type(err).__name__ == "NoArgsIsHelpError":  # bare `attnprobe`: the help is the answer
            print(err.format_message())
            sys.exit(0)
        if is_main_process():
            err_console.print(f"Error: {usage_message(err)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def freeze_at_exit() -> None:
    """At exit, move every object still alive out of the garbage collector's reach (gc.freeze).

    The interpreter's shutdown runs full collections over every object torch, transformers and pandas made, to
    reclaim memory the process is about to hand back anyway: most of a second of CPU after a short `analyze` has
    written its results. Objects are still released as their modules are cleared and every other exit hook still
    runs; only reference cycles left at exit are not collected."""
    import atexit

    atexit.unregister(gc.freeze)  # once, however often main() runs in one process
    atexit.register(gc.freeze)


if __name__ == "__main__":
    main()
