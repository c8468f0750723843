"""What several commands share: the consoles, one-line errors (friendly_errors), loading a model, progress bars and
number formats; the results-folder lock (hold_out) and stop requests (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import functools
import gc
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from attnprobe.errors import AttnprobeError

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


def friendly_errors(command):
    """Turn the library's errors into one line on stderr and exit code 1 (printed by torchrun's rank 0 alone), and
    Ctrl-C into one line and exit code 130; and hand what the command froze (`freeze_imports`) back to the garbage
    collector when it ends."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        ours = gc.get_freeze_count() == 0  # what is frozen from now on was frozen by the command
        try:
            return command(*args, **kwargs)
        except AttnprobeError as err:
            if is_main_process():
                err_console.print(f"Error: {err}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:  # Ctrl-C where no checkpoint is kept (Typer would exit 130 without a word)
            if is_main_process():
                err_console.print("Interrupted: stopped before the results were written (each file is written whole "
                                  "or not at all); run the same command again.", markup=False, highlight=False,
                                  soft_wrap=True)
            raise typer.Exit(130) from None
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


def load(model: str, device: str, dtype: str, device_map: str | None = None, max_memory: str | None = None,
         lm_head: bool = False, enabled: bool = True):
    """load_model under the `Loading MODEL` spinner, with --dtype, --device-map and --max-memory."""
    from attnprobe.model import load_model, parse_max_memory

    with loading(model, enabled) as on_status:
        return load_model(model, device, dtype, device_map=device_map, max_memory=parse_max_memory(max_memory),
                          lm_head=lm_head, on_status=on_status)


def check_placement(device_map: str | None, max_memory: str | None) -> None:
    """--max-memory needs --device-map."""
    if max_memory and not device_map:
        raise AttnprobeError("--max-memory applies with --device-map: add --device-map auto")


def release_offload(loaded) -> None:
    """Remove the temporary folder --device-map offloaded weights to (model.release_offload)."""
    from attnprobe.model import release_offload as release

    release(loaded)


def set_bos(loaded, policy: str) -> None:
    """tokens.set_bos, imported when a command has loaded its model (tokens.py needs numpy and pandas)."""
    from attnprobe.tokens import set_bos as set_policy

    set_policy(loaded, policy)


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


def number_list(text: str, kind: type, option: str) -> list:
    """A comma-separated list of numbers (--lengths 1000,2000; --depths 0,50,100)."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise AttnprobeError(f"{option} {text!r}: give numbers separated by commas, e.g. {option} "
                             f"{'1000,2000' if kind is int else '0,50,100'}") from None


def decimal(value, sign: str = "") -> str:
    """A number to 4 decimals (`sign` '+': signed), n/a for None."""
    return "n/a" if value is None else f"{value:{sign}.4f}"


def interval(bounds) -> str:
    """A 95% interval's bounds, signed, as `[low, high]`."""
    return f"[{decimal(bounds[0], '+')}, {decimal(bounds[1], '+')}]"


def hold_out(out: Path, command: str = "analyze") -> None:
    """Lock results folder `out` for this command (attnprobe.lock) until the command ends, however it ends."""
    from attnprobe import lock

    AT_END.append(lock.take(out, command).release)


def say_written(paths) -> None:
    """The files a command wrote, in one line on stdout (never folded: a path split over two lines of a log cannot be
    copied)."""
    out_console.print(f"Wrote {', '.join(str(p) for p in paths)}", markup=False, highlight=False, soft_wrap=True)


def resume_threads(threads: str, state, say: bool = True) -> dict:
    """Apply --threads for a run that continues checkpoint `state` (None: a new run): under `auto` the stopped run's
    own threads, so that it resumes byte for byte; another count runs as asked, with a note that says what it
    costs. The threads record for run.json."""
    from attnprobe import threads as torch_threads

    recorded = state.threads if state is not None else 0
    note = torch_threads.resume_note(threads, recorded)
    if note and say:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    return torch_threads.apply(threads, recorded)


def say_resumed(path: str | Path | None, unit: str):
    """The `on_resumed(done, total)` of a run that continues the checkpoint at `path`: once the checkpoint has passed
    every check, the run says so (a log shows where it continued), e.g. "Resuming the stopped run from
    out/checkpoint.npz: 10 of 40 batches done."."""

    def say(done: int, total: int) -> None:
        err_console.print(f"Resuming the stopped run from {path}: {done} of {total} {unit} done.", markup=False,
                          highlight=False, soft_wrap=True)

    return say


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
