"""The C allocator's settings for a command: freed tensors reused, not handed back to the kernel and faulted in again.

torch's CPU tensors come from the C library's malloc. glibc gives every block above its mmap threshold (128 KiB
at start) fresh pages from the kernel and returns them when the block is freed, so a batch's activations and
attention blocks, freed at the end of each layer, are page-faulted in again, zeroed by the kernel, at the next.
glibc raises the threshold by itself once a large block is freed (up to 32 MiB), but when that happens depends
on what the process happened to free: on 300 short sentences of a GPT-2-small-shaped model, `attnprobe analyze`
faulted in 130 thousand pages in one version and 450 thousand in the next, for the same work. `reuse_freed_memory`
sets the thresholds glibc's own rule reaches at its ceiling, from the start: blocks up to 32 MiB come from the
heap and are reused, and the heap's free top is handed back only above 64 MiB.

`sparse_zeros` is the other way round: a large table of sums indexed by token id, of which a corpus writes a few
rows, mapped in only where written.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the ceiling of glibc's dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets with it when it raises the threshold itself
MADV_NOHUGEPAGE = 15  # madvise's advice number (mman.h)


def _libc(name: str, *argtypes: type) -> Callable[..., int] | None:
    """The C library's function `name` (taking `argtypes`, returning an int) on Linux; None elsewhere or where the
    C library has no such function."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function


def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module's docstring); whether they were set. Elsewhere (macOS,
    Windows, a C library without mallopt) nothing changes. Call it before the model loads."""
    mallopt = _libc("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def sparse_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """Float64 zeros whose memory is mapped in 4 KiB page by page as rows are first written, for sums indexed by
    token id ([vocabulary, ...]: a corpus writes the rows of the tokens it holds, often a few thousand of 50k to
    250k). np.zeros of a large array already maps nothing until written, but numpy asks Linux for transparent
    huge pages on it, and then one row written maps and zeroes the 2 MiB around it: every part of the table. This
    asks the kernel not to (MADV_NOHUGEPAGE) before anything is written; elsewhere it is np.zeros."""
    import numpy as np  # not at import: the CLI imports this module before it limits numpy's threads

    out = np.zeros(shape)  # [shape]: calloc, so a large one is fresh pages that nothing has touched
    madvise = _libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise is None or out.nbytes < 2 * 2**20:
        return out
    start = out.ctypes.data - out.ctypes.data % mmap.PAGESIZE  # the page the array starts in
    madvise(start, out.ctypes.data + out.nbytes - start, MADV_NOHUGEPAGE)  # advice only: a refusal changes nothing
    return out
