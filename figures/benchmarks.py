"""Figures of long documents, benchmarks and timings: docs/long-documents.md, docs/performance.md,
docs/large-corpora.md, docs/distributed.md, docs/development.md and the README's memory sentence.

Timings depend on the machine and its load: every block says which machine, load and date it was measured on.
"""

from __future__ import annotations

import math

import numpy as np

from figures import fmt
from figures.registry import Outputs, figure

GPL3 = ("`attnprobe analyze --model smollm2-135m --corpus /usr/share/common-licenses/GPL-3 --split file --out "
        "outputs/gpl3`")


def timed(out: Outputs, run: str) -> dict:
    w = out.when(run)
    return {"machine": w["machine"], "load": w["load"], "date": w["date"]}


def measured_on(t: dict) -> str:
    return f"{fmt.machine(t['machine'], t['load'])}; {t['date']}"


def is_busy(t: dict) -> bool:
    """Other jobs kept the cores busy: wall times are inflated, CPU times (one thread) are the ones to compare."""
    return t["load"] is not None and t["load"] >= t["machine"]["cores"]


def seconds_of(r: dict, busy: bool) -> float:
    """The time a ratio is judged on: CPU seconds when the machine was busy and the benchmark measured them."""
    return r["cpu_seconds"] if busy and "cpu_seconds" in r else r["seconds"]


def threads_flag(d: dict) -> str:
    return f" --threads {d['threads']}" if d.get("threads") else ""


# ---- SmolLM2 on the GPL-3 licence -------------------------------------------------------------------------------


@figure("gpl3", runs=("gpl3",), images={"gpl3/position_profile.png": "smollm2-135m-position_profile-gpl3.png"})
def gpl3(out: Outputs) -> dict:
    info = out.json("gpl3", "run.json")
    step = out.step("gpl3", "analyze")
    positions = out.csv("gpl3", "positions.csv")
    layers = out.csv("gpl3", "layers.csv")
    types = out.csv("gpl3", "head_types.csv")
    kv = out.json("gpl3", "kv_cache.json")
    by_layer = positions.groupby(["layer", "bin"])[["entropy", "first_token", "position_min", "position_max"]].mean()
    last = int(positions["bin"].max())
    last_bin = by_layer.xs(last, level="bin")
    by_bin = positions.groupby(["layer", "bin"])[["first_token", "position_min"]].mean().reset_index()
    late = by_bin[by_bin["position_min"] >= 1024].groupby("layer")["first_token"].max()  # per layer, past 1,024
    streaming = types[types["head_type"] == "streaming"]
    kv_streaming = types[types["kv_head_streaming"]].drop_duplicates(["layer", "kv_head"])
    ranked = types.sort_values(["sink_window", "layer", "head"], ascending=[False, True, True])
    return {
        "tokens": info["tokens"], "seconds": step["seconds"], "peak_rss_mib": step["peak_rss_mib"],
        "load": step["load_average"], "date": out.when("gpl3")["date"], "path": info["attention"]["path"],
        "last_bin": [int(last_bin["position_min"].iloc[0]), int(last_bin["position_max"].iloc[0])],
        "last_entropy": [float(x) for x in last_bin["entropy"]],
        "last_first_token": [float(x) for x in last_bin["first_token"]],
        "first_token_past_1024": [float(x) for x in late],
        "streaming": int(len(streaming)), "heads": int(len(types)),
        "streaming_layers": [int(streaming["layer"].min()), int(streaming["layer"].max())] if len(streaming) else None,
        "sink_window_layers": [float(x) for x in layers["sink_window"]],
        "sharpest": [[fmt.head(r.layer, r.head), float(r.sink_window)] for r in ranked.head(3).itertuples()],
        "retrieval": [[fmt.head(r.layer, r.head), float(r.sink_window)]  # the lowest: the clearest full-cache heads
                      for r in ranked.tail(2).iloc[::-1].itertuples()],
        "kv": kv, "kv_streaming_layers": sorted({int(x) for x in kv_streaming["layer"]}),
    }


def first_token_split(d: dict, level: float = 0.1) -> int:
    """The first layer from which every layer keeps more than `level` on the first token in the last bin."""
    values = d["last_first_token"]
    return next(k for k in range(len(values)) if all(v > level for v in values[k:]))


