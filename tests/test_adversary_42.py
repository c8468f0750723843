"""Issue 42's cases: export names that collided with export's own files, inputs whose read fails, settings the
records left out, repeated or idle options, errors that quoted another run's default, and what logs and figures say.
Each case once lost data, ended in a traceback, or said something wrong or unreadable."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from test_adversary_27 import one_error_line
from test_adversary_33_34 import write_retrieval
from typer.testing import CliRunner

from attnprobe.cli import app
from attnprobe.export import PROVENANCE_FILE


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def named_retrieval(folder, name):
    """A retrieval results folder whose model folder is called `name`."""
    write_retrieval(folder, np.arange(8).reshape(2, 4) / 8)
    record = json.loads((folder / "retrieval.json").read_text())
    record["model"] |= {"spec": f"/models/{name}", "source": f"/models/{name}"}
    (folder / "retrieval.json").write_text(json.dumps(record))
    return folder


def check_record(to):
    """attnprobe.json lists only files that are there with the sha256 it records."""
    record = json.loads((to / PROVENANCE_FILE).read_text())
    for entry in record["exports"].values():
        for name, digest in entry["files"].items():
            assert (to / name).is_file() and sha256(to / name) == digest, name
    return record


# ---- item 1: every format's files are apart from the others' and from export's record -----------------------------


def test_a_model_named_attnprobe_keeps_its_retrieval_head_scores(tmp_path):
    folder = named_retrieval(tmp_path / "r", "attnprobe")
    result = invoke("export", "--out", folder, "--format", "retrieval-head", "--to", tmp_path / "to")
    assert result.exit_code == 0, result.output
    scores = json.loads((tmp_path / "to" / "attnprobe.retrieval-head.json").read_text())
    assert scores["1-3"] == [7 / 8]
    assert set(check_record(tmp_path / "to")["exports"]) == {"retrieval-head"}


@pytest.mark.parametrize("order", [("duo-attention", "retrieval-head"), ("retrieval-head", "duo-attention")])
def test_a_model_named_config_keeps_both_formats_in_one_folder(tmp_path, order):
    folder = named_retrieval(tmp_path / "r", "Config")  # case-blind: macOS folders take Config.json for config.json
    to = tmp_path / "to"
    for fmt in order:
        result = invoke("export", "--out", folder, "--format", fmt, "--to", to)
        assert result.exit_code == 0, result.output
    assert json.loads((to / "config.json").read_text()) == {"sink_size": 4, "recent_size": 256}
    assert json.loads((to / "Config.retrieval-head.json").read_text())["0-1"] == [1 / 8]
    assert set(check_record(to)["exports"]) == {"duo-attention", "retrieval-head"}
    assert sorted(p.name for p in to.iterdir()) == sorted(["Config.retrieval-head.json", "attnprobe.json",
                                                           "config.json", "full_attention_heads.tsv"])


def test_the_record_drops_an_earlier_export_whose_file_this_one_replaces(tmp_path):
    from attnprobe.export import provenance

    to = tmp_path / "to"
    to.mkdir()
    (to / "x.json").write_text("old")
    earlier = {"exports": {"retrieval-head": {"files": {"x.json": sha256(to / "x.json")}}}}
    scores = type("S", (), {"model": {}, "results": None, "source": "kv", "secondary_name": None, "sink": 4,
                            "recent": 8, "sizes_from": "x"})()
    record = provenance(earlier, scores, "duo-attention", {"X.json": "new digest"}, to)
    assert set(record["exports"]) == {"duo-attention"}


# ---- item 2: a full disk under the results-folder lock, a haystack whose read fails --------------------------------


LINUX_ONLY = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")


@LINUX_ONLY
def test_a_full_disk_under_the_lock_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, gpt2_dir):
    import errno

    from attnprobe import lock

    real_write = os.write

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(lock.LOCK_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    out = tmp_path / "out"
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    line = one_error_line(invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out))
    assert "lock file" in line and "No space left on device" in line and "--out" in line
    assert not out.exists()  # the folder the lock made goes with its empty lock file
    out.mkdir()
    one_error_line(invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out))
    assert list(out.iterdir()) == []


def unreadable(monkeypatch, path):
    """`path` opens but cannot be read, as a file on a failing disk or one this user may not read."""
    import pathlib

    real_open = pathlib.Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refuse)


@LINUX_ONLY
@pytest.mark.parametrize("command", [["retrieval"], ["train-pattern"]])
def test_a_haystack_whose_read_fails_is_one_line(tmp_path, monkeypatch, command):
    line = one_error_line(invoke(*command, "--model", tmp_path / "m", "--haystack", "/proc/self/mem", "--out",
                                 tmp_path / "o"))
    assert line.startswith("Error: cannot read --haystack /proc/self/mem: ") and "Input/output error" in line
    text = tmp_path / "h.txt"
    text.write_text("A long text.\n", encoding="utf-8")
    unreadable(monkeypatch, text)
    line = one_error_line(invoke(*command, "--model", tmp_path / "m", "--haystack", text, "--out", tmp_path / "o"))
    assert f"cannot read --haystack {text}: Permission denied" in line


def test_a_haystack_reads_as_before(tmp_path):
    from attnprobe.retrieval import read_haystack

    path = tmp_path / "h.txt"
    for data in (b"\xef\xbb\xbfOne\r\ntwo\rthree\n\nfour", b"  x  ", b"caf\xc3\xa9\n" * 40_000):
        path.write_bytes(data)
        assert read_haystack(path) == path.read_text(encoding="utf-8")
    path.write_bytes(b"ok \xff")
    with pytest.raises(Exception, match="is not UTF-8 text \\(byte 3\\)"):
        read_haystack(path)


# ---- items 3 and 10: train_pattern.json records --bos and the whole training's wall time; a resumed run says so;
# ---- a log of short sentences is never silent for long ----------------------------------------------------------


def stopping_after(calls):
    """A stand-in for common.stop_requests: the run is asked to stop at its `calls`-th check (as by Ctrl-C)."""
    from contextlib import contextmanager

    @contextmanager
    def requests():
        count = iter(range(10_000))
        yield lambda: next(count) >= calls

    return requests


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from conftest import make_llama

    return make_llama(tmp_path_factory.mktemp("llama42"))


def test_train_pattern_records_bos_says_it_resumed_and_counts_the_whole_wall_time(llama_dir, tmp_path, monkeypatch):
    from test_train_pattern import HAYSTACK, SMALL

    from attnprobe import io
    from attnprobe.commands import train_pattern as command

    haystack = tmp_path / "hay.txt"
    haystack.write_text(HAYSTACK, encoding="utf-8")
    out = tmp_path / "out"
    args = ("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, "--steps", 4, *SMALL,
            "--bos", "never", "--checkpoint-every", 1)
    with monkeypatch.context() as patch:
        patch.setattr(command, "stop_requests", stopping_after(2))
        result = invoke(*args)
    assert result.exit_code == 130, result.output
    meta = json.loads(str(np.load(out / io.TRAINED_CHECKPOINT_FILE)["meta"]))
    assert meta["done"] == 3 and meta["seconds"] > 0
    result = invoke(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert f"Resuming the stopped run from {out / io.TRAINED_CHECKPOINT_FILE}: 3 of 4 steps done." in result.output
    record = json.loads((out / "train_pattern.json").read_text())
    assert record["bos"] == "never" and record["resumed_at_step"] == 3
    assert record["wall_seconds"] == pytest.approx(meta["seconds"] + record["wall_seconds_this_process"], abs=2e-3)


def test_an_older_training_checkpoint_without_seconds_resumes_and_a_bad_one_is_refused():
    from attnprobe import trainpattern as tp

    state = tp.State({"a": 1}, 1, np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32),
                     np.zeros((1, 2), np.float32), np.array([[1.0] + [0.0] * 7]), threads=1, seconds=None)
    arrays = state.to_arrays()
    assert tp.State.from_arrays(arrays).seconds is None
    for bad in (-1, "3", True, float("nan")):
        meta = json.loads(str(arrays["meta"])) | {"seconds": bad}
        with pytest.raises(ValueError, match="seconds"):
            tp.State.from_arrays(arrays | {"meta": np.array(json.dumps(meta))})


def test_analyze_says_it_resumed_and_logs_short_sentences(gpt2_dir, tmp_path, monkeypatch):
    from conftest import SENTENCES

    from attnprobe import layer_progress
    from attnprobe.commands import analyze as command

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--batch-size", 2, "--resamples", 10)
    with monkeypatch.context() as patch:
        patch.setattr(command, "stop_requests", stopping_after(1))
        assert invoke(*args).exit_code == 130
    monkeypatch.setattr(layer_progress, "LOG_EVERY_SECONDS", 0.0)  # a line at every batch: in a log, every 10 s
    result = invoke(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert f"Resuming the stopped run from {out / 'checkpoint.npz'}: " in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("analyze: ")]
    assert lines and lines[-1].startswith("analyze: 8/8 sentences ("), result.output


def test_ctrl_c_on_ablate_says_so_and_exits_130(tmp_path, monkeypatch, gpt2_dir):
    from attnprobe import ablate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ablate, "ablate_loaded", interrupted)
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    result = invoke("ablate", "--model", gpt2_dir, "--corpus", corpus, "--out", tmp_path / "o")
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1].startswith("Interrupted: stopped before the results were written")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_the_top_level_help_cuts_no_command_description():
    from attnprobe.cli import SHORT_HELP

    result = CliRunner().invoke(app, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1]
    assert "..." not in commands, commands
    for name, words in SHORT_HELP.items():
        assert f"  {name}" in commands and words in commands, name
    assert len(SHORT_HELP) == len(app.registered_commands)  # every command has its line


# ---- item 4: a repeated length or depth runs once, with a note; --no-pruning refuses the curve's options ----------


@pytest.fixture(scope="module")
def gqa_lm(tmp_path_factory):
    from conftest import make_llama

    return make_llama(tmp_path_factory.mktemp("gqa42"), layers=2, heads=4, kv_heads=2, lm_head=True)


def test_retrieval_runs_a_repeated_depth_or_length_once_with_a_note(gqa_lm, tmp_path):
    from conftest import SENTENCES

    haystack = tmp_path / "hay.txt"
    haystack.write_text(" ".join(SENTENCES * 4), encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("retrieval", "--model", gqa_lm, "--haystack", haystack, "--out", out, "--lengths", "30,30",
                    "--depths", "50,50,50,0", "--needle", " Birds sing.", "--decode", "forced", "--resamples", 20,
                    "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    info = json.loads((out / "retrieval.json").read_text())
    assert info["trials_total"] == 2 and info["depths"] == [50.0, 0.0] and info["lengths"] == [30]
    assert "Note: --depths 50,50,50,0 repeats 50: each is run once" in " ".join(result.output.split())
    assert any(note.startswith("--lengths 30,30 repeats 30") for note in info["notes"])
    assert all(len(v) == 2 for v in json.loads((out / "head_score.json").read_text()).values())


def test_ablate_needle_task_runs_a_repeated_depth_once(gqa_lm, tmp_path):
    from conftest import SENTENCES

    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(SENTENCES * 4) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("ablate", "--model", gqa_lm, "--corpus", corpus, "--out", out, "--method", "streaming",
                    "--heads", "L0H0", "--task", "needle", "--lengths", "40", "--depths", "50,50", "--sink-size", 1,
                    "--recent-size", 4, "--no-pruning", "--resamples", 10, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    run = json.loads((out / "streaming.json").read_text())
    assert run["tasks"]["needle"]["sequences"] == 1 and len(run["needle"]["trials"]) == 1
    assert any(note.startswith("--depths 50,50 repeats 50") for note in run["notes"])
    assert run["random_orders"] is None and run["shares"] == []  # no curve: nothing of one recorded
    assert "only 1 trial:" in " ".join(result.output.split())  # not "1 trials"


@pytest.mark.parametrize("option", [["--random-orders", "7"], ["--shares", "0,1"]])
def test_ablate_no_pruning_refuses_the_curves_options(gqa_lm, tmp_path, option):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    line = one_error_line(invoke("ablate", "--model", gqa_lm, "--corpus", corpus, "--out", tmp_path / "o",
                                 "--method", "streaming", "--heads", "L0H0", "--no-pruning", *option))
    assert f"{option[0]} sets the curve that --no-pruning leaves out" in line


# ---- item 5: an out-of-range size quotes this run's default, not another's ----------------------------------------


def test_export_sizes_out_of_range_quote_the_runs_own_sizes(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat and the dog sat on the rug.\n" * 3, encoding="utf-8")
    run = tmp_path / "run"
    result = invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", run, "--sink-tokens", 2, "--window",
                    3, "--resamples", 10)
    assert result.exit_code == 0, result.output
    line = one_error_line(invoke("export", "--out", run, "--to", tmp_path / "to", "--sink-size", 10**9))
    assert line.endswith("(default 2, run.json's --sink-tokens)") and "default 4" not in line
    line = one_error_line(invoke("export", "--out", run, "--to", tmp_path / "to", "--recent-size", 0))
    assert line.endswith("(default 3, run.json's --window)")
    assert not (tmp_path / "to").exists()


def test_ablate_sizes_out_of_range_quote_the_patterns_sizes(gqa_lm, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    common = ("ablate", "--model", gqa_lm, "--corpus", corpus, "--out", tmp_path / "o", "--method", "streaming")
    line = one_error_line(invoke(*common, "--pattern", tmp_path, "--sink-size", 10**9))
    assert line.endswith("(default from the --pattern)")
    line = one_error_line(invoke(*common, "--heads", "L0H0", "--sink-size", 10**9))
    assert line.endswith("(default 128)")


# ---- item 11: figures and printouts in words a reader can follow ---------------------------------------------------


def test_streaming_panels_are_titled_in_words_not_column_names():
    from test_plotting import streaming_rows

    from attnprobe import plotting

    for rows in (streaming_rows([], []), streaming_rows(["pattern"], [0.5]), streaming_rows(["pattern"], [0, 1])):
        titles = [ax.get_title() for ax in plotting.streaming_figure(rows).axes]
        assert titles[0].startswith("Loss change") and titles[1].startswith("KL from the full cache"), titles
        assert not any(word in title for title in titles for word in ("loss_change", "kl ")), titles


def test_every_cluster_band_of_a_large_similarity_matrix_is_numbered_apart():
    from test_plots_at_scale import assert_no_overlaps, synthetic

    from attnprobe import plotting

    js, layer, head, types, labelled = synthetic(32, 32)
    figure = plotting.head_similarity_figure(js, layer, head, types, labelled, "synthetic")
    listed = [t.get_text().split(":")[0] for ax in figure.axes for t in ax.texts if "JS within" in t.get_text()]
    bands = [t.get_text() for ax in figure.axes for t in ax.texts if t.get_text() in listed]
    assert len(listed) == plotting.CLUSTERS and sorted(bands) == sorted(listed)  # every cluster numbered
    assert_no_overlaps(figure)


def test_spread_keeps_the_order_and_the_gap_within_the_bounds():
    from attnprobe.plotting.related import spread

    placed = spread(np.array([0.0, 0.1, 0.2, 50.0, 99.0, 99.5]), 5.0, -0.5, 99.5)
    assert np.all(np.diff(placed) >= 5.0 - 1e-9) and placed[0] >= 2.0 and placed[-1] <= 97.0
    assert placed[3] == 50.0  # a point with room stays where it is
    assert np.array_equal(spread(np.array([10.0, 40.0]), 5.0, 0.0, 100.0), [10.0, 40.0])


def test_compare_names_two_folders_of_one_name_apart(gpt2_dir, tmp_path):
    from attnprobe.compare import apart

    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\nA dog barked.\nRain fell.\n", encoding="utf-8")
    for side in ("a", "b"):
        result = invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", tmp_path / side / "out",
                        "--resamples", 10)
        assert result.exit_code == 0, result.output
    result = invoke("compare", tmp_path / "a" / "out", tmp_path / "b" / "out")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # Rich folds lines at spaces, by the width the temporary paths leave
    assert "A = a/out (" in said and "B = b/out (" in said
    assert apart(tmp_path / "x", tmp_path / "x") == (str(tmp_path / "x"), str(tmp_path / "x"))
    assert apart(tmp_path / "p" / "q", tmp_path / "q") == ("p/q", f"{tmp_path.name}/q")


def test_forced_decodings_summary_says_what_it_counts():
    from attnprobe.commands.retrieval import copy_words

    info = {"trials_total": 10, "trials_copied": 3, "trials_scored": 10}
    forced, greedy = copy_words(info | {"decode": "forced"}), copy_words(info | {"decode": "greedy"})
    assert forced.startswith("every trial scored (the needle fed as the answer)") and "copied" not in forced
    assert "guesses matched at least 50% of the needle's tokens in 3" in forced
    assert greedy == "the needle copied (at least 50% of its tokens in the answer) in 3; 10 scored"


# ---- item 3: every setting that changes a result is in the record ---------------------------------------------------


def test_rollout_and_related_record_bos_and_dtype_and_ablate_no_pruning_no_percents(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke("rollout", "--model", gpt2_dir, "--example", "Rain fell.", "--out", out, "--bos", "never",
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    with np.load(out / "rollout.npz") as saved:
        assert str(saved["bos"]) == "never" and str(saved["dtype"]) == "float32"
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\nA dog barked.\nRain fell.\nBirds sing.\n", encoding="utf-8")
    run = tmp_path / "run"
    assert invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", run, "--resamples", 10).exit_code == 0
    result = invoke("related", "--out", run, "--sentences", 4, "--device", "cpu", "--bos", "always")
    assert result.exit_code == 0, result.output
    with np.load(run / "head_similarity.npz") as saved:
        assert str(saved["bos"]) == "always" and str(saved["dtype"]) == "float32"
    result = invoke("ablate", "--model", gpt2_dir, "--corpus", corpus, "--out", tmp_path / "ab", "--no-pruning",
                    "--resamples", 10, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "ab" / "ablate.json").read_text())["pruning_percents"] is None
