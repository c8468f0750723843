"""`compare`'s compare.png: B - A per head and per layer (same shapes), or by relative depth (different shapes)."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from attnprobe.plotting.style import MAX_ANNOTATED_CELLS, any_script_figure, grid, plain_text

DIFF_CMAP = "RdBu_r"  # B - A: blue where B is lower, red where higher, white at 0


def difference_norm(values: np.ndarray) -> TwoSlopeNorm:
    """Centred on 0 and symmetric, so equal colours mean equal changes either way (all zeros too)."""
    largest = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    largest = largest if largest > 0 else 1e-9
    return TwoSlopeNorm(vcenter=0.0, vmin=-largest, vmax=largest)


def draw_difference_grid(ax: Axes, heads: pd.DataFrame, score: str) -> Any:
    """B - A of one score per head (compare_heads.csv), a box around heads whose interval excludes 0."""
    values = grid(heads, f"{score}_diff")  # [layer, head]
    changed = (grid(heads, f"{score}_diff_ci_low") > 0) | (grid(heads, f"{score}_diff_ci_high") < 0)  # [layer, head]
    norm = difference_norm(values)
    image = ax.imshow(values, cmap=DIFF_CMAP, norm=norm, aspect="auto", interpolation="nearest")
    n_layers, n_heads = values.shape
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"B - A: {score} per head (boxed: 95% interval excludes 0)", fontsize=10)
    for (layer, head), flag in np.ndenumerate(changed):
        if flag:
            ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.4))
    if values.size <= MAX_ANNOTATED_CELLS:
        digits = 2 if norm.vmax >= 0.5 else 3
        size = 7 if values.size <= 160 else 5
        for (layer, head), value in np.ndenumerate(values):
            color = "white" if abs(value) > 0.6 * norm.vmax else "black"
            ax.text(head, layer, f"{value:+.{digits}f}", ha="center", va="center", fontsize=size, color=color)
    return image


def draw_compared_layers(ax: Axes, layers: pd.DataFrame, score: str, labels: tuple[str, str], x: str) -> None:
    """Both runs' mean over heads per layer (x = `layer`) or per relative depth (x = `depth`), with intervals."""
    for side, label, color in (("a", labels[0], "#4d4d4d"), ("b", labels[1], "#d6604d")):
        ax.fill_between(layers[x], layers[f"{score}_{side}_ci_low"], layers[f"{score}_{side}_ci_high"], color=color,
                        alpha=0.2, linewidth=0)
        ax.plot(layers[x], layers[f"{score}_{side}"], marker="o" if x == "layer" else None, markersize=3, color=color,
                label=plain_text(f"{side.upper()}: {label}"))  # a depth grid interpolates between layers: no markers
    ax.set_xlabel("relative depth, layer / (layers - 1)" if x == "depth" else "layer")
    ax.set_ylabel(f"{score}, mean over the layer's heads")
    ax.set_title(f"{score} by {'relative depth' if x == 'depth' else 'layer'} (bands: 95% intervals)", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    if x == "layer":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_type_fractions(ax: Axes, types: pd.DataFrame | None, labels: tuple[str, str]) -> None:
    """Share of heads of each type in A and B, side by side."""
    ax.set_title("Head types (share of all heads)", fontsize=10)
    if types is None:
        ax.text(0.5, 0.5, "head types not comparable\n(different classify schemes)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    x = np.arange(len(types))
    for offset, side, label, color in ((-0.2, "a", labels[0], "#4d4d4d"), (0.2, "b", labels[1], "#d6604d")):
        ax.bar(x + offset, types[f"fraction_{side}"], width=0.4, color=color,
               label=plain_text(f"{side.upper()}: {label}"))
    ax.set_xticks(x, [plain_text(str(kind)) for kind in types["head_type"]])
    ax.set_ylabel("fraction of heads")
    ax.legend(loc="best", fontsize=8)


def draw_layer_difference(ax: Axes, layers: pd.DataFrame, score: str, x: str) -> None:
    """B - A of the layer means per layer or per relative depth, with its 95% interval and a line at 0."""
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.fill_between(layers[x], layers[f"{score}_diff_ci_low"], layers[f"{score}_diff_ci_high"], color="#d6604d",
                    alpha=0.25, linewidth=0, label="95% interval")
    ax.plot(layers[x], layers[f"{score}_diff"], marker="o" if x == "layer" else None, markersize=3, color="#b2182b",
            label="B - A")
    ax.set_xlabel("relative depth, layer / (layers - 1)" if x == "depth" else "layer")
    ax.set_ylabel(f"B - A ({score})")
    ax.set_title(f"B - A of the layer means of {score}", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    if x == "layer":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_label(side: dict[str, Any]) -> str:
    """`model (dtype) on corpus` of one side of compare.json."""
    model = (side.get("model") or {}).get("spec") or side.get("label", "?")
    dtype = f" ({side['dtype']})" if side.get("dtype") else ""
    corpus = (side.get("corpus") or {}).get("path")
    return f"{model}{dtype}" + (f" on {PurePath(str(corpus)).name}" if corpus else "")


@any_script_figure
def compare_figure(
    layers: pd.DataFrame, info: dict[str, Any], heads: pd.DataFrame | None = None, types: pd.DataFrame | None = None,
    score: str | None = None,
) -> Figure:
    """compare.png. Same shape: the B - A heatmap, both layer gradients and their difference.
    Different shapes: both curves and their difference by relative depth, and the head-type shares."""
    score = score or info["score"]
    labels = (info["a"]["label"], info["b"]["label"])
    if heads is not None:
        n_layers, n_heads = grid(heads, f"{score}_diff").shape
        width, height = max(6.0, 0.6 * n_heads + 2.5), max(7.0, 0.4 * n_layers + 1.5)
        figure = Figure(figsize=(width + 6.5, height), layout="constrained")
        spec = figure.add_gridspec(2, 2, width_ratios=[width, 6.5])
        heatmap = figure.add_subplot(spec[:, 0])
        figure.colorbar(draw_difference_grid(heatmap, heads, score), ax=heatmap, label=f"B - A ({score})")
        draw_compared_layers(figure.add_subplot(spec[0, 1]), layers, score, labels, "layer")
        draw_layer_difference(figure.add_subplot(spec[1, 1]), layers, score, "layer")
    else:
        figure = Figure(figsize=(18.0, 4.8), layout="constrained")
        curves, difference, shares = figure.subplots(1, 3)
        draw_compared_layers(curves, layers, score, labels, "depth")
        draw_layer_difference(difference, layers, score, "depth")
        draw_type_fractions(shares, types, labels)
    matched = "heads matched by position" if heads is not None else "heads not matched (different shapes)"
    figure.suptitle(plain_text(f"B - A: B = {run_label(info['b'])}, A = {run_label(info['a'])}\n"
                               f"{info['pairing']} bootstrap over {info.get('bootstrap_over', 'sentences')}; "
                               f"{matched}"), fontsize=11)
    return figure
