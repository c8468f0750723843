"""Issue 20 (items 7, 8, 10, 11, 12): ablation figures, plot --heads, --limit, progress, the Python API."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnprobe import io, plotting
from tests.test_cli import run


def capture_figures(monkeypatch) -> dict:
    """The figures handed to io.figure_writer, by file name (`stem.format`)."""
    figures: dict = {}
    original = io.figure_writer

    def recording(figure, fmt="png", dpi=120):
        write = original(figure, fmt, dpi)

        def record(path):
            figures[Path(path).name.split(".")[1] + "." + fmt] = figure
            write(path)

        return record

    monkeypatch.setattr(io, "figure_writer", recording)
    return figures


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
    assert f"entropy_unforced {heads.loc[(1, 2), 'entropy_unforced']:.2f} nats" in title
    assert "first_token_unforced" in title and "\nentropy " not in f"\n{title.split(chr(10), 1)[1]}"
    assert "means over the corpus" in figure._suptitle.get_text()