@gpl3.renderer
def _(d: dict) -> str:
    e = d["last_entropy"]
    lo, hi = d["last_bin"]
    split = first_token_split(d)
    kv = d["kv"]
    counts = kv["counts"]
    a = kv["assumptions"]
    k32, k128 = kv["lengths"]["32k"], kv["lengths"]["128k"]
    sink_window = d["sink_window_layers"]
    lowest = int(np.nanargmin(sink_window))
    highest = int(np.nanargmax(sink_window))
    share_query = counts["query_heads_streaming"] / counts["kv_heads_total"] / (d["heads"] / counts["kv_heads_total"])
    kept = a["sink"] + a["window"]
    uniform = [math.log(lo + 1), math.log(hi + 1)]
    return "\n".join([
        f"{GPL3} reads the GPL-3 licence as one {fmt.whole(d['tokens'])}-token sequence: "
        f"{fmt.seconds(d['seconds'])} and {d['peak_rss_mib'] / 1024:.2f} GiB peak RSS here (the `{d['path']}` path; "
        f"load average {d['load']:.1f}, {d['date']}).",
        "",
        "![Entropy and first-token mass by query position, SmolLM2-135M on the GPL-3 text]"
        "(images/smollm2-135m-position_profile-gpl3.png)",
        "",
        "- Entropy grows with position in every layer, as it must (a causal row i has at most ln(i+1) nats), but at "
        f"very different rates. In the last bin (positions {fmt.whole(lo)}-{fmt.whole(hi)}), layer 0 is at "
        f"{fmt.num(e[0], 1)} nats, against a uniform head's ln(i+1) of {fmt.span(uniform, 1)}; layers 1-9 at "
        f"{fmt.span(e[1:10], 1)}; layers 10-{len(e) - 1} at {fmt.span(e[10:], 1)}.",
        f"- The first-token mass separates two groups. In layers 0-{split - 1} it falls to nearly 0: under "
        f"{fmt.sig(max(d['first_token_past_1024'][:split]), 1)} past position 1,024 and under "
        f"{fmt.sig(max(d['last_first_token'][:split]), 1)} in the last bin; from layer {split} on, the first token "
        f"keeps {round(100 * min(d['last_first_token'][split:]))}-{fmt.percent(max(d['last_first_token'][split:]), 1)}"
        f" of the attention even {fmt.whole(lo)}-{fmt.whole(hi)} tokens in: the attention sink of StreamingLLM, "
        "measured per layer.",
        f"- `attnprobe classify --scheme kv` (S = {a['sink']}, W = {a['window']}) finds "
        f"{counts['query_heads_streaming']} of the {d['heads']} query heads `streaming` (sink_window >= 0.95)"
        + (f", all in layers {d['streaming_layers'][0]}-{d['streaming_layers'][1]}" if d["streaming_layers"] else "")
        + f"; the layer means of `sink_window` run from {fmt.num(sink_window[lowest], 2)} (layer {lowest}) to "
        f"{fmt.num(sink_window[highest], 2)} (layer {highest}). The sharpest streaming heads are "
        f"{fmt.listing([h for h, _ in d['sharpest']])} ({fmt.span([v for _, v in d['sharpest']], 3)}); the "
        f"clearest `full-cache` heads are {d['retrieval'][0][0]} ({fmt.num(d['retrieval'][0][1], 2)}) and "
        f"{d['retrieval'][1][0]} ({fmt.num(d['retrieval'][1][1], 2)}).",
        "- Grouped-query attention takes most of that away: "
        f"{d['heads'] // counts['kv_heads_total']} query heads share each KV head, and only "
        f"{counts['kv_heads_streaming']} of the {counts['kv_heads_total']} KV heads"
        + (f" (layers {', '.join(str(x) for x in d['kv_streaming_layers'])})" if d["kv_streaming_layers"] else "")
        + f" have all of theirs streaming. The KV-cache estimate (float32, {a['layers']} layers x {a['kv_heads']} KV "
        f"heads x {a['head_dim']} dims x K and V = {fmt.whole(kv['bytes_per_token_full'])} bytes per token) is "
        f"{fmt.whole(k32['full_bytes'] / 2**20)} MiB for the full cache at 32k tokens and "
        f"{fmt.whole(k32['streaming_bytes'] / 2**20)} MiB if those {counts['kv_heads_streaming']} KV heads keep only "
        f"{kept} tokens: a ratio of {fmt.num(k32['ratio'])} ({fmt.num(k128['ratio'])} at 128k). By attention mass, a "
        f"per-KV-head streaming cache would save about {fmt.percent(1 - k32['ratio'], 1)} on this model, not the "
        f"{fmt.percent(share_query, 1)} that counting query heads suggests. This measures where the attention goes "
        "on one document, not what accuracy the model would lose.",
        "",
        fmt.source(f"{GPL3} and `attnprobe classify --out outputs/gpl3 --scheme kv`"),
    ])


@figure("readme-long", runs=("gpl3",))
def readme_long(out: Outputs) -> dict:
    return gpl3.collect(out)


@readme_long.renderer
def _(d: dict) -> str:
    c = d["kv"]["counts"]
    return (f"- Long documents: `attnprobe analyze --split file` on the GPL-3 licence, one "
            f"{fmt.whole(d['tokens'])}-token sequence, took {fmt.seconds(d['seconds'])} and "
            f"{d['peak_rss_mib'] / 1024:.2f} GiB peak RSS here; `attnprobe classify --scheme kv` finds "
            f"{c['query_heads_streaming']} of the {d['heads']} query heads `streaming`, "
            f"but only {c['kv_heads_streaming']} of the {c['kv_heads_total']} KV heads have all their query heads "
            "streaming ([Long documents](docs/long-documents.md)).")


KV_START_COMMANDS = (  # docs/kv-cache.md's first block; the run `gpl3` runs the first two as written
    "attnprobe analyze --model smollm2-135m --corpus /usr/share/common-licenses/GPL-3 --split file --out outputs/gpl3",
    "attnprobe classify --out outputs/gpl3 --scheme kv",
    "attnprobe export --out outputs/gpl3 --format duo-attention --scores kv --to outputs/gpl3-duo",
    "head -c 9000 /usr/share/common-licenses/GPL-3 > gpl3-start.txt",
    "attnprobe ablate --model smollm2-135m --corpus gpl3-start.txt --split file --method streaming \\\n"
    "    --pattern outputs/gpl3-duo --shares 0.5 --random-orders 1 --out outputs/gpl3-check",
)


@figure("kv-start", runs=("gpl3",))
def kv_start(out: Outputs) -> dict:
    return gpl3.collect(out)


@kv_start.renderer
def _(d: dict) -> str:
    counts = d["kv"]["counts"]
    return "\n".join([
        "```bash",
        *KV_START_COMMANDS,
        "```",
        "",
        f"The licence is one {fmt.whole(d['tokens'])}-token sequence; `analyze` took {fmt.seconds(d['seconds'])} "
        f"here (load average {d['load']:.1f}, {d['date']}), `classify` and `export` a moment. `classify` "
        f"finds {counts['kv_heads_streaming']} of the {counts['kv_heads_total']} KV heads streaming by attention "
        "mass ([Long documents](long-documents.md) reads the run); `export` writes DuoAttention's folder from the far "
        "share (`--scores kv` takes analyze's score even where `retrieval` ran into the same folder, which `auto` "
        "would prefer); the last command is the quick check of [Check an export before "
        "compressing](#check-an-export-before-compressing): half of the KV heads streaming, in the export's order "
        "and in one random order, against the full cache, in about a fifth of the passes of `ablate`'s default "
        "curve. [On SmolLM2-135M](#on-smollm2-135m) shows the full curve of this export.",
        "",
        fmt.source("`attnprobe analyze --model smollm2-135m --corpus /usr/share/common-licenses/GPL-3 --split file "
                   "--out outputs/gpl3` and `attnprobe classify --out outputs/gpl3 --scheme kv`"),
    ])


