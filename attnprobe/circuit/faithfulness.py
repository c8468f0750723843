"""Circuits and their faithfulness (MIB): top and random circuits, every edge outside one patched, CPR and CMD."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from attnprobe.ablate import fast_attention
from attnprobe.circuit.graph import Graph
from attnprobe.circuit.layout import Layout
from attnprobe.circuit.runs import (
    Deltas,
    Metric,
    Pass,
    Prompts,
    chunks,
    forward,
    measure,
    outputs,
    part,
    real_positions,
    recorded,
)
from attnprobe.circuit.stream import Walk, point
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

ABLATIONS = ("patch", "mean")
PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes (fractions of edges)
CONFIDENCE = 0.95


def top_edges(graph: Graph, scores: np.ndarray, count: int) -> np.ndarray:
    """The `count` real edges of largest |score| (ties: the earlier edge), as a [senders, receivers] bool mask."""
    flat = np.where(graph.mask, np.abs(scores), -np.inf).ravel()  # [senders * receivers]
    order = np.argsort(-flat, kind="stable")[: min(count, graph.edge_count)]
    chosen = np.zeros(flat.shape, dtype=bool)
    chosen[order] = True
    return chosen.reshape(graph.mask.shape)


def random_edges(graph: Graph, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` real edges drawn uniformly without replacement, as a mask."""
    real = np.flatnonzero(graph.mask.ravel())
    chosen = np.zeros(graph.mask.size, dtype=bool)
    chosen[rng.choice(real, size=min(count, real.size), replace=False)] = True
    return chosen.reshape(graph.mask.shape)


@dataclass
class Baseline:
    """One chunk's runs a circuit's evaluation reads: the clean metric, the corrupt one and the corrupt (or mean)
    outputs of every sender."""

    prompts: Prompts
    clean: Tensor  # [pairs]
    corrupt: Tensor  # [pairs]
    replaced: Tensor  # [senders, pairs, seq, hidden]: what a patched edge's sender sends
    stats: dict[int, Tensor] = field(default_factory=dict)  # post-norm: the corrupt run's stream statistics


@torch.inference_mode()
def baselines(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric,
              ablation: str = "patch") -> list[Baseline]:
    """Per chunk of pairs, the clean and corrupt metric and the senders' replacement outputs: the corrupt run's
    (patch), or each sender's mean over every pair's real positions in the clean run (mean)."""
    check_ablation(layout, ablation)
    out = []
    total = None
    count = 0
    with fast_attention(loaded.model):
        for rows in chunks(prompts, layout):
            sub = part(prompts, rows)
            corrupt, corrupt_final, stats = recorded(loaded, layout, sub, sub.corrupt)
            clean_out, clean_final = outputs(loaded, layout, sub, sub.clean)
            if ablation == "mean":
                real = real_positions(sub)  # [1, pairs, seq, 1]
                sums = (clean_out * real).sum((1, 2))  # [senders, hidden]
                total = sums if total is None else total + sums
                count += int(real.sum())
            out.append(Baseline(sub, measure(layout, metric, clean_final, sub)[0].double(),
                                measure(layout, metric, corrupt_final, sub)[0].double(), corrupt, stats))
    if ablation == "mean":
        mean = total / count  # [senders, hidden]
        for base in out:
            base.replaced = mean[:, None, None, :].expand_as(base.replaced).clone()
    return out


def check_ablation(layout: Layout, ablation: str) -> None:
    """Refuses an unknown --ablation, and mean ablation on a post-norm decoder."""
    if ablation not in ABLATIONS:
        raise AttnprobeError(f"--ablation {ablation!r}: use one of {', '.join(ABLATIONS)}")
    if ablation == "mean" and layout.post_norm:
        raise AttnprobeError("--ablation mean on a post-norm decoder: a sender's mean output has no statistics of its "
                             "own to pass the stream's norms with; use --ablation patch")


@torch.inference_mode()
def evaluate(loaded: LoadedModel, layout: Layout, bases: list[Baseline], metric: Metric,
             circuit: np.ndarray) -> float:
    """The mean metric with every real edge outside `circuit` ([senders, receivers] bool) patched: each receiver
    reads its in-circuit senders' outputs as this run computes them and the others' replacement outputs."""
    graph = layout.graph
    outside = torch.from_numpy(graph.mask & ~circuit).float().to(loaded.device)  # [senders, receivers]
    total, count = 0.0, 0
    with fast_attention(loaded.model):
        for base in bases:
            sub = base.prompts
            # [senders, pairs, seq, hidden]: replaced - current as they are computed (post-norm: post_norm_pass's)
            buffer = base.replaced if layout.post_norm else base.replaced.clone()
            real = real_positions(sub)[0]  # [pairs, seq, 1]

            def patch(layer: int, low: int, high: int, buffer: Tensor = buffer, real: Tensor = real) -> Deltas:
                r0 = layer * graph.per_layer + low
                p = graph.prefix(r0)
                weights = outside[:p, r0 : r0 + high - low]  # [prefix, receivers]
                if not bool(weights.any()):
                    return []
                delta = torch.einsum("sr,snh->rnh", weights, buffer[:p].flatten(1, 2))  # [receivers, n, hidden]
                delta = delta.unflatten(1, buffer.shape[1:3]) * real  # [receivers, pairs, seq, hidden]
                return [(low + i, slice(None), delta[i]) for i in range(high - low) if bool(weights[:, i].any())]

            run = (post_norm_pass(layout, base, outside) if layout.post_norm
                   else Pass(record=buffer, subtract=True, patch=patch))
            final = forward(loaded, layout, sub.clean, sub.mask, run)
            total += float(measure(layout, metric, final, sub)[0].double().sum())
            count += sub.last.shape[0]
    return total / count


