"""How close is `attnprobe analyze` to the bare forward pass, and how much faster than the naive way?

Run:  .venv/bin/python benchmarks/bench_analyze.py            (speed, the new scores' cost, memory; ~6 min here)
      .venv/bin/python benchmarks/bench_analyze.py --no-memory --sentences 100
      .venv/bin/python benchmarks/bench_analyze.py --no-memory --repeat 3 --threads 1
      .venv/bin/python benchmarks/bench_analyze.py --only-new-scores --repeat 5 --threads 1   (new scores' cost)

On a GPT-2-small-shaped model (12 x 12, 768 wide, vocab 50257) with random weights and a
generated corpus (sentences of 8-40 tokens), each way runs as its own process, from start-up to
its last statistic:
  1. floor  - the base model, SDPA, no attention output, length-sorted batches of 8;
  2. naive  - the LM-head model, eager, output_attentions, one sentence at a time, and the
              statistics in a Python loop over heads (as the reference study's script does);
  3. attnprobe - `attnprobe analyze`, exactly as a user runs it;
  4. lean   - `attnprobe analyze --no-value-weighted --no-top-tokens`: without the value-weighted scores, output_norm
              and top_tokens.csv: the statistics the floor target (<= 1.05) was first set on.
Every way runs with the same torch threads (--threads; default: attnprobe's `auto`, torch's own count less the CPUs
busy at the start, decided once for the whole benchmark). Then, as a user runs them (--no-user skips these):
  5. floor-default - the floor with torch's default threads (no OMP_NUM_THREADS, no set_num_threads);
  6. defaults - `attnprobe analyze` with every default, `--threads auto` included, decided by each run itself;
and the ratio 6/5 (target <= 1.05), which is what a user sees on an idle machine, run after run.
With --repeat N the ways run N times, interleaved, and the medians are compared. It prints wall time, CPU time,
tokens/s and peak memory for each, the ratios 3/1 and 4/1 (target <= 1.05) and 2/3 (target >= 2.5), of wall and of
CPU time. The floor and the naive way run with OMP_NUM_THREADS set to the thread count and OPENBLAS_NUM_THREADS=1
(as attnprobe's CLI sets it), so that no way pays for threads that only spin. Then what the newer scores cost:
`attnprobe analyze` on --new-scores-model (default smollm2-135m) over --new-scores-corpus (default the bundled
corpora/sentences.txt), with them (the default) and with --no-value-weighted --no-top-tokens (which skips the value-
weighted scores, output_norm and the per-token sums: the run before them; the punctuation and duplicate_token scores
run in both, `bench_tokens.py` times them), interleaved; the ratios on / off of the process's wall and CPU time and
of the analysis alone (run.json's wall_seconds, after the model is loaded), target <= 1.15. Then the peak memory of
one long sequence: attnprobe's blocked statistics attention, the eager hook path (reduce each layer's map, then drop
it), holding every layer's maps, and the bare SDPA forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 50257
BATCH = 8
TARGET_FLOOR_RATIO = 1.05  # attnprobe / floor, at most (short sentences at the floor)
TARGET_NAIVE_RATIO = 2.5  # naive / attnprobe, at least
USER_WAYS = ("floor-default", "defaults")  # run as a user runs them: torch's and attnprobe's default threads
TARGET_NEW_SCORES_RATIO = 1.15  # analyze with the new scores (value-weighted, top tokens) / without, at most
ROOT = Path(__file__).resolve().parent.parent


# ---- set-up: model, tokenizer, corpus ---------------------------------------------------------

def build(work: Path, sentences: int, seed: int = 0) -> None:
    """A random GPT-2-small-shaped model with a word-level tokenizer (one word = one token)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        words = ["<|endoftext|>", "<unk>", *(f"w{i}" for i in range(VOCAB - 2))]
        core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>")
        tokenizer.save_pretrained(model_dir)
        torch.manual_seed(seed)
        GPT2Model(GPT2Config(vocab_size=VOCAB)).save_pretrained(model_dir)
    rng = random.Random(seed)
    lines = [" ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(rng.randint(8, 40))) for _ in range(sentences)]
    (work / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---- the three ways, each run in a child process ------------------------------------------------

def set_threads() -> None:
    """The benchmark's thread count (BENCH_THREADS), for the floor and the naive way; torch's own where the way runs
    as a user runs it (floor-default)."""
    import torch

    if os.environ.get("BENCH_THREADS", "default") != "default":
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))


