"""Figures of `attnprobe ablate`: docs/guides/ablate.md and the README."""

from __future__ import annotations

from figures import fmt
from figures.registry import Outputs, figure

ABLATE = "`attnprobe ablate --model smollm2-135m --corpus corpora/sentences.txt --out outputs --layers --threads 1`"


def ablation_table(out: Outputs):
    heads = out.csv("ablate-smollm2", "importance.csv")
    types = out.csv("ablate-smollm2", "head_types.csv")[["layer", "head", "head_type"]]
    entropy = out.csv("ablate-smollm2", "heads.csv")[["layer", "head", "entropy"]]
    return heads.merge(types, on=["layer", "head"]).merge(entropy, on=["layer", "head"])


def head_row(r) -> dict:
    return {"head": fmt.head(r["layer"], r["head"]), "layer": int(r["layer"]), "type": r["head_type"],
            "loss": [float(r["loss_change"]), float(r["loss_change_ci_low"]), float(r["loss_change_ci_high"])]}


@figure("ablate-smollm2", runs=("ablate-smollm2",), images={
    "ablate-smollm2/importance.png": "smollm2-135m-importance.png",
    "ablate-smollm2/importance_vs_type.png": "smollm2-135m-importance_vs_type.png"})
def ablate_smollm2(out: Outputs) -> dict:
    table = ablation_table(out)
    layers = out.csv("ablate-smollm2", "layer_importance.csv")
    pruning = out.csv("ablate-smollm2", "pruning.csv")
    info = out.json("ablate-smollm2", "ablate.json")
    ranked = table.sort_values(["loss_change", "layer", "head"], ascending=[False, True, True])
    top10 = ranked.head(10)
    by_kl = table.sort_values(["kl", "layer", "head"])
    sinks = table[table["head_type"] == "sink"]
    curve = {order: {int(r.percent): [float(r.loss), float(r.kl)] for r in frame.itertuples()}
             for order, frame in pruning.groupby("order", sort=False)}
    lay = layers.sort_values("loss_change", ascending=False)
    step = out.step("ablate-smollm2", "ablate")
    return {
        "heads": int(len(table)), "base_loss": curve["kl"][0][0],
        "top10_layers": [int(x) for x in top10["layer"]], "top10_types": list(top10["head_type"]),
        "top": [head_row(r) for _, r in ranked.head(5).iterrows()],
        "bottom": [head_row(r) for _, r in ranked.tail(5).iloc[::-1].iterrows()],
        "layers_top": [[int(r.layer), float(r.loss_change)] for r in lay.head(4).itertuples()],
        "layers_include_zero": int(((layers["loss_change_ci_low"] <= 0) & (layers["loss_change_ci_high"] >= 0)).sum()),
        "layers_negative": [[int(r.layer), float(r.loss_change)]  # removing the layer lowers the loss (interval)
                            for r in layers[layers["loss_change_ci_high"] < 0].itertuples()],
        "rank_entropy_loss": float(table["entropy"].corr(table["loss_change"], method="spearman")),
        "rank_entropy_kl": float(table["entropy"].corr(table["kl"], method="spearman")),
        "above": int((table["loss_change_ci_low"] > 0).sum()), "below": int((table["loss_change_ci_high"] < 0).sum()),
        "sinks": int(len(sinks)), "sink_median_loss": float(sinks["loss_change"].median()),
        "median_kl": {t: float(table[table["head_type"] == t]["kl"].median()) for t in ("sink", "mixed", "broad")},
        "sinks_small": int((sinks["loss_change"].abs() < 0.01).sum()), "sink_max": float(sinks["loss_change"].max()),
        "lowest_kl": list(by_kl["head_type"]),
        "curve": curve, "spearman": info["spearman"], "seconds": info["seconds"], "wall": info["wall_seconds"],
        "threads": info["threads"]["threads"], "load": step["load_average"], "machine": out.when("ablate-smollm2"),
    }


def loss(h: dict, with_ci: bool = True) -> str:
    text = f"{h['head']} ({h['type']}) {fmt.signed(h['loss'][0])}"
    return text + (f" {fmt.ci(*h['loss'][1:], sign=True)}" if with_ci else "")


