"""A bound on what the exact check missed (after AtP*'s subsampling diagnostic, Kramar et al. 2024).

After the top N edges are patched exactly (`--check N`), the other edges are unverified: their scores say they are
small, but a first-order score can miss an edge (saturated attention, cancelling paths). The diagnostic patches
random subsets of the unverified edges together and bounds each edge's exact effect from the subsets that contain
it:

- draw K subsets, each unverified edge in each subset independently with probability p;
- patch each subset's edges together (exact_sets: each receiver reads its subset's senders' corrupt outputs) and
  measure d(S), the mean metric's change;
- for an edge e in k subsets, sort |d(S)| over them, largest first, v_1 >= ... >= v_k, and take as its bound
  v_j, with j the largest rank such that P(Binomial(k, 1/2) <= j - 1) <= 1 - confidence.

Assumption (no systematic cancellation): for a random subset S containing e, |d(S)| >= |d(e)| with probability at
least 1/2, independently across subsets: what the subset's other edges add (their own effects and their
interactions with e) is at least as likely to push the metric e's way as against it. Under it, fewer than j of the
k subsets reach |d(e)| with probability at most 1 - confidence, so |d(e)| <= v_j at that confidence, edge by edge
(not jointly over every edge). AtP*'s stronger assumption, that no subset cancels e at all (probability 1), gives
the smallest of the k values, v_k: written beside the bound as `lowest`. An edge in too few subsets for any rank
(k < log2(1 / (1 - confidence)), 5 at 95%) has no bound (infinite). The bound is loose where subsets are large:
each v is the effect of a whole subset, so choose p so that a subset's effect stays small beside the verified
ones. It fails where the rest of the unverified edges push the metric steadily against e (most subsets cancel it)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from attnprobe.circuit.exact import exact_sets
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout
from attnprobe.circuit.runs import Metric, Prompts
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

MISSED_CONFIDENCE = 0.95
MISSED_P = 0.1  # default chance of an unverified edge to be in a subset


@dataclass
class Missed:
    """The diagnostic's draw, its subsets' effects and each unverified edge's bound."""

    edges: list[tuple[int, int]]  # the unverified edges (sender, receiver)
    members: np.ndarray  # [subsets, edges] bool
    effects: np.ndarray  # [subsets] float64: each subset's change of the mean metric
    counts: np.ndarray  # [edges] int: the subsets each edge is in
    bound: np.ndarray  # [edges]: |effect| <= bound at the confidence (inf: too few subsets)
    lowest: np.ndarray  # [edges]: the smallest |subset effect| containing the edge (AtP*'s bound; inf: none)
    smallest_verified: float  # the smallest |exact effect| among the checked edges
    p: float
    confidence: float

    @property
    def flagged(self) -> np.ndarray:
        """[edges] bool: an unverified edge whose bound reaches the smallest verified effect (a candidate missed)."""
        return self.bound >= self.smallest_verified


def check_missed(subsets: int, p: float, check: int, post_norm: bool) -> None:
    """Refuses a diagnostic it cannot run, in one line."""
    if subsets < 0:
        raise AttnprobeError(f"--missed {subsets}: give 0 (none) or more subsets")
    if not subsets:
        return
    if check < 1:
        raise AttnprobeError("--missed bounds the edges --check leaves unverified: give --check N as well")
    if not 0 < p <= 1:
        raise AttnprobeError(f"--missed-p {p}: give a chance in (0, 1], e.g. 0.1")
    if post_norm:
        raise AttnprobeError("--missed on a post-norm decoder: patching edges together there is not supported yet; "
                             "drop --missed")


def missed_bounds(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, verified: np.ndarray,
           smallest_verified: float, *, subsets: int, p: float = MISSED_P, confidence: float = MISSED_CONFIDENCE,
           seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Missed:
    """The diagnostic on every real edge outside `verified` ([senders, receivers] bool): `subsets` random subsets
    (each edge in with chance p) patched exactly, each edge's bound (see the module's docstring)."""
    graph = layout.graph
    edges = [(int(s), int(r)) for s, r in zip(*np.nonzero(graph.mask & ~verified))]
    members = draw(len(edges), subsets, p, np.random.default_rng(seed))  # [subsets, edges]
    sets = [[edges[e] for e in np.flatnonzero(row)] for row in members]
    effects = exact_sets(loaded, layout, prompts, metric, sets, progress)  # [subsets]
    bound, lowest, counts = bounds(effects, members, confidence)
    return Missed(edges, members, effects, counts, bound, lowest, smallest_verified, p, confidence)


def draw(count: int, subsets: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """[subsets, count] bool: each edge in each subset independently with chance p."""
    return rng.random((subsets, count)) < p


def rank(k: int, confidence: float) -> int:
    """The largest j (0: none) with P(Binomial(k, 1/2) <= j - 1) <= 1 - confidence: the bound is the j-th largest of
    the k subset effects."""
    alpha, below, j = 1 - confidence, 0.0, 0
    while j < k:
        below += math.comb(k, j) / 2**k  # P(Binomial(k, 1/2) <= j)
        if below > alpha:
            break
        j += 1
    return j


def bounds(effects: np.ndarray, members: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each edge's bound (the rank()-th largest |effect| of its subsets), its smallest |effect| and its count [edges]
    each; inf where there is no rank (or, for the smallest, no subset)."""
    order = np.argsort(-np.abs(effects), kind="stable")  # [subsets], largest |effect| first
    ranked = np.abs(effects)[order]  # [subsets]
    seen = np.cumsum(members[order], axis=0)  # [subsets, edges]: subsets so far that hold each edge
    counts = seen[-1] if len(ranked) else np.zeros(members.shape[1], dtype=int)  # [edges]
    ranks = {k: rank(k, confidence) for k in np.unique(counts).tolist()}
    j = np.array([ranks[k] for k in counts.tolist()], dtype=int)  # [edges]
    return pick(ranked, seen, j), pick(ranked, seen, counts), counts


def pick(ranked: np.ndarray, seen: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Per edge, the j-th largest value among its subsets' (j 0: inf) [edges]."""
    if not len(ranked):
        return np.full(seen.shape[1], np.inf)
    row = np.argmax(seen >= np.maximum(j, 1)[None, :], axis=0)  # [edges]: where the j-th of its subsets comes
    return np.where(j > 0, ranked[row], np.inf)


def missed_table(graph: Graph, scores: np.ndarray, result: Missed) -> pd.DataFrame:
    """One row per unverified edge (sender, receiver, input, score, subsets, bound, lowest, flagged), by bound
    descending (the edges with no bound first)."""
    s = [e[0] for e in result.edges]
    r = [e[1] for e in result.edges]
    frame = pd.DataFrame({"sender": [graph.senders[i] for i in s], "receiver": [graph.receivers[j][0] for j in r],
                          "input": [graph.receivers[j][1] for j in r], "score": scores[s, r] if s else [],
                          "subsets": result.counts, "bound": result.bound, "lowest": result.lowest,
                          "flagged": result.flagged})
    order = np.argsort(-frame["bound"].to_numpy(), kind="stable")
    return frame.iloc[order].reset_index(drop=True)
