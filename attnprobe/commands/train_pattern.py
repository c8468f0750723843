"""`attnprobe train-pattern`: DuoAttention's trained head pattern for any decoder; its options and its body.

py registers `train_pattern`. The library side: attnprobe/trainpattern.py (the
training) and attnprobe/passkeys.py (the samples).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from attnprobe import defaults as D
from attnprobe.commands.common import (
    err_console,
    freeze_imports,
    friendly_errors,
    load,
    number_list,
    out_console,
    resume_threads,
    say_resumed,
    say_written,
    set_bos,
    stop_requests,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BosChoice,
    BosOption,
    DeviceChoice,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    ModelOption,
    ThreadsOption,
    folder,
)
from attnprobe.errors import AttnprobeError

TRAIN_OUT = DEFAULT_OUT / "train-pattern"
LOG_EVERY_SECONDS = 10.0  # off a terminal: a progress line at most this often (and the last step's)


@friendly_errors
def train_pattern(
    model: ModelOption,
    out: Annotated[
        Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder (created if missing).")
    ] = TRAIN_OUT,
    haystack: Annotated[
        Path | None, typer.Option("--haystack", metavar="FILE", help="Long UTF-8 text the passkeys are hidden in "
                                  "[default: the Python language reference every CPython ships (pydoc_data)].",
                                  show_default=False)
    ] = None,
    lengths: Annotated[
        str | None, typer.Option("--lengths", metavar="N,N", help="Sample lengths in tokens, taken in turn in a new "
                                 "random order each round [default: "
                                 f"{','.join(map(str, D.TRAIN_LENGTHS))}].", show_default=False)
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", help="Training steps, one sample each (DuoAttention: 2000).")
    ] = D.TRAIN_STEPS,
    lr: Annotated[float, typer.Option("--lr", help="AdamW's peak learning rate (DuoAttention's).")] = D.DUO_LR,
    reg_weight: Annotated[
        float, typer.Option("--reg-weight", help="Weight of the mean gate in the loss (DuoAttention's).")
    ] = D.DUO_REG_WEIGHT,
    sink_size: Annotated[
        int, typer.Option("--sink-size", metavar="S", help="First keys a streaming head keeps (DuoAttention's).")
    ] = D.DUO_SINK,
    recent_size: Annotated[
        int, typer.Option("--recent-size", metavar="W", help="Last keys a streaming head keeps (DuoAttention's).")
    ] = D.DUO_RECENT,
    passkeys: Annotated[
        int, typer.Option("--passkeys", help="Passkeys hidden per sample, 1-20 (DuoAttention: 10).")
    ] = D.TRAIN_PASSKEYS,
    passkey_words: Annotated[
        int, typer.Option("--passkey-words", help="Words per passkey (DuoAttention: 32).")
    ] = D.TRAIN_PASSKEY_WORDS,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the samples (DuoAttention's).")] = D.DUO_SEED,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", metavar="N", help="Steps between checkpoints of the training.")
    ] = D.TRAIN_CHECKPOINT_EVERY,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the training whose train_checkpoint.npz is in --out (same "
                           "settings).")
    ] = False,
    block_mib: Annotated[
        float, typer.Option("--block-mib", help="Memory budget (MiB) for one block of attention rows (a GPU wants "
                            "more than the default).")
    ] = D.BLOCK_MIB,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Train which KV heads need the full cache, as DuoAttention does: a gate per KV head mixing full and streaming
    attention, learned on passkey retrieval; write gates.csv, training.csv, training.png and train_pattern.json
    (`attnprobe export` turns them into DuoAttention's and kvpress's table)."""
    from attnprobe import io, limits
    from attnprobe import passkeys as keys
    from attnprobe import trainpattern as tp
    from attnprobe.commands.folder import ResultsFolder

    freeze_imports()
    folder = ResultsFolder(out, "train-pattern", {"--haystack": haystack}, keep=(haystack, model))
    length_list = tp.DEFAULT_LENGTHS if lengths is None else tuple(number_list(lengths, int, "--lengths"))
    settings = tp.Settings(length_list, steps, lr, reg_weight, sink_size, recent_size, passkeys, passkey_words, seed,
                           block_mib)
    settings.check()
    limits.check_whole("--checkpoint-every", checkpoint_every, 1, tp.MAX_STEPS, tp.DEFAULT_CHECKPOINT_EVERY)
    folder.check()
    folder.apart()
    text, name = keys.read_haystack(haystack)
    folder.hold(sweep=False)  # a killed run's files go at the end
    path = Path(out) / io.TRAINED_CHECKPOINT_FILE
    if path.exists() and not path.is_file():
        raise AttnprobeError(f"{path} is not a file: move it away, then run again")
    if path.is_file() and not resume:
        raise AttnprobeError(f"{path} holds a stopped training: add --resume to continue it, or delete it to start "
                             "again")
    checkpointing = tp.Checkpointing(save=lambda state: io.write_files(out, {io.TRAINED_CHECKPOINT_FILE: io.npz_writer(
        **state.to_arrays())}), every=checkpoint_every, resume_from=read_checkpoint(path) if resume else None)
    threads_used = resume_threads(threads, checkpointing.resume_from)
    if checkpointing.resume_from is not None:
        checkpointing.on_resumed = say_resumed(checkpointing.resume_from.path, "steps")
    loaded = load(model, device.value, dtype.value)
    set_bos(loaded, bos.value)
    try:
        with shown_steps() as progress, stop_requests() as stop:
            checkpointing.should_stop = stop
            result = tp.train_pattern_loaded(loaded, text, settings, haystack_name=name, progress=progress,
                                             checkpointing=checkpointing)
    except tp.Stopped as err:
        err_console.print(f"Interrupted: {err}. Continue with the same command and --resume.", markup=False,
                              soft_wrap=True)
        raise typer.Exit(130) from None
    result.run["threads"] = threads_used
    result.run["peak_memory_mib"] = peak_memory_mib(loaded)
    title = f"{model}: {result.run['kv_heads']} KV heads gated, {steps} steps"
    files = {tp.GATES_FILE: io.csv_writer(result.gates), tp.LOG_FILE: io.csv_writer(result.log),
             tp.FIGURE_FILE: io.figure_writer(tp.training_figure(result, title))}
    # train_pattern.json last, with the sha256 of the files beside it (export refuses a gates.csv of another run)
    record = (tp.RUN_FILE, lambda hashes: io.json_writer({**result.run, io.RUN_FILES_KEY: hashes}))
    written = io.write_files(out, files, remove=[io.TRAINED_CHECKPOINT_FILE], last=record)
    folder.sweep()
    for note in result.run["notes"]:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    summary = result.run["result"]
    out_console.print(f"{model}: {result.run['kv_heads']} KV heads gated; mean gate {summary['mean_gate']:.3f}, "
                          f"{100 * summary['below_half']:.0f}% below 0.5 (streaming); last distillation loss "
                          f"{summary['distill_loss_last']:.3g}", markup=False, highlight=False)
    say_written(written)