def bottom_sentence(d: dict) -> str:
    bottom_two = d["top10_layers"].count(0) + d["top10_layers"].count(1)
    sharp = {"local", "copy", "sink", "previous"}
    kinds = "broad or mixed, not sharp" if not sharp & set(d["top10_types"]) else \
        "of types " + fmt.listing(sorted(set(d["top10_types"])))
    where = "The heads that matter sit at the bottom: " if bottom_two >= 5 else ""
    return f"{where}{bottom_two} of the 10 most important are in layers 0-1, and they are {kinds}"


def lowest_kl_sentence(types: list[str]) -> str:
    """The heads of smallest KL up to the second that is not a sink: '26 sinks and one mixed head'."""
    others = [k for k, t in enumerate(types) if t != "sink"]
    if not others:
        return "The heads with the smallest KL are all sinks."
    end = others[1] if len(others) > 1 else len(types)
    first = types[others[0]]
    return f"The {end} heads with the smallest KL are {end - 1} sinks and one {first} head."


def curve_of(d: dict) -> dict[str, dict[int, list[float]]]:
    """The pruning curve, order -> percent -> [loss, kl], with whole-number percents (JSON keeps them as text)."""
    return {order: {int(p): v for p, v in points.items()} for order, points in d["curve"].items()}


def curve_sentence(d: dict) -> str:
    c = curve_of(d)
    base = d["base_loss"]
    kl = c["kl"]
    flat = max(p for p in kl if all(kl[q][0] - base < 0.05 for q in kl if q <= p))
    after = min((p for p in kl if p > flat), default=None)
    text = (f"Removed by increasing KL, {flat}% of the heads leave the loss at most 0.05 nats above where it was "
            f"({fmt.num(base, 2)})")
    if after is not None:
        text += f" and {after}% cost {fmt.signed(kl[after][0] - base, 2)} nats"
    text += f"; in random order 10% already costs {fmt.signed(c['random'][10][0] - base, 2)}."
    text += (" Ordering by the single-head loss change first removes the heads whose absence lowers the loss, and "
             f"together they shift the distribution (KL {fmt.num(c['ablation'][10][1], 2)} at 10%): a head that "
             "helps alone is not a head that is safe to remove with others.")
    return text


