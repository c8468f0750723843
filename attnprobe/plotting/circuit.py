"""`circuit`'s figures: the circuit as a graph a person can read, and its faithfulness over circuit size.

The graph: one row per layer, bottom to top, the input below the first and the logits above the last; a layer's
heads across (a{layer}.h{head}) and its MLP beside them (m{layer}, a little above the heads, as it reads them).
Only the edges in the circuit are drawn: width by |score|, red for a positive score and blue for a negative one
(what the sign means is the score's: the circuit command's is the change of the metric when the edge is patched to
the corrupt run); an edge into a head's query, key or value ends at that input's own point below the head (left,
middle, right) with its own line style; an edge from one MLP to another bows out to the right of the MLP column.
The `labelled` strongest edges carry a number, and a key beside the graph names them with their scores. Node names
are EAP-IG's: "input", "a{layer}.h{head}", "m{layer}", "logits"; under grouped-query attention an edge into a
key/value head "a{layer}.kv{group}" ends on a bar under the query heads that share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from attnprobe.errors import AttnprobeError
from attnprobe.plotting.style import any_script_figure, plain_text

EDGE_COLUMNS = ("sender", "receiver", "input", "score", "in_circuit")
CURVE_COLUMNS = ("edges", "fraction", "faithfulness", "random_mean", "random_low", "random_high")
NODE = re.compile(r"input|logits|a(\d+)\.h(\d+)|a(\d+)\.kv(\d+)|m(\d+)")
RAISES, LOWERS = "#b2182b", "#2166ac"  # an edge's score above or below 0 (RdBu's ends)
NODE_COLOR, IDLE_COLOR = "#252525", "#d0d0d0"  # a node an edge of the circuit touches, and one none does
IDLE_BAR, USED_BAR = "#ebebeb", "#737373"  # a key/value head's bar that no edge of the circuit reaches, and one reached
# an edge into a head's query, key or value: where it ends (x offset from the head, y below it) and its line style
PORTS = {"q": (-0.22, -0.14, "solid"), "k": (0.0, -0.14, (0, (4, 2))), "v": (0.22, -0.14, (0, (1, 1.5))),
         "": (0.0, 0.0, "solid")}
MLP_GAP, MLP_RISE = 0.9, 0.4  # an MLP node: this far right of the last head, this far above its heads' row
KV_DROP = 0.32  # a grouped key/value head: this far below its query heads' row, on a bar under them
BOW, BOW_MAX, CURVE_POINTS = 0.1, 1.2, 21  # an edge's arc: its sideways bow (share of its length, at most
# BOW_MAX node spacings at the control point: half that at the arc's middle) and the points drawn
WIDTH = (0.4, 4.0)  # the thinnest and the widest edge, in points
ALPHA = (0.35, 0.85)  # the weakest and the strongest edge's opacity
RANDOM_COLOR, CIRCUIT_COLOR = "#7f7f7f", "#b2182b"


@dataclass(frozen=True)
class Shape:
    """The graph's shape: layers, query heads per layer, and query heads per key/value head (1: no grouping)."""

    layers: int
    heads: int
    group: int = 1

    @property
    def centre(self) -> float:
        return (self.heads - 1) / 2


def node_position(name: str, shape: Shape) -> tuple[float, float]:
    """Where a node sits: (head, layer) for a query head; a grouped key/value head (a{layer}.kv{group}) KV_DROP
    below its layer, centred under the query heads it serves; an MLP beside the heads and a little above them; the
    input one row below layer 0 and the logits one row above the last layer, both centred."""
    match = NODE.fullmatch(str(name))
    if match is None:
        raise AttnprobeError(f"circuit node {name!r}: expected input, logits, a<layer>.h<head>, a<layer>.kv<group> "
                             "or m<layer>")
    if name == "input":
        return shape.centre, -1.0
    if name == "logits":
        return shape.centre, float(shape.layers)
    head_layer, head, kv_layer, kv, mlp_layer = match.groups()
    layer = int(head_layer or kv_layer or mlp_layer)
    if layer >= shape.layers:
        raise AttnprobeError(f"circuit node {name!r} lies beyond the model's {shape.layers} layers")
    if mlp_layer is not None:
        return shape.heads - 1 + MLP_GAP, layer + MLP_RISE
    if kv is not None:
        return int(kv) * shape.group + (shape.group - 1) / 2, layer - KV_DROP
    return float(head), float(layer)


