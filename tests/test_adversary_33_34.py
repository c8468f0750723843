"""Issues 33 and 34's bad-input cases of export, ablate --method streaming and retrieval: each once wrote over a file
attnprobe did not write, deleted an input, accepted a wrong value or ended in a traceback."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import SENTENCES, make_llama
from test_ablate import make_llama_lm
from test_adversary_27 import one_error_line
from typer.testing import CliRunner

from attnprobe import io
from attnprobe.cli import app
from attnprobe.export import PROVENANCE_FILE, HeadScores, break_ties, duo_attention

HAYSTACK = " ".join(SENTENCES)
NEEDLE = " Birds sing."
QUESTION = "Who wrote the letter?"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two tiny grouped-query Llamas of one shape (other weights), a long corpus, and an analyze run of the first."""
    root = tmp_path_factory.mktemp("issue33")
    first = make_llama_lm(root / "first")
    second = make_llama(root / "second", seed=7, lm_head=True)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(["The bridge was painted by two workers in the early spring of last year ."] * 10),
                      encoding="utf-8")
    paragraph = "\n".join(["The bridge was painted by two workers in the early spring of last year ."] * 7)
    long = root / "long.txt"  # three documents of ~100 tokens: streaming heads need sequences past sink + recent
    long.write_text("\n\n".join([paragraph] * 3) + "\n", encoding="utf-8")
    run = root / "run"
    result = invoke("analyze", "--model", first, "--corpus", corpus, "--out", run, "--sink-tokens", 2, "--window", 3,
                    "--resamples", 20, "--threads", 1)
    assert result.exit_code == 0, result.output
    return {"first": first, "second": second, "corpus": corpus, "long": long, "run": run}


