"""The C allocator's thresholds: taken by glibc's mallopt, left alone elsewhere."""

import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from attnprobe import allocator


def test_glibc_takes_the_thresholds_and_other_systems_are_left_alone():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert allocator.reuse_freed_memory() is glibc


def _resident_kib(array: np.ndarray) -> tuple[int, list[str]]:
    """The resident KiB of the mappings that hold `array`, and their VmFlags (/proc/self/smaps). A mapping may hold
    more than the array: the kernel merges neighbours of the same flags (another such table still alive in this
    process), so compare two readings."""
    low, high = array.ctypes.data, array.ctypes.data + array.nbytes
    inside, resident, flags = False, 0, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        found = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if found:
            inside = int(found.group(1), 16) < high and int(found.group(2), 16) > low
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1])
        elif inside and line.startswith("VmFlags:"):
            flags.append(line.split(":", 1)[1].strip())
    return resident, flags


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="needs Linux with transparent huge pages (and /proc/self/smaps)")
def test_sparse_zeros_maps_in_only_the_pages_of_the_rows_written():
    table = allocator.sparse_zeros((49_152, 270))  # SmolLM2's token sums: 106 MB of float64
    assert table.shape == (49_152, 270) and not table.any()
    rows = np.random.default_rng(0).choice(49_152, 1_000, replace=False)
    before, _ = _resident_kib(table)
    table[rows] += 1.0
    resident, flags = _resident_kib(table)
    assert all("nh" in f.split() for f in flags)  # no huge pages asked for, on every part of it
    assert resident - before <= 1_000 * 2 * 4 + 8  # a 2,160-byte row spans two 4 KiB pages at most (+ first, last)
    assert table.sum() == 1_000 * 270
