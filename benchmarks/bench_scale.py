"""The sizes researchers study: attnprobe on random-weight models at published 1-4B shapes, in bfloat16.

Run:  .venv/bin/python benchmarks/bench_scale.py                       (every model, short sentences; Llama 4k too)
      .venv/bin/python benchmarks/bench_scale.py --models llama-3.2-1b --document-tokens 4096
      .venv/bin/python benchmarks/bench_scale.py --threads 1 --json out.json

Each model is built once from its published config with random weights (bfloat16, saved with save_pretrained into
--work; Phi-3-mini is 7.6 GB on disk) and loaded by path as a user's checkpoint. Per model, each in its own process
(the model loaded before the clock starts):
  forward  - the bare base model under SDPA (eager where transformers refuses SDPA, as for Gemma 2), no attention
             output, the corpus in attnprobe's own length-sorted batches of 8 (the floor);
  analyze  - `analyze_loaded` with every default score (value-weighted, output_norm, top tokens), batches of 8;
  checkpoint - the same run stopped after its first batch: the size of checkpoint.npz and the seconds to write it;
  related  - `attnprobe related` on the analyze results (the whole process, its model load included);
and, for the --document-models, one document of --document-tokens tokens through forward and analyze. It prints
CPU and wall seconds, analyze / forward (targets, Llama-3.2-1B shape in bf16: <= 1.3 on short sentences, <= 1.5 at
4k tokens, of CPU time), and each process's peak RSS. On a busy machine trust the CPU-time ratios.
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

ROOT = Path(__file__).resolve().parent.parent
TARGET_SHORT = 1.3  # analyze / forward, CPU time, short sentences (Llama-3.2-1B shape, bf16)
TARGET_LONG = 1.5  # the same on a 4k-token document
SENTENCES = 30

# Published shapes (config.json of each model); the weights are random.
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-3.2-1b": ("LlamaConfig", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}),
    "qwen2.5-1.5b": ("Qwen2Config", {
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6}),
    "gemma-2-2b": ("Gemma2Config", {
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256}),
    "phi-3-mini": ("Phi3Config", {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096, "rope_theta": 10000.0}),
}


WORDS = 2000  # distinct words of the corpora: few enough that the tokenizer makes each one token


def word(i: int) -> str:
    """The i-th word: letters only (some tokenizers split digits one by one)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "z" + letters[i // 676 % 26] + letters[i // 26 % 26] + letters[i % 26]


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained on the corpora's words (each word one token). A plain word-level one is
    not enough: transformers 5 loads some model types' own tokenizer class from tokenizer.json (a qwen2 folder gets
    Qwen2Tokenizer, which reads a word-level vocabulary as empty); a byte-level BPE reads the same in every
    class."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    lines = [" ".join(word(rng.randrange(WORDS)) for _ in range(40)) for _ in range(3000)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=4 * WORDS, special_tokens=["<unk>", "<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="<s>",
                            pad_token="<unk>").save_pretrained(folder)


def build(work: Path, name: str) -> Path:
    """The model at `name`'s shape, random bf16 weights, with its tokenizer, saved once into work/name."""
    folder = work / name
    save_tokenizer(folder)
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    import torch
    import transformers
    from transformers import AutoModel

    class_name, settings = SHAPES[name]
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**settings, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    config.dtype = "bfloat16"
    with torch.device("cpu"):
        model = AutoModel.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    return folder


def write_corpora(work: Path, document_tokens: int) -> tuple[Path, Path]:
    """30 sentences of 8-40 words, and one document of `document_tokens` words (one word = one token)."""
    rng = random.Random(0)
    short = work / "sentences.txt"
    short.write_text("\n".join(" ".join(word(rng.randrange(WORDS)) for _ in range(rng.randint(8, 40)))
                               for _ in range(SENTENCES)) + "\n", encoding="utf-8")
    long = work / f"document-{document_tokens}.txt"
    long.write_text(" ".join(word(rng.randrange(WORDS)) for _ in range(document_tokens)) + "\n", encoding="utf-8")
    return short, long


# ---- children: one process per way -------------------------------------------------------------------------------

