"""Figures from result tables. Each `draw_*` fills the Axes it is given; nothing here writes files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
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
                label=f"{side.upper()}: {label}")  # a depth grid interpolates between layers: no markers
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
        ax.bar(x + offset, types[f"fraction_{side}"], width=0.4, color=color, label=f"{side.upper()}: {label}")
    ax.set_xticks(x, types["head_type"])
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
    figure.suptitle(f"B - A, {info['pairing']} bootstrap over sentences; {matched}", fontsize=11)
    return figure


IMPORTANCE_LABELS = {  # ablate's ranking measure: decoders, encoders
    "loss_change": "loss change when ablated (nats/token)",
    "embedding_change": "embedding change when ablated (1 - cosine)",
}


def importance_measure(importance: pd.DataFrame) -> str:
    """The column of importance.csv that ranks heads: loss_change (decoders) or embedding_change (encoders)."""
    return "loss_change" if "loss_change" in importance.columns else "embedding_change"


def full_grid(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Every (layer, head) up to the largest of each, NaN where `frame` has no row (ablate --heads)."""
    layers, heads = int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1
    index = pd.MultiIndex.from_product([range(layers), range(heads)], names=["layer", "head"])
    values = frame.set_index(["layer", "head"])[column].reindex(index)
    return values.reset_index()


def importance_heatmap_figure(importance: pd.DataFrame, title: str | None = None) -> Figure:
    """A layers x heads grid of the ranking measure: red = the model loses most without the head."""
    column = importance_measure(importance)
    cells = full_grid(importance, column)
    n_layers, n_heads = grid(cells, column).shape
    largest = float(np.nanmax(np.abs(cells[column]))) if cells[column].notna().any() else 0.0
    largest = largest if largest > 0 else 1e-9
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)))
    ax = figure.add_subplot()
    heading = "Ablating one head: " + IMPORTANCE_LABELS[column]
    image = draw_head_grid(ax, cells, column, heading, "RdBu_r", vmin=-largest, vmax=largest)
    figure.colorbar(image, ax=ax, label=IMPORTANCE_LABELS[column])
    if title is not None:
        figure.suptitle(title)
    return figure


def draw_importance_vs_entropy(ax: Axes, merged: pd.DataFrame, column: str) -> None:
    """One dot per head: entropy (x) against the ablation measure (y), with its 95% interval, coloured by type."""
    ax.errorbar(merged["entropy"], merged[column],
                yerr=[merged[column] - merged[f"{column}_ci_low"], merged[f"{column}_ci_high"] - merged[column]],
                fmt="none", ecolor="#bbbbbb", elinewidth=0.6, zorder=1)
    for kind, group in merged.groupby("head_type", sort=False):
        ax.scatter(group["entropy"], group[column], s=14, color=TYPE_COLORS.get(str(kind), "#333333"),
                   label=f"{kind} ({len(group)})", zorder=2)
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
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_xlabel("head type (bar: median)")
    ax.set_ylabel(IMPORTANCE_LABELS[column])
    ax.set_title("Ablation by head type")


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
        figure.suptitle(title)
    return figure


def short_text(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rollout_figure(rollout: Any, model: str) -> Figure:
    """Per example sentence (one row each): the rollout through every layer beside the last layer's raw map.

    `rollout` is a rollout.Rollout; both panels are head-averaged, on the same 0-1 scale.
    """
    rows = len(rollout.tokens)
    n = max(len(tokens) for tokens in rollout.tokens)
    side = min(7.0, max(3.5, 0.18 * n + 1.5))  # inches per panel
    figure = Figure(figsize=(2 * side + 1.2, rows * (side + 0.6) + 0.6), layout="constrained")
    axes = np.atleast_2d(figure.subplots(rows, 2, squeeze=False))  # [sentence, panel]
    image = None
    for s, tokens in enumerate(rollout.tokens):
        layers = rollout.rollout[s].shape[0]
        total = rollout.total_tokens[s]
        cut = f" (first {len(tokens)} of {total} tokens)" if total > len(tokens) else ""
        draw_pattern(axes[s, 0], rollout.rollout[s][-1], tokens,
                     f"rollout through {layers} layers{cut}\n{short_text(rollout.sentences[s])}")
        image = draw_pattern(axes[s, 1], rollout.raw[s], tokens, f"raw attention, last layer (layer {layers - 1})")
    figure.colorbar(image, ax=list(axes.ravel()), label="share of the row (heads averaged)", shrink=0.6)
    figure.suptitle(f"Attention rollout of {model}: heads averaged, residual as identity with weight "
                    f"{rollout.residual:g}")
    return figure
