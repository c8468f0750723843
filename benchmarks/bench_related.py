"""How long does `attnprobe related` take, and how much of it is the pairwise JS divergence?

Run:  .venv/bin/python benchmarks/bench_related.py                 (SmolLM2-135M, bundled corpus, the defaults)
      .venv/bin/python benchmarks/bench_related.py --long          (the largest default sample: 200 x 64 tokens)

It loads the model once (not timed), then times `similarity.head_similarity` as `related` runs it, split into
  1. forward - the eager forward passes with their hooks, and each sentence's unforced rows taken out
               (`similarity.batch_rows`), batches of --batch-size sentences sorted by length;
  2. js      - `similarity.PairwiseJS` over those rows: the JS divergence of every pair of heads
               (270 heads: 36,315 pairs), in blocks of BUDGET elements.
--long replaces the corpus by 200 texts of 64 tokens or more (bundled sentences joined), so that the sample is
the largest the defaults allow. The JS work grows with heads^2 x the (row, key) weights of the sample:
about heads^2 / 2 x sentences x max_tokens^2 / 2 at most.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def long_texts(sentences: list[str], count: int, words: int) -> list[str]:
    """`count` texts of at least `words` words each, consecutive bundled sentences joined (cycling)."""
    texts, k = [], 0
    for _ in range(count):
        parts: list[str] = []
        while sum(len(p.split()) for p in parts) < words:
            parts.append(sentences[k % len(sentences)])
            k += 1
        texts.append(" ".join(parts))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default=str(ROOT / "corpora" / "sentences.txt"))
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--long", action="store_true", help="200 texts of 64+ tokens: the largest default sample")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="auto", help="torch threads, as the CLI's --threads (default: auto)")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()

    import torch

    from attnprobe.threads import apply

    apply(args.threads)
    from attnprobe.batching import clipped, length_batches, tokenize_sentences
    from attnprobe.corpus import corpus_from_texts, read_corpus
    from attnprobe.model import load_model
    from attnprobe.similarity import PairwiseJS, batch_rows, sample_indices

    loaded = load_model(args.model, args.device)
    corpus = read_corpus(args.corpus)
    if args.long:
        corpus = corpus_from_texts(long_texts(corpus.texts, args.sentences, args.max_tokens))
    indices = set(sample_indices(len(corpus), args.sentences))
    chosen = [clipped(s, args.max_tokens) for k, s in enumerate(corpus.stream()) if k in indices]
    ids = [list(map(int, t[: args.max_tokens])) for t in tokenize_sentences(loaded, chosen).ids]
    heads = loaded.num_layers * loaded.num_heads
    total = PairwiseJS(heads, loaded.device)
    forward = js = 0.0
    for batch in length_batches(ids, args.batch_size):
        started = time.perf_counter()
        rows = batch_rows(loaded, [ids[i] for i in batch])
        forward += time.perf_counter() - started
        started = time.perf_counter()
        for weights, count in rows:
            total.add(weights, count)
        js += time.perf_counter() - started
    started = time.perf_counter()
    total.mean()  # folds in what is still buffered
    js += time.perf_counter() - started
    weights = sum(min(len(t), args.max_tokens) ** 2 // 2 for t in ids)
    print(f"{args.model}: {heads} heads ({heads * (heads - 1) // 2:,} pairs), {len(ids)} sentences, "
          f"{sum(len(t) for t in ids):,} tokens, {total.rows:,} rows, ~{weights:,} weights per head, "
          f"{torch.get_num_threads()} threads")
    print(f"forward {forward:.1f} s, js {js:.1f} s, together {forward + js:.1f} s")
    if args.json:
        measured = {"model": args.model, "long": args.long, "heads": heads, "pairs": heads * (heads - 1) // 2,
                    "sentences": len(ids), "tokens": sum(len(t) for t in ids), "rows": total.rows,
                    "weights_per_head": weights, "threads": torch.get_num_threads(), "forward_seconds": forward,
                    "js_seconds": js}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