# ---- the architecture table -------------------------------------------------------------------------------------


@figure("architectures", runs=("zoo",))
def architectures(out: Outputs) -> dict:
    return out.json("zoo", "zoo.json")


@architectures.renderer
def _(d: dict) -> str:
    rows = [[f"`{name}`", r["path"], r["features"]] for name, r in d["architectures"].items()]
    own = sum(r["path"] != "eager (hooks)" for r in d["architectures"].values())
    worst = max(v for r in d["architectures"].values() for v in r["max_diff"].values() if v is not None)
    return (fmt.table(["architecture", "path", "features"], rows) + "\n\n"
            f"{own} of these {len(rows)} architectures run on attnprobe's own attention (blocked or fused), the other "
            f"{len(rows) - own} on the eager hooks. The largest difference from the eager maps' statistics that "
            f"`attnprobe verify` finds on them here, blocked or fused, is {fmt.sci(worst)}.\n\n"
            + fmt.source("`tests/zoo.py`'s models: `kernel.discover` and `attnprobe verify`'s checks on each "
                         "(`python -m figures.steps zoo`)"))


# ---- the Triton kernels' machine code ------------------------------------------------------------------------


@figure("triton-compile", runs=("triton-compile",))
def triton_compile(out: Outputs) -> dict:
    return out.json("triton-compile", "compile.json")


@triton_compile.renderer
def _(d: dict) -> str:
    rows = [[name, str(v["registers"]), f"{v['spills']:,}", f"{v['loop']:,}", f"{v['path']:,}"]
            for name, v in d["variants"].items() if "registers" in v]
    target = d["targets"]
    return (fmt.table(["variant", "registers", "spill bytes", "main loop, instructions per tile", "shortest path"],
                      rows) + "\n\n"
            f"The goal for analyze's default features (the first row): at most {target['registers']} registers, "
            f"{target['spills']} spill bytes and {target['loop']} instructions per tile in the main loop.\n\n"
            + fmt.source(f"`python tests/triton_compile.py --all` with triton {d['triton']} for sm_{d['arch']} "
                         "(the ptxas and nvdisasm in Triton's wheel; no GPU needed)"))


# ---- bench_long -------------------------------------------------------------------------------------------------


@figure("long-memory", runs=("bench-long",))
def long_memory(out: Outputs) -> dict:
    tiny = out.json("bench-long", "tiny.json")["tiny"]
    n = max(int(k) for k in tiny["runs"])
    return {"tokens": n, "peak_mib": tiny["runs"][str(n)]["peak_mib"], "heads": 4, **timed(out, "bench-long")}


@long_memory.renderer
def _(d: dict) -> str:
    gib = d["heads"] * d["tokens"] ** 2 * 4 / 2**30
    return (f"A {fmt.whole(d['tokens'])}-token sequence through a small Llama runs in {fmt.whole(d['peak_mib'])} MiB "
            f"here, where one layer's map alone ({d['heads']} heads, float32) would take {fmt.whole(gib)} GiB "
            "(`benchmarks/bench_long.py --part tiny`).")


@figure("bench-long-smollm2", runs=("bench-long",))
def bench_long_smollm2(out: Outputs) -> dict:
    found = out.json("bench-long", "smollm2.json")
    return {**found["smollm2"], "threads": found.get("threads"), **timed(out, "bench-long")}


@bench_long_smollm2.renderer
def _(d: dict) -> str:
    r, t = d["runs"], d["targets"]
    busy = is_busy(d)
    cpu = all("cpu_seconds" in v for v in r.values())
    names = {"sdpa": "SDPA, no statistics (the floor)", "blocked": "attnprobe, blocked statistics",
             "fused": "attnprobe, fused statistics (`--attention fused`)",
             "eager": "attnprobe's eager hooks (`--attention eager`)"}
    rows = [[names[way], fmt.num(v["seconds"], 1), *([fmt.num(v["cpu_seconds"], 1)] if cpu else []),
             fmt.whole(v["peak_mib"])] for way, v in r.items()]

    def verdict(x: float, target: float) -> str:
        return f"target <= {target}{': missed' if x > target else ''}"

    for way, time_target, memory_target in (("blocked", t["blocked_time"], t["blocked_memory"]),
                                            ("fused", t["fused_time"], t["fused_memory"])):
        time_ratio = seconds_of(r[way], busy) / seconds_of(r["sdpa"], busy)
        memory_ratio = r[way]["peak_mib"] / r["sdpa"]["peak_mib"]
        judged = f"**{fmt.ratio(time_ratio)}** ({verdict(time_ratio, time_target)})"
        rows.append([f"{way} / SDPA", *(["", judged] if cpu and busy else [judged, ""] if cpu else [judged]),
                     f"**{fmt.ratio(memory_ratio)}** ({verdict(memory_ratio, memory_target)})"])
    key = "flash_cpu_seconds_by_head_size" if busy and "flash_cpu_seconds_by_head_size" in d else \
        "flash_seconds_by_head_size"
    flash = {int(k): v for k, v in d[key].items()}
    faster = 1 - seconds_of(r["fused"], busy) / seconds_of(r["blocked"], busy)
    return "\n".join([
        f"SmolLM2-135M on one {fmt.whole(d['tokens'])}-token document (the GPL-3 licence text), forward pass only, "
        f"each way in its own process{' with ' + str(d['threads']) + ' torch thread' if d.get('threads') else ''}"
        + (" (the machine was busy: the ratios are of CPU time)" if busy and cpu else "") + ":",
        "",
        fmt.table(["way", "seconds", *(["CPU seconds"] if cpu else []), "peak RSS MiB"], rows),
        "",
        f"The fused path is {fmt.percent(abs(faster), 1)} {'faster' if faster > 0 else 'slower'} than blocked here. "
        + head_size_sentence(flash, key, d.get("flash_tokens", 4096)),
        *fused_bound(d, flash, busy),
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_long.py --part smollm2 --tokens {d['tokens']}"
                   f"{' --eager' if 'eager' in r else ''}{threads_flag(d)}` ({measured_on(d)})"),
    ])


