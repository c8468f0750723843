"""Figures from result tables. Each `draw_*` fills the Axes it is given; nothing here writes files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attnprobe.classify import ALL_TYPES, counts_per_layer

TYPE_COLORS = {
    "previous": "#66a61e", "local": "#1b9e77", "sink": "#e7298a", "copy": "#d95f02",
    "broad": "#7570b3", "mixed": "#a6a6a6", "streaming": "#4575b4", "retrieval": "#d73027",
}
PICK_BY = {  # the clearest head of each type: (column, largest?)
    "previous": ("previous_token", True), "local": ("diagonal_unforced", True), "sink": ("first_token_unforced", True),
    "copy": ("entropy_unforced", False), "broad": ("entropy_norm", True),
    "streaming": ("sink_window", True), "retrieval": ("sink_window", False),
}
MAX_ANNOTATED_CELLS = 400  # beyond this many heads the heatmap drops its per-cell numbers


def grid(heads: pd.DataFrame, column: str) -> np.ndarray:
    """A [layer, head] array of one column of heads.csv."""
    table = heads.pivot(index="layer", columns="head", values=column).sort_index().sort_index(axis=1)
    return table.to_numpy(dtype=float)  # [layer, head]


def draw_head_grid(
    ax: Axes, heads: pd.DataFrame, column: str, title: str, cmap: str, vmin: float | None = None,
    vmax: float | None = None,
) -> Any:
    """A layers x heads grid of one column, each cell annotated while there are few enough."""
    values = grid(heads, column)  # [layer, head]
    n_layers, n_heads = values.shape
    image = ax.imshow(values, cmap=cmap, aspect="auto", interpolation="nearest", vmin=vmin, vmax=vmax)
    ax.set_title(title)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    if values.size <= MAX_ANNOTATED_CELLS:
        low = np.nanmin(values) if vmin is None else vmin
        high = np.nanmax(values) if vmax is None else vmax
        middle = low + 0.6 * (high - low)
        size = 8 if values.size <= 160 else 6
        for (layer, head), value in np.ndenumerate(values):
            color = "white" if value > middle else "black"
            ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=size, color=color)
    return image


def draw_entropy_heatmap(ax: Axes, heads: pd.DataFrame) -> Any:
    return draw_head_grid(ax, heads, "entropy", "Mean attention entropy per head (light = sharp)", "Blues")


def draw_layer_entropy(
    ax: Axes, heads: pd.DataFrame, layers: pd.DataFrame, categories: pd.DataFrame | None = None
) -> None:
    ax.scatter(heads["layer"], heads["entropy"], s=10, color="#9ecae1", label="one head")
    spread = layers["entropy_head_std"].fillna(0.0)
    ax.fill_between(
        layers["layer"], layers["entropy"] - spread, layers["entropy"] + spread,
        color="#3182bd", alpha=0.2, label="mean +- 1 sd over heads",
    )
    ax.plot(layers["layer"], layers["entropy"], marker="o", color="#08519c", label="mean over heads")
    if categories is not None:  # one thin line per sentence category
        for category, group in categories.groupby("category", sort=False):
            ax.plot(group["layer"], group["entropy"], linewidth=1.2, alpha=0.9, label=str(category))
    ax.set_title("Entropy by depth")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention entropy (nats)")
    if categories is None:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="mean over heads of")


def draw_type_distribution(ax: Axes, types: pd.DataFrame) -> None:
    counts = counts_per_layer(types)  # the same columns `attnprobe classify` prints
    bottom = np.zeros(len(counts))
    for kind in counts.columns:
        ax.bar(counts.index, counts[kind], bottom=bottom, color=TYPE_COLORS[kind], label=kind)
        bottom += counts[kind].to_numpy()
    ax.set_title("Head types by layer")
    ax.set_xlabel("layer")
    ax.set_ylabel("number of heads")
    ax.set_ylim(0, bottom.max() * 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="head type")


def draw_pattern(ax: Axes, attention: np.ndarray, tokens: list[str], title: str) -> Any:
    """One head's attention on the example sentence: rows are queries, columns keys."""
    image = ax.imshow(attention, cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
    labels = [t.strip() or repr(t) for t in tokens]
    size = 7 if len(labels) <= 25 else 5
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=size)
    ax.set_yticks(range(len(labels)), labels, fontsize=size)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=10)
    return image


