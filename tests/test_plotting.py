"""Figures are built from tables alone and scale to any number of layers and heads."""

import re

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
    assert figure.axes[1].get_ylabel() == "entropy (nats): dark = sharp, light = diffuse"  # the colour bar


def luminance(rgba) -> float:
    return 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]


def test_heatmap_draws_sharp_heads_dark_as_the_report_does():
    """Issue 20: the PNG ran light = sharp while report.html's grid runs dark = sharp. Both use viridis now, low
    entropy dark; the numbers stay readable (white on dark cells, black on light ones)."""
    heads = fake_heads(4, 4)
    figure = plotting.entropy_heatmap_figure(heads, "a title")
    ax = figure.axes[0]
    image = ax.images[0]
    assert image.get_cmap().name.startswith("viridis")
    sharp, diffuse = heads["entropy"].idxmin(), heads["entropy"].idxmax()
    dark = image.to_rgba(heads.loc[sharp, "entropy"])
    light = image.to_rgba(heads.loc[diffuse, "entropy"])
    assert luminance(dark) < luminance(light)
    assert "dark = sharp" in ax.get_title() and "dark = sharp" in figure.axes[1].get_ylabel()
    colour = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_color() for t in ax.texts}
    assert colour[(heads.loc[sharp, "layer"], heads.loc[sharp, "head"])] == "white"
    assert colour[(heads.loc[diffuse, "layer"], heads.loc[diffuse, "head"])] == "black"


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
    name, kind = ax.get_title().split("\n")[0].split(" ")[:2]  # e.g. "L0H1 local", then the head's scores
    assert re.fullmatch(r"L\dH\d", name) and kind in {"local", "copy", "broad", "mixed"}
    assert "entropy" in ax.get_title() and "diagonal" in ax.get_title()


def test_category_lines_join_the_layer_gradient():
    heads = fake_heads(4, 3)
    categories = pd.DataFrame({"category": ["svo"] * 4 + ["passive"] * 4, "layer": list(range(4)) * 2,
                               "entropy": [1.0, 0.9, 0.8, 0.7, 1.5, 1.2, 1.0, 0.9]})
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), classify(heads), categories)
    left, middle = figure.axes[:2]  # the categories get their own panel
    assert [line.get_label() for line in left.lines] == ["mean over heads"]
    labels = [line.get_label() for line in middle.lines]
    assert labels == ["all sentences", "svo", "passive"]
    np.testing.assert_allclose(middle.lines[2].get_ydata(), [1.5, 1.2, 1.0, 0.9])
    colours = {line.get_label(): line.get_color() for line in [*left.lines, *middle.lines]}
    assert len(set(colours.values())) == len(colours)  # no category shares the mean's colour


def test_extended_types_get_their_own_bars_and_picks():
    heads = fake_heads(2, 3)
    heads["previous_token"] = [0.9, 0.1, 0.1, 0.1, 0.1, 0.1]
    heads["first_token_unforced"] = [0.1, 0.9, 0.1, 0.1, 0.1, 0.1]
    types = classify(heads, scheme="extended")
    types["head_type"] = ["previous", "sink", "local", "copy", "broad", "mixed"]
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), types)
    legend = [text.get_text() for text in figure.axes[1].get_legend().get_texts()]
    assert legend == ["mixed", "broad", "copy", "sink", "local", "previous"]  # top-down, as the bars stack
    picks = plotting.representatives(types)
    assert picks["previous"] == (0, 0) and picks["sink"] == (0, 1)


# ---- issue 13: readable plots ------------------------------------------------------------------------------


