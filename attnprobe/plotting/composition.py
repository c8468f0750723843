"""`compose`'s composition.png: the strongest Q-, K- and V-composition edges between heads, one panel per mode."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

from attnprobe.plotting.style import layer_ticks, plain_text

EDGE_CMAP = "viridis_r"  # darker: stronger
MODE_TITLES = {"Q": "Q-composition (the receiver's queries read what the sender writes)",
               "K": "K-composition (the receiver's keys read it)",
               "V": "V-composition (the receiver's values read it)"}


def composition_figure(table: pd.DataFrame, layers: int, heads: int, baseline: float, spread: float, model: str,
                       top: int = 30) -> Figure:
    """One panel per mode of composition.csv's rows: every head a dot at (layer, head), the `top` strongest
    sender -> receiver edges as arrows, coloured by the score over the random baseline (one scale for all panels)."""
    modes = [mode for mode in ("Q", "K", "V") if (table["mode"] == mode).any()]
    strongest = {mode: table[table["mode"] == mode].nlargest(top, "score") for mode in modes}
    ratios = np.concatenate([rows["score"].to_numpy() / baseline for rows in strongest.values()]) \
        if strongest else np.ones(1)
    norm = Normalize(vmin=min(1.0, float(ratios.min())), vmax=max(float(ratios.max()), 1.0 + 1e-9))
    cmap = colormaps[EDGE_CMAP]
    width = min(16.0, max(8.0, 2.0 + 0.35 * layers))  # inches
    figure = Figure(figsize=(width, max(2.2, 0.3 * heads + 1.2) * len(modes) + 0.8), layout="constrained")
    axes = np.atleast_1d(figure.subplots(len(modes), 1, squeeze=False)[:, 0])
    for ax, mode in zip(axes, modes):
        draw_edges(ax, strongest[mode], layers, heads, cmap, norm)
        ax.set_title(f"{MODE_TITLES[mode]}: the {len(strongest[mode])} strongest of "
                     f"{int((table['mode'] == mode).sum()):,} pairs", fontsize=9, loc="left")
    mappable = figure.colorbar(_scalar(cmap, norm), ax=list(axes), location="bottom", shrink=0.6, aspect=40)
    mappable.set_label(f"score / random baseline ({baseline:.3f})")
    figure.suptitle(plain_text(f"Composition of {model}'s heads, from weights folded as TransformerLens folds them\n"
                               f"(random matrices of the same shapes score {baseline:.3f} ± {spread:.3f})"),
                    fontsize=10)
    return figure


def draw_edges(ax, rows: pd.DataFrame, layers: int, heads: int, cmap, norm) -> None:
    """Every head as a grey dot at (layer, head) and each row of `rows` as an arrow from its sender to its
    receiver, weakest first so the strongest lie on top."""
    grid_layer, grid_head = np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij")  # [layer, head] each
    ax.scatter(grid_layer.ravel(), grid_head.ravel(), s=6, color="#bdbdbd", zorder=1)
    for row in rows.sort_values("score").itertuples():
        ratio = row.score / float(row.baseline)
        arrow = FancyArrowPatch((row.sender_layer, row.sender_head), (row.receiver_layer, row.receiver_head),
                                connectionstyle="arc3,rad=0.15", arrowstyle="-|>", mutation_scale=7,
                                color=cmap(norm(ratio)), linewidth=0.6 + 1.6 * norm(ratio), zorder=2)
        ax.add_patch(arrow)
    involved = pd.concat([rows[["sender_layer", "sender_head"]].set_axis(["layer", "head"], axis=1),
                          rows[["receiver_layer", "receiver_head"]].set_axis(["layer", "head"], axis=1)])
    ax.scatter(involved["layer"], involved["head"], s=14, color="#252525", zorder=3)
    ax.set_ylim(heads - 0.5, -0.5)
    layer_ticks(ax, range(layers))
    ax.set_yticks(range(heads))
    ax.set_xlabel("layer")
    ax.set_ylabel("head")


def _scalar(cmap, norm):
    from matplotlib.cm import ScalarMappable

    return ScalarMappable(norm=norm, cmap=cmap)
