"""The trained pattern's figure of docs/kv-cache.md ("Train a pattern"): `attnprobe train-pattern` at its defaults on
SmolLM2-135M, its time and peak memory against the targets its defaults were sized for, and its gates."""

from __future__ import annotations

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
