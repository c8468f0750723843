"""Issue 20 items 7, 8, 10-12: ablate and plot figures, --limit, ablate progress off a terminal, the notebook API."""

import json

import numpy as np
import pandas as pd
import pytest
from test_cli import assert_one_line_error, run
from test_plot_options import capture_figures

from attnprobe import plotting
from attnprobe.errors import AttnprobeError


def texts_of(figure) -> list[str]:
    return [text.get_text() for ax in figure.axes for text in ax.texts]


# ---- item 7: importance.png of some heads, pruning.png and layer_importance.png ---------------------------------


def test_importance_of_some_heads_is_drawn_on_the_models_grid_without_nan():
    importance = pd.DataFrame({"layer": [1, 19], "head": [5, 0], "loss_change": [0.2, -0.1],
                               "loss_change_ci_low": [0.1, -0.2], "loss_change_ci_high": [0.3, 0.0]})
    figure = plotting.importance_heatmap_figure(importance, "t", shape=(30, 9))
    image = figure.axes[0].images[0].get_array()
    assert image.shape == (30, 9)  # the model's grid, not 20 x 6
    assert int(np.ma.count(image)) == 2  # only the two ablated heads hold a value
    texts = texts_of(figure)
    assert not any("nan" in t.lower() for t in texts) and sorted(texts) == ["-0.10", "0.20"]
    assert "2 of 270 heads ablated" in figure.axes[0].get_title()


def test_ablate_some_heads_then_plot_draws_the_pruning_curve_and_layer_bars(gpt2_dir, corpus_file, tmp_path,
                                                                              monkeypatch):
    figures = capture_figures(monkeypatch)
    out = tmp_path / "out"
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 20, "--heads", "L0H1,L2H3", "--layers")
    assert result.exit_code == 0, result.output
    heatmap = figures["importance.png"]
    assert heatmap.axes[0].images[0].get_array().shape == (3, 4)  # gpt2_dir: 3 layers x 4 heads
    assert not any("nan" in t.lower() for t in texts_of(heatmap))
    assert run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
               "--resamples", 20).exit_code == 0
    plotted = run("plot", "--out", out)
    assert plotted.exit_code == 0, plotted.output
    assert (out / "pruning.png").stat().st_size > 0 and (out / "layer_importance.png").stat().st_size > 0
    pruning = figures["pruning.png"]
    panels = [ax for ax in pruning.axes if ax.lines]
    assert [ax.get_ylabel().split(" ")[0] for ax in panels] == ["loss", "KL(unablated"]
    orders = {line.get_label() for line in panels[0].lines if not line.get_label().startswith("_")}
    assert orders == set(pd.read_csv(out / "pruning.csv")["order"])  # one line per order
    bars = figures["layer_importance.png"]
    assert len(bars.axes[0].patches) == 3  # one bar per layer
    assert figures["importance.png"].axes[0].images[0].get_array().shape == (3, 4)
    # an ablate run that makes no pruning.csv leaves no pruning.png of the earlier run behind
    again = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                "--resamples", 20, "--heads", "L0H1", "--no-pruning")
    assert again.exit_code == 0, again.output
    assert not (out / "pruning.png").exists() and not (out / "layer_importance.png").exists()


def test_pruning_figure_of_an_encoder_draws_its_two_measures():
    rows = [{"order": order, "percent": p, "heads_removed": p // 10, "embedding_change": p / 100,
             "embedding_change_ci_low": 0.0, "embedding_change_ci_high": 1.0, "hidden_change": p / 200,
             "hidden_change_ci_low": 0.0, "hidden_change_ci_high": 1.0}
            for order in ("gradient", "random") for p in range(0, 101, 10)]
    figure = plotting.pruning_figure(pd.DataFrame(rows))
    assert [ax.get_ylabel() for ax in figure.axes] == ["embedding change (1 - cosine)",
                                                        "hidden-state change (1 - cosine)"]
    assert len(figure.axes[0].lines) == 2 + 1  # two orders and the zero line


# ---- item 8: plot --heads writes its own file; panel scores are labelled ------------------------------------


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory, gpt2_dir):
    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    corpus.write_text("The cat sat on the mat.\nRain fell.\nBirds sing.\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("out") / "results"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", 20)
    assert result.exit_code == 0, result.output
    return out