@ablate_smollm2.renderer
def _(d: dict) -> str:
    top, bottom, c = d["top"], d["bottom"], curve_of(d)
    lay = d["layers_top"]
    negative = d["layers_negative"]
    lowers = ""
    if negative:
        names = fmt.listing([str(layer) for layer, _ in negative]).replace(" and ", " or ")
        lowers = (f", and removing layer {names} lowers the loss slightly "
                  f"({fmt.signed(min(v for _, v in negative), 2)})")
    small, sinks = d["sinks_small"], d["sinks"]
    lowest_text = lowest_kl_sentence(d["lowest_kl"])
    sharper = d["rank_entropy_loss"] > 0
    orders = ["ablation", "kl", "gradient", "random"]
    rows = [[f"{p}%", *[f"{fmt.num(c[o][p][0], 2)} / {fmt.num(c[o][p][1], 2)}" for o in orders]]
            for p in sorted(c["kl"])]
    gap = max(abs(c["gradient"][p][0] - c["kl"][p][0]) for p in c["kl"] if p <= 50)
    s = d["seconds"]
    lines = [
        f"**SmolLM2-135M** on the bundled corpus ({ABLATE}: zero ablation; the unablated loss is "
        f"{fmt.num(d['base_loss'], 2)} nats per token; head types from `make demo` + "
        "`attnprobe classify --out outputs --scheme extended`):",
        "",
        "![Loss change when each head of SmolLM2-135M is ablated](../images/smollm2-135m-importance.png)",
        "",
        "![Loss change against entropy and head type, SmolLM2-135M](../images/smollm2-135m-importance_vs_type.png)",
        "",
        f"- {bottom_sentence(d)}. {loss(top[0])} nats/token, {', '.join(loss(h) for h in top[1:])}. Whole layers: "
        f"ablating layer {lay[0][0]} costs {fmt.signed(lay[0][1], 2)} nats/token, layer {lay[1][0]} "
        f"{fmt.signed(lay[1][1], 2)}, then layer {lay[2][0]} {fmt.signed(lay[2][1], 2)} and layer {lay[3][0]} "
        f"{fmt.signed(lay[3][1], 2)}; the intervals of {d['layers_include_zero']} layers include 0{lowers}.",
        f"- Sharp heads matter {'less, not more' if sharper else 'more'}: the rank correlation of entropy with the "
        f"loss change is {fmt.signed(d['rank_entropy_loss'], 2)}, and with the KL "
        f"{fmt.signed(d['rank_entropy_kl'], 2)}.",
        f"- The least important heads lower the loss: {loss(bottom[0])}, "
        f"{', '.join(loss(h, False) for h in bottom[1:])}. (This is the Instruct model on plain sentences, not "
        f"chat.) {d['above'] + d['below']} of the {d['heads']} heads have an interval that excludes 0: {d['above']} "
        f"above, {d['below']} below.",
        f"- **Are the {sinks} sink heads prunable?** One at a time, yes: their median loss change is "
        f"{fmt.num(d['sink_median_loss'])} and their median KL {fmt.num(d['median_kl']['sink'])} (mixed heads "
        f"{fmt.num(d['median_kl']['mixed'])}, broad {fmt.num(d['median_kl']['broad'])}); {small} of them "
        f"({fmt.percent(small, sinks)}) move the loss by less than 0.01 nats, and none by more than "
        f"{fmt.signed(d['sink_max'])}. {lowest_text}",
        "- Pruning curve, loss / KL at each percentage of the "
        f"{d['heads']} heads removed (zero ablation):",
        "",
        *["    " + line for line in fmt.table(["removed", "`ablation` order", "`kl` order", "`gradient` order",
                                               "`random` order"], rows).split("\n")],
        "",
        f"    {curve_sentence(d)}",
        f"- The gradient screen agrees with the ablation only roughly: Spearman {fmt.num(d['spearman'], 2)} over the "
        f"{d['heads']} heads. Its pruning curve stays within {fmt.num(gap, 2)} nats of the KL order's up to 50%, so it "
        "finds what is safe to remove better than it ranks the heads that matter.",
        f"- Time ({d['threads']} thread, {fmt.machine(d['machine']['machine'], d['load'])}; {d['machine']['date']}): "
        f"{fmt.whole(s['ablate'])} s for the {d['heads']} ablations (+ {fmt.whole(s['gradient'])} s gradient, "
        f"{fmt.whole(s['pruning'])} s pruning), {fmt.whole(d['wall'])} s in all.",
    ]
    return "\n".join(lines)


@figure("ablate-sink-groups", runs=("sink-groups", "ablate-smollm2"))
def ablate_sink_groups(out: Outputs) -> dict:
    return out.json("sink-groups", "sink-groups.json")


@ablate_sink_groups.renderer
def _(d: dict) -> str:
    g = d["groups"]
    zero, mean = g["sink, zero"], g["sink, mean"]
    randoms = [v["loss_change"][0] for k, v in g.items() if k.startswith("random")]
    constant = mean["loss_change"][0] < zero["loss_change"][0] / 4
    return (f"All {d['heads']} sink heads at once are another matter: zeroing every sink head costs "
            f"{fmt.vci(*zero['loss_change'], 2, True)} nats/token (KL {fmt.num(zero['kl'][0], 2)}), against "
            f"{fmt.signed(min(randoms), 1)} to {fmt.signed(max(randoms), 1)} for {len(randoms)} random sets of "
            f"{d['heads']} heads. With **mean** ablation the same {d['heads']} heads cost "
            f"{fmt.vci(*mean['loss_change'], 2, True)} (KL {fmt.num(mean['kl'][0], 2)})"
            + (": a sink head's output is nearly a constant, so it can go if that constant stays (as a bias), not if "
               "it becomes 0." if constant else ".")
            + " (These group numbers come from `ablate.prune_passes` in Python with the sink mask; the CLI's pruning "
            "curve removes heads in the orders above.)\n\n"
            + fmt.source("`python -m figures.steps sink-groups` (the sink heads of the extended classification, "
                         "and random sets drawn with numpy seeds 1-3)"))


@figure("readme-ablate", runs=("ablate-smollm2", "sink-groups"))
def readme_ablate(out: Outputs) -> dict:
    return {**ablate_smollm2.collect(out), "groups": ablate_sink_groups.collect(out)}


