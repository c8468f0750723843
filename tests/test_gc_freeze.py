"""The CLI keeps what a command imported out of the garbage collector's full collections while it runs
(cli.freeze_imports), and gives it back when the command ends: a caller's process lives on."""

import gc
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attnprobe.cli import app

runner = CliRunner()


def analyze(gpt2_dir, corpus_file, out):
    return runner.invoke(app, ["analyze", "--model", str(gpt2_dir), "--corpus", str(corpus_file), "--out", str(out),
                               "--resamples", "5", "--device", "cpu"])


def test_analyze_freezes_while_it_runs_and_gives_everything_back(gpt2_dir, corpus_file, tmp_path, monkeypatch):
    seen = []
    real = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (real(), seen.append(gc.get_freeze_count())))
    assert gc.get_freeze_count() == 0
    result = analyze(gpt2_dir, corpus_file, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert seen and seen[0] > 0  # it froze ...
    assert gc.get_freeze_count() == 0  # ... and gave it all back


def test_a_callers_own_frozen_objects_stay_frozen(gpt2_dir, corpus_file, tmp_path):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert analyze(gpt2_dir, corpus_file, tmp_path / "out").exit_code == 0
        assert 0 < gc.get_freeze_count() <= frozen  # not given back by the command, nor more frozen by it
    finally:
        gc.unfreeze()


def test_no_leak_warnings_at_exit_where_triton_is_loaded():
    """Where triton is installed (every CUDA build of torch brings it; the dev extra here), torch._dynamo imports it,
    and a freeze at exit left its nanobind objects alive: a page of 'nanobind: leaked ...' ended every command. The
    same process without attnprobe's freeze_at_exit prints them too when it freezes, so the test can fail."""
    pytest.importorskip("triton")
    frozen = subprocess.run([sys.executable, "-c", "import atexit, gc, torch._dynamo\natexit.register(gc.freeze)"],
                            capture_output=True, text=True, timeout=120)
    if "leaked" not in frozen.stderr:
        pytest.skip("this triton leaves nothing alive at exit even when frozen: nothing to check")
    script = ("import sys, torch._dynamo\nsys.argv = ['attnprobe', '--version']\n"
              "from attnprobe.cli import main\nmain()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("attnprobe ")
    assert "leaked" not in done.stderr, done.stderr[:300]
