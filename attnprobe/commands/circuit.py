"""`attnprobe circuit`: which paths carry a behaviour: every edge between heads, MLPs, the input and the logits scored
by edge attribution patching, the circuit chosen, its faithfulness over circuit size beside random circuits."""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from attnprobe.commands.common import (
    check_placement,
    err_console,
    friendly_errors,
    load,
    out_console,
    release_offload,
    say_written,
    set_bos,
    stage_progress,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BosChoice,
    BosOption,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    MaxMemoryOption,
    ModelOption,
    OutOption,
    ThreadsOption,
)
from attnprobe.errors import AttnprobeError
from attnprobe.naming import visible
from attnprobe.threads import apply as apply_threads

TASK_NAMES = "ioi, greater-than, arithmetic, multiple-choice"


class MethodChoice(str, Enum):
    eap = "eap"
    eap_ig = "eap-ig"
    exact = "exact"


class AblationChoice(str, Enum):
    patch = "patch"
    mean = "mean"


@friendly_errors
def circuit(
    model: ModelOption,
    task: Annotated[
        str | None, typer.Option("--task", help=f"Generate the prompt pairs: {TASK_NAMES} (tokenizer-aware, "
                                 "offline).")
    ] = None,
    pairs: Annotated[
        Path | None, typer.Option("--pairs", metavar="FILE", help="Prompt pairs instead, JSON lines as `patch` "
                                  "reads them: clean, corrupt, answer, wrong.")
    ] = None,
    n: Annotated[int, typer.Option("--n", help="--task: how many pairs.")] = 64,
    out: OutOption = DEFAULT_OUT,
    method: Annotated[
        MethodChoice, typer.Option("--method", help="eap: one clean and one corrupt forward and one backward score "
                                   "every edge; eap-ig: the gradient averaged over --steps points between the corrupt "
                                   "and clean input embeddings; exact: every edge patched alone (small models).")
    ] = MethodChoice.eap_ig,
    steps: Annotated[int, typer.Option("--steps", help="--method eap-ig: integration steps.")] = 5,
    grad_drop: Annotated[
        bool, typer.Option("--grad-drop", help="AtP*'s GradDrop: the scores again with the gradient through each "
                           "block dropped in turn, the mean of their magnitudes (unsigned; layers x the passes).")
    ] = False,
    qk_fix: Annotated[
        bool, typer.Option("--qk-fix", help="AtP*'s QK fix: the edges into queries and keys scored with the patched "
                           "attention pattern recomputed exactly (linear only after it), where saturated attention "
                           "hides them from the gradient. Costs about one attention recomputation per (sender, "
                           "layer) pair; with --grad-drop, once per block dropped; with eap-ig, at the clean run. "
                           "Every block shape read: pre-norm, sandwich (Gemma 2 and 3, soft-capping included) and "
                           "post-norm (OPT-350m).")
    ] = False,
    top: Annotated[
        int | None, typer.Option("--top", help="The circuit: the edges of largest |score|, this many.  [default: 1% "
                                 "of the edges]", show_default=False)
    ] = None,
    threshold: Annotated[
        float | None, typer.Option("--threshold", help="The circuit instead: every edge whose |score| is at least "
                                   "this.")
    ] = None,
    sizes: Annotated[
        str, typer.Option("--sizes", help="The faithfulness curve's circuit sizes, as fractions of the edges (MIB's "
                          "by default); none: no curve.")
    ] = ",".join(f"{v:g}" for v in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)),
    random: Annotated[
        int, typer.Option("--random", help="Random circuits of each size beside the curve (their mean and 95% "
                          "interval).")
    ] = 5,
    ablation: Annotated[
        AblationChoice, typer.Option("--ablation", help="What an edge outside the circuit carries: patch = the "
                                     "corrupt run's sender output; mean = its mean over the clean prompts.")
    ] = AblationChoice.patch,
    check: Annotated[
        int, typer.Option("--check", help="Also patch the top this-many edges exactly, beside their scores.")
    ] = 0,
    missed: Annotated[
        int, typer.Option("--missed", metavar="K", help="With --check: bound what the check missed (after AtP*'s "
                          "subsampling diagnostic): K random subsets of the unverified edges patched together, and "
                          "each edge's exact effect bounded at 95% from the subsets that hold it; edges whose bound "
                          "reaches the smallest verified effect are flagged. Costs K patched runs of the pairs. "
                          "Pre-norm and sandwich-norm decoders.")
    ] = 0,
    missed_p: Annotated[
        float, typer.Option("--missed-p", metavar="P", help="--missed: each unverified edge's chance to be in a "
                            "subset (keep K x P >= 10 so that most edges are in 5 subsets or more, the fewest a bound "
                            "needs; smaller P: tighter bounds).")
    ] = 0.1,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --task's pairs, of the random circuits and of --missed's "
                                      "subsets.")] = 0,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Which paths carry a behaviour: score every edge of the model's graph (heads, MLPs, input, logits) over prompt
    pairs, choose the circuit, measure its faithfulness; write edges.csv, circuit.json, importances.json (MIB's
    layout) and the figures."""
    from attnprobe import circuit as cc
    from attnprobe.commands.folder import ResultsFolder

    if (pairs is None) == (task is None):
        raise AttnprobeError(f"give the prompt pairs: --task ({TASK_NAMES}) or --pairs FILE, one of them")
    if pairs is not None and n != 64:
        raise AttnprobeError("--n does nothing here: it applies to --task; drop it")
    if method is not MethodChoice.eap_ig and steps != 5:
        raise AttnprobeError("--steps does nothing here: it applies to --method eap-ig; drop it")
    fractions = parse_sizes(sizes)
    if random < 0 or check < 0:
        raise AttnprobeError(f"{'--random' if random < 0 else '--check'}: give 0 or more")
    if missed_p != 0.1 and not missed:
        raise AttnprobeError("--missed-p does nothing here: it applies to --missed K; drop it")
    folder = ResultsFolder(out, "circuit", {"--pairs": pairs, "--model": model})
    folder.check()
    folder.apart()
    check_placement(device_map, max_memory)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    folder.hold()
    try:
        made, metric, kind, source = prompt_pairs(loaded, task, pairs, n, seed)
        with stage_progress("steps") as progress:
            layout, result = cc.find_circuit(loaded, made, metric, method=method.value, steps=steps,
                                             grad_drop=grad_drop, qk_fix=qk_fix, top=top,
                                             threshold=threshold, fractions=fractions, randoms=random,
                                             ablation=ablation.value, check=check, missed_subsets=missed,
                                             missed_p=missed_p, seed=seed, progress=progress)
    finally:
        release_offload(loaded)
    run = record(loaded, layout, result, made, source, method=method.value, steps=steps, grad_drop=grad_drop,
                 qk_fix=qk_fix, top=top, threshold=threshold, random=random, ablation=ablation.value, kind=kind,
                 seed=seed)
    run["threads"] = threads_used
    written = write(out, layout, result, run, f"{model}: {len(made)} pairs, {method.value}")
    folder.sweep()
    for note in run["notes"]:
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(summary(layout, result, run))
    say_written(written)


def parse_sizes(text: str) -> list[float]:
    """`0.01,0.1,1` -> [0.01, 0.1, 1.0]; `none` -> [] (no faithfulness curve)."""
    from attnprobe.circuit import check_fractions

    if text.strip().lower() == "none":
        return []
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise AttnprobeError(f"--sizes {text}: give fractions of the edges separated by commas, e.g. 0.01,0.1,1") \
            from None
    check_fractions(values)
    return values


def prompt_pairs(loaded, task: str | None, path: Path | None, n: int, seed: int) -> tuple[list, Any, str, dict]:
    """The pairs, the metric over them, its kind and where the pairs came from (the tasks module's)."""
    from attnprobe import tasks

    if task is not None:
        if task not in tasks.TASKS:
            raise AttnprobeError(f"--task {task!r}: use one of {', '.join(tasks.TASKS)}")
        made, kind, source = tasks.task_pairs(loaded, task, n, seed), tasks.METRIC[task], {"from": f"task {task}",
                                                                                              "seed": seed}
    else:
        made, kind, source = tasks.file_pairs(loaded, path), "logit-diff", {"from": str(path)}
    return made, (lambda logits, rows: tasks.metric_value(logits, rows, kind)), kind, source


def record(loaded, layout, result, pairs: list, source: dict, *, method: str, steps: int, grad_drop: bool,
           qk_fix: bool, top: int | None, threshold: float | None, random: int, ablation: str, kind: str,
           seed: int) -> dict[str, Any]:
    """circuit.json: the model, the pairs, the settings, the circuit, its faithfulness curve, CPR and CMD."""
    import numpy as np

    from attnprobe import __version__
    from attnprobe.records import model_record, model_weights, versions

    graph = layout.graph
    chosen = np.nonzero(result.circuit)
    edges = sorted(({"sender": graph.senders[s], "receiver": graph.receivers[r][0],
                     "input": graph.receivers[r][1], "score": float(result.scores[s, r])}
                    for s, r in zip(*chosen)), key=lambda e: -abs(e["score"]))
    faith = result.faithfulness
    notes = []
    if faith is not None and abs(faith.clean - faith.corrupt) < 0.1:
        notes.append(f"the clean and corrupt metric differ by only {faith.clean - faith.corrupt:+.3f}: faithfulness "
                     "divides by it and is unreliable; choose pairs the model answers differently")
    return {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {**model_record(loaded), "weights_sha256": model_weights(loaded)},
        "pairs": {**source, "count": len(pairs)},
        "method": method, "steps": steps if method == "eap-ig" else None, "grad_drop": grad_drop, "qk_fix": qk_fix,
        "metric": kind,
        "score": score_text(method, grad_drop, qk_fix),
        "graph": {"layers": graph.layers, "heads": graph.heads, "kv_heads": graph.kv_heads,
                  "senders": len(graph.senders), "receivers": len(graph.receivers), "edges": graph.edge_count,
                  "kv_groups": graph.groups()},
        "circuit": {"chosen_by": "threshold" if threshold is not None else "top", "top": top,
                    "threshold": threshold, "edges": edges},
        "faithfulness": None if faith is None else {
            "ablation": ablation, "random_circuits": random, "seed": seed,
            "definition": "(M_circuit - M_corrupt) / (M_clean - M_corrupt), edges outside the circuit patched",
            "clean": faith.clean, "corrupt": faith.corrupt, "cpr": faith.cpr, "cmd": faith.cmd,
            "random_cpr": faith.random_cpr, "random_cmd": faith.random_cmd,
            "curve": faith.curve.to_dict(orient="records"),
        },
        "exact_check": None if result.exact is None else result.exact.to_dict(orient="records"),
        "missed": None if result.missed is None else missed_record(graph, result, seed),
        "seconds": result.seconds,
        "bos": loaded.bos, "device": str(loaded.device), "dtype": loaded.dtype,
        "notes": notes,
        "versions": versions(),
    }


def missed_record(graph, result, seed: int, listed: int = 20) -> dict[str, Any]:
    """circuit.json's "missed": the diagnostic's settings and assumption, the largest bound, the flagged edges (the
    first `listed` by bound) and every subset's size and effect."""
    import numpy as np

    from attnprobe import circuit as cc

    found = result.missed
    table = cc.missed_table(graph, result.scores, found)
    finite = table[np.isfinite(table["bound"])]
    flagged = table[table["flagged"]]

    def rows(frame) -> list[dict[str, Any]]:
        return [{**row, "bound": none_if_inf(row["bound"]), "lowest": none_if_inf(row["lowest"])}
                for row in frame.drop(columns="flagged").to_dict(orient="records")]

    return {
        "subsets": len(found.effects), "p": found.p, "confidence": found.confidence, "seed": seed,
        "definition": ("each unverified edge's |exact effect| <= its bound at the confidence: the j-th largest "
                       "|effect| of the random subsets (each edge in with chance p) that hold it, patched together, "
                       "j the largest rank with P(Binomial(k, 1/2) <= j - 1) <= 1 - confidence (k: its subsets); "
                       "assumes a subset holding the edge changes the metric at least as much as the edge alone "
                       "with chance >= 1/2 (no systematic cancellation). lowest: the smallest such |effect|, the "
                       "bound if no subset cancels the edge at all (AtP*'s assumption)"),
        "unverified_edges": len(table), "bounded_edges": len(finite),
        "smallest_verified": found.smallest_verified,
        "largest_bound": rows(finite.head(1))[0] if len(finite) else None,
        "flagged_edges": len(flagged), "flagged": rows(flagged.head(listed)),
        "subset_sizes": found.members.sum(1).tolist(), "subset_effects": found.effects.tolist(),
    }


def none_if_inf(value: float) -> float | None:
    import math

    return None if math.isinf(value) else float(value)


def score_text(method: str, grad_drop: bool, qk_fix: bool) -> str:
    """What circuit.json's scores are, in words."""
    if method == "exact":
        return "change of the mean metric when the edge alone is patched"
    text = ("mean over blocks dropped of |first-order change| (GradDrop)" if grad_drop else
            "first-order change of the mean metric when the edge is patched to the corrupt run")
    if qk_fix:
        text += ("; edges into queries and keys: the patched attention pattern recomputed exactly, first order only "
                 "after it (QK fix)")
    return text


def write(out, layout, result, run: dict, title: str) -> list[Path]:
    """edges.csv (with --missed, each unverified edge's bound as missed_bound), circuit.json, importances.json and,
    where the plotting module has them, the two figures."""
    from attnprobe import circuit as cc
    from attnprobe import io

    graph = layout.graph
    edges = cc.edge_table(graph, result.scores, result.circuit)
    if result.missed is not None:  # each unverified edge's bound (inf: too few subsets), blank for the verified
        bound = {(graph.senders[s], *graph.receivers[r]): b for (s, r), b in zip(result.missed.edges,
                                                                                  result.missed.bound)}
        edges["missed_bound"] = [bound.get(key, float("nan")) for key in zip(edges["sender"], edges["receiver"],
                                                                             edges["input"])]
    files = {io.CIRCUIT_EDGES_FILE: io.csv_writer(edges), io.CIRCUIT_RUN_FILE: io.json_writer(run),
             io.CIRCUIT_IMPORTANCES_FILE: io.compact_json_writer(
                 cc.mib_importances(graph, result.scores, result.circuit, layout.w_out[0].shape[0]))}
    files.update(figures(graph, edges, result, title))
    written = io.write_files(out, files)
    if result.faithfulness is None:  # an earlier run's curve would stand beside a circuit.json without one
        (Path(out) / io.FAITHFULNESS_FIGURE).unlink(missing_ok=True)
    return written


def figures(graph, edges, result, title: str) -> dict[str, Any]:
    """circuit.png (the circuit by layer, sized to the model) and faithfulness.png (when measured)."""
    from attnprobe import io, plotting

    made = {io.CIRCUIT_FIGURE: io.figure_writer(plotting.circuit_figure(edges, graph.layers, title))}
    if result.faithfulness is not None:
        made[io.FAITHFULNESS_FIGURE] = io.figure_writer(plotting.faithfulness_figure(result.faithfulness.curve, title))
    return made


def summary(layout, result, run: dict) -> Table:
    """The ten edges of largest |score| and the circuit's faithfulness."""
    edges = run["circuit"]["edges"]
    faith = run["faithfulness"]
    heading = (f"{run['model']['spec']}: {run['method']}, {run['pairs']['count']} pairs, {len(edges)} of "
               f"{run['graph']['edges']} edges in the circuit")
    caption = f"{run['metric']}"
    if faith is not None:
        caption += (f": clean {faith['clean']:+.3f}, corrupt {faith['corrupt']:+.3f}; CPR {faith['cpr']:.3f}, "
                    f"CMD {faith['cmd']:.3f}")
        if faith["random_cpr"] is not None:
            caption += f" (random circuits: CPR {faith['random_cpr']:.3f})"
    found = run.get("missed")
    if found is not None:
        largest = found["largest_bound"]
        caption += (f"\nmissed ({found['subsets']} subsets, {found['confidence']:.0%}): "
                    + (f"largest bound {largest['bound']:.4f} ({largest['sender']} -> {largest['receiver']}"
                       f"{' ' + largest['input'] if largest['input'] else ''}); " if largest else "no edge bounded; ")
                    + f"{found['flagged_edges']} of {found['unverified_edges']} unverified edges may reach the "
                    f"smallest verified effect {found['smallest_verified']:.4f}")
    table = Table(title=Text(visible(heading)), caption=caption)
    for name in ("sender", "receiver", "input", "score"):
        table.add_column(name, justify="right" if name == "score" else "left")
    for edge in edges[:10]:
        table.add_row(edge["sender"], edge["receiver"], edge["input"] or "-", f"{edge['score']:+.4f}")
    return table