def fused_bound(d: dict, flash: dict[int, float], busy: bool) -> list[str]:
    """Why the fused target is out of reach with the CPU kernel: what the wider call alone adds to the SDPA forward."""
    sdpa = d["runs"]["sdpa"]
    if d.get("flash_tokens") != d["tokens"] or "layers" not in sdpa or 136 not in flash:
        return []  # measured before bench_long.py timed the calls at the document's length: rerun bench-long
    extra = sdpa["layers"] * (flash[136] - flash[64])
    floor = 1 + extra / seconds_of(sdpa, busy)
    target = d["targets"]["fused_time"]
    return ["", f"That wider call alone adds {sdpa['layers']} layers x ({fmt.num(flash[136], 2)} - "
            f"{fmt.num(flash[64], 2)}) = {fmt.num(extra, 1)} s to the SDPA forward's "
            f"{fmt.num(seconds_of(sdpa, busy), 1)} s: with this kernel the fused path cannot go below "
            f"{fmt.ratio(floor)} x SDPA before any other statistic"
            + (f" (target {target}). aten's CPU flash kernel takes queries, keys and values of one head size only "
               "(\"Q/K/V should have the same head size\"), so the 64-wide queries and keys are padded to the values' "
               "width. CUDA's efficient-attention kernel accepts values wider than the queries and keys (one call with "
               "queries and keys of 64 and values of 136), but no GPU was lent to test it." if floor > target else ".")]


def head_size_sentence(flash: dict[int, float], key: str, tokens: int = 4096) -> str:
    """What the fused path's one statistics call costs against the model's own flash call."""
    if 136 not in flash:  # measured before the values rode in the statistics call: rerun bench-long
        return "The statistics need a second pass over every score."
    return ("The statistics need a second pass over every score: for a float32 model one flash call whose head size "
            f"is 64 (the key) + 64 (the values) + 3 channels, rounded up to 136. On [1, 9, {tokens}, d] here one call "
            f"of head size 136 took {fmt.num(flash[136], 2)} s{' of CPU' if 'cpu' in key else ''}, a call of 64 (the "
            f"model's own) {fmt.num(flash[64], 2)} s and one of 72 {fmt.num(flash[72], 2)} s: one wide call costs "
            f"{fmt.ratio(flash[136] / flash[64])} calls of 64"
            f"{', less than two' if flash[136] < 2 * flash[64] else ''}.")


@figure("bench-long-tiny", runs=("bench-long",))
def bench_long_tiny(out: Outputs) -> dict:
    found = out.json("bench-long", "tiny.json")
    return {**found["tiny"], "threads": found.get("threads"), **timed(out, "bench-long")}


@bench_long_tiny.renderer
def _(d: dict) -> str:
    cpu = all("cpu_seconds" in r for r in d["runs"].values())
    rows = [[fmt.whole(int(n)), fmt.num(r["seconds"], 1), *([fmt.num(r["cpu_seconds"], 1)] if cpu else []),
             fmt.whole(r["peak_mib"]), f"{4 * int(n) ** 2 * 4 / 2**30:.2f}"]
            for n, r in sorted(d["runs"].items(), key=lambda x: int(x[0]))]
    p, c = d["process"], d["prefix_check"]
    return "\n".join([
        fmt.table(["tokens", "seconds", *(["CPU seconds"] if cpu else []), "peak RSS MiB",
                   "one eager map of one layer, GiB"], rows),
        "",
        f"The whole `attnprobe analyze --split file` process on that {fmt.whole(p['tokens'])}-token sequence took "
        f"{fmt.seconds(p['seconds'])} with a peak RSS of {fmt.whole(p['peak_mib'])} MiB (target: under 3 GiB). As an "
        f"independent check, the benchmark compares the `positions.csv` bins that lie inside the first "
        f"{fmt.whole(c['prefix'])} tokens with an eager computation on that prefix alone (a causal row sees only the "
        f"keys before it): they agree to {fmt.sci(c['max_diff'])}.",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_long.py --part tiny{threads_flag(d)}` ({measured_on(d)})"),
    ])


@figure("bench-long-zoo", runs=("bench-long",))
def bench_long_zoo(out: Outputs) -> dict:
    found = out.json("bench-long", "zoo.json")
    return {**found["zoo"], "threads": found.get("threads"), **timed(out, "bench-long")}


def flat_text(ratio_: float) -> str:
    return "stays flat" if ratio_ < 1.2 else "grows far less than qwen2's"


@bench_long_zoo.renderer
def _(d: dict) -> str:
    window = d["window"]
    busy = is_busy(d) and all("cpu_seconds" in r for runs in d["scaling"].values() for r in runs.values())
    unit = "CPU seconds" if busy else "seconds"
    lengths = sorted({int(n) for runs in d["scaling"].values() for n in runs})
    rows, growth, per_token = [], {}, {}
    labels = {"qwen2": "qwen2", "mistral (sliding window)": f"mistral (window {fmt.whole(window)})",
              "gemma2": f"gemma2 (window {fmt.whole(window)} on alternate layers, soft-cap)"}
    for name, runs in d["scaling"].items():
        runs = {int(n): r for n, r in runs.items()}
        label = labels.get(name, name)
        growth[name] = runs[lengths[-1]]["peak_mib"] / runs[lengths[0]]["peak_mib"]
        rows.append([f"{label}, {unit}", *[fmt.num(seconds_of(runs[n], busy), 1) for n in lengths], ""])
        rows.append([f"{label.split(' (')[0]}, peak MiB", *[fmt.whole(runs[n]["peak_mib"]) for n in lengths],
                     f"**{fmt.ratio(growth[name])}**"])
        past = [n for n in lengths if n >= 2 * window]
        per_token[name] = [1e6 * seconds_of(runs[n], busy) / n for n in past]
    met = [n for n, g in growth.items() if g <= 1.25]
    missed = [n for n, g in growth.items() if g > 1.25]
    windowed = "mistral (sliding window)"
    past = [n for n in lengths if n >= 2 * window]
    sixteen = d["16k"]
    peaks = [r["peak_mib"] for r in sixteen.values()]
    return "\n".join([
        fmt.table(["model", *[fmt.whole(n) for n in lengths[:-1]], f"{fmt.whole(lengths[-1])} tokens",
                   f"peak {lengths[-1] // 1024}k / {lengths[0] // 1024}k"], rows),
        "",
        f"- Peak memory grows by {round(100 * (min(growth.values()) - 1))}-"
        f"{fmt.percent(max(growth.values()) - 1, 1)} from {lengths[0] // 1024}k to {lengths[-1] // 1024}k tokens "
        "(target: at most 25%): "
        + (f"met for {fmt.listing(met)}" if met else "met for none")
        + (f", missed for {fmt.listing(missed)}" if missed else "")
        + ". The blocks are sized from a fixed budget, so the growth is what grows with n outside them (the model's "
        "own activations are O(n)).",
        f"- Past its window, the windowed model's time per token "
        f"{flat_text(per_token[windowed][-1] / per_token[windowed][0])}: "
        f"{', '.join(fmt.whole(x) for x in per_token[windowed])} us{' of CPU' if busy else ''} per token at "
        f"{fmt.listing([f'{n // 1024}k' for n in past])} tokens ({past[-1] // 1024}k / {past[0] // 1024}k: "
        f"{fmt.ratio(per_token[windowed][-1] / per_token[windowed][0])}, qwen2's "
        f"{fmt.ratio(per_token['qwen2'][-1] / per_token['qwen2'][0])}).",
        f"- One 16,384-token sequence through tiny {fmt.listing(list(sixteen))} peaks at "
        f"{fmt.listing([fmt.whole(p) for p in peaks])} MiB (target: under 1.5 GiB).",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_long.py --part zoo{threads_flag(d)}`, blocked statistics "
                   f"attention ({measured_on(d)})"),
    ])


