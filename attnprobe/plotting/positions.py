"""`plot`'s position_profile: entropy and first-token mass against query position, one line per layer, coloured
by depth."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attnprobe.plotting.style import any_script_figure, plain_text

# layers coloured by depth: light = early, dark = deep, from report.js's drawPositions colours (the PNG once ran
# viridis, dark = early, the report's chart the other way)
DEPTH_LIGHT, DEPTH_DARK = "#bec8dc", "#14285a"  # rgb(190, 200, 220) and rgb(20, 40, 90), as report.js
POSITION_CMAP = LinearSegmentedColormap.from_list("attnprobe_depth", [DEPTH_LIGHT, DEPTH_DARK])


POSITION_XLABEL = "query position (0-based, log scale of position + 1)"


def position_x(positions: pd.DataFrame) -> pd.Series:
    """Where a bin sits on the 0-based position axis: the geometric centre of its first and last positions + 1,
    less 1 (bin 0 at 0, bin 1 at 1)."""
    return np.sqrt((positions["position_min"] + 1.0) * (positions["position_max"] + 1.0)) - 1.0


def _log1p(x: Any) -> Any:
    return np.log1p(np.maximum(x, 0.0))


def position_scale(ax: Axes, longest: float) -> None:
    """A log scale of position + 1 on the x axis, so 0-based position 0 has a place, with ticks at 0-based
    positions 0, 1, 10, 100, ... (and 3, 30, 300, ... while there are few decades) up to `longest`."""
    ax.set_xscale("function", functions=(_log1p, np.expm1))
    ticks, decade = [0, 1], 10
    while decade <= max(longest, 1.0):
        ticks.append(decade)
        decade *= 10
    if len(ticks) <= 4:
        ticks = sorted(ticks + [3 * t for t in ticks[1:] if 3 * t <= longest])
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlim(-0.1, max(longest, 1.0) * 1.1)


def layer_norm(positions: pd.DataFrame) -> Normalize:
    """Maps layer numbers onto the colormap; a single layer lands in its middle."""
    layers = positions["layer"].dropna()
    if layers.empty:
        return Normalize(0.0, 1.0)
    low, high = float(layers.min()), float(layers.max())
    return Normalize(low - 0.5, high + 0.5) if low == high else Normalize(low, high)


def draw_position_profile(ax: Axes, positions: pd.DataFrame, column: str, ylabel: str) -> ScalarMappable:
    """One line per layer, the mean over its heads per position bin, coloured by depth; bins without a value skipped.

    Returns the mappable for a colour bar labelled by layer."""
    table = positions.groupby(["layer", "bin"]).agg(
        position_min=("position_min", "min"), position_max=("position_max", "max"), value=(column, "mean"),
    ).reset_index()  # mean skips NaN: the nanmean over heads, NaN where no head has a value
    table["x"] = position_x(table)
    norm = layer_norm(positions)
    cmap = POSITION_CMAP
    for layer, group in table.groupby("layer"):
        group = group.sort_values("bin").dropna(subset=["value"])
        if group.empty:
            continue
        ax.plot(group["x"], group["value"], marker="o", markersize=2.5, linewidth=1.2,
                color=cmap(norm(layer)), label=f"layer {layer}")
    position_scale(ax, float(table["position_max"].max()) if table["position_max"].notna().any() else 1.0)
    ax.set_xlabel(POSITION_XLABEL)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    return ScalarMappable(norm=norm, cmap=cmap)


@any_script_figure
def position_profile_figure(positions: pd.DataFrame, title: str | None = None) -> Figure:
    """Entropy and first-token mass against query position, one line per layer, with a layer colour bar."""
    figure = Figure(figsize=(12.0, 4.6), layout="constrained")
    left, right = figure.subplots(1, 2)
    mappable = draw_position_profile(left, positions, "entropy", "mean attention entropy (nats)")
    left.set_title("Entropy by query position")
    draw_position_profile(right, positions, "first_token", "attention mass on the first token")
    right.set_title("First-token mass by query position")
    bar = figure.colorbar(mappable, ax=[left, right], label="layer (light = early, dark = deep)", shrink=0.9)
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure
