"""`--threads`: how many CPU threads torch may use, chosen before a model runs.

torch starts one thread per physical core. On a machine whose cores are busy with other jobs, those
threads wait on each other at every operation (a thread that lost its core holds the rest), and a run
stalls: `attnprobe ablate` on SmolLM2 took over 15 minutes with 2 threads on a loaded 2-core machine and
193 s with 1. So the default, `auto`, takes torch's thread count and leaves out the cores that the
system says are busy *now*, keeping at least one. Threads change results only by float32 rounding (the tests run
with 1 and with 2).

"Busy now" is a short sample of the CPU counters in /proc/stat (SAMPLE_SECONDS), less this process's own CPU time
over the same interval: the 1-minute load average, used before, still counts processes that have ended (right after
a benchmark's previous run it read 1.2-1.6 on an idle 2-core machine, and auto chose 1 thread, halving the speed).
Where /proc/stat is missing (not Linux), the load average is the fallback.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from attnprobe.errors import AttnprobeError, plain

AUTO = "auto"
_cores: list[int] = []  # torch's own thread count, read before the first `apply` changes it


def parse(value: Any) -> int | str:
    """`auto` or a whole number of threads, 1 or more; anything else raises AttnprobeError."""
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    try:
        threads = int(text)
    except ValueError:
        raise AttnprobeError(f"--threads {value!r} is not a whole number: use auto or 1 or more") from None
    if threads < 1:
        raise AttnprobeError(f"--threads {threads} is below 1: use auto or 1 or more")
    most = most_threads()
    if threads > most:
        raise AttnprobeError(f"--threads {threads} is above {most} (4 x this machine's {os.cpu_count() or 1} CPUs): "
                             f"use auto or 1 to {most}")
    return threads


def most_threads() -> int:
    """The most threads --threads takes: 4 x the machine's CPUs (more only wait on each other, and torch overflows)."""
    return 4 * (os.cpu_count() or 1)


def recorded_threads(meta: dict[str, Any]) -> int:
    """The threads a checkpoint's meta record says its run used (0: not recorded, an older checkpoint); ValueError
    for anything but a whole number of 0 or more."""
    threads = meta.get("threads", 0)
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"threads = {plain(threads)} is not a whole number of threads")
    return threads


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load() -> float | None:
    """The 1-minute load average: how many CPUs other work keeps busy (None where unknown)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


SAMPLE_SECONDS = 0.1  # how long `busy_now` watches the CPU counters (10 ms ticks: 20 ticks on 2 CPUs)
PROC_STAT = "/proc/stat"


def cpu_ticks(text: str) -> tuple[int, int, int] | None:
    """(busy ticks, all ticks, CPUs) summed over the CPUs of a /proc/stat text; None if it has no `cpu` line.

    Idle time is `idle` + `iowait` (the 4th and 5th numbers); steal and guest time count as busy."""
    total = busy = None
    cpus_seen = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu":
            ticks = [int(x) for x in fields[1:]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total, busy = sum(ticks[:8]), sum(ticks[:8]) - idle  # guest time is already inside user time
        elif fields[0].startswith("cpu") and fields[0][3:].isdigit():
            cpus_seen += 1
    if total is None:
        return None
    return busy, total, max(1, cpus_seen)


def busy_cpus(before: tuple[int, int, int], after: tuple[int, int, int], own_seconds: float,
              elapsed: float) -> float:
    """CPUs kept busy by other work between two `cpu_ticks` samples: the busy share of all ticks times the CPUs,
    less the CPUs this process used (`own_seconds` of CPU time over `elapsed` seconds); never below 0."""
    busy, total, count = after[0] - before[0], after[1] - before[1], after[2]
    if total <= 0:
        return 0.0
    own = own_seconds / elapsed if elapsed > 0 else 0.0
    return max(0.0, busy / total * count - own)


def _read_ticks() -> tuple[int, int, int] | None:
    try:
        with open(PROC_STAT) as stat:
            return cpu_ticks(stat.read())
    except (OSError, ValueError, IndexError):
        return None


def busy_now(seconds: float = SAMPLE_SECONDS) -> float | None:
    """How many CPUs other processes keep busy right now: a `seconds` sample of /proc/stat, less this process's own
    CPU time; None where /proc/stat cannot be read. Work that has ended does not count (unlike the load average)."""
    before = _read_ticks()
    if before is None:
        return None
    own0, start = time.process_time(), time.monotonic()
    time.sleep(seconds)
    after = _read_ticks()
    if after is None:
        return None
    return busy_cpus(before, after, time.process_time() - own0, time.monotonic() - start)


def auto(cores: int, available: int, busy: float | None) -> int:
    """torch's `cores`, less the CPUs other work keeps busy (rounded to the nearest), at least 1."""
    if busy is None:
        return max(1, cores)
    free = math.floor(available - busy + 0.5)
    return max(1, min(cores, free))


