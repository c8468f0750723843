"""commands/folder.py's ResultsFolder: the checkpoint name a run saves under and what it refuses, the apart check, and
the sweep of a killed run's files that never takes an input."""

from __future__ import annotations

import os
import time

import pytest

from attnprobe import io
from attnprobe.commands.folder import ResultsFolder
from attnprobe.errors import AttnprobeError


def folder(tmp_path, **inputs):
    return ResultsFolder(tmp_path, "analyze", inputs or {"--corpus": None})


def test_checkpoint_names_a_new_run_an_overwrite_and_a_resume(tmp_path):
    assert folder(tmp_path).checkpoint(resume=False, overwrite=False) == "checkpoint.npz"
    assert folder(tmp_path).checkpoint(resume=False, overwrite=True) == "checkpoint-overwrite.npz"
    assert folder(tmp_path).checkpoint(False, False, rank=1, size=2) == "checkpoint-rank1-of-2.npz"
    (tmp_path / "checkpoint.npz").write_bytes(b"")
    assert folder(tmp_path).checkpoint(resume=True, overwrite=False) == "checkpoint.npz"
    (tmp_path / "checkpoint-overwrite.npz").write_bytes(b"")  # the replacing run is the later: resume continues it
    assert folder(tmp_path).checkpoint(resume=True, overwrite=False) == "checkpoint-overwrite.npz"


def test_checkpoint_refuses_a_stopped_run_without_resume_or_overwrite(tmp_path):
    (tmp_path / "checkpoint.npz").write_bytes(b"")
    with pytest.raises(AttnprobeError, match="holds a stopped run: add --resume"):
        folder(tmp_path).checkpoint(resume=False, overwrite=False)
    with pytest.raises(AttnprobeError, match="contradict each other"):
        folder(tmp_path).checkpoint(resume=True, overwrite=True)


def test_checkpoint_refuses_a_folder_under_a_checkpoint_name(tmp_path):
    (tmp_path / "checkpoint.npz").mkdir()
    with pytest.raises(AttnprobeError):
        folder(tmp_path).checkpoint(resume=False, overwrite=True)


def test_apart_refuses_an_input_that_is_a_result(tmp_path):
    heads = tmp_path / io.HEADS_FILE
    heads.write_text("layer,head\n")
    with pytest.raises(AttnprobeError, match="--corpus"):
        folder(tmp_path, **{"--corpus": heads}).apart()


def test_sweep_removes_a_killed_runs_temporary_file_but_never_an_input(tmp_path):
    stale = tmp_path / f".{io.HEADS_FILE}.{os.getpid()}-abcd1234.tmp"  # this process's, older than the run's start
    kept = tmp_path / f".{io.LAYERS_FILE}.{os.getpid()}-efgh5678.tmp"  # named like one, but the run's input
    for path in (stale, kept):
        path.write_text("x")
        os.utime(path, (time.time() - 60, time.time() - 60))
    results = ResultsFolder(tmp_path, "analyze", {"--corpus": kept})
    results.sweep()
    assert not stale.exists() and kept.exists()