@readme_ablate.renderer
def _(d: dict) -> str:
    g = d["groups"]
    return (f"- `attnprobe ablate`: {bottom_sentence(d)[0].lower() + bottom_sentence(d)[1:]} ({loss(d['top'][0])} "
            f"nats/token). Zeroing all {g['heads']} sink heads at once costs "
            f"{fmt.vci(*g['groups']['sink, zero']['loss_change'], 2, True)} nats/token; with mean ablation, "
            f"{fmt.vci(*g['groups']['sink, mean']['loss_change'], 2, True)} ([ablate](docs/guides/ablate.md)).")


@figure("ablate-minilm", runs=("ablate-minilm",))
def ablate_minilm(out: Outputs) -> dict:
    table = out.csv("ablate-minilm", "importance.csv")
    pruning = out.csv("ablate-minilm", "pruning.csv")
    info = out.json("ablate-minilm", "ablate.json")
    ranked = table.sort_values(["embedding_change", "layer", "head"], ascending=[False, True, True])
    layer_means = table.groupby("layer")["embedding_change"].mean()
    half = pruning[pruning["percent"] == 50].set_index("order")["embedding_change"]
    best = ranked.iloc[0]
    least = ranked.iloc[-1]
    return {"layer_means": {int(k): float(v) for k, v in layer_means.items()},
            "top": [fmt.head(r.layer, r.head) for r in ranked.head(5).itertuples()],
            "best": [float(best["embedding_change"]), float(best["embedding_change_ci_low"]),
                     float(best["embedding_change_ci_high"])],
            "least": [fmt.head(least["layer"], least["head"]), float(least["embedding_change"])],
            "spearman": info["spearman"], "half": {k: float(v) for k, v in half.items()},
            "seconds": info["wall_seconds"], "method": info["method"],
            "heads_per_layer": int(table.groupby("layer").size().max())}


@ablate_minilm.renderer
def _(d: dict) -> str:
    means = {int(k): v for k, v in d["layer_means"].items()}
    last = max(means)
    others = [v for k, v in means.items() if k != last]
    in_last = means[last] > 2 * max(others)
    ordered = [d["half"][o] for o in ("ablation", "gradient") if o in d["half"]]
    return (f"**MiniLM-L6** (`attnprobe ablate --model minilm-l6 --corpus corpora/sentences.txt --out outputs/minilm`,"
            f" {d['method']} ablation, {fmt.seconds(d['seconds'])} in all): "
            + (f"the heads that move the sentence embedding are in the last layer. Its {d['heads_per_layer']} heads "
               if in_last else f"layer {last}'s heads ")
            + f"average an `embedding_change` of {fmt.num(means[last])} against {fmt.span(others, 3)} in layers "
            f"0-{last - 1}; the top five are {d['top'][0]} {fmt.vci(*d['best'])}, {fmt.listing(d['top'][1:])}, and "
            f"the least important, {d['least'][0]}, changes it by {fmt.num(d['least'][1], 4)}. The gradient screen "
            f"agrees with the ablation {'nearly exactly' if d['spearman'] > 0.95 else 'roughly'} here (Spearman "
            f"{fmt.num(d['spearman'])}), and removing half of the heads in either order turns the embedding by "
            f"{fmt.span(ordered, 3)} (1 - cosine), against {fmt.num(d['half']['random'], 2)} in random order.")


@figure("bench-ablate", runs=("bench-ablate",))
def bench_ablate(out: Outputs) -> dict:
    return {**out.json("bench-ablate", "ablate.json"), "when": out.when("bench-ablate")}


@bench_ablate.renderer
def _(d: dict) -> str:
    w = d["when"]
    rows = [[f"naive: {d['heads']} x one pass over the corpus ({fmt.num(d['naive_per_head'], 2)} s, mean of "
             f"{fmt.listing(d['naive_heads'])})", fmt.whole(d["naive"])],
            [f"attnprobe, all {d['heads']} heads", fmt.whole(d["attnprobe"])],
            ["ratio", f"**{fmt.num(d['ratio'])}** (target <= {d['target']}: "
                      f"{'met' if d['ratio'] <= d['target'] else 'missed'})"]]
    return (fmt.table(["way", "seconds"], rows) + "\n\n"
            + fmt.source(f"`.venv/bin/python benchmarks/bench_ablate.py --threads 1` ({d['threads']} thread; "
                         f"{fmt.machine(w['machine'], w['load'])}; {w['date']})"))