def child(way: str, folder: Path, corpus: Path, split: str, out: Path) -> dict:
    import torch

    from attnprobe.analysis import analyze_loaded
    from attnprobe.batching import length_batches, pad_batch, tokenize
    from attnprobe.corpus import read_corpus
    from attnprobe.model import forward_kwargs, load_model
    from attnprobe.resume import Checkpointing, Stopped

    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    loaded = load_model(str(folder), "cpu", "bfloat16")
    text = read_corpus(corpus, split=split)
    started, cpu = time.perf_counter(), time.process_time()
    result: dict = {}
    if way == "forward":
        try:
            loaded.model.set_attn_implementation("sdpa")
            result["attention"] = "sdpa"
        except ValueError:  # transformers refuses SDPA for some models (Gemma 2's soft-capping): their own eager
            result["attention"] = "eager"
        ids = tokenize(loaded, text).ids
        with torch.inference_mode():
            for batch in length_batches(ids, 8):
                x, mask = pad_batch([ids[i] for i in batch], loaded.device)  # [batch, seq] each
                loaded.model(**forward_kwargs(loaded.model, x, mask))
    elif way == "analyze":
        run = analyze_loaded(loaded, text, batch_size=8).run
        result["path"] = run["attention"]["path"]
        result["sequences"] = run["attention"].get("sequences")
    elif way == "checkpoint":
        target = out / "checkpoint.npz"
        saves: list[float] = []

        def save(state) -> None:
            import numpy as np

            begun = time.perf_counter()
            with open(target, "wb") as handle:
                np.savez(handle, **state.to_arrays())
            saves.append(time.perf_counter() - begun)

        try:
            analyze_loaded(loaded, text, batch_size=8, checkpointing=Checkpointing(save=save, should_stop=lambda: True))
        except Stopped:
            pass
        result.update(checkpoint_mib=target.stat().st_size / 2**20, save_seconds=saves[-1] if saves else None)
    return {**result, "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu}


def spawn(way: str, folder: Path, corpus: Path, split: str, work: Path) -> dict:
    """Run one way in its own process; what it measured, and its peak RSS (os.wait4's ru_maxrss)."""
    out = Path(tempfile.mkdtemp(dir=work))
    command = [sys.executable, __file__, "--child", way, "--folder", str(folder), "--corpus", str(corpus),
               "--split", split, "--out", str(out)]
    with open(out / "stdout", "w+") as stdout, open(out / "stderr", "w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        stdout.seek(0)
        stderr.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{way} on {folder.name} failed:\n{stderr.read()[-3000:]}")
        return {**json.loads(stdout.read().strip().splitlines()[-1]), "peak_mib": usage.ru_maxrss / 1024}


def related_seconds(folder: Path, corpus: Path, work: Path) -> dict:
    """`attnprobe analyze` then `attnprobe related` as a user runs them (the latter timed, whole process)."""
    out = Path(tempfile.mkdtemp(dir=work))
    base = [sys.executable, "-m", "attnprobe"]
    subprocess.run([*base, "analyze", "--model", str(folder), "--corpus", str(corpus), "--out", str(out), "--device",
                    "cpu", "--dtype", "bfloat16"], check=True, capture_output=True)
    started = time.perf_counter()
    done = subprocess.run([*base, "related", "--out", str(out), "--device", "cpu"], capture_output=True, text=True)
    if done.returncode != 0:
        return {"seconds": None, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return {"seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--document-models", default="llama-3.2-1b", help="models also run on the long document")
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--no-related", action="store_true", help="skip `attnprobe related`")
    parser.add_argument("--threads", type=int, help="torch threads in every child (default: torch's own)")
    parser.add_argument("--work", type=Path, help="folder for the models (default: a temp folder; several GB)")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--split", default="lines", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.corpus, args.split, args.out)))
        return
    if args.threads:
        os.environ["BENCH_THREADS"] = str(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="attnprobe-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    short, long = write_corpora(work, args.document_tokens)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {', '.join(SHAPES)}")
    measured: dict = {"cores": os.cpu_count(), "load_average": os.getloadavg()[0], "threads": args.threads,
                      "sentences": SENTENCES, "document_tokens": args.document_tokens, "models": {},
                      "targets": {"short": TARGET_SHORT, "long": TARGET_LONG}}
    print(f"{os.cpu_count()} cores; threads {args.threads or 'torch default'}; work folder {work}")
    print(f"{'model':<14} {'corpus':<10} {'forward cpu s':>13} {'analyze cpu s':>13} {'ratio':>6} "
          f"{'fwd MiB':>8} {'analyze MiB':>11}")
    for name in names:
        folder = build(work, name)
        record: dict = {"class": SHAPES[name][0], "shape": SHAPES[name][1]}
        corpora = [("short", short, "lines")] + ([("document", long, "file")]
                                                  if name in args.document_models.split(",") else [])
        for label, corpus, split in corpora:
            forward = spawn("forward", folder, corpus, split, work)
            analyze = spawn("analyze", folder, corpus, split, work)
            ratio = analyze["cpu_seconds"] / forward["cpu_seconds"]
            record[label] = {"forward": forward, "analyze": analyze, "cpu_ratio": ratio,
                             "wall_ratio": analyze["seconds"] / forward["seconds"]}
            print(f"{name:<14} {label:<10} {forward['cpu_seconds']:>13.1f} {analyze['cpu_seconds']:>13.1f} "
                  f"{ratio:>6.2f} {forward['peak_mib']:>8.0f} {analyze['peak_mib']:>11.0f}")
        record["checkpoint"] = spawn("checkpoint", folder, short, "lines", work)
        print(f"{'':<14} checkpoint after the first batch: {record['checkpoint']['checkpoint_mib']:.0f} MiB, "
              f"written in {record['checkpoint']['save_seconds']:.1f} s")
        if not args.no_related:
            record["related"] = related_seconds(folder, short, work)
            print(f"{'':<14} related (whole process): {record['related']}")
        measured["models"][name] = record
    llama = measured["models"].get("llama-3.2-1b")
    if llama:
        for label, target in (("short", TARGET_SHORT), ("document", TARGET_LONG)):
            if label in llama:
                r = llama[label]["cpu_ratio"]
                print(f"Llama-3.2-1B shape, {label}: analyze / forward = {r:.2f} of CPU time (target <= {target}: "
                      f"{'met' if r <= target else 'MISSED'})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
