"""The circuit's figures (plotting.circuit): what is drawn is what the tables hold, and a SmolLM2-sized circuit of
500 edges draws quickly."""

from __future__ import annotations

import time

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from attnprobe import plotting
from attnprobe.errors import AttnprobeError
from attnprobe.plotting import circuit

matplotlib.use("Agg")


def random_edges(layers: int, heads: int, count: int, chosen: int, seed: int = 0, kv_heads: int | None = None
                 ) -> pd.DataFrame:
    """`count` distinct edges from an upstream node to a downstream node's input (EAP-IG's names; with `kv_heads`,
    a key or value input goes to the grouped a{layer}.kv{group}), random scores; the `chosen` largest |score| in the
    circuit."""
    rng = np.random.default_rng(seed)
    senders = ["input", *(f"a{layer}.h{head}" for layer in range(layers) for head in range(heads)),
               *(f"m{layer}" for layer in range(layers))]
    receivers = [*senders[1:], "logits"]

    def depth(name: str) -> float:
        return -1 if name == "input" else layers if name == "logits" else (
            int(name[1:]) + 0.5 if name[0] == "m" else int(name[1:].split(".")[0]))

    rows: set[tuple[str, str, str]] = set()
    while len(rows) < count:
        sender, receiver = senders[rng.integers(len(senders))], receivers[rng.integers(len(receivers))]
        if depth(receiver) > depth(sender):
            port = str(rng.choice(["q", "k", "v"])) if receiver[0] == "a" else ""
            if kv_heads and port in "kv" and port:
                layer, head = receiver[1:].split(".h")
                receiver = f"a{layer}.kv{int(head) * kv_heads // heads}"
            rows.add((sender, receiver, port))
    edges = pd.DataFrame(sorted(rows), columns=["sender", "receiver", "input"])
    edges["score"] = rng.normal(size=len(edges))
    edges["in_circuit"] = edges["score"].abs().rank(ascending=False, method="first") <= chosen
    return edges


def drawn(edges: pd.DataFrame, layers: int, labelled: int = 10):
    figure = Figure()
    ax = figure.add_subplot()
    plotting.draw_circuit(ax, edges, layers, labelled)
    lines = [c for c in ax.collections if c.get_gid() == "circuit-edges"]
    labels = [t for t in ax.texts if t.get_gid() == "circuit-edge-label"]
    return figure, ax, lines, labels


def test_a_smollm2_sized_circuit_of_500_edges_draws_quickly(tmp_path):
    """30 layers x 9 heads (3 key/value heads), 500 of 3,000 edges in the circuit: one edge line each, ten
    numbered, saved in seconds (1.7 s here; the bound leaves room for a loaded machine)."""
    edges = random_edges(30, 9, 3000, 500, kv_heads=3)
    assert edges["receiver"].str.contains(".kv", regex=False).any()
    started = time.perf_counter()
    figure = plotting.circuit_figure(edges, 30, "a 30 x 9 circuit")
    figure.savefig(tmp_path / "circuit.png", dpi=120, bbox_inches="tight")
    assert time.perf_counter() - started < 8
    (lines,) = [c for c in figure.axes[0].collections if c.get_gid() == "circuit-edges"]
    assert len(lines.get_segments()) == 500
    assert len([t for t in figure.axes[0].texts if t.get_gid() == "circuit-edge-label"]) == 10


def test_only_circuit_edges_are_drawn_widest_for_the_largest_score():
    edges = random_edges(4, 3, 40, 12, seed=1)
    _, ax, (lines,), labels = drawn(edges, 4, labelled=5)
    chosen = edges[edges["in_circuit"]]
    assert len(lines.get_segments()) == len(chosen) == 12
    order = np.argsort(chosen["score"].abs().to_numpy(), kind="stable")  # the collection's order: weakest first
    widths = np.asarray(lines.get_linewidths())
    assert np.all(np.diff(widths) >= 0) and widths[-1] == pytest.approx(circuit.WIDTH[1])
    signs = chosen["score"].to_numpy()[order] >= 0
    colours = [to_rgb(c) for c in lines.get_colors()]
    assert colours == [to_rgb(circuit.RAISES if s else circuit.LOWERS) for s in signs]
    assert [t.get_text() for t in labels] == ["1", "2", "3", "4", "5"]
    key = next(t.get_text() for t in ax.texts if t.get_text().startswith("strongest edges"))
    strongest = chosen.loc[chosen["score"].abs().idxmax()]
    port = f".{strongest['input']}" if strongest["input"] else ""
    assert f" 1  {strongest['sender']} \u2192 {strongest['receiver']}{port}  {strongest['score']:+.3g}" in key


def test_nodes_sit_by_layer_and_head_and_edges_end_at_their_input():
    """Rows = layers bottom to top (input below, logits above), heads across, the MLP beside; an edge ends at its
    receiver's query, key or value point, an edge into an MLP or the logits at the node."""
    shape = circuit.Shape(5, 4)
    assert circuit.node_position("a3.h2", shape) == (2.0, 3.0)
    x, y = circuit.node_position("m3", shape)
    assert x > 3 and 3 < y < 4
    assert circuit.node_position("input", shape) == (1.5, -1.0)
    assert circuit.node_position("logits", shape) == (1.5, 5.0)
    ends = {port: tuple(circuit.edge_points("a0.h0", "a2.h1", port, shape)[-1]) for port in "qkv"}
    assert len(set(ends.values())) == 3
    for port, (dx, dy, _) in circuit.PORTS.items():
        if port:
            assert ends[port] == pytest.approx((1 + dx, 2 + dy))
    arc = circuit.edge_points("a0.h1", "logits", "", shape)
    assert tuple(arc[0]) == (1.0, 0.0) and tuple(arc[-1]) == (1.5, 5.0)


