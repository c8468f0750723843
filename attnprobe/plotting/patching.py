"""`patch`'s figure: the patching effect of each head, layers x heads, diverging colours around 0 (one panel per
method: activation and attribution patching side by side when both ran)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from attnprobe.plotting.ablation import full_grid
from attnprobe.plotting.style import any_script_figure, draw_head_grid, plain_text

PATCHING_LABELS = {"effect": "activation patching effect", "attribution": "attribution patching estimate"}


def per_head(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """One value per head: the table's own rows, or (per position) the position with the largest |effect|."""
    if "position" not in table.columns:
        return table[["layer", "head", column]]
    ranked = table.assign(size=table[column].abs()).sort_values("size", ascending=False, kind="stable")
    return ranked.drop_duplicates(["layer", "head"])[["layer", "head", column]]


@any_script_figure
def patching_figure(table: pd.DataFrame, shape: tuple[int, int], title: str | None = None,
                    direction: str = "denoise") -> Figure:
    """patching.csv as layers x heads grids: red = the head carries the behaviour (1: alone, all of it); with
    --positions each, each head's strongest position."""
    columns = [c for c in PATCHING_LABELS if c in table.columns]
    layers, heads = shape
    figure = Figure(figsize=(max(6.0, 0.6 * heads + 2.5) * len(columns), max(4.0, 0.4 * layers + 1.5)),
                    layout="constrained")
    cells = {c: full_grid(per_head(table, c), c, shape) for c in columns}
    largest = max([float(np.nanmax(np.abs(v[c]))) for c, v in cells.items() if v[c].notna().any()] or [1e-9])
    for k, column in enumerate(columns):
        ax = figure.add_subplot(1, len(columns), k + 1)
        heading = f"{PATCHING_LABELS[column]} ({direction})"
        if "position" in table.columns:
            heading += "\neach head's strongest position"
        image = draw_head_grid(ax, cells[column], column, heading, "RdBu_r", vmin=-largest, vmax=largest)
        figure.colorbar(image, ax=ax, label=PATCHING_LABELS[column])
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure
