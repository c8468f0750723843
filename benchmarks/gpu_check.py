"""`make gpu-check`: what a lent GPU machine runs for attnprobe, in one command of at most 9 minutes.

Run:  make gpu-check                    (on the lent machine; results in $OUT, else outputs/gpu-check/)
      make gpu-check DRY=1              (here, on CPU, in CI-sized time: proves the script itself works)
      python3 benchmarks/gpu_check.py [--dry] [--out FOLDER] [--budget SECONDS] [--steps tests,bench,e2e,train,torchrun]

Steps, each in a process of its own with a time limit (a step that fails or runs out of time is recorded and the
next one runs; a step that no longer fits the --budget is skipped, and the JSON and the last line say so), and one
JSON of results, FOLDER/gpu-check.json, rewritten after every step (a stopped run keeps what it measured), with
every step's output in FOLDER/gpu-check.log:
  environment - the GPU (torch.cuda.get_device_name), torch, CUDA, transformers and Python versions;
  install     - the wheels carried in .whl/ (git-ignored: what the machine lacks) into a folder on PYTHONPATH, then
                `pip install --no-deps --no-build-isolation --no-index -e .` (the machine has no internet; the dry
                run adds --dry-run), then a check that every module the steps import is there: a missing one stops
                the run with one line naming the wheel to carry and the `pip download` line that fetches it;
  tests       - `pytest -m "cuda or triton" tests/test_gpu.py tests/test_train_pattern.py tests/test_triton.py`:
                the real CUDA kernel against the stand-in and a float64 softmax, fused = blocked = eager on the zoo's
                gpt2, llama, qwen2, mistral and bert in float32 and bfloat16, the compiled Triton kernel against a
                float64 map and triton = blocked on the same families and gemma2, no [n, n] map, auto taking the
                Triton path, train-pattern on the GPU in bfloat16 (all skipped on CPU; the dry run runs `-m cuda`
                only, the Triton tests run under the interpreter in the ordinary suite);
  bench       - what users run, on a random model of Llama-3.2-1B's published shape (hidden 2048, 16 layers, 32
                heads, 8 KV heads, intermediate 8192, vocabulary 128256, RoPE theta 500000 with llama3 scaling) in
                bfloat16, base model (no LM head): the short sentences at a GPU batch size (SHORT: 1,024 sentences of
                8-40 tokens in right-padded batches of 64) and one sequence of each of LENGTHS (4,096 and 32,768
                tokens). The ways: `sdpa` (the model's SDPA forward, the floor, restricted to the flash, efficient and
                cuDNN kernels so that a fallback to the math kernel fails instead of being timed; `flash_attention_2`
                too where the flash_attn package is installed), and attnprobe's statistics through its public entry
                (kernel.run_batch) with what `attnprobe analyze` passes it by default (Ways: a special token first,
                the token classes, the received mass read for top_tokens.csv, the position bins, the rows kept for
                the block bootstrap of one document): `triton` and `triton+vw` (the Triton path, `auto`'s on CUDA,
                without and with the value-weighted scores), `fused`, `fused+vw` and `blocked` (block budget
                BLOCKED_MIB; at the shortest length and on the short sentences only). Each way is run once to warm it
                at the same shape (every batch of the short sentences: each shape compiled, cuDNN's graphs built),
                then timed REPS times (CUDA-synchronized): its time is the median; fused and fused+vw at the longest
                length once after their warm-up at the shortest (context: they have no target). Peak GPU memory
                (torch.cuda.max_memory_allocated) over the timed runs, the weights included and above them. The
                bench also saves the model as a checkpoint for the next step. The dry run's Triton ways (Triton's
                interpreter) run at its shortest length only;
  e2e         - `attnprobe analyze --device cuda` with every default on one document of E2E_TOKENS tokens (words of
                the benchmark's tokenizer, one token each, after a BOS) against the bare forward of the same tokens
                (attnprobe's loader and tokenization, the model's SDPA forward), each a whole process timed from
                start to exit, in turn E2E_REPEAT times: analyze's fastest over the floor's fastest;
  train       - `attnprobe train-pattern`'s optimization (trainpattern.train_pattern_loaded) on the same model in
                bfloat16: TRAIN_STEPS steps on samples of TRAIN_LENGTH random tokens whose last TRAIN_TAIL repeat
                tokens from a quarter of the way in (the loss is taken on them), sink 128 + recent 256, block
                budget BLOCKED_MIB; seconds per step and peak GPU memory, the distillation loss and the gates;
  torchrun    - `torchrun --standalone --nproc-per-node 1` of a process-group check (NCCL on the GPU: all_reduce and
                barrier) and of `attnprobe analyze` on a tiny zoo Llama on the GPU.
The JSON's `targets.triton` says whether each target of the Triton path (TRITON_TARGETS, analyze's default
statistics: within 1.5x of the SDPA forward's time at 32,768 tokens and 1.3x at 4,096, with the value-weighted scores
2.0x at 32,768, short sentences 1.3x, peak memory 1.1x at 32,768, the end-to-end analyze 1.5x of the bare forward's
process) was met: `<name>_ratio`, `_target`, `_met`, and `summary`, each in words with its number; `targets` also
keeps the fused path's (TARGET_TIME, TARGET_MEMORY at the longest length, fused = eager to bfloat16's tolerance).

Budget: BUDGET_S = 540 s (the device tool's 10 minutes less a margin). The H200 of 2026-12-04 took 5 s to install
and 139 s for the tests; the rest is estimated from its timings (bench ~150 s with the kernel of then, e2e ~90 s,
train and torchrun ~40 s each). STEP_S caps each step, STEP_MIN_S is what a step needs to be started. The bench
measures the long lengths first, so that a bench out of time keeps the targets at 32k.

The dry run (--dry): the same steps on CPU with a tiny model of the same kind (2 layers, 4 heads of 16), lengths
of 64 and 256 tokens, 8 short sentences, a 256-token document, DRY_TRAIN_LENGTH-token training samples, 16 corpus
sentences under torchrun, gloo instead of NCCL; its numbers are not GPU figures (`dry: true`, and the targets are
not judged).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"  # git-ignored: wheels carried to a machine that lacks them
SITE = Path(tempfile.gettempdir()) / "attnprobe-gpu-check-site"  # where carried wheels are unpacked
BUDGET_S = 540  # the whole command, at most (the device tool allows 10 minutes a command)
STEP_S = {"install": 60, "tests": 170, "bench": 190, "e2e": 110, "train": 50, "torchrun": 60}  # each step's limit,
# within what remains
STEP_MIN_S = {"tests": 60, "bench": 60, "e2e": 45, "train": 25, "torchrun": 20}  # with less left, a step is skipped
TARGET_TIME = 1.5  # fused bfloat16 statistics / SDPA forward, time at the longest length, at most
TARGET_MEMORY = 1.1  # the same, peak GPU memory, at most
LENGTHS = (4096, 32768)
# The Triton path's targets, analyze's default statistics: name -> (where: the shortest or longest length, the short
# sentences or the end-to-end run; the way; the measure; at most)
TRITON_TARGETS = {
    "time_longest": ("longest", "triton", "seconds", 1.5),
    "time_shortest": ("shortest", "triton", "seconds", 1.3),
    "time_vw_longest": ("longest", "triton+vw", "seconds", 2.0),
    "memory_longest": ("longest", "triton", "peak_mib", 1.1),
    "time_short": ("short", "triton", "seconds", 1.3),
    "end_to_end": ("e2e", "analyze", "seconds", 1.5),
}
REPS = 3  # timed runs of each way after its warm-up at the same shape: the median is its time
DRY_LENGTHS = (64, 256)
SHORT = (1024, 64, 8, 40)  # sentences, batch size, shortest and longest (tokens)
DRY_SHORT = (8, 4, 8, 40)
E2E_TOKENS, DRY_E2E_TOKENS = 32768, 256  # the end-to-end document
E2E_REPEAT, DRY_E2E_REPEAT = 2, 1  # floor and analyze processes, in turn
E2E_MODEL = "e2e-model"  # the folder (in the check's work folder) of the end-to-end run's checkpoint
BOS, WORDS = "<|begin_of_text|>", 61  # the benchmark tokenizer's BOS and its words (w0 ... w60)
BLOCKED_MIB = 1024  # the blocked path's block budget on the GPU (the CPU default, 64 MiB, makes blocks of 2 rows)
SINK, WINDOW = 4, 256  # attnprobe's defaults
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "accelerate", "numpy", "pandas",
          "pyarrow", "scipy", "matplotlib", "typer", "rich", "pytest")
STEPS = ("tests", "bench", "e2e", "train", "torchrun")  # after environment and install, which always run (--steps
# picks)
TRAIN_LENGTH, TRAIN_TAIL, TRAIN_STEPS = 8192, 256, 5  # train: tokens per sample, of them supervised, steps
DRY_TRAIN_LENGTH = 512
TRAIN_SINK, TRAIN_RECENT = 128, 256  # DuoAttention's
DISTRIBUTIONS = {"pyarrow": "pyarrow", "pytest": "pytest iniconfig pluggy"}  # module -> what to download
DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "
            "-d .whl {names}")

# Llama-3.2-1B's published shape (config.json of meta-llama/Llama-3.2-1B), with random weights.
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 64, "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
TINY = {**LLAMA_1B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "head_dim": 16}


# ---- the parent: steps, limits, the JSON ---------------------------------------------------------------------------


class Report:
    """gpu-check.json and gpu-check.log in `folder`; the JSON is rewritten (temp file + rename) after every step."""

    def __init__(self, folder: Path, dry: bool):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self.log = folder / "gpu-check.json", folder / "gpu-check.log"
        self.log.write_text("", encoding="utf-8")
        self.data: dict = {"dry": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}

    def save(self) -> None:
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str) + "\n", encoding="utf-8")
        temporary.replace(self.path)

    def write_log(self, title: str, text: str) -> None:
        with self.log.open("a", encoding="utf-8") as log:
            log.write(f"==== {title}\n{text}\n")


def child_env(extra_paths: list[str]) -> dict[str, str]:
    """The steps' environment: the checkout (and any carried wheels) first on PYTHONPATH, offline, unbuffered."""
    paths = [*extra_paths, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


def run(report: Report, title: str, argv: list[str], timeout: float, env: dict[str, str]) -> dict:
    """One process, its output to the log; what the JSON keeps of it."""
    shown = " ".join(a.replace(sys.executable, "python") for a in argv)
    print(f"  $ {shown}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        code, out, timed_out = done.returncode, done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as err:
        code, timed_out = None, True
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (err.stdout,
                                                                                                  err.stderr))
    seconds = round(time.perf_counter() - started, 1)
    report.write_log(f"{title}: {shown} (exit {code}, {seconds} s{', out of time' if timed_out else ''})", out)
    return {"command": shown, "returncode": code, "timed_out": timed_out, "seconds": seconds, "tail": out[-2000:]}


def missing_modules(names: tuple[str, ...] = NEEDED) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def wheel_hint(missing: list[str]) -> str:
    """One line: what is missing and how to bring it (docs/development.md#gpu-check)."""
    names = " ".join(DISTRIBUTIONS.get(name, name) for name in missing)
    return (f"missing on this machine: {', '.join(missing)}; no wheel of it in .whl/: on a machine with pip run `"
            + DOWNLOAD.format(names=names) + "` in the checkout (and `echo /.whl/ >> .git/info/exclude`), then "
            "carry .whl")


def install(report: Report, args: argparse.Namespace, budget: float) -> list[str]:
    """The carried wheels and the project; the extra PYTHONPATH entries the steps need."""
    step: dict = {}
    extra: list[str] = []
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if wheels:
        step["wheels"] = [Path(w).name for w in wheels]
        step["unpack"] = run(report, "wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                                "--no-deps", "--no-compile", "--upgrade", "--target", str(SITE),
                                                *wheels], budget, child_env([]))
        extra.append(str(SITE))
        sys.path.insert(0, str(SITE))
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               *(["--dry-run"] if args.dry else []), "-e", "."]
    step["project"] = run(report, "install", command, budget, child_env(extra))
    importlib.invalidate_caches()
    missing = missing_modules()
    step["missing"] = missing
    step["ok"] = step["project"]["returncode"] == 0 and not missing
    if step["project"]["returncode"] != 0:
        step["note"] = "the steps import the checkout through PYTHONPATH all the same"
    report.data["steps"]["install"] = step
    report.save()
    if missing:
        report.data["error"] = wheel_hint(missing)
        report.save()
        raise SystemExit(f"gpu-check: {report.data['error']}")
    return extra


