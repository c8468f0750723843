"""`plot`'s entropy figures: entropy_heatmap (the layers x heads grid) and layer_gradient (entropy by depth, by
sentence category, and the head types per layer)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attnprobe.classify import counts_per_layer
from attnprobe.plotting.style import (
    CATEGORY_COLORS,
    MEAN_COLOR,
    TYPE_COLORS,
    any_script_figure,
    check_has_values,
    draw_head_grid,
    from_zero,
    grid,
    layer_ticks,
    plain_text,
    spaced_suptitle,
)

ENTROPY_CMAP = "viridis"  # as in report.html's grid: low entropy (sharp) dark, high entropy (diffuse) light
ENTROPY_BAR_LABEL = "entropy (nats): dark = sharp, light = diffuse"


def draw_entropy_heatmap(ax: Axes, heads: pd.DataFrame) -> Any:
    return draw_head_grid(ax, heads, "entropy", "Mean attention entropy per head (dark = sharp)", ENTROPY_CMAP)


def draw_layer_entropy(ax: Axes, heads: pd.DataFrame, layers: pd.DataFrame) -> None:
    """Each head as a dot, the middle half of the layer's heads as a band (quartiles: never below 0 nats, as
    a mean - sd band can be), and the mean over heads as a line."""
    per_layer = heads.groupby("layer")["entropy"]
    low, high = per_layer.quantile(0.25), per_layer.quantile(0.75)  # indexed by layer
    ax.scatter(heads["layer"], heads["entropy"], s=10, color="#9ecae1", label="one head", zorder=1)
    ax.fill_between(low.index, low.to_numpy(), high.to_numpy(), color="#3182bd", alpha=0.25, linewidth=0,
                    label="middle half of heads (quartiles)", zorder=0)
    ax.plot(layers["layer"], layers["entropy"], marker="o", markersize=4, color=MEAN_COLOR, label="mean over heads",
            zorder=2)
    ax.set_title("Entropy by depth")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention entropy (nats)")
    from_zero(ax, [heads["entropy"], high, layers["entropy"]])
    layer_ticks(ax, layers["layer"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the axes: it covers no head


def category_score(categories: pd.DataFrame) -> str:
    """The column the category panel draws: normalized entropy when categories.csv has it, else raw entropy."""
    return "entropy_norm" if "entropy_norm" in categories.columns else "entropy"


def draw_category_lines(ax: Axes, categories: pd.DataFrame, layers: pd.DataFrame) -> None:
    """One line per sentence category with its 95% interval as a band, and the mean of all sentences dashed."""
    score = category_score(categories)
    if score in layers.columns:
        ax.plot(layers["layer"], layers[score], color="black", linestyle="--", linewidth=1.2, label="all sentences")
    for k, (category, group) in enumerate(categories.groupby("category", sort=False)):
        color = CATEGORY_COLORS[k % len(CATEGORY_COLORS)]
        if {f"{score}_ci_low", f"{score}_ci_high"} <= set(group.columns):
            ax.fill_between(group["layer"], group[f"{score}_ci_low"], group[f"{score}_ci_high"], color=color,
                            alpha=0.15, linewidth=0)
        count = f" ({int(group['sentences'].iloc[0])})" if "sentences" in group.columns else ""
        ax.plot(group["layer"], group[score], linewidth=1.3, color=color, label=plain_text(f"{category}{count}"))
    if score == "entropy_norm":
        ax.set_ylabel("normalized entropy H / ln(keys)")
        ax.set_title("By sentence category (bands: 95% intervals)")
    else:
        ax.set_ylabel("mean attention entropy (nats)")
        ax.set_title("By sentence category (bands: 95% intervals)\n"
                     "raw entropy: longer sentences sit higher", fontsize=10)
    ax.set_xlabel("layer")
    drawn = [categories[c] for c in (score, f"{score}_ci_high") if c in categories.columns]
    from_zero(ax, [*drawn, layers[score] if score in layers.columns else []])
    layer_ticks(ax, categories["layer"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="category (sentences)")


def draw_type_distribution(ax: Axes, types: pd.DataFrame) -> None:
    """Stacked bars of the types present (the first type at the bottom); the legend lists them top-down, as stacked."""
    counts = counts_per_layer(types)  # the same columns `attnprobe classify` prints
    bottom = np.zeros(len(counts))
    for kind in counts.columns:
        if counts[kind].sum() == 0:
            continue  # a type no head has stays out of the bars and the legend
        ax.bar(counts.index, counts[kind], bottom=bottom, color=TYPE_COLORS[kind], label=kind)
        bottom += counts[kind].to_numpy()
    ax.set_title("Head types by layer")
    ax.set_xlabel("layer")
    ax.set_ylabel("number of heads")
    ax.set_ylim(0, max(bottom.max(), 1.0) * 1.02)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    layer_ticks(ax, counts.index)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title="head type")


@any_script_figure
def entropy_heatmap_figure(heads: pd.DataFrame, title: str | None = None) -> Figure:
    check_has_values(heads, "entropy")
    n_layers, n_heads = grid(heads, "entropy").shape
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    figure.colorbar(draw_entropy_heatmap(ax, heads), ax=ax, label=ENTROPY_BAR_LABEL)
    if title is not None:  # the title names what is drawn; the panel's own title says how to read it
        figure.suptitle(plain_text(title))
        ax.set_title("dark = sharp heads, light = diffuse ones", fontsize=10)
    return figure


@any_script_figure
def layer_gradient_figure(
    heads: pd.DataFrame, layers: pd.DataFrame, types: pd.DataFrame, categories: pd.DataFrame | None = None,
    title: str | None = None,
) -> Figure:
    """Entropy by depth (heads, quartile band, mean), by sentence category when there are categories, and the
    head types per layer."""
    if categories is None:
        figure = Figure(figsize=(13.0, 4.8), layout="constrained")
        left, right = figure.subplots(1, 2)
    else:
        figure = Figure(figsize=(19.0, 4.8), layout="constrained")
        left, middle, right = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 1.2, 1.0]})
        draw_category_lines(middle, categories, layers)
    draw_layer_entropy(left, heads, layers)
    draw_type_distribution(right, types)
    if title is not None:
        spaced_suptitle(figure, plain_text(title))
    return figure