def test_entropy_band_never_goes_below_zero():
    """Heads near 0 nats beside a diffuse one: a mean - sd band would dip below 0, the quartile band cannot."""
    heads = pd.DataFrame({"layer": [0] * 4 + [1] * 4, "head": [0, 1, 2, 3] * 2,
                          "entropy": [0.0, 0.01, 0.02, 2.5, 0.0, 0.0, 0.05, 3.0]})
    heads = heads.assign(entropy_norm=0.5, diagonal_unforced=0.1, entropy_unforced=heads["entropy"])
    layers = fake_layers(heads)
    assert (layers["entropy"] - layers["entropy_head_std"]).min() < 0  # the old band's lower edge
    figure = plotting.layer_gradient_figure(heads, layers, classify(heads))
    left = figure.axes[0]
    band = [c for c in left.collections if "quartiles" in c.get_label()]
    assert len(band) == 1
    assert min(path.vertices[:, 1].min() for path in band[0].get_paths()) >= 0.0
    assert left.get_ylim()[0] == 0.0


def test_type_legend_has_only_types_some_head_has():
    heads = fake_heads(3, 3)
    types = classify(heads)
    types["head_type"] = ["local", "local", "mixed"] * 3  # no copy, no broad
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), types)
    right = figure.axes[1]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["mixed", "local"]
    assert len(right.containers) == 2


def test_layer_ticks_stay_on_existing_layers():
    heads = fake_heads(30, 9)
    figure = plotting.layer_gradient_figure(heads, fake_layers(heads), classify(heads))
    for ax in figure.axes[:2]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert set(ticks) <= set(range(30)) and 29 in ticks and 30 not in ticks
        assert ax.get_xlim()[1] < 30


def test_previous_and_local_are_told_apart():
    from matplotlib.colors import to_rgb

    distance = np.abs(np.subtract(to_rgb(plotting.TYPE_COLORS["previous"]), to_rgb(plotting.TYPE_COLORS["local"])))
    assert distance.sum() > 0.6  # not two shades of green


def test_category_panel_draws_intervals_and_prefers_normalized_entropy():
    heads = fake_heads(3, 2)
    layers = fake_layers(heads).assign(entropy_norm=[0.5, 0.4, 0.3])
    categories = pd.DataFrame({
        "category": ["a"] * 3 + ["b"] * 3, "layer": [0, 1, 2] * 2, "entropy": [1.0, 0.9, 0.8, 2.0, 1.8, 1.6],
        "entropy_ci_low": [0.9, 0.8, 0.7, 1.9, 1.7, 1.5], "entropy_ci_high": [1.1, 1.0, 0.9, 2.1, 1.9, 1.7],
        "sentences": [4] * 3 + [2] * 3,
    })
    middle = plotting.layer_gradient_figure(heads, layers, classify(heads), categories).axes[1]
    assert len(middle.collections) == 2  # one interval band per category
    assert [line.get_label() for line in middle.lines] == ["all sentences", "a (4)", "b (2)"]
    assert "raw entropy" in middle.get_title()
    normalized = categories.assign(entropy_norm=[0.5, 0.4, 0.3, 0.6, 0.5, 0.4], entropy_norm_ci_low=0.2,
                                   entropy_norm_ci_high=0.7)
    middle = plotting.layer_gradient_figure(heads, layers, classify(heads), normalized).axes[1]
    assert "normalized" in middle.get_ylabel()
    np.testing.assert_allclose(middle.lines[0].get_ydata(), [0.5, 0.4, 0.3])


def test_every_figure_carries_the_title_it_is_given():
    heads = fake_heads(2, 2)
    types = classify(heads)
    example = {"maps": np.tile(np.eye(3), (2, 2, 1, 1)), "tokens": ["a", "b", "c"], "sentence": "a b c"}
    title = "Something: smollm2-135m on sentences.txt"
    for figure in (plotting.entropy_heatmap_figure(heads, title),
                   plotting.layer_gradient_figure(heads, fake_layers(heads), types, title=title),
                   plotting.head_patterns_figure(example, types, title=title)):
        assert figure._suptitle.get_text().startswith(title)


