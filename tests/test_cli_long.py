"""Long inputs from the command line: --split, blocked attention, positions.csv, the kv scheme."""

import json

import pandas as pd
import pytest
from conftest import SENTENCES, make_gpt2
from test_cli import assert_one_line_error, run


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    """Three paragraphs, about 90 tokens as one file."""
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    paragraphs = [" ".join(SENTENCES[k : k + 3]) for k in (0, 3, 5)]
    path.write_text("\n\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def long_results(tmp_path_factory, llama_dir, document):
    out = tmp_path_factory.mktemp("out") / "long"
    analyzed = run("analyze", "--model", llama_dir, "--corpus", document, "--split", "file", "--out", out,
                   "--device", "cpu", "--sink-tokens", "1", "--window", "8", "--resamples", "20")
    classified = run("classify", "--out", out, "--scheme", "kv", "--streaming-min-sink-window", "0.5")
    plotted = run("plot", "--out", out)
    return out, analyzed, classified, plotted


def test_split_file_is_one_sequence_on_the_blocked_path(long_results):
    out, analyzed, _, _ = long_results
    assert analyzed.exit_code == 0, analyzed.output
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["sentences"] == 1 and run_info["longest_sequence"] == run_info["tokens"] > 60
    assert run_info["attention"] == {"requested": "auto", "path": "fused", "block_budget_mib": 64,
                                     "fused_layers": [0, 1], "fused_min_tokens": 512, "sequences": {"blocked": 1},
                                     "sink_tokens": 1, "window": 8, "features": {
                                         "causal": True, "query_heads_per_kv_head": 2, "sliding_window": None,
                                         "softcap": None, "attention_sinks": False, "scale": [8**-0.5]}}
    assert run_info["model"]["kv_heads"] == 2 and run_info["model"]["head_dim"] == 8
    assert run_info["distributed"] == {"world_size": 1, "sentences_per_rank": [1]}
    heads = pd.read_csv(out / "heads.csv")
    assert heads["sink_window"].between(0, 1).all()
    positions = pd.read_csv(out / "positions.csv")
    assert positions.groupby(["layer", "head"])["rows"].sum().eq(run_info["tokens"]).all()
    assert positions["bin"].max() == (run_info["tokens"] - 1).bit_length()  # bin b ends at 2^b - 1


def test_kv_scheme_writes_the_cache_estimate(long_results):
    out, _, classified, _ = long_results
    assert classified.exit_code == 0, classified.output
    types = pd.read_csv(out / "head_types.csv")
    assert list(types.columns) == ["layer", "head", "head_type", "sink_window", "kv_head", "kv_head_streaming"]
    assert set(types["head_type"]) <= {"streaming", "full-cache"}
    estimate = json.loads((out / "kv_cache.json").read_text())
    assert estimate["bytes_per_token_full"] == 2 * 2 * 8 * 2 * 4  # layers x kv heads x head_dim x (K, V) x float32
    assert estimate["assumptions"]["sink"] == 1 and estimate["assumptions"]["window"] == 8
    assert set(estimate["lengths"]) == {"longest_sequence", "32k", "128k"}
    assert "KV cache if streaming KV heads keep only 1 sink + 8 recent tokens" in classified.stdout


def test_plot_draws_the_position_profile_and_kv_types(long_results):
    out, _, _, plotted = long_results
    assert plotted.exit_code == 0, plotted.output
    for name in ("position_profile.png", "head_patterns.png", "layer_gradient.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_a_later_default_classification_removes_the_kv_estimate(long_results):
    out = long_results[0]
    assert run("classify", "--out", out).exit_code == 0
    assert not (out / "kv_cache.json").exists()
    assert run("classify", "--out", out, "--scheme", "kv").exit_code == 0  # and back, for the other tests
    assert (out / "kv_cache.json").exists()


def test_split_paragraphs_gives_one_sequence_each(llama_dir, document, tmp_path):
    out = tmp_path / "para"
    result = run("analyze", "--model", llama_dir, "--corpus", document, "--split", "paragraphs", "--out", out,
                 "--device", "cpu", "--resamples", "5")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["sentences"] == 3


def test_kv_scheme_on_short_sentences_is_one_line(llama_dir, corpus_file, tmp_path):
    out = tmp_path / "short"
    assert run("analyze", "--model", llama_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
               "--resamples", "5").exit_code == 0
    assert_one_line_error(run("classify", "--out", out, "--scheme", "kv"), "sink_window is empty", "--window")


def test_kv_scheme_on_an_encoder_is_one_line(bert_dir, corpus_file, tmp_path):
    out = tmp_path / "bert"
    assert run("analyze", "--model", bert_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
               "--resamples", "5", "--window", "1", "--sink-tokens", "1").exit_code == 0
    assert_one_line_error(run("classify", "--out", out, "--scheme", "kv"), "is an encoder")


def test_a_feature_blocked_lacks_is_refused_by_blocked_and_noted_by_auto(corpus_file, tmp_path):
    folder = make_gpt2(tmp_path / "reordered")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "reorder_and_upcast_attn": True}))
    blocked = run("analyze", "--model", folder, "--corpus", corpus_file, "--out", tmp_path / "a", "--device", "cpu",
                  "--attention", "blocked")
    assert_one_line_error(blocked, "reorder_and_upcast_attn", "--attention eager")
    assert not (tmp_path / "a").exists()
    auto = run("analyze", "--model", folder, "--corpus", corpus_file, "--out", tmp_path / "b", "--device", "cpu",
               "--resamples", "5")
    assert auto.exit_code == 0, auto.output
    assert "ran on the eager path" in auto.stderr and "reorder_and_upcast_attn" in auto.stderr
    assert json.loads((tmp_path / "b" / "run.json").read_text())["attention"]["path"] == "eager"


@pytest.mark.parametrize(("option", "value", "fragment"), [
    ("--window", "0", "--window 0 is below 1"), ("--sink-tokens", "-1", "--sink-tokens -1 is negative"),
    ("--block-mib", "0", "--block-mib 0"),
])
def test_bad_long_options_are_one_line(option, value, fragment, llama_dir, corpus_file, tmp_path):
    result = run("analyze", "--model", llama_dir, "--corpus", corpus_file, "--out", tmp_path / "x", option, value)
    assert_one_line_error(result, fragment)
