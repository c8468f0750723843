"""Figures are built from tables alone and scale to any number of layers and heads."""

import numpy as np
import pandas as pd
import pytest

from attnprobe import plotting
from attnprobe.classify import classify


def fake_heads(n_layers: int, n_heads: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    layer, head = np.meshgrid(range(n_layers), range(n_heads), indexing="ij")
    return pd.DataFrame({
        "layer": layer.ravel(), "head": head.ravel(),
        "entropy": rng.uniform(0, 2.5, layer.size), "entropy_norm": rng.uniform(0, 1, layer.size),
        "diagonal": rng.uniform(0, 1, layer.size), "first_token": rng.uniform(0, 1, layer.size),
    }).assign(entropy_unforced=lambda f: f["entropy"] * 1.05, diagonal_unforced=lambda f: f["diagonal"] * 0.9,
              first_token_unforced=lambda f: f["first_token"] * 0.95)


def fake_layers(heads: pd.DataFrame) -> pd.DataFrame:
    grouped = heads.groupby("layer")
    layers = grouped[["entropy"]].mean()
    layers["entropy_head_std"] = grouped["entropy"].std(ddof=0)
    return layers.reset_index()


@pytest.mark.parametrize("shape", [(12, 12), (30, 9), (6, 12), (1, 1)])
def test_heatmap_has_one_cell_per_head(shape):
    heads = fake_heads(*shape)
    figure = plotting.entropy_heatmap_figure(heads)
    ax = figure.axes[0]
    assert ax.images[0].get_array().shape == shape
    assert len(ax.texts) == shape[0] * shape[1]  # every cell annotated at these sizes
    assert ax.get_xlabel() == "head" and ax.get_ylabel() == "layer"
    assert figure.axes[1].get_ylabel() == "entropy (nats)"  # the colour bar


def test_large_heatmaps_drop_annotations():
    assert len(plotting.entropy_heatmap_figure(fake_heads(48, 16)).axes[0].texts) == 0


def test_grid_places_each_head_at_its_layer_and_index():
    heads = fake_heads(3, 4)
    values = plotting.grid(heads, "entropy")
    row = heads.query("layer == 2 and head == 1").iloc[0]
    assert values[2, 1] == row["entropy"]


def test_layer_gradient_shows_mean_per_layer_and_type_counts():
    heads = fake_heads(30, 9)
    types = classify(heads)
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), types)
    left, right = figure.axes[:2]
    line = left.lines[0]
    np.testing.assert_allclose(line.get_ydata(), heads.groupby("layer")["entropy"].mean())
    heights = np.zeros(30)
    for container in right.containers:
        heights += [bar.get_height() for bar in container]
    assert heights.tolist() == [9.0] * 30  # every head of every layer counted once


def test_representatives_pick_the_clearest_head_of_each_type():
    types = pd.DataFrame({
        "layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "head_type": ["local", "local", "copy", "broad"],
        "diagonal_unforced": [0.9, 0.99, 0.1, 0.2], "entropy_unforced": [0.1, 0.2, 0.3, 2.0],
        "entropy_norm": [0.1, 0.1, 0.1, 0.9],
    })
    assert plotting.representatives(types) == {"local": (0, 1), "copy": (1, 0), "broad": (1, 1)}


def test_head_patterns_label_tokens():
    heads = fake_heads(2, 2)
    types = classify(heads)
    maps = np.tile(np.eye(3), (2, 2, 1, 1))  # [layer, head, query, key]
    example = {"maps": maps, "tokens": ["a", " b", "c"], "sentence": "a b c"}
    figure = plotting.head_patterns_figure(example, types)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert ax.get_title().split(":")[0] in {"local", "copy", "broad", "mixed"}


def test_category_lines_join_the_layer_gradient():
    heads = fake_heads(4, 3)
    categories = pd.DataFrame({"category": ["svo"] * 4 + ["passive"] * 4, "layer": list(range(4)) * 2,
                               "entropy": [1.0, 0.9, 0.8, 0.7, 1.5, 1.2, 1.0, 0.9]})
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), classify(heads), categories)
    left = figure.axes[0]
    labels = [line.get_label() for line in left.lines]
    assert labels == ["mean over heads", "svo", "passive"]
    np.testing.assert_allclose(left.lines[2].get_ydata(), [1.5, 1.2, 1.0, 0.9])


def test_extended_types_get_their_own_bars_and_picks():
    heads = fake_heads(2, 3)
    heads["previous_token"] = [0.9, 0.1, 0.1, 0.1, 0.1, 0.1]
    heads["first_token_unforced"] = [0.1, 0.9, 0.1, 0.1, 0.1, 0.1]
    types = classify(heads, scheme="extended")
    types["head_type"] = ["previous", "sink", "local", "copy", "broad", "mixed"]
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), types)
    legend = [text.get_text() for text in figure.axes[1].get_legend().get_texts()]
    assert legend == ["previous", "local", "sink", "copy", "broad", "mixed"]
    picks = plotting.representatives(types)
    assert picks["previous"] == (0, 0) and picks["sink"] == (0, 1)
