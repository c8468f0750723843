"""What the block bootstrap of a run of few sequences adds: resampling one long document's query rows.

Run:  .venv/bin/python benchmarks/bench_block_bootstrap.py                 (~1 min here)
      .venv/bin/python benchmarks/bench_block_bootstrap.py --lengths 1825,7657 --layers 30 --heads 9
      .venv/bin/python benchmarks/bench_block_bootstrap.py --json x.json   (also as JSON, for `make figures`)

Below 10 sequences `analyze` keeps each layer's row values ([head, row] per score) and resamples them
with `BlockResampler.means` before dropping them. This times exactly that, on random values shaped like
SmolLM2-135M's (30 layers x 9 heads, the 13 scores of a tokenizer that adds special tokens; some rows
NaN as in entropy_norm, sink_window and the _unforced scores) with the default 1,000 resamples: drawing
the blocks once per sequence, then one `means` call per layer. Target: well under the forward pass of
the same document (docs/long-documents.md compares it with SmolLM2's run on the GPL-3 text, `make figures`).
It also prints the row values one layer holds, in MiB (float32, as the kernel keeps them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch  # noqa: F401 - imported before the timings (BlockResampler imports it on first use)

from attnprobe.bootstrap import DEFAULT_RESAMPLES, BlockResampler, block_length

SCORES = 13  # METRICS and special_tokens


def values(heads: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    """[score x head, row]: random values with the NaN rows of the scores that skip some rows."""
    out = rng.random((SCORES * heads, rows))
    out[1 * heads : 2 * heads, 0] = np.nan  # entropy_norm: row 0 has one key
    out[8 * heads : 9 * heads, : min(rows, 260)] = np.nan  # sink_window: rows i >= S + W only
    out[9 * heads : 12 * heads, 0] = np.nan  # the _unforced scores
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1825,7657,32768", help="query rows of the one document")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| rows | block length | draw s | resample all layers s | s per layer | one layer's rows MiB |")
    print("|---|---|---|---|---|---|")
    measured = {"layers": args.layers, "heads": args.heads, "scores": SCORES, "resamples": args.resamples,
                "lengths": []}
    for rows in (int(n) for n in args.lengths.split(",")):
        layer = values(args.heads, rows, rng)
        started = time.perf_counter()
        resampler = BlockResampler.draw(0, rows, args.resamples, seed=0)
        drawn = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.layers):
            resampler.means(layer)
        resampled = time.perf_counter() - started
        held = SCORES * args.heads * rows * 4 / 2**20
        print(f"| {rows:,} | {block_length(rows)} | {drawn:.2f} | {resampled:.1f} | {resampled / args.layers:.2f} | "
              f"{held:.1f} |")
        measured["lengths"].append({"rows": rows, "block_length": block_length(rows), "draw_seconds": drawn,
                                    "resample_seconds": resampled, "held_mib": held})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