def test_grouped_key_value_heads_sit_on_a_bar_under_the_heads_they_serve():
    """SmolLM2's grouping (9 query heads, 3 key/value heads): a{layer}.kv{g} is centred under query heads 3g..3g+2,
    below their row; its k and v edges end there; one bar per layer and group, dark where the circuit uses it."""
    edges = pd.DataFrame({"sender": ["a0.h4", "m0", "a1.h8", "input"], "receiver": ["a1.kv1", "a1.kv1", "logits",
                                                                                      "a0.kv2"],
                          "input": ["k", "v", "", "v"], "score": [1.0, -0.5, 2.0, 0.1],
                          "in_circuit": [True, True, True, False]})
    shape = circuit.shape_of(edges, 2)
    assert shape == circuit.Shape(2, 9, 3)
    assert circuit.node_position("a1.kv1", shape) == (4.0, 1 - circuit.KV_DROP)
    assert tuple(circuit.edge_points("a0.h4", "a1.kv1", "k", shape)[-1]) == (4.0, 1 - circuit.KV_DROP)
    assert tuple(circuit.edge_points("m0", "a1.kv1", "v", shape)[-1]) == pytest.approx((4.22, 1 - circuit.KV_DROP))
    _, ax, (lines,), _ = drawn(edges, 2)
    assert len(lines.get_segments()) == 3
    (bars,) = [c for c in ax.collections if c.get_gid() == "kv-groups"]
    assert len(bars.get_segments()) == 2 * 3
    dark = [k for k, colour in enumerate(bars.get_colors()) if to_rgb(colour) == to_rgb(circuit.USED_BAR)]
    assert dark == [1 * 3 + 1]  # layer 1, group 1: a0.kv2's edge is not in the circuit
    with pytest.raises(AttnprobeError, match="names 9 query heads and 4 key/value heads"):
        drawn(edges.assign(receiver=["a1.kv3", "a1.kv1", "logits", "a0.kv2"]), 2)


def test_an_empty_circuit_draws_its_nodes_and_says_so():
    edges = random_edges(3, 2, 10, 0)
    _, ax, lines, labels = drawn(edges, 3)
    assert not lines and not labels
    assert any(t.get_text() == "no edge in the circuit" for t in ax.texts)


def test_bad_tables_are_refused_in_one_line():
    edges = random_edges(3, 2, 10, 4)
    with pytest.raises(AttnprobeError, match="lacks the column.*in_circuit"):
        drawn(edges.drop(columns="in_circuit"), 3)
    with pytest.raises(AttnprobeError, match="circuit node 'head7': expected input, logits"):
        drawn(edges.assign(in_circuit=True, receiver="head7"), 3)
    with pytest.raises(AttnprobeError, match="'a5.h0' lies beyond the model's 3 layers"):
        drawn(edges.assign(in_circuit=True, receiver="a5.h0"), 3)
    with pytest.raises(AttnprobeError, match="input 'z', expected q, k, v or empty"):
        drawn(edges.assign(in_circuit=True, input="z"), 3)


def curve_frame(fractions: list[float]) -> pd.DataFrame:
    fraction = np.array(fractions)
    return pd.DataFrame({"edges": np.rint(fraction * 1000).astype(int), "fraction": fraction,
                         "faithfulness": 1 - np.exp(-20 * fraction), "random_mean": fraction ** 2,
                         "random_low": fraction ** 2 - 0.05, "random_high": fraction ** 2 + 0.05})


def test_faithfulness_draws_the_curve_the_random_band_and_the_lines_at_0_and_1():
    curve = curve_frame([0.5, 0.001, 0.01, 0.1, 1.0])  # out of order: drawn by fraction
    figure = plotting.faithfulness_figure(curve, "faithfulness")
    ax = figure.axes[0]
    lines = {line.get_gid(): line for line in ax.lines}
    ordered = curve.sort_values("fraction")
    np.testing.assert_array_equal(lines["circuit-faithfulness"].get_xdata(), ordered["fraction"])
    np.testing.assert_array_equal(lines["circuit-faithfulness"].get_ydata(), ordered["faithfulness"])
    np.testing.assert_array_equal(lines["random-mean"].get_ydata(), ordered["random_mean"])
    band = next(c for c in ax.collections if c.get_gid() == "random-band")
    vertices = band.get_paths()[0].vertices  # [point, 2]: the band's outline
    assert vertices[:, 1].min() == pytest.approx(ordered["random_low"].min())
    assert vertices[:, 1].max() == pytest.approx(ordered["random_high"].max())
    flat = sorted(float(line.get_ydata()[0]) for line in ax.lines if line.get_gid() is None)
    assert flat == [0.0, 1.0]  # the corrupt run and the full model
    assert ax.get_xscale() == "log"  # sizes over three decades
    linear = plotting.faithfulness_figure(curve_frame([0.1, 0.5, 1.0])).axes[0]
    assert linear.get_xscale() == "linear"
    with pytest.raises(AttnprobeError, match="lacks the column.*random_high"):
        plotting.faithfulness_figure(curve.drop(columns="random_high"))