# ---- bench_analyze ----------------------------------------------------------------------------------------------


@figure("bench-analyze-speed", runs=("bench-analyze",))
def bench_analyze_speed(out: Outputs) -> dict:
    return {**out.json("bench-analyze", "speed.json"), **timed(out, "bench-analyze")}


@bench_analyze_speed.renderer
def _(d: dict) -> str:
    s = d["speed"]
    med, runs, targets = s["medians"], s["runs"], s["targets"]
    label = {"lean": "attnprobe `--no-value-weighted --no-top-tokens`",
             "floor-default": "floor, torch's default threads",
             "defaults": "attnprobe, every default (`--threads auto`)"}
    rows = [[label.get(way, way), fmt.num(m["seconds"], 2), fmt.num(m["cpu"], 2),
             fmt.whole(d["tokens"] / m["seconds"]), fmt.whole(m["peak_mib"]),
             ", ".join(fmt.num(r["seconds"], 1) for r in runs[way])]
            for way, m in med.items()]
    over_floor = {way: [med[way][k] / med["floor"][k] for k in ("seconds", "cpu")]
                  for way in ("attnprobe", "lean") if way in med}
    naive_over = [med["naive"][k] / med["attnprobe"][k] for k in ("seconds", "cpu")]
    busy = is_busy(d)
    judged = 1 if busy else 0  # the ratio the target is judged on: CPU time when the machine was busy

    def cells(pair: list[float]) -> list[str]:
        return [f"**{fmt.ratio(x)}**" if k == judged else fmt.ratio(x) for k, x in enumerate(pair)]

    ratios = [*([f"{label.get(way, way)} / floor", *cells(pair),
                 f"<= {targets['floor']}: {'met' if pair[judged] <= targets['floor'] else 'missed'}"]
                for way, pair in over_floor.items()),
              ["naive / attnprobe", *cells(naive_over),
               f">= {targets['naive']}: {'met' if naive_over[judged] >= targets['naive'] else 'missed'}"]]
    if "defaults" in med:  # as a user runs them: every default against the floor at torch's default threads
        as_user = [med["defaults"][k] / med["floor-default"][k] for k in ("seconds", "cpu")]
        ratios.append([f"{label['defaults']} / {label['floor-default']}", *cells(as_user),
                       f"<= {targets['floor']}: {'met' if as_user[judged] <= targets['floor'] else 'missed'}"])
    return "\n".join([
        *([f"The machine was busy during this run (load average up to {d['load']:.1f} on {d['machine']['cores']} "
           "cores): wall times are inflated and vary from run to run, so the targets are judged on CPU time (in "
           "bold).", ""] if busy else []),
        fmt.table(["way", "wall s (median)", "CPU s (median)", "tokens/s", "peak RSS MiB",
                   f"wall s of the {d['repeat']} runs"], rows),
        "",
        fmt.table(["ratio", "wall", "CPU", "target"], ratios),
        "",
        *([f"The first four ways run with {d['threads']} torch thread(s) each; the last two as a user runs them: "
           "torch's own thread count for the floor, and `attnprobe analyze` with no `--threads`, where `auto` "
           f"chose {', '.join(str(r['threads']) for r in runs['defaults'])} thread(s) in its runs.", ""]
          if "defaults" in med else []),
        fmt.source(f"`.venv/bin/python benchmarks/bench_analyze.py --no-memory --repeat {d['repeat']} --threads "
                   f"{d['threads_option']}` ({d['sentences']} sentences, {fmt.whole(d['tokens'])} tokens; "
                   f"{measured_on(d)})"),
    ])


