"""Fixes after the third review: categories skip undefined scores, an explicit `untagged` category,
files of a folder that held no run are left alone, a waiting checkpoint is not overwritten, and
runs split differently are not paired."""

import json

import numpy as np
import pandas as pd
from conftest import SENTENCES
from test_cli import assert_one_line_error, run

from attnprobe import compare, io


def analyze(model, corpus, out, *extra):
    result = run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", "50", *extra)
    assert result.exit_code == 0, result.output
    return result


def test_a_one_token_sentence_leaves_its_category_s_normalized_entropy_defined(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(f"# category: a\n{SENTENCES[0]}\nRain\n{SENTENCES[2]}\n# category: b\n{SENTENCES[1]}\n",
                      encoding="utf-8")  # "Rain" is one token: no entropy_norm
    analyze(gpt2_dir, corpus, tmp_path / "out")
    cats = pd.read_csv(tmp_path / "out" / "categories.csv")
    a = cats[cats["category"] == "a"]
    assert a[["entropy_norm", "entropy_norm_ci_low", "entropy_norm_ci_high"]].notna().all().all()
    assert (a["sentences"] == 3).all()


def test_an_explicit_untagged_category_is_one_category(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(f"{SENTENCES[0]}\n# category: untagged\n{SENTENCES[2]}\n# category: b\n{SENTENCES[1]}\n",
                      encoding="utf-8")
    out = tmp_path / "out"
    analyze(gpt2_dir, corpus, out)
    cats = pd.read_csv(out / "categories.csv")
    assert not cats.duplicated(["category", "layer"]).any()
    assert cats.groupby("category")["sentences"].first().to_dict() == {"untagged": 2, "b": 1}
    assert run("plot", "--out", out).exit_code == 0


def test_a_folder_without_a_run_keeps_its_files(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("report.html", "layer_gradient.pdf", "checkpoint_epoch3.npz"):
        (out / name).write_text("mine", encoding="utf-8")
    result = analyze(gpt2_dir, corpus_file, out)
    assert all((out / name).read_text() == "mine" for name in ("report.html", "layer_gradient.pdf",
                                                               "checkpoint_epoch3.npz"))
    assert "removed" not in result.stderr
    assert io.checkpoint_files(out) == []  # not a checkpoint of ours


def test_a_waiting_checkpoint_is_not_overwritten(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.npz").write_bytes(b"progress")
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu")
    assert_one_line_error(result, "holds a stopped run", "--resume")
    assert (out / "checkpoint.npz").read_bytes() == b"progress"


def test_runs_split_differently_are_not_paired(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("A cat.\n# note\n\nRain fell.\n\nBirds sing.\n", encoding="utf-8")  # 3 sequences either way
    analyze(gpt2_dir, corpus, tmp_path / "lines")
    analyze(gpt2_dir, corpus, tmp_path / "paragraphs", "--split", "paragraphs")
    assert json.loads((tmp_path / "lines" / "run.json").read_text())["corpus"]["split"] == "lines"
    result = compare.compare(tmp_path / "lines", tmp_path / "paragraphs")
    assert result.info["pairing"] == "unpaired" and "split by lines vs paragraphs" in result.info["pairing_reason"]
    assert any("only 3 sequences" in note for note in result.info["notes"])
    assert np.isfinite(result.heads["entropy_diff"]).all()
