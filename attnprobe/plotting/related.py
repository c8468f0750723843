"""`related`'s figures, drawn by `plot`: head_similarity (the JS divergence matrix, clustered) and head_map (the
heads placed by multidimensional scaling)."""

from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from attnprobe.classify import ALL_TYPES
from attnprobe.naming import counted, head_name
from attnprobe.plotting.style import TYPE_COLORS, any_script_figure, plain_text, spaced_suptitle

SIMILARITY_CMAP = "viridis"  # dark = alike (low JS), light = different: dark = low, as every grid here
SIMILARITY_BAR_LABEL = "Jensen-Shannon divergence (nats): dark = alike, light = different (ln 2 = 0.693: disjoint)"
MAX_HEAD_LABELS = 64  # up to this many heads the similarity matrix names every head; beyond, only the labelled ones
NO_TYPE_COLOR = "#333333"  # a head without a type (no head_types.csv row)


def head_kinds(layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None) -> list[str]:
    """The head type of each (layers[i], heads[i]) from head_types.csv's table ("" where it has none)."""
    if types is None:
        return [""] * len(layers)
    known = {(int(r.layer), int(r.head)): str(r.head_type) for r in types[["layer", "head", "head_type"]].itertuples()}
    return [known.get((int(layer), int(head)), "") for layer, head in zip(layers, heads)]


def type_handles(kinds: list[str]) -> list[Any]:
    """Legend patches of the types present, in classify's order, with their counts."""
    present = [k for k in ALL_TYPES if k in kinds] + sorted({k for k in kinds if k and k not in ALL_TYPES})
    return [Rectangle((0, 0), 1, 1, color=TYPE_COLORS.get(kind, NO_TYPE_COLOR),
                      label=plain_text(f"{kind} ({kinds.count(kind)})")) for kind in present]


CLUSTERS = 12  # a matrix of more than MAX_HEAD_LABELS heads is summarised as this many clusters of its tree
MAX_NAMED = 24  # at most this many heads named on a matrix or map of many heads
NAME_POINTS = 7  # the font size of those names; two names stay at least 1.4 times it apart


def cluster_exemplars(js: np.ndarray, clusters: np.ndarray) -> dict[int, int]:
    """Per cluster id, its most central head: the one of smallest mean JS to the others of its cluster."""
    out = {}
    for label in np.unique(clusters):
        members = np.flatnonzero(clusters == label)
        inner = js[np.ix_(members, members)].mean(axis=1)  # [member]
        out[int(label)] = int(members[int(np.argmin(inner))])
    return out


def spaced_names(wanted: list[int], position: np.ndarray, gap: float, limit: int = MAX_NAMED) -> list[int]:
    """Of the heads `wanted` (most important first), at most `limit` whose `position`s (in head units along the
    axis) lie at least `gap` apart, so their names do not overlap; later ones that would are left out."""
    kept: list[int] = []
    for i in dict.fromkeys(wanted):
        if len(kept) < limit and all(abs(position[i] - position[j]) >= gap for j in kept):
            kept.append(i)
    return kept


def cluster_summary(js: np.ndarray, clusters: np.ndarray, order: np.ndarray, kinds: list[str],
                    names: list[str]) -> list[tuple[int, int, int, str]]:
    """Per cluster in the matrix's order: (first position, last position + 1, its number from 1, a line saying its
    heads, mean JS within it, its commonest head type and its most central head)."""
    exemplar = cluster_exemplars(js, clusters)
    rows, start = [], 0
    ordered = clusters[order]
    for end in range(1, len(order) + 1):
        if end < len(order) and ordered[end] == ordered[start]:
            continue
        members = order[start:end]
        inner = js[np.ix_(members, members)]
        within = float(inner[np.triu_indices(len(members), k=1)].mean()) if len(members) > 1 else 0.0
        types = [kinds[i] for i in members if kinds[i]]
        common = max(dict.fromkeys(types), key=types.count) if types else ""  # a tie: the first in matrix order
        share = f", {types.count(common) / len(members):.0%} {common}" if common else ""
        number = len(rows) + 1
        rows.append((start, end, number, f"C{number}: {counted(len(members), 'head')}, JS within {within:.3f}{share}; "
                                         f"centre {names[exemplar[int(ordered[start])]]}"))
        start = end
    return rows


