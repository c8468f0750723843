"""Helpers that figures/runs.py runs as their own processes: `python -m figures.steps NAME ARGS...`.

Each does what a person would do by hand between the documented commands (copy an analysis, screenshot the
report, read verify's checks as JSON, ablate a group of heads from Python, time something) and writes what it
measured as JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from figures.runs import ANALYZE_FILES, CORPUS, ROOT


def write_json(path: str | Path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1), encoding="utf-8")


def copy_analysis(source: str, target: str, *extra: str) -> None:
    """The files `attnprobe analyze` wrote in `source` (and `extra` ones), into `target`."""
    Path(target).mkdir(parents=True, exist_ok=True)
    for name in (*ANALYZE_FILES, *extra):
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(target) / name)


@contextmanager
def opened(page: str, head: str) -> Iterator:
    """report.html in headless Chromium (a 1360 x 1060 viewport), opened at `head`: the playwright page."""
    from playwright.sync_api import sync_playwright

    executable = os.environ.get("ATTNPROBE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        raise SystemExit("no Chromium: set ATTNPROBE_CHROMIUM or install chromium")
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=executable)
        tab = browser.new_page(viewport={"width": 1360, "height": 1060})
        tab.goto(Path(page).resolve().as_uri() + f"#{head}")
        yield tab
        browser.close()


def screenshot(page: str, head: str, target: str) -> None:
    """report.html opened at `head`, the tooltip of another head showing, as a 1360 x 1060 png."""
    with opened(page, head) as tab:
        tab.wait_for_selector("body[data-ready='true']")
        tab.wait_for_selector(f"#pattern[data-name='{head}']")
        tab.hover("td[data-name='L17H4']")
        tab.wait_for_timeout(300)
        tab.screenshot(path=target)


def head_page_screenshot(page: str, head: str, target: str) -> None:
    """report.html's scatter and the head page of `head`, as a png of that section (1360 px wide)."""
    with opened(page, head) as tab:
        tab.wait_for_selector(f"#head-page[data-name='{head}']")
        tab.eval_on_selector("#head-page-examples", "e => { e.style.maxHeight = '760px'; "
                             "e.style.overflow = 'hidden'; }")  # the first examples: the highest and top tenths
        tab.locator("#scatter-section").screenshot(path=target)


def verify(model: str, target: str) -> None:
    """`attnprobe verify --model model`'s checks (4 built-in sentences, CPU), as JSON."""
    import torch

    from attnprobe.model import load_model
    from attnprobe.verify import DEFAULT_SENTENCES
    from attnprobe.verify import verify as run_verify

    loaded = load_model(model, "cpu")
    checks = run_verify(loaded, list(DEFAULT_SENTENCES))
    write_json(target, {"model": model, "threads": torch.get_num_threads(), "checks": [
        {"name": c.name, "max_abs_diff": c.max_abs_diff, "tolerance": c.tolerance, "note": c.note} for c in checks]})


