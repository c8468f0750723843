"""Figures of what heads move and of the block bootstrap: docs/classification.md (dormant sinks), docs/metrics.md
(SmolLM2's value-weighted scores, the block bootstrap's coverage) and docs/long-documents.md (what the block
bootstrap costs).

Wording that depends on the numbers (whether sinks write less than other heads, whether ablation agrees, how
many heads fall below the threshold) is decided here, from the data, so a new measurement cannot leave a sentence
that no longer holds.
"""

from __future__ import annotations

import math

from figures import fmt
from figures.registry import Outputs, figure

DORMANT = "`.venv/bin/python benchmarks/dormant_sinks.py`"
LOUD = 0.8  # the loudest heads: those writing at least this share of what the loudest head writes


def ceil_sig(x: float) -> float:
    """`x` rounded up to one significant digit: 0.0013 -> 0.002, so 'within 0.002' holds."""
    if x <= 0:
        return 0.0
    unit = 10 ** math.floor(math.log10(x))
    return math.ceil(round(x / unit, 9)) * unit


def is_sink(kind: str) -> bool:
    return kind in ("sink", "dormant")


# ---- dormant sinks: benchmarks/dormant_sinks.py ------------------------------------------------------------------


@figure("dormant-sinks", runs=("dormant-sinks",))
def dormant_sinks(out: Outputs) -> dict:
    return {**out.json("dormant-sinks", "dormant.json"), "date": out.when("dormant-sinks")["date"]}


def loud_heads(d: dict) -> list[dict]:
    """The heads whose output_norm_ratio is at least LOUD times the largest one, by layer and head."""
    top = d["loudest"][0]["ratio"]
    loud = [h for h in d["loudest"] if h["ratio"] >= LOUD * top]
    return sorted(loud, key=lambda h: (h["layer"], int(h["head"].split("H")[1])))


def loud_sentence(d: dict) -> str:
    """'SmolLM2's loudest heads are L24H6, L24H7 and L24H8 (sinks of layer 24), writing 5.4 to 5.7 times ...'."""
    loud = loud_heads(d)
    what = []
    if all(is_sink(h["type"]) for h in loud):
        what.append("sinks" if len(loud) > 1 else "a sink")
    layers = {h["layer"] for h in loud}
    if len(layers) == 1:
        what.append(f"of layer {layers.pop()}")
    kind = (" (" + " ".join(what) + ")") if what else ""
    ratios = fmt.span([h["ratio"] for h in loud], 1).replace("-", " to ")
    rest = d["loudest"][len(loud):]
    after = f"; the next, {rest[0]['head']} ({rest[0]['type']}), {fmt.num(rest[0]['ratio'], 1)}" if rest else ""
    if len(loud) == 1:
        return f"SmolLM2's loudest head is {loud[0]['head']}{kind}, writing {ratios} times its layer's median{after}"
    return (f"SmolLM2's loudest heads are {fmt.listing([h['head'] for h in loud])}{kind}, writing {ratios} times "
            f"their layer's median{after}")


def threshold_row(t: dict, default: float) -> list[str]:
    cells = [fmt.num(t["threshold"], 1), str(t["dormant"]), str(t["others_below"]),
             *(fmt.num(v, 4) for v in (*t["loss_change"], *t["kl"]))]
    return [f"**{c}**" for c in cells] if math.isclose(t["threshold"], default) else cells


def below_default(d: dict) -> str:
    """Who of the heads that are not sinks falls below the default: 'a single other head (a mixed one, at 0.483)'."""
    below = d["others_below_default"]
    if not below:
        return "no other head"
    if len(below) == 1:
        return f"a single other head (a {below[0]['type']} one, at {fmt.num(below[0]['ratio'])})"
    named = ", ".join(f"{b['head']} {b['type']} {fmt.num(b['ratio'])}" for b in below)
    return f"{len(below)} other heads ({named})"


