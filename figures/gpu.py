"""The GPU figures of docs/performance.md: what `make gpu-check` measured on a lent GPU (benchmarks/gpu_check.py).

No GPU runs here: a session that is lent one runs `make gpu-check` there and brings its gpu-check.json back; the run
`gpu-check` (part `gpu`, never in `make figures` or PART=all) checks that file and copies it, and this figure renders
it. Until a GPU run exists the block says so, with no figure in it.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from figures import fmt
from figures.registry import Outputs, figure

WAYS = {"sdpa": "SDPA forward (the floor)", "flash_attention_2": "FlashAttention 2 forward",
        "triton": "attnprobe Triton statistics", "triton+vw": "Triton, with the value-weighted scores",
        "fused": "attnprobe fused statistics", "fused+vw": "fused, with the value-weighted scores",
        "blocked": "attnprobe blocked statistics"}


class GpuCheckError(ValueError):
    """A gpu-check.json that is not a GPU run's results: one line saying what is wrong."""


def _seconds(value: object, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise GpuCheckError(f"{what}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _mib(value: object, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise GpuCheckError(f"{what}: expected MiB above 0, got {value!r}")
    return float(value)


def _runs(ways: object, what: str) -> dict:
    """{way: {seconds, peak_mib}} of the ways that ran (those that failed keep their error)."""
    if not isinstance(ways, dict):
        raise GpuCheckError(f"{what}: expected an object of ways")
    found = {}
    for name, run in ways.items():
        if name not in WAYS or not isinstance(run, dict):
            raise GpuCheckError(f"{what}: unknown way {name!r}")
        if "error" in run:
            found[name] = {"error": str(run["error"])[:200]}
            continue
        found[name] = {"seconds": _seconds(run.get("seconds"), f"{what} {name}"),
                       "peak_mib": _mib(run.get("peak_mib"), f"{what} {name}")}
    return found


def merge_reruns(paths: list[Path]) -> dict:
    """One gpu-check.json from a full check and reruns of some of its steps (`make gpu-check STEPS=...`) on the same
    GPU: each rerun's steps replace the earlier ones, and `reruns` records which file gave which steps."""
    merged: dict = {}
    for path in paths:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise GpuCheckError(f"{path}: not a readable JSON file ({type(err).__name__})") from err
        if not isinstance(raw, dict) or not isinstance(raw.get("steps"), dict):
            raise GpuCheckError(f"{path}: not gpu-check.json (no steps)")
        if not merged:
            merged = {**raw, "steps": dict(raw["steps"]), "reruns": []}
            continue
        if (raw.get("environment") or {}).get("gpu") != (merged.get("environment") or {}).get("gpu"):
            raise GpuCheckError(f"{path}: a rerun on another GPU than {paths[0]}'s; rerun every step there")
        steps = {k: v for k, v in raw["steps"].items() if k not in ("environment", "install")}
        merged["steps"].update(steps)
        merged["reruns"].append({"file": Path(path).name, "started": raw.get("started"), "steps": sorted(steps)})
        merged["ok"] = bool(merged.get("ok")) and bool(raw.get("ok"))
    return merged


def read_gpu_check(path: str | Path) -> dict:
    """The figure's data from a gpu-check.json, checked: a GPU run (not the dry run) with its GPU's name, versions and
    timings; GpuCheckError says what is wrong."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GpuCheckError(f"{path}: not a readable JSON file ({type(err).__name__})") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("environment"), dict) or not isinstance(
            raw.get("steps"), dict):
        raise GpuCheckError(f"{path}: not gpu-check.json (no environment or steps)")
    if raw.get("dry") is not False:
        raise GpuCheckError(f"{path}: a dry run on CPU, not GPU figures: run `make gpu-check` on a lent GPU")
    environment = raw["environment"]
    gpu = environment.get("gpu")
    if not isinstance(gpu, str) or not gpu.strip():
        raise GpuCheckError(f"{path}: no GPU name (environment.gpu)")
    bench = raw["steps"].get("bench") or {}
    long_runs = bench.get("long") or {}
    if not isinstance(long_runs, dict) or not all(str(n).isdigit() for n in long_runs):
        raise GpuCheckError(f"{path}: steps.bench.long is not an object of token counts")
    long_found = {str(n): _runs(ways, f"{path}: long {n}") for n, ways in sorted(long_runs.items(),
                                                                                   key=lambda x: int(x[0]))}
    short = bench.get("short") or {}
    short_found = None
    if short.get("runs"):
        short_found = {"sentences": int(short["sentences"]), "batch_size": int(short["batch_size"]),
                       "tokens": int(short["tokens"]), "runs": _runs(short["runs"], f"{path}: short")}
    tests = raw["steps"].get("tests") or {}
    counts = {k: int(v) for k, v in (tests.get("counts") or {}).items() if k in ("passed", "failed", "error",
                                                                                  "skipped")}
    failed = sorted(t for t, o in (tests.get("outcomes") or {}).items() if o in ("FAILED", "ERROR"))
    group = (raw["steps"].get("torchrun") or {}).get("group") or {}
    train = raw["steps"].get("train") or {}
    train_found = None
    if train.get("step_seconds"):
        train_found = {"ok": bool(train.get("ok")), "length": int(train["length"]), "steps": int(train["steps_done"]),
                       "step_seconds": [float(x) for x in train["step_seconds"]], "peak_mib": train.get("peak_mib"),
                       "model_mib": train.get("model_mib"), "sink": train.get("sink"), "recent": train.get("recent"),
                       "mean_gate": train.get("mean_gate")}
    targets = raw.get("targets") or {}
    keep = ("tokens", "fused_time_ratio", "time_met", "time_target", "fused_memory_ratio", "memory_met",
            "memory_target")
    return {"measured": True, "gpu": gpu.strip()[:80], "date": str(raw.get("started", ""))[:10],
            "versions": {k: str(environment.get(k)) for k in ("torch", "cuda", "transformers", "python")},
            "parameters": int(bench.get("model", {}).get("parameters", 0)), "block_mib": bench.get("block_mib"),
            "long": long_found, "short": short_found, "tests": {"counts": counts, "failed": failed[:20]},
            "train": train_found, "reruns": [r.get("steps") for r in raw.get("reruns") or []],
            "torchrun": {"backend": group.get("backend"), "all_reduce_ok": group.get("all_reduce_ok")},
            "targets": {k: targets.get(k) for k in keep}, "triton_targets": targets.get("triton"),
            "eager_bfloat16": targets.get("fused_equals_eager_bfloat16"), "ok": bool(raw.get("ok")),
            "sdpa_fallback": sorted(int(n) for n in (bench.get("sdpa_fallback") or {}) if str(n).isdigit())}


@figure("gpu-check", runs=("gpu-check",))
def gpu_check(out: Outputs) -> dict:
    return read_gpu_check(out.path("gpu-check", "gpu-check.json"))


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "missed"


TRITON_LINES = {  # gpu_check.TRITON_TARGETS's names (<name>_ratio, _met, _target in the JSON): what each says
    "time_longest": "time at the longest length", "time_shortest": "at the shortest",
    "time_vw_longest": "with the value-weighted scores at the longest", "memory_longest": "peak memory at the longest",
    "time_short": "short sentences",
}


def _triton_line(found: dict | None, ran: bool) -> str:
    """The Triton path's targets, or that this run did not measure it (it predates the path, or triton did not run)."""
    if not found or not ran:
        return ("The Triton path (`--attention triton`, which `auto` takes on CUDA) is not in this run: "
                "`make gpu-check` times it beside the other ways, and checks it against the blocked path, on the "
                "next lent GPU.")
    said = [f"{what} {fmt.ratio(found[key + '_ratio']) if found.get(key + '_ratio') else '-'} (at most "
            f"{found.get(key + '_target')}x: {_verdict(found.get(key + '_met'))})"
            for key, what in TRITON_LINES.items()]
    return f"Targets of the Triton path, against the SDPA forward: {'; '.join(said)}."


@gpu_check.renderer
def _(d: dict) -> str:
    if not d.get("measured"):
        return ("No GPU figures have been measured yet: no session with a lent GPU has run `make gpu-check` "
                "(see [Development](development.md#gpu-check)). This block fills in from its results with "
                "`make figures ONLY=gpu-check` once one has.")
    rows = []
    for n, ways in d["long"].items():
        floor = ways.get("sdpa", {})
        for name, run in ways.items():
            if "error" in run:
                rows.append([fmt.whole(int(n)), WAYS[name], run["error"], "", "", ""])
                continue
            time_ratio = fmt.ratio(run["seconds"] / floor["seconds"]) if "seconds" in floor else ""
            memory_ratio = fmt.ratio(run["peak_mib"] / floor["peak_mib"]) if run["peak_mib"] and floor.get(
                "peak_mib") else ""
            rows.append([fmt.whole(int(n)), WAYS[name], fmt.seconds(run["seconds"]),
                         fmt.whole(run["peak_mib"]) if run["peak_mib"] else "", time_ratio, memory_ratio])
    v, t = d["versions"], d["targets"]
    parts = [
        f"On one {d['gpu']} (torch {v['torch']}, CUDA {v['cuda']}, transformers {v['transformers']}), a random model "
        f"of Llama-3.2-1B's shape ({fmt.whole(d['parameters'])} parameters, the base model) in bfloat16, one "
        "sequence; peak GPU memory is torch's `max_memory_allocated`, the model's weights included:",
        "",
        fmt.table(["tokens", "way", "time", "peak GPU MiB", "time / SDPA", "memory / SDPA"], rows),
    ]
    if d.get("sdpa_fallback"):
        parts += ["", "No fused SDPA kernel took the floor's inputs at "
                  f"{fmt.listing([fmt.whole(n) for n in d['sdpa_fallback']])} tokens: there the floor is torch's own "
                  "choice, the math kernel, slower than a fused one."]
    if d.get("short"):
        s = d["short"]
        short_rows = [[WAYS[name], run.get("error") or fmt.seconds(run["seconds"]),
                       "" if "error" in run else fmt.whole(s["tokens"] / run["seconds"])]
                      for name, run in s["runs"].items()]
        parts += ["", f"Short sentences: {s['sentences']} of them ({fmt.whole(s['tokens'])} tokens) in batches of "
                  f"{s['batch_size']}:", "", fmt.table(["way", "time", "tokens/s"], short_rows)]
    eager = d.get("eager_bfloat16") or {}
    counts = d["tests"]["counts"]
    parts += [
        "",
        f"Targets (benchmarks/gpu_check.py's): fused statistics within {t['time_target']}x of the SDPA forward's "
        "time at "
        f"{fmt.whole(t['tokens'] or 0)} tokens: {fmt.ratio(t['fused_time_ratio']) if t['fused_time_ratio'] else '-'}"
        f" ({_verdict(t['time_met'])}); peak memory within {t['memory_target']}x: "
        f"{fmt.ratio(t['fused_memory_ratio']) if t['fused_memory_ratio'] else '-'} ({_verdict(t['memory_met'])}); "
        f"fused = eager to bfloat16's tolerance on the zoo's main families: {eager.get('passed', 0)} of "
        f"{eager.get('tests', 0)} checks passed ({_verdict(eager.get('met'))}).",
        "",
        _triton_line(d.get("triton_targets"), any(name.startswith("triton") for ways in d["long"].values()
                                                  for name in ways)),
        "",
        f"The CUDA tests (`pytest -m cuda`): {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed"
        + (f" ({fmt.listing(d['tests']['failed'])})" if d["tests"]["failed"] else "")
        + f"; `torchrun --nproc-per-node 1` with {d['torchrun']['backend'] or '-'}: all_reduce "
        f"{'correct' if d['torchrun']['all_reduce_ok'] else 'failed'}.",
    ]
    if d.get("train"):
        tr = d["train"]
        parts += ["", f"`attnprobe train-pattern` on the same model in bfloat16 on the GPU (sink {tr['sink']}, recent "
                  f"{tr['recent']}, samples of {fmt.whole(tr['length'])} tokens): {tr['steps']} steps, "
                  f"{fmt.seconds(statistics.median(tr['step_seconds']))} a step (median)"
                  + (f", peak GPU memory {fmt.whole(tr['peak_mib'])} MiB with the model's "
                     f"{fmt.whole(tr['model_mib'])} MiB of weights" if tr["peak_mib"] and tr["model_mib"] else "")
                  + f"{'' if tr['ok'] else ' (the step failed)'}."]
    if d.get("reruns"):
        parts += ["", "Rerun on the same GPU after a fix, and taken from that rerun: "
                  f"{fmt.listing(sorted({s for r in d['reruns'] for s in r}))}."]
    parts += [
        "",
        fmt.source(f"`make gpu-check` (benchmarks/gpu_check.py) on a lent {d['gpu']}, {d['date']}"),
    ]
    return "\n".join(parts)


@figure("readme-gpu", runs=("gpu-check",))
def readme_gpu(out: Outputs) -> dict:
    return gpu_check.collect(out)


@readme_gpu.renderer
def _(d: dict) -> str:
    if not d.get("measured"):
        return ("No GPU has been lent to this project's sessions so far: the CUDA, GPU bfloat16 and NCCL paths are "
                "written and tested on CPU stand-ins (bfloat16 on CPU, gloo for two processes), but have no measured "
                "GPU figure yet ([Performance](docs/performance.md)).")
    v, counts = d["versions"], d["tests"]["counts"]
    return (f"The GPU paths were measured on one lent {d['gpu']} on {d['date']} (torch {v['torch']}, CUDA "
            f"{v['cuda']}, transformers {v['transformers']}): the CUDA tests ({counts.get('passed', 0)} passed, "
            f"{counts.get('failed', 0)} failed), NCCL under `torchrun`, and the long-sequence and train-pattern "
            "figures of a random model of Llama-3.2-1B's shape in bfloat16, by `make gpu-check` "
            "([Performance](docs/performance.md#on-a-gpu)). Every other figure is from the CPU machine its line "
            "names; between GPU loans, CI proves the CUDA, GPU bfloat16 and NCCL code on CPU stand-ins (bfloat16 "
            "on CPU, gloo for two processes).")