def gpt2_small(target: str) -> None:
    """A GPT-2-small-shaped model with random weights (seed 0) and GPT-2's tokenizer shape: a word-level one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analyze import build

    build(Path(target), 10)


def sink_groups(folder: str, target: str, resamples: int = 1000, seed: int = 0) -> None:
    """Every sink head of SmolLM2 (head_types.csv, extended scheme) ablated at once, zero and mean, against three
    random sets of as many heads (numpy seeds 1, 2, 3), with ablate.prune_passes on the bundled corpus."""
    import numpy as np
    import pandas as pd
    import torch

    from attnprobe import ablate as ab
    from attnprobe.batching import tokenize
    from attnprobe.bootstrap import poisson_weights
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model

    types = pd.read_csv(Path(folder) / "head_types.csv")
    loaded = load_model("smollm2-135m", "cpu", lm_head=True)
    stack = ab.find_stack(loaded)
    ids = tokenize(loaded, read_corpus(str(ROOT / CORPUS))).ids
    batches = ab.make_batches(loaded, ids, 8)
    shape = (loaded.num_layers, stack.heads)
    sinks = np.zeros(shape, dtype=bool)  # [layer, heads]
    sinks[types.loc[types["head_type"] == "sink", "layer"], types.loc[types["head_type"] == "sink", "head"]] = True
    count = int(sinks.sum())
    masks = {"sink": sinks}
    for k in (1, 2, 3):
        chosen = np.random.default_rng(k).permutation(sinks.size)[:count]
        mask = np.zeros(sinks.size, dtype=bool)
        mask[chosen] = True
        masks[f"random {k}"] = mask.reshape(shape)
    weights = poisson_weights(range(len(ids)), resamples, seed)  # [resample, sentence]
    out = {"heads": count, "resamples": resamples, "seed": seed, "groups": {}}
    with ab.fast_attention(loaded.model), torch.inference_mode():
        for method in ("zero", "mean"):
            fill = ab.head_fill(loaded, stack, batches, method, None)
            values = ab.prune_passes(loaded, stack, batches, list(masks.values()), fill)
            for column, name in enumerate(masks):
                if method == "mean" and name != "sink":
                    continue
                row = {}
                for measure in ("loss_change", "kl"):
                    mean, low, high = ab.summarize(values[measure][:, [column]], weights)
                    row[measure] = [float(mean[0]), float(low[0]), float(high[0])]
                out["groups"][f"{name}, {method}"] = row
    write_json(target, out)


def startup(target: str, repeat: int = 5) -> None:
    """Wall seconds of `python -m attnprobe --help`, the median of `repeat` runs after one warm-up."""
    times = []
    for k in range(repeat + 1):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "attnprobe", "--help"], check=True, capture_output=True)
        if k:
            times.append(time.perf_counter() - started)
    write_json(target, {"median_seconds": statistics.median(times), "seconds": times})


def threads(target: str, sentences: int = 24) -> None:
    """`attnprobe ablate` on the corpus's first `sentences` with 1 and with 2 torch threads, interleaved, twice."""
    runs = []
    for count in (1, 2, 1, 2):
        out = Path(target).parent / f"ablate-{len(runs)}"
        command = [sys.executable, "-m", "attnprobe", "ablate", "--model", "smollm2-135m", "--corpus", CORPUS,
                   "--limit", str(sentences), "--no-pruning", "--resamples", "200", "--threads", str(count),
                   "--out", str(out)]
        load = os.getloadavg()[0]
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
        runs.append({"threads": count, "seconds": time.perf_counter() - started, "load_average": load,
                     "load_average_after": os.getloadavg()[0]})
    write_json(target, {"sentences": sentences, "runs": runs})