@dormant_sinks.renderer
def _(d: dict) -> str:
    default = d["default"]
    q = d["ratio_quantiles"]
    rows = [t for t in d["thresholds"] if t["dormant"] > 0]
    at_default = next(t for t in d["thresholds"] if math.isclose(t["threshold"], default))
    higher = [t for t in rows if t["threshold"] > default]
    m = d["medians"]
    dormant = d["dormant_heads"]
    spread = ("Sinks write less than other heads" if q["sinks"][-1] < q["others"][-1] else
              "Sinks do not write less than other heads")
    gap = ("there is no gap between two groups: the threshold is a choice" if d["ratio_max"]["sinks"] >= q["others"][0]
           else "the two groups do not overlap")
    kl_agrees = m["kl"]["dormant"] is not None and m["kl"]["dormant"] < m["kl"]["other_sinks"]
    loss_near = ceil_sig(max(abs(m["loss_change"]["dormant"] or 0.0), abs(m["loss_change"]["other_sinks"])))
    loss_small = loss_near < abs(m["loss_change"]["others"])
    vw = [h["first_token_unforced_vw"] for h in dormant]
    ratios = [h["ratio"] for h in dormant]
    lines = [
        loud_sentence(d) + ".",
        "",
        "The threshold comes from SmolLM2-135M on the bundled corpus. "
        f"{DORMANT} runs `analyze`, `classify --scheme extended` and `ablate --no-pruning` (zero ablation of every "
        "head) on `smollm2-135m` over `corpora/sentences.txt` and prints the tables below. Quantiles of "
        "`output_norm_ratio`:",
        "",
        fmt.table(["heads", "min", *(f"{round(100 * x)}%" for x in d["quantiles"][1:-1]), "median"], [
            [f"the {d['sinks']} sinks", *(fmt.num(v) for v in q["sinks"])],
            [f"the {d['others']} other heads", *(fmt.num(v) for v in q["others"])]]),
        "",
        f"{spread}, but {gap}. At {fmt.num(default, 1)}, {at_default['dormant']} of the {d['sinks']} sinks are dormant "
        f"and {below_default(d)} {'falls' if len(d['others_below_default']) <= 1 else 'fall'} below the line"
        + "".join(f"; at {fmt.num(t['threshold'], 1)}, {t['others_below']} other heads do" for t in higher[:1])
        + "".join(f"; at {fmt.num(t['threshold'], 1)}, {t['others_below']}" for t in higher[1:]) + ". "
        f"{fmt.num(default, 1)} takes the sinks that write less than "
        + ("any head that is not a sink" if not d["others_below_default"] else
           f"all but {len(d['others_below_default'])} of the {d['others']} heads that are not sinks")
        + ' ("half the layer\'s typical head").',
        "",
        ("Ablation agrees in direction: zeroing a dormant sink changes the model less than zeroing another sink."
         if kl_agrees else
         "Ablation does not confirm the rule here: zeroing a dormant sink does not change the next-token "
         "distribution less than zeroing another sink.") + " Medians over heads, per threshold:",
        "",
        fmt.table(["threshold", "dormant sinks", "other heads below", "loss_change, dormant",
                   "loss_change, other sinks", "kl, dormant", "kl, other sinks"],
                  [threshold_row(t, default) for t in rows]),
        "",
        "(`loss_change` in nats per token, `kl` the mean KL divergence of the next-token distribution; the "
        f"{d['others']} heads that are not sinks have medians {fmt.num(m['loss_change']['others'], 4)} and "
        f"{fmt.num(m['kl']['others'], 4)}.) "
        + (f"By loss, single sinks matter less than other heads, dormant or not: both medians are within "
           f"{fmt.sig(loss_near, 1)} nats of zero. " if loss_small else
           f"By loss, the medians of dormant and other sinks are {fmt.num(m['loss_change']['dormant'], 4)} and "
           f"{fmt.num(m['loss_change']['other_sinks'], 4)}. ")
        + "The KL, which counts any change of the next-token distribution, "
        + (f"separates them: a dormant sink's median is {fmt.percent(m['kl']['dormant'], m['kl']['other_sinks'])} of "
           f"the other sinks' and {fmt.percent(m['kl']['dormant'], m['kl']['others'])} of the median of the heads "
           "that are not sinks. " if kl_agrees else "does not separate them. ")
        + f"The {len(dormant)} dormant sinks at {fmt.num(default, 1)}:",
        "",
        fmt.table(["head", "first_token_unforced", "first_token_unforced_vw", "output_norm_ratio", "loss_change", "kl"],
                  [[h["head"], *(fmt.num(h[k], 4) for k in ("first_token_unforced", "first_token_unforced_vw",
                                                             "ratio", "loss_change", "kl"))] for h in dormant]),
        "",
        f"SmolLM2's dormant sinks are {'quiet, not silent' if min(ratios) > 0.1 else 'quiet, some nearly silent'}: "
        + ("their first token still carries most of what they move (`first_token_unforced_vw` "
           if min(vw) > 0.5 else "their first token carries part of what they move (`first_token_unforced_vw` ")
        + f"{fmt.span(vw, 2).replace('-', ' to ')}), and they write {fmt.span(ratios, 2).replace('-', ' to ')} of "
        "their layer's median head. The dormant heads Guo et al. (2024, \"Active-dormant attention heads\") describe "
        "go further: the first token's value is near zero, so a head on it moves nearly nothing (`first_token_vw` "
        "near 0, which the tests plant). On another model, or with another corpus, check the ratio's spread with the "
        "script before trusting the default.",
        "",
        fmt.source(f"{DORMANT} ({d['date']})"),
    ]
    return "\n".join(lines)