def limit_numpy_threads() -> None:
    """One thread for numpy's BLAS (OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy is first imported).

    attnprobe's numpy products are small (the bootstrap's [resample, sentence] weights times a batch's
    scores); with OpenBLAS's own thread per core next to torch's, its idle threads spin on the cores torch
    needs: 300 short sentences took 22 s of CPU instead of 14 with one torch thread. Call it before numpy is
    imported (the CLI does, first thing); an OPENBLAS_NUM_THREADS already set is kept.
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def apply(requested: int | str = AUTO, resumed: int = 0) -> dict[str, Any]:
    """Set torch's intra-op (and, where still possible, inter-op) threads; what was chosen, for run.json.
    `resumed`: the threads of the stopped run a checkpoint continues (0: none), which `auto` keeps
    (`resumed_threads`; the record then says `resumed`)."""
    import torch

    requested = parse(requested)
    chosen = resumed_threads(requested, resumed)
    if not _cores:
        _cores.append(torch.get_num_threads())
    busy, source = (None, None)
    if chosen == AUTO:
        busy, source = busy_now(), f"{PROC_STAT} over {SAMPLE_SECONDS} s"
        if busy is None:
            busy, source = load(), "load average"
    threads = auto(_cores[0], cpus(), busy) if chosen == AUTO else chosen
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)  # allowed once, before any inter-op work
    except RuntimeError:
        pass
    record = {"requested": requested, "threads": torch.get_num_threads(),
              "interop_threads": torch.get_num_interop_threads(), "cpus": cpus(),
              "busy_cpus": _rounded(busy),
              "busy_from": source if busy is not None else None, "load_average": _rounded(load())}
    if chosen != requested:
        record["resumed"] = chosen  # auto kept the stopped run's threads
    return record


def resumed_threads(requested: int | str, recorded: int) -> int | str:
    """The threads a resumed run uses: under `auto`, the `recorded` threads of the run it continues (when this
    machine allows that many), since float32 sums round with the thread count and only the same count resumes to an
    uninterrupted run's results byte for byte; else `requested`. `recorded` 0: not known (an older checkpoint)."""
    requested = parse(requested)
    if requested != AUTO or recorded < 1:
        return requested
    try:
        return parse(recorded)
    except AttnprobeError:  # more than this machine takes: auto as for a new run
        return AUTO


def resume_note(requested: int | str, recorded: int) -> str | None:
    """What a resumed run says when it will not run at the stopped run's `recorded` threads; None where it will."""
    chosen = resumed_threads(requested, recorded)
    if recorded < 1 or chosen == recorded:
        return None
    rounding = ("float32 sums round with the thread count, so the results equal an uninterrupted run's only to "
                "rounding, not byte for byte")
    if chosen == AUTO:
        return (f"the stopped run used {recorded} threads, more than this machine takes "
                f"({most_threads()} at most), and this one --threads auto: {rounding}")
    return (f"the stopped run used {recorded} thread{'s' if recorded != 1 else ''} and this one --threads {chosen}: "
            f"{rounding} (resume with --threads {recorded} or auto for that)")


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
