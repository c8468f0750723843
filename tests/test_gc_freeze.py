"""The CLI keeps what a command imported out of the garbage collector's full collections while it runs
(cli.freeze_imports), and gives it back when the command ends: a caller's process lives on."""

import gc

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