@figure("value-weighted-smollm2", runs=("dormant-sinks",))
def value_weighted_smollm2(out: Outputs) -> dict:
    d = dormant_sinks.collect(out)
    return {k: d[k] for k in ("heads", "sinks", "value_weighted", "loudest", "date")}


@value_weighted_smollm2.renderer
def _(d: dict) -> str:
    vw = d["value_weighted"]
    entropy = vw["all"]["entropy"]
    first = vw["all"]["first_token_unforced"]
    sinks = vw["sinks"]["first_token_unforced"]
    low = vw["lowest_sink"]
    loud = loud_heads(d)
    verb = "spreads" if entropy[1] > entropy[0] else "sharpens"
    beyond = ("The first token attracts attention beyond what it moves" if first[1] < first[0] else
              "The first token moves at least as much as the attention it attracts")
    still = ("but in SmolLM2 it still moves something" if low["first_token_unforced_vw"] > 0.1 else
             "and in SmolLM2 some sinks take almost nothing from it")
    loud_text = (f"The loudest heads are sinks too: {fmt.listing([h['head'] for h in loud])} write "
                 f"{fmt.span([h['ratio'] for h in loud], 1).replace('-', ' to ')} times their layer's median "
                 "`output_norm`." if all(is_sink(h["type"]) for h in loud) else
                 f"The loudest heads, {fmt.listing([h['head'] for h in loud])}, write "
                 f"{fmt.span([h['ratio'] for h in loud], 1).replace('-', ' to ')} times their layer's median "
                 "`output_norm`.")
    return (
        "On SmolLM2-135M and the bundled corpus (`attnprobe analyze --model smollm2-135m --corpus "
        f"corpora/sentences.txt`, summarised by {DORMANT}), weighing by value {verb} the attention: the mean entropy "
        f"over the {d['heads']} heads goes from {fmt.num(entropy[0], 4)} to {fmt.num(entropy[1], 4)} nats, and the "
        f"first-token mass over the rows with a choice from {fmt.num(first[0], 4)} to {fmt.num(first[1], 4)} (over "
        f"the {d['sinks']} sinks, from {fmt.num(sinks[0], 4)} to {fmt.num(sinks[1], 4)}). {beyond}, {still}: the "
        f"lowest `first_token_unforced_vw` of a sink is {low['head']}'s {fmt.num(low['first_token_unforced_vw'], 4)} "
        f"({fmt.num(low['first_token_unforced'], 4)} raw). {loud_text}\n\n"
        + fmt.source(f"{DORMANT} ({d['date']})"))


# ---- the block bootstrap: its coverage (docs/metrics.md) and its cost (docs/long-documents.md) -----------------


@figure("block-coverage", runs=("block-coverage",))
def block_coverage(out: Outputs) -> dict:
    return out.json("block-coverage", "block-coverage.json")