def test_copy_pick_avoids_a_first_token_sink_when_it_can():
    types = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "head_type": ["copy", "copy", "broad"],
                          "diagonal_unforced": 0.1, "entropy_unforced": [0.01, 0.3, 2.0],
                          "entropy_norm": [0, 0.1, 0.9]})
    heads = types.drop(columns="head_type").assign(first_token_unforced=[0.99, 0.2, 0.1])
    assert plotting.representatives(types)["copy"] == (0, 0)  # the sharpest, knowing nothing of sinks
    assert plotting.representatives(types, heads)["copy"] == (0, 1)  # the sharpest that is no sink
    example = {"maps": np.tile(np.eye(3), (2, 2, 1, 1)), "tokens": ["a", "b", "c"], "sentence": "a b c"}
    all_sinks = heads.assign(first_token_unforced=[0.99, 0.9, 0.1])
    figure = plotting.head_patterns_figure(example, types, all_sinks)
    assert "first-token sink, like every copy head" in " ".join(figure.axes[0].get_title().split())


def test_chosen_heads_get_one_panel_each_with_their_name():
    heads = fake_heads(3, 4)
    types = classify(heads)
    maps = np.tile(np.eye(5), (3, 4, 1, 1))
    example = {"maps": maps, "tokens": list("abcde"), "sentence": "a b c d e"}
    figure = plotting.head_patterns_figure(example, types, heads, chosen=[(2, 3), (0, 1)])
    panels = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title().split(" ")[0] for ax in panels] == ["L2H3", "L0H1"]


def test_long_sentences_keep_labels_readable():
    n = 40
    size, step = plotting.pattern_label_size(n, plotting.pattern_side(n))
    assert size >= 7 and step == 1  # 40 tokens: every label, at least 7 pt
    size, step = plotting.pattern_label_size(300, plotting.pattern_side(300))
    assert size >= plotting.MIN_LABEL_PT and step > 1  # far more: thinned, never tiny
    assert plotting.token_label("") == plotting.CONTINUATION
    cut = plotting.token_label(" internationalization")
    assert cut == "internation\u2026" and len(cut) == plotting.LABEL_MAX_CHARS
    assert plotting.token_label("$5") == r"\$5"  # no mathtext
    assert plotting.token_label("\n") == repr("\n")


