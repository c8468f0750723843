"""`probe`'s probe_heatmap: one layers x heads panel per synthetic probe, with chance on the colour bar."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from attnprobe.plotting.style import any_script_figure, draw_head_grid, grid, plain_text, spaced_suptitle


@any_script_figure
def probe_heatmap_figure(
    scores: pd.DataFrame, kinds: list[str], model: str, chance: dict[str, float] | None = None
) -> Figure:
    """One layers x heads panel per probe kind, stacked, on a shared 0-1 scale (dark = strong); `chance` (per kind, the
    score of uniform attention) is drawn as a red line on the colour bar."""
    n_layers, n_heads = grid(scores, kinds[0]).shape
    width = float(np.clip(0.45 * n_heads + 2.0, 6.0, 15.0))  # panels stacked: the figure is as wide as one panel
    panel = float(np.clip(0.32 * n_layers + 1.3, 2.6, 24.0 / len(kinds)))  # and at most ~26 in tall in all
    figure = Figure(figsize=(width + 1.5, panel * len(kinds) + 1.0), layout="constrained")
    axes = np.atleast_1d(figure.subplots(len(kinds), 1))
    image = None
    chance = {k: float(v) for k, v in (chance or {}).items() if k in kinds}
    for ax, kind in zip(axes, kinds):
        heading = f"{kind} score" + (f" (chance {chance[kind]:.3f})" if kind in chance else "")
        image = draw_head_grid(ax, scores, kind, heading, "Purples", vmin=0.0, vmax=1.0)
    label = "mean attention to the target token"
    bar = figure.colorbar(image, ax=list(axes), label=label, shrink=0.8)
    if chance:
        levels: dict[str, list[str]] = {}
        for kind, value in chance.items():
            levels.setdefault(f"{value:.3f}", []).append(kind)
            bar.ax.axhline(value, color="#d62728", linewidth=2.0)
        where = "; ".join(f"{', '.join(names)} {level}" for level, names in levels.items())
        bar.set_label(f"{label}\nred line: chance, uniform attention ({where})")
    spaced_suptitle(figure, f"Synthetic probes on {plain_text(model)}: random tokens repeated twice")
    return figure
