"""Long documents: attnprobe's blocked statistics attention against the bare SDPA forward pass.

Run:  .venv/bin/python benchmarks/bench_long.py                 (both parts; ~10 min here)
      .venv/bin/python benchmarks/bench_long.py --part smollm2 --tokens 3600
      .venv/bin/python benchmarks/bench_long.py --part tiny --lengths 1024,2048,4096
      .venv/bin/python benchmarks/bench_long.py --part smollm2 --threads 1     (CPU times stay comparable on a busy
                                                                              machine; every way reports both)

Part 1, SmolLM2-135M on one document (licence text, repeated if short, cut to --tokens): each way runs
in its own process, which loads the model, warms it up on 8 tokens, then runs the document once.
  sdpa     - the base model under SDPA, no attention output (the floor);
  blocked  - attnprobe's statistics attention: every statistic of every row, by position bin too;
  fused    - the same statistics from the fused kernel's logsumexp (--attention fused);
  eager    - (--eager) attnprobe's hook path on eager maps, as before blocked attention existed;
  blocked+vw, fused+vw - (--value-weighted) blocked and fused with the value-weighted scores and output_norm
             (what `analyze` computes by default), printed as ratios to blocked and fused without them.
It prints the forward time and the peak resident memory of each process, and the ratios blocked/sdpa
(targets: time <= 2x, peak memory <= 1.3x) and fused/sdpa (targets: time <= 1.3x, peak memory <= 1.1x).

Part `user` (--part user), SmolLM2-135M on one document of --user-tokens tokens (default 8,000; its context is
8,192), as a user runs it: whole processes with torch's default threads (no OMP_NUM_THREADS, no --threads):
  floor    - load the model as attnprobe does, tokenize the document, one SDPA forward pass;
  defaults - `attnprobe analyze --split file` with every default (`--threads auto`, value-weighted and token scores).
--repeat N runs them N times interleaved; it prints the medians and defaults/floor of wall and CPU time (target
<= 1.3), and the threads `auto` chose in each run (run.json). --baseline DIR adds a third way, interleaved with the
two: `baseline`, the same analyze from the attnprobe package in DIR (an older checkout, e.g. from `git archive`),
so that a change is measured before and after in one run.

Part 2, a tiny random Llama (4 layers, 4 query heads, 2 KV heads, 64 wide, room for 40k positions)
on one random sequence of 1k ... 32k tokens: time and peak memory of the blocked run, so that O(n)
memory and O(n^2) time are visible, and a check that the positions.csv bins that lie inside a 2,048-token
prefix equal an independent eager computation on that prefix (causal: a row sees only the keys before it).

Part 3 (--part zoo), the other architectures (tests/zoo.py's tiny models, 2 layers x 4 heads of 8, room for 40k
positions): tiny Qwen2, Mistral with a sliding window of 4,096 and Gemma 2 (window 4,096 on alternate layers,
soft-capping) at 1k ... 32k tokens, blocked statistics attention, each length in its own process. Targets: peak
memory within +25% from the shortest to the longest length; a windowed model's time grows linearly past its
window (the time per token from 8k to 32k stays flat, printed as the ratio of the last to the 8k one). Then one
16k-token sequence through tiny gpt_neox, qwen2, mistral (sliding window), gemma2, phi3 and modernbert: the
process's peak memory, target under 1.5 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_analyze import peak_mib  # benchmarks/ is on sys.path when a script there runs

LICENCE = Path("/usr/share/common-licenses/GPL-3")
TARGET_TIME = 2.0  # blocked / sdpa forward time, at most
TARGET_FUSED_TIME = 1.3  # fused / sdpa forward time, at most
TARGET_FUSED_MEMORY = 1.1  # fused / sdpa peak RSS, at most
TARGET_GROWTH = 1.25  # zoo: peak memory at the longest length / at the shortest, at most
TARGET_16K_MIB = 1536  # zoo: a 16k-token sequence's process peak
ZOO_WINDOW = 4096
ZOO_SCALING = ("qwen2", "mistral (sliding window)", "gemma2")
ZOO_16K = ("gpt_neox", "qwen2", "mistral (sliding window)", "gemma2", "phi3", "modernbert")
TARGET_MEMORY = 1.3  # blocked / sdpa peak RSS, at most
PREFIX = 2048


def document_ids(tokenizer, tokens: int) -> list[int]:
    text = LICENCE.read_text(encoding="utf-8") if LICENCE.exists() else "attention is all you need. " * 4000
    ids = tokenizer(text)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def run_way(loaded, x, mask, way: str, sink: int = 4, window: int = 256) -> None:
    import torch

    from attnprobe import kernel
    from attnprobe.metrics import bin_count, sentence_sums
    from attnprobe.model import stream_attention

    bins = bin_count(x.shape[1])
    with torch.inference_mode():
        if way == "sdpa":
            loaded.model.set_attn_implementation("sdpa")
            loaded.model(input_ids=x, attention_mask=mask, use_cache=False)
        elif way.split("+")[0] in ("blocked", "fused"):
            projections = None
            if way.endswith("+vw"):
                from attnprobe.model import attention_modules
                from attnprobe.values import find_projections

                modules = [module for module, _ in attention_modules(loaded.model)]
                projections = find_projections(loaded.model, modules, loaded.num_heads)[0]
            with kernel.statistics_attention(loaded):
                kernel.run_batch(loaded, x, mask, lambda *_: None, sink=sink, window=window, bins=bins,
                                 fused=0 if way.startswith("fused") else None, projections=projections)
        else:
            stream_attention(loaded, x, mask, lambda _l, p: sentence_sums(p, mask, True, None, sink, window, bins))


TARGET_USER = 1.3  # user part: attnprobe analyze (defaults) / the floor process, at most


def user_document(work: Path, tokens: int) -> Path:
    """A text file of about `tokens` SmolLM2 tokens of licence text (decoded from the ids, so it tokenizes back to
    nearly the same count)."""
    from transformers import AutoTokenizer

    from attnprobe.sources import resolve

    path = work / f"user-document-{tokens}.txt"
    if not path.exists():
        tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m").location)
        path.write_text(tokenizer.decode(document_ids(tokenizer, tokens)) + "\n", encoding="utf-8")
    return path


def child_user_floor(document: Path) -> None:
    """The floor as a user would write it: attnprobe's loader, torch's default threads, one SDPA forward."""
    import torch

    from attnprobe.model import load_model

    loaded = load_model("smollm2-135m", "cpu")
    loaded.model.set_attn_implementation("sdpa")
    ids = loaded.tokenizer(document.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


def user_part(work: Path, tokens: int, repeat: int, baseline: Path | None = None) -> dict:
    """The floor process and `attnprobe analyze` with its defaults, interleaved `repeat` times, torch's and
    attnprobe's own thread choices: medians, each run, and defaults / floor. `baseline`: a folder holding another
    attnprobe package, whose analyze runs as a third way (`baseline`)."""
    import statistics

    document = user_document(work, tokens)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                            "MKL_NUM_THREADS", "BENCH_THREADS")}
    commands = {
        "floor": [sys.executable, __file__, "--child-user-floor", str(document)],
        "defaults": [sys.executable, "-m", "attnprobe", "analyze", "--model", "smollm2-135m", "--corpus",
                     str(document), "--split", "file", "--out", str(work / "user-out"), "--device", "cpu"],
    }
    envs = {way: env for way in commands}
    if baseline is not None:
        commands["baseline"] = [*commands["defaults"][:-3], str(work / "baseline-out"), "--device", "cpu"]
        envs["baseline"] = {**env, "PYTHONPATH": str(baseline.resolve())}
    runs: dict[str, list[dict]] = {way: [] for way in commands}
    for _ in range(repeat):
        for way, command in commands.items():
            started = time.perf_counter()
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=envs[way])
            _, status, usage = os.wait4(process.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"user/{way} failed: {process.stderr.read().decode()[-2000:]}")
            run = {"seconds": time.perf_counter() - started, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                   "peak_mib": usage.ru_maxrss / 1024}
            if way != "floor":
                record = json.loads((work / ("user-out" if way == "defaults" else "baseline-out") / "run.json")
                                    .read_text(encoding="utf-8"))
                run.update(threads=record["threads"]["threads"], tokens=record["tokens"],
                           path=record["attention"]["path"])
            runs[way].append(run)
    medians = {way: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "cpu_seconds", "peak_mib")}
               for way, rs in runs.items()}
    ratios = {k: medians["defaults"][k] / medians["floor"][k] for k in ("seconds", "cpu_seconds")}
    print(f"\nAs a user runs it: SmolLM2-135M, one document of {runs['defaults'][0]['tokens']} tokens, whole "
          f"processes, torch's default threads; {repeat} run(s) each, interleaved (medians)")
    for way, m in medians.items():
        print(f"{way:<10} {m['seconds']:>8.1f} s wall {m['cpu_seconds']:>8.1f} s CPU {m['peak_mib']:>7.0f} MiB")
    print(f"--threads auto chose {', '.join(str(r['threads']) for r in runs['defaults'])} thread(s)")
    for what, key in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        print(f"{what}: defaults / floor = {ratios[key]:.2f} (target <= {TARGET_USER}: "
              f"{'met' if ratios[key] <= TARGET_USER else 'MISSED'})"
              + (f"; baseline / floor = {medians['baseline'][key] / medians['floor'][key]:.2f}"
                 if "baseline" in medians else ""))
    return {"tokens": runs["defaults"][0]["tokens"], "runs": runs, "medians": medians, "ratios": ratios,
            "target": TARGET_USER, "repeat": repeat}


def child(args) -> dict:
    import torch

    from attnprobe.model import load_model

    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))

    if args.part == "smollm2":
        loaded = load_model("smollm2-135m", "cpu")
        ids = document_ids(loaded.tokenizer, args.n)
        x = torch.tensor([ids])  # [batch, seq]
    elif args.part == "zoo":
        loaded = load_model(str(zoo_folder(args.work, args.how)), "cpu")
        x = torch.randint(3, loaded.model.config.vocab_size, (1, args.n), generator=torch.Generator().manual_seed(0))
        args.how = "blocked"
    else:
        loaded = load_model(str(args.work / "tiny"), "cpu")
        x = torch.randint(3, loaded.model.config.vocab_size, (1, args.n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)  # [batch, seq]
    run_way(loaded, x[:, :8], mask[:, :8], args.how)  # warm-up: weights are memory-mapped until first used
    started, cpu = time.perf_counter(), time.process_time()
    run_way(loaded, x, mask, args.how)
    return {"seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu, "peak_mib": peak_mib(),
            "layers": loaded.model.config.num_hidden_layers}


def spawn(part: str, how: str, n: int, work: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", "--part", part, "--how", how, "--n", str(n),
                           "--work", str(work)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{part}/{how}/{n} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def zoo_folder(work: Path, name: str) -> Path:
    """tests/zoo.py's `name` with room for 40k positions (and a window of 4,096 where it has one), built once."""
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from zoo import ZOO, make

    folder = work / re.sub(r"\W+", "_", name)
    if not (folder / "config.json").is_file():
        settings = ZOO[name][1]
        overrides = {"max_position_embeddings": 40_000}
        if settings.get("sliding_window"):
            overrides["sliding_window"] = ZOO_WINDOW
        if name == "modernbert":
            overrides.update(local_attention=128, global_rope_theta=160_000.0)
        make(name, folder, **overrides)
    return folder


