"""Whether a process still runs: how cleanups tell a killed run's leftovers (temp files, offload folders) from a live
run's."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts; a pid no process can have does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, OSError):
        return False
    return True