def read_checkpoint(path: Path):
    """The stopped training's state in `path`, checked (trainpattern.State.from_arrays)."""
    from attnprobe import io
    from attnprobe.trainpattern import State

    if not path.is_file():
        raise AttnprobeError(f"no {path.name} in {path.parent}: nothing to resume; run without --resume")
    return io.read_state(path, State.from_arrays)


def peak_memory_mib(loaded) -> dict[str, float | None]:
    """The process's peak resident memory (Linux, macOS) and, on a GPU, the peak memory torch allocated there."""
    import sys

    import torch

    rss = None
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        rss = round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)
    except (ImportError, OSError):
        pass
    gpu = round(torch.cuda.max_memory_allocated(loaded.device) / 2**20, 1) if loaded.device.type == "cuda" else None
    return {"rss": rss, "cuda": gpu}


class shown_steps:
    """The progress of the steps with the last loss: a bar on a terminal, else a plain line at most every
    LOG_EVERY_SECONDS (and the last step's)."""

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.started = self.printed = time.monotonic()
        self.bar = None
        if err_console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=err_console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("training", total=None)
        return self.step

    def step(self, done: int, total: int, row: dict[str, float]) -> None:
        words = f"training: loss {row['distill_loss']:.3g} + {row['penalty']:.3g}, mean gate {row['mean_gate']:.3f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, description=words)
            return
        now = time.monotonic()
        if now - self.printed >= LOG_EVERY_SECONDS or done == total:
            self.printed = now
            err_console.print(f"{words}: step {done}/{total} ({now - self.started:.1f} s)", markup=False,
                                  highlight=False, soft_wrap=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