def names_caption(named: list[int], chosen: list[int], centres: list[int]) -> str:
    """What the names on a matrix of many heads are, as counted (a caption once said every cluster's centre
    was named where three were left out, their names too close to others)."""
    shown = set(named)
    chosen_shown = len(shown & set(chosen))
    centres_shown = sum(1 for i in centres if i in shown)
    parts = []
    if chosen:
        parts.append(f"{chosen_shown} of the {counted(len(set(chosen)), 'chosen head')}"
                     if chosen_shown < len(set(chosen)) else f"the {counted(len(set(chosen)), 'chosen head')}")
    if centres_shown == len(centres):
        parts.append("each cluster's centre")
    else:
        parts.append(f"the centres of {centres_shown} of the {counted(len(centres), 'cluster')}")
    left_out = "\n(names that would overlap are left out; every centre is listed on the right)" \
        if chosen_shown < len(set(chosen)) or centres_shown < len(centres) else ""
    return f"{len(named)} named: {' and '.join(parts)}{left_out}"


@any_script_figure
def head_similarity_figure(
    js: np.ndarray, layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None = None,
    labelled: list[tuple[int, int]] | None = None, title: str | None = None,
) -> Figure:
    """The [head, head] JS divergences of `attnprobe related`, rows and columns reordered by hierarchical
    clustering (average linkage on sqrt(JS)), with a strip of head-type colours on the left.

    Up to MAX_HEAD_LABELS heads the tree is drawn above and every head named. Beyond, the tree is cut into
    CLUSTERS clusters, shown as numbered bands above the matrix and lines across it and listed on the right
    (size, mean JS within, commonest type, most central head); at most MAX_NAMED heads are named (the `labelled`
    (layer, head)s first, then each cluster's centre), spaced so that no two names overlap."""
    from scipy.cluster.hierarchy import dendrogram, fcluster, leaves_list

    from attnprobe.headspace import LN2, cluster

    n = len(layers)
    tree = cluster(js) if n >= 2 else None
    order = leaves_list(tree) if tree is not None else np.arange(n)  # the tree's leaves, left to right
    names = [head_name(layers[i], heads[i]) for i in range(n)]
    kinds = head_kinds(layers, heads, types)
    many = n > MAX_HEAD_LABELS
    side = 9.0 if many else min(11.0, max(5.0, 0.16 * n + 3.0))
    listing = 4.2 if many else 0.0  # inches of the cluster list on the right
    figure = Figure(figsize=(side + 1.8 + listing, side + 2.6), layout="constrained")
    grid = figure.add_gridspec(2, 3 if many else 2, width_ratios=[0.35, side, listing][: 3 if many else 2],
                               height_ratios=[0.5 if many else 1.4, side])
    corner, tree_ax = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1])
    ax = figure.add_subplot(grid[1, 1])
    strip = figure.add_subplot(grid[1, 0], sharey=ax)
    image = ax.imshow(js[np.ix_(order, order)], cmap=SIMILARITY_CMAP, vmin=0.0, vmax=LN2, aspect="auto",
                      interpolation="nearest")
    colours = [matplotlib.colors.to_rgb(TYPE_COLORS.get(kinds[i], NO_TYPE_COLOR) if kinds[i] else "#ffffff")
               for i in order]
    strip.imshow(np.asarray(colours)[:, None, :], aspect="auto", interpolation="nearest")
    strip.set_xticks([])
    strip.set_ylabel("head type", fontsize=9)
    if types is None:
        strip.set_axis_off()  # no head types: no strip
    if not many:
        if tree is not None:  # the leaves sit at x = 5, 15, ...: the tree spans [0, 10 n] over the matrix's n columns
            dendrogram(tree, ax=tree_ax, no_labels=True, link_color_func=lambda _: "#555555")
            tree_ax.set_xlim(0, 10 * n)
        tree_ax.set_title("average-linkage tree on sqrt(JS)", fontsize=9)
        size = 8 if n <= 32 else 6
        ax.set_xticks(range(n), [names[i] for i in order], rotation=90, fontsize=size)
        ax.set_yticks(range(n), [names[i] for i in order], fontsize=size)
    else:
        clusters = fcluster(tree, t=min(CLUSTERS, n), criterion="maxclust")  # [head]: contiguous in the leaf order
        summary = cluster_summary(js, clusters, order, kinds, names)
        draw_cluster_bands(tree_ax, ax, summary, n, side)
        listed = figure.add_subplot(grid[1, 2])
        listed.set_axis_off()
        for k, (_, _, _, line) in enumerate(summary):
            listed.text(0.0, 1.0 - (k + 0.5) / max(len(summary), CLUSTERS), plain_text(line), fontsize=8,
                        va="center", ha="left", transform=listed.transAxes, wrap=False)
        listed.set_title("clusters of the tree, in matrix order", fontsize=9, loc="left")
        where = np.empty(n)
        where[order] = np.arange(n)  # [head]: its position in the matrix
        index = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(layers, heads))}
        chosen = [index[(int(a), int(b))] for a, b in labelled or [] if (int(a), int(b)) in index]
        centres = cluster_exemplars(js, clusters)
        centre_list = [centres[int(clusters[order[start]])] for start, *_ in summary]
        gap = 1.4 * NAME_POINTS / (side * 72 / n)  # heads between two names: 1.4 font heights
        named = sorted(spaced_names(chosen + centre_list, where, gap), key=lambda i: where[i])
        ax.set_xticks([where[i] for i in named], [names[i] for i in named], rotation=90, fontsize=NAME_POINTS)
        ax.set_yticks([where[i] for i in named], [names[i] for i in named], fontsize=NAME_POINTS)
        ax.set_xlabel(f"{counted(n, 'head')} in cluster order; {names_caption(named, chosen, centre_list)}",
                      fontsize=9)
    tree_ax.set_axis_off()
    ax.yaxis.tick_right()
    strip.tick_params(axis="y", left=False, labelleft=False)  # the names are on the matrix's right
    figure.colorbar(image, ax=ax, location="bottom", shrink=0.7, label=SIMILARITY_BAR_LABEL)
    corner.set_axis_off()
    handles = type_handles(kinds)
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=8,
                      title="head type (left strip)", frameon=False)
    heading = "How alike heads attend: JS divergence of every pair, clustered (dark blocks: groups of alike heads)"
    spaced_suptitle(figure, f"{plain_text(title)}\n{heading}" if title else heading, fontsize=11)
    return figure


