"""Figures of `attnprobe related` (which heads attend alike) and of the token scores, on SmolLM2-135M."""

from __future__ import annotations

import numpy as np

from figures import fmt
from figures.benchmarks import measured_on, timed
from figures.registry import Outputs, figure
from figures.results import probe_facts
from figures.runs import INDUCTION

RELATED = f"`attnprobe related --out outputs --heads {INDUCTION}`"


# ---- related heads on SmolLM2 ------------------------------------------------------------------------------------


def similarity(out: Outputs, run: str) -> tuple[np.ndarray, list[str]]:
    """head_similarity.npz's JS matrix [head, head] and its heads' names."""
    with np.load(out.path(run, "head_similarity.npz")) as z:
        return np.asarray(z["js"]), [fmt.head(int(a), int(b)) for a, b in zip(z["layer"], z["head"])]


def nearest(js: np.ndarray, names: list[str], name: str, k: int = 5) -> list[list]:
    """The k heads nearest `name`, as `related --heads` prints them: [name, js], nearest first."""
    i = names.index(name)
    order = [j for j in np.argsort(js[i], kind="stable") if j != i][:k]
    return [[names[j], float(js[i, j])] for j in order]


def related_facts(out: Outputs) -> dict:
    js, names = similarity(out, "related-smollm2")
    upper = np.triu_indices(len(names), k=1)
    closest = int(np.argmin(js[upper]))
    a, b = upper[0][closest], upper[1][closest]
    heads = out.csv("related-smollm2", "heads.csv")
    types = out.csv("related-smollm2", "head_types.csv")
    frame = heads.merge(types[["layer", "head", "head_type"]], on=["layer", "head"])
    frame["name"] = [fmt.head(r.layer, r.head) for r in frame.itertuples()]
    frame = frame.set_index("name")
    probe = out.csv("probe-smollm2", "probe.csv")
    probe["name"] = [fmt.head(r.layer, r.head) for r in probe.itertuples()]
    probe = probe.set_index("name")
    named = INDUCTION.split(",")
    near = {name: nearest(js, names, name) for name in named}
    involved = sorted({n for rows in near.values() for n, _ in rows} | set(named) | {names[a], names[b]},
                      key=names.index)
    stdout = out.step("related-smollm2", "related")["stdout"].strip().splitlines()
    return {
        "named": named, "nearest": near, "printed": [line for line in stdout if ": nearest " in line],
        "sample": next(line for line in stdout if " query rows, " in line),
        "pairs": int(len(upper[0])), "mean": float(js[upper].mean()),
        "closest": [names[a], names[b], float(js[a, b])],
        "type": {n: str(frame.loc[n, "head_type"]) for n in involved},
        "first_token": {n: float(frame.loc[n, "first_token_unforced"]) for n in involved},
        "induction": {n: float(probe.loc[n, "induction"]) for n in involved},
        "above": {n: bool(probe.loc[n, "induction_above_chance"]) for n in involved},
        "probe": probe_facts(out, "probe-smollm2"),
    }


@figure("related-smollm2", runs=("related-smollm2", "probe-smollm2"), images={
    "related-smollm2/head_similarity.png": "smollm2-135m-head_similarity.png",
    "related-smollm2/head_map.png": "smollm2-135m-head_map.png"})
def related_smollm2(out: Outputs) -> dict:
    return related_facts(out)


def neighbours(d: dict) -> list[str]:
    """Heads among the named heads' nearest that are not named themselves, in order of first mention."""
    found: list[str] = []
    for rows in d["nearest"].values():
        found += [n for n, _ in rows if n not in d["named"] and n not in found]
    return found


def sinks_sentence(d: dict, heads: list[str]) -> str:
    sinks = [n for n in heads if d["type"][n] in ("sink", "dormant")]
    if not sinks:
        return "None of them is a sink under the extended classification."
    share = fmt.span([d["first_token"][n] for n in sinks])
    every = "all of them" if len(sinks) == len(heads) else f"{len(sinks)} of these {len(heads)} heads"
    return (f"The extended classification calls {every} sinks: on natural text each puts {share} of its attention "
            "on the first token (`first_token_unforced` in `heads.csv`).")


