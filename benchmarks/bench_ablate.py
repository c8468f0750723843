"""How much faster is `attnprobe ablate` than one full forward pass per ablated head?

Run:  .venv/bin/python benchmarks/bench_ablate.py --threads 1      (SmolLM2-135M, bundled corpus; ~15 min here)
      .venv/bin/python benchmarks/bench_ablate.py --naive-heads 5 --batch-size 8

Both ways ablate heads of SmolLM2-135M (30 layers x 9 heads, zero ablation) on corpora/sentences.txt and compute
the same measures per sentence: the next-token loss and KL(unablated || ablated), against the unablated model on
the same batch, in length-sorted batches.
  1. naive     - for one head, the whole network on a batch with that head ablated (the same hook), then the LM
                 head and the measures; the unablated references are computed once beforehand and not counted.
                 Its cost for all heads is (number of heads) x the time of one such pass over the corpus.
  2. attnprobe - `attnprobe.ablate.measure` on all 270 heads, as `attnprobe ablate` runs it for importance.csv
                 (its own unablated passes included; the gradient and pruning stages are not): per batch, one
                 unablated pass keeps the residual stream at every layer's input; the heads of layer l then run
                 layers l..L-1 only, all of a layer's heads at once as copies of the batch.
This machine is shared, so the two are interleaved: after attnprobe finishes each batch, the naive pass runs on
that batch for --naive-heads heads spread over the depth (timed apart, and taken out of attnprobe's time), so
both see the same load. The naive time of a batch is the mean over those heads. It prints both totals and the
ratio 2/1 (target <= 0.6).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 0.6  # attnprobe / naive, at most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default=str(ROOT / "corpora" / "sentences.txt"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--naive-heads", type=int, default=3, help="heads timed the naive way (spread over depth)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice); "
                        "on a shared machine 1 thread avoids oversubscription")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from attnprobe import ablate as ab
    from attnprobe.batching import tokenize
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model
    from attnprobe.naming import head_name

    loaded = load_model(args.model, "cpu", lm_head=True)
    stack = ab.find_stack(loaded)
    ids = tokenize(loaded, read_corpus(args.corpus)).ids
    batches = ab.make_batches(loaded, ids, args.batch_size)
    fill = ab.zero_fill(loaded, stack)
    every = [(layer, (head,)) for layer in range(loaded.num_layers) for head in range(stack.heads)]
    print(f"{args.model}: {loaded.num_layers} layers x {stack.heads} heads = {len(every)} ablations; "
          f"{len(ids)} sentences, {sum(len(t) for t in ids)} tokens, batches of {args.batch_size}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    picks = [every[round(k * (len(every) - 1) / max(1, args.naive_heads - 1))] for k in range(args.naive_heads)]
    with ab.fast_attention(loaded.model), torch.inference_mode():
        references = [ab.reference(stack, b, ab.run_prefix(loaded, stack, b).final, True) for b in batches]
        naive: list[float] = []  # per batch: one head's naive pass, mean over the picked heads
        aside = [0.0]  # seconds spent in the naive passes while attnprobe runs

        def interleave(_stage: str, _done: int, _total: int) -> None:
            started = time.perf_counter()
            k = len(naive)
            naive.append(statistics.mean(naive_pass(ab, loaded, stack, batches[k], references[k], fill, target)
                                         for target in picks))
            aside[0] += time.perf_counter() - started

        started = time.perf_counter()
        ab.measure(loaded, stack, batches, every, fill, progress=interleave)
        ours = time.perf_counter() - started - aside[0]

    per_head = sum(naive)
    estimate = per_head * len(every)
    heads = ", ".join(head_name(layer, h[0]) for layer, h in picks)
    print(f"naive: {len(every)} x {per_head:.2f} s (one pass over the corpus, mean of heads {heads}) = "
          f"{estimate:.1f} s")
    print(f"attnprobe: {ours:.1f} s for all {len(every)} heads ({ours / len(every):.3f} s per head)")
    verdict = "meets" if ours / estimate <= TARGET_RATIO else "misses"
    print(f"ratio attnprobe / naive: {ours / estimate:.3f} ({verdict} the target <= {TARGET_RATIO})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "heads": len(every), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "naive_heads": [head_name(layer, h[0]) for layer, h in picks], "naive_per_head": per_head,
            "naive": estimate, "attnprobe": ours, "ratio": ours / estimate, "target": TARGET_RATIO,
            "load_average_after": os.getloadavg()[0]}, indent=1), encoding="utf-8")


def naive_pass(ab, loaded, stack, batch, ref, fill, target) -> float:
    """Seconds for the whole network on one batch with one head ablated, then the measures."""
    import torch

    layer, heads = target
    started = time.perf_counter()
    rows = torch.zeros(len(batch.indices), stack.heads, dtype=torch.bool)  # [batch, heads]
    rows[:, list(heads)] = True
    with ab.hooked([stack.projections[layer]], [ab.ablation_hook(stack, rows, fill[layer])]):
        final = ab.run_full(loaded, batch, 1)  # [batch, seq, hidden]
    ab.decoder_measures(stack, batch, ref, final)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
