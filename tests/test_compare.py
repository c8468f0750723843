"""`attnprobe compare`: a run against itself is 0, a planted change is found, paired vs unpaired, shapes, bad input."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import SENTENCES, make_llama, unstamp
from test_cli import assert_one_line_error, run

RESAMPLES = "200"  # enough for intervals, quick


def analyze(model, corpus, out, *extra):
    result = run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", RESAMPLES, *extra)
    assert result.exit_code == 0, result.output
    return out


def zero_query_head(source, folder, layer: int, head: int):
    """A copy of a saved tiny GPT-2 whose head (layer, head) has zero query weights: uniform attention there."""
    import torch
    from transformers import GPT2Model

    shutil.copytree(source, folder)
    model = GPT2Model.from_pretrained(source)
    head_dim = model.config.n_embd // model.config.n_head
    with torch.no_grad():
        attn = model.h[layer].attn.c_attn  # weight [embd, 3*embd]: Q, K, V columns, head by head
        attn.weight[:, head * head_dim : (head + 1) * head_dim] = 0.0
        attn.bias[head * head_dim : (head + 1) * head_dim] = 0.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gpt2_dir):
    """Folders written by analyze (+ classify): A, A again with another seed, B with L0H1 made uniform, A on
    another corpus, and a Llama of another shape."""
    root = tmp_path_factory.mktemp("compare")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES + SENTENCES[:2]) + "\n", encoding="utf-8")  # 10: the Poisson bootstrap
    other = root / "other.txt"
    other.write_text("\n".join(reversed(SENTENCES[:6])) + "\n", encoding="utf-8")
    planted = zero_query_head(gpt2_dir, root / "planted_model", layer=0, head=1)
    llama = make_llama(root / "llama_model", layers=2, heads=4, kv_heads=2)
    folders = {
        "a": analyze(gpt2_dir, corpus, root / "a"),
        "seed1": analyze(gpt2_dir, corpus, root / "seed1", "--seed", "1"),
        "planted": analyze(planted, corpus, root / "planted"),
        "other_corpus": analyze(gpt2_dir, other, root / "other_corpus"),
        "llama": analyze(llama, corpus, root / "llama"),
    }
    for name in ("a", "planted", "llama"):
        assert run("classify", "--out", folders[name]).exit_code == 0
    return folders


def read(out):
    heads = pd.read_csv(out / "compare_heads.csv") if (out / "compare_heads.csv").exists() else None
    return heads, pd.read_csv(out / "compare_layers.csv"), json.loads((out / "compare.json").read_text())


def test_a_run_against_itself_is_zero_with_zero_width(runs):
    result = run("compare", runs["a"], runs["a"])
    assert result.exit_code == 0, result.output
    out = runs["a"] / "compare"  # the default --out: OUT_B/compare
    heads, layers, info = read(out)
    assert info["pairing"] == "paired" and info["same_shape"]
    for frame in (heads, layers):
        diffs = frame.filter(regex="_diff(_ci_low|_ci_high)?$")
        values = diffs.to_numpy(dtype=float)
        assert np.isfinite(values).any()
        assert np.all(values[np.isfinite(values)] == 0.0)
    assert len(heads) == 3 * 4 and {"layer", "head", "head_type_a", "head_type_b"} <= set(heads.columns)
    assert (heads["head_type_a"] == heads["head_type_b"]).all()
    assert info["overall"]["entropy"]["diff"] == 0.0 and info["overall"]["entropy"]["ci"] == [0.0, 0.0]
    assert info["top"] == [] and info["changed"]["entropy"] == 0
    assert "No head's entropy changed" in result.stdout and "paired: same corpus" in result.stdout
    assert (out / "compare.png").stat().st_size > 0 and (out / "compare_types.csv").exists()
    assert not list(out.glob(".*.tmp"))


def test_a_planted_change_is_found_paired(runs):
    out = runs["planted"].parent / "planted_vs_a"
    result = run("compare", runs["a"], runs["planted"], "--out", out)
    assert result.exit_code == 0, result.output
    heads, layers, info = read(out)
    assert info["pairing"] == "paired" and "same corpus" in info["pairing_reason"]
    row = heads.set_index(["layer", "head"]).loc[(0, 1)]
    assert row["entropy_diff"] > 0.1 and row["entropy_diff_ci_low"] > 0  # uniform attention is more diffuse
    layer0 = heads[(heads["layer"] == 0) & (heads["head"] != 1)]
    assert np.allclose(layer0["entropy_diff"], 0.0, atol=1e-5)  # layer 0's other heads read the same input
    assert info["top"][0]["name"] == "L0H1" and info["top"][0]["ci"][0] > 0
    first_row = next(line for line in result.stdout.splitlines() if "L" in line and "H" in line and "│" in line)
    assert "L0H1" in first_row
    assert layers.loc[0, "entropy_diff_ci_low"] > 0  # and layer 0's mean rises with it
    assert {"entropy_vw", "first_token_vw", "output_norm"} <= set(info["scores"])  # the value-weighted ones too
    assert abs(row["output_norm_diff"]) > 1e-3 and np.allclose(layer0["output_norm_diff"], 0.0, atol=1e-4)
    assert "models differ" in info["matching"]  # another folder: matched by position, said so
    assert isinstance(info["type_changes"], list)
    assert (out / "compare.png").stat().st_size > 0


def test_paired_or_unpaired_follows_corpus_and_seed(runs):
    out = runs["a"].parent / "cmp_other"
    result = run("compare", runs["a"], runs["other_corpus"], "--out", out)
    assert result.exit_code == 0, result.output
    info = read(out)[2]
    assert info["pairing"] == "unpaired" and "corpora differ" in info["pairing_reason"]
    assert info["unpaired_seed"] == 0 and "unpaired:" in result.stdout
    seeded = run("compare", runs["a"], runs["seed1"], "--out", out)
    assert seeded.exit_code == 0, seeded.output
    info = read(out)[2]
    assert info["pairing"] == "unpaired" and "seeds differ (0 vs 1)" in info["pairing_reason"]
    forced = run("compare", runs["a"], runs["a"], "--unpaired", "--out", out)
    assert forced.exit_code == 0, forced.output
    heads, _, info = read(out)
    assert info["pairing"] == "unpaired" and "--unpaired" in info["pairing_reason"]
    assert (heads["entropy_diff"] == 0).all()  # the same values ...
    assert (heads["entropy_diff_ci_low"] <= 0).all() and (heads["entropy_diff_ci_high"] >= 0).all()
    assert (heads["entropy_diff_ci_high"] - heads["entropy_diff_ci_low"] > 0).any()  # ... independent draws: wider


def test_different_shapes_compare_by_depth_and_types(runs):
    out = runs["a"].parent / "cmp_shapes"
    same = run("compare", runs["a"], runs["planted"], "--out", out)  # leaves a compare_heads.csv ...
    assert same.exit_code == 0 and (out / "compare_heads.csv").exists()
    result = run("compare", runs["a"], runs["llama"], "--out", out)
    assert result.exit_code == 0, result.output
    heads, layers, info = read(out)
    assert heads is None  # ... which a comparison of different shapes removes
    assert not info["same_shape"] and "cannot be matched one to one" in info["matching"]
    assert "cannot be matched one to one" in result.stdout
    assert info["pairing"] == "paired"  # the same sentences and bootstrap: pairing is over sentences, not heads
    assert layers["depth"].tolist() == [0.0, 0.5, 1.0] and "layer" not in layers.columns  # GPT-2's 3 layers
    a_layers = pd.read_csv(runs["a"] / "layers.csv")
    assert layers["entropy_a"].to_numpy() == pytest.approx(a_layers["entropy"].to_numpy(), abs=1e-6)
    b_layers = pd.read_csv(runs["llama"] / "layers.csv")["entropy"].to_numpy()  # 2 layers: depths 0 and 1
    assert layers["entropy_b"].to_numpy() == pytest.approx([b_layers[0], b_layers.mean(), b_layers[1]], abs=1e-6)
    types = pd.read_csv(out / "compare_types.csv")
    assert types["fraction_a"].sum() == pytest.approx(1.0) and types["count_b"].sum() == 2 * 4
    assert info["top"] and all("depth" in row for row in info["top"])


def test_comparison_data_is_plain_and_reads_back(runs):
    from attnprobe.compare import compare, comparison_data, load_comparison

    comparison = compare(runs["a"], runs["planted"])
    data = comparison_data(comparison)
    json.dumps(data, allow_nan=False)  # plain: no NaN, no numpy types
    assert data["info"]["top"][0]["name"] == "L0H1" and len(data["heads"]) == 12
    out = runs["a"].parent / "cmp_read"
    assert run("compare", runs["a"], runs["planted"], "--out", out).exit_code == 0
    loaded = load_comparison(out)
    assert loaded.info["pairing"] == "paired" and loaded.heads is not None
    assert loaded.heads["entropy_diff"].to_numpy() == pytest.approx(comparison.heads["entropy_diff"].to_numpy())


def test_interpolation_and_draws():
    from attnprobe.compare import interpolate

    assert interpolate(np.array([0.0, 1.0]), 3).tolist() == [0.0, 0.5, 1.0]
    values = np.array([[1.0, np.nan, 3.0]])  # [draw, layer]
    assert interpolate(values, 3) is values  # as many layers as points: untouched
    assert interpolate(np.array([2.0]), 4).tolist() == [2.0] * 4  # one layer: a constant
    assert interpolate(np.array([0.0, 6.0, 3.0]), 5).tolist() == [0.0, 3.0, 6.0, 4.5, 3.0]


def copy_without(source, target, name):
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("compare"))
    (target / name).unlink()
    return target


def test_bad_inputs_get_one_line(runs, tmp_path):
    a = runs["a"]
    cases = [
        ((tmp_path / "missing", a), ["OUT_A", "does not exist", "attnprobe analyze"]),
        ((a, a / "heads.csv"), ["OUT_B", "is a file"]),
        ((copy_without(a, tmp_path / "no_heads", "heads.csv"), a), ["no heads.csv", "attnprobe analyze"]),
        ((a, copy_without(a, tmp_path / "no_run", "run.json")), ["no run.json", "attnprobe analyze"]),
        ((copy_without(a, tmp_path / "no_resamples", "resamples.npz"), a), ["no resamples.npz", "attnprobe analyze"]),
        ((a, runs["other_corpus"], "--paired"), ["--paired needs", "corpora differ", "drop --paired"]),
        ((a, runs["llama"], "--score", "nope"), ["--score 'nope'", "entropy"]),
        ((a, a, "--top", "0"), ["--top 0"]),
    ]
    stale = shutil.copytree(a, tmp_path / "stale", ignore=shutil.ignore_patterns("compare"))
    shutil.copy(runs["llama"] / "resamples.npz", stale / "resamples.npz")  # another run's resamples
    cases.append(((a, stale), ["resamples.npz", "not written by the run that wrote run.json", "attnprobe analyze"]))
    older = shutil.copytree(stale, tmp_path / "older")
    unstamp(older)  # an older run records no files: the resamples' own shape check tells them apart
    cases.append(((a, older), ["resamples.npz", "does not match run.json", "attnprobe analyze"]))
    retyped = shutil.copytree(a, tmp_path / "retyped", ignore=shutil.ignore_patterns("compare"))
    shutil.copy(runs["planted"] / "head_types.csv", retyped / "head_types.csv")  # classified from another run
    cases.append(((retyped, a), ["head_types.csv does not match heads.csv", "attnprobe classify"]))
    for args, fragments in cases:
        out = tmp_path / "never"
        result = run("compare", *args, "--out", out)
        assert_one_line_error(result, *fragments)
        assert not out.exists()


def test_compare_imports_no_torch(runs, tmp_path):
    """compare reads files only: it never imports torch or transformers."""
    import subprocess
    import sys

    code = (f"import sys\nfrom attnprobe.cli import app\ntry:\n    app(['compare', {str(runs['a'])!r}, "
            f"{str(runs['planted'])!r}, '--out', {str(tmp_path / 'c')!r}], standalone_mode=False)\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "c" / "compare.json").exists()


def test_a_comparison_joins_the_report_of_its_folder(runs, tmp_path):
    import shutil

    b = tmp_path / "planted"
    shutil.copytree(runs["planted"], b)
    shutil.rmtree(b / "compare", ignore_errors=True)
    assert run("report", "--out", b).exit_code == 0
    assert "Comparison (compare)" not in (b / "report.html").read_text(encoding="utf-8")
    result = run("compare", runs["a"], b)  # into the default b/compare: b's report gains the section
    assert result.exit_code == 0, result.output
    page = (b / "report.html").read_text(encoding="utf-8")
    assert "Comparison (compare)" in page and "L0H1" in page and "paired" in page
    assert "data:image/png;base64," in page  # compare.png inline, no file reference
    assert run("report", "--out", b).exit_code == 0  # and a later report keeps it
    assert "Comparison (compare)" in (b / "report.html").read_text(encoding="utf-8")
