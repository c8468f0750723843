"""The command line, driven with CliRunner: the happy path and every bad input."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from attnprobe.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory, gpt2_dir):
    """One analyze -> classify -> plot run, shared by the read-only checks below."""
    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    corpus.write_text("The cat sat on the mat.\nRain fell.\nBirds sing.\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("out") / "results"
    analyzed = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu")
    classified = run("classify", "--out", out)
    plotted = run("plot", "--out", out)
    return out, analyzed, classified, plotted


def test_analyze_writes_every_file(results, gpt2_dir):
    out, analyzed, _, _ = results
    assert analyzed.exit_code == 0, analyzed.output
    heads = pd.read_csv(out / "heads.csv")
    scores = ["entropy", "entropy_norm", "diagonal", "first_token", "previous_token", "self", "distance",
              "diagonal_excess", "sink_window", "entropy_unforced", "diagonal_unforced", "first_token_unforced",
              "punctuation", "duplicate_token",
              *(f"{name}_vw" for name in ("entropy", "entropy_norm", "diagonal", "first_token", "previous_token",
                                          "self", "distance", "sink_window", "entropy_unforced", "diagonal_unforced",
                                          "first_token_unforced")), "output_norm"]
    intervals = [f"{name}_ci_{side}" for name in scores for side in ("low", "high")]
    assert list(heads.columns) == ["layer", "head", *scores, "entropy_std", "sentences", *intervals]
    assert (heads["entropy_ci_low"] <= heads["entropy"] + 1e-9).all()
    assert (heads["entropy"] <= heads["entropy_ci_high"] + 1e-9).all()
    assert not (out / "categories.csv").exists()  # the corpus is not tagged
    assert len(heads) == 3 * 4 and heads["layer"].max() == 2 and heads["head"].max() == 3
    assert heads["entropy"].between(0, math.log(7) + 1e-5).all()
    layers = pd.read_csv(out / "layers.csv")
    assert layers["entropy"].tolist() == pytest.approx(heads.groupby("layer")["entropy"].mean().tolist(), abs=1e-5)
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["sentences"] == 3 and run_info["tokens"] == 7 + 3 + 3
    assert run_info["model"]["source"] == str(gpt2_dir.resolve())
    assert len(run_info["corpus"]["sha256"]) == 64
    assert run_info["batch_size"] == 8 and run_info["device"] == "cpu"
    assert run_info["distributed"] == {"world_size": 1, "sentences_per_rank": [3]}  # one process, every sentence
    assert "early - late" in analyzed.stdout and "95% interval" in analyzed.stdout
    assert run_info["bootstrap"] | {"block_rule": ""} == {  # 3 sentences: blocks of round(n^(1/3)) query rows
        "resamples": 1000, "seed": 0, "confidence": 0.95, "over": "query rows, in blocks within each sequence",
        "method": "block", "sequence_rows": [7, 3, 3], "block_lengths": [2, 1, 1], "block_rule": ""}
    low, high = run_info["summary"]["difference_ci"]
    assert low <= run_info["summary"]["difference"] <= high
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_resamples_file_gives_the_intervals(results):
    """resamples.npz holds what the intervals were computed from: its percentiles are heads.csv's bounds."""
    from attnprobe import io

    out = results[0]
    heads = pd.read_csv(out / "heads.csv")
    resampled = io.read_resamples(out)
    raw = {"entropy", "entropy_norm", "diagonal", "first_token", "previous_token", "self", "distance",
           "diagonal_excess", "sink_window", "entropy_unforced", "diagonal_unforced", "first_token_unforced"}
    assert set(resampled) == raw | {f"{name}_vw" for name in raw - {"diagonal_excess"}} | {"output_norm"} | {
        "punctuation", "duplicate_token"}
    assert resampled["entropy"].shape == (1000, 3, 4) and resampled["entropy"].dtype == np.float32
    examples = io.read_examples(out)  # examples.npz: the plot's example first, then others (report.html)
    assert 1 <= len(examples) <= 3 and examples[0]["sentence"] == "The cat sat on the mat."
    low, high = np.nanpercentile(resampled["entropy"].astype(np.float64), [2.5, 97.5], axis=0)
    assert low.ravel() == pytest.approx(heads["entropy_ci_low"].to_numpy(), abs=1e-6)
    assert high.ravel() == pytest.approx(heads["entropy_ci_high"].to_numpy(), abs=1e-6)