BAND_TOP = 0.45  # the cluster bands fill the lower part of their strip; their numbers sit above
BAND_LABEL_INCHES = 0.32  # room for one band number ("C12" at 8 points) and a little space beside it


def draw_cluster_bands(band_ax: Axes, ax: Axes, summary: list[tuple[int, int, int, str]], n: int,
                       width: float) -> None:
    """The clusters as bands above the matrix, every band numbered (C1, C2, ...: the list on the right names them):
    each number above its band, moved sideways (`spread`) where bands are too narrow for their numbers to sit apart,
    with a thin line down to its band; thin white lines across the matrix between the clusters. `width`: the
    strip's width in inches."""
    centres = np.array([(start + end - 1) / 2 for start, end, *_ in summary], dtype=float)
    places = spread(centres, BAND_LABEL_INCHES * n / width, -0.5, n - 0.5)
    for (start, end, number, _), centre, place in zip(summary, centres, places):
        band_ax.axvspan(start - 0.5, end - 0.5, ymax=BAND_TOP, color="#d9d9e3" if number % 2 else "#a9a9bd",
                        linewidth=0)
        band_ax.text(place, 0.8, f"C{number}", ha="center", va="center", fontsize=8)
        band_ax.plot([centre, place], [BAND_TOP, 0.62], color="#555555", linewidth=0.6)
        if start:
            ax.axhline(start - 0.5, color="white", linewidth=0.8)
            ax.axvline(start - 0.5, color="white", linewidth=0.8)
    band_ax.set_xlim(-0.5, n - 0.5)
    band_ax.set_ylim(0, 1)


def spread(points: np.ndarray, gap: float, low: float, high: float) -> np.ndarray:
    """`points` (increasing) moved as little as a forward and a backward pass need so that neighbours are at least
    `gap` apart and every point lies within [low + gap / 2, high - gap / 2] (where they fit: len x gap <= high -
    low); the order is kept."""
    placed = np.asarray(points, dtype=float).copy()
    first, last = low + gap / 2, high - gap / 2
    for k in range(len(placed)):
        placed[k] = max(placed[k], first if k == 0 else placed[k - 1] + gap)
    for k in range(len(placed) - 1, -1, -1):
        placed[k] = min(placed[k], last if k == len(placed) - 1 else placed[k + 1] - gap)
    return placed