def test_plot_heads_writes_head_patterns_selected_and_keeps_head_patterns(analyzed, monkeypatch):
    assert run("plot", "--out", analyzed).exit_code == 0
    by_type = (analyzed / "head_patterns.png").read_bytes()
    figures = capture_figures(monkeypatch)
    result = run("plot", "--out", analyzed, "--heads", "L0H1,L2H3")
    assert result.exit_code == 0, result.output
    assert "head_patterns_selected.png" in result.stdout and "--heads" in result.stdout
    assert (analyzed / "head_patterns_selected.png").stat().st_size > 0
    assert [ax.get_title().split(" ")[0] for ax in figures["head_patterns_selected.png"].axes if ax.images] == [
        "L0H1", "L2H3"]
    by_type_titles = [ax.get_title().split(" ")[0] for ax in figures["head_patterns.png"].axes if ax.images]
    assert by_type_titles != ["L0H1", "L2H3"]  # still one head of each type
    assert (analyzed / "head_patterns.png").read_bytes() == by_type  # drawn the same as before


def test_pattern_panels_name_the_heads_csv_columns_they_show(analyzed, monkeypatch):
    figures = capture_figures(monkeypatch)
    assert run("plot", "--out", analyzed, "--heads", "L1H2").exit_code == 0
    figure = figures["head_patterns_selected.png"]
    title = next(ax.get_title() for ax in figure.axes if ax.images)
    heads = pd.read_csv(analyzed / "heads.csv").set_index(["layer", "head"])
    # in the words of the report's score menu (issue 34), still naming which heads.csv score: the unforced one
    assert f"entropy (unforced) {heads.loc[(1, 2), 'entropy_unforced']:.2f} nats" in title
    assert "first token (unforced)" in title and "\nentropy 0" not in f"\n{title.split(chr(10), 1)[1]}"
    assert "_unforced" not in title
    assert "means over the corpus" in figure._suptitle.get_text()


# ---- item 10: --limit ---------------------------------------------------------------------------------------


def test_a_corpus_head_streams_its_first_sequences(corpus_file):
    from attnprobe.corpus import corpus_from_texts, read_corpus

    whole = read_corpus(corpus_file)
    first = whole.head(3)
    assert len(first) == 3 and first.limit == 3 and [s.text for s in first.stream()] == whole.texts[:3]
    assert first.sha256 == whole.sha256 and whole.head(None) is whole and len(whole.head(100)) == len(whole)
    assert corpus_from_texts(["a", "b", "c"]).head(2).texts == ["a", "b"]
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises(AttnprobeError, match="--limit"):
            whole.head(bad)


def test_analyze_limit_is_recorded_and_in_the_resume_fingerprint(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 20, "--limit", 2)
    assert result.exit_code == 0, result.output
    info = json.loads((out / "run.json").read_text())
    assert info["sentences"] == 2 and info["limit"] == 2
    assert pd.read_csv(out / "heads.csv")["sentences"].max() == 2
    full = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
               "--resamples", 20)
    assert full.exit_code == 0 and json.loads((out / "run.json").read_text())["limit"] is None

    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model
    from attnprobe.planning import Options
    from attnprobe.records import run_fingerprint
    from attnprobe.resume import check_fingerprint

    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(corpus_file)
    limited = run_fingerprint(loaded, corpus.head(2), 8, 20, 0, Options(), weights=False)
    assert limited["limit"] == 2
    with pytest.raises(AttnprobeError, match="limit"):
        check_fingerprint(limited, run_fingerprint(loaded, corpus.head(3), 8, 20, 0, Options(), weights=False))
    with pytest.raises(AttnprobeError, match="limit"):  # the same count of sentences, but not the same run
        check_fingerprint(run_fingerprint(loaded, corpus.head(len(corpus)), 8, 20, 0, Options(), weights=False),
                          run_fingerprint(loaded, corpus, 8, 20, 0, Options(), weights=False))


@pytest.mark.parametrize("command", ["analyze", "ablate", "rollout"])
def test_a_limit_below_1_is_one_line(command, gpt2_dir, corpus_file, tmp_path):
    result = run(command, "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "o", "--limit", 0)
    assert_one_line_error(result, "--limit 0 is below 1")
    assert not (tmp_path / "o").exists()


def test_probe_limit_below_1_and_a_limit_that_is_no_number_are_one_line(gpt2_dir, tmp_path):
    assert_one_line_error(run("probe", "--model", gpt2_dir, "--out", tmp_path / "o", "--limit", -3),
                          "--limit -3 is below 1")
    from tests.test_first_hour import attnprobe_process

    done = attnprobe_process("analyze", "-m", "x", "-c", "y", "--limit", "ten")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "Error: Invalid value for '--limit': not a whole number (see `attnprobe analyze --help`)"]


