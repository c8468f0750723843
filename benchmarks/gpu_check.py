"""`make gpu-check`: what a lent GPU machine runs for attnprobe, in one command of at most 9 minutes.

Run:  make gpu-check                    (on the lent machine; results in $OUT, else outputs/gpu-check/)
      make gpu-check DRY=1              (here, on CPU, in CI-sized time: proves the script itself works)
      python3 benchmarks/gpu_check.py [--dry] [--out FOLDER] [--budget SECONDS] [--steps tests,bench,train,torchrun]

Steps, each in a process of its own with a time limit (a step that fails or runs out of time is recorded and the
next one runs), and one JSON of results, FOLDER/gpu-check.json, rewritten after every step (a stopped run keeps what
it measured), with every step's output in FOLDER/gpu-check.log:
  environment - the GPU (torch.cuda.get_device_name), torch, CUDA, transformers and Python versions;
  install     - the wheels carried in .whl/ (git-ignored: what the machine lacks) into a folder on PYTHONPATH, then
                `pip install --no-deps --no-build-isolation --no-index -e .` (the machine has no internet; the dry
                run adds --dry-run), then a check that every module the steps import is there: a missing one stops
                the run with one line naming the wheel to carry and the `pip download` line that fetches it;
  tests       - `pytest -m "cuda or triton" tests/test_gpu.py tests/test_train_pattern.py tests/test_triton.py`:
                the real CUDA kernel against the stand-in and a float64 softmax, fused = blocked = eager on the zoo's
                gpt2, llama, qwen2, mistral and bert in float32 and bfloat16, the compiled Triton kernel against a
                float64 map and triton = blocked on the same families and gemma2, no [n, n] map, train-pattern on
                the GPU in bfloat16 (all skipped on CPU; the dry run runs `-m cuda` only, the Triton tests run
                under the interpreter in the ordinary suite);
  bench       - a random model of Llama-3.2-1B's published shape (hidden 2048, 16 layers, 32 heads, 8 KV heads,
                intermediate 8192, vocabulary 128256, RoPE theta 500000 with llama3 scaling) in bfloat16, base model
                (no LM head): the short benchmark (64 sentences of 8-40 tokens in right-padded batches of 8) and the
                long one (one sequence of 4k, 16k and 32k tokens), each way after a warm-up: `sdpa` (the model's SDPA
                forward, the floor, restricted to the flash/efficient/cuDNN kernels so that a fallback to the math
                kernel fails instead of timing it; `flash_attention_2` too where the flash_attn package is
                installed), `triton` and `triton+vw` (kernel.run_batch on the Triton path, without and with the
                value-weighted scores; at the first and last length and on the short sentences, where triton runs;
                the dry run at its first length only, under Triton's interpreter), `fused` (kernel.run_batch on the
                fused path), `fused+vw` (with the value-weighted scores, analyze's default) and `blocked` (block
                budget BLOCKED_MIB); every way is
                warmed up first on one sequence and on a padded batch; time (CUDA-synchronized) and peak GPU memory
                (torch.cuda.max_memory_allocated, also above the loaded model);
  train       - `attnprobe train-pattern`'s optimization (trainpattern.train_pattern_loaded) on the same model in
                bfloat16: TRAIN_STEPS steps on samples of TRAIN_LENGTH random tokens whose last TRAIN_TAIL repeat
                tokens from a quarter of the way in (the loss is taken on them), sink 128 + recent 256, block
                budget BLOCKED_MIB; seconds per step and peak GPU memory, the distillation loss and the gates;
  torchrun    - `torchrun --standalone --nproc-per-node 1` of a process-group check (NCCL on the GPU: all_reduce and
                barrier) and of `attnprobe analyze` on a tiny zoo Llama on the GPU.
The JSON's `targets` says whether the GPU targets were met: fused bfloat16 statistics within TARGET_TIME x the
SDPA forward's time at the longest length, peak memory within TARGET_MEMORY x, fused = eager to bfloat16's
tolerance on every family tested; `targets.triton`, the Triton path's (TRITON_TARGETS).

The dry run (--dry): the same steps on CPU with a tiny model of the same kind (2 layers, 4 heads of 16), lengths
of 128-512 tokens, 8 short sentences, DRY_TRAIN_LENGTH-token training samples, 16 corpus sentences under torchrun,
gloo instead of NCCL; its numbers are not GPU figures (`dry: true`, and the targets are not judged).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"  # git-ignored: wheels carried to a machine that lacks them
SITE = Path(tempfile.gettempdir()) / "attnprobe-gpu-check-site"  # where carried wheels are unpacked
BUDGET_S = 540  # the whole command, at most (the device tool allows 10 minutes a command)
STEP_S = {"install": 60, "tests": 150, "bench": 200, "train": 60, "torchrun": 70}  # each step's limit, within what
# remains
TARGET_TIME = 1.5  # fused bfloat16 statistics / SDPA forward, time at the longest length, at most
TARGET_MEMORY = 1.1  # the same, peak GPU memory, at most
LENGTHS = (4096, 16384, 32768)  # the Triton ways run at the first and last only
# The Triton path's targets: name -> (where: shortest / longest length or short sentences, way, measure, at most)
TRITON_TARGETS = {
    "time_longest": ("longest", "triton", "seconds", 1.5),
    "time_shortest": ("shortest", "triton", "seconds", 1.3),
    "time_vw_longest": ("longest", "triton+vw", "seconds", 2.0),
    "memory_longest": ("longest", "triton", "peak_mib", 1.1),
    "time_short": ("short", "triton", "seconds", 1.3),
}
DRY_LENGTHS = (128, 256, 512)
SHORT = (64, 8, 8, 40)  # sentences, batch size, shortest and longest (tokens)
DRY_SHORT = (8, 4, 8, 40)
BLOCKED_MIB = 1024  # the blocked path's block budget on the GPU (the CPU default, 64 MiB, makes blocks of 2 rows)
SINK, WINDOW = 4, 256  # attnprobe's defaults
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "accelerate", "numpy", "pandas",
          "pyarrow", "scipy", "matplotlib", "typer", "rich", "pytest")
STEPS = ("tests", "bench", "train", "torchrun")  # after environment and install, which always run (--steps picks)
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
    """Issue 29's targets from the results: met or missed, with the numbers (None where not measured)."""
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
    if report.get("dry"):  # a tiny model on CPU says nothing of a GPU: the ratios are kept, nothing is judged
        found.update(time_met=None, memory_met=None, judged=False, note="dry run on CPU: not GPU figures")
        found["triton"].update({key: None for key in found["triton"] if key.endswith("_met")})
    else:
        found["judged"] = True
    return found