@figure("bench-analyze-memory", runs=("bench-analyze",))
def bench_analyze_memory(out: Outputs) -> dict:
    return {**out.json("bench-analyze", "memory.json"), **timed(out, "bench-analyze")}


@bench_analyze_memory.renderer
def _(d: dict) -> str:
    rows = [[n, *[fmt.whole(r[k]) for k in ("sdpa", "attnprobe", "hooks", "all-maps")]]
            for n, r in sorted(d["memory"].items(), key=lambda x: int(x[0]))]
    return (fmt.table(["tokens", "SDPA, no maps", "attnprobe (blocked)", "eager hooks", "holding all 12 layers' maps"],
                      rows) + "\n\n"
            + fmt.source(f"`.venv/bin/python benchmarks/bench_analyze.py --memory-only` ({measured_on(d)})"))


@figure("new-scores-cost", runs=("bench-analyze",))
def new_scores_cost(out: Outputs) -> dict:
    found = out.json("bench-analyze", "speed.json")
    return {"new_scores": found.get("new_scores"), "repeat": found["repeat"],
            "threads_option": found["threads_option"], **timed(out, "bench-analyze")}


@new_scores_cost.renderer
def _(d: dict) -> str:
    n = d["new_scores"]
    if n is None:  # measured before bench_analyze.py timed the new scores: rerun bench-analyze
        return "Not measured yet: `python -m figures --only bench-analyze` measures it."
    off, on = n["medians"]["False"], n["medians"]["True"]
    busy = is_busy(d)
    judged = "cpu" if busy else "seconds"
    rows = [[flags, fmt.num(m["seconds"], 2), fmt.num(m["cpu"], 2), fmt.num(m["analysis"], 2)]
            for flags, m in (("`--no-value-weighted --no-top-tokens`", off), ("with them (the default)", on))]
    ratios = {k: on[k] / off[k] for k in ("seconds", "cpu", "analysis")}
    rows.append(["**with / without**", *[f"**{fmt.ratio(ratios[k])}**" if k == judged else fmt.ratio(ratios[k])
                                         for k in ("seconds", "cpu", "analysis")]])
    met = ratios[judged] <= n["target"]
    return "\n".join([
        fmt.table(["run", "wall s", "CPU s", "analysis s (run.json `wall_seconds`)"], rows),
        "",
        f"The process, as a user runs it, is {fmt.percent(abs(ratios[judged] - 1), 1)} "
        f"{'slower' if ratios[judged] > 1 else 'faster'} by {'CPU' if busy else 'wall'} time with the new scores "
        f"(target: at most {fmt.percent(n['target'] - 1, 1)} slower, {'met' if met else 'missed'}); the analysis "
        f"alone, after the model is loaded, {fmt.percent(abs(ratios['analysis'] - 1), 1)} "
        f"{'slower' if ratios['analysis'] > 1 else 'faster'}.",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_analyze.py --no-memory --repeat {d['repeat']} --threads "
                   f"{d['threads_option']}`, medians of {d['repeat']} interleaved runs of `attnprobe analyze --model "
                   f"{n['model']} --corpus corpora/{n['corpus']}` each way ({measured_on(d)})"),
    ])


@figure("performance-choices", runs=("batch-sizes", "startup"))
def performance_choices(out: Outputs) -> dict:
    return {"batch_sizes": out.json("batch-sizes", "batch-sizes.json"),
            "startup": out.json("startup", "startup.json")["median_seconds"], **timed(out, "batch-sizes")}


@performance_choices.renderer
def _(d: dict) -> str:
    b = d["batch_sizes"]
    sizes = sorted(b["seconds"], key=int)
    return (f"`attnprobe analyze` on `bench_analyze.py`'s model and corpus ({b['threads']} thread) took "
            f"{fmt.listing([fmt.num(b['seconds'][k], 1) for k in sizes])} s with batches of "
            f"{fmt.listing(sizes)}: larger batches gain little on a CPU, and 8 keeps padding and memory low. "
            f"`attnprobe --help` takes {fmt.num(d['startup'], 2)} s.\n\n"
            + fmt.source(f"`python -m figures.steps batch-sizes` and `python -m figures.steps startup` "
                         f"({measured_on(d)})"))


@figure("threads", runs=("threads",))
def threads(out: Outputs) -> dict:
    return {**out.json("threads", "threads.json"), **timed(out, "threads")}


@threads.renderer
def _(d: dict) -> str:
    by = {1: [], 2: []}
    loads = [r["load_average"] for r in d["runs"]] + [r["load_average_after"] for r in d["runs"]]
    for r in d["runs"]:
        by[r["threads"]].append(r["seconds"])
    speedup = np.median(by[1]) / np.median(by[2])
    row = [f"`ablate` SmolLM2-135M, all 270 heads, {d['sentences']} sentences, load average "
           f"{fmt.span(loads, 1)}", ", ".join(fmt.num(x, 1) + " s" for x in by[1]),
           ", ".join(fmt.num(x, 1) + " s" for x in by[2]),
           f"`attnprobe ablate --model smollm2-135m --corpus corpora/sentences.txt --limit {d['sentences']} "
           "--no-pruning --resamples 200 --threads N`, interleaved"]
    return (fmt.table(["work", "1 thread", "2 threads", "command"], [row]) + "\n\n"
            + (f"Here 2 threads were {fmt.ratio(speedup, 1)} times as fast as 1.\n\n" if speedup > 1 else
               f"Here 2 threads took {fmt.ratio(1 / speedup, 1)} times as long as 1.\n\n")
            + fmt.source(f"`python -m figures.steps threads` ({measured_on(d)})"))


