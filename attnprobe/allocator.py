"""The C allocator's settings for a command: freed tensors reused, not handed back to the kernel and faulted in again.

torch's CPU tensors come from the C library's malloc. glibc gives every block above its mmap threshold (128 KiB
at start) fresh pages from the kernel and returns them when the block is freed, so a batch's activations and
attention blocks, freed at the end of each layer, are page-faulted in again, zeroed by the kernel, at the next.
glibc raises the threshold by itself once a large block is freed (up to 32 MiB), but when that happens depends
on what the process happened to free: on 300 short sentences of a GPT-2-small-shaped model, `attnprobe analyze`
faulted in 130 thousand pages in one version and 450 thousand in the next, for the same work. `reuse_freed_memory`
sets the thresholds glibc's own rule reaches at its ceiling, from the start: blocks up to 32 MiB come from the
heap and are reused, and the heap's free top is handed back only above 64 MiB.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the ceiling of glibc's dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets with it when it raises the threshold itself


def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module's docstring); whether they were set. Elsewhere (macOS,
    Windows, a C library without mallopt) nothing changes. Call it before the model loads."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
