"""The trained pattern's figure of docs/kv-cache.md ("Train a pattern"): `attnprobe train-pattern` at its defaults on
SmolLM2-135M, its time and peak memory against the targets its defaults were sized for, and its gates."""

from __future__ import annotations

import pandas as pd

from figures import fmt
from figures.registry import Outputs, figure

TARGET_MINUTES = 20.0  # what the defaults were sized for: the default run on SmolLM2-135M, two CPU cores
TARGET_GIB = 4.0


@figure("train-smollm2", runs=("train-smollm2",))
def train_smollm2(out: Outputs) -> dict:
    step = out.step("train-smollm2", "train")
    run = out.json("train-smollm2", "train_pattern.json")
    gates = out.csv("train-smollm2", "gates.csv")
    log = out.csv("train-smollm2", "training.csv")
    trained = gates[gates["trained"]]
    ranked = trained.sort_values(["gate", "layer", "kv_head"], ascending=[False, True, True])
    per_layer = trained.assign(low=trained["gate"] < 0.5).groupby("layer")["low"].agg(["sum", "size"])
    return {"measured": True, "seconds": step["seconds"], "peak_rss_mib": step["peak_rss_mib"],
            "threads": (run.get("threads") or {}).get("threads"), "settings": run["settings"],
            "kv_heads": int(len(trained)), "windowed_layers": run.get("windowed_layers", []),
            "mean_gate": float(trained["gate"].mean()), "below_half": int((trained["gate"] < 0.5).sum()),
            "top": [{"head": f"L{int(r.layer)} KV{int(r.kv_head)}", "gate": float(r.gate)}
                    for r in ranked.head(8).itertuples()],
            "streaming_layers": [int(layer) for layer, row in per_layer.iterrows() if row["sum"] == row["size"]],
            "distill_first": float(log["distill_loss"].iloc[:5].mean()),
            "distill_last": float(log["distill_loss"].iloc[-5:].mean()),
            **out.when("train-smollm2")}


@train_smollm2.renderer
def _(d: dict) -> str:
    if not d.get("measured"):
        return ("Not measured yet: `python -m figures --only train-smollm2` runs `attnprobe train-pattern --model "
                "smollm2-135m` at its defaults (about 20 minutes on two cores) and fills in its time, peak memory "
                "and gates here.")
    minutes, gib = d["seconds"] / 60, d["peak_rss_mib"] / 1024
    s = d["settings"]
    verdict = (f"{'within' if minutes <= TARGET_MINUTES else 'over'} the target of {fmt.num(TARGET_MINUTES, 0)} "
               f"minutes, and {fmt.num(gib, 2)} GiB peak RSS, {'within' if gib <= TARGET_GIB else 'over'} the "
               f"target of {fmt.num(TARGET_GIB, 0)} GiB")
    rows = [[h["head"], fmt.num(h["gate"], 3)] for h in d["top"]]
    streaming = fmt.layers(d["streaming_layers"]) if d["streaming_layers"] else "none"
    return "\n".join([
        f"At its defaults ({s['steps']} steps on samples of {', '.join(fmt.whole(n) for n in s['lengths'])} "
        f"tokens, {d['threads']} threads) the training of SmolLM2-135M's {d['kv_heads']} KV heads took "
        f"{fmt.num(minutes, 1)} minutes, {verdict}. The mean gate ended at {fmt.num(d['mean_gate'], 3)}; "
        f"{d['below_half']} of {d['kv_heads']} KV heads ended below 0.5 (streaming by DuoAttention's threshold); "
        f"layers whose KV heads all did: {streaming}. The distillation loss, mean of the first five steps "
        f"{fmt.sci(d['distill_first'])}, of the last five {fmt.sci(d['distill_last'])}. The KV heads that kept the "
        "highest gates:",
        "",
        fmt.table(["KV head", "gate"], rows),
        "",
        fmt.source(f"`attnprobe train-pattern --model smollm2-135m --threads 2` on "
                   f"{fmt.machine(d['machine'], d['load'])}, {d['date']}"),
    ])


def _gates(out: Outputs, folder: str) -> pd.Series:
    """One train-pattern folder's trained gates, indexed by (layer, kv_head)."""
    gates = out.csv(RUN_OF[folder], f"{folder}/gates.csv")
    return gates[gates["trained"]].set_index(["layer", "kv_head"])["gate"]


