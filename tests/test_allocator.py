"""The C allocator's thresholds: taken by glibc's mallopt, left alone elsewhere."""

import platform
import sys

from attnprobe import allocator


def test_glibc_takes_the_thresholds_and_other_systems_are_left_alone():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert allocator.reuse_freed_memory() is glibc