def test_probe_colour_bar_marks_chance():
    scores = fake_heads(2, 3).rename(columns={"entropy_norm": "induction", "diagonal": "previous"})
    figure = plotting.probe_heatmap_figure(scores, ["induction", "previous"], "tiny", {"induction": 0.04,
                                                                                       "previous": 0.09})
    bar = figure.axes[-1]
    levels = sorted(round(float(line.get_ydata()[0]), 3) for line in bar.lines)
    assert levels == [0.04, 0.09]
    assert "chance" in bar.get_ylabel()
    assert "chance 0.040" in figure.axes[0].get_title()


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_labels_in_any_script_draw_without_warnings(fmt, tmp_path):
    import warnings

    from attnprobe import io

    tokens = ["Привет", "猫", "", "が", " 😀", "مرحبا", "$", "\u200d"]
    n = len(tokens)
    example = {"maps": np.tile(np.eye(n), (2, 2, 1, 1)), "tokens": tokens, "sentence": "Привет猫が 😀 مرحبا $"}
    heads = fake_heads(2, 2)
    figure = plotting.head_patterns_figure(example, classify(heads), title="日本語.txt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io.figure_writer(figure, fmt)(tmp_path / f"f.{fmt}")
        if "Last Resort High-Efficiency" in plotting.installed_fallback_fonts():  # matplotlib >= 3.10
            figure.savefig(tmp_path / f"g.{fmt}", format=fmt)  # drawn outside attnprobe's writer too
    assert not [str(w.message) for w in caught if "Glyph" in str(w.message)]
    assert (tmp_path / f"f.{fmt}").stat().st_size > 0


def test_encoder_importance_is_sequential_from_0_with_3_significant_digits():
    """Issue 20: 1 - cosine is never negative, yet the scale was symmetric about 0, and rows of small values
    all read "0.00"."""
    heads = fake_heads(6, 4)[["layer", "head"]]
    values = np.concatenate([np.linspace(1e-4, 4e-3, 20), [0.02, 0.05, 0.08, 0.12]])
    importance = heads.assign(embedding_change=values)
    figure = plotting.importance_heatmap_figure(importance, title="bert")
    ax = figure.axes[0]
    image = ax.images[0]
    assert image.norm.vmin == 0.0 and image.norm.vmax == pytest.approx(0.12)
    assert image.get_cmap().name.startswith("Reds")
    texts = [t.get_text() for t in ax.texts]
    assert "0.00" not in texts and len(set(texts)) == len(texts)  # every small value reads apart
    assert texts[0] == f"{values[0]:.3g}" and texts[-1] == "0.12"
    decoder = plotting.importance_heatmap_figure(heads.assign(loss_change=np.linspace(-0.5, 1.0, 24)))
    norm = decoder.axes[0].images[0].norm
    assert norm.vmin == -norm.vmax  # a loss change goes either way: still centred on 0


def title_gaps(figure) -> list[float]:
    """Inches between the figure title's bottom and each panel title's top."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    bottom = figure._suptitle.get_window_extent(renderer).y0
    return [(bottom - ax.title.get_window_extent(renderer).y1) / figure.dpi for ax in figure.axes
            if ax.title.get_text()]


def test_figure_titles_clear_the_panel_titles():
    """Issue 20: in layer_gradient and probe_heatmap the figure title sat on the panels' titles."""
    heads = fake_heads(12, 12)
    categories = pd.DataFrame([{"category": c, "layer": layer, "entropy": 1.0, "entropy_norm": 0.5, "sentences": 3}
                               for c in "ab" for layer in range(12)])
    gradient = plotting.layer_gradient_figure(heads, fake_layers(heads), classify(heads), categories,
                                              "Entropy by depth and head types: gpt2 on corpus.txt")
    probes = plotting.probe_heatmap_figure(heads.assign(induction=0.5, duplicate=0.2, previous=0.1),
                                           ["induction", "duplicate", "previous"], "gpt2", {"induction": 0.01})
    for figure in (gradient, probes):
        gaps = title_gaps(figure)
        assert len(gaps) == 3 and min(gaps) >= 0.12, gaps


def test_a_long_documents_line_breaks_do_not_show_as_backslash_n():
    """Issue 20: a long document's title printed its line breaks as a literal "\\n"."""
    example = {"tokens": ["a"] * 5, "sentence": "Chapter 1\n\nIt was a dark\nnight.", "total_tokens": 7657}
    caption = plotting.example_caption(example)
    assert "\\n" not in caption and '"Chapter 1 It was a dark night."' in caption
    assert "first 5 of 7657 tokens" in caption


# ---- issue 27: newcomer frictions ---------------------------------------------------------------------------


def drawn(figure):
    """The figure drawn on an Agg canvas, and its renderer (text extents need one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return canvas.get_renderer()


def overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize(("tokens", "chosen"), [
    (list("abcdefghijkl"), [(0, 0), (1, 1)]),  # two panels side by side: their score lines ran into each other
    (list("abc"), [(0, 0), (1, 1), (2, 2)]),  # one-character tokens: the narrowest panels
    ([f"token{k}" for k in range(12)], None),  # one head of each type (extended scheme: six panels, two rows)
    ([f"t{k}" for k in range(40)], [(0, 1), (2, 3), (1, 2), (0, 3)]),  # 40 tokens, 2 x 2
    (list("abcde"), [(2, 3)]),  # one panel beside the colour bar
])
def test_pattern_titles_clear_each_other_and_the_colour_bar(tokens, chosen):
    heads = fake_heads(3, 4).assign(previous_token=0.3, sink_window=0.4)
    types = classify(heads, scheme="extended")
    types["head_type"] = ["local", "copy", "broad", "mixed", "previous", "sink"] * 2
    heads.loc[heads.index[1], "first_token_unforced"] = 0.99  # a copy head that is a first-token sink: a longer title
    n = len(tokens)
    example = {"maps": np.tile(np.eye(n), (3, 4, 1, 1)), "tokens": tokens, "sentence": " ".join(tokens)}
    figure = plotting.head_patterns_figure(example, types, heads, chosen, "Attention patterns: gpt2 on corpus.txt")
    renderer = drawn(figure)
    panels = [ax for ax in figure.axes if ax.images]
    assert len(panels) == (len(chosen) if chosen else 6)
    titles = [ax.title.get_window_extent(renderer) for ax in panels]
    bar = [ax for ax in figure.axes if ax.get_ylabel() == "attention weight"][0].get_tightbbox(renderer)
    for k, box in enumerate(titles):
        assert not overlap(box, bar), (k, box, bar)
        for other in titles[k + 1:]:
            assert not overlap(box, other), (box, other)
    assert all("\n" in ax.get_title() and "entropy (unforced)" in ax.get_title() for ax in panels)
    # issue 34: every text of one panel (title, axis labels, tick labels) clear of every other panel's: in two rows
    # the top row's "key (attended to)" ran into the bottom row's titles
    texts = [(k, text) for k, ax in enumerate(figure.axes)
             for text in (ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels())
             if text.get_visible() and text.get_text()]
    boxes = [(k, text.get_text(), text.get_window_extent(renderer)) for k, text in texts]
    for i, (k, name, box) in enumerate(boxes):
        for other_k, other_name, other in boxes[i + 1:]:
            assert k == other_k or not overlap(box, other), (name, other_name, box, other)


def test_pattern_layout_is_what_is_saved():
    """One pass of constrained layout does not settle fixed-aspect panels: the layout of the first draw (what
    savefig writes) differed from the second. head_patterns settles it once and keeps it."""
    heads = fake_heads(3, 4)
    types = classify(heads)
    types["head_type"] = ["local", "copy", "broad", "mixed"] * 3
    tokens = [f"token{k}" for k in range(12)]
    example = {"maps": np.tile(np.eye(12), (3, 4, 1, 1)), "tokens": tokens, "sentence": " ".join(tokens)}
    figure = plotting.head_patterns_figure(example, types, heads, None, "Attention patterns: gpt2 on corpus.txt")
    first = [ax.get_position().bounds for ax in figure.axes]
    drawn(figure)
    drawn(figure)
    np.testing.assert_allclose([ax.get_position().bounds for ax in figure.axes], first, atol=1e-6)


def test_a_panel_heading_leaves_no_word_alone_on_a_line():
    """Issue 34: the copy panel's title broke "... like every copy head" / "here"."""
    heading = "L18H8 copy: a first-token sink, like every copy head here"
    width = plotting.text_inches("L18H8 copy: a first-token sink, like every copy head", plotting.PANEL_TITLE_PT)
    greedy = plotting.fit_lines(heading.split(" "), width, plotting.PANEL_TITLE_PT, " ")
    assert greedy[-1] == "here"  # what it did
    lines = plotting.fit_lines(heading.split(" "), width, plotting.PANEL_TITLE_PT, " ", balanced=True)
    assert len(lines) == len(greedy) and all(" " in line for line in lines), lines
    assert " ".join(lines) == heading
    assert max(plotting.text_inches(line, plotting.PANEL_TITLE_PT) for line in lines) <= width


def test_pattern_scores_are_named_in_words():
    """Issue 34: the panel titles printed heads.csv's column names (entropy_unforced, first_token_unforced)."""
    row = pd.Series({"entropy_unforced": 0.5, "entropy_norm": 0.2, "diagonal_unforced": 0.9,
                     "first_token_unforced": 0.1, "previous_token": 0.7, "sink_window": 0.4})
    scores = plotting.head_scores(row)
    assert scores == ["entropy (unforced) 0.50 nats", "normalized entropy 0.20", "diagonal (unforced) 0.90",
                      "first token (unforced) 0.10", "previous token 0.70", "sink + window 0.40"]
    assert not any("_" in score for score in scores)


def test_layer_gradient_shows_values_all_near_1_below_the_top_and_clear_of_the_legend():
    """Every head at 1.000 +- 0.004 nats (and every category at about 1): the autoscaled top sat at the largest
    value, so line and dots lay on the top spine, under the legend."""
    heads = fake_heads(6, 4)
    rng = np.random.default_rng(1)
    heads["entropy"] = 1.0 + rng.uniform(-0.004, 0.004, len(heads))
    layers = fake_layers(heads).assign(entropy_norm=0.999)
    categories = pd.DataFrame([{"category": c, "layer": layer, "entropy": 1.0, "entropy_norm": 0.999,
                                "entropy_norm_ci_low": 0.998, "entropy_norm_ci_high": 1.0, "sentences": 3}
                               for c in "ab" for layer in range(6)])
    figure = plotting.layer_gradient_figure(heads, layers, classify(heads), categories, "title")
    renderer = drawn(figure)
    left, middle = figure.axes[:2]
    for ax in (left, middle):
        points = np.concatenate([np.column_stack(line.get_data()) for line in ax.lines]
                                + [c.get_offsets() for c in ax.collections if len(c.get_offsets()) > 1])
        top = ax.get_ylim()[1]
        assert ax.get_ylim()[0] == 0.0 and points[:, 1].max() <= top / (1 + 0.05)  # room above the highest
        legend = ax.get_legend().get_window_extent(renderer)
        inside = [legend.contains(x, y) for x, y in ax.transData.transform(points)]
        assert not any(inside), "the legend covers a point"
    dots = left.collections[0].get_offsets()
    assert len(dots) == len(heads)  # every head drawn as a dot


def test_the_y_axis_from_zero_leaves_room_above_any_values():
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    plotting.from_zero(ax, [[0.0, 0.0]])
    assert ax.get_ylim() == (0.0, pytest.approx(1.0 + plotting.HEADROOM))  # nothing above 0: still a range
    plotting.from_zero(ax, [[2.0, np.nan], pd.Series([1.0])])
    assert ax.get_ylim() == (0.0, pytest.approx(2.0 * (1 + plotting.HEADROOM)))


# ---- issue 34: streaming.png without a curve ---------------------------------------------------------------


def streaming_rows(orders, shares, task=None):
    rows = [{"order": "chosen", "share": 0.25, "kv_heads_streaming": 2}]
    rows += [{"order": order, "share": share, "kv_heads_streaming": int(8 * share)} for order in orders
             for share in shares]
    frame = pd.DataFrame(rows)
    for k, name in enumerate(plotting.STREAMING_LABELS):
        frame[name] = 0.1 + 0.05 * k + frame["share"]
        frame[f"{name}_ci_low"], frame[f"{name}_ci_high"] = frame[name] - 0.02, frame[name] + 0.03
    return frame if task is None else frame.assign(task=task)


def test_streaming_without_a_curve_draws_the_one_result_as_a_point_with_its_interval():
    """`ablate --method streaming --no-pruning` measures the chosen heads only: one point, not a "curve" with a band
    and a legend of orders."""
    figure = plotting.streaming_figure(streaming_rows([], []), "title")
    drawn(figure)
    for ax in figure.axes:
        assert not [line for line in ax.lines if len(line.get_xdata()) > 1 and line.get_linestyle() != "None"
                    and line.get_color() != "black"]  # no line through points (the 0 line is black)
        assert not [c for c in ax.collections if type(c).__name__ == "FillBetweenPolyCollection"
                    or type(c).__name__ == "PolyCollection"]  # no band
        assert ax.get_legend() is None
        assert "no curve" in ax.get_title() and "bands" not in ax.get_title()
        assert any("chosen: 2 KV heads" in t.get_text() for t in ax.texts)


def test_streaming_orders_at_one_share_are_points_and_at_several_a_curve():
    one = plotting.streaming_figure(streaming_rows(["pattern", "random"], [0.5]))
    for ax in one.axes:
        assert not ax.collections or all(type(c).__name__ == "LineCollection" for c in ax.collections)  # error bars
        assert ax.get_legend() is not None and "no curve" in ax.get_title()
    several = plotting.streaming_figure(streaming_rows(["pattern", "random"], [0.0, 0.5, 1.0], task="text"))
    for ax in several.axes:
        curves = [line for line in ax.lines if len(line.get_xdata()) == 3]
        assert len(curves) == 2 and "bands: 95% intervals" in ax.get_title() and ax.get_title().startswith("text task")