def environment(dry: bool) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    found = {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
             "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
             "flash_attn": importlib.util.find_spec("flash_attn") is not None}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        found.update({"gpu_memory_mib": props.total_memory // 2**20, "capability": f"{props.major}.{props.minor}",
                      "gpus": torch.cuda.device_count()})
    if not dry and not cuda:
        raise SystemExit("gpu-check: torch sees no CUDA GPU here: run `make gpu-check DRY=1` for the CPU dry run")
    return found


def pytest_outcomes(text: str) -> dict:
    """Each test's outcome from pytest's -rA summary lines, and the totals."""
    outcomes = {}
    for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", text, re.MULTILINE):
        outcomes[test] = outcome
    counts = {}
    for outcome in outcomes.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    skipped = re.search(r"(\d+) skipped", text)  # -rA reports skips grouped by reason
    if skipped:
        counts["skipped"] = int(skipped.group(1))
    return {"counts": counts, "outcomes": {t: o for t, o in outcomes.items() if o != "SKIPPED"}}


def targets(report: dict) -> dict:
    """The targets from the results, met or missed, with the numbers (None where not measured): the fused path's
    (TARGET_TIME, TARGET_MEMORY, fused = eager in bfloat16) and, under `triton`, the Triton path's (triton_targets)."""
    long_runs = report.get("steps", {}).get("bench", {}).get("long", {})
    lengths = sorted(int(n) for n, ways in long_runs.items() if "seconds" in ways.get("sdpa", {})
                     and "seconds" in ways.get("fused", {}))
    found: dict = {"time_target": TARGET_TIME, "memory_target": TARGET_MEMORY, "tokens": None,
                   "fused_time_ratio": None, "time_met": None, "fused_memory_ratio": None, "memory_met": None}
    if lengths:
        n = lengths[-1]
        sdpa, fused = long_runs[str(n)]["sdpa"], long_runs[str(n)]["fused"]
        found.update(tokens=n, fused_time_ratio=round(fused["seconds"] / sdpa["seconds"], 3))
        found["time_met"] = found["fused_time_ratio"] <= TARGET_TIME
        if sdpa.get("peak_mib") and fused.get("peak_mib"):
            found["fused_memory_ratio"] = round(fused["peak_mib"] / sdpa["peak_mib"], 3)
            found["memory_met"] = found["fused_memory_ratio"] <= TARGET_MEMORY
    outcomes = report.get("steps", {}).get("tests", {}).get("outcomes", {})
    bf16 = {t: o for t, o in outcomes.items() if "fused_equals_blocked_equals_eager" in t and "bfloat16" in t}
    found["fused_equals_eager_bfloat16"] = {"tests": len(bf16), "passed": sum(o == "PASSED" for o in bf16.values()),
                                            "met": (all(o == "PASSED" for o in bf16.values()) if bf16 else None)}
    found["triton"] = triton_targets(report)
    found["ratios"] = ratios(report)
    if report.get("dry"):  # a tiny model on CPU says nothing of a GPU: the ratios are kept, nothing is judged
        found.update(time_met=None, memory_met=None, judged=False, note="dry run on CPU: not GPU figures")
        found["triton"].update({key: None for key in found["triton"] if key.endswith("_met")})
        for line in found["triton"]["summary"]:
            line["met"] = None
    else:
        found["judged"] = True
    return found