def zoo(work: Path, lengths: list[int]) -> dict:
    print(f"\nOther architectures (tests/zoo.py, 2 layers x 4 heads of 8), one random sequence, blocked statistics "
          f"attention; windows of {ZOO_WINDOW}")
    print(f"{'model':<26} {'tokens':>7} {'seconds':>8} {'us/token':>9} {'peak MiB':>9}")
    measured: dict = {"window": ZOO_WINDOW, "scaling": {}, "16k": {}}
    for name in ZOO_SCALING:
        zoo_folder(work, name)
        runs = {n: spawn("zoo", name, n, work) for n in lengths}
        measured["scaling"][name] = runs
        for n, r in runs.items():
            print(f"{name:<26} {n:>7} {r['seconds']:>8.1f} {1e6 * r['seconds'] / n:>9.1f} {r['peak_mib']:>9.0f}")
        growth = runs[max(lengths)]["peak_mib"] / runs[min(lengths)]["peak_mib"]
        verdict = "met" if growth <= TARGET_GROWTH else "MISSED"
        line = f"{name}: peak memory {max(lengths)} / {min(lengths)} tokens = {growth:.2f} "
        line += f"(target <= {TARGET_GROWTH}: {verdict})"
        past = [n for n in lengths if n >= 2 * ZOO_WINDOW]
        if "window" in name and len(past) >= 2:
            per_token = [runs[n]["seconds"] / n for n in past]
            line += f"; time per token, {past[-1]} / {past[0]} tokens: {per_token[-1] / per_token[0]:.2f} (linear: ~1)"
        print(line)
    print(f"\nOne 16,384-token sequence, blocked statistics attention (target: peak under {TARGET_16K_MIB} MiB)")
    for name in ZOO_16K:
        zoo_folder(work, name)
        r = spawn("zoo", name, 16_384, work)
        measured["16k"][name] = r
        verdict = "met" if r["peak_mib"] < TARGET_16K_MIB else "MISSED"
        print(f"{name:<26} {r['seconds']:>8.1f} s {r['peak_mib']:>9.0f} MiB ({verdict})")
    return measured


