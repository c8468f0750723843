"""Where the fused path's time goes on one long document, against the bare SDPA forward, in one process.

Run:  .venv/bin/python benchmarks/profile_fused.py                       (SmolLM2-135M, 3,600 tokens, 1 thread)
      .venv/bin/python benchmarks/profile_fused.py --tokens 2000 --repeat 5 --profile

The model is loaded once; then, interleaved (so that a busy, shared machine slows every way alike), the ways run
`--repeat` times each and the medians of the process's CPU time (time.process_time) are printed, with each way's
ratio to SDPA:
  sdpa      - the base model under SDPA, no attention output (the floor);
  fused     - run_batch on the fused path with what `analyze` computes by default: value-weighted scores,
              special tokens, token scores (punctuation, duplicate) and the mass each key receives (top_tokens.csv);
  fused-off - the same with --no-value-weighted --no-top-tokens (token ids still reach the kernel: punctuation and
              duplicate are per-head scores);
  fused-bare - bench_long's `fused` way: no value-weighted scores, no token ids, no special tokens.
`--profile` then runs each fused way once more under cProfile and torch.profiler and prints the CPU time per
Python function of the fused path (cumulative) and per aten operation (self time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from bench_long import document_ids  # benchmarks/ is on sys.path when a script there runs

WAYS = ("sdpa", "fused", "fused-off", "fused-bare")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3600)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--profile", action="store_true", help="then a per-function and per-operation breakdown")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from attnprobe import analysis, kernel, values
    from attnprobe.metrics import bin_count
    from attnprobe.model import attention_modules, load_model

    loaded = load_model("smollm2-135m", "cpu")
    x = torch.tensor([document_ids(loaded.tokenizer, args.tokens)])  # [batch, seq]
    mask = torch.ones_like(x)  # [batch, seq]
    special = torch.isin(x, torch.tensor(loaded.tokenizer.all_special_ids))  # [batch, seq]
    classes = analysis.key_classes(loaded, x, special)
    modules = [module for module, _ in attention_modules(loaded.model)]
    projections = values.find_projections(loaded.model, modules, loaded.num_heads)[0]

    def run(way: str, ids, ids_mask) -> None:
        with torch.inference_mode():
            if way == "sdpa":
                loaded.model.set_attn_implementation("sdpa")
                loaded.model(input_ids=ids, attention_mask=ids_mask, use_cache=False)
                return
            full = way == "fused"
            bare = way == "fused-bare"
            n = ids.shape[1]

            def on_layer(_layer, sums, _maps) -> None:  # what analysis.measure_batch reads
                sums.means(), sums.bin_means()
                if full:
                    sums.received  # noqa: B018 - top_tokens.csv reads it

            with kernel.statistics_attention(loaded):
                kernel.run_batch(loaded, ids, ids_mask, on_layer, special=None if bare else special[:, :n],
                                 bins=bin_count(n), fused=0, projections=projections if full else None,
                                 tokens=None if bare else analysis.TokenClasses(classes.ids[:, :n],
                                                                                classes.punctuation[:, :n]))

    ways = args.ways.split(",")
    for way in ways:
        run(way, x[:, :64], mask[:, :64])  # warm-up
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    for k in range(args.repeat):
        for way in ways if k % 2 == 0 else ways[::-1]:
            started = time.process_time()
            run(way, x, mask)
            cpu[way].append(time.process_time() - started)
            print(f"  {way:<10} CPU {cpu[way][-1]:.2f} s", flush=True)
    base = statistics.median(cpu["sdpa"]) if "sdpa" in cpu else None
    print(f"\nSmolLM2-135M, {args.tokens} tokens, {args.threads} thread(s), median CPU seconds of {args.repeat}")
    for way in ways:
        median = statistics.median(cpu[way])
        print(f"{way:<10} {median:7.2f} s" + (f"   / sdpa {median / base:.2f}" if base else ""))
    if not args.profile:
        return
    for way in ways:
        if way == "sdpa":
            continue
        profile = cProfile.Profile()
        profile.enable()
        run(way, x, mask)
        profile.disable()
        print(f"\n== {way}: Python functions of the fused path, cumulative CPU seconds")
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative").print_stats(r"kernel/|metrics.py|values.py", 30)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(way, x, mask)
        print(f"\n== {way}: aten operations, self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
