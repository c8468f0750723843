"""Figures stay readable at 1,024 heads (issue 28, item 4): head_similarity and head_map are sized within bounds,
name at most MAX_NAMED heads, summarise the tree as clusters instead of a dendrogram of 1 px leaves, and no two
texts overlap; probe_heatmap stacks its panels. Synthetic frames of 12 x 12 and 32 x 32 heads."""

import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from attnprobe import plotting

DPI = 120  # io.figure_writer's
TYPES = ("previous-token", "first-token-sink", "broad", "local", "positional")


def synthetic(layers, heads, seed=0):
    """JS of heads drawn around 8 centres (groups of alike heads), a layer and head per row, and head types."""
    rng = np.random.default_rng(seed)
    n = layers * heads
    points = rng.random((8, 5))[rng.integers(0, 8, n)] + 0.05 * rng.standard_normal((n, 5))  # [head, 5]
    squared = ((points[:, None] - points[None]) ** 2).sum(-1)  # [head, head]
    js = squared / squared.max() * np.log(2)
    np.fill_diagonal(js, 0.0)
    layer, head = np.divmod(np.arange(n), heads)
    types = pd.DataFrame({"layer": layer, "head": head, "head_type": np.array(TYPES)[rng.integers(0, 5, n)]})
    labelled = [(int(a), int(b)) for a, b in zip(layer[::37], head[::37])]  # more than MAX_NAMED at 1,024 heads
    return js, layer, head, types, labelled


def texts(figure):
    """Every drawn, non-empty text of the figure (tick labels of shown axes, titles, annotations, legend entries)
    with its box."""
    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    hidden = {id(label) for ax in figure.axes if not ax.axison
              for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]}  # an axes turned off draws no ticks
    found = []
    for text in figure.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in hidden:
            continue
        box = Text.get_window_extent(text, renderer)  # an annotation's text, not its leader line
        if box.width > 0 and box.height > 0:
            found.append((text.get_text(), box))
    return found


def assert_no_overlaps(figure):
    boxes = texts(figure)
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        overlap = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0), min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
        assert not (overlap[0] > 0.5 and overlap[1] > 0.5), (a, b, box_a, box_b)


def assert_size_within(figure, most=(2000, 3200), least=(700, 500)):
    width, height = figure.get_size_inches() * DPI
    assert least[0] <= width <= most[0] and least[1] <= height <= most[1], (width, height)


@pytest.mark.parametrize(("layers", "heads"), [(12, 12), (32, 32)])
def test_the_similarity_matrix_of_many_heads_names_a_few_and_lists_its_clusters(layers, heads):
    js, layer, head, types, labelled = synthetic(layers, heads)
    figure = plotting.head_similarity_figure(js, layer, head, types, labelled, "synthetic")
    assert_size_within(figure)
    matrix = next(ax for ax in figure.axes if ax.images and ax.images[0].get_array().shape == (len(layer),) * 2)
    names = [t.get_text() for t in matrix.get_xticklabels() if t.get_text()]
    assert 1 <= len(names) <= plotting.MAX_NAMED
    assert "L0H0" in names  # the first chosen head is named
    assert not any("tree" in ax.get_title() for ax in figure.axes)  # no dendrogram of 1 px leaves
    listed = [t.get_text() for ax in figure.axes for t in ax.texts if t.get_text().startswith("C")]
    clusters = [t for t in listed if "JS within" in t]
    assert 2 <= len(clusters) <= plotting.CLUSTERS
    assert sum(int(t.split(": ")[1].split(" head")[0]) for t in clusters) == len(layer)  # every head in one
    assert_no_overlaps(figure)


def test_a_small_matrix_still_names_every_head_under_its_tree():
    js, layer, head, types, _ = synthetic(2, 4)
    figure = plotting.head_similarity_figure(js, layer, head, types)
    assert any("tree" in ax.get_title() for ax in figure.axes)
    matrix = next(ax for ax in figure.axes if ax.images and ax.images[0].get_array().shape == (8, 8))
    assert len([t for t in matrix.get_xticklabels() if t.get_text()]) == 8


@pytest.mark.parametrize(("layers", "heads"), [(12, 12), (32, 32)])
def test_the_head_map_of_many_heads_names_a_few_apart_and_keeps_its_legend_off_the_dots(layers, heads):
    js, layer, head, types, labelled = synthetic(layers, heads)
    figure = plotting.head_map_figure(js, layer, head, types, labelled, "synthetic")
    assert_size_within(figure)
    ax = figure.axes[0]
    named = [t for t in ax.texts if t.get_text().startswith("L")]
    assert 1 <= len(named) <= plotting.MAX_NAMED
    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    legend, plot = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= plot.x1  # beside the axes
    boxes = [Text.get_window_extent(t, renderer) for t in named]  # the name, not its leader line
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    assert_no_overlaps(figure)


@pytest.mark.parametrize(("layers", "heads"), [(12, 12), (32, 32)])
def test_the_probe_heatmap_stacks_its_panels(layers, heads):
    rng = np.random.default_rng(0)
    layer, head = np.divmod(np.arange(layers * heads), heads)
    kinds = ["copy", "induction", "previous"]
    scores = pd.DataFrame({"layer": layer, "head": head, **{k: rng.random(len(layer)) for k in kinds}})
    figure = plotting.probe_heatmap_figure(scores, kinds, "model", {"copy": 0.1})
    assert_size_within(figure)  # 7,746 x 952 px at 32 heads when side by side
    panels = [ax for ax in figure.axes if ax.get_title().endswith(("score", "0.100)"))]
    assert len(panels) == 3
    FigureCanvasAgg(figure).draw()
    boxes = [ax.get_window_extent() for ax in panels]
    assert all(abs(box.x0 - boxes[0].x0) < 1 for box in boxes)  # one above the other
    assert all(a.y0 > b.y1 for a, b in zip(boxes, boxes[1:]))
    assert_no_overlaps(figure)


def test_the_similarity_caption_counts_the_names_it_shows():
    """Issue 34: the caption said every cluster's centre was named where some were left out (too close to another
    name), and a cluster of one read "1 heads"."""
    js, layer, head, types, labelled = synthetic(12, 12)
    figure = plotting.head_similarity_figure(js, layer, head, types, labelled[:2], "synthetic")
    matrix = next(ax for ax in figure.axes if ax.images and ax.images[0].get_array().shape == (len(layer),) * 2)
    named = {t.get_text() for t in matrix.get_xticklabels() if t.get_text()}
    listed = [t.get_text() for ax in figure.axes for t in ax.texts if "JS within" in t.get_text()]
    centres = [line.rsplit("centre ", 1)[1] for line in listed]
    caption = matrix.get_xlabel()
    shown = sum(1 for c in centres if c in named)
    assert f"{len(named)} named" in caption
    if shown == len(centres):
        assert "each cluster's centre" in caption
    else:
        assert f"the centres of {shown} of the {len(centres)} clusters" in caption and "left out" in caption

    assert "1 heads" not in " ".join(listed)
    assert plotting.names_caption([1, 2], [1], [2, 3, 4]) == ("2 named: the 1 chosen head and the centres of 1 of "
                                                              "the 3 clusters\n(names that would overlap are left "
                                                              "out; every centre is listed on the right)")
    assert plotting.names_caption([1, 2, 3], [], [2, 3]) == "3 named: each cluster's centre"
