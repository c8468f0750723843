"""The commands whose outputs the docs quote, grouped into named runs, and the runner that executes them.

A run is a list of steps (an `attnprobe` command, a benchmark script, or a helper of `figures.steps`), each
run as its own process from the repository's root, with its wall time and peak RSS recorded. Every run writes
into its own folder under the work folder (default `outputs/figures/`, gitignored) and a record of what ran,
where and how long into `<work>/_runs/<run>.json`; the figures read those folders (see figures/figures.py).

Runs belong to a part: `results` (the real models' results, the default), `bench` (benchmarks that take a few
minutes) and `slow` (those that take tens of minutes: the full SmolLM2 ablation, the dormant sinks' ablation,
bench_ablate, bench_corpus, the thread comparison, the test suite, the trained pattern). `python -m figures
--part ...` chooses. The part `gpu` runs nothing here: it checks and copies the results `make gpu-check` brought
back from a lent GPU (`--part gpu` or `--only gpu-check`; never in `--part all`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = "corpora/sentences.txt"
GPL3 = "/usr/share/common-licenses/GPL-3"
PARTS = ("results", "bench", "slow", "gpu")
HERE = ("results", "bench", "slow")  # the parts that run on this machine (--part all); `gpu` reads a GPU run
INDUCTION = "L17H4,L18H6,L17H3,L23H2"  # SmolLM2's top induction heads by `attnprobe probe` (the figures check it)
ANALYZE_FILES = ("heads.csv", "layers.csv", "run.json", "positions.csv", "categories.csv", "examples.npz",
                 "example_attention.npz", "resamples.npz")


@dataclass(frozen=True)
class Step:
    """One process. `argv` may hold {work} (the work folder), {out} (this run's folder) and {py} (python)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    key: str = ""  # a name to find this step's record by (its wall time, peak RSS, stdout)
    fresh_cache: bool = False  # run with an empty ATTNPROBE_CACHE of its own (the GGUF conversion)


@dataclass(frozen=True)
class Run:
    name: str
    part: str
    steps: tuple[Step, ...]
    needs: tuple[str, ...] = ()  # runs whose folders this one reads
    about: str = ""  # one line: what it is, for --list
    minutes: float = 1.0  # about how long here (2 shared cores), for --list and the skip message


QUICK_TRAIN = ("--lengths", "384,448", "--sink-size", "16", "--recent-size", "64", "--threads", "1")  # train-steps
KVPRESS_HAYSTACK = "/usr/share/common-licenses/MPL-2.0"  # bench_kvpress.py's held-out needle task, its first needle
KVPRESS_NEEDLE = ("The best thing to do in Lisbon is ride the old yellow tram up the hill and watch the sunset from "
                  "the castle.")
KVPRESS_QUESTION = "What is the best thing to do in Lisbon?"


def ap(*args: str, key: str = "", env: tuple[tuple[str, str], ...] = ()) -> Step:
    """An `attnprobe` command, run as `python -m attnprobe` (the checkout's own code)."""
    return Step(("{py}", "-m", "attnprobe", *args), env=env, key=key)


def helper(*args: str, key: str = "") -> Step:
    return Step(("{py}", "-m", "figures.steps", *args), key=key)


def bench(script: str, *args: str, key: str = "") -> Step:
    return Step(("{py}", f"benchmarks/{script}", *args), key=key)


def demo(model: str) -> tuple[Step, ...]:
    """`make demo MODEL=model OUT={out}`: analyze, classify, related, plot and report."""
    return (ap("analyze", "--model", model, "--corpus", CORPUS, "--out", "{out}", "--head-examples", key="analyze"),
            ap("classify", "--out", "{out}"), ap("related", "--out", "{out}", key="related"),
            ap("plot", "--out", "{out}"), ap("report", "--out", "{out}"))


RUNS: dict[str, Run] = {run.name: run for run in (
    Run("convert", "results", (
        Step(("{py}", "-m", "attnprobe", "verify", "--model", "smollm2-135m"), key="verify", fresh_cache=True),),
        about="the GGUF conversion of SmolLM2, from an "
        "empty cache (`attnprobe verify --model smollm2-135m`)", minutes=0.5),
    Run("demo", "results", demo("smollm2-135m"), about="`make demo`: SmolLM2-135M on the bundled corpus",
        minutes=0.5),
    Run("demo-minilm", "results", demo("minilm-l6"), about="`make demo MODEL=minilm-l6`", minutes=0.3),
    Run("demo-extended", "results", (
        helper("copy-analysis", "{work}/demo", "{out}"),
        ap("classify", "--out", "{out}", "--scheme", "extended"), ap("plot", "--out", "{out}"),
        ap("report", "--out", "{out}"), helper("screenshot", "{out}/report.html", "L16H0", "{out}/report.png"),
        helper("head-page-screenshot", "{out}/report.html", "L16H0", "{out}/head-page.png")),
        needs=("demo",), about="`make demo`, then `attnprobe classify --scheme extended`, plot, report",
        minutes=0.3),
    Run("related-smollm2", "results", (
        helper("copy-analysis", "{work}/demo-extended", "{out}", "head_types.csv"),
        ap("related", "--out", "{out}", "--heads", INDUCTION, key="related"),
        ap("plot", "--out", "{out}", "--heads", INDUCTION)),
        needs=("demo-extended",), about=f"`attnprobe related --heads {INDUCTION}` and plot, after `make demo` and "
        "`classify --scheme extended`", minutes=0.5),
    Run("probe-smollm2", "results", (ap("probe", "--model", "smollm2-135m", "--out", "{out}"),),
        about="`attnprobe probe --model smollm2-135m`", minutes=0.5),
    Run("compose-smollm2", "results", (ap("compose", "--model", "smollm2-135m", "--out", "{out}", key="compose"),),
        about="`attnprobe compose --model smollm2-135m`", minutes=3),
    Run("probe-minilm", "results", (ap("probe", "--model", "minilm-l6", "--out", "{out}"),),
        about="`attnprobe probe --model minilm-l6`", minutes=0.3),
    Run("bf16", "results", (
        ap("analyze", "--model", "smollm2-135m", "--corpus", CORPUS, "--out", "{out}", "--dtype", "bfloat16"),
        ap("classify", "--out", "{out}"),
        ap("compare", "{work}/demo", "{out}"),
        ap("compare", "{work}/demo", "{out}", "--unpaired", "--out", "{out}/compare-unpaired")),
        needs=("demo",), about="SmolLM2 in bfloat16 against `make demo`'s float32 (`attnprobe compare`)",
        minutes=1),
    Run("compare-minilm", "results", (
        ap("compare", "{work}/demo", "{work}/demo-minilm", "--score", "entropy_norm", "--out", "{out}"),),
        needs=("demo", "demo-minilm"), about="`attnprobe compare` SmolLM2 against MiniLM", minutes=0.1),
    Run("gpl3", "results", (
        ap("analyze", "--model", "smollm2-135m", "--corpus", GPL3, "--split", "file", "--out", "{out}",
           key="analyze"),
        ap("classify", "--out", "{out}", "--scheme", "kv", key="classify"), ap("plot", "--out", "{out}")),
        about="SmolLM2 on the GPL-3 licence as one sequence, `classify --scheme kv`", minutes=1.5),
    Run("kv-smollm2", "results", (
        ap("retrieval", "--model", "smollm2-135m", "--haystack", GPL3, "--lengths", "1024,2048", "--out",
           "{out}/retrieval", key="retrieval"),
        ap("retrieval", "--model", "smollm2-135m", "--haystack", GPL3, "--lengths", "1024,2048", "--decode",
           "forced", "--out", "{out}/forced", key="forced"),
        ap("export", "--out", "{work}/gpl3", "--format", "duo-attention", "--scores", "kv", "--to", "{out}/duo"),
        Step(("sh", "-c", f"head -c 9000 {GPL3} > {{out}}/gpl3-start.txt")),  # ASCII: 9,000 characters
        ap("ablate", "--model", "smollm2-135m", "--corpus", "{out}/gpl3-start.txt", "--split", "file", "--method",
           "streaming", "--pattern", "{out}/duo", "--out", "{out}/streaming", key="streaming")),
        needs=("gpl3", "probe-smollm2"), about="SmolLM2's retrieval heads (Wu et al.) on the GPL-3 licence, the "
        "DuoAttention export of `gpl3` and its streaming curve (text and needle tasks, kvpress client)", minutes=15),
    Run("kvpress-smollm2", "slow", (
        Step(("make", "--no-print-directory", "kvpress-check", "KVPRESS_OUT={out}"), key="kvpress"),
        helper("kvpress-plot", "{out}/kvpress-smollm2.json", "{out}/kvpress-smollm2.png"),
        *(ap("ablate", "--model", "smollm2-135m", "--corpus", KVPRESS_HAYSTACK, "--split", "file", "--method",
             "streaming", "--client", "kvpress", "--task", "needle", "--pattern", f"{{out}}/{folder}", "--haystack",
             KVPRESS_HAYSTACK, "--needle", KVPRESS_NEEDLE, "--question", KVPRESS_QUESTION, "--lengths", "1024",
             "--depths", "20,45,70", "--shares", "0.25,0.5,0.75", "--random-orders", "5", "--out",
             f"{{out}}/ablate-{name}", key=f"ablate-{name}")
          for name, folder in (("analyze", "duo-analyze"), ("retrieval", "duo-retrieval"),
                               ("sink_window", "candidates/sink_window")))),
        about="`make kvpress-check`: the exports of `retrieval` and `analyze` (and other analyze scores) inside "
        "kvpress 0.5.5 on held-out needles and texts, beside random patterns and kvpress's presses", minutes=30),
    Run("rollout", "results", (
        ap("rollout", "--model", "smollm2-135m", "--corpus", CORPUS, "--out", "{out}/smollm2"),
        ap("rollout", "--model", "smollm2-135m", "--corpus", CORPUS, "--residual", "0.9", "--out",
           "{out}/smollm2-residual-0.9"),
        ap("rollout", "--model", "minilm-l6", "--corpus", CORPUS, "--out", "{out}/minilm")),
        about="`attnprobe rollout` on both models' example sentence", minutes=0.5),
    Run("verify", "results", (
        helper("verify", "smollm2-135m", "{out}/smollm2-135m.json"),
        Step(("{py}", "-m", "figures.steps", "verify", "smollm2-135m", "{out}/smollm2-135m-1-thread.json"),
             env=(("OMP_NUM_THREADS", "1"),)),
        helper("verify", "minilm-l6", "{out}/minilm-l6.json"),
        helper("gpt2-small", "{work}/gpt2-small"),
        helper("verify", "{work}/gpt2-small/model", "{out}/gpt2-small.json")),
        about="`attnprobe verify`'s checks on both models and a random GPT-2 small", minutes=1),
    Run("ablate-minilm", "results", (
        ap("ablate", "--model", "minilm-l6", "--corpus", CORPUS, "--out", "{out}", key="ablate"),),
        about="`attnprobe ablate --model minilm-l6` (zero ablation)", minutes=0.7),
    Run("report-sizes", "results", (helper("report-sizes", "{work}/demo", "{out}/sizes.json"),),
        needs=("demo",), about="report.html's size for 8 examples of 40 tokens, decoder and encoder", minutes=0.1),
    Run("coverage", "results", (helper("coverage", "{out}/coverage.json"),),
        about="the bootstrap's coverage simulation (tests/test_bootstrap.py's)", minutes=0.1),
    Run("block-coverage", "results", (helper("block-coverage", "{out}/block-coverage.json"),),
        about="the block bootstrap's coverage simulation (tests/test_block_bootstrap.py's)", minutes=0.2),
    Run("triton-compile", "bench", (
        Step(("{py}", "tests/triton_compile.py", "--all", "--json", "{out}/compile.json"), key="compile"),),
        about="the Triton kernels compiled offline for sm_90: registers, spills, main-loop instructions per tile",
        minutes=4),
    Run("zoo", "results", (helper("zoo", "{work}/zoo-models", "{out}/zoo.json"),),
        about="the architecture table: tests/zoo.py's tiny models, discovered and verified", minutes=0.3),
    Run("torchrun-minilm", "results", (
        ap("analyze", "--model", "minilm-l6", "--corpus", CORPUS, "--out", "{out}/one", key="one"),
        Step(("{py}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "attnprobe",
              "analyze", "--model", "minilm-l6", "--corpus", CORPUS, "--out", "{out}/two"), key="two"),
        Step(("{py}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "attnprobe",
              "analyze", "--model", "minilm-l6", "--corpus", CORPUS, "--out", "{out}/two-1-thread"),
             env=(("OMP_NUM_THREADS", "1"),), key="two-1-thread")),
        about="MiniLM on the bundled corpus in one process and in two under torchrun", minutes=0.5),
    Run("startup", "results", (helper("startup", "{out}/startup.json"),),
        about="how long `attnprobe --help` takes", minutes=0.1),
    Run("bench-analyze", "bench", (
        bench("bench_analyze.py", "--no-memory", "--repeat", "3", "--threads", "1", "--work", "{work}/bench-work",
              "--json", "{out}/speed.json"),
        bench("bench_analyze.py", "--memory-only", "--work", "{work}/bench-work", "--json", "{out}/memory.json")),
        about="benchmarks/bench_analyze.py: speed (3 interleaved runs, 1 thread) and memory", minutes=8),
    Run("bench-related", "bench", (
        bench("bench_related.py", "--threads", "1", "--json", "{out}/defaults.json"),
        bench("bench_related.py", "--long", "--threads", "1", "--json", "{out}/long.json")),
        about="benchmarks/bench_related.py: `related`'s two parts on the bundled corpus and on its largest sample",
        minutes=3),
    Run("batch-sizes", "bench", (helper("batch-sizes", "{work}/bench-work", "{out}/batch-sizes.json"),),
        about="`attnprobe analyze` on bench_analyze.py's model and corpus with batches of 4, 8, 16 and 32",
        minutes=2),
    Run("bench-scale", "bench", (
        bench("bench_scale.py", "--threads", "1", "--work", "{work}/scale-work", "--json", "{out}/scale.json"),),
        about="benchmarks/bench_scale.py: random-weight 1-4B shapes in bf16 (builds ~18 GB of models)", minutes=45),
    Run("bench-long-user", "bench", (
        bench("bench_long.py", "--part", "user", "--repeat", "3", "--work", "{work}/bench-work", "--json",
              "{out}/user.json"),),
        about="benchmarks/bench_long.py --part user: SmolLM2 on an 8k-token document as a user runs it", minutes=8),
    Run("bench-long", "bench", (
        bench("bench_long.py", "--part", "smollm2", "--tokens", "3600", "--eager", "--threads", "1", "--work",
              "{work}/bench-work", "--json", "{out}/smollm2.json"),
        bench("bench_long.py", "--part", "tiny", "--threads", "1", "--work", "{work}/bench-work", "--json",
              "{out}/tiny.json"),
        bench("bench_long.py", "--part", "zoo", "--threads", "1", "--work", "{work}/bench-work", "--json",
              "{out}/zoo.json")),
        about="benchmarks/bench_long.py: SmolLM2 at 3,600 tokens, a tiny Llama to 32k, the zoo", minutes=10),
    Run("bench-block-bootstrap", "bench", (bench("bench_block_bootstrap.py", "--json", "{out}/block.json"),),
        about="benchmarks/bench_block_bootstrap.py: the block bootstrap's resampling of 1,825 to 32,768 rows",
        minutes=1),
    Run("ablate-smollm2", "slow", (
        helper("copy-analysis", "{work}/demo-extended", "{out}", "head_types.csv"),
        ap("ablate", "--model", "smollm2-135m", "--corpus", CORPUS, "--out", "{out}", "--layers", "--threads", "1",
           key="ablate"),
        ap("plot", "--out", "{out}")),
        needs=("demo-extended",), about="`attnprobe ablate --model smollm2-135m --layers --threads 1`",
        minutes=20),
    Run("train-smollm2", "slow", (
        ap("train-pattern", "--model", "smollm2-135m", "--threads", "2", "--out", "{out}", key="train"),
        ap("export", "--out", "{out}", "--format", "duo-attention", "--to", "{out}/duo")),
        about="`attnprobe train-pattern --model smollm2-135m` at its defaults on two threads (sized for 20 minutes "
        "and 4 GiB), and its DuoAttention export", minutes=20),
    Run("train-steps", "slow", tuple(
        ap("train-pattern", "--model", "smollm2-135m", *QUICK_TRAIN, "--steps", "8", "--dtype", dtype, "--out",
           f"{{out}}/{dtype}-8", key=f"{dtype}-8") for dtype in ("float32", "bfloat16")),
        about="`attnprobe train-pattern` on SmolLM2-135M at a quick size (samples of 384 and 448 tokens, sink 16, "
        "recent 64, one thread): 8 steps in float32 and in bfloat16", minutes=12),
    Run("train-steps-long", "slow", (
        ap("train-pattern", "--model", "smollm2-135m", *QUICK_TRAIN, "--steps", "24", "--dtype", "float32", "--out",
           "{out}/float32-24", key="float32-24"),),
        about="the same quick size, 24 steps in float32 (against train-steps' 8)", minutes=18),
    Run("sink-groups", "slow", (helper("sink-groups", "{work}/demo-extended", "{out}/sink-groups.json"),),
        needs=("demo-extended",), about="all of SmolLM2's sink heads ablated at once, zero and mean", minutes=4),
    Run("dormant-sinks", "slow", (
        bench("dormant_sinks.py", "--out", "{out}/smollm2", "--json", "{out}/dormant.json"),),
        about="benchmarks/dormant_sinks.py: SmolLM2's analyze, classify --scheme extended, ablate of every head",
        minutes=12),
    Run("patch-smollm2", "results", (
        ap("patch", "--model", "smollm2-135m", "--task", "ioi", "--n", "16", "--method", "both", "--out", "{out}",
           "--threads", "2", key="patch"),),
        about="`attnprobe patch --model smollm2-135m --task ioi --n 16 --method both`: 16 IOI pairs, every head",
        minutes=8),
    Run("circuit-ioi", "results", (
        ap("circuit", "--model", "smollm2-135m", "--task", "ioi", "--n", "32", "--out", "{out}", "--threads", "2",
           key="circuit"),),
        about="`attnprobe circuit --model smollm2-135m --task ioi --n 32`: EAP-IG over every edge, faithfulness",
        minutes=4),
    Run("circuit-greater-than", "results", (
        ap("circuit", "--model", "smollm2-135m", "--task", "greater-than", "--n", "32", "--out", "{out}",
           "--threads", "2", key="circuit"),),
        about="`attnprobe circuit --model smollm2-135m --task greater-than --n 32`", minutes=4),
    Run("bench-circuit", "bench", (bench("bench_circuit.py", "--pairs", "64", "--threads", "2", "--json",
                                         "{out}/circuit.json"),),
        about="bench_circuit.py: EAP, EAP-IG and exact patching of 100 edges on 64 IOI pairs of SmolLM2 (the targets' "
              "size)", minutes=14),
    Run("bench-patch", "bench", (bench("bench_patch.py", "--pairs", "16", "--threads", "2", "--json",
                                       "{out}/patch.json"),),
        about="benchmarks/bench_patch.py --threads 2: the patching sweep, attribution and memory on SmolLM2",
        minutes=4),
    Run("bench-ablate", "slow", (bench("bench_ablate.py", "--threads", "1", "--json", "{out}/ablate.json"),),
        about="benchmarks/bench_ablate.py --threads 1", minutes=45),
    Run("bench-corpus", "slow", (
        bench("bench_corpus.py", "--work", "{work}/bench-work/corpus", "--json", "{out}/corpus.json"),),
        about="benchmarks/bench_corpus.py: 1k, 10k and 100k sentences, 1 and 2 processes", minutes=20),
    Run("threads", "slow", (helper("threads", "{out}/threads.json"),),
        about="`attnprobe ablate` on 24 sentences with 1 and 2 threads, interleaved", minutes=6),
    Run("suite", "slow", (helper("suite", "{out}/suite.json"),), about="the test suite's time", minutes=12),
    Run("gpu-check", "gpu", (helper("gpu-result", "{out}/gpu-check.json"),),
        about="the gpu-check.json `make gpu-check` wrote on a lent GPU (GPU_CHECK_JSON, else "
        "outputs/gpu-check/gpu-check.json), checked and copied", minutes=0.1),
)}


def machine() -> dict:
    """What the figures were measured on: CPU, cores, load, versions."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch
    import transformers

    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "bf16_instructions": sorted(flags & {"avx512_bf16", "amx_bf16"})}  # bfloat16 rounds in these, if any


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def expand(text: str, work: Path, out: Path) -> str:
    return text.replace("{work}", str(work)).replace("{out}", str(out)).replace("{py}", sys.executable)


def run_step(step: Step, work: Path, out: Path, log) -> dict:
    """Run one step from the repository's root: its wall and CPU time, its own peak RSS (os.wait4), its output."""
    argv = [expand(a, work, out) for a in step.argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), **dict(step.env)}
    if step.fresh_cache:
        cache = work / "_fresh-cache"
        shutil.rmtree(cache, ignore_errors=True)
        env["ATTNPROBE_CACHE"] = str(cache)
    shown = " ".join(a.replace(sys.executable, "python") for a in argv)
    log(f"  $ {shown}")
    load = load_average()
    logs = out / "_logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"{len(list(logs.glob('*.out')))}"
    with open(logs / f"{stem}.out", "w") as stdout, open(logs / f"{stem}.err", "w") as stderr:
        started = time.perf_counter()
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if step.fresh_cache:
        shutil.rmtree(work / "_fresh-cache", ignore_errors=True)
    out_text = (logs / f"{stem}.out").read_text(errors="replace")
    err_text = (logs / f"{stem}.err").read_text(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{shown} failed (exit {process.returncode}):\n{err_text[-3000:]}")
    return {"argv": shown, "key": step.key, "seconds": round(seconds, 2),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "load_average": load, "load_average_after": load_average(), "stdout": out_text[-20000:],
            "stderr": err_text[-20000:]}


def execute(run: Run, work: Path, log=print) -> dict:
    """Run every step of `run` into a fresh `<work>/<run.name>` and write its record."""
    out = work / run.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log(f"{run.name}: {run.about}")
    started = datetime.now(timezone.utc)
    steps = []
    for step in run.steps:
        steps.append(run_step(step, work, out, log))
    record = {"run": run.name, "started": started.isoformat(timespec="seconds"),
              "date": started.date().isoformat(), "machine": machine(), "steps": steps}
    records = work / "_runs"
    records.mkdir(exist_ok=True)
    (records / f"{run.name}.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


def record(work: Path, name: str) -> dict | None:
    path = work / "_runs" / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
