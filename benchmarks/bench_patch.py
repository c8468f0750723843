"""How fast and how lean is `attnprobe patch` against the plain loop (one whole corrupt forward per head)?

Run:  .venv/bin/python benchmarks/bench_patch.py --threads 2           (SmolLM2-135M, 64 IOI pairs; a few minutes)
      .venv/bin/python benchmarks/bench_patch.py --pairs 16 --json out.json

On SmolLM2-135M (30 layers x 9 heads) over --pairs IOI pairs (ABC corruption), denoising at all positions:
  1. plain loop  - per head, the whole model on the corrupt prompts (all pairs in one batch, SDPA) with a forward
                   pre-hook on o_proj that puts the clean run's slice of that head, then the LM head at the last
                   position; about --plain-heads heads spread over the depth are timed (each costs the same: the
                   whole network), each right after the sweep's layer it sits in, and the mean is taken times 270.
     Beside it, the same loop with the LM head on every position (what a causal LM's forward computes).
  2. sweep       - `patching.activation_patching` on all 270 heads, a layer at a time, with the two kept runs it
                   needs (clean and corrupt: every block's input and every head's output); the corrupt run's earlier
                   layers are not rerun, and a layer's heads are patched as copies of the pairs in one batched
                   forward.
  3. attribution - `patching.attribution_patching` on every head and every position (the clean run kept, the
                   corrupt run with gradients, one backward pass), against one corrupt forward (the plain loop's
                   pass without its hook).
Memory: the peak resident memory above what the process held before each step (Linux: /proc/self/status VmHWM,
reset through /proc/self/clear_refs), for the corrupt forward, the sweep and attribution.
Targets: sweep <= 0.5 x the plain loop; attribution <= 4 x one corrupt forward; the sweep's peak <= 2 x the corrupt
forward's. The machine may be shared: the ratios are measured side by side in one process, at the same threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SWEEP_TARGET = 0.5  # sweep / plain loop, at most
ATTRIBUTION_TARGET = 4.0  # attribution / one corrupt forward, at most
MEMORY_TARGET = 2.0  # the sweep's peak / the corrupt forward's peak (above the loaded model), at most


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measured(work, baseline: int | None = None):
    """(seconds, peak MiB above the resident memory before (or above `baseline` KiB), result) of work()."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    except OSError:
        pass
    before = status_kib("VmRSS") if baseline is None else baseline
    started = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - started
    return seconds, max(0, status_kib("VmHWM") - before) / 1024, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--plain-heads", type=int, default=6, help="heads timed the plain way (spread over depth)")
    parser.add_argument("--repeats", type=int, default=3, help="timings of the corrupt forward (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from attnprobe import ioi
    from attnprobe import patching as pt
    from attnprobe.ablate import hooked
    from attnprobe.model import forward_kwargs, load_model

    loaded = load_model(args.model, "cpu", "float32", lm_head=True)
    parts = pt.find_parts(loaded)
    pairs = ioi.ioi_pairs(loaded, args.pairs, "abc")
    prompts = pt.tokenize_pairs(loaded, pairs)
    every = [(layer, head) for layer in range(loaded.num_layers) for head in range(loaded.num_heads)]

    def corrupt_forward(hooks=(), every_logit: bool = False):
        with hooked(*zip(*hooks)) if hooks else nullcontext():
            final = loaded.model(**forward_kwargs(loaded.model, prompts.corrupt, prompts.mask)).last_hidden_state
        if every_logit:  # as a causal LM's forward does: the logits of every position, then the last one's read
            logits = loaded.lm_head(final)  # [pairs, seq, vocab]
            rows = torch.arange(logits.shape[0])  # [pairs]
            last = logits[rows, prompts.last]  # [pairs, vocab]
            return last[rows, prompts.answer] - last[rows, prompts.wrong]
        return pt.metric(parts, prompts, final, "logit-diff")

    def plain_head(layer: int, head: int, clean: pt.Prefix) -> float:
        mask = torch.zeros(prompts.mask.shape + (parts.heads,), dtype=torch.bool)  # [pairs, seq, heads]
        mask[..., head] = True
        step = [(parts.projections[layer], pt.replace_hook(parts, mask, clean.outputs[layer]))]
        return measured(lambda: corrupt_forward(step))[0], measured(lambda: corrupt_forward(step, True))[0]

    def attribution():
        with torch.inference_mode():
            source = pt.run_prefix(loaded, parts, prompts.clean, prompts.mask)
        return pt.attribution_patching(loaded, parts, prompts, every, direction="denoise", positions="each",
                                       kind="logit-diff", source=source)

    with pt.fast_attention(loaded.model):
        with torch.inference_mode():
            corrupt_forward()  # warm-up
            forward = [measured(corrupt_forward) for _ in range(args.repeats)]
            # the sweep's kept runs, then its layers one at a time, each followed by one plain head of that layer
            # (every --plain-heads-th layer): both see the same load
            gc.collect()
            start_kib = status_kib("VmRSS")  # the sweep's memory counts from here: its kept runs included
            kept_s, kept_mib, (base, clean) = measured(lambda: (
                pt.run_prefix(loaded, parts, prompts.corrupt, prompts.mask),
                pt.run_prefix(loaded, parts, prompts.clean, prompts.mask)))
            layers_s, layers_mib, plain = [], [], []
            step = max(1, loaded.num_layers // max(1, args.plain_heads))
            for layer in range(loaded.num_layers):
                mine = [(layer, head) for head in range(loaded.num_heads)]
                seconds, mib, _ = measured(lambda mine=mine: pt.activation_patching(
                    loaded, parts, prompts, mine, positions="all", kind="logit-diff", base=base, source=clean),
                    start_kib)
                layers_s.append(seconds)
                layers_mib.append(mib)
                print(f"  layer {layer}: {seconds:.2f} s", flush=True)
                if layer % step == 0:
                    plain.append(plain_head(layer, layer % loaded.num_heads, clean))
        attribution_s, attribution_mib, _ = measured(attribution)
        forward += [measured(corrupt_forward) for _ in range(args.repeats)]  # after, too: the load changes
    forward_s = statistics.median(f[0] for f in forward)
    forward_mib = max(f[1] for f in forward)
    plain_s = statistics.mean(p[0] for p in plain) * len(every)
    plain_all_s = statistics.mean(p[1] for p in plain) * len(every)
    sweep_s = kept_s + sum(layers_s)
    sweep_mib = max(kept_mib, max(layers_mib))  # each above the RSS before the kept runs
    picks = plain

    result = {
        "model": args.model, "pairs": args.pairs, "tokens": int(prompts.mask.sum()), "heads": len(every),
        "threads": torch.get_num_threads(), "plain_heads_timed": len(picks),
        "corrupt_forward_s": forward_s, "plain_loop_s": plain_s, "plain_loop_all_logits_s": plain_all_s,
        "sweep_s": sweep_s, "attribution_s": attribution_s,
        "sweep_ratio": sweep_s / plain_s, "sweep_ratio_all_logits": sweep_s / plain_all_s,
        "attribution_ratio": attribution_s / forward_s,
        "corrupt_forward_mib": forward_mib, "sweep_mib": sweep_mib, "attribution_mib": attribution_mib,
        "memory_ratio": sweep_mib / forward_mib if forward_mib else None,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    result["targets_met"] = {
        "sweep": result["sweep_ratio"] <= SWEEP_TARGET,
        "attribution": result["attribution_ratio"] <= ATTRIBUTION_TARGET,
        "memory": result["memory_ratio"] is not None and result["memory_ratio"] <= MEMORY_TARGET,
    }
    print(f"{args.model}, {args.pairs} IOI pairs ({result['tokens']} tokens), {result['threads']} threads, "
          f"load {result['load_average']}")
    print(f"  corrupt forward        {forward_s:8.3f} s   peak +{forward_mib:7.1f} MiB")
    print(f"  plain loop (270 heads) {plain_s:8.2f} s   (mean of {len(picks)} heads x 270; last position's logits)")
    print(f"  plain, every logit     {plain_all_s:8.2f} s   (the LM head on every position, as a causal LM runs)")
    print(f"  sweep                  {sweep_s:8.2f} s   peak +{sweep_mib:7.1f} MiB   "
          f"ratio {result['sweep_ratio']:.3f} (target <= {SWEEP_TARGET}); "
          f"{result['sweep_ratio_all_logits']:.3f} against every logit")
    print(f"  attribution (each pos) {attribution_s:8.3f} s   peak +{attribution_mib:7.1f} MiB   "
          f"{result['attribution_ratio']:.2f} x the forward (target <= {ATTRIBUTION_TARGET})")
    print(f"  memory: sweep / forward {result['memory_ratio']:.2f} (target <= {MEMORY_TARGET})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
