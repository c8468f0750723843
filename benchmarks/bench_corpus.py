"""Peak memory against corpus size: `attnprobe analyze` on 1k, 10k and 100k sentences.

Run:  .venv/bin/python benchmarks/bench_corpus.py                      (about 5 minutes here)
      .venv/bin/python benchmarks/bench_corpus.py --sizes 1000,10000

A tiny random GPT-2 (4 layers x 4 heads, 64 wide, a 1,000-word vocabulary) reads generated
sentences of 8-24 tokens; each size runs as its own `attnprobe analyze` process, with the default
1,000 bootstrap resamples. Statistics are folded into sums batch by batch, so the peak resident
memory should stay flat within noise while the time grows linearly: the corpus streams past in
windows of 4,096 sentences, and nothing per sentence is kept.

Then `--processes 2` (the default) runs the 10,000-sentence corpus in one process and in two under
`torchrun --standalone` (gloo on CPU) and prints the ratio; on a 2-core machine expect about 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 1000


def build(work: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    folder = work / "model"
    if not (folder / "config.json").exists():
        words = ["<|endoftext|>", "<unk>", *(f"w{i}" for i in range(VOCAB - 2))]
        core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(
            folder)
        torch.manual_seed(0)
        GPT2Model(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                        bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return folder


def corpus(work: Path, sentences: int) -> Path:
    path = work / f"corpus-{sentences}.txt"
    if not path.exists():
        rng = random.Random(sentences)
        lines = (" ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(rng.randint(8, 24))) for _ in range(sentences))
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(model: Path, text: Path, out: Path, processes: int = 1) -> dict:
    started = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(processes)] if processes > 1 else [sys.executable]
    process = subprocess.Popen([*launcher, "-m", "attnprobe", "analyze", "--model", str(model), "--corpus",
                                str(text), "--out", str(out), "--device", "cpu", "--batch-size", "32"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(process.stderr.read().decode()[-2000:])
    return {"seconds": time.perf_counter() - started, "peak_mib": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--processes", type=int, default=2, help="compare 1 process with this many (0: skip)")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="attnprobe-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build(work)
    print(f"{os.cpu_count()} cores; work folder {work}")
    print(f"{'sentences':>10} {'seconds':>8} {'sentences/s':>12} {'peak MiB':>9}")
    measured: dict = {"cores": os.cpu_count(), "load_average": os.getloadavg()[0], "sizes": {}}
    for n in (int(x) for x in args.sizes.split(",")):
        r = run(model, corpus(work, n), work / f"out-{n}")
        measured["sizes"][n] = r
        print(f"{n:>10} {r['seconds']:>8.1f} {n / r['seconds']:>12.0f} {r['peak_mib']:>9.0f}")
    if args.processes > 1:
        text = corpus(work, 10_000)
        one = run(model, text, work / "out-one")["seconds"]
        many = run(model, text, work / "out-many", args.processes)["seconds"]
        print(f"\n10,000 sentences: 1 process {one:.1f} s, {args.processes} under torchrun {many:.1f} s "
              f"(whole processes); ratio {many / one:.2f}")
        measured["processes"] = {"sentences": 10_000, "one": one, "many": many, "count": args.processes}
    measured["load_average_after"] = os.getloadavg()[0]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
