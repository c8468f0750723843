"""`--threads`: how many CPU threads torch may use, chosen before a model runs.

torch starts one thread per physical core. On a machine whose cores are busy with other jobs, those
threads wait on each other at every operation (a thread that lost its core holds the rest), and a run
stalls: `attnprobe ablate` on SmolLM2 took over 15 minutes with 2 threads on a loaded 2-core machine and
193 s with 1. So the default, `auto`, takes torch's thread count and leaves out the cores that the
system's load average says are busy, keeping at least one. Threads change results only by float32
rounding (the tests run with 1 and with 2).
"""

from __future__ import annotations

import math
import os
from typing import Any

from attnprobe.errors import AttnprobeError

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
    most = 4 * (os.cpu_count() or 1)  # more threads than that only wait on each other (and torch overflows)
    if threads > most:
        raise AttnprobeError(f"--threads {threads} is above {most} (4 x this machine's {os.cpu_count() or 1} CPUs): "
                             f"use auto or 1 to {most}")
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


def auto(cores: int, available: int, busy: float | None) -> int:
    """torch's `cores`, less the CPUs the load keeps busy (rounded to the nearest), at least 1."""
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


def apply(requested: int | str = AUTO) -> dict[str, Any]:
    """Set torch's intra-op (and, where still possible, inter-op) threads; what was chosen, for run.json."""
    import torch

    requested = parse(requested)
    busy = load()
    if not _cores:
        _cores.append(torch.get_num_threads())
    threads = auto(_cores[0], cpus(), busy) if requested == AUTO else requested
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)  # allowed once, before any inter-op work
    except RuntimeError:
        pass
    return {"requested": requested, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "cpus": cpus(),
            "load_average": None if busy is None else round(busy, 2)}
