"""torchrun: two processes (gloo on CPU) give the single-process results, intervals included."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import SENTENCES

from attnprobe import distributed
from attnprobe.errors import AttnprobeError


def test_a_strided_shard_covers_every_sentence_once():
    worlds = [distributed.World(rank=r, size=3) for r in range(3)]
    shards = [w.shard(10) for w in worlds]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert worlds[0].counts(10) == [4, 3, 3]
    assert distributed.World().shard(4) == [0, 1, 2, 3] and distributed.World().is_main


def test_the_world_comes_from_torchrun_s_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.current() == distributed.World(rank=2, size=4, local_rank=0)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(AttnprobeError, match="RANK 4 is outside WORLD_SIZE 4"):
        distributed.current()


def analyze(command, model, corpus, out):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    args = ["analyze", "--model", str(model), "--corpus", str(corpus), "--out", str(out), "--device", "cpu",
            "--resamples", "200", "--batch-size", "3"]
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_processes_equal_one(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("# category: a\n" + "\n".join(SENTENCES[:5]) + "\n# category: b\n" + "\n".join(SENTENCES[5:]),
                      encoding="utf-8")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "attnprobe"]
    two = analyze(torchrun, gpt2_dir, corpus, tmp_path / "two")
    analyze([sys.executable, "-m", "attnprobe"], gpt2_dir, corpus, tmp_path / "one")
    assert two.stdout.count("Wrote") == 1  # rank 0 alone writes and prints
    for name in ("heads.csv", "layers.csv", "positions.csv", "categories.csv", "top_tokens.csv"):
        one, other = pd.read_csv(tmp_path / "one" / name), pd.read_csv(tmp_path / "two" / name)
        assert list(one.columns) == list(other.columns)
        numbers = one.select_dtypes("number").columns
        assert (one[numbers].isna() == other[numbers].isna()).all().all(), name
        np.testing.assert_allclose(other[numbers], one[numbers], atol=1e-5, rtol=1e-5, err_msg=name)
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["distributed"] == {"world_size": 2, "sentences_per_rank": [4, 4]}
    assert run["sentences"] == len(SENTENCES)
    maps = [np.load(tmp_path / d / "example_attention.npz")["maps"] for d in ("one", "two")]
    np.testing.assert_allclose(maps[1], maps[0], atol=1e-5)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "attnprobe"]


def test_two_processes_write_the_per_sentence_rows_of_one(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("# category: a\n" + "\n".join(SENTENCES) + "\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for command, out in ((TORCHRUN, "two"), ([sys.executable, "-m", "attnprobe"], "one")):
        done = subprocess.run([*command, "analyze", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out",
                               str(tmp_path / out), "--device", "cpu", "--resamples", "20", "--batch-size", "3",
                               "--per-sentence"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    from attnprobe.io import read_sentences

    tables = [read_sentences(tmp_path / out).read().to_pandas().sort_values(["sentence", "layer", "head"])
              .reset_index(drop=True) for out in ("one", "two")]
    assert len(tables[1]) == len(SENTENCES) * 3 * 4
    pd.testing.assert_frame_equal(tables[1], tables[0], atol=1e-5)
    assert not list((tmp_path / "two").glob(".*part")) and not list((tmp_path / "two").glob(".*tmp"))


def test_a_killed_torchrun_run_resumes_to_identical_results(gpt2_dir, tmp_path):
    import signal
    import time

    corpus = tmp_path / "long.txt"
    corpus.write_text("\n".join(SENTENCES * 25) + "\n", encoding="utf-8")  # 200 sentences: 100 batches a rank
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def start(out, *extra, every="0"):
        return subprocess.Popen([*TORCHRUN, "analyze", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out",
                                 str(out), "--device", "cpu", "--batch-size", "1", "--resamples", "20",
                                 "--checkpoint-every", every, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    whole = start(tmp_path / "whole", every="300")
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    out = tmp_path / "cut"
    process = start(out)
    deadline = time.monotonic() + 120
    while not all((out / f"checkpoint-rank{r}-of-2.npz").exists() for r in range(2)):
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint of both ranks"
        time.sleep(0.02)
    for pid in [*children(process.pid), process.pid]:  # both ranks and torchrun, as a lost machine would
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert not (out / "heads.csv").exists()
    resumed = start(out, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert not list(out.glob("checkpoint*.npz"))  # the run is complete
    for name in ("heads.csv", "layers.csv", "positions.csv", "examples.npz"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    one = subprocess.run([sys.executable, "-m", "attnprobe", "analyze", "--model", str(gpt2_dir), "--corpus",
                          str(corpus), "--out", str(out), "--resume"], env=env, capture_output=True, text=True)
    assert one.returncode == 1 and "no checkpoint.npz" in one.stderr  # the checkpoints are gone now


def children(pid):
    """The processes whose parent is `pid` (torchrun's workers run in a process group of their own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found