@related_smollm2.renderer
def _(d: dict) -> str:
    top = d["probe"]["top"]["induction"]
    named, near = d["named"], d["nearest"]
    mutual = {n: [m for m, _ in near[n] if m in named] for n in named}
    values = [v for rows in near.values() for _, v in rows]
    others = neighbours(d)
    chance = d["probe"]["chance"]["induction"]
    probe_others = [f"{n} scores {fmt.num(d['induction'][n])}" for n in others]
    low = [n for n in others if not d["above"][n]]
    a, b, value = d["closest"]
    lines = [
        "`attnprobe probe --model smollm2-135m` finds SmolLM2's top induction heads in layers "
        f"{fmt.layers(h['layer'] for h in top[:4])} ({', '.join(h['head'] + ' ' + fmt.num(h['score']) for h in top)}; "
        "see [probe](probe.md)). On the bundled corpus, after `make demo`'s `analyze` and `classify --scheme "
        "extended`:",
        "",
        "```bash",
        f"attnprobe related --out outputs --heads {','.join(named)}",
        "```",
        "",
        "```text",
        *d["printed"],
        d["sample"],
        "```",
        "",
        "- The named heads are among each other's nearest: "
        + "; ".join(f"{n}'s five hold {fmt.listing(mutual[n]) if mutual[n] else 'none of them'}" for n in named)
        + ". These divergences, "
        f"{fmt.num(min(values), 4)}-{fmt.num(max(values), 4)} nats, are {fmt.whole(d['mean'] / max(values))} to "
        f"{fmt.whole(d['mean'] / max(min(values), 1e-12))} times below the mean over all {fmt.whole(d['pairs'])} "
        f"pairs ({fmt.num(d['mean'], 4)}).",
        f"- The other heads among their nearest are {fmt.listing(others)}. {sinks_sentence(d, others + named)} "
        "An induction head has nothing to copy in a sentence without repeated tokens, so it rests on the first "
        "token, and JS groups it with the other resting heads. The probe separates them: in the same `probe.csv`, "
        f"{fmt.listing(probe_others)} on induction (chance: {fmt.num(chance)})"
        + (f"; {fmt.listing(low)} {'is' if len(low) == 1 else 'are'} not above chance" if low else "")
        + ". JS on natural text measures what heads do on that text, not what they can do.",
        f"- The most alike pair of all is {a} and {b} ({fmt.num(value, 4)}): they put "
        f"{fmt.num(d['first_token'][a], 2)} and {fmt.num(d['first_token'][b], 2)} of their attention on the first "
        "token.",
        "",
        "![The 270 heads of SmolLM2-135M clustered by the JS divergence of their attention, bundled corpus]"
        "(../images/smollm2-135m-head_similarity.png)",
        "",
        "![SmolLM2-135M's heads placed by classical MDS of sqrt(JS), coloured by head type; the induction heads "
        f"{fmt.listing(named)} circled](../images/smollm2-135m-head_map.png)",
        "",
        fmt.source(f"{RELATED}, then `attnprobe plot --out outputs --heads {INDUCTION}`, after `make demo` and "
                   "`attnprobe classify --out outputs --scheme extended`; `attnprobe probe --model smollm2-135m`"),
    ]
    return "\n".join(lines)


def nearest_sentence(d: dict, head: str) -> str:
    (n1, v1), (n2, v2) = d["nearest"][head][:2]
    return (f"{head}'s nearest heads are {n1} ({fmt.num(v1, 4)} nats) and {n2} ({fmt.num(v2, 4)}), against a mean of "
            f"{fmt.num(d['mean'], 4)} over all pairs")


def resting(d: dict) -> str:
    """The neighbour with the lowest induction score, if it is not above chance: a sink that is no induction head."""
    low = [n for n in neighbours(d) if not d["above"][n]]
    if not low:
        return ""
    worst = min(low, key=lambda n: d["induction"][n])
    return f" ({worst} scores {fmt.num(d['induction'][worst])} on induction)"


@figure("results-related", runs=("related-smollm2", "probe-smollm2"))
def results_related(out: Outputs) -> dict:
    return related_facts(out)


@results_related.renderer
def _(d: dict) -> str:
    head = d["named"][0]
    return ("On the bundled corpus, `attnprobe related` (the Jensen-Shannon divergence of every pair of heads' "
            f"attention) puts the induction heads next to each other: {nearest_sentence(d, head)}. Their "
            f"neighbourhood also holds first-token sinks, some of them no induction heads at all{resting(d)}: on "
            "text without repeated tokens an induction head rests on the first token. See "
            "[Related heads](guides/related.md#smollm2-135m-what-sits-next-to-the-induction-heads).\n\n"
            + fmt.source(f"{RELATED} and `attnprobe probe --model smollm2-135m`"))


@figure("readme-related", runs=("related-smollm2", "probe-smollm2"))
def readme_related(out: Outputs) -> dict:
    return related_facts(out)


@readme_related.renderer
def _(d: dict) -> str:
    head = d["named"][0]
    return ("- `attnprobe related`: on natural text SmolLM2's induction heads attend alike "
            f"({nearest_sentence(d, head)}), and they share their neighbourhood with first-token sinks that are no "
            "induction heads ([related](docs/guides/related.md)).")


# ---- related's time ----------------------------------------------------------------------------------------------


@figure("bench-related", runs=("bench-related",))
def bench_related(out: Outputs) -> dict:
    return {"defaults": out.json("bench-related", "defaults.json"), "long": out.json("bench-related", "long.json"),
            **timed(out, "bench-related")}


