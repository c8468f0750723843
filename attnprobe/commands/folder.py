"""The results folder a long command writes, as one object: its checks, its lock, its checkpoint's name, what an
earlier run left there, and the cleanup at the end. Each command calls it at the same points (check, take, finish),
so the command's body reads as its flow; the files themselves go through `attnprobe.io`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprobe import io
from attnprobe.commands.common import err_console, hold_out
from attnprobe.errors import AttnprobeError


@dataclass
class ResultsFolder:
    """`out` as `command` writes it. `inputs`: the run's input paths by option ({"--corpus": ..., "--model": ...}),
    which may never be results of this folder (check_inputs_apart) and are never swept as a killed run's files, nor
    are the paths of `keep` (default: the inputs)."""

    out: Path | str
    command: str
    inputs: dict[str, Any]
    keep: tuple[Any, ...] | None = None
    started: float = field(default_factory=time.time)  # a temporary file of this process older than this is stale

    def __post_init__(self) -> None:
        if self.keep is None:
            self.keep = tuple(self.inputs.values())

    def check(self) -> None:
        """Refuse an --out that cannot hold results (a file, a folder we cannot write), before anything runs."""
        io.check_out_dir(self.out)

    def apart(self) -> None:
        """Refuse an input that is one of this folder's results (a run would overwrite what it reads)."""
        io.check_inputs_apart(self.out, self.inputs)

    def hold(self, sweep: bool = True) -> None:
        """Lock the folder until the command ends (a second run into it is refused) and, with `sweep`, remove what a
        killed run left (half-written files, never the inputs)."""
        hold_out(self.out, self.command)
        if sweep:
            self.sweep()

    def take(self, hold: bool = True) -> None:
        """`apart`, then with `hold` the lock and the sweep."""
        self.apart()
        if hold:
            self.hold()

    def sweep(self) -> None:
        """Remove the temporary files a killed run of attnprobe left (io.remove_stale_temps), keeping the inputs."""
        io.remove_stale_temps(self.out, self.started, keep=self.keep)

    def checkpoint(self, resume: bool, overwrite: bool, rank: int = 0, size: int = 1) -> str:
        """The name this process checkpoints under, after refusing what cannot go on: a folder under a checkpoint's
        name, a stopped run's checkpoint without --resume or --overwrite, and both together. Under torchrun every
        rank saves its own; under --overwrite under another name, so that the stopped run's checkpoint stays until
        this run completes (and --resume continues the replacing run where it left one)."""
        io.check_checkpoint_slots(self.out)  # a folder named checkpoint.npz: refused now, not at the first save
        saved = io.resumed_name(self.out, rank, size) if resume else \
            io.checkpoint_name(rank, size, replacing=overwrite)
        waiting = io.checkpoint_files(self.out)  # of this process count or any other
        if waiting and not resume and not overwrite:
            raise AttnprobeError(f"{Path(self.out) / waiting[0]} holds a stopped run: add --resume to continue it "
                                 "(with as many processes as it had), or --overwrite to discard it and start again")
        if resume and overwrite:
            raise AttnprobeError("--resume and --overwrite contradict each other: --resume continues the stopped run, "
                                 "--overwrite discards it; pass one")
        return saved

    def stopped(self, reason: object, overwrite: bool) -> None:
        """Say that the run stopped (Ctrl-C, SIGTERM) and how to continue it, or that nothing was measured."""
        how = "the same command with --resume in place of --overwrite (the stopped run it replaces is kept " \
            "until this one completes)" if overwrite else "the same command and --resume"
        again = f"Continue with {how}" if io.checkpoint_files(self.out) else \
            "Nothing was measured: run the same command again"  # stopped before the first checkpoint
        err_console.print(f"Interrupted: {reason}. {again}.", markup=False, soft_wrap=True)

    def finish(self, files: dict[str, Any], run: dict[str, Any], written: list[Path],
               kept: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
        """Write `files` and run.json last (io.write_run: the sha256 of every other file, the checkpoints removed),
        then remove what an earlier run left that no longer matches: its results this run did not make (but `kept`,
        written apart, in `written`) and what classify, plot, report and compare made from them, unless the results
        are the same file for file (a rerun). Returns (every file written, the stale names removed)."""
        folder = Path(self.out)
        # from an earlier run that wrote what this one did not (a tagged corpus' categories.csv, --top-tokens,
        # resamples, --per-sentence's sentences.parquet): run.json's record of this run's files would refuse them
        stale = [name for name in io.RUN_FILES if name not in files and name not in kept]
        # and what classify, plot, report and compare made from the earlier run: only in a folder that held one
        earlier = (folder / io.RUN_FILE).is_file()
        stale = [name for name in stale if (folder / name).is_file()] + io.derived_files(self.out) if earlier else []
        before = io.readable_record(self.out) if earlier else None
        done = [*io.write_run(self.out, files, run, remove=io.checkpoint_files(self.out), written=written), *written]
        if before is not None and before == io.readable_record(self.out):
            stale = []  # the same results, file for file (a rerun): what classify, plot, ... made still match
        io.remove_files(self.out, stale)
        self.sweep()
        return done, stale

    def say_left(self, stale: list[str], model: dict[str, Any]) -> None:
        """Notes on what the folder holds beside this run: the earlier run's files removed, and other commands'
        results of another model, kept."""
        out = self.out
        if stale:
            err_console.print(f"Note: removed {len(stale)} file(s) made from the earlier run in {out}, which no "
                              f"longer match its results: {', '.join(stale)}; run classify, plot or report again to "
                              "remake them", markup=False, highlight=False, soft_wrap=True)
        for command, names, theirs in io.other_model_files(out, model):
            err_console.print(f"Note: kept {', '.join(names)} in {out}: `attnprobe {command}` results for {theirs}, "
                              f"not {model['spec']}; move them, or run `attnprobe {command}` again",
                              markup=False, highlight=False, soft_wrap=True)