def write_retrieval(folder, means, needle_mass=None, layers=2, heads=4, kv_heads=2):
    """A results folder as `attnprobe retrieval` writes it (retrieval.json, retrieval_heads.csv, head_score.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    means = np.asarray(means, dtype=float)
    rows = [{"layer": la, "head": h, "kv_head": h // (heads // kv_heads), "mean": means[la, h]}
            for la in range(layers) for h in range(heads)]
    frame = pd.DataFrame(rows)
    if needle_mass is not None:
        frame["needle_mass"] = np.asarray(needle_mass, dtype=float).ravel()
    frame.to_csv(folder / io.RETRIEVAL_FILE, index=False)
    trials = {f"{la}-{h}": [float(means[la, h])] for la in range(layers) for h in range(heads)}
    (folder / io.RETRIEVAL_SCORES_FILE).write_text(json.dumps(trials))
    record = {"model": {"spec": "m", "source": "m", "layers": layers, "heads": heads, "kv_heads": kv_heads}}
    (folder / io.RETRIEVAL_RUN_FILE).write_text(json.dumps(record))
    return folder


def kvpress_order(folder):
    scores = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2), 0, 1)
    return scores, np.argsort(scores, axis=None)


# ---- case 1: export never writes over a file attnprobe did not write (a model's config.json) -------------------


def test_export_into_a_model_folder_is_refused_and_the_models_config_kept(setup, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(setup["first"], model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    line = one_error_line(invoke("export", "--out", setup["run"], "--format", "duo-attention", "--to", model))
    assert f"--to {model}" in line and "config.json" in line and "did not write" in line and "another --to" in line
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # nothing written, nothing half-written


def test_export_writes_again_over_its_own_files_but_not_over_an_edited_one(setup, tmp_path):
    duo = tmp_path / "duo"
    for _ in range(2):  # again into the same folder: its own files, recorded in attnprobe.json
        result = invoke("export", "--out", setup["run"], "--to", duo)
        assert result.exit_code == 0, result.output
    record = json.loads((duo / PROVENANCE_FILE).read_text())
    entry = record["exports"]["duo-attention"]
    assert set(entry["files"]) == {"full_attention_heads.tsv", "config.json"}
    assert entry["model"]["weights"] and entry["model"]["layers"] == 2 and entry["sink_size"] == 2
    result = invoke("export", "--out", setup["run"], "--format", "retrieval-head", "--to", duo)
    assert result.exit_code == 0, result.output  # a second format beside the first: both recorded
    assert set(json.loads((duo / PROVENANCE_FILE).read_text())["exports"]) == {"duo-attention", "retrieval-head"}
    (duo / "full_attention_heads.tsv").write_text("0.5\t0.5\n0.5\t0.5\n")  # somebody's own pattern now
    line = one_error_line(invoke("export", "--out", setup["run"], "--to", duo))
    assert "full_attention_heads.tsv" in line and "--to" in line
    assert (duo / "full_attention_heads.tsv").read_text() == "0.5\t0.5\n0.5\t0.5\n"
    (duo / PROVENANCE_FILE).write_text("[]")  # not export's record
    line = one_error_line(invoke("export", "--out", setup["run"], "--to", duo))
    assert PROVENANCE_FILE in line and "--to" in line


# ---- case 2: the start-up cleanup deletes only attnprobe's own temporary files, never the run's input -----------


def test_a_corpus_named_like_a_temporary_file_is_not_deleted(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    corpus = out / ".heads.csv.abcd1234.tmp"
    corpus.write_text("The cat sat on the mat.\nRain fell.\n", encoding="utf-8")
    old = time.time() - 2 * 3600
    os.utime(corpus, (old, old))
    result = invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--resamples", 10)
    assert result.exit_code == 0, result.output
    assert corpus.read_text(encoding="utf-8").startswith("The cat")


def test_the_cleanup_needs_the_writers_pid_and_keeps_the_inputs(tmp_path):
    old = time.time() - 3600
    names = [".heads.csv.abcd1234.tmp", ".heads.csv.999999999-abcd1234.tmp", ".run.json.999999999-ab_d1234.tmp",
             ".notes.txt.999999999-abcd1234.tmp", ".heads.csv.999999999-ABCD1234.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    assert io.remove_stale_temps(tmp_path, time.time(), keep=[tmp_path / names[2]]) == [names[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {names[1]})


# ---- case 3: ablate --pattern of another model of the same shape is refused ------------------------------------


def test_a_pattern_of_another_model_is_refused_and_a_bare_one_gets_a_note(setup, tmp_path):
    duo = tmp_path / "duo"
    assert invoke("export", "--out", setup["run"], "--to", duo).exit_code == 0
    common = ["--corpus", setup["long"], "--split", "paragraphs", "--method", "streaming", "--task", "text",
              "--no-pruning", "--resamples", 10, "--threads", 1]
    for pattern in (setup["run"], duo):  # the results folder, and the export with its attnprobe.json
        line = one_error_line(invoke("ablate", "--model", setup["second"], "--out", tmp_path / "o", "--pattern",
                                     pattern, *common))
        assert "--pattern" in line and "another model" in line and "weights fingerprint" in line
        assert not (tmp_path / "o").exists()
    out = tmp_path / "same"
    result = invoke("ablate", "--model", setup["first"], "--out", out, "--pattern", duo, *common)
    assert result.exit_code == 0, result.output
    assert not any("records no model" in n for n in json.loads((out / "streaming.json").read_text())["notes"])
    (duo / PROVENANCE_FILE).unlink()  # a bare DuoAttention folder: nothing tells its model
    out = tmp_path / "bare"
    result = invoke("ablate", "--model", setup["second"], "--out", out, "--pattern", duo, *common)
    assert result.exit_code == 0, result.output
    notes = json.loads((out / "streaming.json").read_text())["notes"]
    assert any("records no model" in note and "only its shape was checked" in note for note in notes), notes


# ---- case 4: an empty --needle or --question is refused, not replaced by the default -----------------------------


@pytest.mark.parametrize("option", ["--needle", "--question"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_needle_or_question_is_refused(tmp_path, option, value):
    from attnprobe.errors import AttnprobeError
    from attnprobe.retrieval import check_text

    haystack = tmp_path / "h.txt"
    haystack.write_text(HAYSTACK, encoding="utf-8")
    line = one_error_line(invoke("retrieval", "--model", tmp_path / "no-model", "--haystack", haystack, "--out",
                                 tmp_path / "o", option, value))
    assert line.startswith(f"Error: {option} {value!r} is ") and "pass a sentence" in line
    assert not (tmp_path / "o").exists()
    with pytest.raises(AttnprobeError, match=option):
        check_text(option, value)
    check_text(option, None)  # the default


# ---- cases 5 and 7: pattern values outside [0, 1], and --sink-size beyond any bound, on ablate -------------------


def test_a_pattern_outside_zero_one_is_refused(setup, tmp_path):
    pattern = tmp_path / "p"
    pattern.mkdir()
    (pattern / "full_attention_heads.tsv").write_text("0.2\t5\n-3\t0.4\n", encoding="utf-8")
    line = one_error_line(invoke("ablate", "--model", setup["first"], "--corpus", setup["corpus"], "--out",
                                 tmp_path / "o", "--method", "streaming", "--pattern", pattern))
    assert "full_attention_heads.tsv holds 5, outside [0, 1]" in line and "attnprobe export" in line


@pytest.mark.parametrize("option", ["--sink-size", "--recent-size"])
def test_ablate_sizes_are_bounded(setup, tmp_path, option):
    line = one_error_line(invoke("ablate", "--model", setup["first"], "--corpus", setup["corpus"], "--out",
                                 tmp_path / "o", "--method", "streaming", "--heads", "L0H1", option,
                                 "99999999999999999999"))
    assert f"{option} 99999999999999999999 is outside" in line and "10,000,000" in line


# ---- cases 6 and 8: export's sizes are bounded, and its errors name --to where --to is at fault -----------------


@pytest.mark.parametrize("args, fragment", [
    (["--recent-size", "0"], "--recent-size 0 is outside 1-10,000,000"),
    (["--sink-size", "12345678901234567890123"], "--sink-size 12345678901234567890123 is outside 0-10,000,000"),
    (["--sink-size", "-1"], "--sink-size -1 is outside 0-10,000,000"),
])
def test_export_sizes_are_bounded(setup, tmp_path, args, fragment):
    line = one_error_line(invoke("export", "--out", setup["run"], "--to", tmp_path / "duo", *args))
    assert fragment in line
    assert not (tmp_path / "duo").exists()


def test_export_errors_name_to(setup, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    line = one_error_line(invoke("export", "--out", setup["run"], "--to", a_file))
    assert f"--to {a_file} is a file" in line and "--out" not in line
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    line = one_error_line(invoke("export", "--out", setup["run"], "--to", dangling))
    assert line.startswith(f"Error: --to {dangling}") and "does not exist" in line
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            line = one_error_line(invoke("export", "--out", setup["run"], "--to", locked))
            assert f"--to {locked} is not writable" in line
        finally:
            locked.chmod(0o700)


# ---- cases 9 and 10: retrieval-head prints no sizes; a retrieval-only folder exports with analyze's defaults -----


def test_retrieval_head_export_prints_no_sizes(setup, tmp_path):
    result = invoke("export", "--out", setup["run"], "--format", "retrieval-head", "--to", tmp_path / "rh")
    assert result.exit_code == 0, result.output
    first = " ".join(result.output.split("Wrote")[0].split())  # the first line, however the console wrapped it
    assert first.endswith("from (1 - sink_window) / (1 - first_token) (analyze)")
    assert "sink 2" not in first and "recent" not in first


def test_a_retrieval_only_folder_exports_with_analyzes_defaults(tmp_path):
    folder = write_retrieval(tmp_path / "r", np.arange(8).reshape(2, 4) / 8)
    result = invoke("export", "--out", folder, "--to", tmp_path / "duo")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "duo" / "config.json").read_text()) == {"sink_size": 4, "recent_size": 256}
    assert "sink 4, recent 256 (from analyze's defaults" in result.output
    result = invoke("export", "--out", folder, "--to", tmp_path / "duo2", "--recent-size", 64)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "duo2" / "config.json").read_text()) == {"sink_size": 4, "recent_size": 64}


# ---- case 11: exported scores never tie, whatever sort reads them ---------------------------------------------


def test_ties_are_broken_by_the_secondary_score_then_position():
    primary = np.array([[0.0, 0.5, 0.0], [1.0, 0.0, 1.0], [0.5, 0.25, 0.0]])
    secondary = np.array([[0.3, 0.0, 0.9], [0.1, 0.3, 0.2], [0.0, 0.0, 0.5]])
    broken = break_ties(primary, secondary)
    flat = broken.reshape(-1)
    assert len(np.unique(flat)) == flat.size and flat.min() >= 0 and flat.max() <= 1
    assert (np.argsort(flat, kind="quicksort") == np.argsort(flat, kind="stable")).all()
    # distinct primaries keep their order
    p = primary.reshape(-1)
    for i in range(p.size):
        for j in range(p.size):
            if p[i] < p[j]:
                assert flat[i] < flat[j]
    # the zeros by secondary, equal secondaries (0.3) by position; the ones by secondary
    zeros = [k for k in np.argsort(flat) if p[k] == 0.0]
    order = sorted((k for k in range(p.size) if p[k] == 0.0), key=lambda k: (secondary.reshape(-1)[k], k))
    assert zeros == order
    assert flat[3] < flat[5]  # the ones: secondary 0.1 below 0.2, and stepped down from 1
    without = break_ties(primary)  # no secondary: layer, head order
    zeros = [k for k in np.argsort(without.reshape(-1)) if p[k] == 0.0]
    assert zeros == sorted(zeros)
    assert (break_ties(np.array([[0.1, 0.2]])) == [[0.1, 0.2]]).all()  # nothing tied: unchanged


def test_duo_attention_export_of_tied_scores_has_one_order(tmp_path):
    """A retrieval-only folder where most heads scored 0 (few trials): the exported table has distinct values in
    [0, 1], ordered within the ties by the heads' attention mass on the needle, kvpress's unstable argsort agrees
    with a stable one, and distinct scores keep their order."""
    means = np.array([[0.0, 0.0, 0.5, 0.0], [0.0, 0.25, 0.0, 0.0]])
    mass = np.array([[0.1, 0.6, 0.9, 0.2], [0.3, 0.1, 0.05, 0.4]])
    folder = write_retrieval(tmp_path / "r", means, mass)
    result = invoke("export", "--out", folder, "--to", tmp_path / "duo")
    assert result.exit_code == 0, result.output
    scores, order = kvpress_order(tmp_path / "duo")
    assert scores.shape == (2, 2) and len(np.unique(scores)) == 4 and scores.min() >= 0 and scores.max() <= 1
    assert (order == np.argsort(scores, axis=None, kind="stable")).all()
    # KV heads: max of (0, 0) -> 0 with mass max(0.1, 0.6) = 0.6; (0.5, 0) -> 0.5; (0, 0.25) -> 0.25; (0, 0) -> 0
    # with mass max(0.05, 0.4) = 0.4: the two zeros order by mass, [1, 1] below [0, 0]
    assert order.tolist() == [3, 0, 2, 1]
    record = json.loads((tmp_path / "duo" / PROVENANCE_FILE).read_text())["exports"]["duo-attention"]
    assert record["ties"] == "attention mass on the needle (retrieval)"


def test_duo_attention_ties_without_a_secondary_score_follow_layer_head_order():
    scores = HeadScores(np.zeros((3, 2)), "kv", {"spec": "m", "layers": 3, "heads": 2, "kv_heads": 2}, 4, 256)
    table, _ = duo_attention(scores)
    assert len(np.unique(table)) == 6 and (np.argsort(table, axis=None) == np.arange(6)).all()


def test_the_needle_mass_is_the_mean_over_steps_of_the_rows_mass_on_the_needle(tmp_path):
    """retrieval_heads.csv's needle_mass against a hand computation: one eager full pass over the prompt and the
    forced answer gives every decoding step's row; sum each over the needle's keys, average over the steps."""
    from attnprobe.model import load_model
    from attnprobe.retrieval import needle_mass, run_trial, tabulate

    rows = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [-1.0, 0.5, 0.5, 0.0]]])  # [layer 1, head 2, keys 4]
    assert needle_mass(rows, 1, 3).tolist() == [[pytest.approx(0.5), pytest.approx(1.0)]]
    model = make_llama(tmp_path / "llama", layers=2, heads=4, kv_heads=2, lm_head=True)
    loaded = load_model(str(model), "cpu", lm_head=True)
    ids = list(range(1, 31))
    start, end = 10, 14
    trial, _ = run_trial(loaded, ids, start, end, "forced")
    needle = ids[start:end]
    with torch.inference_mode():
        full = loaded.model(input_ids=torch.tensor([ids + needle[:-1]]), output_attentions=True).attentions
    steps = range(len(ids) - 1, len(ids) - 1 + len(needle))  # the query positions of the decoding steps
    hand = np.zeros((2, 4))
    for layer, weights in enumerate(full):
        for head in range(4):
            hand[layer, head] = np.mean([float(weights[0, head, q, start:end].sum()) for q in steps])
    np.testing.assert_allclose(trial.mass, hand, atol=1e-5)
    frame, _ = tabulate([trial, trial], loaded.num_kv_heads, 10, 0)
    np.testing.assert_allclose(frame["needle_mass"].to_numpy(), hand.ravel(), atol=1e-5)