def suite(target: str) -> None:
    """The whole test suite (`python -m pytest -q`): its wall time and pytest's own counts."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - started
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)", last)}
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    write_json(target, {"seconds": seconds, "counts": counts, "summary": last, "exit": done.returncode,
                        "failures": failures,
                        "load_average": os.getloadavg()[0]})


KVPRESS_LABELS = {"full": "full cache", "no_needle": "full cache, no needle in the context",
                  "retrieval": "export of `retrieval`", "analyze": "export of `analyze` (far share, the default)",
                  "random": "random patterns", "trained": "trained by `train-pattern`"}


def kvpress_plot(results: str, target: str) -> None:
    """bench_kvpress.py's JSON as a figure: per task, the NLL against the share of the context's KV entries kept, for
    the exports, the random patterns (mean, band: lowest to highest), kvpress's own presses and the full cache."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    data = json.loads(Path(results).read_text(encoding="utf-8"))
    settings = data["settings"]
    kept_if = 1 - (settings["sink_size"] + settings["recent_size"]) / settings["context"]  # dropped share per ratio
    tasks = list(dict.fromkeys(r["task"] for r in data["summary"]))
    figure = Figure(figsize=(6.2 * len(tasks), 4.8), layout="constrained")
    axes = figure.subplots(1, len(tasks), squeeze=False)[0]
    shown = ("trained", "retrieval", "analyze", "sink_window", "random", "StreamingLLMPress", "SnapKVPress",
             "KnormPress", "ExpectedAttentionPress")
    for ax, task in zip(axes, tasks):
        rows = [r for r in data["summary"] if r["task"] == task]
        for name in shown:
            mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["ratio"])
            if not mine:
                continue
            x = [100 * (1 - r["ratio"] * kept_if) for r in mine]
            label = KVPRESS_LABELS.get(name, "analyze: 1 - sink_window (old default)" if name == "sink_window"
                                       else name)
            style = "-" if name in ("trained", "retrieval", "analyze", "random", "sink_window") else "--"
            line, = ax.plot(x, [r["nll"] for r in mine], style, marker="o", markersize=3, label=label)
            if name == "random":
                ax.fill_between(x, [r["nll_min"] for r in mine], [r["nll_max"] for r in mine], alpha=0.15,
                                color=line.get_color(), linewidth=0)
        for name, color in (("full", "black"), ("no_needle", "grey")):
            for r in rows:
                if r["method"] == name:
                    ax.axhline(r["nll"], color=color, linewidth=0.8, linestyle=":", label=KVPRESS_LABELS[name])
        ax.invert_xaxis()
        ax.set_xlabel("share of the context's KV entries kept (%)")
        ax.set_ylabel("NLL of the scored tokens (nats/token)")
        ax.set_title(f"{task}: SmolLM2-135M in kvpress {settings['versions']['kvpress']}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    figure.savefig(target, dpi=110)


def batch_sizes(work: str, target: str) -> None:
    """Seconds of the whole `attnprobe analyze` process on bench_analyze.py's model and corpus (built in `work`
    if missing), one torch thread, for batches of 4, 8, 16 and 32."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analyze import build

    build(Path(work), 300)
    seconds = {}
    for size in (4, 8, 16, 32):
        out = Path(target).parent / f"batch-{size}"
        command = [sys.executable, "-m", "attnprobe", "analyze", "--model", str(Path(work) / "model"), "--corpus",
                   str(Path(work) / "corpus.txt"), "--out", str(out), "--device", "cpu", "--threads", "1",
                   "--batch-size", str(size)]
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
        seconds[size] = time.perf_counter() - started
    write_json(target, {"threads": 1, "seconds": seconds})


def report_sizes(folder: str, target: str, layers: int = 30, heads: int = 9, tokens: int = 40) -> None:
    """report.html's size for a `layers` x `heads` model with 8 examples of `tokens` tokens (random softmax maps),
    decoder (lower triangle stored) and encoder (full maps), built on a copy of the analysis in `folder`."""
    import tempfile

    import numpy as np

    from attnprobe import io
    from attnprobe.report import build_report

    rng = np.random.default_rng(0)
    sizes = {}
    for causal in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            copy_analysis(folder, tmp)
            run = json.loads((Path(tmp) / "run.json").read_text())
            if (run["model"]["layers"], run["model"]["heads"]) != (layers, heads):
                raise SystemExit(f"{folder} is not a {layers} x {heads} model")
            run["model"]["causal"] = causal
            run.pop(io.RUN_FILES_KEY, None)  # the run's record of its files: the examples below are not its own
            (Path(tmp) / "run.json").write_text(json.dumps(run))
            (Path(tmp) / "example_attention.npz").unlink(missing_ok=True)
            logits = rng.normal(0, 3, (io.MAX_EXAMPLES, layers, heads, tokens, tokens))
            if causal:
                logits = np.where(np.tril(np.ones((tokens, tokens), bool)), logits, -np.inf)
            maps = np.exp(logits - logits.max(-1, keepdims=True))
            maps = (maps / maps.sum(-1, keepdims=True)).astype(np.float32)  # [example, layer, head, q, k]
            io.write_files(Path(tmp), {io.EXAMPLES_FILE: io.examples_writer([
                {"maps": m, "tokens": [f" token{j}" for j in range(tokens)], "sentence": "x " * tokens,
                 "category": ""} for m in maps])})
            sizes["decoder" if causal else "encoder"] = len(build_report(tmp).html.encode("utf-8"))
    write_json(target, {"layers": layers, "heads": heads, "examples": io.MAX_EXAMPLES, "tokens": tokens,
                        "bytes": sizes})


def coverage(target: str, trials: int = 300, n: int = 60, resamples: int = 400) -> None:
    """How often the 95% interval of a mean of `n` exponential values holds the true mean: the simulation of
    tests/test_bootstrap.py's coverage test, with its seeds."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_bootstrap import coverage_rate

    write_json(target, {"trials": trials, "values": n, "resamples": resamples,
                        "rate": coverage_rate(trials, n, resamples)})


def block_coverage(target: str, trials: int = 300, rows: int = 1000, resamples: int = 400, phi: float = 0.5) -> None:
    """How often the 95% block interval of the mean of an AR(1) series holds the true mean, against resampling
    single rows as if independent: the simulation of tests/test_block_bootstrap.py's coverage test, with its seeds
    and its series."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_block_bootstrap import block_coverage_rates

    from attnprobe.bootstrap import block_length

    rate, single_rows = block_coverage_rates(trials, rows, resamples, phi)
    write_json(target, {"trials": trials, "rows": rows, "resamples": resamples, "phi": phi,
                        "block_length": block_length(rows), "rate": rate, "single_rows": single_rows})


def zoo(work: str, target: str) -> None:
    """Per architecture of tests/zoo.py: the path `auto` takes on long documents and the features discovered,
    and the largest difference of the blocked and fused statistics from the eager maps' (verify's checks)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SENTENCES
    from zoo import ZOO, architecture_row, make

    from attnprobe.model import load_model
    from attnprobe.verify import verify as run_verify

    rows = {}
    for name in ZOO:
        folder = Path(work) / re.sub(r"\W+", "_", name)
        if not (folder / "config.json").is_file():
            make(name, folder)
        loaded = load_model(str(folder), "cpu")
        path, features = architecture_row(name, loaded)
        diffs = {}
        if path != "eager (hooks)":
            for check in run_verify(loaded, list(SENTENCES[:4])):
                if check.name in ("blocked statistics = eager", "fused statistics = eager"):
                    diffs[check.name.split()[0]] = check.max_abs_diff
        rows[name] = {"path": path, "features": features, "max_diff": diffs}
    write_json(target, {"architectures": rows})


