"""Figures of `attnprobe circuit`: docs/guides/circuits.md."""

from __future__ import annotations

import re

from figures import fmt
from figures.registry import Outputs, figure

CIRCUIT = "`attnprobe circuit --model smollm2-135m --task {task} --n 32 --out outputs/circuit-{task} --threads 2`"
PATCH_HEADS = ("L23H3", "L20H0", "L17H4")  # the heads patch's guide finds carrying IOI on SmolLM2 (patch-smollm2)


def heads_of(names: list[str]) -> list[str]:
    """The query heads named in edges' endpoints ("a23.h3" -> "L23H3"), in order of first appearance."""
    found: list[str] = []
    for name in names:
        match = re.fullmatch(r"a(\d+)\.h(\d+)", name)
        if match and fmt.head(int(match[1]), int(match[2])) not in found:
            found.append(fmt.head(int(match[1]), int(match[2])))
    return found


def summary(out: Outputs, run: str) -> dict:
    info = out.json(run, "circuit.json")
    edges = out.csv(run, "edges.csv").head(8)
    faith = info["faithfulness"]
    return {
        "pairs": info["pairs"]["count"], "method": info["method"], "metric": info["metric"],
        "edges": info["graph"]["edges"], "chosen": len(info["circuit"]["edges"]),
        "clean": faith["clean"], "corrupt": faith["corrupt"], "cpr": faith["cpr"], "cmd": faith["cmd"],
        "random_cpr": faith["random_cpr"], "random_cmd": faith["random_cmd"],
        "top": [{"sender": r.sender, "receiver": r.receiver, "input": r.input if isinstance(r.input, str) else "",
                 "score": float(r.score)} for r in edges.itertuples()],
        "wall": out.step(run, "circuit")["seconds"], "load": out.step(run, "circuit")["load_average"],
        "machine": out.when(run),
    }


@figure("circuit-smollm2", runs=("circuit-ioi", "circuit-greater-than"),
        images={"circuit-ioi/circuit.png": "smollm2-135m-circuit-ioi.png",
                "circuit-ioi/faithfulness.png": "smollm2-135m-faithfulness-ioi.png",
                "circuit-greater-than/faithfulness.png": "smollm2-135m-faithfulness-greater-than.png"})
def circuit_smollm2(out: Outputs) -> dict:
    return {"ioi": summary(out, "circuit-ioi"), "greater-than": summary(out, "circuit-greater-than")}


@circuit_smollm2.renderer
def _(d: dict) -> str:
    ioi = d["ioi"]
    rows = [[f"`{e['sender']}`", f"`{e['receiver']}`", e["input"] or "-", fmt.signed(e["score"])] for e in ioi["top"]]
    named = heads_of([e["sender"] for e in ioi["top"]] + [e["receiver"] for e in ioi["top"]])
    shared = [h for h in named if h in PATCH_HEADS]
    tasks = [[task, str(r["pairs"]), r["metric"], fmt.signed(r["clean"]), fmt.signed(r["corrupt"]),
              fmt.num(r["cpr"]), fmt.num(r["cmd"]), fmt.num(r["random_cpr"]), fmt.num(r["random_cmd"])]
             for task, r in d.items()]
    return "\n\n".join([
        f"On {ioi['pairs']} IOI pairs ({ioi['method']}, every one of the {ioi['edges']:,} edges scored) the eight "
        "edges of largest |score| are below; the heads they run through are "
        f"{fmt.listing(named) if named else 'none (MLPs and the input only)'}, and of the heads `patch` finds "
        f"carrying IOI ({fmt.listing(list(PATCH_HEADS))}) {fmt.listing(shared) if shared else 'none'} "
        f"{'is' if len(shared) == 1 else 'are'} among them.",
        fmt.table(["sender", "receiver", "input", "score"], rows),
        "![the IOI circuit of SmolLM2-135M](../images/smollm2-135m-circuit-ioi.png)",
        "Faithfulness over circuit size, each task's circuit against random circuits of the same sizes (CPR: the "
        "area under the curve, higher is better; CMD: the area between it and 1, lower is better):",
        fmt.table(["task", "pairs", "metric", "clean", "corrupt", "CPR", "CMD", "random CPR", "random CMD"], tasks),
        "![IOI faithfulness](../images/smollm2-135m-faithfulness-ioi.png)",
        "![greater-than faithfulness](../images/smollm2-135m-faithfulness-greater-than.png)",
        fmt.source(f"{CIRCUIT.format(task='ioi')} and the same with `--task greater-than` "
                   f"({fmt.seconds(ioi['wall'])} and {fmt.seconds(d['greater-than']['wall'])}; "
                   f"{fmt.machine(ioi['machine']['machine'], ioi['load'])}; {ioi['machine']['date']})"),
    ])


@figure("bench-circuit", runs=("bench-circuit",))
def bench_circuit(out: Outputs) -> dict:
    return {**out.json("bench-circuit", "circuit.json"), "when": out.when("bench-circuit")}


@bench_circuit.renderer
def _(d: dict) -> str:
    met = {k: "met" if v else "missed" for k, v in d["targets_met"].items()}
    rows = [["one forward + backward of the pairs", fmt.seconds(d["forward_backward_s"]), "1", ""],
            [f"EAP, all {d['edges']:,} edges", fmt.seconds(d["eap_s"]), fmt.ratio(d["eap_ratio"]),
             f"<= 3 ({met['eap']}); peak memory {fmt.ratio(d['memory_ratio'])} x (<= 2, {met['memory']})"],
            ["EAP-IG, 5 steps", fmt.seconds(d["eap_ig_s"]), fmt.ratio(d["eap_ig_ratio"]), f"<= 6 ({met['eap_ig']})"],
            ["exact patching of the top 100 edges", fmt.seconds(d["exact_top100_s"]),
             f"{fmt.ratio(d['exact_ratio'])} of 100 separate patched forwards", f"<= 0.5 ({met['exact']})"]]
    return (fmt.table(["what", "time", "x forward + backward", "target"], rows) + "\n\n"
            + fmt.source(f"`benchmarks/bench_circuit.py --pairs {d['pairs']} --threads {d['threads']}` "
                         f"({d['pairs']} IOI pairs, {d['tokens']} tokens; "
                         f"{fmt.machine(d['when']['machine'], d['load_average'])}; {d['when']['date']})"))