@bench_related.renderer
def _(d: dict) -> str:
    rows = []
    for key, what in (("defaults", "the bundled corpus, defaults"),
                      ("long", "`--long`: 200 texts of 64 tokens, the defaults' largest sample")):
        r = d[key]
        rows.append([what, fmt.whole(r["sentences"]), fmt.whole(r["tokens"]), fmt.num(r["forward_seconds"], 1) + " s",
                     fmt.num(r["js_seconds"], 1) + " s", fmt.num(r["forward_seconds"] + r["js_seconds"], 1) + " s"])
    long = d["long"]
    return "\n".join([
        fmt.table(["sample", "sentences", "tokens", "forward passes", "pairwise JS", "together"], rows),
        "",
        f"The pairwise part computes, for each of the {fmt.whole(long['pairs'])} pairs and each (row, key) weight of "
        f"the sample, one sum, one logarithm and one product (about {fmt.whole(long['weights_per_head'])} weights per "
        "head for the largest sample), in blocks that stay in each thread's cache.",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_related.py --threads {d['defaults']['threads']}` and the same "
                   f"with `--long`, model loading not counted ({measured_on(d)})"),
    ])


# ---- what heads attend to by token ------------------------------------------------------------------------------


def token_leaders(heads, column: str, n: int = 3) -> list[dict]:
    best = heads.sort_values([column, "layer", "head"], ascending=[False, True, True]).head(n)
    return [{"head": fmt.head(r["layer"], r["head"]), "value": float(r[column]), "low": float(r[f"{column}_ci_low"]),
             "high": float(r[f"{column}_ci_high"])} for _, r in best.iterrows()]


def top_tokens_of(frame, head: str, n: int = 5) -> list[list]:
    rows = frame[[fmt.head(r.layer, r.head) == head for r in frame.itertuples()]].sort_values("rank").head(n)
    return [[str(r.token), float(r.lift), int(r.occurrences)] for r in rows.itertuples()]


@figure("tokens-smollm2", runs=("demo", "probe-smollm2"))
def tokens_smollm2(out: Outputs) -> dict:
    heads = out.csv("demo", "heads.csv")
    tokens = out.csv("demo", "top_tokens.csv")
    leaders = {c: token_leaders(heads, c) for c in ("punctuation", "duplicate_token")}
    probe = probe_facts(out, "probe-smollm2")["top"]["duplicate"][0]["head"]
    heads["name"] = [fmt.head(r.layer, r.head) for r in heads.itertuples()]
    by_name = heads.set_index("name")
    return {"leaders": leaders, "median": {c: float(heads[c].median()) for c in leaders},
            "tokens": {c: top_tokens_of(tokens, rows[0]["head"]) for c, rows in leaders.items()},
            "probe_duplicate": probe, "probe_duplicate_natural": float(by_name.loc[probe, "duplicate_token"]),
            "probe_duplicate_rank": int((heads["duplicate_token"] > by_name.loc[probe, "duplicate_token"]).sum()) + 1,
            "heads": int(len(heads))}


def token_list(rows: list[list]) -> str:
    return ", ".join(f"`{token}` ({fmt.num(lift, 1)}x, {fmt.whole(count)} times)" for token, lift, count in rows)


@tokens_smollm2.renderer
def _(d: dict) -> str:
    p, u = d["leaders"]["punctuation"], d["leaders"]["duplicate_token"]

    def leaders(rows: list[dict]) -> str:
        return "; ".join(f"{r['head']}: {fmt.vci(r['value'], r['low'], r['high'])}" for r in rows)

    return "\n".join([
        f"- `punctuation`: the heads that put the most mass on punctuation keys are {leaders(p)} (the median head: "
        f"{fmt.num(d['median']['punctuation'])}). In `top_tokens.csv`, {p[0]['head']}'s top tokens by lift are "
        f"{token_list(d['tokens']['punctuation'])}.",
        f"- `duplicate_token`: on rows whose token occurred before, the heads that attend most to the earlier "
        f"copies are {leaders(u)} (the median head: {fmt.num(d['median']['duplicate_token'])}); "
        f"{u[0]['head']}'s top tokens by lift are {token_list(d['tokens']['duplicate_token'])}. The probe's best "
        f"duplicate-token head on planted repeats, {d['probe_duplicate']}, scores "
        f"{fmt.num(d['probe_duplicate_natural'])} here, rank {d['probe_duplicate_rank']} of {d['heads']}.",
        "",
        fmt.source("`make demo` (`heads.csv` and `top_tokens.csv`) and `attnprobe probe --model smollm2-135m`"),
    ])


@figure("readme-tokens", runs=("demo", "probe-smollm2"))
def readme_tokens(out: Outputs) -> dict:
    return tokens_smollm2.collect(out)


@readme_tokens.renderer
def _(d: dict) -> str:
    p, u = d["leaders"]["punctuation"][0], d["leaders"]["duplicate_token"][0]
    return (f"- Token scores of `attnprobe analyze`: SmolLM2's {p['head']} puts {fmt.num(p['value'])} of its attention "
            f"on punctuation (the median head {fmt.num(d['median']['punctuation'])}), and {u['head']} "
            f"{fmt.num(u['value'])} on earlier copies of the query's token (median "
            f"{fmt.num(d['median']['duplicate_token'])}); `top_tokens.csv` lists each head's favourite key tokens "
            "([results](docs/results.md)).")
