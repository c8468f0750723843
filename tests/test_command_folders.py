"""The results folder of `retrieval`, `ablate` (both methods) and `compose`, as `analyze` and `train-pattern` keep it
(commands/folder.py's ResultsFolder): a folder another run holds is refused in one line before the model loads; what
a killed run left (a temporary file whose writer is gone) is swept, never a file attnprobe did not name; Ctrl-C in the
middle of writing leaves no result and no temporary file, and the lock goes with the command (the next run works)."""

from __future__ import annotations

import pytest
from conftest import make_llama
from test_cli import assert_one_line_error, run
from test_composition import DATA
from test_retrieval import HAYSTACK, NEEDLE, QUESTION

from attnprobe import io, lock

DEAD_PID = 999999999  # no process has it: its temporary files are a killed run's


@pytest.fixture(scope="module")
def llama_lm(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("folders") / "llama", layers=2, heads=4, kv_heads=2, lm_head=True)


def command_args(name, out, tmp_path, gpt2_dir, corpus_file, llama_lm):
    """(arguments of a quick run of `name` into `out`, its result files, the io writer it calls last)."""
    if name == "retrieval":
        haystack = tmp_path / "haystack.txt"
        haystack.write_text(HAYSTACK, encoding="utf-8")
        return (["retrieval", "--model", llama_lm, "--haystack", haystack, "--out", out, "--lengths", "30",
                 "--depths", "50", "--needle", NEEDLE, "--question", QUESTION, "--decode", "forced", "--resamples",
                 5, "--device", "cpu", "--threads", 1],
                [io.RETRIEVAL_RUN_FILE, io.RETRIEVAL_FILE, io.RETRIEVAL_SCORES_FILE], "compact_json_writer")
    if name == "ablate":
        return (["ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--limit", 4, "--resamples",
                 5, "--no-pruning", "--device", "cpu", "--threads", 1],
                [io.IMPORTANCE_FILE, io.ABLATE_RUN_FILE, io.IMPORTANCE_FIGURE], "figure_writer")
    return (["compose", "--model", DATA / "llama", "--out", out, "--samples", 5, "--threads", 1],
            [io.COMPOSITION_FILE, io.COMPOSITION_RUN_FILE, io.COMPOSITION_FIGURE], "figure_writer")


COMMANDS = ["retrieval", "ablate", "compose"]


@pytest.mark.parametrize("name", [*COMMANDS, "ablate-streaming"])
def test_a_folder_another_run_holds_is_refused_in_one_line(name, tmp_path, gpt2_dir, corpus_file, llama_lm):
    out = tmp_path / "out"
    if name == "ablate-streaming":
        args = ["ablate", "--method", "streaming", "--model", llama_lm, "--corpus", corpus_file, "--out", out,
                "--heads", "L0H1", "--task", "text", "--device", "cpu"]
    else:
        args = command_args(name, out, tmp_path, gpt2_dir, corpus_file, llama_lm)[0]
    held = lock.take(out, "analyze")  # flock: a second open of the lock file is refused, in this process too
    try:
        result = run(*args)
        assert_one_line_error(result, f"--out {out} is in use by another attnprobe run", "another --out")
        assert sorted(p.name for p in out.iterdir()) == [lock.LOCK_FILE]  # nothing written, nothing swept
    finally:
        held.release()


@pytest.mark.parametrize("name", COMMANDS)
def test_ctrl_c_while_writing_leaves_nothing_half_written_and_a_killed_runs_files_are_swept(
        name, tmp_path, monkeypatch, gpt2_dir, corpus_file, llama_lm):
    out = tmp_path / "out"
    args, results, last_writer = command_args(name, out, tmp_path, gpt2_dir, corpus_file, llama_lm)
    out.mkdir()
    killed = [out / f".{results[0]}.{DEAD_PID}-abcd1234.tmp", out / f".{results[-1]}.{DEAD_PID}-efgh5678.tmp"]
    theirs = [out / "notes.txt", out / f".{results[0]}.abcd1234.tmp"]  # not named by attnprobe (no writer's pid)
    for path in killed + theirs:
        path.write_text("x")

    def interrupted(*_args, **_kwargs):
        def write(path):
            path.write_bytes(b"half")  # the last file begun, then Ctrl-C
            raise KeyboardInterrupt

        return write

    real = getattr(io, last_writer)
    monkeypatch.setattr(io, last_writer, interrupted)
    stopped = run(*args)
    assert stopped.exit_code == 130, stopped.output
    assert "Interrupted: stopped before the results were written" in stopped.stderr
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(p.name for p in theirs), left  # no result, no temporary file, no lock: theirs alone
    monkeypatch.setattr(io, last_writer, real)
    again = run(*args)  # the lock went with the interrupted run
    assert again.exit_code == 0, again.output
    assert all((out / name).is_file() for name in results)
    assert all(path.is_file() for path in theirs) and not (out / lock.LOCK_FILE).exists()
