"""Defects found in review of blocked attention, torchrun and the kv scheme, each with its test."""

import json

import numpy as np
import pytest
import torch
from conftest import SENTENCES, make_llama
from test_blocked import corpus_of
from test_cli import assert_one_line_error, run

from attnprobe import kernel
from attnprobe.analysis import analyze_loaded
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model, resolve_device
from attnprobe.planning import Options


def test_bfloat16_blocked_stays_as_close_to_eager_in_every_layer(llama_dir):
    """Scores are scaled in the model's dtype, as eager does: the gap must not grow with depth."""
    loaded = load_model(str(make_llama(llama_dir.parent / "deep", layers=6)), "cpu", dtype="bfloat16")
    runs = {a: analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=4, resamples=5, keep_per_sentence=True,
                              options=Options(attention=a)).per_sentence for a in ("blocked", "eager")}
    gap = (runs["blocked"]["entropy"] - runs["eager"]["entropy"]).abs().groupby(runs["eager"]["layer"]).max()
    assert gap.max() < 3e-3, gap.to_dict()  # 0.019 nats by the last layer when scaled in float32


def test_a_causal_architecture_asking_for_a_bidirectional_mask_is_not_called_causal(tmp_path, corpus_file):
    folder = make_llama(tmp_path / "bidi")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    loaded = load_model(str(folder), "cpu")
    assert loaded.causal is False  # the eager path then uses every key, as the model does
    assert kernel.unsupported(loaded) is None  # the mask it asks for is bidirectional: blocked reads it so
    assert kernel.discover(loaded).features[0].causal is False


def test_torchrun_ranks_get_their_own_gpu(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and chosen == [1]
    with pytest.raises(AttnprobeError, match="has 2 GPU"):
        resolve_device("cuda:5")


def test_a_left_padded_mask_is_refused():
    q = torch.zeros(1, 2, 3, 4)
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=1, window=1, bins=2, budget_bytes=2**20,
                        block_rows=None, example=None, on_layer=lambda *_: None)
    with pytest.raises(AttnprobeError, match="right-padded"):
        kernel.attend(q, q, q, torch.tensor([[False, True, True]]), None, True, info)


def test_run_json_with_a_null_setting_is_one_line(llama_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(SENTENCES), encoding="utf-8")
    out = tmp_path / "out"
    assert run("analyze", "--model", llama_dir, "--corpus", doc, "--split", "file", "--out", out, "--device", "cpu",
               "--resamples", "5", "--window", "4", "--sink-tokens", "1").exit_code == 0
    info = json.loads((out / "run.json").read_text())
    info["model"]["kv_heads"] = None
    (out / "run.json").write_text(json.dumps(info))
    assert_one_line_error(run("classify", "--out", out, "--scheme", "kv"), "not a whole number")
    assert np.isfinite(json.loads((out / "run.json").read_text())["longest_sequence"])
