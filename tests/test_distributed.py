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
    for name in ("heads.csv", "layers.csv", "positions.csv", "categories.csv"):
        one, other = pd.read_csv(tmp_path / "one" / name), pd.read_csv(tmp_path / "two" / name)
        assert list(one.columns) == list(other.columns)
        numbers = one.select_dtypes("number").columns
        assert (one[numbers].isna() == other[numbers].isna()).all().all(), name
        np.testing.assert_allclose(other[numbers], one[numbers], atol=1e-6, rtol=1e-6, err_msg=name)
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["distributed"] == {"world_size": 2, "sentences_per_rank": [4, 4]}
    assert run["sentences"] == len(SENTENCES)
    maps = [np.load(tmp_path / d / "example_attention.npz")["maps"] for d in ("one", "two")]
    np.testing.assert_allclose(maps[1], maps[0], atol=1e-6)