def ratios(report: dict) -> dict:
    """Every way's time and peak GPU memory over the SDPA forward's, per length and on the short sentences
    (None where either is missing)."""
    bench = report.get("steps", {}).get("bench", {})
    places = {**{f"{n} tokens": ways for n, ways in (bench.get("long") or {}).items()},
              "short": (bench.get("short") or {}).get("runs") or {}}
    found: dict = {}
    for where, ways in places.items():
        floor = ways.get("sdpa") or {}
        found[where] = {way: {measure: round(run[key] / floor[key], 3) if run.get(key) and floor.get(key) else None
                              for measure, key in (("time", "seconds"), ("memory", "peak_mib"))}
                        for way, run in ways.items() if way != "sdpa"}
    return found


DESCRIBED = {  # TRITON_TARGETS's names, as the summary says them
    "time_longest": "analyze's default statistics (Triton path) / the SDPA forward, time at {longest} tokens",
    "time_shortest": "analyze's default statistics (Triton path) / the SDPA forward, time at {shortest} tokens",
    "time_vw_longest": "with the value-weighted scores / the SDPA forward, time at {longest} tokens",
    "memory_longest": "analyze's default statistics (Triton path) / the SDPA forward, peak GPU memory at {longest} "
                      "tokens",
    "time_short": "short sentences ({sentences} in batches of {batch_size}), analyze's default statistics (Triton "
                  "path) / the SDPA forward of the same batches, time",
    "end_to_end": "`attnprobe analyze` process / the bare forward's process, {tokens} tokens, wall time",
}