# ---- bench_corpus and torchrun ----------------------------------------------------------------------------------


@figure("bench-corpus", runs=("bench-corpus",))
def bench_corpus(out: Outputs) -> dict:
    return {**out.json("bench-corpus", "corpus.json"), **timed(out, "bench-corpus")}


@bench_corpus.renderer
def _(d: dict) -> str:
    rows = [[fmt.whole(int(n)), fmt.num(r["seconds"], 1), fmt.whole(int(n) / r["seconds"]), fmt.whole(r["peak_mib"])]
            for n, r in sorted(d["sizes"].items(), key=lambda x: int(x[0]))]
    sizes = sorted(d["sizes"], key=int)
    low, high = d["sizes"][sizes[-2]]["peak_mib"], d["sizes"][sizes[-1]]["peak_mib"]
    flat = abs(high - low) < 0.1 * low
    return (fmt.table(["sentences", "seconds", "sentences/s", "peak RSS MiB"], rows) + "\n\n"
            f"From {fmt.whole(int(sizes[-2]))} to {fmt.whole(int(sizes[-1]))} sentences the peak "
            + (f"stays within {fmt.whole(abs(high - low))} MiB: it does not grow with the corpus." if flat else
               f"grows by {fmt.whole(high - low)} MiB.") + "\n\n"
            + fmt.source(f"`.venv/bin/python benchmarks/bench_corpus.py` ({measured_on(d)})"))


@figure("distributed-corpus", runs=("bench-corpus",))
def distributed_corpus(out: Outputs) -> dict:
    return {**out.json("bench-corpus", "corpus.json")["processes"], **timed(out, "bench-corpus")}


@distributed_corpus.renderer
def _(d: dict) -> str:
    return (f"`benchmarks/bench_corpus.py` measured {fmt.num(d['one'], 1)} s in one process against "
            f"{fmt.num(d['many'], 1)} s in {d['count']} (ratio {fmt.ratio(d['many'] / d['one'])}) for "
            f"{fmt.whole(d['sentences'])} sentences through a tiny model ({measured_on(d)}).")


@figure("distributed-minilm", runs=("torchrun-minilm",))
def distributed_minilm(out: Outputs) -> dict:
    return {k: out.step("torchrun-minilm", k)["seconds"] for k in ("one", "two", "two-1-thread")} | \
        timed(out, "torchrun-minilm")


@distributed_minilm.renderer
def _(d: dict) -> str:
    return ("MiniLM on the bundled corpus (`attnprobe analyze --model minilm-l6 --corpus corpora/sentences.txt`) "
            f"took {fmt.num(d['one'], 1)} s in one process, {fmt.num(d['two'], 1)} s in "
            f"two under `torchrun --standalone --nproc-per-node 2` (each with torch's default threads) and "
            f"{fmt.num(d['two-1-thread'], 1)} s in two with `OMP_NUM_THREADS=1`, whole processes included "
            f"({measured_on(d)}).")


# ---- the test suite ---------------------------------------------------------------------------------------------


@figure("suite", runs=("suite",))
def suite(out: Outputs) -> dict:
    return {**out.json("suite", "suite.json"), **timed(out, "suite")}


@suite.renderer
def _(d: dict) -> str:
    tests = sum(d["counts"].values())
    return (f"The whole suite took {fmt.num(d['seconds'] / 60, 1)} minutes of `python -m pytest` here ({tests} "
            f"tests, the conversion included; {measured_on(d)}), "
            + ("less on a quiet machine" if is_busy(d) else "more while other jobs share the machine")
            + ". It has grown with every command, so time it again (`make test` prints pytest's total).")


@figure("bench-long-user", runs=("bench-long-user",))
def bench_long_user(out: Outputs) -> dict:
    return {**out.json("bench-long-user", "user.json")["user"], **timed(out, "bench-long-user")}


