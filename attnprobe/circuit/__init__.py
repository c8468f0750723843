"""Circuits at head granularity: edge attribution patching (EAP, EAP-IG), exact edge patching and faithfulness.

The graph (Hanna et al.'s EAP-IG graph, with grouped-query attention kept grouped):

- senders: the input embeddings (`input`, the first block's input), each query head's output (`a{l}.h{h}`: its
  slice of the output projection's input times that slice of the projection, what the head adds to the residual
  stream) and each MLP's output (`m{l}`);
- receivers: each query head's query input (`a{l}.h{h}`, input `q`), each key/value head's key and value inputs
  (`a{l}.kv{g}`, inputs `k` and `v`, shared by the query heads it serves; named `a{l}.h{g}` where there is no
  grouping), each MLP's input (`m{l}`) and the logits (`logits`, the final norm's input);
- an edge u -> v for every sender u upstream of v. A receiver's input is the residual stream where it reads it,
  which is the sum of the upstream senders' outputs (plus constant biases), so patching the edge u -> v changes
  v's input alone by (corrupt_u - current_u) before v's own norm: a head's query slice is recomputed from
  norm(x + delta) while the other heads keep theirs.

Scores (the first-order change of the mean metric when the edge is patched to the corrupt run, as EAP-IG's code
signs them): EAP = sum over positions of (corrupt_u - clean_u) . dM/d(input_v), every edge from one clean and one
corrupt forward and one backward; EAP-IG = the same with the gradient averaged over m points on the straight line
from the corrupt to the clean input embeddings (alpha = k/m, k = 1..m, so m = 1 is EAP; EAP-IG's code takes
k = 0..m-1); GradDrop (AtP*, Kramar et al. 2024) as an option, and AtP*'s QK fix as another (qkfix.py): the edges
into queries and keys scored with the patched attention pattern recomputed exactly, dM/dz_h . ((A' - A) V), linear
only after the softmax whose gradient saturated attention makes blind (with EAP-IG at the clean point, k = m; with
GradDrop once per dropped block; about one attention recomputation per (sender, layer)). Exact edge patching: the
patched mean metric minus the clean one, each edge a copy of the pairs run from its receiver's layer on. After the
exact check of the top edges, AtP*'s subsampling diagnostic as an option (missed.py): random subsets of the
unverified edges patched together, and each edge's effect bounded from the subsets that hold it.

Faithfulness (MIB, Mueller et al. 2025): the metric with every edge outside the circuit patched to the corrupt run
(or mean-ablated), (M_circuit - M_corrupt) / (M_clean - M_corrupt), at circuit sizes given as fractions of the
edges (top |score|); CPR and CMD are the trapezoid areas of f and |1 - f| over the fractions.

Supported block shapes (layout.py finds which, and checks it on one short run):

- pre-norm (GPT-2, Llama, Qwen, Mistral, OPT's pre-norm sizes...): x + attn(ln1 x), then + mlp(ln2 .). The stream
  is the sum of the senders' outputs plus constant biases.
- sandwich (Gemma 2 and 3): x + post_attn_norm(attn(ln1 x)), then + post_mlp_norm(mlp(ln2 .)). Still a sum: the
  MLP sender's output is its post-feedforward norm's output, and a head's output is its contribution through the
  post-attention norm with that norm's statistics (Gemma's 1 / rms of the attention's whole output, times 1 + weight,
  in float32) frozen at the run's own value, so that the heads add up to the norm's output in every run. Patching an
  edge moves v's input by u's output in the corrupt run minus u's output in the clean run, each at its own run's
  scale, and EAP stays that patch's first-order change. Gemma 2's attention and final soft-caps are the model's own
  (the logits through patching's logit transform).
- post-norm (OPT-350m: h = ln_a(x + attn(x)), then ln_f(h + mlp(h)); the logits read the last block's output, through
  project_out where the model has one). The stream is renormalised after each add, so it is not a plain sum. With
  each stream LayerNorm's mean-centring and 1 / sigma frozen at the run's own values, the norms are linear: a
  sender's contribution at a receiver is its output carried through every norm between (centred, times 1 / sigma,
  times the norm's weight, per norm), and the stream is exactly the sum of the carried contributions plus constant
  terms (the norms' and the output projection's biases, carried the same way), which ride with `input` so that
  patching every edge gives the corrupt run. Receivers read the stream bare (no input norm): the queries, keys and
  values the block's input, the MLP its input h, the logits the last block's output. Patching u -> v moves v's input
  by u's contribution carried to v's point in the corrupt run (its outputs, its statistics) minus the same in the
  clean run; EAP contracts that diff with dM/d(input_v) point by point (stream.py keeps both runs' records and
  statistics and carries them along), and exact patching and faithfulness use the same carried diffs. GradDrop (no
  residual add to drop) and mean ablation (a mean output has no statistics to pass the norms with) are refused there.

Parallel blocks (GPT-NeoX, Phi: attention and MLP both read x) and attention that normalises every head's queries
or keys together (OLMo 2) are refused in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.circuit.attribution import attribute
from attnprobe.circuit.exact import COPY_TOKENS, exact, exact_sets, keep_run
from attnprobe.circuit.faithfulness import (
    ABLATIONS,
    PERCENTAGES,
    Faithfulness,
    areas,
    baselines,
    check_ablation,
    check_fractions,
    evaluate,
    faithfulness,
    normalized,
    random_edges,
    top_edges,
)
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout, find_layout
from attnprobe.circuit.missed import MISSED_CONFIDENCE, MISSED_P, Missed, check_missed, missed_bounds, missed_table
from attnprobe.circuit.runs import BUFFER_MIB, Metric, Pass, Prompts, forward, measure, outputs, tokenize
from attnprobe.circuit.tables import edge_table, mib_importances
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

METHODS = ("eap", "eap-ig", "exact")

__all__ = [
    "ABLATIONS",
    "BUFFER_MIB",
    "COPY_TOKENS",
    "METHODS",
    "MISSED_CONFIDENCE",
    "MISSED_P",
    "PERCENTAGES",
    "CircuitResult",
    "Faithfulness",
    "Graph",
    "Layout",
    "Metric",
    "Missed",
    "Pass",
    "Prompts",
    "areas",
    "attribute",
    "baselines",
    "check_fractions",
    "choose",
    "edge_table",
    "evaluate",
    "exact",
    "exact_sets",
    "faithfulness",
    "find_circuit",
    "find_layout",
    "forward",
    "keep_run",
    "measure",
    "mib_importances",
    "missed_bounds",
    "missed_table",
    "normalized",
    "outputs",
    "random_edges",
    "tokenize",
    "top_edges",
]



@dataclass
class CircuitResult:
    scores: np.ndarray  # [senders, receivers]
    circuit: np.ndarray  # [senders, receivers] bool
    faithfulness: Faithfulness | None
    exact: pd.DataFrame | None  # the top edges' exact patching beside their scores
    seconds: dict[str, float]
    missed: Missed | None = None  # the bound on the unverified edges (--missed)


def find_circuit(loaded: LoadedModel, pairs: Sequence[Any], metric: Metric, *, method: str = "eap-ig",
                 steps: int = 5, grad_drop: bool = False, qk_fix: bool = False, top: int | None = None,
                 threshold: float | None = None, fractions: Sequence[float] = PERCENTAGES, randoms: int = 5,
                 ablation: str = "patch", check: int = 0, missed_subsets: int = 0, missed_p: float = MISSED_P,
                 seed: int = 0, progress: Callable[[str, int, int], None] | None = None,
                 ) -> tuple[Layout, CircuitResult]:
    """Score every edge (method eap, eap-ig, or exact: every edge patched alone; grad_drop and qk_fix: AtP*'s
    options of eap and eap-ig, together or alone), choose the circuit (top edges or |score| >= threshold), its
    faithfulness curve and, with check > 0, the exact patch of the top `check` edges; with missed_subsets > 0 as
    well, the bound on the other edges from that many random subsets of them (each edge in with chance missed_p,
    drawn from seed) patched together (missed.py)."""
    if method not in METHODS:
        raise AttnprobeError(f"--method {method!r}: use one of {', '.join(METHODS)}")
    if steps < 1:
        raise AttnprobeError(f"--steps {steps}: give at least 1")
    if grad_drop and method == "exact":
        raise AttnprobeError("--grad-drop applies to --method eap or eap-ig: exact patching has no gradient to drop")
    if qk_fix and method == "exact":
        raise AttnprobeError("--qk-fix applies to --method eap or eap-ig: exact patching recomputes every attention "
                             "pattern already; drop --qk-fix")
    layout = find_layout(loaded)
    check_missed(missed_subsets, missed_p, check, layout.post_norm)
    if fractions:
        check_ablation(layout, ablation)
    graph = layout.graph
    prompts = tokenize(loaded, pairs)
    seconds: dict[str, float] = {}
    tick = time.perf_counter()
    say = (lambda stage: (lambda d, t: progress(stage, d, t))) if progress else (lambda stage: None)  # noqa: E731
    if method == "exact":
        edges = list(zip(*np.nonzero(graph.mask)))
        scores = np.zeros(graph.mask.shape)
        values = exact(loaded, layout, prompts, metric, edges, say("exact patching"))
        for (s, r), v in zip(edges, values):
            scores[s, r] = v
    else:
        scores = attribute(loaded, layout, prompts, metric, steps=1 if method == "eap" else steps,
                           grad_drop=grad_drop, qk_fix=qk_fix, progress=say("attribution"))
    seconds["scores"] = time.perf_counter() - tick
    circuit = choose(graph, scores, top, threshold)
    checked = None
    if check:
        tick = time.perf_counter()
        chosen = top_edges(graph, scores, check)
        edges = list(zip(*np.nonzero(chosen)))
        values = exact(loaded, layout, prompts, metric, edges, say("exact check"))
        checked = pd.DataFrame({"sender": [graph.senders[s] for s, _ in edges],
                                "receiver": [graph.receivers[r][0] for _, r in edges],
                                "input": [graph.receivers[r][1] for _, r in edges],
                                "score": [scores[s, r] for s, r in edges], "exact": values})
        seconds["check"] = time.perf_counter() - tick
    bound = None
    if missed_subsets:
        tick = time.perf_counter()
        bound = missed_bounds(loaded, layout, prompts, metric, chosen, float(np.abs(values).min()),
                              subsets=missed_subsets, p=missed_p, seed=seed, progress=say("missed edges"))
        seconds["missed"] = time.perf_counter() - tick
    faith = None
    if fractions:
        tick = time.perf_counter()
        faith = faithfulness(loaded, layout, prompts, metric, scores, fractions=fractions, randoms=randoms,
                             ablation=ablation, seed=seed, progress=say("faithfulness"))
        seconds["faithfulness"] = time.perf_counter() - tick
    return layout, CircuitResult(scores, circuit, faith, checked, {k: round(v, 3) for k, v in seconds.items()}, bound)


def choose(graph: Graph, scores: np.ndarray, top: int | None, threshold: float | None) -> np.ndarray:
    """The circuit: the `top` edges of largest |score|, or every edge with |score| >= threshold."""
    if top is not None and threshold is not None:
        raise AttnprobeError("--top and --threshold both choose the circuit: give one of them")
    if threshold is not None:
        if threshold < 0:
            raise AttnprobeError(f"--threshold {threshold}: give a |score| of 0 or more")
        return graph.mask & (np.abs(scores) >= threshold)
    if top is not None and top < 1:
        raise AttnprobeError(f"--top {top}: give at least 1 edge")
    return top_edges(graph, scores, top if top is not None else max(1, graph.edge_count // 100))