def triton_targets(report: dict) -> dict:
    """The Triton path's targets (TRITON_TARGETS: way / SDPA forward, time or peak memory, at most; analyze's process
    / the floor's): per name its `<name>_ratio`, `<name>_target` and `<name>_met` (None where not measured), and
    `summary`, the same as a list of {target, measured, at_most, met} in words."""
    steps = report.get("steps", {})
    bench = steps.get("bench", {})
    long_runs, short = bench.get("long", {}), (bench.get("short") or {}).get("runs", {})
    lengths = sorted(int(n) for n in long_runs)
    e2e = steps.get("e2e") or {}
    found: dict = {"summary": []}
    for key, (where, way, measure, target) in TRITON_TARGETS.items():
        if where == "e2e":
            ratio = e2e.get("ratio")
        else:
            runs = short if where == "short" else long_runs.get(str(lengths[0 if where == "shortest" else -1]), {}) \
                if lengths else {}
            mine, floor = runs.get(way, {}).get(measure), runs.get("sdpa", {}).get(measure)
            ratio = round(mine / floor, 3) if mine and floor else None
        met = None if ratio is None else ratio <= target
        found.update({f"{key}_ratio": ratio, f"{key}_target": target, f"{key}_met": met})
        said = DESCRIBED[key].format(longest=f"{lengths[-1]:,}" if lengths else "-",
                                     shortest=f"{lengths[0]:,}" if lengths else "-",
                                     sentences=(bench.get("short") or {}).get("sentences", "-"),
                                     batch_size=(bench.get("short") or {}).get("batch_size", "-"),
                                     tokens=f"{e2e['tokens']:,}" if e2e.get("tokens") else "-")
        found["summary"].append({"name": key, "target": said, "measured": ratio, "at_most": target, "met": met})
    return found