def representatives(types: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """The clearest head of each type present: (layer, head)."""
    picks: dict[str, tuple[int, int]] = {}
    for kind, group in types.groupby("head_type"):
        column, largest = PICK_BY.get(str(kind), ("entropy", None))
        if largest is None:  # mixed: the most typical, nearest the median entropy
            index = (group["entropy_unforced"] - group["entropy_unforced"].median()).abs().idxmin()
        else:
            index = group[column].idxmax() if largest else group[column].idxmin()
        picks[str(kind)] = (int(group.loc[index, "layer"]), int(group.loc[index, "head"]))
    return {kind: picks[kind] for kind in ALL_TYPES if kind in picks}


def entropy_heatmap_figure(heads: pd.DataFrame) -> Figure:
    n_layers, n_heads = grid(heads, "entropy").shape
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)))
    ax = figure.add_subplot()
    figure.colorbar(draw_entropy_heatmap(ax, heads), ax=ax, label="entropy (nats)")
    return figure


def layer_gradient_figure(
    heads: pd.DataFrame, layers: pd.DataFrame, types: pd.DataFrame, categories: pd.DataFrame | None = None
) -> Figure:
    figure = Figure(figsize=(13.0, 4.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    draw_layer_entropy(left, heads, layers, categories)
    draw_type_distribution(right, types)
    return figure


def head_patterns_figure(example: dict[str, Any], types: pd.DataFrame) -> Figure:
    picks = representatives(types)
    n = len(example["tokens"])
    side = min(8.0, max(3.5, 0.2 * n + 1.5))  # inches per panel, whatever the sentence's length
    figure = Figure(figsize=(side * len(picks), side + 0.8), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(picks)))
    image = None
    for ax, (kind, (layer, head)) in zip(axes, picks.items()):
        title = f"{kind}: layer {layer}, head {head}"
        image = draw_pattern(ax, example["maps"][layer, head], example["tokens"], title)
    figure.colorbar(image, ax=list(axes), label="attention weight", shrink=0.8)
    shown = f" (first {n} of {example['total_tokens']} tokens)" if example.get("total_tokens", n) > n else ""
    sentence = example["sentence"] if len(example["sentence"]) <= 120 else example["sentence"][:117] + "..."
    figure.suptitle(f"One head of each type on: {sentence}{shown}", fontsize=11)
    return figure


def probe_heatmap_figure(scores: pd.DataFrame, kinds: list[str], model: str) -> Figure:
    """One layers x heads panel per probe kind, on a shared 0-1 scale (dark = strong)."""
    n_layers, n_heads = grid(scores, kinds[0]).shape
    width = max(5.0, 0.6 * n_heads + 2.0)
    figure = Figure(figsize=(width * len(kinds) + 1.0, max(4.0, 0.4 * n_layers + 1.5)), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(kinds)))
    image = None
    for ax, kind in zip(axes, kinds):
        image = draw_head_grid(ax, scores, kind, f"{kind} score", "Purples", vmin=0.0, vmax=1.0)
    figure.colorbar(image, ax=list(axes), label="mean attention to the target token", shrink=0.8)
    figure.suptitle(f"Synthetic probes on {model}: random tokens repeated twice")
    return figure


POSITION_CMAP = "viridis"  # layers coloured by depth, shallow dark to deep yellow


def position_x(positions: pd.DataFrame) -> pd.Series:
    """Where a bin sits on a 1-based log axis: the geometric centre of its first and last query positions."""
    return np.sqrt((positions["position_min"] + 1.0) * (positions["position_max"] + 1.0))


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
    cmap = colormaps[POSITION_CMAP]
    for layer, group in table.groupby("layer"):
        group = group.sort_values("bin").dropna(subset=["value"])
        if group.empty:
            continue
        ax.plot(group["x"], group["value"], marker="o", markersize=2.5, linewidth=1.2,
                color=cmap(norm(layer)), label=f"layer {layer}")
    ax.set_xscale("log")
    ax.set_xlabel("query position (1-based, log scale)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    return ScalarMappable(norm=norm, cmap=cmap)


def position_profile_figure(positions: pd.DataFrame, title: str | None = None) -> Figure:
    """Entropy and first-token mass against query position, one line per layer, with a layer colour bar."""
    figure = Figure(figsize=(12.0, 4.6), layout="constrained")
    left, right = figure.subplots(1, 2)
    mappable = draw_position_profile(left, positions, "entropy", "mean attention entropy (nats)")
    left.set_title("Entropy by query position")
    draw_position_profile(right, positions, "first_token", "attention mass on the first token")
    right.set_title("First-token mass by query position")
    bar = figure.colorbar(mappable, ax=[left, right], label="layer", shrink=0.9)
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    if title is not None:
        figure.suptitle(title)
    return figure