@block_coverage.renderer
def _(d: dict) -> str:
    sd = math.sqrt(0.95 * 0.05 / d["trials"])
    return (
        f"A simulation in the tests checks the coverage: for series of {fmt.whole(d['rows'])} rows in which each row "
        f"is correlated with the next (AR(1), phi = {d['phi']}), the 95% block interval (blocks of "
        f"{d['block_length']} rows) held the true mean in {fmt.num(d['rate'], 2)} of {d['trials']} series, where "
        f"resampling single rows as if independent held it in {fmt.num(d['single_rows'], 2)}. The test asserts a "
        f"rate within 3 binomial standard deviations of 0.95 ({fmt.num(3 * sd, 3)}), widened by 0.02 below (a block "
        "bootstrap slightly underestimates the variance at this block length), and under 0.85 for single rows.\n\n"
        + fmt.source("the simulation of `tests/test_block_bootstrap.py` (`python -m figures.steps block-coverage`)"))


@figure("block-bootstrap-cost", runs=("bench-block-bootstrap", "gpl3"))
def block_bootstrap_cost(out: Outputs) -> dict:
    when = out.when("bench-block-bootstrap")
    step = out.step("gpl3", "analyze")
    return {**out.json("bench-block-bootstrap", "block.json"), "machine": when["machine"], "load": when["load"],
            "date": when["date"], "gpl3": {"tokens": out.json("gpl3", "run.json")["tokens"],
                                          "seconds": step["seconds"], "date": out.when("gpl3")["date"]}}


@block_bootstrap_cost.renderer
def _(d: dict) -> str:
    rows = [[fmt.whole(r["rows"]), r["block_length"], fmt.num(r["draw_seconds"], 2), fmt.sig(r["resample_seconds"], 2),
             fmt.num(r["held_mib"], 1)] for r in d["lengths"]]
    g = d["gpl3"]
    near = min(d["lengths"], key=lambda r: abs(r["rows"] - g["tokens"]))
    share = (near["draw_seconds"] + near["resample_seconds"]) / g["seconds"]
    return (
        f"What the resampling costs, on values shaped like SmolLM2's ({d['layers']} layers x {d['heads']} heads x "
        f"{d['scores']} scores, {fmt.whole(d['resamples'])} resamples), measured {d['date']} with "
        f"`.venv/bin/python benchmarks/bench_block_bootstrap.py` on {fmt.machine(d['machine'], d['load'])}:\n\n"
        + fmt.table(["rows", "block length", "draw the blocks, s", f"resample all {d['layers']} layers, s",
                     "one layer's rows, MiB"], rows) + "\n\n"
        f"For the {fmt.whole(g['tokens'])}-token GPL-3 text, drawing and resampling "
        + ("its rows" if near["rows"] == g["tokens"] else f"{fmt.whole(near['rows'])} rows")
        + f" takes {fmt.percent(share, 1)} of the whole `analyze` run ({fmt.seconds(g['seconds'])} on {g['date']}, "
        "[below](#smollm2-on-a-long-document)).\n\n"
        + fmt.source("`.venv/bin/python benchmarks/bench_block_bootstrap.py`"))


@figure("readme-value-weighted", runs=("dormant-sinks",))
def readme_value_weighted(out: Outputs) -> dict:
    d = dormant_sinks.collect(out)
    return {k: d[k] for k in ("sinks", "value_weighted", "date")}


@readme_value_weighted.renderer
def _(d: dict) -> str:
    vw = d["value_weighted"]
    sinks = vw["sinks"]["first_token_unforced"]
    verb = "less" if sinks[1] < sinks[0] else "more"
    return (f"- Value-weighted scores (`<score>_vw` of `attnprobe analyze`): weighing each key by the size of what it "
            "writes, SmolLM2's "
            f"{d['sinks']} sinks put {verb} on the first token ({fmt.num(sinks[0], 2)} of the attention, "
            f"{fmt.num(sinks[1], 2)} value-weighted)"
            + (": the first token draws more attention than it moves" if sinks[1] < sinks[0] else "")
            + " ([metric definitions](docs/metrics.md#what-a-head-moves-value-weighted-scores)).")
