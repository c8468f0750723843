"""What the token scores cost `analyze`: punctuation, duplicate and top_tokens.csv on vs off, in one process.

Run:  .venv/bin/python benchmarks/bench_tokens.py                      (SmolLM2-135M, the bundled corpus)
      .venv/bin/python benchmarks/bench_tokens.py --model minilm-l6 --repeat 5 --attention fused

The model is loaded once; `analyze` then runs over the corpus with the token scores on and off, interleaved
(on, off, on, off, ...), so that a loaded, shared machine slows both alike; the medians and their ratio are
printed, of wall time and of the process's CPU time, which a loaded machine disturbs less (the target:
on / off <= 1.15). torch runs on --threads threads (default 1: steadier on a shared machine). "Off" is the code
path before the scores existed: no token ids reach the kernels and no top-token sums are kept (only the two
columns, empty, still pass through the bootstrap's sums). The punctuation table (the vocabulary decoded once per
tokenizer) is timed on its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "sentences.txt"
TARGET = 1.15


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from attnprobe import analysis, planning, tokens
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model

    loaded = load_model(args.model, "cpu")
    corpus = read_corpus(args.corpus)
    start = time.perf_counter()
    tokens.punctuation_table(loaded.tokenizer, analysis.vocabulary(loaded))
    print(f"punctuation table ({analysis.vocabulary(loaded):,} ids): {time.perf_counter() - start:.2f} s, once")

    def run(on: bool) -> tuple[float, float]:
        options = planning.Options(attention=args.attention, top_tokens=on)
        start, cpu = time.perf_counter(), time.process_time()
        if on:
            analysis.analyze_loaded(loaded, corpus, batch_size=args.batch_size, options=options)
        else:
            with mock.patch.object(analysis, "key_classes", lambda *_: None):
                analysis.analyze_loaded(loaded, corpus, batch_size=args.batch_size, options=options)
        return time.perf_counter() - start, time.process_time() - cpu

    run(True)  # warm-up
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for k in range(args.repeat):
        for on in (True, False) if k % 2 == 0 else (False, True):
            times[on].append(run(on))
            wall, cpu = times[on][-1]
            print(f"  {'on ' if on else 'off'} wall {wall:.2f} s, CPU {cpu:.2f} s", flush=True)
    for k, what in enumerate(("wall", "CPU")):
        on, off = (statistics.median(t[k] for t in times[flag]) for flag in (True, False))
        print(f"{args.model}, {len(corpus)} sequences, --attention {args.attention}, {args.threads} thread(s), "
              f"{what} time: on {on:.2f} s, off {off:.2f} s, on/off {on / off:.3f} (target <= {TARGET})")


if __name__ == "__main__":
    main()