def gpu_result(target: str) -> None:
    """The gpu-check.json `make gpu-check` wrote on a lent GPU, checked (figures.gpu.read_gpu_check: a GPU run, not
    the dry run) and copied to `target`. GPU_CHECK_JSON names it, else outputs/gpu-check/gpu-check.json; reruns of
    some steps (`make gpu-check STEPS=...`) saved beside it as gpu-check-*.json, or named after it in GPU_CHECK_JSON
    (separated by os.pathsep), replace those steps, in order (figures.gpu.merge_reruns)."""
    from figures.gpu import GpuCheckError, merge_reruns, read_gpu_check

    given = os.environ.get("GPU_CHECK_JSON")
    folder = ROOT / "outputs" / "gpu-check"
    sources = [Path(p) for p in given.split(os.pathsep) if p] if given else \
        [folder / "gpu-check.json", *sorted(folder.glob("gpu-check-*.json"))]
    for source in sources:
        if not source.is_file():
            raise SystemExit(f"no {source}: run `make gpu-check` on a lent GPU and put its gpu-check.json there (or "
                             "set GPU_CHECK_JSON to it)")
    try:
        merged = merge_reruns(sources)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(merged, indent=1), encoding="utf-8")
        read_gpu_check(target)
    except GpuCheckError as err:
        raise SystemExit(str(err)) from None


STEPS = {"copy-analysis": copy_analysis, "screenshot": screenshot, "head-page-screenshot": head_page_screenshot,
         "verify": verify, "gpt2-small": gpt2_small,
         "sink-groups": sink_groups, "startup": startup, "threads": threads, "suite": suite,
         "report-sizes": report_sizes, "batch-sizes": batch_sizes, "coverage": coverage,
         "block-coverage": block_coverage, "zoo": zoo, "gpu-result": gpu_result, "kvpress-plot": kvpress_plot}


if __name__ == "__main__":
    STEPS[sys.argv[1]](*sys.argv[2:])