def whole_process(work: Path, n: int) -> dict:
    """`attnprobe analyze --split file` on one random n-token document of the tiny Llama: the whole process."""
    import random

    document = work / f"tiny-document-{n}.txt"
    rng = random.Random(0)
    document.write_text(" ".join(f"w{rng.randrange(998)}" for _ in range(n)) + "\n", encoding="utf-8")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "attnprobe", "analyze", "--model", str(work / "tiny"),
                                "--corpus", str(document), "--split", "file", "--out", str(work / "tiny-out"),
                                "--device", "cpu", "--threads", os.environ.get("BENCH_THREADS", "auto")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(process.stderr.read().decode()[-2000:])
    return {"tokens": n, "seconds": time.perf_counter() - started, "peak_mib": usage.ru_maxrss / 1024}


def head_size_timing(n: int, heads: int = 9, repeat: int = 5) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of aten's CPU flash attention (causal) on [1, heads, n, d], for d = 64 (SmolLM2's own call),
    72 (a statistics call carrying a 64-wide key and 3 channels, rounded up to a multiple of 8) and 136 (one that
    carries a float32 model's 64-wide values too). Wall and CPU seconds."""
    import statistics

    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    out, cpu = {}, {}
    for d in (64, 72, 136):
        q, k, v = (torch.randn(1, heads, n, d, generator=torch.Generator().manual_seed(s)) for s in range(3))
        flash(q, k, v, 0.0, True, scale=d**-0.5)  # warm-up
        times, cpus = [], []
        for _ in range(repeat):
            started, used = time.perf_counter(), time.process_time()
            flash(q, k, v, 0.0, True, scale=d**-0.5)
            times.append(time.perf_counter() - started)
            cpus.append(time.process_time() - used)
        out[d], cpu[d] = statistics.median(times), statistics.median(cpus)
    return out, cpu


def build_tiny(work: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

    folder = work / "tiny"
    if (folder / "config.json").exists():
        return
    words = ["<s>", "<unk>", *(f"w{i}" for i in range(998))]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40_000,
                         initializer_range=0.2)
    LlamaModel(config).save_pretrained(folder)


def prefix_check(work: Path, n: int) -> tuple[float, int]:
    """Largest difference (relative above 1) of the positions bins inside a prefix: blocked on n tokens vs
    eager on the prefix alone; and the prefix's length (PREFIX, or less for short sequences)."""
    import numpy as np
    import torch

    from attnprobe import kernel
    from attnprobe.metrics import bin_count, sentence_sums
    from attnprobe.model import load_model, stream_attention

    loaded = load_model(str(work / "tiny"), "cpu")
    x = torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    blocked, eager = {}, {}
    with torch.inference_mode(), kernel.statistics_attention(loaded):
        kernel.run_batch(loaded, x, mask, lambda layer, sums, _m: blocked.__setitem__(layer, sums.bin_means()),
                         bins=bin_count(n), sink=4, window=256)
    prefix = min(PREFIX, 1 << ((n // 2).bit_length() - 1))  # a power of two shorter than the sequence
    keep = bin_count(prefix)  # with 2,048: bins 0 .. 11 hold exactly positions 0 .. 2047
    xp, mp = x[:, :prefix], mask[:, :prefix]
    stream_attention(loaded, xp, mp, lambda layer, p: eager.__setitem__(
        layer, sentence_sums(p, mp, True, None, 4, 256, keep).bin_means()))
    worst = 0.0
    for layer, values in eager.items():
        for name, expected in values.items():
            got = blocked[layer][name][..., :keep]
            same_nan = bool((got.isnan() == expected.isnan()).all())
            relative = (got - expected).abs() / expected.abs().clamp(min=1.0)  # distance is in tokens
            worst = max(worst, float(np.nanmax(relative.numpy())) if same_nan else float("inf"))
    return worst, prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("smollm2", "tiny", "zoo", "user", "both"), default="both",
                        help="both: smollm2 and tiny; zoo: the other architectures; user: as a user runs it")
    parser.add_argument("--user-tokens", type=int, default=8000, help="the user part's document length")
    parser.add_argument("--repeat", type=int, default=1, help="the user part: runs of each way, interleaved")
    parser.add_argument("--baseline", type=Path, help="the user part: also run analyze from the attnprobe package in "
                        "this folder (an older checkout), interleaved")
    parser.add_argument("--child-user-floor", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=3600, help="SmolLM2 document length")
    parser.add_argument("--eager", action="store_true", help="also time the eager hook path on SmolLM2 (slow)")
    parser.add_argument("--value-weighted", action="store_true",
                        help="also time blocked and fused with the value-weighted scores on SmolLM2")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="tiny-model lengths")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    parser.add_argument("--threads", type=int, help="torch threads in every child (default: torch's own); on a shared "
                        "machine 1 thread keeps the CPU times comparable")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--how", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.child_user_floor:
        child_user_floor(args.child_user_floor)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="attnprobe-long-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores; work folder {work}")
    measured: dict = {"cores": os.cpu_count(), "load_average": os.getloadavg()[0], "threads": args.threads}
    if args.threads:
        os.environ["BENCH_THREADS"] = str(args.threads)  # the children read it
    if args.part in ("smollm2", "both"):
        ways = ("sdpa", "blocked", "fused", *(("eager",) if args.eager else ()),
                *(("blocked+vw", "fused+vw") if args.value_weighted else ()))
        runs = {how: spawn("smollm2", how, args.tokens, work) for how in ways}
        widths, width_cpu = head_size_timing(args.tokens)
        print(f"aten's CPU flash attention on [1, 9, {args.tokens}, d]: " + ", ".join(
            f"d = {d} {seconds:.2f} s ({width_cpu[d]:.2f} s CPU)" for d, seconds in widths.items()))
        measured["smollm2"] = {"tokens": args.tokens, "runs": runs, "targets": {
            "blocked_time": TARGET_TIME, "blocked_memory": TARGET_MEMORY, "fused_time": TARGET_FUSED_TIME,
            "fused_memory": TARGET_FUSED_MEMORY}, "flash_seconds_by_head_size": widths,
            "flash_cpu_seconds_by_head_size": width_cpu, "flash_tokens": args.tokens}
        print(f"\nSmolLM2-135M, one document of {args.tokens} tokens (forward time; peak RSS of the process)")
        print(f"{'way':<10} {'seconds':>8} {'peak MiB':>9}")
        for how, r in runs.items():
            print(f"{how:<10} {r['seconds']:>8.1f} {r['peak_mib']:>9.0f}")
        for how in ("blocked", "fused"):
            if f"{how}+vw" in runs:
                print(f"{how}+vw / {how}: time {runs[how + '+vw']['seconds'] / runs[how]['seconds']:.2f}, peak memory "
                      f"{runs[how + '+vw']['peak_mib'] / runs[how]['peak_mib']:.2f}")
        t = runs["blocked"]["seconds"] / runs["sdpa"]["seconds"]
        m = runs["blocked"]["peak_mib"] / runs["sdpa"]["peak_mib"]
        print(f"blocked / sdpa: time {t:.2f} (target <= {TARGET_TIME}: {'met' if t <= TARGET_TIME else 'MISSED'}), "
              f"peak memory {m:.2f} (target <= {TARGET_MEMORY}: {'met' if m <= TARGET_MEMORY else 'MISSED'})")
        t = runs["fused"]["seconds"] / runs["sdpa"]["seconds"]
        m = runs["fused"]["peak_mib"] / runs["sdpa"]["peak_mib"]
        print(f"fused / sdpa: time {t:.2f} (target <= {TARGET_FUSED_TIME}: "
              f"{'met' if t <= TARGET_FUSED_TIME else 'MISSED'}), peak memory {m:.2f} (target <= "
              f"{TARGET_FUSED_MEMORY}: {'met' if m <= TARGET_FUSED_MEMORY else 'MISSED'})")
    if args.part == "zoo":
        measured["zoo"] = zoo(work, [int(n) for n in args.lengths.split(",")])
    if args.part == "user":
        measured["user"] = user_part(work, args.user_tokens, args.repeat, args.baseline)
    if args.part in ("tiny", "both"):
        build_tiny(work)
        lengths = [int(n) for n in args.lengths.split(",")]
        print("\nTiny Llama (4 layers x 4 heads, 2 KV heads), one random sequence, blocked statistics attention")
        print(f"{'tokens':>7} {'seconds':>8} {'peak MiB':>9} {'one eager map, GiB':>19}")
        measured["tiny"] = {"runs": {}}
        for n in lengths:
            r = spawn("tiny", "blocked", n, work)
            measured["tiny"]["runs"][n] = r
            eager_map = 4 * n * n * 4 / 2**30  # [head, n, n] float32, one layer
            print(f"{n:>7} {r['seconds']:>8.1f} {r['peak_mib']:>9.0f} {eager_map:>19.2f}")
        n = max(lengths)
        worst, prefix = prefix_check(work, n)
        measured["tiny"]["prefix_check"] = {"max_diff": worst, "prefix": prefix, "tokens": n}
        print(f"\npositions bins inside the first {prefix} tokens, blocked on {n} tokens vs eager on the prefix: "
              f"max diff {worst:.2g} (relative above 1)")
        whole = measured["tiny"]["process"] = whole_process(work, n)
        print(f"the whole `attnprobe analyze --split file` process on {n} tokens: {whole['seconds']:.1f} s, "
              f"peak RSS {whole['peak_mib']:.0f} MiB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