def post_norm_pass(layout: Layout, base: Baseline, outside: Tensor) -> Pass:
    """evaluate()'s pass on a post-norm decoder: each receiver's input moved by sum over its edges outside the circuit
    of (the sender's corrupt contribution at the receiver's point - its contribution in this run), both records
    carried through the stream's norms as the forward reaches them, each at its own run's statistics."""
    graph = layout.graph
    real = real_positions(base.prompts)[0]  # [pairs, seq, 1]
    run = Pass(record=torch.zeros_like(base.replaced), stats={})
    replaced = Walk(layout, base.replaced.clone(), base.stats)
    current = Walk(layout, run.record, run.stats)

    def patch(layer: int, low: int, high: int) -> Deltas:
        r0 = layer * graph.per_layer + low
        p = graph.prefix(r0)
        weights = outside[:p, r0 : r0 + high - low]  # [prefix, receivers]
        if not bool(weights.any()):
            return []
        target = point(graph, r0)
        sent = replaced.at(target)[:p].flatten(1, 2)  # [prefix, pairs x seq, hidden]
        now = current.at(target)[:p].flatten(1, 2)  # [prefix, pairs x seq, hidden]
        delta = torch.einsum("sr,snh->rnh", weights, sent) - torch.einsum("sr,snh->rnh", weights, now)
        delta = delta.unflatten(1, real.shape[:2]) * real  # [receivers, pairs, seq, hidden]
        return [(low + i, slice(None), delta[i]) for i in range(high - low) if bool(weights[:, i].any())]

    run.patch = patch
    return run


@dataclass
class Faithfulness:
    curve: pd.DataFrame  # edges, fraction, faithfulness, metric, random_mean, random_low, random_high
    clean: float
    corrupt: float
    cpr: float
    cmd: float
    random_cpr: float | None
    random_cmd: float | None


def faithfulness(loaded: LoadedModel, layout: Layout, prompts: Prompts, metric: Metric, scores: np.ndarray, *,
                 fractions: Sequence[float] = PERCENTAGES, randoms: int = 0, ablation: str = "patch",
                 seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Faithfulness:
    """The faithfulness curve of the top-|score| circuits at each fraction of the edges (int(fraction x edges)
    edges, as MIB counts them), beside `randoms` random circuits of each size (their mean and 95% interval), with
    CPR and CMD."""
    check_fractions(fractions)
    graph = layout.graph
    bases = baselines(loaded, layout, prompts, metric, ablation)
    clean = float(torch.cat([b.clean for b in bases]).mean())
    corrupt = float(torch.cat([b.corrupt for b in bases]).mean())
    rng = np.random.default_rng(seed)
    rows = []
    steps, done = len(fractions) * (1 + randoms), 0
    for fraction in fractions:
        count = int(fraction * graph.edge_count)
        value = evaluate(loaded, layout, bases, metric, top_edges(graph, scores, count))
        drawn = [normalized(evaluate(loaded, layout, bases, metric, random_edges(graph, count, rng)), clean, corrupt)
                 for _ in range(randoms)]
        done += 1 + randoms
        if progress:
            progress(done, steps)
        low, high = (np.quantile(drawn, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]) if drawn else (np.nan, np.nan))
        rows.append({"edges": count, "fraction": fraction, "faithfulness": normalized(value, clean, corrupt),
                     "metric": value, "random_mean": float(np.mean(drawn)) if drawn else np.nan,
                     "random_low": float(low), "random_high": float(high)})
    curve = pd.DataFrame(rows)
    cpr, cmd = areas(curve["fraction"].to_numpy(), curve["faithfulness"].to_numpy())
    random_areas = areas(curve["fraction"].to_numpy(), curve["random_mean"].to_numpy()) if randoms else (None, None)
    return Faithfulness(curve, clean, corrupt, cpr, cmd, *random_areas)


def normalized(value: float, clean: float, corrupt: float) -> float:
    """MIB's faithfulness: (M_circuit - M_corrupt) / (M_clean - M_corrupt)."""
    return (value - corrupt) / (clean - corrupt) if clean != corrupt else float("nan")


def areas(fractions: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """CPR and CMD as MIB's evaluate_area_under_curve computes them: trapezoids over the fractions themselves
    (its log_scale flag changes nothing it sums) of f and of |1 - f|, from the first fraction to the last."""
    x, f = np.asarray(fractions, float), np.asarray(values, float)
    width = np.diff(x)  # [sizes - 1]
    cpr = float((width * (f[:-1] + f[1:]) / 2).sum())
    cmd = float((width * (np.abs(1 - f[:-1]) + np.abs(1 - f[1:])) / 2).sum())
    return cpr, cmd


def check_fractions(fractions: Sequence[float]) -> None:
    values = list(fractions)
    if len(values) < 2 or any(not 0 < v <= 1 for v in values) or values != sorted(set(values)):
        raise AttnprobeError(f"--sizes {','.join(str(v) for v in values)}: give two or more increasing fractions of "
                             "the edges in (0, 1], e.g. 0.001,0.01,0.1,1")
