"""Checkpoints: a stopped or killed run resumes to results identical to an uninterrupted one."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from conftest import SENTENCES
from test_cli import assert_one_line_error, run

from attnprobe.analysis import analyze_loaded
from attnprobe.corpus import read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model
from attnprobe.resume import Checkpointing, Stopped


@pytest.fixture(scope="module")
def tagged_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "c.txt"
    path.write_text("# category: a\n" + "\n".join(SENTENCES[:4]) + "\n# category: b\n" + "\n".join(SENTENCES[4:]),
                    encoding="utf-8")
    return path


def test_a_stopped_run_resumes_to_identical_results(gpt2_dir, tagged_corpus):
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged_corpus)
    whole = analyze_loaded(loaded, corpus, batch_size=2, resamples=50)
    saved = []
    calls = iter(range(100))
    stopping = Checkpointing(save=saved.append, every_seconds=1e9, should_stop=lambda: next(calls) >= 1)
    with pytest.raises(Stopped, match="stopped after 2 of 4 batches"):
        analyze_loaded(loaded, corpus, batch_size=2, resamples=50, checkpointing=stopping)
    assert len(saved) == 1 and saved[0].batches_done == 2
    resumed = analyze_loaded(loaded, corpus, batch_size=2, resamples=50,
                             checkpointing=Checkpointing(save=saved.append, resume_from=saved[0]))
    pd.testing.assert_frame_equal(resumed.heads, whole.heads, check_exact=True)
    pd.testing.assert_frame_equal(resumed.layers, whole.layers, check_exact=True)
    pd.testing.assert_frame_equal(resumed.positions, whole.positions, check_exact=True)
    pd.testing.assert_frame_equal(resumed.categories, whole.categories, check_exact=True)
    pd.testing.assert_frame_equal(resumed.top_tokens, whole.top_tokens, check_exact=True)
    assert len(whole.top_tokens)  # the corpus has tokens seen 5 times or more
    np.testing.assert_array_equal(resumed.example["maps"], whole.example["maps"])
    assert resumed.run["summary"] == whole.run["summary"]


def test_resuming_with_other_settings_is_refused(gpt2_dir, tagged_corpus):
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged_corpus)
    saved = []
    with pytest.raises(Stopped):
        analyze_loaded(loaded, corpus, batch_size=2, resamples=50,
                       checkpointing=Checkpointing(save=saved.append, should_stop=lambda: True))
    with pytest.raises(AttnprobeError, match="made with seed = 0, this run has 3"):
        analyze_loaded(loaded, corpus, batch_size=2, resamples=50, seed=3,
                       checkpointing=Checkpointing(save=saved.append, resume_from=saved[0]))


def long_corpus(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("\n".join(SENTENCES * 25) + "\n", encoding="utf-8")  # 200 sentences, 200 batches
    return path


def start(model, corpus, out, *extra, every="0"):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "attnprobe", "analyze", "--model", str(model), "--corpus",
                             str(corpus), "--out", str(out), "--device", "cpu", "--batch-size", "1",
                             "--resamples", "20", "--checkpoint-every", every, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_killed_or_interrupted_process_resumes_to_identical_results(gpt2_dir, tmp_path, how):
    corpus = long_corpus(tmp_path)
    reference = start(gpt2_dir, corpus, tmp_path / "whole", every="300")
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    out = tmp_path / "cut"
    process = start(gpt2_dir, corpus, out)
    wait_for(out / "checkpoint.npz", process)
    process.send_signal(signal.SIGKILL if how == "kill" else signal.SIGINT)
    code = process.wait(timeout=120)
    if how == "interrupt":
        assert code == 130
        assert "Continue with the same command and --resume" in process.stderr.read()
    assert not (out / "heads.csv").exists() and (out / "checkpoint.npz").exists()
    resumed = start(gpt2_dir, corpus, out, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert not (out / "checkpoint.npz").exists()  # the run is complete
    for name in ("heads.csv", "layers.csv", "positions.csv", "top_tokens.csv", "examples.npz"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_resume_without_a_checkpoint_is_one_line(gpt2_dir, corpus_file, tmp_path):
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path, "--resume")
    assert_one_line_error(result, "no checkpoint.npz", "without --resume")