def child_floor(work: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, GPT2Model

    set_threads()
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = GPT2Model.from_pretrained(work / "model", attn_implementation="sdpa").eval()
    ids = tokenizer((work / "corpus.txt").read_text(encoding="utf-8").splitlines())["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    with torch.inference_mode():
        for k in range(0, len(order), BATCH):
            batch = [ids[i] for i in order[k : k + BATCH]]
            n = max(map(len, batch))
            x = torch.tensor([t + [0] * (n - len(t)) for t in batch])  # [batch, seq]
            mask = torch.tensor([[1] * len(t) + [0] * (n - len(t)) for t in batch])  # [batch, seq]
            model(input_ids=x, attention_mask=mask, use_cache=False)
    return {"tokens": sum(map(len, ids))}


def child_naive(work: Path) -> dict:
    import math

    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    set_threads()
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = GPT2LMHeadModel.from_pretrained(work / "model", attn_implementation="eager").eval()
    ids = tokenizer((work / "corpus.txt").read_text(encoding="utf-8").splitlines())["input_ids"]
    results = []
    with torch.no_grad():
        for tokens in ids:
            out = model(torch.tensor([tokens]), output_attentions=True)
            n = len(tokens)
            band = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 2  # [query, key]
            for layer, attn in enumerate(out.attentions):  # [1, head, query, key]
                for head in range(attn.shape[1]):
                    p = attn[0, head]  # [query, key]
                    entropy = -(p * torch.log(p + 1e-12)).sum(-1).mean().item()
                    near = (p * band).sum(-1).mean().item()
                    results.append((layer, head, entropy, near, p[:, 0].mean().item()))
    assert not math.isnan(results[0][2])
    return {"tokens": sum(map(len, ids))}


def child_attnprobe(work: Path, *flags: str) -> dict:
    out = Path(tempfile.mkdtemp(dir=work))
    command = [sys.executable, "-m", "attnprobe", "analyze", "--model", str(work / "model"),
               "--corpus", str(work / "corpus.txt"), "--out", str(out), "--device", "cpu",
               "--threads", os.environ["BENCH_THREADS"], *flags]
    os.execv(sys.executable, command)  # become the user's process: its start-up and imports count


def child_lean(work: Path) -> dict:
    return child_attnprobe(work, "--no-value-weighted", "--no-top-tokens")


def child_floor_default(work: Path) -> dict:
    return child_floor(work)  # run_child leaves BENCH_THREADS and OMP_NUM_THREADS out: torch's own threads


def child_defaults(work: Path) -> dict:
    """`attnprobe analyze` exactly as a user types it: no --threads (auto decides in this process)."""
    command = [sys.executable, "-m", "attnprobe", "analyze", "--model", str(work / "model"),
               "--corpus", str(work / "corpus.txt"), "--out", os.environ["BENCH_OUT"], "--device", "cpu"]
    os.execv(sys.executable, command)


def new_scores_command(model: str, corpus: str, out: Path, new: bool) -> list[str]:
    """`attnprobe analyze` as a user runs it, with or without the value-weighted scores and top_tokens.csv."""
    return [sys.executable, "-m", "attnprobe", "analyze", "--model", model, "--corpus", corpus, "--out", str(out),
            "--device", "cpu", "--threads", os.environ["BENCH_THREADS"],
            *([] if new else ["--no-value-weighted", "--no-top-tokens"])]


def run_child(way: str, work: Path, command: list[str] | None = None) -> dict:
    """Run one way in a fresh process (or `command`); wall time, CPU time and peak RSS of that process."""
    env = dict(os.environ)
    if way in ("floor", "naive"):  # as attnprobe's CLI and --threads set them before torch and numpy load
        env.update(OMP_NUM_THREADS=os.environ["BENCH_THREADS"], OPENBLAS_NUM_THREADS="1")
    if way in USER_WAYS:  # as a user's shell has it: no thread settings at all
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(name, None)
        env["BENCH_THREADS"] = "default"
        env["BENCH_OUT"] = tempfile.mkdtemp(dir=work)
    started = time.perf_counter()
    process = subprocess.Popen(command or [sys.executable, __file__, "--child", way.replace("-", "_"), "--work",
                                           str(work)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{way} failed: {process.stderr.read().decode()[-2000:]}")
    result = {"seconds": seconds, "cpu": usage.ru_utime + usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024}
    if way == "defaults":  # the threads `auto` chose in that run
        result["threads"] = json.loads((Path(env["BENCH_OUT"]) / "run.json").read_text())["threads"]["threads"]
    return result


# ---- memory: one long sequence ----------------------------------------------------------------

def child_memory(work: Path, n: int, how: str) -> dict:
    import torch

    from attnprobe import kernel
    from attnprobe.metrics import bin_count, sentence_stats
    from attnprobe.model import load_model, stream_attention

    loaded = load_model(str(work / "model"), "cpu")
    x = torch.randint(2, VOCAB, (1, n))  # [batch, seq]
    mask = torch.ones(1, n, dtype=torch.long)  # [batch, seq]
    with torch.inference_mode():  # warm-up: weights are memory-mapped until first used
        loaded.model(input_ids=x[:, :8], attention_mask=mask[:, :8], use_cache=False)
    base = resident_mib()
    reset_peak()
    with torch.inference_mode():
        if how == "attnprobe":
            with kernel.statistics_attention(loaded):
                kernel.run_batch(loaded, x, mask, lambda *_: None, bins=bin_count(n))
        elif how == "hooks":
            stream_attention(loaded, x, mask, lambda _layer, p: sentence_stats(p, mask, True))
        elif how == "sdpa":
            loaded.model.set_attn_implementation("sdpa")
            loaded.model(input_ids=x, attention_mask=mask, use_cache=False)
        else:
            maps = loaded.model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
            [sentence_stats(p, mask, True) for p in maps]
    return {"above_model_mib": peak_mib() - base}


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak resident size (VmHWM)


def peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


# ---- report -----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--work", type=Path, help="folder for the model and corpus (default: a temp folder)")
    parser.add_argument("--no-memory", action="store_true", help="skip the long-sequence memory table")
    parser.add_argument("--no-user", action="store_true", help="skip the ways run as a user runs them (defaults)")
    parser.add_argument("--threads", default="auto", help="torch threads for every way (default: attnprobe's auto)")
    parser.add_argument("--repeat", type=int, default=1, help="run the ways this many times, interleaved; medians")
    parser.add_argument("--new-scores-model", default="smollm2-135m", help="model of the new scores' cost")
    parser.add_argument("--new-scores-corpus", default=str(ROOT / "corpora" / "sentences.txt"),
                        help="corpus of the new scores' cost")
    parser.add_argument("--no-new-scores", action="store_true", help="skip the new scores' cost")
    parser.add_argument("--only-new-scores", action="store_true", help="only the new scores' cost")
    parser.add_argument("--memory-only", action="store_true", help="only the long-sequence memory table")
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--how", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "memory":
            print(json.dumps(child_memory(args.work, args.n, args.how)))
        else:
            globals()[f"child_{args.child}"](args.work)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="attnprobe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    build(work, args.sentences)
    tokens = sum(len(line.split()) for line in (work / "corpus.txt").read_text().splitlines())
    from attnprobe import threads

    chosen = threads.apply(args.threads)
    os.environ["BENCH_THREADS"] = str(chosen["threads"])
    print(f"GPT-2-small shape, random weights; {args.sentences} sentences, {tokens} tokens; "
          f"{os.cpu_count()} cores; torch threads {chosen['threads']} (--threads {args.threads}, busy CPUs "
          f"{chosen['busy_cpus']}, load average {chosen['load_average']}); {args.repeat} run(s) each, interleaved; "
          f"work folder {work}\n")
    measured: dict = {"sentences": args.sentences, "tokens": tokens, "cores": os.cpu_count(),
                      "threads": chosen["threads"], "threads_option": args.threads,
                      "load_average": chosen["load_average"], "repeat": args.repeat}
    if not (args.memory_only or args.only_new_scores):
        measured["speed"] = speed(work, tokens, args.repeat, user=not args.no_user)
    if not (args.memory_only or args.no_new_scores):
        measured["new_scores"] = new_scores_cost(work, args.new_scores_model, args.new_scores_corpus, args.repeat)
    if not (args.no_memory or args.only_new_scores):
        measured["memory"] = memory(work)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


def speed(work: Path, tokens: int, repeat: int, user: bool = True) -> dict:
    """The ways, `repeat` times interleaved: medians and each run, printed and returned."""
    ways = ("floor", "naive", "attnprobe", "lean", *(USER_WAYS if user else ()))
    every: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(repeat):
        for way in ways:
            every[way].append(run_child(way, work))
    runs = {way: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for way, rs in every.items()}
    if user:
        print(f"defaults: --threads auto chose {', '.join(str(r['threads']) for r in every['defaults'])} thread(s) "
              "in its runs")
    print(f"{'way':<10} {'wall s':>8} {'cpu s':>8} {'tok/s':>8} {'peak MiB':>9}   (medians; wall of each run)")
    for way, r in runs.items():
        each = " ".join(f"{x['seconds']:.1f}" for x in every[way])
        print(f"{way:<10} {r['seconds']:>8.2f} {r['cpu']:>8.2f} {tokens / r['seconds']:>8.0f} {r['peak_mib']:>9.0f}"
              f"   {each}")
    for what, key in (("wall", "seconds"), ("cpu", "cpu")):
        print()
        for way in ("attnprobe", "lean"):
            over_floor = runs[way][key] / runs["floor"][key]
            print(f"{what}: {way} / floor = {over_floor:.2f}  (target <= {TARGET_FLOOR_RATIO}: "
                  f"{'met' if over_floor <= TARGET_FLOOR_RATIO else 'MISSED'})")
        naive_over = runs["naive"][key] / runs["attnprobe"][key]
        print(f"{what}: naive / attnprobe = {naive_over:.2f}  (target >= {TARGET_NAIVE_RATIO}: "
              f"{'met' if naive_over >= TARGET_NAIVE_RATIO else 'MISSED'})")
        if user:
            as_user = runs["defaults"][key] / runs["floor-default"][key]
            print(f"{what}: as a user runs them, defaults / floor-default = {as_user:.2f}  (target <= "
                  f"{TARGET_FLOOR_RATIO}: {'met' if as_user <= TARGET_FLOOR_RATIO else 'MISSED'})")
    return {"runs": every, "medians": runs, "targets": {"floor": TARGET_FLOOR_RATIO, "naive": TARGET_NAIVE_RATIO}}


def new_scores_cost(work: Path, model: str, corpus: str, repeat: int) -> dict:
    """`attnprobe analyze` with the value-weighted and token scores and without, interleaved `repeat` times: medians
    and ratios."""
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(repeat):
        for new in (False, True):
            out = work / f"new-scores-{'on' if new else 'off'}"
            result = run_child("", work, new_scores_command(model, corpus, out, new))
            run = json.loads((out / "run.json").read_text(encoding="utf-8"))
            if run["value_weighted"]["measured"] != new or (out / "top_tokens.csv").exists() != new:
                raise SystemExit(f"value_weighted {run['value_weighted']} in {out}: not the run asked for")
            runs[new].append({**result, "analysis": run["wall_seconds"]})
    medians = {w: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for w, rs in runs.items()}
    print(f"\nNew scores: attnprobe analyze --model {model} --corpus {Path(corpus).name}, with them (the default) and "
          f"with --no-value-weighted --no-top-tokens; {repeat} run(s) each, interleaved (medians)")
    print(f"{'':<34} {'wall s':>8} {'cpu s':>8} {'analysis s':>11}")
    for new in (False, True):
        m = medians[new]
        print(f"{'with' if new else '--no-value-weighted --no-top-tokens':<34} {m['seconds']:>8.2f} {m['cpu']:>8.2f} "
              f"{m['analysis']:>11.2f}")
    ratios = {}
    for what, key in (("process wall", "seconds"), ("process cpu", "cpu"), ("analysis (run.json)", "analysis")):
        ratios[key] = medians[True][key] / medians[False][key]
        print(f"{what}: with / without = {ratios[key]:.3f}  (target <= {TARGET_NEW_SCORES_RATIO}: "
              f"{'met' if ratios[key] <= TARGET_NEW_SCORES_RATIO else 'MISSED'})")
    return {"model": model, "corpus": Path(corpus).name, "runs": {str(k): v for k, v in runs.items()},
            "medians": {str(k): v for k, v in medians.items()}, "ratios": ratios, "target": TARGET_NEW_SCORES_RATIO}


def memory(work: Path) -> dict:
    """Peak memory above the loaded model of one sequence of 128 ... 1024 tokens, four ways (MiB)."""
    table = {}
    print("\nPeak memory above the loaded model, one sequence (MiB)")
    print(f"{'tokens':>7} {'SDPA, no maps':>14} {'attnprobe':>10} {'eager hooks':>12} {'all maps':>9}")
    for n in (128, 256, 512, 1024):
        row = []
        for how in ("sdpa", "attnprobe", "hooks", "all-maps"):
            done = subprocess.run([sys.executable, __file__, "--child", "memory", "--work", str(work),
                                   "--n", str(n), "--how", how], capture_output=True, text=True, check=True)
            row.append(json.loads(done.stdout.strip().splitlines()[-1])["above_model_mib"])
        print(f"{n:>7} {row[0]:>14.0f} {row[1]:>10.0f} {row[2]:>12.0f} {row[3]:>9.0f}")
        table[n] = dict(zip(("sdpa", "attnprobe", "hooks", "all-maps"), row))
    return table


if __name__ == "__main__":
    main()
