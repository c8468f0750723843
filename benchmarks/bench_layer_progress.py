"""What progress inside a long sequence (attnprobe.layer_progress) costs.

Run:  .venv/bin/python benchmarks/bench_layer_progress.py [--sentences 300] [--repeat 5] [--threads 1]

1. Short sentences: `analyze_loaded` over --sentences generated sentences (8-40 tokens) on a random GPT-2-shaped model
   (6 x 12, 384 wide: smaller than GPT-2 small, so a fixed cost per batch weighs more), three ways, interleaved,
   --repeat times: `before` (layer_progress.watching replaced by a bare nullcontext: the code before layer progress),
   `plain` (a progress callback without `within`: no reporter), `cli` (a callback with `within`, as the CLI's: the
   reporter is made, and `watching` sees a short batch and registers nothing). Medians of the analysis's wall time.
2. The `with watching(...)` of a short batch alone, in microseconds.
3. One long sequence (2,048 tokens) through the same model, with the hooks (a report per layer) and without.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch


def model_dir(folder):
    from transformers import GPT2Config, GPT2Model

    from attnprobe.model import load_model

    words = [f"w{i}" for i in range(400)]
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import save_tokenizer

    texts = [" ".join(words[i : i + 20]) + "." for i in range(0, 400, 20)]
    vocab = save_tokenizer(folder, texts)
    torch.manual_seed(0)
    GPT2Model(GPT2Config(vocab_size=vocab, n_positions=4096, n_embd=384, n_layer=6, n_head=12, bos_token_id=None,
                         eos_token_id=None)).save_pretrained(folder)
    return load_model(str(folder), "cpu"), words


def main() -> None:
    import tempfile
    from pathlib import Path

    from attnprobe import analysis, layer_progress
    from attnprobe.analysis import analyze_loaded
    from attnprobe.corpus import Corpus, Sentence

    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded, words = model_dir(Path(tempfile.mkdtemp()))
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(args.sentences)]
    corpus = Corpus(path=Path("bench.txt"), sha256="-",
                    sentences=tuple(Sentence(t, i + 1, None) for i, t in enumerate(texts)))

    real = layer_progress.watching

    def bare(*_args, **_kwargs):
        return contextlib.nullcontext()

    def with_within(done, within=None):
        pass

    ways = {"before": (bare, lambda done: None), "plain": (real, lambda done: None), "cli": (real, with_within)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    analyze_loaded(loaded, corpus, resamples=10)  # warm up
    for _ in range(args.repeat):
        for name, (watch, progress) in ways.items():
            analysis.layer_progress.watching = watch
            started, used = time.perf_counter(), time.process_time()
            analyze_loaded(loaded, corpus, resamples=10, progress=progress)
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - used)
    analysis.layer_progress.watching = real
    print(f"1. {args.sentences} short sentences, {args.threads} thread(s), median of {args.repeat}:")
    for what, measured in (("wall", times), ("CPU", cpu)):
        base = statistics.median(measured["before"])
        for name, values in measured.items():
            median = statistics.median(values)
            print(f"   {what:4s} {name:7s} {median:7.3f} s  ({median / base:.3f}x before)  "
                  f"all: {', '.join(f'{v:.2f}' for v in values)}")

    n = 20000
    started = time.perf_counter()
    for _ in range(n):
        with real(loaded.model, 40, with_within):
            pass
    print(f"2. `with watching(...)` on a short batch: {(time.perf_counter() - started) / n * 1e6:.2f} us")

    ids = torch.randint(0, 400, (1, 2048))
    seen = []
    long_times: dict[str, list[float]] = {"hooks": [], "none": []}
    with torch.inference_mode():
        for _ in range(args.repeat):
            for name in long_times:
                started = time.perf_counter()
                with real(loaded.model, 2048, seen.append if name == "hooks" else None, every=0):
                    loaded.model(input_ids=ids)
                long_times[name].append(time.perf_counter() - started)
    print(f"3. 2,048 tokens, median of {args.repeat}: with hooks {statistics.median(long_times['hooks']):.3f} s, "
          f"without {statistics.median(long_times['none']):.3f} s; {len(seen)} reports")


if __name__ == "__main__":
    main()