def test_classify_writes_types_and_prints_counts(results):
    out, _, classified, _ = results
    assert classified.exit_code == 0, classified.output
    types = pd.read_csv(out / "head_types.csv")
    assert list(types.columns) == ["layer", "head", "head_type", "diagonal_unforced", "entropy_unforced",
                                   "entropy_norm"]
    assert set(types["head_type"]) <= {"local", "copy", "broad", "mixed"}
    assert len(types) == 12
    assert "Head types per layer" in classified.stdout


def test_plot_writes_four_pngs(results):
    out, _, _, plotted = results
    assert plotted.exit_code == 0, plotted.output
    for name in ("entropy_heatmap.png", "layer_gradient.png", "head_patterns.png", "position_profile.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_classify_thresholds_from_the_command_line(results, tmp_path):
    out = results[0]
    result = run("classify", "--out", out, "--local-min-diagonal", "0", "--copy-max-entropy", "0")
    assert result.exit_code == 0
    assert set(pd.read_csv(out / "head_types.csv")["head_type"]) == {"local"}
    run("classify", "--out", out)  # restore the default labels for other tests


@pytest.mark.parametrize("command", [[], ["analyze"], ["classify"], ["plot"]])
def test_every_command_has_help(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "Usage:" in result.stdout


def test_python_dash_m_and_version():
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.startswith("attnprobe ")


# ---- bad input: one line, non-zero exit, nothing written --------------------------------------

@pytest.fixture()
def out(tmp_path):
    return tmp_path / "out"


def analyze_with(model, corpus, out, *extra):
    return run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu", *extra)


def test_missing_corpus(gpt2_dir, tmp_path, out):
    assert_one_line_error(analyze_with(gpt2_dir, tmp_path / "nope.txt", out), "not found", "nope.txt")
    assert not out.exists()


def test_empty_corpus(gpt2_dir, tmp_path, out):
    corpus = tmp_path / "empty.txt"
    corpus.write_bytes(b"")
    assert_one_line_error(analyze_with(gpt2_dir, corpus, out), "empty")
    assert not out.exists()


def test_corpus_of_only_comments_and_blanks(gpt2_dir, tmp_path, out):
    corpus = tmp_path / "comments.txt"
    corpus.write_text("# nothing here\n\n   \n# category: svo\n", encoding="utf-8")
    assert_one_line_error(analyze_with(gpt2_dir, corpus, out), "no sentences")
    assert not out.exists()


def test_non_utf8_corpus_names_the_line(gpt2_dir, tmp_path, out):
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("The cat sat.\nA caf\u00e9 opened.\n".encode("latin-1"))
    assert_one_line_error(analyze_with(gpt2_dir, corpus, out), "not UTF-8", "line 2")
    assert not out.exists()


def test_directory_as_corpus(gpt2_dir, tmp_path, out):
    assert_one_line_error(analyze_with(gpt2_dir, tmp_path, out), "is a directory")
    assert not out.exists()


def test_model_path_that_does_not_exist(corpus_file, tmp_path, out):
    assert_one_line_error(analyze_with(tmp_path / "no-model", corpus_file, out), "does not exist")
    assert not out.exists()


def test_hub_id_offline(corpus_file, out):
    result = analyze_with("surely-not-a-cached-model", corpus_file, out)
    assert_one_line_error(result, "surely-not-a-cached-model", "hub", "local folder")
    assert not out.exists()


def test_corrupt_model_config(gpt2_dir, corpus_file, tmp_path, out):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in gpt2_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "config.json").write_text('{"model_type": "gpt2", "n_layer": ', encoding="utf-8")
    assert_one_line_error(analyze_with(broken, corpus_file, out), "corrupt model config")
    assert not out.exists()


def test_folder_without_config(corpus_file, tmp_path, out):
    (tmp_path / "empty-model").mkdir()
    assert_one_line_error(analyze_with(tmp_path / "empty-model", corpus_file, out), "no config.json")


@pytest.mark.parametrize("size", ["0", "-3"])
def test_batch_size_below_one(gpt2_dir, corpus_file, out, size):
    assert_one_line_error(analyze_with(gpt2_dir, corpus_file, out, "--batch-size", size), "--batch-size", size)
    assert not out.exists()


def test_out_is_a_file(gpt2_dir, corpus_file, tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("keep me", encoding="utf-8")
    assert_one_line_error(analyze_with(gpt2_dir, corpus_file, target), "is a file")
    assert target.read_text(encoding="utf-8") == "keep me"


def test_out_cannot_be_created(gpt2_dir, corpus_file, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x", encoding="utf-8")
    assert_one_line_error(analyze_with(gpt2_dir, corpus_file, blocker / "sub"), "cannot be created")


@pytest.mark.parametrize("command, needs", [("classify", "attnprobe analyze"), ("plot", "attnprobe analyze")])
def test_classify_and_plot_without_results(tmp_path, command, needs):
    assert_one_line_error(run(command, "--out", tmp_path), "no heads.csv", needs)
    assert list(tmp_path.iterdir()) == []


def test_heads_csv_missing_columns(tmp_path):
    pd.DataFrame({"layer": [0], "head": [0], "entropy": [1.0]}).to_csv(tmp_path / "heads.csv", index=False)
    assert_one_line_error(run("classify", "--out", tmp_path), "diagonal", "entropy_norm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.csv"]


def test_bad_threshold(results):
    assert_one_line_error(run("classify", "--out", results[0], "--local-min-diagonal", "2"), "between 0 and 1")


def test_plot_refuses_head_types_from_another_run(results, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for name in ("heads.csv", "layers.csv", "example_attention.npz"):
        (out / name).write_bytes((results[0] / name).read_bytes())
    types = pd.read_csv(results[0] / "head_types.csv")
    types["entropy_unforced"] += 0.5
    types.to_csv(out / "head_types.csv", index=False)
    assert_one_line_error(run("plot", "--out", out), "head_types.csv does not match", "attnprobe classify")
    assert not list(out.glob("*.png"))


def test_plot_without_head_types_uses_default_rule(results, tmp_path):
    out = tmp_path / "fresh"
    out.mkdir()
    for name in ("heads.csv", "layers.csv", "example_attention.npz"):
        (out / name).write_bytes((results[0] / name).read_bytes())
    result = run("plot", "--out", out)
    assert result.exit_code == 0, result.output
    assert "default classification" in result.stderr
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["entropy_heatmap.png", "head_patterns.png", "layer_gradient.png"]


def test_resamples_below_one(gpt2_dir, corpus_file, out):
    assert_one_line_error(analyze_with(gpt2_dir, corpus_file, out, "--resamples", "0"), "--resamples 0")
    assert not out.exists()


def test_categories_file_comes_and_goes_with_the_tags(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    tagged = tmp_path / "tagged.txt"
    tagged.write_text("# category: a\nRain fell.\nBirds sing.\n# category: b\nThe cat sat on the mat.\n")
    assert analyze_with(gpt2_dir, tagged, out, "--resamples", "50").exit_code == 0
    cats = pd.read_csv(out / "categories.csv")
    assert sorted(set(cats["category"])) == ["a", "b"] and len(cats) == 2 * 3
    plain = tmp_path / "plain.txt"
    plain.write_text("Rain fell.\nBirds sing.\n")
    assert analyze_with(gpt2_dir, plain, out, "--resamples", "50").exit_code == 0
    assert not (out / "categories.csv").exists()


def test_classify_extended_scheme_from_the_command_line(results, tmp_path):
    out = tmp_path / "ext"
    out.mkdir()
    for name in ("heads.csv", "layers.csv", "example_attention.npz"):
        (out / name).write_bytes((results[0] / name).read_bytes())
    result = run("classify", "--out", out, "--scheme", "extended", "--local-min-diagonal", "0",
                 "--previous-min-previous-token", "0")
    assert result.exit_code == 0, result.output
    assert set(pd.read_csv(out / "head_types.csv")["head_type"]) == {"previous"}
    assert "extended scheme" in result.stdout
    assert run("plot", "--out", out).exit_code == 0


def test_classify_extended_needs_the_new_columns(tmp_path):
    pd.DataFrame({"layer": [0], "head": [0], "entropy": [1.0], "entropy_norm": [0.5], "diagonal": [0.3]}).to_csv(
        tmp_path / "heads.csv", index=False)
    assert_one_line_error(run("classify", "--out", tmp_path, "--scheme", "extended"), "first_token", "previous_token")