@bench_long_user.renderer
def _(d: dict) -> str:
    med, ratios = d["medians"], d["ratios"]
    chosen = ", ".join(str(r["threads"]) for r in d["runs"]["defaults"])
    rows = [[way, fmt.num(m["seconds"], 1), fmt.num(m["cpu_seconds"], 1), fmt.whole(m["peak_mib"])]
            for way, m in (("floor: load, tokenize, one SDPA forward", med["floor"]),
                           ("`attnprobe analyze --split file`, every default", med["defaults"]))]
    judged = "cpu_seconds" if is_busy(d) else "seconds"
    ratio = ratios[judged]
    return "\n".join([
        fmt.table(["process", "wall s (median)", "CPU s (median)", "peak RSS MiB"], rows),
        "",
        f"attnprobe / floor: {fmt.ratio(ratios['seconds'])} of wall time, {fmt.ratio(ratios['cpu_seconds'])} of CPU "
        f"time (target <= {d['target']} on {'CPU' if judged == 'cpu_seconds' else 'wall'} time: "
        f"{'met' if ratio <= d['target'] else 'missed'}). `--threads auto` chose {chosen} thread(s) in its runs.",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_long.py --part user --repeat {d['repeat']}` (SmolLM2-135M, "
                   f"one document of {fmt.whole(d['tokens'])} tokens, whole processes with torch's default threads, "
                   f"{d['repeat']} runs each, interleaved; {measured_on(d)})"),
    ])


@figure("readme-speed", runs=("bench-analyze", "bench-long"))
def readme_speed(out: Outputs) -> dict:
    return {"short": bench_analyze_speed.collect(out), "long": bench_long_smollm2.collect(out)}


@figure("readme-as-user", runs=("bench-analyze", "bench-long-user"))
def readme_as_user(out: Outputs) -> dict:
    return {"short": bench_analyze_speed.collect(out), "user": bench_long_user.collect(out)}


@readme_as_user.renderer
def _(d: dict) -> str:
    return (as_a_user(d["short"], d["user"]) + "(`benchmarks/bench_analyze.py`, `benchmarks/bench_long.py --part "
            "user`; [Threads](docs/performance.md#threads)).")


@readme_speed.renderer
def _(d: dict) -> str:
    short, long = d["short"], d["long"]
    med, targets = short["speed"]["medians"], short["speed"]["targets"]
    key = "cpu" if is_busy(short) else "seconds"
    over = med["attnprobe"][key] / med["floor"][key]
    naive = med["naive"][key] / med["attnprobe"][key]
    lean = med["lean"][key] / med["floor"][key] if "lean" in med else None
    busy = is_busy(long)
    runs, t = long["runs"], long["targets"]
    blocked = seconds_of(runs["blocked"], busy) / seconds_of(runs["sdpa"], busy)
    fused = seconds_of(runs["fused"], busy) / seconds_of(runs["sdpa"], busy)

    def met(x: float, target: float, most: bool = True) -> str:
        return f"target {'<=' if most else '>='} {target}: {'met' if (x <= target) == most else 'missed'}"

    return (f"Speed, against the bare SDPA forward pass of the same model ({'CPU' if key == 'cpu' else 'wall'} time, "
            f"1 thread): on {short['sentences']} short sentences `attnprobe analyze` takes {fmt.ratio(over)} x "
            f"the forward pass ({met(over, targets['floor'])}"
            + (f"; {fmt.ratio(lean)} x without the value-weighted and token scores, "
               f"`--no-value-weighted --no-top-tokens`" if lean is not None else "")
            + f") and is {fmt.ratio(naive)} x faster than eager maps read in a Python loop "
            f"({met(naive, targets['naive'], most=False)}; `benchmarks/bench_analyze.py`). On a "
            f"{fmt.whole(long['tokens'])}-token document SmolLM2's blocked statistics take {fmt.ratio(blocked)} x the "
            f"SDPA forward ({met(blocked, t['blocked_time'])}) and the fused ones {fmt.ratio(fused)} x "
            f"({met(fused, t['fused_time'])}, [why](docs/long-documents.md#speed-and-memory-measured); "
            "`benchmarks/bench_long.py`). "
            "The full tables: [Performance](docs/performance.md).")


def as_a_user(short: dict, user: dict) -> str:
    """The README's sentence on the runs made as a user makes them: every default, torch's default threads."""
    med = short["speed"]["medians"]
    key = "cpu" if is_busy(short) else "seconds"
    over = med["defaults"][key] / med["floor-default"][key]
    target = short["speed"]["targets"]["floor"]
    long = user["ratios"]["cpu_seconds" if is_busy(user) else "seconds"]
    return (f"As a user runs it (every default, `--threads auto`, against the forward pass at torch's default "
            f"threads, whole processes): {fmt.ratio(over)} x on the short sentences (target <= "
            f"{target}: {'met' if over <= target else 'missed'})"
            f" and {fmt.ratio(long)} x on a {fmt.whole(user['tokens'])}-token document (target <= {user['target']}: "
            f"{'met' if long <= user['target'] else 'missed'}) ")


# ---- sizes researchers study: benchmarks/bench_scale.py -----------------------------------------------------------

SCALE_NAMES = {"llama-3.2-1b": "Llama-3.2-1B", "qwen2.5-1.5b": "Qwen2.5-1.5B", "gemma-2-2b": "Gemma-2-2B",
               "phi-3-mini": "Phi-3-mini"}


@figure("bench-scale", runs=("bench-scale",))
def bench_scale(out: Outputs) -> dict:
    return {**out.json("bench-scale", "scale.json"), **timed(out, "bench-scale")}


@bench_scale.renderer
def _(d: dict) -> str:
    rows = []
    for name, r in d["models"].items():
        shape = r["shape"]
        heads = shape["num_hidden_layers"] * shape["num_attention_heads"]
        document = r.get("document")
        related = (r.get("related") or {}).get("seconds")
        floor = r["short"]["forward"].get("attention", "sdpa")
        rows.append([
            SCALE_NAMES.get(name, name) + ("" if floor == "sdpa" else f" ({floor} floor: no SDPA)"),
            f"{shape['num_hidden_layers']} x {shape['num_attention_heads']} ({fmt.whole(heads)} heads, "
            f"{shape.get('num_key_value_heads', shape['num_attention_heads'])} KV)",
            fmt.ratio(r["short"]["cpu_ratio"]), fmt.ratio(document["cpu_ratio"]) if document else "-",
            fmt.whole(r["short"]["forward"]["peak_mib"]), fmt.whole(r["short"]["analyze"]["peak_mib"]),
            fmt.whole(r["checkpoint"]["checkpoint_mib"]),
            fmt.num(related, 0) if related is not None else "-",
        ])
    llama = d["models"].get("llama-3.2-1b", {})
    verdicts = []
    for label, key, target in (("short sentences", "short", d["targets"]["short"]),
                               (f"{fmt.whole(d['document_tokens'])} tokens", "document", d["targets"]["long"])):
        if key in llama:
            ratio = llama[key]["cpu_ratio"]
            verdict = "met" if ratio <= target else "missed"
            verdicts.append(f"{label} {fmt.ratio(ratio)} (target <= {target}: {verdict})")
    return "\n".join([
        fmt.table(["model (random weights, bf16)", "layers x heads", f"analyze / forward, {d['sentences']} sentences",
                   f"the same, {fmt.whole(d['document_tokens'])}-token document", "forward peak RSS MiB",
                   "analyze peak RSS MiB", "checkpoint MiB (first batch)", "related s"], rows),
        "",
        "Ratios are of CPU time, the model loaded before the clock starts; both ways run attnprobe's own length-sorted "
        "batches of 8, the forward under SDPA with no attention output. The Llama-3.2-1B shape, against its targets: "
        + "; ".join(verdicts) + ".",
        "",
        fmt.source(f"`.venv/bin/python benchmarks/bench_scale.py{threads_flag(d)}` ({measured_on(d)})"),
    ])
