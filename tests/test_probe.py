"""Synthetic probes, checked on a tiny GPT-2 with a planted previous-token head (0.0)."""

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from attnprobe.analysis import analyze
from attnprobe.classify import classify
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model
from attnprobe.probe import chance, probe, special_frame, targets

runner = CliRunner()


@pytest.fixture(scope="module")
def planted(planted_dir):
    return load_model(str(planted_dir), "cpu")


def test_targets_of_each_kind():
    queries, keys = targets("induction", offset=1, length=3)  # [CLS] a b c a b c
    assert queries.tolist() == [4, 5, 6] and keys.tolist() == [2, 3, 4]
    queries, keys = targets("duplicate", offset=0, length=3)
    assert queries.tolist() == [3, 4, 5] and keys.tolist() == [0, 1, 2]
    queries, keys = targets("previous", offset=0, length=3)
    assert queries.tolist() == [1, 2, 3, 4, 5] and keys.tolist() == [0, 1, 2, 3, 4]
    assert chance("duplicate", 0, 2, total=4, causal=True) == pytest.approx((1 / 3 + 1 / 4) / 2)
    assert chance("duplicate", 0, 2, total=4, causal=False) == pytest.approx(1 / 4)


def test_planted_previous_token_head_tops_the_previous_probe(planted):
    result = probe(planted, lengths=(4, 8), sequences=6, resamples=200)
    scores = result.scores.set_index(["layer", "head"])
    assert scores.loc[(0, 0), "previous"] > 0.99
    assert scores.loc[(0, 0), "induction"] < 0.01 and scores.loc[(0, 0), "duplicate"] < 0.01
    others = scores.drop(index=(0, 0))
    # uniform heads score exactly the uniform chance level
    np.testing.assert_allclose(others["previous"], result.info["chance"]["previous"], atol=1e-5)
    np.testing.assert_allclose(others["induction"], result.info["chance"]["induction"], atol=1e-5)
    assert (result.scores["previous_ci_low"] <= result.scores["previous"] + 1e-9).all()


def test_probe_is_seeded(planted):
    a = probe(planted, kinds=("induction",), lengths=(5,), sequences=4, seed=3, resamples=50)
    b = probe(planted, kinds=("induction",), lengths=(5,), sequences=4, seed=3, resamples=50)
    pd.testing.assert_frame_equal(a.scores, b.scores)
    assert list(a.scores.columns) == ["layer", "head", "induction", "induction_ci_low", "induction_ci_high",
                                      "induction_above_chance"]


def test_planted_head_is_previous_in_analyze_and_extended_classification(planted_dir, corpus_file):
    result = analyze(str(planted_dir), str(corpus_file), device="cpu", resamples=100)
    head = result.heads.query("layer == 0 and head == 0").iloc[0]
    assert head["previous_token"] > 0.99 and head["self"] < 0.01
    types = classify(result.heads, scheme="extended").set_index(["layer", "head"])["head_type"]
    assert types[(0, 0)] == "previous"
    assert (types.drop(index=(0, 0)) != "previous").all()


def test_special_frame_finds_what_the_tokenizer_adds(planted, minilm):
    assert special_frame(planted) == ([], [])
    tok = minilm.tokenizer
    assert special_frame(minilm) == ([tok.cls_token_id], [tok.sep_token_id])


def test_encoder_probe_skips_the_special_tokens(minilm):
    result = probe(minilm, kinds=("duplicate",), lengths=(6,), sequences=2, resamples=20)
    assert result.info["special_prefix"] == [minilm.tokenizer.cls_token_id]
    assert len(result.scores) == 6 * 12


def test_too_long_for_the_model(planted):
    with pytest.raises(AttnprobeError, match="longer than the model's 32: use lengths up to 16"):
        probe(planted, lengths=(20,))


def test_probe_command_writes_scores_and_heatmap(planted_dir, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["probe", "--model", str(planted_dir), "--out", str(out), "--lengths", "4,6",
                                 "--sequences", "4", "--resamples", "50", "--kind", "previous", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "Top previous heads" in result.stdout and "L0H0" in result.stdout  # heads named L{layer}H{head}
    scores = pd.read_csv(out / "probe.csv")
    assert scores.loc[scores["previous"].idxmax(), ["layer", "head"]].tolist() == [0, 0]
    info = json.loads((out / "probe.json").read_text())
    assert info["lengths"] == [4, 6] and info["kinds"] == ["previous"] and info["model"]["spec"] == str(planted_dir)
    assert (out / "probe_heatmap.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--lengths", "a,b"], "--lengths 'a,b'"),
    (["--lengths", "1"], "every length must be 2 or more"),
    (["--sequences", "0"], "--sequences 0"),
    (["--lengths", "40"], "longer than the model's 32"),
])
def test_probe_bad_options(planted_dir, tmp_path, args, message):
    out = tmp_path / "out"
    result = runner.invoke(app, ["probe", "--model", str(planted_dir), "--out", str(out), *args])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert not out.exists()
