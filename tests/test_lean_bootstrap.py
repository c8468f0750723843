"""The bootstrap's resample sums do not grow past a budget (issue 28, item 5b): resamples x scores x heads at most
RESAMPLE_CELLS, so a 32 x 32 model keeps fewer resamples than asked, and run.json says so; smaller models keep
every resample asked, as before."""

import json

import numpy as np
from conftest import SENTENCES
from test_cli import run

from attnprobe import accumulate, records
from attnprobe.accumulate import RESAMPLE_CELLS, Accumulator, Shape, resamples_within_budget
from attnprobe.planning import score_names


def test_models_up_to_512_heads_keep_every_resample_asked():
    scores = len(score_names(True, True))  # every score: the most columns a run has
    for layers, heads in ((12, 12), (30, 9), (16, 32)):
        assert resamples_within_budget(1000, scores, layers * heads) == 1000
    assert resamples_within_budget(20, scores, 1024) == 20  # fewer than the budget allows: as asked


def test_a_32_by_32_model_keeps_its_resample_sums_within_the_budget():
    scores = len(score_names(True, True))
    kept = resamples_within_budget(1000, scores, 1024)
    assert 500 <= kept < 1000 and kept * scores * 1024 <= RESAMPLE_CELLS < (kept + 1) * scores * 1024
    shape = Shape(score_names(True, True), (), 32, 32, 1, kept, 0, ())
    totals = Accumulator(shape)
    sums = totals.state()
    resampled = sum(value.nbytes for key, value in sums.items() if key.startswith(("wsum/", "wcount/")))
    assert resampled <= 2 * 8 * RESAMPLE_CELLS  # 256 MiB, not the 442 MB of 1,000 resamples
    assert resamples_within_budget(1000, 10**9, 10**9) == 1  # never none


def test_a_run_past_the_budget_keeps_fewer_resamples_and_says_so(gpt2_dir, tmp_path, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES * 2) + "\n", encoding="utf-8")
    heads = 3 * 4  # the tiny GPT-2: 3 layers x 4 heads
    monkeypatch.setattr(accumulate, "RESAMPLE_CELLS", 600)
    monkeypatch.setattr(records, "RESAMPLE_CELLS", 600)
    out = tmp_path / "out"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", "200")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "run.json").read_text(encoding="utf-8"))
    boot = record["bootstrap"]
    assert boot["resamples_asked"] == 200 and boot["resample_budget"] == 600
    assert any("not the 200 asked" in note for note in record["notes"])
    with np.load(out / "resamples.npz") as saved:  # one array per score, [resample, layer, head]
        scores = len(saved.files)
        assert all(saved[key].shape[0] == boot["resamples"] for key in saved.files)
    assert boot["resamples"] == 600 // (scores * heads) >= 1


def test_a_run_within_the_budget_records_no_note(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES * 2) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", "50")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert record["bootstrap"]["resamples"] == 50 and "resamples_asked" not in record["bootstrap"]
    assert not any("asked" in note for note in record["notes"])
