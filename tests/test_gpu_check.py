"""`make gpu-check` (benchmarks/gpu_check.py): its CPU dry run end to end, and the parts that judge a GPU run.

The dry run is the same script a lent GPU machine runs, on CPU with tiny shapes and gloo: every step must pass and
the JSON must hold what a GPU run's figures are read from (figures/gpu.py), so that a lent machine's one call only
has to run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

from attnprobe.kernel import triton_path  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done, out


def test_the_dry_run_passes_every_step_and_writes_one_json(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.log"]  # what $OUT brings back
    found = json.loads((out / "gpu-check.json").read_text(encoding="utf-8"))
    assert found["dry"] is True and found["ok"] is True
    assert set(found["steps"]) == {"install", "tests", "bench", "e2e", "train", "torchrun"} and "skipped" not in found
    assert all(step["ok"] for step in found["steps"].values()), {k: v.get("tail") for k, v in found["steps"].items()}
    environment = found["environment"]
    assert environment["gpu"] is None and environment["torch"] and environment["transformers"]
    assert "--dry-run" in found["steps"]["install"]["project"]["command"]  # the dry run installs nothing
    tests = found["steps"]["tests"]
    assert tests["counts"]["skipped"] > 0 and not tests["outcomes"]  # every cuda test skipped here
    bench = found["steps"]["bench"]
    assert bench["model"]["rope"]["rope_type"] == "llama3" and bench["model"]["rope"]["rope_theta"] == 500000.0
    assert set(bench["short"]["runs"]) == {"sdpa", "fused", "fused+vw", "blocked"}  # the interpreter: too slow here
    assert set(bench["long"]) == {str(n) for n in gpu_check.DRY_LENGTHS}
    interpreted = triton_path.unavailable(torch.device("cpu")) is None  # triton 3.9's interpreter runs the kernels
    if interpreted:
        assert {"triton", "triton+vw"} <= set(bench["long"][str(gpu_check.DRY_LENGTHS[0])])
    else:  # no triton, or an interpreter that cannot run them (3.6, torch 2.11's): left out, and the bench says why
        assert not {"triton", "triton+vw"} & set(bench["long"][str(gpu_check.DRY_LENGTHS[0])])
        assert bench["triton"] == triton_path.unavailable(torch.device("cpu"))
    for ways in (bench["short"]["runs"], *bench["long"].values()):  # warmed, then the median of REPS runs
        for run in ways.values():
            assert run["first_s"] > 0 and len(run["runs"]) == gpu_check.REPS, ways
            assert run["seconds"] == sorted(run["runs"])[gpu_check.REPS // 2] > 0, ways
    assert bench["auto_path"] == "fused" and bench["reps"] == gpu_check.REPS  # auto on a CPU
    e2e = found["steps"]["e2e"]  # analyze's process and the bare forward's, one each in the dry run
    assert [r["returncode"] for r in e2e["runs"]["floor"] + e2e["runs"]["analyze"]] == [0, 0]
    assert e2e["runs"]["analyze"][0]["tokens"] == e2e["tokens"] == gpu_check.DRY_E2E_TOKENS
    assert e2e["runs"]["analyze"][0]["path"] == "fused" and e2e["ratio"] == round(
        e2e["runs"]["analyze"][0]["seconds"] / e2e["runs"]["floor"][0]["seconds"], 3)
    train = found["steps"]["train"]
    assert train["steps_done"] == train["steps"] == 3 and train["length"] == gpu_check.DRY_TRAIN_LENGTH
    assert len(train["step_seconds"]) == 3 and all(s > 0 for s in train["step_seconds"])
    assert train["distill_loss"][0] == 0.0 and 0 <= train["gates"]["mean"] <= 1  # gates of 1: the model itself
    torchrun = found["steps"]["torchrun"]
    assert torchrun["group"]["backend"] == "gloo" and torchrun["group"]["all_reduce_ok"] is True
    assert torchrun["analyze"]["world_size"] == 1 and torchrun["analyze"]["path"] == "fused"
    targets = found["targets"]
    assert targets["judged"] is False and targets["time_met"] is None  # a CPU dry run judges nothing
    assert targets["tokens"] == max(gpu_check.DRY_LENGTHS) and targets["fused_time_ratio"] > 0
    assert targets["triton"]["time_shortest_met"] is None
    shortest = targets["triton"]["time_shortest_ratio"]
    assert shortest > 0 if interpreted else shortest is None
    assert targets["triton"]["time_longest_ratio"] is None  # the dry run's Triton ways: its shortest length only
    summary = targets["triton"]["summary"]
    assert [line["name"] for line in summary] == list(gpu_check.TRITON_TARGETS)
    assert all(line["met"] is None for line in summary) and summary[-1]["measured"] == e2e["ratio"]


def test_the_model_has_the_published_llama_3_2_1b_shape():
    shape = gpu_check.LLAMA_1B
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]) == \
        (2048, 16, 32, 8, 8192, 128256)
    assert gpu_check.ROPE["rope_theta"] == 500000.0 and gpu_check.ROPE["rope_type"] == "llama3"
    assert gpu_check.LENGTHS == (4096, 32768) and gpu_check.SHORT[:2] == (1024, 64)
    assert gpu_check.E2E_TOKENS == 32768 and gpu_check.REPS >= 3


def gpu_report(sdpa: float, fused: float, sdpa_mib: float, fused_mib: float, tests: dict) -> dict:
    runs = {"sdpa": {"seconds": sdpa, "peak_mib": sdpa_mib}, "fused": {"seconds": fused, "peak_mib": fused_mib}}
    return {"dry": False, "steps": {"bench": {"long": {"4096": {"sdpa": {"seconds": 1.0}, "fused": {"seconds": 9.0}},
                                                       "32768": runs}},
                                    "tests": {"outcomes": tests}}}


def test_targets_are_judged_at_the_longest_length_with_the_numbers():
    passed = {"tests/test_gpu.py::test_cuda_fused_equals_blocked_equals_eager[bfloat16-llama]": "PASSED",
              "tests/test_gpu.py::test_cuda_fused_equals_blocked_equals_eager[float32-llama]": "FAILED"}
    found = gpu_check.targets(gpu_report(2.0, 2.9, 1000.0, 1099.0, passed))
    assert found["tokens"] == 32768 and found["fused_time_ratio"] == 1.45 and found["time_met"] is True
    assert found["fused_memory_ratio"] == 1.099 and found["memory_met"] is True and found["judged"] is True
    assert found["fused_equals_eager_bfloat16"] == {"tests": 1, "passed": 1, "met": True}
    missed = gpu_check.targets(gpu_report(2.0, 3.2, 1000.0, 1200.0, {"x::test_cuda_fused_equals_blocked_equals_eager"
                                                                     "[bfloat16-bert]": "FAILED"}))
    assert missed["time_met"] is False and missed["memory_met"] is False
    assert missed["fused_equals_eager_bfloat16"]["met"] is False
    assert gpu_check.targets({"steps": {}})["time_met"] is None  # nothing measured: nothing judged


def test_the_triton_targets_are_each_way_over_the_floor_with_the_end_to_end_processes():
    """Each target of the Triton path: the way's median over the SDPA forward's at the same length (peak memory for
    the memory target), the short sentences' likewise, the end-to-end processes' ratio; met where at most the
    target; missing measurements judge nothing."""
    runs = {"4096": {"sdpa": {"seconds": 0.1, "peak_mib": 100.0}, "triton": {"seconds": 0.12, "peak_mib": 100.0}},
            "32768": {"sdpa": {"seconds": 0.3, "peak_mib": 1000.0}, "triton": {"seconds": 0.6, "peak_mib": 1050.0},
                      "triton+vw": {"seconds": 0.57, "peak_mib": 1200.0}}}
    short = {"sdpa": {"seconds": 1.0}, "triton": {"seconds": 1.4}}
    report = {"dry": False, "steps": {"bench": {"long": runs, "short": {"runs": short, "sentences": 1024,
                                                                         "batch_size": 64}},
                                      "e2e": {"ratio": 1.2, "tokens": 32768}}}
    found = gpu_check.targets(report)["triton"]
    assert (found["time_longest_ratio"], found["time_longest_met"]) == (2.0, False)
    assert (found["time_shortest_ratio"], found["time_shortest_met"]) == (1.2, True)
    assert (found["time_vw_longest_ratio"], found["time_vw_longest_met"]) == (1.9, True)
    assert (found["memory_longest_ratio"], found["memory_longest_met"]) == (1.05, True)
    assert (found["time_short_ratio"], found["time_short_met"]) == (1.4, False)
    assert (found["end_to_end_ratio"], found["end_to_end_met"]) == (1.2, True)
    every = gpu_check.targets(report)["ratios"]
    assert every["32768 tokens"]["triton+vw"] == {"time": 1.9, "memory": 1.2}
    assert every["short"]["triton"] == {"time": 1.4, "memory": None}  # no memory measured there
    lines = {line["name"]: line for line in found["summary"]}
    assert lines["time_longest"]["at_most"] == 1.5 and "32,768 tokens" in lines["time_longest"]["target"]
    assert "1024 in batches of 64" in lines["time_short"]["target"]
    del report["steps"]["e2e"], runs["32768"]["triton+vw"]
    found = gpu_check.targets(report)["triton"]
    assert found["end_to_end_met"] is None and found["time_vw_longest_ratio"] is None


def test_a_step_that_no_longer_fits_the_budget_is_skipped_and_said(tmp_path, monkeypatch, capsys):
    """--budget: a step with fewer seconds left than it needs is not started; the JSON names it under `skipped`
    with one line saying why, and the check still exits 0 (nothing failed)."""
    assert gpu_check.skip_reason("bench", gpu_check.STEP_MIN_S["bench"], 540) is None
    why = gpu_check.skip_reason("bench", 12.4, 300)
    assert "12 s left of --budget 300 s" in why and "STEPS=bench" in why
    monkeypatch.setattr(gpu_check, "environment", lambda dry: {"gpu": None})
    monkeypatch.setattr(gpu_check, "install", lambda report, args, budget: [])
    assert gpu_check.main(["--dry", "--steps", "bench,e2e", "--budget", "5", "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "gpu-check.json").read_text(encoding="utf-8"))
    assert found["skipped"] == ["bench", "e2e"] and found["ok"] is True
    assert found["steps"]["bench"]["ok"] is None and "needs at least" in found["steps"]["bench"]["skipped"]
    assert "skipped (out of budget): bench, e2e" in capsys.readouterr().out


def test_the_end_to_end_step_takes_each_way_s_fastest_process_in_folders_of_their_own(tmp_path, monkeypatch):
    """e2e on a GPU: E2E_REPEAT turns of the floor's process and analyze's, each analyze writing a folder of its own
    (a second run into the first's would be taken for a resume); the ratio is the fastest over the fastest; the
    processes share the step's limit, and those that no longer fit are not started."""
    (tmp_path / gpu_check.E2E_MODEL).mkdir()
    (tmp_path / gpu_check.E2E_MODEL / "config.json").write_text("{}", encoding="utf-8")  # as the bench saved it
    seconds = iter([10.0, 16.0, 9.0, 12.0])
    outs = []

    def fake_run(report, title, argv, timeout, env):
        if "analyze" in argv:
            out = Path(argv[argv.index("--out") + 1])
            outs.append(out)
            out.mkdir()
            (out / "run.json").write_text(json.dumps({"tokens": 32768, "attention": {"path": "triton", "sequences": {
                "triton": 1}}}), encoding="utf-8")
        return {"seconds": next(seconds), "returncode": 0, "timed_out": False, "tail": ""}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    step = gpu_check.end_to_end(None, False, tmp_path, lambda name: 100.0, {})
    assert gpu_check.E2E_REPEAT == 2 and len(set(outs)) == 2
    assert [r["seconds"] for r in step["runs"]["floor"]] == [10.0, 9.0] and step["seconds"] == {"floor": 9.0,
                                                                                               "analyze": 12.0}
    assert step["ratio"] == round(12.0 / 9.0, 3) and step["ok"] is True and step["runs"]["analyze"][0]["path"] == \
        "triton"
    step = gpu_check.end_to_end(None, False, tmp_path, lambda name: 3.0, {})  # too little time for a process
    assert step["out_of_time"] is True and step["ok"] is False and step["ratio"] is None


def test_pytest_outcomes_are_read_from_the_summary():
    text = ("PASSED tests/test_gpu.py::test_a[x]\nFAILED tests/test_gpu.py::test_b - AssertionError\n"
            "SKIPPED [3] tests/test_gpu.py:12: needs a CUDA GPU\n1 failed, 1 passed, 3 skipped in 2.0s\n")
    found = gpu_check.pytest_outcomes(text)
    assert found["outcomes"] == {"tests/test_gpu.py::test_a[x]": "PASSED", "tests/test_gpu.py::test_b": "FAILED"}
    assert found["counts"] == {"passed": 1, "failed": 1, "skipped": 3}


def test_a_missing_module_names_the_wheel_and_the_download_line():
    assert gpu_check.missing_modules(("json", "no_such_module_here")) == ["no_such_module_here"]
    hint = gpu_check.wheel_hint(["pytest"])
    assert "pytest iniconfig pluggy" in hint and "pip download --no-deps --only-binary=:all:" in hint
    assert "--python-version 3.12" in hint and "-d .whl" in hint and "\n" not in hint


def gpu_json_from(dry_json: dict) -> dict:
    """The dry run's JSON as a GPU run would write it (a GPU name, peak memory), for the figure's tests."""
    found = json.loads(json.dumps(dry_json))
    found["dry"] = False
    found["environment"]["gpu"] = "NVIDIA H100 80GB HBM3"
    for ways in (found["steps"]["bench"]["short"]["runs"], *found["steps"]["bench"]["long"].values()):
        for run in ways.values():
            run["peak_mib"] = 1000.0
    found["targets"] = gpu_check.targets(found)
    return found


def test_the_gpu_figure_renders_a_gpu_run_and_refuses_the_dry_run(dry_run, tmp_path):
    """figures/gpu.py: a GPU run's JSON renders with the GPU's name, every length and way, and the targets judged;
    the dry run's JSON and a malformed one are refused with one line; no run yet renders without a number."""
    from figures import build
    from figures.gpu import GpuCheckError, read_gpu_check

    _, out = dry_run
    dry_json = json.loads((out / "gpu-check.json").read_text(encoding="utf-8"))
    with pytest.raises(GpuCheckError, match="dry run"):
        read_gpu_check(out / "gpu-check.json")
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(gpu_json_from(dry_json)), encoding="utf-8")
    data = read_gpu_check(path)
    body = build.render("gpu-check", data)
    assert "NVIDIA H100 80GB HBM3" in body and "attnprobe fused statistics" in body
    assert all(f"| {n} |" in body for n in gpu_check.DRY_LENGTHS)
    assert "(met)" in body or "(missed)" in body
    broken = gpu_json_from(dry_json)
    broken["steps"]["bench"]["long"][str(gpu_check.DRY_LENGTHS[-1])]["fused"]["seconds"] = -1
    path.write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(GpuCheckError, match="positive number of seconds"):
        read_gpu_check(path)
    empty = build.render("gpu-check", {"measured": False})
    assert "No GPU figures have been measured yet" in empty and not any(ch.isdigit() for ch in empty)
