"""One run at a time in a results folder: a lock file that holds its owner's pid, under an fcntl.flock.

Two `analyze` runs into one --out would clean each other's live temporary files and write each other's results
over; the second is refused instead. The kernel drops a flock when its process ends, however it ends, so a lock
left by a killed run is stale and the next run takes it over. The file is removed on release; a run that locked
a file just removed (its inode no longer the path's) locks the path's new file instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnprobe.errors import AttnprobeError

LOCK_FILE = ".attnprobe.lock"


class OutLock:
    """The lock of one results folder, held from `take` until `release` (or the process's end)."""

    def __init__(self, folder: Path, fd: int, made_folder: bool) -> None:
        self.folder, self.fd, self.made_folder = folder, fd, made_folder

    def release(self) -> None:
        """Remove the lock file and drop the lock; an empty folder that `take` made goes too."""
        import fcntl

        if self.fd < 0:
            return
        try:
            (self.folder / LOCK_FILE).unlink(missing_ok=True)  # while still held: no one else has it now
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        if self.made_folder:
            try:
                self.folder.rmdir()  # only if the run wrote nothing there
            except OSError:
                pass


def take(out: str | Path, command: str = "analyze") -> OutLock:
    """Lock results folder `out` (made if missing) for this process, or refuse in one line naming the run that
    holds it (its pid)."""
    import fcntl

    folder = Path(out)
    made_folder = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AttnprobeError(f"cannot make --out {out} ({err.strerror}): pass a writable folder") from err
    path = folder / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as err:
            raise AttnprobeError(f"cannot make the lock file {path} ({err.strerror}): pass a writable --out") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _owner(fd)
            os.close(fd)
            who = f" (pid {owner})" if owner else ""
            raise AttnprobeError(
                f"--out {out} is in use by another attnprobe run{who}: wait for it to finish, or pass another --out"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed this file as we waited on it: lock the path's new one
    held = OutLock(folder, fd, made_folder)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {command}\n".encode())
    except OSError as err:  # a full disk (ENOSPC), a quota: no lock file, empty or not, stays behind
        held.release()
        raise AttnprobeError(f"cannot write the lock file {path} ({err.strerror}): free some space on that disk, "
                             "or pass another --out") from err
    return held


def _owner(fd: int) -> int | None:
    """The pid written in an open lock file, or None when it holds none yet."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").split()
    except OSError:
        return None
    return int(text[0]) if text and text[0].isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        found = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