def shape_of(edges: pd.DataFrame, layers: int) -> Shape:
    """The shape the node names of `edges` imply: one more query head than the highest named (1 at least), and as
    many query heads per key/value head as the grouped names (a{layer}.kv{group}) leave."""
    names = pd.concat([edges["sender"], edges["receiver"]]).astype(str)
    found = names.str.extract(r"^a\d+\.h(\d+)$")[0].dropna().astype(int)
    heads = int(found.max()) + 1 if len(found) else 1
    groups = names.str.extract(r"^a\d+\.kv(\d+)$")[0].dropna().astype(int)
    if not len(groups):
        return Shape(layers, heads)
    kv_heads = int(groups.max()) + 1
    if heads % kv_heads:
        raise AttnprobeError(f"the circuit names {heads} query heads and {kv_heads} key/value heads per layer: the "
                             "query heads must divide among them")
    return Shape(layers, heads, heads // kv_heads)


def check_columns(frame: pd.DataFrame, columns: tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise AttnprobeError(f"{what} lacks the column(s) {', '.join(missing)}: it needs {', '.join(columns)}")


def draw_circuit(ax: Axes, edges: pd.DataFrame, layers: int, labelled: int = 10) -> None:
    """The circuit's edges (the rows of `edges` whose in_circuit is true) on the model's nodes, as the module
    docstring says; the edges are one LineCollection (gid "circuit-edges"), the strongest drawn last."""
    check_columns(edges, EDGE_COLUMNS, "the circuit's edge table")
    shape = shape_of(edges, layers)
    chosen = edges[edges["in_circuit"].astype(bool)]
    chosen = chosen.assign(size=chosen["score"].abs()).sort_values("size", kind="stable")  # strongest last
    draw_nodes(ax, shape, set(chosen["sender"]) | set(chosen["receiver"]))
    if chosen.empty:
        ax.text(0.5, 0.5, "no edge in the circuit", transform=ax.transAxes, ha="center", va="center")
    else:
        draw_edges(ax, chosen, shape)
        label_edges(ax, chosen.iloc[::-1].head(max(labelled, 0)), shape)
    frame_graph(ax, shape)


def draw_nodes(ax: Axes, shape: Shape, used: set[str]) -> None:
    """Every head and MLP as a small grey mark, those the circuit uses dark and larger; under grouped-query
    attention a bar under each key/value head's query heads (dark where the circuit uses it); input and logits
    named."""
    names = [f"a{layer}.h{head}" for layer in range(shape.layers) for head in range(shape.heads)]
    names += [f"m{layer}" for layer in range(shape.layers)]
    xy = np.array([node_position(n, shape) for n in names])  # [node, 2]
    marker = np.array(["s" if n.startswith("m") else "o" for n in names])  # [node]
    active = np.array([n in used for n in names])  # [node]
    for form in ("o", "s"):
        for on, color, size in ((False, IDLE_COLOR, 9), (True, NODE_COLOR, 22)):
            pick = (marker == form) & (active == on)  # [node]
            ax.scatter(xy[pick, 0], xy[pick, 1], s=size, c=color, marker=form, zorder=3 if on else 1,
                       linewidths=0)
    if shape.group > 1:
        bars = [(f"a{layer}.kv{g}", layer, g) for layer in range(shape.layers)
                for g in range(shape.heads // shape.group)]
        segments = [[(g * shape.group - 0.3, layer - KV_DROP), ((g + 1) * shape.group - 0.7, layer - KV_DROP)]
                    for _, layer, g in bars]
        colors = [USED_BAR if name in used else IDLE_BAR for name, _, _ in bars]
        ax.add_collection(LineCollection(segments, colors=colors, linewidths=0.9, zorder=1, gid="kv-groups"))
    for name in ("input", "logits"):
        x, y = node_position(name, shape)
        ax.scatter([x], [y], s=40, c=NODE_COLOR if name in used else IDLE_COLOR, marker="D", zorder=3)
        ax.annotate(name, (x, y), xytext=(7, 0), textcoords="offset points", va="center", fontsize=8)


def draw_edges(ax: Axes, chosen: pd.DataFrame, shape: Shape) -> None:
    """The chosen edges as one LineCollection: width by |score| (WIDTH), colour by sign, style by the input."""
    ports = chosen["input"].fillna("")
    segments = [edge_points(s, r, p, shape) for s, r, p in zip(chosen["sender"], chosen["receiver"], ports)]
    styles = [PORTS[p][2] for p in ports]
    size = chosen["size"].to_numpy(dtype=float)  # [edge]
    largest = float(size.max()) if size.size and size.max() > 0 else 1.0
    widths = WIDTH[0] + (WIDTH[1] - WIDTH[0]) * size / largest  # [edge]
    colors = [to_rgba(RAISES if s >= 0 else LOWERS, alpha) for s, alpha in  # weak edges fainter
              zip(chosen["score"], ALPHA[0] + (ALPHA[1] - ALPHA[0]) * size / largest)]
    lines = LineCollection(segments, linewidths=widths, colors=colors, linestyles=styles, zorder=2, capstyle="round")
    lines.set_gid("circuit-edges")
    ax.add_collection(lines)


def edge_points(sender: str, receiver: str, port: str, shape: Shape) -> np.ndarray:
    """The edge as a gentle arc of CURVE_POINTS points [point, 2], from its sender to the receiver (or to its query,
    key or value point; a grouped key/value head's on its bar), its middle moved sideways towards the graph's middle
    column by BOW of its length (at most BOW_MAX): an edge along a column of heads does not run through the heads
    between its ends."""
    if port not in PORTS:
        raise AttnprobeError(f"edge {sender} -> {receiver}: input {port!r}, expected q, k, v or empty")
    dx, dy, _ = PORTS[port]
    x, y = node_position(receiver, shape)
    dy = 0.0 if ".kv" in str(receiver) else dy  # a key/value head sits below its row already
    start, end = np.array(node_position(sender, shape)), np.array([x + dx, y + dy])  # [2] each
    along = end - start  # [2]
    length = float(np.hypot(*along)) or 1.0
    side = np.array([along[1], -along[0]]) / length  # [2]: unit normal
    mlps = str(sender).startswith("m") and str(receiver).startswith("m")
    if side[0] * (shape.centre - (start[0] + end[0]) / 2) < 0:
        side = -side  # towards the middle column: arcs stay inside the axes
    if mlps:
        side = np.array([1.0, 0.0])  # MLP to MLP: out to the right, clear of the heads
    control = (start + end) / 2 + min(BOW * length, BOW_MAX) * side  # [2]
    t = np.linspace(0.0, 1.0, CURVE_POINTS)[:, None]  # [point, 1]
    return (1 - t) ** 2 * start + 2 * t * (1 - t) * control + t ** 2 * end  # [point, 2], a quadratic Bezier


def label_edges(ax: Axes, top: pd.DataFrame, shape: Shape) -> None:
    """A number on each of the `top` edges (strongest first) and, beside the graph, a key naming each."""
    key = []
    for rank, (sender, receiver, port, score) in enumerate(
            zip(top["sender"], top["receiver"], top["input"].fillna(""), top["score"]), start=1):
        x, y = edge_points(sender, receiver, port, shape)[CURVE_POINTS * 11 // 20]  # 55% of the way
        ax.text(x, y, str(rank), fontsize=6, ha="center", va="center",
                zorder=4, gid="circuit-edge-label",
                bbox={"boxstyle": "circle,pad=0.2", "facecolor": "white", "edgecolor": "#737373", "linewidth": 0.5})
        into = f"{receiver}.{port}" if port else receiver
        key.append(f"{rank:>2}  {sender} \u2192 {into}  {score:+.3g}")
    ax.text(1.02, 1.0, plain_text("strongest edges\n" + "\n".join(key)), transform=ax.transAxes, va="top",
            ha="left", fontsize=7, family="monospace")


def frame_graph(ax: Axes, shape: Shape) -> None:
    """Axis limits, layer and head ticks, and the legend of colours and line styles (and key/value bars)."""
    layers, heads = shape.layers, shape.heads
    ax.set_xlim(-0.8, heads - 1 + MLP_GAP + BOW_MAX / 2 + 0.3)  # room for MLP-to-MLP arcs
    ax.set_ylim(-1.6, layers + 0.6)
    step = 1 if layers <= 32 else int(np.ceil(layers / 32))
    ax.set_yticks(range(0, layers, step))
    ax.set_ylabel("layer")
    ax.set_xticks([*range(heads), heads - 1 + MLP_GAP], [*map(str, range(heads)), "MLP"],
                  fontsize=7 if heads > 16 else 8)
    ax.set_xlabel("head")
    ax.tick_params(axis="y", labelsize=7 if layers > 16 else 8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Line2D([], [], color=RAISES, lw=2, label="score > 0"),
               Line2D([], [], color=LOWERS, lw=2, label="score < 0"),
               *(Line2D([], [], color="#525252", lw=1.2, linestyle=PORTS[p][2], label=f"into a head's {name}")
                 for p, name in (("q", "query"), ("k", "key"), ("v", "value")))]
    if shape.group > 1:
        handles.append(Line2D([], [], color=USED_BAR, lw=1.0, label=f"a key/value head, shared by the {shape.group}"
                                                                      "\nquery heads above its bar"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(1.02, 0.0), fontsize=7, frameon=False)


def draw_faithfulness(ax: Axes, curve: pd.DataFrame, log: bool | None = None) -> None:
    """Faithfulness over circuit size (x: the fraction of the graph's edges kept, on a log scale when `log`, or by
    default when the sizes span more than two decades), beside random circuits of the same sizes (their mean and
    interval band), with the full model (1) and the corrupt run (0) as lines."""
    check_columns(curve, CURVE_COLUMNS, "the faithfulness curve")
    curve = curve.sort_values("fraction")
    x = curve["fraction"].to_numpy(dtype=float)  # [size]
    if log is None:
        positive = x[x > 0]
        log = bool(positive.size == x.size and positive.size and positive.max() / positive.min() > 100)
    ax.axhline(1.0, color="#252525", lw=0.8, label="full model (1)")
    ax.axhline(0.0, color="#969696", lw=0.8, linestyle=(0, (4, 2)), label="corrupt run (0)")
    ax.fill_between(x, curve["random_low"].to_numpy(dtype=float), curve["random_high"].to_numpy(dtype=float),
                    color=RANDOM_COLOR, alpha=0.25, linewidth=0, label="random circuits: interval", gid="random-band")
    ax.plot(x, curve["random_mean"].to_numpy(dtype=float), color=RANDOM_COLOR, lw=1.2, marker=".",
            label="random circuits: mean", gid="random-mean")
    ax.plot(x, curve["faithfulness"].to_numpy(dtype=float), color=CIRCUIT_COLOR, lw=1.8, marker="o", ms=3.5,
            label="circuit", gid="circuit-faithfulness")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("fraction of edges in the circuit" + (" (log scale)" if log else ""))
    ax.set_ylabel("faithfulness (0: corrupt run, 1: full model)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3, linewidth=0.5)


@any_script_figure
def circuit_figure(edges: pd.DataFrame, layers: int, title: str | None = None, labelled: int = 10) -> Figure:
    """draw_circuit on a figure sized to the model (a 30 x 9 model: about 10 x 10 inches)."""
    check_columns(edges, EDGE_COLUMNS, "the circuit's edge table")
    heads = shape_of(edges, layers).heads
    figure = Figure(figsize=(max(6.0, 0.45 * heads + 5.0), max(4.5, 0.3 * layers + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    draw_circuit(ax, edges, layers, labelled)
    if title is not None:
        ax.set_title(plain_text(title))
    return figure


@any_script_figure
def faithfulness_figure(curve: pd.DataFrame, title: str | None = None, log: bool | None = None) -> Figure:
    """draw_faithfulness on a figure of its own."""
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = figure.add_subplot()
    draw_faithfulness(ax, curve, log)
    if title is not None:
        ax.set_title(plain_text(title))
    return figure