def skip_reason(step: str, seconds_left: float, budget: float) -> str | None:
    """Why `step` is not started (one line), or None: fewer seconds left of the --budget than it needs."""
    if seconds_left >= STEP_MIN_S[step]:
        return None
    return (f"skipped: {max(seconds_left, 0):.0f} s left of --budget {budget:.0f} s, and {step} needs at least "
            f"{STEP_MIN_S[step]} s (rerun it alone: make gpu-check STEPS={step})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the CPU dry run: tiny shapes, gloo, cuda tests skipped")
    parser.add_argument("--out", type=Path, default=None,
                        help="where gpu-check.json goes ($OUT, else outputs/gpu-check)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds for the whole check: a step that no longer fits is skipped, and the JSON says so")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps to run after install (a rerun of some): {', '.join(STEPS)}")
    parser.add_argument("--child", choices=("bench", "group", "train", "save", "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    children = {"bench": bench, "train": train, "save": save_checkpoint, "floor": floor_process}
    if args.child == "group":
        return group(args.json)
    if args.child:
        return children[args.child](args.dry, args.json)
    chosen = [step for step in args.steps.split(",") if step]
    if not chosen or set(chosen) - set(STEPS):
        parser.error(f"--steps: choose among {', '.join(STEPS)}")
    folder = args.out or Path(os.environ.get("OUT") or ROOT / "outputs" / "gpu-check")
    report = Report(folder.resolve(), args.dry)
    deadline = time.perf_counter() + args.budget

    def left(step: str) -> float:
        return min(STEP_S[step], deadline - time.perf_counter())

    print(f"gpu-check{' (dry run, CPU)' if args.dry else ''}: results in {report.path}", flush=True)
    report.data["environment"] = environment(args.dry)
    report.save()
    print(f"  {report.data['environment']}", flush=True)
    extra = install(report, args, left("install"))
    env = child_env(extra)
    if args.dry:  # the Triton path's ways run in Triton's interpreter on a CPU
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for step in chosen:
            why = skip_reason(step, deadline - time.perf_counter(), args.budget)
            if why is not None:
                print(f"gpu-check: {step} {why}", flush=True)
                report.data["steps"][step] = {"skipped": why, "ok": None}
                report.data.setdefault("skipped", []).append(step)
            else:
                report.data["steps"][step] = STEP_RUNS[step](report, args.dry, Path(work), left, env)
            report.data["targets"] = targets(report.data)
            report.save()
    report.data["seconds"] = round(args.budget - (deadline - time.perf_counter()), 1)
    failed = [name for name, step in report.data["steps"].items() if step.get("ok") is False]
    report.data["ok"] = not failed
    report.save()
    skipped = report.data.get("skipped")
    print(f"gpu-check: {'every step run passed' if not failed else 'failed: ' + ', '.join(failed)}"
          f"{'; skipped (out of budget): ' + ', '.join(skipped) if skipped else ''}; targets "
          f"{json.dumps(report.data['targets'].get('triton', {}).get('summary'))}; {report.path}", flush=True)
    return 0 if not failed else 1


def run_tests(report: Report, dry: bool, work: Path, left, env: dict[str, str]) -> dict:
    """The tests marked cuda and triton (the dry run: cuda, every one skipped on a CPU)."""
    tests = run(report, "tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda" if dry else "cuda or triton",
                                  "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py", "tests/test_train_pattern.py",
                                  "tests/test_triton.py"], left("tests"), env)
    tests.update(pytest_outcomes(tests["tail"] if tests["timed_out"] else _full_log(report, "tests")))
    tests["ok"] = tests["returncode"] == 0
    return tests


def run_child(name: str):
    """A step that is one child process of this script writing a JSON (bench, train): its run and its results."""

    def step(report: Report, dry: bool, work: Path, left, env: dict[str, str]) -> dict:
        results = work / f"{name}.json"
        done = run(report, name, [sys.executable, __file__, "--child", name, "--json", str(results),
                                  *(["--dry"] if dry else [])], left(name), env)
        found = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else {}
        ok = done["returncode"] == 0 and (name != "train" or found.get("steps_done") == found.get("steps"))
        return {**done, **found, "ok": ok}

    return step


def _full_log(report: Report, title: str) -> str:
    """The last block of the log that `title` wrote (the whole output, where the JSON keeps its tail)."""
    text = report.log.read_text(encoding="utf-8")
    start = text.rfind(f"==== {title}: ")
    return text[start:] if start >= 0 else ""


def torchrun(report: Report, dry: bool, work: Path, left, env: dict[str, str]) -> dict:
    """The process-group check and `attnprobe analyze` under `torchrun --nproc-per-node 1`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import make  # the tiny zoo Llama, saved like a user's checkpoint

    model = make("llama", work / "llama")
    ends = time.perf_counter() + left("torchrun")  # the step's two processes share its limit

    def remaining() -> float:
        return ends - time.perf_counter()

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    checked = work / "group.json"
    step = {"group": run(report, "torchrun group", [*launch, __file__, "--child", "group", "--json", str(checked)],
                         remaining(), env)}
    step["group"].update(json.loads(checked.read_text(encoding="utf-8")) if checked.is_file() else {})
    out = work / "analyze"
    step["analyze"] = run(report, "torchrun analyze", [
        *launch, "-m", "attnprobe", "analyze", "--model", str(model), "--corpus", "corpora/sentences.txt", "--out",
        str(out), "--device", "cpu" if dry else "cuda", "--dtype", "float32" if dry else "bfloat16", "--resamples",
        "20", *(["--limit", "16"] if dry else [])], remaining(), env)
    record = out / "run.json"
    if record.is_file():
        found = json.loads(record.read_text(encoding="utf-8"))
        step["analyze"].update(world_size=found["distributed"]["world_size"], path=found["attention"]["path"],
                               device=found.get("device"))
    step["ok"] = step["group"]["returncode"] == 0 and bool(step["group"].get("all_reduce_ok")) and \
        step["analyze"]["returncode"] == 0 and record.is_file()
    return step


def end_to_end(report: Report, dry: bool, work: Path, left, env: dict[str, str]) -> dict:
    """`attnprobe analyze` as a user runs it (every default, --device cuda) on one document of E2E_TOKENS tokens of
    the benchmark's model saved as a checkpoint, against the bare forward of the same tokens (attnprobe's loader,
    SDPA, one forward), each a process of its own, timed whole (start, imports, load, forward, what follows), in
    turn E2E_REPEAT times; `ratio`: analyze's fastest over the floor's fastest."""
    folder, document = work / E2E_MODEL, work / "e2e-document.txt"
    ends = time.perf_counter() + left("e2e")  # the step's processes share its limit

    def remaining() -> float:
        return ends - time.perf_counter()

    step: dict = {"tokens": DRY_E2E_TOKENS if dry else E2E_TOKENS, "runs": {"floor": [], "analyze": []}}
    if not (folder / "config.json").is_file():  # the bench step saved it, unless it did not run
        step["save"] = run(report, "e2e save", [sys.executable, __file__, "--child", "save", "--json", str(folder),
                                                *(["--dry"] if dry else [])], remaining(), env)
        if step["save"]["returncode"] != 0:
            return {**step, "ok": False}
    device = "cpu" if dry else "cuda"
    for turn in range(DRY_E2E_REPEAT if dry else E2E_REPEAT):
        out = work / f"e2e-analyze-{turn}"  # a folder of its own: analyze would take a full one for a resume
        commands = {
            "floor": [sys.executable, __file__, "--child", "floor", "--json", str(folder), *(["--dry"] if dry else [])],
            "analyze": [sys.executable, "-m", "attnprobe", "analyze", "--model", str(folder), "--corpus",
                        str(document), "--split", "file", "--out", str(out), "--device", device],
        }
        for way, command in commands.items():
            if remaining() < 5:
                step["out_of_time"] = True
                break
            done = run(report, f"e2e {way}", command, remaining(), env)
            kept = {k: done[k] for k in ("seconds", "returncode", "timed_out")}
            record = out / "run.json"
            if way == "analyze" and done["returncode"] == 0 and record.is_file():
                found = json.loads(record.read_text(encoding="utf-8"))
                kept.update(tokens=found.get("tokens"), path=found["attention"]["path"],
                            sequences=found["attention"].get("sequences"))
            elif done["returncode"] != 0:
                kept["tail"] = done["tail"][-600:]
            step["runs"][way].append(kept)
    fastest = {way: min((r["seconds"] for r in runs if r["returncode"] == 0), default=None)
               for way, runs in step["runs"].items()}
    step["seconds"] = fastest
    step["ratio"] = round(fastest["analyze"] / fastest["floor"], 3) if all(fastest.values()) else None
    step["ok"] = all(r["returncode"] == 0 for runs in step["runs"].values() for r in runs) and \
        all(len(runs) > 0 for runs in step["runs"].values())
    return step


def save_checkpoint(dry: bool, folder: Path, loaded=None) -> int:
    """The end-to-end run's inputs: the benchmark's model (`loaded`, else built) and tokenizer saved as a checkpoint
    in `folder`, and its document beside it (random words of the tokenizer, one token each, after the BOS)."""
    loaded = loaded or build_model(dry)[0]
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    rng = random.Random(0)
    tokens = DRY_E2E_TOKENS if dry else E2E_TOKENS
    words = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(tokens - 1))  # and the BOS
    (folder.parent / "e2e-document.txt").write_text(words + "\n", encoding="utf-8")
    return 0


def floor_process(dry: bool, folder: Path) -> int:
    """The end-to-end run's floor, as a user would write it: attnprobe's loader, its tokenization of the document,
    one SDPA forward of the base model, nothing kept."""
    import torch

    from attnprobe.model import load_model
    from attnprobe.tokens import encode

    loaded = load_model(str(folder), "cpu" if dry else "cuda")
    loaded.model.set_attn_implementation("sdpa")
    text = (folder.parent / "e2e-document.txt").read_text(encoding="utf-8")
    ids = torch.tensor([encode(loaded, text)["input_ids"]], device=loaded.device)  # [1, seq]
    with torch.inference_mode():
        loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    if not dry:
        torch.cuda.synchronize()
    return 0



STEP_RUNS = {"tests": run_tests, "bench": run_child("bench"), "e2e": end_to_end, "train": run_child("train"),
             "torchrun": torchrun}


# ---- the children --------------------------------------------------------------------------------------------------


def group(into: Path) -> int:
    """Under torchrun: join the process group (NCCL on a GPU, gloo on CPU), all_reduce and barrier."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group(backend=backend)
    value = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(value)
    dist.barrier()
    dist.destroy_process_group()
    expected = size * (size + 1) / 2
    into.write_text(json.dumps({"backend": backend, "world_size": size, "all_reduce_ok": bool(
        (value == expected).all()), "group_seconds": round(time.perf_counter() - started, 2)}), encoding="utf-8")
    return 0