def triton_targets(report: dict) -> dict:
    """The Triton path's targets (TRITON_TARGETS: way / SDPA forward, time or peak memory, at most): per name its
    `<name>_ratio`, `<name>_target` and `<name>_met` (None where not measured), at the shortest and longest length
    and on the short sentences."""
    bench = report.get("steps", {}).get("bench", {})
    long_runs, short = bench.get("long", {}), (bench.get("short") or {}).get("runs", {})
    lengths = sorted(int(n) for n in long_runs)
    found: dict = {}
    for key, (where, way, measure, target) in TRITON_TARGETS.items():
        runs = short if where == "short" else long_runs.get(str(lengths[0 if where == "shortest" else -1]), {}) \
            if lengths else {}
        mine, floor = runs.get(way, {}).get(measure), runs.get("sdpa", {}).get(measure)
        ratio = round(mine / floor, 3) if mine and floor else None
        found.update({f"{key}_ratio": ratio, f"{key}_target": target,
                      f"{key}_met": None if ratio is None else ratio <= target})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the CPU dry run: tiny shapes, gloo, cuda tests skipped")
    parser.add_argument("--out", type=Path, default=None,
                        help="where gpu-check.json goes ($OUT, else outputs/gpu-check)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps to run after install (a rerun of some): {', '.join(STEPS)}")
    parser.add_argument("--child", choices=("bench", "group", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "bench":
        return bench(args.dry, args.json)
    if args.child == "group":
        return group(args.json)
    if args.child == "train":
        return train(args.dry, args.json)
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

    if "tests" in chosen:
        report.data["steps"]["tests"] = tests = run(
            report, "tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda" if args.dry else "cuda or triton",
                              "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py", "tests/test_train_pattern.py",
                              "tests/test_triton.py"], left("tests"), env)
        tests.update(pytest_outcomes(tests["tail"] if tests["timed_out"] else _full_log(report, "tests")))
        tests["ok"] = tests["returncode"] == 0
        report.save()

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        if "bench" in chosen:
            results = Path(work) / "bench.json"
            bench_run = run(report, "bench", [sys.executable, __file__, "--child", "bench", "--json", str(results),
                                              *(["--dry"] if args.dry else [])], left("bench"), env)
            found = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else {}
            report.data["steps"]["bench"] = {**bench_run, **found, "ok": bench_run["returncode"] == 0}
            report.data["targets"] = targets(report.data)
            report.save()
        if "train" in chosen:
            results = Path(work) / "train.json"
            train_run = run(report, "train", [sys.executable, __file__, "--child", "train", "--json", str(results),
                                              *(["--dry"] if args.dry else [])], left("train"), env)
            found = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else {}
            report.data["steps"]["train"] = {**train_run, **found, "ok": train_run["returncode"] == 0
                                             and found.get("steps_done") == found.get("steps")}
            report.save()
        if "torchrun" in chosen:
            report.data["steps"]["torchrun"] = torchrun(report, args.dry, Path(work), left, env)
            report.save()
    report.data["targets"] = targets(report.data)
    report.data["seconds"] = round(args.budget - (deadline - time.perf_counter()), 1)
    failed = [name for name, step in report.data["steps"].items() if not step.get("ok")]
    report.data["ok"] = not failed
    report.save()
    print(f"gpu-check: {'every step passed' if not failed else 'failed: ' + ', '.join(failed)}; targets "
          f"{json.dumps(report.data['targets'])}; {report.path}", flush=True)
    return 0 if not failed else 1


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
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    checked = work / "group.json"
    step = {"group": run(report, "torchrun group", [*launch, __file__, "--child", "group", "--json", str(checked)],
                         left("torchrun"), env)}
    step["group"].update(json.loads(checked.read_text(encoding="utf-8")) if checked.is_file() else {})
    out = work / "analyze"
    step["analyze"] = run(report, "torchrun analyze", [
        *launch, "-m", "attnprobe", "analyze", "--model", str(model), "--corpus", "corpora/sentences.txt", "--out",
        str(out), "--device", "cpu" if dry else "cuda", "--dtype", "float32" if dry else "bfloat16", "--resamples",
        "20", *(["--limit", "16"] if dry else [])], left("torchrun"), env)
    record = out / "run.json"
    if record.is_file():
        found = json.loads(record.read_text(encoding="utf-8"))
        step["analyze"].update(world_size=found["distributed"]["world_size"], path=found["attention"]["path"],
                               device=found.get("device"))
    step["ok"] = step["group"]["returncode"] == 0 and bool(step["group"].get("all_reduce_ok")) and \
        step["analyze"]["returncode"] == 0 and record.is_file()
    return step


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
    LoadedModel, with a word-level tokenizer (the benchmark feeds random ids)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models
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
    words = ["<|endoftext|>", "<unk>", *(f"w{i}" for i in range(62))]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>")
    return from_transformers(model, tokenizer, spec="Llama-3.2-1B shape, random weights"), config


def bench(dry: bool, into: Path) -> int:
    """The short and long benchmarks (module docstring), written to `into` after every measurement."""
    import torch

    from attnprobe import kernel, values
    from attnprobe.kernel import triton_path
    from attnprobe.metrics import bin_count
    from attnprobe.model import attention_modules

    cuda = not dry
    found: dict = {"dtype": "bfloat16", "block_mib": BLOCKED_MIB if cuda else kernel.DEFAULT_BUDGET_MIB,
                   "sink": SINK, "window": WINDOW, "short": {}, "long": {}}

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
    save()
    modules = [module for module, _ in attention_modules(loaded.model)]
    projections = values.find_projections(loaded.model, modules, loaded.num_heads)[0]
    backends = sdpa_backends(cuda)
    found["sdpa_backends"] = [b.name for b in backends] if backends else "default"

    def floor(x, mask) -> None:
        """The SDPA forward on the fused kernels only; where none takes these inputs, torch's own choice (the math
        kernel, whose n x n map the floor should not have), noted in `sdpa_fallback`."""
        try:
            with sdpa_only(backends):
                loaded.model(input_ids=x, attention_mask=mask, use_cache=False)
        except RuntimeError as err:
            if backends is None or "kernel" not in str(err):
                raise
            found.setdefault("sdpa_fallback", {})[str(x.shape[1])] = str(err).strip().splitlines()[0][:300]
            loaded.model(input_ids=x, attention_mask=mask, use_cache=False)

    def way(name: str, x, mask) -> None:
        with torch.inference_mode():
            if name in ("sdpa", "flash_attention_2"):
                loaded.model.set_attn_implementation(name)
                try:
                    floor(x, mask)
                finally:
                    loaded.model.set_attn_implementation("eager")
                return
            with kernel.statistics_attention(loaded):
                kernel.run_batch(loaded, x, mask, lambda *_: None, sink=SINK, window=WINDOW, bins=bin_count(x.shape[1]),
                                 budget_mib=found["block_mib"], fused=0 if name.startswith("fused") else None,
                                 triton=name.startswith("triton"),
                                 projections=projections if name.endswith("+vw") else None)

    triton_ways = ["triton", "triton+vw"] if triton_path.unavailable(loaded.device) is None else []
    if not triton_ways:
        found["triton"] = triton_path.unavailable(loaded.device)
    ways = ["sdpa", *(["flash_attention_2"] if cuda and importlib.util.find_spec("flash_attn") else []), *triton_ways,
            "fused", "fused+vw", "blocked"]
    found["ways"] = ways
    # the Triton ways: at the shortest and longest length and on the short sentences; in the dry run, where Triton's
    # interpreter takes seconds for what a GPU does in microseconds, at the shortest length only
    lengths_triton = {DRY_LENGTHS[0]} if dry else {LENGTHS[0], LENGTHS[-1]}
    device = loaded.device
    generator = torch.Generator().manual_seed(0)

    def ids(batch: int, n: int):
        return torch.randint(3, config.vocab_size, (batch, n), generator=generator).to(device)  # [batch, seq]

    for name in ways:  # warm-up: kernels chosen, compiled and loaded, memory pools grown; with padding too
        x = ids(2, 128 if dry else 512)
        padded = torch.ones_like(x)
        padded[1, x.shape[1] // 2:] = 0  # right padding, as the short sentences have
        way(name, x[:1], padded[:1])
        way(name, x, padded)
    sentences, batch_size, shortest, longest = DRY_SHORT if dry else SHORT
    rng = random.Random(0)
    lengths = sorted(rng.randint(shortest, longest) for _ in range(sentences))  # analyze sorts by length too
    batches = []
    for first in range(0, sentences, batch_size):
        chunk = lengths[first : first + batch_size]
        x, mask = ids(len(chunk), max(chunk)), torch.zeros(len(chunk), max(chunk), dtype=torch.long, device=device)
        for row, n in enumerate(chunk):
            mask[row, :n] = 1  # right padding
        batches.append((x, mask))
    found["short"] = {"sentences": sentences, "batch_size": batch_size, "tokens": sum(lengths), "runs": {}}
    for name in ways:
        if dry and name in triton_ways:
            continue
        found["short"]["runs"][name] = measured(lambda name=name: [way(name, x, m) for x, m in batches], cuda)
        save()
    for n in DRY_LENGTHS if dry else LENGTHS:
        x = ids(1, n)
        mask = torch.ones_like(x)
        found["long"][str(n)] = {}
        for name in ways:
            if name in triton_ways and n not in lengths_triton:
                continue
            found["long"][str(n)][name] = measured(lambda name=name, x=x, mask=mask: way(name, x, mask), cuda)
            save()
    found["seconds"] = round(time.perf_counter() - started, 1)
    save()
    return 0


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


def measured(fn, cuda: bool) -> dict:
    """Seconds of `fn()` (after the GPU finished its work) and the peak GPU memory it reached, or its error."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    try:
        fn()
        if cuda:
            torch.cuda.synchronize()
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError: recorded, the rest runs
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {"error": f"{type(err).__name__}: {first[:300]}"}
    found = {"seconds": round(time.perf_counter() - started, 4)}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        found.update(peak_mib=round(peak / 2**20, 1), above_model_mib=round((peak - before) / 2**20, 1))
    return found


if __name__ == "__main__":
    sys.exit(main())
