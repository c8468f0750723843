"""Figures of `attnprobe patch`: docs/guides/patch.md."""

from __future__ import annotations

from figures import fmt
from figures.registry import Outputs, figure
from figures.runs import INDUCTION

PATCH = "`attnprobe patch --model smollm2-135m --task ioi --n 16 --method both --out outputs/patch --threads 2`"


def row(r) -> dict:
    return {"head": fmt.head(int(r["layer"]), int(r["head"])), "layer": int(r["layer"]),
            "effect": [float(r["effect"]), float(r["effect_lo"]), float(r["effect_hi"])],
            "attribution": float(r["attribution"])}


@figure("patch-smollm2", runs=("patch-smollm2",), images={"patch-smollm2/patching.png": "smollm2-135m-patching.png"})
def patch_smollm2(out: Outputs) -> dict:
    table = out.csv("patch-smollm2", "patching.csv")
    info = out.json("patch-smollm2", "patch.json")
    ranked = table.sort_values(["effect", "layer", "head"], ascending=[False, True, True])
    by_attribution = table.sort_values(["attribution", "layer", "head"], ascending=[False, True, True])
    top = [row(r) for _, r in ranked.head(8).iterrows()]
    step = out.step("patch-smollm2", "patch")
    return {
        "pairs": info["pairs"]["count"], "corruption": info["pairs"].get("corruption"),
        "ld_clean": info["ld_clean"], "ld_corrupt": info["ld_corrupt"], "top": top,
        "negative": [row(r) for _, r in table.sort_values("effect").head(3).iterrows()],
        "above": int((table["effect_lo"] > 0).sum()), "heads": int(len(table)),
        "top_attribution": [fmt.head(int(r.layer), int(r.head)) for r in by_attribution.head(8).itertuples()],
        "spearman": info.get("spearman"), "disagreements": info.get("disagreements", []),
        "induction": INDUCTION.split(","), "wall": info["wall_seconds"], "load": step["load_average"],
        "machine": out.when("patch-smollm2"),
    }


@patch_smollm2.renderer
def _(d: dict) -> str:
    rows = [[h["head"], fmt.vci(*h["effect"], sign=True), fmt.signed(h["attribution"]),
             "yes" if h["head"] in d["induction"] else ""] for h in d["top"]]
    found = [h["head"] for h in d["top"] if h["head"] in d["induction"]]
    overlap = (f"{fmt.listing(found)}, one of the probe's top induction heads ({fmt.listing(d['induction'])}), "
               "is among them" if len(found) == 1 else
               f"{fmt.listing(found)}, of the probe's top induction heads ({fmt.listing(d['induction'])}), are "
               "among them" if found else
               f"none of the probe's top induction heads ({fmt.listing(d['induction'])}) is among them")
    worst = "; ".join(f"{x['head']} activation {fmt.signed(x['effect'])}, attribution {fmt.signed(x['attribution'])}"
                      for x in d["disagreements"][:3])
    rho = "n/a" if d["spearman"] is None else fmt.num(d["spearman"], 2)
    return "\n\n".join([
        f"Over {d['pairs']} IOI pairs ({d['corruption']} corruption) the logit difference is "
        f"{fmt.vci(d['ld_clean']['mean'], d['ld_clean']['ci_low'], d['ld_clean']['ci_high'], sign=True)} on the "
        f"clean prompts and "
        f"{fmt.vci(d['ld_corrupt']['mean'], d['ld_corrupt']['ci_low'], d['ld_corrupt']['ci_high'], sign=True)} on "
        f"the corrupt ones. {d['above']} of the {d['heads']} heads have a denoising effect whose 95% interval is "
        f"above 0. The strongest eight are below; {overlap}.",
        fmt.table(["head", "effect [95% interval]", "attribution", "induction head"], rows),
        f"Attribution patching ranks the heads with Spearman {rho} against activation patching; its own top eight "
        f"are {fmt.listing(d['top_attribution'])}. Where the two differ most: {worst}.",
        "![patching effect of every head](../images/smollm2-135m-patching.png)",
        fmt.source(f"{PATCH} ({fmt.seconds(d['wall'])} of patching; {fmt.machine(d['machine']['machine'], d['load'])}; "
                   f"{d['machine']['date']})"),
    ])


@figure("bench-patch", runs=("bench-patch",))
def bench_patch(out: Outputs) -> dict:
    return {**out.json("bench-patch", "patch.json"), "when": out.when("bench-patch")}


@bench_patch.renderer
def _(d: dict) -> str:
    w = d["when"]
    met = {k: "met" if v else "missed" for k, v in d["targets_met"].items()}
    rows = [
        [f"plain loop: one corrupt forward per head, x {d['heads']}", fmt.seconds(d["plain_loop_s"]), "", ""],
        ["the same, the LM head on every position (a causal LM's forward)", fmt.seconds(d["plain_loop_all_logits_s"]),
         "", ""],
        [f"`attnprobe patch` sweep, all {d['heads']} heads", fmt.seconds(d["sweep_s"]),
         f"**{fmt.num(d['sweep_ratio'], 2)}** x the plain loop (target <= 0.5: {met['sweep']}); "
         f"{fmt.num(d['sweep_ratio_all_logits'], 2)} x the second", f"{fmt.num(d['sweep_mib'], 0)} MiB"],
        ["one corrupt forward", fmt.seconds(d["corrupt_forward_s"]), "",
         f"{fmt.num(d['corrupt_forward_mib'], 0)} MiB"],
        ["attribution, every head and position", fmt.seconds(d["attribution_s"]),
         f"**{fmt.num(d['attribution_ratio'], 2)}** x one corrupt forward (target <= 4: {met['attribution']})",
         f"{fmt.num(d['attribution_mib'], 0)} MiB"],
    ]
    memory = "n/a" if d["memory_ratio"] is None else fmt.num(d["memory_ratio"], 2)
    return (fmt.table(["way", "time", "ratio", "peak memory above the loaded model"], rows) + "\n\n"
            + f"The sweep's peak memory is {memory} x the corrupt forward's (target <= 2: {met['memory']}).\n\n"
            + fmt.source(f"`.venv/bin/python benchmarks/bench_patch.py --pairs 16 --threads 2` ({d['model']}, "
                         f"{d['pairs']} IOI pairs, {d['tokens']} tokens; {d['threads']} threads; "
                         f"{fmt.machine(w['machine'], w['load'])}; {w['date']})"))