def test_ablate_probe_and_rollout_limits_are_recorded(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 20, "--no-pruning", "--limit", 3)
    assert result.exit_code == 0, result.output
    info = json.loads((out / "ablate.json").read_text())
    assert info["sentences"] == 3 and info["limit"] == 3
    probed = run("probe", "--model", gpt2_dir, "--out", tmp_path / "p", "--device", "cpu", "--lengths", "3,4",
                 "--sequences", 5, "--limit", 2, "--resamples", 20)
    assert probed.exit_code == 0, probed.output
    info = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert info["limit"] == 2 and info["sequences_scored_per_length"] == 2 and info["sequences_per_length"] == 5
    from attnprobe.model import load_model
    from attnprobe.probe import probe

    loaded = load_model(str(gpt2_dir), "cpu")
    limited = probe(loaded, lengths=(3,), sequences=5, limit=2, resamples=10).scores
    alone = probe(loaded, lengths=(3,), sequences=2, resamples=10).scores  # one length: the same first 2 draws
    assert np.allclose(limited["induction"], alone["induction"])
    refused = run("rollout", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "r", "--limit", 2,
                  "--index", 3)
    assert_one_line_error(refused, "--index 3", "has 2 sentences")
    rolled = run("rollout", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "r", "--limit", 2,
                 "--device", "cpu")
    assert rolled.exit_code == 0, rolled.output
    with np.load(tmp_path / "r" / "rollout.npz", allow_pickle=False) as data:
        assert int(data["limit"]) == 2 and int(data["index"][0]) < 2
    assert_one_line_error(run("rollout", "--model", gpt2_dir, "--example", "Hi there", "--out", tmp_path / "r",
                              "--limit", 2), "--limit", "--corpus")


def test_python_analyze_takes_a_limit(gpt2_dir, corpus_file):
    import attnprobe

    result = attnprobe.analyze(str(gpt2_dir), corpus_file, device="cpu", resamples=10, limit=2)
    assert result.run["sentences"] == 2 and result.run["limit"] == 2


# ---- item 12: the Python API ------------------------------------------------------------------------------


def test_rollout_returns_what_it_is_given():
    import torch

    import attnprobe

    maps = np.full((2, 3, 3), 1 / 3, dtype=np.float32)
    rolled = attnprobe.rollout(maps)
    assert isinstance(rolled, np.ndarray) and rolled.dtype == np.float32 and rolled.shape == (2, 3, 3)
    as_tensor = attnprobe.rollout(torch.from_numpy(maps))
    assert isinstance(as_tensor, torch.Tensor)
    np.testing.assert_allclose(rolled, as_tensor.numpy())


def test_python_analyze_warns_of_a_truncated_document(gpt2_dir):
    import attnprobe

    long = " ".join(["The cat sat on the mat."] * 40)  # gpt2_dir's context is shorter
    with pytest.warns(UserWarning, match=r"1 sentence\(s\) were longer than the model's \d+ tokens.*line 2"):
        result = attnprobe.analyze(str(gpt2_dir), ["Birds sing.", long], device="cpu", resamples=10)
    assert result.run["truncated_lines"][0]["line"] == 2


# ---- item 11: progress a person can trust ----------------------------------------------------------------------


def test_ablate_logs_one_plain_line_per_step_when_stderr_is_no_terminal(gpt2_dir, corpus_file, tmp_path):
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "o", "--device", "cpu",
                 "--resamples", 10, "--batch-size", 4)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines.pop().startswith("Warning: only 8 sentences")  # fewer than 10: the intervals mean little
    stages = [line.split(":")[0] for line in lines]
    assert stages == ["mean"] * stages.count("mean") + ["ablate"] * 2 + ["gradient"] * 2 + ["pruning"] * 2
    assert lines[stages.index("ablate") + 1].startswith("ablate: 8/8 sentences (") and lines[-1].endswith(" s)")


def test_analyze_progress_moves_layer_by_layer_on_one_document(llama_dir):
    """Item 11: one long document is one batch; progress advances as each layer finishes, not 0/1 until the end."""
    from test_blocked import corpus_of

    from attnprobe.analysis import analyze_loaded
    from attnprobe.model import load_model

    loaded = load_model(str(llama_dir), "cpu")
    steps, totals = [], []
    analyze_loaded(loaded, corpus_of(["The cat sat on the mat. " * 8]), resamples=5, progress=steps.append,
                   on_start=totals.append)
    assert totals == [1]
    assert steps == pytest.approx([1 / loaded.num_layers] * loaded.num_layers)
    assert sum(steps) == pytest.approx(1.0)