def rank_correlation(a: pd.Series, b: pd.Series) -> float:
    """Spearman's rank correlation of two gate tables (Pearson's of their ranks, ties at their mean rank)."""
    return float(a.rank().corr(b.reindex(a.index).rank()))


def lowest_shared(a: pd.Series, b: pd.Series, count: int) -> int:
    """How many of the `count` lowest gates of `a` are among the `count` lowest of `b` (the KV heads an export
    makes streaming at that count, ties by position)."""
    return len(set(a.sort_values(kind="stable").index[:count]) & set(b.sort_values(kind="stable").index[:count]))


RUN_OF = {"float32-8": "train-steps", "bfloat16-8": "train-steps", "float32-24": "train-steps-long"}


@figure("train-steps", runs=("train-steps", "train-steps-long"))
def train_steps(out: Outputs) -> dict:
    runs = {}
    for folder, run in RUN_OF.items():
        log = out.csv(run, f"{folder}/training.csv")
        gates = _gates(out, folder)
        runs[folder] = {"seconds": out.step(run, folder)["seconds"], "steps": int(len(log)),
                        "below_half": int((gates < 0.5).sum()), "min_gate": float(gates.min()),
                        "mean_gate": float(gates.mean()), "distill": [float(x) for x in log["distill_loss"]]}
    short, bf16, long = (_gates(out, f) for f in RUN_OF)
    half = len(long) // 2
    return {"runs": runs, "kv_heads": int(len(long)), "settings": out.json("train-steps-long", "float32-24/"
                                                                            "train_pattern.json")["settings"],
            "short_vs_long": rank_correlation(short, long), "half": half,
            "short_long_half": lowest_shared(short, long, half),
            "bf16_vs_float32": rank_correlation(bf16, short), "bf16_float32_half": lowest_shared(bf16, short, half),
            **out.when("train-steps-long")}


@train_steps.renderer
def _(d: dict) -> str:
    if not d.get("runs"):
        return "Not measured yet: `python -m figures --only train-steps` fills this in."
    r, s = d["runs"], d["settings"]
    short, bf16, long = r["float32-8"], r["bfloat16-8"], r["float32-24"]
    ratios = [b / f for b, f in zip(bf16["distill"], short["distill"]) if f > 0]
    def below(run: dict) -> str:
        return (f"{'no gate' if run['below_half'] == 0 else fmt.whole(run['below_half']) + ' gates'} after "
                f"{run['steps']} steps (the lowest {fmt.num(run['min_gate'], 3)})")

    return "\n".join([
        f"On SmolLM2-135M at a quick size (samples of {', '.join(fmt.whole(n) for n in s['lengths'])} tokens, sink "
        f"{s['sink']}, recent {s['recent']}, one thread), {short['steps']} steps took {fmt.seconds(short['seconds'])} "
        f"and {long['steps']} steps {fmt.seconds(long['seconds'])}. The order of the {d['kv_heads']} KV heads' gates "
        f"after {short['steps']} steps against after {long['steps']}: rank correlation "
        f"{fmt.num(d['short_vs_long'], 3)}; {d['short_long_half']} of the {d['half']} lowest are the same. The 0.5 "
        f"threshold is another matter: below it, {below(short)}, {below(long)}.",
        "",
        f"In bfloat16 ({fmt.seconds(bf16['seconds'])} for {bf16['steps']} steps) the distillation loss is "
        f"{fmt.num(ratios[0], 1)}x float32's at step 2 and {fmt.num(ratios[-1], 1)}x at step {bf16['steps']}: the "
        "model's own rounding of its hidden states, which the float32 gates, mix and loss cannot remove, adds a floor "
        "that matters while the gates are near 1. It does not scramble what the gates learn: their order against "
        f"float32's after {bf16['steps']} steps, rank correlation {fmt.num(d['bf16_vs_float32'], 3)}; "
        f"{d['bf16_float32_half']} of the {d['half']} lowest are the same.",
        "",
        fmt.source("`attnprobe train-pattern --model smollm2-135m --steps 8 --lengths 384,448 --sink-size 16 "
                   "--recent-size 64 --threads 1` (and `--dtype bfloat16`, and `--steps 24`) on "
                   f"{fmt.machine(d['machine'], d['load'])}, {d['date']}"),
    ])
