"""`ablate --method streaming`'s streaming.png: the loss change and the KL against the share of KV heads made
streaming, per order and task."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnprobe.plotting.style import CATEGORY_COLORS, any_script_figure, plain_text

STREAMING_COLORS = {"pattern": "#1f77b4", "random": "#7f7f7f"}
STREAMING_LABELS = {"loss_change": "loss change (nats/token)", "kl": "KL(full cache || streaming) (nats/token)"}
STREAMING_TITLES = {"loss_change": "Loss change", "kl": "KL from the full cache"}  # the panels' titles, in words


@any_script_figure
def streaming_figure(curve: pd.DataFrame, title: str | None = None) -> Figure:
    """streaming.csv: the loss change and the KL against the share of KV heads made streaming, one line per order
    (the pattern's, lowest score first, and random) with its 95% interval as a band; the chosen heads as a star.
    One row of panels per task (text, needle) where the table has a `task` column.

    Without a curve (`--no-pruning`: only the chosen heads' row) each panel shows that one result as a star with its
    95% interval as an error bar, and no band or legend; an order measured at one share only (`--shares 0.5`) is a
    point with an error bar too, not a one-point line."""
    tasks = list(dict.fromkeys(curve["task"])) if "task" in curve.columns else [None]
    figure = Figure(figsize=(13.5, 4.6 * len(tasks)), layout="constrained")
    axes = np.atleast_2d(figure.subplots(len(tasks), len(STREAMING_LABELS)))  # [task, measure]
    for task, row_axes in zip(tasks, axes):
        rows = curve if task is None else curve[curve["task"] == task]
        for ax, name in zip(row_axes, STREAMING_LABELS):
            streaming_panel(ax, rows, name)
            if task is not None:
                ax.set_title(f"{task} task: {ax.get_title()}", fontsize=10)
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


def streaming_panel(ax: Axes, curve: pd.DataFrame, name: str) -> None:
    """One measure of streaming.csv's rows against the share of KV heads streaming: a line and band per order
    measured at two shares or more, a point with an error bar where one share, and the chosen heads as a star."""
    def error_bar(x: float, row: pd.Series, **style: Any) -> None:
        low, high = row[name] - row[f"{name}_ci_low"], row[f"{name}_ci_high"] - row[name]
        ax.errorbar([x], [row[name]], yerr=[[max(low, 0.0)], [max(high, 0.0)]], capsize=3, linestyle="none", **style)

    words = STREAMING_TITLES[name]
    lines = 0
    for k, (order, group) in enumerate(curve[curve["order"] != "chosen"].groupby("order", sort=False)):
        group = group.sort_values("share")
        color = STREAMING_COLORS.get(str(order), CATEGORY_COLORS[k % len(CATEGORY_COLORS)])
        percent = 100 * group["share"]
        if group["share"].nunique() < 2:  # one share: no curve to draw
            for _, row in group.iterrows():
                error_bar(100 * row["share"] + 1.5 * k, row, marker="o", markersize=5, color=color,  # side by side
                          label=plain_text(str(order)))
            continue
        lines += 1
        ax.fill_between(percent, group[f"{name}_ci_low"], group[f"{name}_ci_high"], color=color, alpha=0.15,
                        linewidth=0)
        ax.plot(percent, group[name], marker="o", markersize=3, color=color, label=plain_text(str(order)))
    chosen = curve[curve["order"] == "chosen"]
    for _, row in chosen.iterrows():
        error_bar(100 * row["share"], row, marker="*", markersize=11, color="#d62728",
                  label=f"chosen ({int(row['kv_heads_streaming'])} KV heads)")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("KV heads streaming (% of all KV heads)")
    ax.set_ylabel(STREAMING_LABELS[name])
    if lines:
        ax.set_title(f"{words} as KV heads keep only sink + recent keys (bands: 95% intervals)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="order (lowest score first)")
        return
    ax.set_xlim(0.0, 100.0)  # a point alone: where it sits among all KV heads
    if len(ax.get_legend_handles_labels()[0]) > 1:  # the chosen heads and orders at one share each
        ax.set_title(f"{words} at one share per order (bars: 95% intervals; no curve)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="order (lowest score first)")
    else:
        ax.set_title(f"{words} with the chosen KV heads streaming (bar: 95% interval; no curve)", fontsize=10)
        for _, row in chosen.iterrows():
            ax.annotate(f"chosen: {int(row['kv_heads_streaming'])} KV heads", (100 * row["share"], row[name]),
                        xytext=(8, 6), textcoords="offset points", fontsize=8, color="#d62728")
