"""What a circuit run writes besides its plots: edges.csv's table and MIB's importances.json."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from attnprobe.circuit.graph import Graph


def edge_table(graph: Graph, scores: np.ndarray, circuit: np.ndarray | None = None) -> pd.DataFrame:
    """edges.csv: one row per real edge (sender, receiver, input, score[, in_circuit]), by |score| descending."""
    s, r = np.nonzero(graph.mask)  # [edges] each
    frame = pd.DataFrame({
        "sender": [graph.senders[i] for i in s],
        "receiver": [graph.receivers[j][0] for j in r],
        "input": [graph.receivers[j][1] for j in r],
        "score": scores[s, r],
    })
    if circuit is not None:
        frame["in_circuit"] = circuit[s, r]
    order = np.argsort(-np.abs(frame["score"].to_numpy()), kind="stable")
    return frame.iloc[order].reset_index(drop=True)


def mib_importances(graph: Graph, scores: np.ndarray, circuit: np.ndarray, hidden: int) -> dict[str, Any]:
    """MIB's importances.json (EAP-IG's Graph.to_json): cfg, nodes {name: in_graph}, edges {"u->v<q>": {score,
    in_graph}}; a grouped key/value receiver's edge is written for each query head it serves (the grouped score)."""
    edges: dict[str, dict[str, Any]] = {}
    s_idx, r_idx = np.nonzero(graph.mask)
    for s, r in zip(s_idx, r_idx):
        node, kind = graph.receivers[r]
        for target in (graph.serves(node) if kind in ("k", "v") else [node]):
            name = f"{graph.senders[s]}->{target}" + (f"<{kind}>" if kind else "")
            edges[name] = {"score": float(scores[s, r]), "in_graph": bool(circuit[s, r])}
    used = {graph.senders[s] for s in np.nonzero(circuit.any(1))[0]}
    used |= {t for r in np.nonzero(circuit.any(0))[0] for t in graph.serves(graph.receivers[r][0])}
    names = graph.senders + ["logits"]
    return {
        "cfg": {"n_layers": graph.layers, "n_heads": graph.heads, "n_kv_heads": graph.kv_heads,
                "parallel_attn_mlp": False, "d_model": hidden},
        "nodes": {name: {"in_graph": name in used or name == "logits"} for name in names},
        "edges": edges,
    }