def label_rises(points: np.ndarray, span: float, near: float = 0.05, step: float = 11.0) -> list[float]:
    """Points by which each label of `points` [label, 2] is raised so that the labels of dots close together
    (within `near` x `span`, the plot's extent) stack instead of overlapping: `step` above the highest earlier
    close one."""
    rises: list[float] = []
    for k, point in enumerate(points):
        close = [rises[j] for j in range(k) if np.abs(points[j] - point).max() <= near * span]
        rises.append(max(close) + step if close else 0.0)
    return rises


def separate_labels(figure: Figure, notes: list[Any], passes: int = 30) -> None:
    """Raise annotations whose drawn boxes overlap an earlier one's until none do (`label_rises` stacks those of
    close dots, but a long name can still reach a farther one): each pass draws the figure and moves every
    later label of an overlapping pair up by the overlap plus 2 points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    if len(notes) < 2:
        return
    canvas = FigureCanvasAgg(figure)
    for _ in range(passes):
        canvas.draw()
        boxes = [Text.get_window_extent(note, canvas.get_renderer()) for note in notes]  # the text, not its arrow
        moved = False
        for j in range(1, len(notes)):
            for i in range(j):
                a, b = boxes[i], boxes[j]
                if min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0):
                    x, y = notes[j].xyann
                    notes[j].xyann = (x, y + (a.y1 - b.y0) * 72.0 / figure.dpi + 2.0)  # pixels to points
                    moved = True
                    break
        if not moved:
            return


@any_script_figure
def head_map_figure(
    js: np.ndarray, layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None = None,
    labelled: list[tuple[int, int]] | None = None, title: str | None = None,
) -> Figure:
    """Every head as a dot placed by classical multidimensional scaling of sqrt(JS): heads that attend alike lie
    close together. Coloured by head type; the `labelled` (layer, head)s are named."""
    from attnprobe.headspace import classical_mds

    coords, shares = classical_mds(js)
    kinds = head_kinds(layers, heads, types)
    dot_area = float(np.clip(22.0 * np.sqrt(200.0 / max(len(layers), 1)), 5.0, 22.0))  # smaller dots for many heads
    figure = Figure(figsize=(9.5, 7.0), layout="constrained")
    ax = figure.add_subplot()
    groups: dict[str, list[int]] = {}  # head type ("" for none) -> the heads' indices
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    for kind in [k for k in ALL_TYPES if k in groups] + sorted(k for k in groups if k not in ALL_TYPES):
        chosen = groups[kind]
        label = f"{kind} ({len(chosen)})" if kind else f"no type ({len(chosen)})" if types is not None else None
        ax.scatter(coords[chosen, 0], coords[chosen, 1], s=dot_area, alpha=0.85, linewidths=0,
                   color=TYPE_COLORS.get(kind, NO_TYPE_COLOR), label=plain_text(label) if label else None)
    index = {(int(layer), int(head)): i for i, (layer, head) in enumerate(zip(layers, heads))}
    named = [index[key] for key in dict.fromkeys((int(a), int(b)) for a, b in labelled or []) if key in index]
    named = named[:MAX_NAMED]
    notes = []
    for i, rise in zip(named, label_rises(coords[named], float(np.ptp(coords, axis=0).max()))):
        ax.scatter(coords[i, 0], coords[i, 1], s=60, facecolors="none", edgecolors="black", linewidths=1.0)
        notes.append(ax.annotate(
            head_name(layers[i], heads[i]), coords[i], xytext=(8, 4 + rise), textcoords="offset points", fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "#777777", "linewidth": 0.6},
            bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.75, "linewidth": 0}))
    ax.set_xlabel(f"MDS axis 1 ({shares[0]:.0%} of the spread)")
    ax.set_ylabel(f"MDS axis 2 ({shares[1]:.0%} of the spread)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.axhline(0.0, color="#dddddd", linewidth=0.6, zorder=0)
    ax.axvline(0.0, color="#dddddd", linewidth=0.6, zorder=0)
    if types is not None:  # beside the axes: over the dots of many heads it would hide some
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="head type")
    ax.set_title("Distance between dots approximates sqrt(JS): close = attend alike (circled: named heads)",
                 fontsize=9)
    separate_labels(figure, notes)
    heading = "Heads by how alike they attend (classical multidimensional scaling)"
    spaced_suptitle(figure, f"{plain_text(title)}\n{heading}" if title else heading, fontsize=11)
    return figure
