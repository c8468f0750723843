"""The composition figure of docs/guides/compose.md: `attnprobe compose` on SmolLM2-135M, its strongest edges per
mode against the random baseline, and where the probe's induction heads take their keys from."""

from __future__ import annotations

import pandas as pd

from figures import fmt
from figures.registry import Outputs, figure
from figures.results import top

MODES = ("Q", "K", "V")
SHOWN = 5  # edges per mode in the table
INDUCTION_SHOWN = 3  # the probe's top induction heads whose K-composition senders the text names


def rank_of(frame: pd.DataFrame, kind: str, name: str) -> int:
    """1-based rank of head `name` by the probe's `kind` score (1: the highest)."""
    order = frame.sort_values([kind, "layer", "head"], ascending=[False, True, True])
    names = [fmt.head(r.layer, r.head) for r in order.itertuples()]
    return names.index(name) + 1


@figure("compose-smollm2", runs=("compose-smollm2", "probe-smollm2"), images={
    "compose-smollm2/composition.png": "smollm2-135m-composition.png"})
def compose_smollm2(out: Outputs) -> dict:
    table = out.csv("compose-smollm2", "composition.csv")
    record = out.json("compose-smollm2", "composition.json")
    probe = out.csv("probe-smollm2", "probe.csv")
    base = record["baseline"]
    modes = {}
    for mode in MODES:
        rows = table[table["mode"] == mode].nlargest(SHOWN, "score")
        modes[mode] = {"pairs": record["modes"][mode]["pairs"], "above": record["modes"][mode]["above_baseline_3sd"],
                       "mean": record["modes"][mode]["mean"],
                       "top": [[fmt.head(r.sender_layer, r.sender_head), fmt.head(r.receiver_layer, r.receiver_head),
                                float(r.score)] for r in rows.itertuples()]}
    induction = [h for h in top(probe, "induction") if h["above"]][:INDUCTION_SHOWN]
    keys = table[table["mode"] == "K"]
    senders = {}
    for head in induction:
        layer, index = (int(x) for x in head["head"][1:].split("H"))
        into = keys[(keys["receiver_layer"] == layer) & (keys["receiver_head"] == index)].nlargest(3, "score")
        senders[head["head"]] = [[fmt.head(r.sender_layer, r.sender_head), float(r.score),
                                  rank_of(probe, "previous", fmt.head(r.sender_layer, r.sender_head))]
                                 for r in into.itertuples()]
    step = out.step("compose-smollm2", "compose")
    return {"baseline": base, "modes": modes, "senders": senders, "heads": int(len(probe)),
            "norm": record["norm"], "gqa": record["gqa"], "kv_heads": record["kv_heads"], "heads_per_layer":
            record["heads"], "layers": record["layers"], "seconds": step["seconds"], **out.when("compose-smollm2")}


@compose_smollm2.renderer
def _(d: dict) -> str:
    base = d["baseline"]
    rows = [[mode, f"{sender} → {receiver}", fmt.num(score, 3), fmt.num(score / base["mean"], 1)]
            for mode, m in d["modes"].items() for sender, receiver, score in m["top"]]
    above = "; ".join(f"{mode}: {fmt.whole(m['above'])} of {fmt.whole(m['pairs'])} "
                      f"({fmt.percent(m['above'], m['pairs'])}), mean {fmt.num(m['mean'], 3)}"
                      for mode, m in d["modes"].items())
    induction = []
    for head, senders in d["senders"].items():
        named = ", ".join(f"{s} ({fmt.num(score, 3)}, previous-token rank {rank} of {d['heads']})"
                          for s, score, rank in senders)
        induction.append(f"- {head}: {named}")
    return "\n".join([
        f"SmolLM2-135M ({d['layers']} layers of {d['heads_per_layer']} query heads on {d['kv_heads']} KV heads, "
        f"RMSNorm): random matrices of its heads' shapes score {fmt.num(base['mean'], 4)} ± "
        f"{fmt.num(base['sd'], 4)} ({base['samples']} pairs). Pairs above the baseline by 3 of its standard "
        f"deviations, per mode: {above}. The strongest edges:",
        "",
        fmt.table(["mode", "sender → receiver", "score", "× baseline"], rows),
        "",
        "The strongest K-composition senders of the probe's top induction heads (each sender's rank among the "
        f"{d['heads']} heads by the probe's previous-token score in brackets):",
        "",
        *induction,
        "",
        "![The strongest composition edges of SmolLM2-135M](../images/smollm2-135m-composition.png)",
        "",
        fmt.source(f"`attnprobe compose --model smollm2-135m` ({fmt.num(d['seconds'], 0)} s) and `attnprobe probe "
                   f"--model smollm2-135m` on {fmt.machine(d['machine'], d['load'])}, {d['date']}"),
    ])