def build_model(dry: bool):
    """The benchmark's model: Llama-3.2-1B's shape (TINY for the dry run), random weights, bfloat16, eager; as a
    LoadedModel, with a word-level tokenizer that adds a BOS as Llama's does (the benchmark feeds random ids; the
    end-to-end run's document is words of it, one token each)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from attnprobe.model import from_transformers

    shape = TINY if dry else LLAMA_1B
    config = transformers.LlamaConfig(**shape, rope_parameters=dict(ROPE))
    if (getattr(config, "rope_parameters", None) or {}).get("rope_type") != "llama3":  # a transformers that reads
        config = transformers.LlamaConfig(**shape, rope_theta=ROPE["rope_theta"],  # the older fields
                                          rope_scaling={k: v for k, v in ROPE.items() if k != "rope_theta"})
    device = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaModel._from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    words = ["<|endoftext|>", "<unk>", BOS, *(f"w{i}" for i in range(WORDS))]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # one token per word of the end-to-end document
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 2)])  # as Llama's
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>",
                                        bos_token=BOS)
    return from_transformers(model, tokenizer, spec="Llama-3.2-1B shape, random weights"), config


def bench(dry: bool, into: Path) -> int:
    """The short and long benchmarks (module docstring), written to `into` after every measurement."""
    import torch

    from attnprobe import planning
    from attnprobe.kernel import triton_path

    cuda = not dry
    found: dict = {"dtype": "bfloat16", "block_mib": BLOCKED_MIB if cuda else None, "sink": SINK, "window": WINDOW,
                   "reps": REPS, "short": {}, "long": {}}

    def save() -> None:
        temporary = into.with_suffix(".tmp")
        temporary.write_text(json.dumps(found), encoding="utf-8")
        temporary.replace(into)

    started = time.perf_counter()
    loaded, config = build_model(dry)
    found["model"] = {"shape": {k: v for k, v in (TINY if dry else LLAMA_1B).items()},
                      "rope": dict(getattr(config, "rope_parameters", None) or {}),
                      "parameters": sum(p.numel() for p in loaded.model.parameters()),
                      "built_seconds": round(time.perf_counter() - started, 1)}
    found["auto_path"] = planning.attention_path(loaded, "auto")  # what analyze's --attention auto takes here
    save_checkpoint(dry, into.parent / E2E_MODEL, loaded)  # the e2e step's, while the model is here
    save()
    way = Ways(loaded, cuda, found)
    found["features"] = way.features
    triton_ways = ["triton", "triton+vw"] if triton_path.unavailable(loaded.device) is None else []
    if not triton_ways:
        found["triton"] = triton_path.unavailable(loaded.device)
    ways = ["sdpa", *(["flash_attention_2"] if cuda and importlib.util.find_spec("flash_attn") else []), *triton_ways,
            "fused", "fused+vw", "blocked"]
    found["ways"] = ways
    generator = torch.Generator().manual_seed(0)

    def ids(batch: int, n: int):
        return torch.randint(3, config.vocab_size, (batch, n), generator=generator).to(loaded.device)  # [batch, seq]

    lengths = DRY_LENGTHS if dry else LENGTHS
    for n in lengths:
        x = ids(1, n)
        mask = torch.ones_like(x)
        found["long"][str(n)] = {}
        for name in ways:
            if name in triton_ways and dry and n != lengths[0]:
                continue  # the interpreter: the shortest length only
            if name == "blocked" and n != lengths[0]:
                continue  # minutes at 32k on a GPU, and no target of its own
            context = name.startswith(("fused", "blocked")) and n != lengths[0] and not dry  # a single run
            found["long"][str(n)][name] = timed(lambda name=name, x=x, mask=mask: way(name, x, mask, True), cuda,
                                                1 if context else REPS, warm=not context)
            save()
    short_batches = short_sentences(ids, loaded.device, DRY_SHORT if dry else SHORT)
    sentences, batch_size, _, _ = DRY_SHORT if dry else SHORT
    found["short"] = {"sentences": sentences, "batch_size": batch_size,
                      "tokens": int(sum(int(m.sum()) for _, m in short_batches)), "runs": {}}
    for name in ways:  # every way warmed on all the batches (each shape compiled, cuDNN's graphs built), then timed
        if dry and name in triton_ways:
            continue  # Triton's interpreter: seconds per batch on a CPU
        found["short"]["runs"][name] = timed(lambda name=name: [way(name, x, m, False) for x, m in short_batches],
                                             cuda, REPS)
        save()
    found["seconds"] = round(time.perf_counter() - started, 1)
    save()
    return 0


def short_sentences(ids, device, short: tuple[int, int, int, int]) -> list:
    """The short benchmark's right-padded batches [(ids [batch, seq], mask [batch, seq])], sorted by length as
    analyze sorts them."""
    import torch

    sentences, batch_size, shortest, longest = short
    rng = random.Random(0)
    lengths = sorted(rng.randint(shortest, longest) for _ in range(sentences))
    batches = []
    for first in range(0, sentences, batch_size):
        chunk = lengths[first : first + batch_size]
        x, mask = ids(len(chunk), max(chunk)), torch.zeros(len(chunk), max(chunk), dtype=torch.long, device=device)
        for row, n in enumerate(chunk):
            mask[row, :n] = 1  # right padding
        batches.append((x, mask))
    return batches


class Ways:
    """The benchmark's ways on one model: `sdpa` (and `flash_attention_2`), the model's own forward, the floor; and
    triton, fused, blocked (+vw: with the value-weighted scores) through attnprobe's public entry, kernel.run_batch,
    with what `attnprobe analyze` passes it by default: a special token first (a BOS), the token classes
    (punctuation, same-token keys), the position bins, sink and window, the rows kept for the block bootstrap of a
    single document (`keep_rows`), and a callback that reads what analyze's reads (the received mass for
    top_tokens.csv, the means and binned means). The kernel, old or new, is reached only through run_batch."""

    def __init__(self, loaded, cuda: bool, found: dict):
        from attnprobe import kernel, values
        from attnprobe.model import attention_modules

        self.loaded, self.cuda, self.found = loaded, cuda, found
        modules = [module for module, _ in attention_modules(loaded.model)]
        self.projections = values.find_projections(loaded.model, modules, loaded.num_heads)[0]
        self.backends = sdpa_backends(cuda)
        found["sdpa_backends"] = [b.name for b in self.backends] if self.backends else "default"
        self.budget = BLOCKED_MIB if cuda else kernel.DEFAULT_BUDGET_MIB
        found["block_mib"] = self.budget
        self.features = ["special token first", "punctuation (one id in ten)", "duplicate tokens",
                         "received mass read (top_tokens.csv)", "position bins", f"sink {SINK}", f"window {WINDOW}",
                         "rows kept for the block bootstrap (one document)"]

    def __call__(self, name: str, x, mask, keep_rows: bool) -> None:
        import torch

        with torch.inference_mode():
            if name in ("sdpa", "flash_attention_2"):
                self.loaded.model.set_attn_implementation(name)
                try:
                    self.floor(x, mask)
                finally:
                    self.loaded.model.set_attn_implementation("eager")
                return
            self.statistics(name, x, mask, keep_rows)

    def floor(self, x, mask) -> None:
        """The SDPA forward on the fused kernels only; where none takes these inputs, torch's own choice (the math
        kernel, whose n x n map the floor should not have), noted in `sdpa_fallback`."""
        try:
            with sdpa_only(self.backends):
                self.loaded.model(input_ids=x, attention_mask=mask, use_cache=False)
        except RuntimeError as err:
            if self.backends is None or "kernel" not in str(err):
                raise
            self.found.setdefault("sdpa_fallback", {})[str(x.shape[1])] = str(err).strip().splitlines()[0][:300]
            self.loaded.model(input_ids=x, attention_mask=mask, use_cache=False)

    def statistics(self, name: str, x, mask, keep_rows: bool) -> None:
        import torch

        from attnprobe import kernel, planning
        from attnprobe.metrics import TokenClasses, bin_count

        path = name.split("+")[0]
        special = torch.zeros_like(x, dtype=torch.bool)  # [batch, seq]
        special[:, 0] = True  # a BOS, as Llama's tokenizer adds
        punctuation = (x % 10 == 0) & ~special  # [batch, seq]

        def read(_layer: int, sums, _maps) -> None:  # what analyze's store reads of each layer
            _ = sums.received, sums.stacked_means(), sums.stacked_bin_means()

        with kernel.statistics_attention(self.loaded):
            kernel.run_batch(self.loaded, x, mask, read, special=special, sink=SINK, window=WINDOW,
                             bins=bin_count(x.shape[1]), budget_mib=self.budget,
                             fused=planning.fused_from(path, "auto" if path == "triton" else path),
                             triton=path == "triton", projections=self.projections if name.endswith("+vw") else None,
                             keep_rows=keep_rows, tokens=TokenClasses(x, punctuation))


def train(dry: bool, into: Path) -> int:
    """train-pattern's optimization on the benchmark's model (module docstring), written to `into` after every
    step: seconds per step (CUDA-synchronized), peak GPU memory, the distillation loss and the gates."""
    import numpy as np
    import torch

    from attnprobe import kernel, passkeys
    from attnprobe import trainpattern as tp

    cuda = not dry
    length = DRY_TRAIN_LENGTH if dry else TRAIN_LENGTH
    steps = 3 if dry else TRAIN_STEPS
    found: dict = {"dtype": "bfloat16", "length": length, "tail": TRAIN_TAIL, "steps": steps, "steps_done": 0,
                   "sink": TRAIN_SINK, "recent": TRAIN_RECENT,
                   "block_mib": BLOCKED_MIB if cuda else kernel.DEFAULT_BUDGET_MIB, "step_seconds": []}

    def save() -> None:
        temporary = into.with_suffix(".tmp")
        temporary.write_text(json.dumps(found), encoding="utf-8")
        temporary.replace(into)

    started = time.perf_counter()
    loaded, config = build_model(dry)
    found["built_seconds"] = round(time.perf_counter() - started, 1)
    save()

    def sample(step: int) -> passkeys.Sample:
        rng = np.random.default_rng([0, step])
        ids = rng.integers(3, config.vocab_size, length)  # [n]
        ids[-TRAIN_TAIL:] = ids[length // 4 : length // 4 + TRAIN_TAIL]  # copied from far back
        return passkeys.Sample(ids, np.arange(length) >= length - TRAIN_TAIL, (), ())

    clock = [time.perf_counter()]

    def progress(done: int, total: int, row: dict) -> None:
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        found["step_seconds"].append(round(now - clock[0], 3))
        found["steps_done"] = done
        found.setdefault("distill_loss", []).append(row["distill_loss"])
        found["mean_gate"] = row["mean_gate"]
        if cuda:
            found["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        clock[0] = now
        save()

    settings = tp.Settings(lengths=(length,), steps=steps, sink=TRAIN_SINK, recent=TRAIN_RECENT,
                           budget_mib=found["block_mib"])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        found["model_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    clock[0] = time.perf_counter()
    result = tp.train_pattern_loaded(loaded, "", settings, samples=sample, progress=progress)
    found["gates"] = {"kv_heads": int(result.gates["trained"].sum()), "mean": float(result.gates["gate"].mean()),
                      "min": float(result.gates["gate"].min())}
    found["seconds"] = round(time.perf_counter() - started, 1)
    save()
    return 0


def sdpa_backends(cuda: bool) -> list | None:
    """The SDPA kernels the floor may use on a GPU: every fused one, not the math kernel (None: torch's choice)."""
    if not cuda:
        return None
    from torch.nn.attention import SDPBackend

    return [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        getattr(SDPBackend, "CUDNN_ATTENTION", None)) if b is not None]


def sdpa_only(backends: list | None):
    from contextlib import nullcontext

    if backends is None:
        return nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def timed(fn, cuda: bool, reps: int, warm: bool = True) -> dict:
    """`fn()` run once to warm it (at the same shape: kernels compiled and chosen, memory pools grown; `first_s`),
    then `reps` times: the median seconds (after the GPU finished its work), every run's, and the peak GPU memory
    the timed runs reached (the model's weights included, and above them); or the error, and the runs done."""
    import torch

    found: dict = {"runs": []}
    try:
        if warm:
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            found["first_s"] = round(time.perf_counter() - started, 4)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            found["runs"].append(round(time.perf_counter() - started, 4))
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError: recorded, the rest runs
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {**found, "error": f"{type(err).__name__}: {first[:300]}"}
    found["seconds"] = round(statistics.median(found["runs"]), 4)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        found.update(peak_mib=round(peak / 2**20, 1), above_model_mib=round((peak - before) / 2**20, 1))
    return found


if __name__ == "__main__":
    sys.exit(main())
