"""How fast and how lean are `attnprobe circuit`'s edge scores and exact edge patching?

Run:  .venv/bin/python benchmarks/bench_circuit.py --threads 2          (SmolLM2-135M, 64 IOI pairs; minutes)
      .venv/bin/python benchmarks/bench_circuit.py --pairs 16 --json out.json

On SmolLM2-135M (30 layers x 9 query heads, 3 key/value heads: 301 senders, 481 receivers) over --pairs IOI pairs
(ABC corruption), metric logit(answer) - logit(wrong) at the last position, SDPA attention:
  1. forward + backward - the clean prompts through the model, the LM head at the last position, the metric summed
                          and backward() (parameter gradients too, as a training step computes them);
  2. EAP               - `circuit.attribute` (a corrupt and a clean forward keeping every sender's output, one
                          forward and backward with the hooks, every edge scored);
  3. EAP-IG (m = 5)    - the same with five forward and backward passes;
  4. exact, top 100    - `circuit.exact` on EAP's 100 edges of largest |score| (copies of the pairs restarted at
                          each receiver's layer, several a pass; its clean and corrupt runs included), against 100
                          separate patched forwards: the whole model on the clean prompts with one edge's receiver
                          moved (--separate of them timed, the mean times 100; the deltas taken as given).
Memory: the peak resident memory above what the process held before each step (Linux: VmHWM reset through
/proc/self/clear_refs). Each of EAP and EAP-IG is timed between two timings of the forward + backward and
divided by their median.
Targets: EAP <= 3 x forward + backward, EAP-IG <= 6 x, EAP's peak <= 2 x its peak; exact
top 100 <= 0.5 x the separate forwards. The ratios are measured side by side in one process, at the same threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_patch import measured  # noqa: E402  (benchmarks/ is on sys.path when a script there runs)

TARGETS = {"eap": 3.0, "eap_ig": 6.0, "memory": 2.0, "exact": 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--separate", type=int, default=10, help="separate patched forwards timed (of 100)")
    parser.add_argument("--repeats", type=int, default=2, help="timings of the forward + backward (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from dataclasses import dataclass

    from attnprobe import circuit as cc
    from attnprobe import ioi
    from attnprobe.ablate import fast_attention
    from attnprobe.model import load_model
    from attnprobe.patching import first_token

    @dataclass(frozen=True)
    class Pair:
        clean: str
        corrupt: str
        good: tuple[int, ...]
        bad: tuple[int, ...]

    def metric(logits, pairs):
        good = torch.tensor([p.good[0] for p in pairs], device=logits.device)  # [rows]
        bad = torch.tensor([p.bad[0] for p in pairs], device=logits.device)  # [rows]
        rows = torch.arange(logits.shape[0], device=logits.device)  # [rows]
        return logits[rows, good] - logits[rows, bad]

    loaded = load_model(args.model, "cpu", "float32", lm_head=True)
    made = [Pair(p.clean, p.corrupt, (first_token(loaded, p.answer, "answer"),),
                 (first_token(loaded, p.wrong, "wrong"),)) for p in ioi.ioi_pairs(loaded, args.pairs, "abc")]
    layout = cc.find_layout(loaded)
    graph = layout.graph
    prompts = cc.tokenize(loaded, made)

    def forward_backward():
        with torch.enable_grad():
            final = cc.forward(loaded, layout, prompts.clean, prompts.mask, cc.Pass())
            cc.measure(layout, metric, final, prompts).sum().backward()
        loaded.model.zero_grad(set_to_none=True)
        loaded.lm_head.zero_grad(set_to_none=True)

    def separate(edge, diff, kept):
        s, r = edge
        layer, j = graph.receiver_layer(r), r - graph.receiver_layer(r) * graph.per_layer

        def patch(at, low, high):
            return [(j, slice(None), diff[s])] if at == layer and low <= j < high else []

        with torch.inference_mode():
            final = cc.forward(loaded, layout, prompts.clean, prompts.mask, cc.Pass(patch=patch))
            return cc.measure(layout, metric, final, prompts)

    for module in (loaded.model, loaded.lm_head):
        module.requires_grad_(True)
    with fast_attention(loaded.model):
        forward_backward()  # warm-up
        # each way between two timings of the baseline: its ratio is to their median (the load of a shared
        # machine moves within minutes)
        before = [measured(forward_backward) for _ in range(args.repeats)]
        eap_s, eap_mib, scores = measured(lambda: cc.attribute(loaded, layout, prompts, metric))
        between = [measured(forward_backward) for _ in range(args.repeats)]
        ig_s, ig_mib, _ = measured(lambda: cc.attribute(loaded, layout, prompts, metric, steps=5))
        after = [measured(forward_backward) for _ in range(args.repeats)]
        base = before + between + after
        top = list(zip(*cc.top_edges(graph, scores, 100).nonzero()))
        exact_s, exact_mib, _ = measured(lambda: cc.exact(loaded, layout, prompts, metric, top))
        with torch.inference_mode():
            diff, _ = cc.outputs(loaded, layout, prompts, prompts.corrupt)
            kept = cc.keep_run(loaded, layout, prompts)
            diff -= kept.record
        step = max(1, len(top) // args.separate)
        one = [measured(lambda e=e: separate(e, diff, kept))[0] for e in top[::step][: args.separate]]
    base_s = statistics.median(b[0] for b in base)
    eap_base = statistics.median(b[0] for b in before + between)
    ig_base = statistics.median(b[0] for b in between + after)
    base_mib = max(b[1] for b in base)
    separate_s = statistics.mean(one) * len(top)
    result = {
        "model": args.model, "pairs": args.pairs, "tokens": int(prompts.mask.sum()), "edges": graph.edge_count,
        "threads": torch.get_num_threads(),
        "forward_backward_s": base_s, "forward_backward_mib": base_mib,
        "eap_s": eap_s, "eap_mib": eap_mib, "eap_ig_s": ig_s, "eap_ig_mib": ig_mib,
        "exact_top100_s": exact_s, "exact_receiver_layers": sorted(int(graph.receiver_layer(r)) for _, r in top),
        "exact_top100_mib": exact_mib, "separate_100_s": separate_s,
        "eap_ratio": eap_s / eap_base, "eap_ig_ratio": ig_s / ig_base,
        "memory_ratio": eap_mib / base_mib if base_mib else None, "exact_ratio": exact_s / separate_s,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    result["targets_met"] = {
        "eap": result["eap_ratio"] <= TARGETS["eap"], "eap_ig": result["eap_ig_ratio"] <= TARGETS["eap_ig"],
        "memory": result["memory_ratio"] is not None and result["memory_ratio"] <= TARGETS["memory"],
        "exact": result["exact_ratio"] <= TARGETS["exact"],
    }
    print(f"{args.model}, {args.pairs} IOI pairs ({result['tokens']} tokens), {graph.edge_count} edges, "
          f"{result['threads']} threads, load {result['load_average']}")
    print(f"  forward + backward     {base_s:8.3f} s   peak +{base_mib:7.1f} MiB   (median; before and after EAP "
          f"{eap_base:.3f} s, before and after EAP-IG {ig_base:.3f} s: each ratio is to its own)")
    print(f"  EAP (every edge)       {eap_s:8.3f} s   peak +{eap_mib:7.1f} MiB   {result['eap_ratio']:.2f} x "
          f"(target <= {TARGETS['eap']}); memory {result['memory_ratio']:.2f} x (target <= {TARGETS['memory']})")
    print(f"  EAP-IG (m = 5)         {ig_s:8.3f} s   peak +{ig_mib:7.1f} MiB   {result['eap_ig_ratio']:.2f} x "
          f"(target <= {TARGETS['eap_ig']})")
    print(f"  exact, top 100 edges   {exact_s:8.3f} s   peak +{exact_mib:7.1f} MiB   {result['exact_ratio']:.3f} x "
          f"100 separate patched forwards ({separate_s:.2f} s; target <= {TARGETS['exact']})")
    print(f"  (the top 100 edges' receivers by layer: {result['exact_receiver_layers']}; {graph.layers}: logits)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
