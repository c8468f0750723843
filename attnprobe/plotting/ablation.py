"""`ablate`'s figures: importance (layers x heads), pruning (measures as heads are removed), layer_importance
(whole layers ablated) and importance_vs_type (the measure against entropy and per head type)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnprobe.classify import ALL_TYPES
from attnprobe.errors import AttnprobeError
from attnprobe.plotting.style import (
    CATEGORY_COLORS,
    TYPE_COLORS,
    any_script_figure,
    draw_head_grid,
    grid,
    layer_ticks,
    plain_text,
)

IMPORTANCE_LABELS = {  # ablate's ranking measure: decoders, encoders
    "loss_change": "loss change when ablated (nats/token)",
    "embedding_change": "embedding change when ablated (1 - cosine)",
}


def importance_measure(importance: pd.DataFrame) -> str:
    """The column of importance.csv that ranks heads: loss_change (decoders) or embedding_change (encoders)."""
    return "loss_change" if "loss_change" in importance.columns else "embedding_change"


def full_grid(frame: pd.DataFrame, column: str, shape: tuple[int, int] | None = None) -> pd.DataFrame:
    """Every (layer, head) of a model of `shape` (layers, heads), NaN where `frame` has no row (ablate --heads);
    without `shape`, up to the largest layer and head in `frame`."""
    layers, heads = shape if shape is not None else (int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1)
    index = pd.MultiIndex.from_product([range(layers), range(heads)], names=["layer", "head"])
    values = frame.set_index(["layer", "head"])[column].reindex(index)
    return values.reset_index()


@any_script_figure
def importance_heatmap_figure(
    importance: pd.DataFrame, title: str | None = None, shape: tuple[int, int] | None = None
) -> Figure:
    """A layers x heads grid of the ranking measure: red = the model loses most without the head.

    `shape` (layers, heads) is the model's: with `ablate --heads` only the ablated heads have a value, and the
    others stay grey and blank."""
    column = importance_measure(importance)
    cells = full_grid(importance, column, shape)
    n_layers, n_heads = grid(cells, column).shape
    largest = float(np.nanmax(np.abs(cells[column]))) if cells[column].notna().any() else 0.0
    largest = largest if largest > 0 else 1e-9
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    heading = "Ablating one head: " + IMPORTANCE_LABELS[column]
    ablated = int(cells[column].notna().sum())
    if ablated < len(cells):
        heading += f"\n{ablated} of {len(cells)} heads ablated (grey: not ablated)"
    if column == "embedding_change":  # 1 - cosine is never negative: a sequential scale from 0, 3 significant digits
        image = draw_head_grid(ax, cells, column, heading, "Reds", vmin=0.0, vmax=largest, digits=-3)
    else:  # a loss change goes either way: centred on 0
        image = draw_head_grid(ax, cells, column, heading, "RdBu_r", vmin=-largest, vmax=largest)
    figure.colorbar(image, ax=ax, label=IMPORTANCE_LABELS[column])
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


PRUNING_COLORS = {"ablation": "#d62728", "kl": "#ff7f0e", "gradient": "#1f77b4", "random": "#7f7f7f"}
PRUNING_LABELS = {  # the measures of pruning.csv and layer_importance.csv, as an axis reads them
    "loss_change": "loss change (nats/token)", "kl": "KL(unablated || pruned) (nats/token)",
    "embedding_change": "embedding change (1 - cosine)", "hidden_change": "hidden-state change (1 - cosine)",
}


def pruning_measures(frame: pd.DataFrame) -> list[str]:
    """The measures of pruning.csv or layer_importance.csv drawn, one panel each: decoders loss change and KL,
    encoders embedding and hidden-state change."""
    return [name for name in PRUNING_LABELS if name in frame.columns]


@any_script_figure
def pruning_figure(pruning: pd.DataFrame, title: str | None = None) -> Figure:
    """pruning.csv: each measure against the percent of heads removed, one line per removal order, with its 95%
    interval as a band."""
    measures = pruning_measures(pruning)
    if "order" not in pruning.columns:
        raise AttnprobeError("pruning.csv has no order column: run `attnprobe ablate` again")
    if not measures:
        raise AttnprobeError("pruning.csv has no measure column (loss_change, kl, embedding_change or "
                             "hidden_change): run `attnprobe ablate` again")
    figure = Figure(figsize=(6.0 * len(measures) + 1.5, 4.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(measures)))
    for ax, name in zip(axes, measures):
        for k, (order, group) in enumerate(pruning.groupby("order", sort=False)):
            group = group.sort_values("percent")
            color = PRUNING_COLORS.get(str(order), CATEGORY_COLORS[k % len(CATEGORY_COLORS)])
            if {f"{name}_ci_low", f"{name}_ci_high"} <= set(group.columns):
                ax.fill_between(group["percent"], group[f"{name}_ci_low"], group[f"{name}_ci_high"], color=color,
                                alpha=0.15, linewidth=0)
            ax.plot(group["percent"], group[name], marker="o", markersize=3, color=color,
                    label=plain_text(str(order)))
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("heads removed (% of all heads)")
        ax.set_ylabel(PRUNING_LABELS[name])
        ax.set_title(f"{name} as heads are removed (bands: 95% intervals)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="removal order (least important first)")
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


@any_script_figure
def layer_importance_figure(layers: pd.DataFrame, title: str | None = None) -> Figure:
    """layer_importance.csv: per layer, each measure with every head of the layer ablated at once, as bars with
    their 95% intervals."""
    measures = pruning_measures(layers)
    if not measures:
        raise AttnprobeError("layer_importance.csv has no measure column: run `attnprobe ablate --layers` again")
    figure = Figure(figsize=(max(6.0, 0.35 * len(layers) + 3.0) * len(measures), 4.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(measures)))
    for ax, name in zip(axes, measures):
        values = layers[name].to_numpy(dtype=float)
        errors = None
        if {f"{name}_ci_low", f"{name}_ci_high"} <= set(layers.columns):
            errors = np.clip(np.vstack([values - layers[f"{name}_ci_low"].to_numpy(dtype=float),
                                        layers[f"{name}_ci_high"].to_numpy(dtype=float) - values]), 0.0, None)
        ax.bar(layers["layer"], values, color="#d6604d", yerr=errors, ecolor="black", capsize=2)
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("layer")
        ax.set_ylabel(PRUNING_LABELS[name])
        ax.set_title(f"Ablating a whole layer: {name} (bars: 95% intervals)", fontsize=10)
        layer_ticks(ax, layers["layer"])
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


def draw_importance_vs_entropy(ax: Axes, merged: pd.DataFrame, column: str) -> None:
    """One dot per head: entropy (x) against the ablation measure (y), with its 95% interval, coloured by type."""
    ax.errorbar(merged["entropy"], merged[column],
                yerr=[merged[column] - merged[f"{column}_ci_low"], merged[f"{column}_ci_high"] - merged[column]],
                fmt="none", ecolor="#bbbbbb", elinewidth=0.6, zorder=1)
    for kind, group in merged.groupby("head_type", sort=False):
        ax.scatter(group["entropy"], group[column], s=14, color=TYPE_COLORS.get(str(kind), "#333333"),
                   label=plain_text(f"{kind} ({len(group)})"), zorder=2)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("mean attention entropy (nats, heads.csv)")
    ax.set_ylabel(IMPORTANCE_LABELS[column])
    ax.set_title("Do sharp heads matter more?")
    ax.legend(loc="best", fontsize=8, title="head type")


def draw_importance_by_type(ax: Axes, merged: pd.DataFrame, column: str) -> None:
    """The ablation measure of every head of each type, jittered, with the type's median as a bar."""
    kinds = [k for k in ALL_TYPES if k in set(merged["head_type"])]
    kinds += sorted(set(merged["head_type"]) - set(kinds))
    jitter = np.random.default_rng(0)
    for x, kind in enumerate(kinds):
        values = merged.loc[merged["head_type"] == kind, column].dropna().to_numpy()
        ax.scatter(x + jitter.uniform(-0.2, 0.2, len(values)), values, s=12,
                   color=TYPE_COLORS.get(kind, "#333333"), alpha=0.8)
        if len(values):
            ax.hlines(np.median(values), x - 0.3, x + 0.3, color="black", linewidth=1.5)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(kinds)), [plain_text(str(kind)) for kind in kinds])
    ax.set_xlabel("head type (bar: median)")
    ax.set_ylabel(IMPORTANCE_LABELS[column])
    ax.set_title("Ablation by head type")


@any_script_figure
def importance_vs_type_figure(
    importance: pd.DataFrame, heads: pd.DataFrame, types: pd.DataFrame | None = None, title: str | None = None
) -> Figure:
    """Left: ablation measure against entropy, coloured by head type; right: the measure per type."""
    column = importance_measure(importance)
    merged = importance.merge(heads[["layer", "head", "entropy"]], on=["layer", "head"])
    if types is not None:
        merged = merged.merge(types[["layer", "head", "head_type"]], on=["layer", "head"], how="left")
        merged["head_type"] = merged["head_type"].fillna("unknown")
    else:
        merged["head_type"] = "all heads"
    figure = Figure(figsize=(13.0, 4.8), layout="constrained")
    left, right = figure.subplots(1, 2, sharey=True)
    draw_importance_vs_entropy(left, merged, column)
    draw_importance_by_type(right, merged, column)
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure
