"""The position profile: entropy and first-token mass per query-position bin, one line per layer."""

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from attnprobe import plotting

COLUMNS = ["entropy", "entropy_norm", "first_token", "diagonal", "distance", "sink_window"]


def bin_edges(n_bins: int, longest: int = 1000) -> list[tuple[int, int]]:
    """0-based query positions per bin: {0}, {1}, 2-3, 4-7, ... the last ending at the longest sequence's end."""
    edges = [(0, 0), (1, 1)] + [(2 ** k, 2 ** (k + 1) - 1) for k in range(1, n_bins)]
    edges = edges[:n_bins]
    low, _ = edges[-1]
    edges[-1] = (low, max(low, longest - 1))
    return edges


def fake_positions(n_layers: int, n_heads: int, n_bins: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    edges = bin_edges(n_bins)
    rows = [
        {"layer": layer, "head": head, "bin": b, "position_min": lo, "position_max": hi, "rows": 100}
        for layer in range(n_layers) for head in range(n_heads) for b, (lo, hi) in enumerate(edges)
    ]
    positions = pd.DataFrame(rows)
    for column in COLUMNS:
        positions[column] = rng.uniform(0, 3 if column == "entropy" else 1, len(positions))
    return positions


def expected(positions: pd.DataFrame, column: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """x and y a layer's line should carry: geometric bin centres, nanmean over heads, empty bins dropped."""
    one = positions[positions["layer"] == layer]
    x, y = [], []
    for _, group in one.groupby("bin"):
        values = group[column].to_numpy(dtype=float)
        if np.isnan(values).all():
            continue
        lo, hi = group["position_min"].iloc[0], group["position_max"].iloc[0]
        x.append(np.sqrt((lo + 1) * (hi + 1)) - 1)  # 0-based, as positions.csv
        y.append(np.nanmean(values))
    return np.array(x), np.array(y)


def panels(figure):
    return [ax for ax in figure.axes if ax.get_label() != "<colorbar>"]


@pytest.mark.parametrize("shape", [(3, 2, 5), (30, 9, 9), (1, 1, 1), (1, 4, 6)])
def test_one_line_per_layer_with_mean_over_heads(shape):
    n_layers, n_heads, n_bins = shape
    positions = fake_positions(n_layers, n_heads, n_bins)
    figure = plotting.position_profile_figure(positions)
    left, right = panels(figure)
    for ax, column in [(left, "entropy"), (right, "first_token")]:
        assert ax.get_xscale() == "function"  # log of position + 1: position 0 has a place
        assert ax.get_xlabel() == "query position (0-based, log scale of position + 1)"
        assert len(ax.lines) == n_layers
        for layer, line in enumerate(ax.lines):
            x, y = expected(positions, column, layer)
            assert len(x) == n_bins
            np.testing.assert_allclose(line.get_xdata(), x)
            np.testing.assert_allclose(line.get_ydata(), y)


def test_two_panels_and_a_layer_colorbar():
    figure = plotting.position_profile_figure(fake_positions(3, 2, 5), title="gpt2 on the corpus")
    assert len(panels(figure)) == 2
    assert len(figure.axes) == 3  # two panels and the colour bar
    bar = [ax for ax in figure.axes if ax not in panels(figure)][0]
    assert bar.get_ylabel() == "layer (light = early, dark = deep)"
    assert figure.get_suptitle() == "gpt2 on the corpus"
    left, right = panels(figure)
    assert "entropy" in left.get_ylabel() and "nats" in left.get_ylabel()
    assert "first token" in right.get_ylabel()
    assert left.get_legend() is None and right.get_legend() is None  # the colour bar stands in for a legend


def test_no_title_leaves_no_suptitle():
    assert plotting.position_profile_figure(fake_positions(2, 2, 3)).get_suptitle() == ""


@pytest.mark.parametrize("n_layers", [3, 30])
def test_layers_coloured_by_depth(n_layers):
    figure = plotting.position_profile_figure(fake_positions(n_layers, 2, 4))
    lines = panels(figure)[0].lines
    colors = [np.array(matplotlib.colors.to_rgba(line.get_color())) for line in lines]
    assert not np.allclose(colors[0], colors[-1])
    np.testing.assert_allclose(colors[0], matplotlib.colors.to_rgba(plotting.DEPTH_LIGHT))  # light = early
    np.testing.assert_allclose(colors[-1], matplotlib.colors.to_rgba(plotting.DEPTH_DARK), atol=1e-6)
    assert all(line.get_markersize() <= 4 for line in lines)


def test_nan_bins_and_all_nan_layers_are_skipped():
    positions = fake_positions(3, 2, 5)
    positions.loc[(positions["layer"] == 0) & (positions["bin"] == 2), "entropy"] = np.nan  # a whole bin empty
    positions.loc[(positions["layer"] == 1) & (positions["head"] == 0), "entropy"] = np.nan  # one head missing
    positions.loc[positions["layer"] == 2, "first_token"] = np.nan  # a layer with nothing at all
    figure = plotting.position_profile_figure(positions)
    left, right = panels(figure)
    assert len(left.lines) == 3
    for layer, line in enumerate(left.lines):
        x, y = expected(positions, "entropy", layer)
        np.testing.assert_allclose(line.get_xdata(), x)
        np.testing.assert_allclose(line.get_ydata(), y)
    assert len(left.lines[0].get_xdata()) == 4
    np.testing.assert_allclose(left.lines[1].get_ydata(), expected(positions, "entropy", 1)[1])
    assert not np.isnan(left.lines[1].get_ydata()).any()
    assert len(right.lines) == 2  # the all-NaN layer draws nothing
    np.testing.assert_allclose(right.lines[1].get_ydata(), expected(positions, "first_token", 1)[1])


def test_draw_position_profile_fills_a_given_axes():
    from matplotlib.figure import Figure

    positions = fake_positions(4, 3, 6)
    ax = Figure().add_subplot()
    plotting.draw_position_profile(ax, positions, "diagonal", "diagonal mass")
    assert ax.get_ylabel() == "diagonal mass" and ax.get_xscale() == "function"
    np.testing.assert_allclose(ax.lines[3].get_ydata(), expected(positions, "diagonal", 3)[1])


@pytest.mark.parametrize("shape", [(3, 2, 5), (30, 9, 10), (1, 1, 1)])
def test_figure_saves_to_png(tmp_path, shape):
    path = tmp_path / "positions.png"
    plotting.position_profile_figure(fake_positions(*shape), title="saved").savefig(path)
    assert path.stat().st_size > 0
    assert matplotlib.image.imread(path).ndim == 3


def test_a_single_layer_takes_the_middle_colour():
    figure = plotting.position_profile_figure(fake_positions(1, 3, 4))
    (line,) = panels(figure)[0].lines
    np.testing.assert_allclose(matplotlib.colors.to_rgba(line.get_color()), plotting.POSITION_CMAP(0.5))


def test_positions_are_0_based_like_positions_csv_and_the_report():
    """Issue 20: the PNG said 1-based while positions.csv and report.html are 0-based. Bin 0 (position 0) sits at
    x = 0 and the tick labels are 0-based positions, starting at 0."""
    figure = plotting.position_profile_figure(fake_positions(2, 2, 8))
    left, _ = panels(figure)
    assert left.lines[0].get_xdata()[0] == 0.0 and left.lines[0].get_xdata()[1] == 1.0
    labels = [t.get_text() for t in left.get_xticklabels()]
    assert labels[:2] == ["0", "1"] and {"10", "100"} <= set(labels)
    np.testing.assert_allclose(left.get_xticks(), [int(label) for label in labels])  # each label at its position
    low, high = left.get_xlim()
    assert low < 0 < 999 <= high  # every bin, position 0 included, inside the axes


def test_depth_runs_light_to_dark_as_in_the_report():
    """Issue 34: position_profile.png ran dark = early (viridis), the report's position chart light = early. Both run
    light = early, dark = deep, from the same two colours."""
    import re
    from pathlib import Path

    from matplotlib.colors import to_rgb

    figure = plotting.position_profile_figure(fake_positions(4, 2, 5))
    left = panels(figure)[0]
    shade = [0.299 * r + 0.587 * g + 0.114 * b for r, g, b, *_ in (to_rgb(line.get_color()) for line in left.lines)]
    assert shade == sorted(shade, reverse=True) and shade[0] > shade[-1]  # layer 0 lightest, the last darkest
    script = (Path(plotting.__file__).parents[1] / "report_assets" / "report.js").read_text(encoding="utf-8")
    found = re.search(r"const c = \[(\d+), (\d+), (\d+)\]\.map\(\(x, j\) => Math\.round\(x \+ \(\[(\d+), (\d+), "
                      r"(\d+)\]\[j\] - x\) \* shade\)\)", script)
    assert found, "report.js's depth colours moved: keep them those of plotting.DEPTH_LIGHT / DEPTH_DARK"
    numbers = [int(v) for v in found.groups()]
    assert [round(255 * v) for v in to_rgb(plotting.DEPTH_LIGHT)] == numbers[:3]
    assert [round(255 * v) for v in to_rgb(plotting.DEPTH_DARK)] == numbers[3:]
    assert 'layer 0 (light)' in script
