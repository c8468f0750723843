"""--threads on every command that runs a model: checked as a usage error, applied before the model runs,
recorded in run.json, ablate.json and probe.json; `auto` leaves out the cores the load keeps busy."""

import json
import os

import numpy as np
import pytest
import torch
from test_cli import run
from test_nothing_lost import usage_error

from attnprobe import threads
from attnprobe.errors import AttnprobeError

MODEL_COMMANDS = {  # every command that loads a model, with its other required options
    "analyze": ["--model", "m", "--corpus", "c.txt"],
    "ablate": ["--model", "m", "--corpus", "c.txt"],
    "probe": ["--model", "m"],
    "rollout": ["--model", "m", "--example", "Hello."],
    "compose": ["--model", "m"],
    "verify": ["--model", "m"],
}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_parse():
    assert threads.parse("auto") == threads.parse(" AUTO ") == "auto"
    assert threads.parse("3") == threads.parse(3) == 3
    for bad, words in (("0", "below 1"), ("-1", "below 1"), ("two", "not a whole number"), ("1.5", "whole")):
        with pytest.raises(AttnprobeError, match=words):
            threads.parse(bad)


@pytest.mark.parametrize(("cores", "cpus", "busy", "expected"), [
    (2, 2, 0.1, 2),  # a quiet machine: every core
    (2, 2, 0.8, 1),  # one core busy with other work: one thread
    (2, 2, 5.0, 1),  # overloaded: one thread, never zero
    (8, 16, 4.2, 8),  # torch's own count is the ceiling
    (4, 4, None, 4),  # no load average (not Unix): torch's count
])
def test_auto_leaves_out_busy_cores(cores, cpus, busy, expected):
    assert threads.auto(cores, cpus, busy) == expected


def test_apply_sets_torch_and_reports_it():
    used = threads.apply(1)
    assert torch.get_num_threads() == 1
    assert used["requested"] == 1 and used["threads"] == 1 and used["cpus"] >= 1
    auto = threads.apply("auto")
    assert auto["requested"] == "auto" and 1 <= auto["threads"] == torch.get_num_threads()


@pytest.mark.parametrize(("requested", "recorded", "chosen"), [
    ("auto", 1, 1),  # auto keeps the stopped run's threads
    ("auto", 0, "auto"),  # not recorded (an older checkpoint): auto as for a new run
    (2, 1, 2),  # a count asked for is a count used
    (1, 1, 1),
    ("auto", 10_000, "auto"),  # more than this machine takes: auto
])
def test_a_resumed_run_keeps_the_stopped_runs_threads_under_auto(requested, recorded, chosen):
    assert threads.resumed_threads(requested, recorded) == chosen
    note = threads.resume_note(requested, recorded)
    assert (note is None) == (recorded == 0 or chosen == recorded)
    if note:
        assert f"the stopped run used {recorded} thread" in note and "not byte for byte" in note


def test_apply_under_auto_with_a_resumed_count_uses_it_and_says_so():
    used = threads.apply("auto", resumed=1)
    assert torch.get_num_threads() == 1
    assert used["requested"] == "auto" and used["threads"] == 1 and used["resumed"] == 1
    assert "resumed" not in threads.apply(1, resumed=2)  # a count asked for wins; the command says what it costs


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
@pytest.mark.parametrize(("value", "words"), [("0", "below 1"), ("-1", "below 1"), ("many", "not a whole number")])
def test_a_bad_thread_count_is_one_usage_line(capsys, monkeypatch, tmp_path, command, value, words):
    monkeypatch.chdir(tmp_path)
    code, lines = usage_error(capsys, monkeypatch, command, *MODEL_COMMANDS[command], f"--threads={value}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("Error: Invalid value for '--threads'") and words in lines[0], lines[0]


def test_threads_are_recorded(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 5, "--threads", 1)
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "run.json").read_text())["threads"]
    assert recorded["requested"] == 1 and recorded["threads"] == 1
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 5, "--no-pruning", "--threads", 2)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "ablate.json").read_text())["threads"]["threads"] == 2
    probe_out = tmp_path / "probe"
    result = run("probe", "--model", gpt2_dir, "--out", probe_out, "--device", "cpu", "--lengths", "5",
                 "--sequences", 2, "--resamples", 5)
    assert result.exit_code == 0, result.output
    assert json.loads((probe_out / "probe.json").read_text())["threads"]["requested"] == "auto"
    result = run("related", "--out", out, "--sentences", 3, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    with np.load(out / "head_similarity.npz") as similarity:
        assert int(similarity["threads"]) == 1
    rollout_out = tmp_path / "rollout"
    result = run("rollout", "--model", gpt2_dir, "--corpus", corpus_file, "--out", rollout_out, "--device", "cpu",
                 "--threads", 1)
    assert result.exit_code == 0, result.output
    with np.load(rollout_out / "rollout.npz") as rollout:
        assert int(rollout["threads"]) == 1
    result = run("verify", "--model", gpt2_dir, "--sentences", 1, "--device", "cpu", "--threads", 1)
    assert "1 torch thread(s)" in " ".join(result.output.split()), result.output


def test_numpy_gets_one_blas_thread_unless_told(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    threads.limit_numpy_threads()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    threads.limit_numpy_threads()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_the_command_line_limits_numpy_before_importing_it(tmp_path):
    import subprocess
    import sys

    code = ("import os, sys; os.environ.pop('OPENBLAS_NUM_THREADS', None); sys.argv = ['attnprobe', '--version']\n"
            "from attnprobe.cli import main\n"
            "assert 'numpy' not in sys.modules, 'imported with the CLI, before its threads are limited'\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'numpy' not in sys.modules or os.environ['OPENBLAS_NUM_THREADS'] == '1'\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "1"


STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 1
"""


def test_cpu_ticks_reads_proc_stat():
    ticks = threads.cpu_ticks(STAT.format(user=70, system=30, idle=180, iowait=20))
    assert ticks == (100, 300, 2)  # busy = user + system; idle and iowait are idle; two cpuN lines
    assert threads.cpu_ticks("intr 1\n") is None


@pytest.mark.parametrize(("busy", "total", "own", "expected"), [
    (0, 20, 0.0, 0.0),  # an idle machine: nothing busy, whatever ran a minute ago
    (10, 20, 0.0, 1.0),  # half of 2 CPUs busy: one CPU
    (10, 20, 1.0, 0.0),  # ... and it was this process itself: nothing busy
    (2, 20, 1.0, 0.0),  # never below 0
])
def test_busy_cpus_leaves_out_this_process(busy, total, own, expected):
    before = (1000, 5000, 2)
    after = (1000 + busy, 5000 + total, 2)
    assert threads.busy_cpus(before, after, own_seconds=own * 0.1, elapsed=0.1) == pytest.approx(expected)


def test_auto_counts_what_runs_now_not_the_load_average(monkeypatch):
    """The load average of work that has ended (1.6 on 2 idle cores) must not cost a thread: auto reads the CPUs
    busy now, and falls back to the load average only where /proc/stat is missing."""
    monkeypatch.setattr(threads, "load", lambda: 1.6)
    monkeypatch.setattr(threads, "busy_now", lambda seconds=threads.SAMPLE_SECONDS: 0.05)
    monkeypatch.setattr(threads, "cpus", lambda: 2)
    monkeypatch.setattr(threads, "_cores", [2])
    used = threads.apply("auto")
    assert used["threads"] == 2 and used["busy_cpus"] == 0.05 and "/proc/stat" in used["busy_from"]
    assert used["load_average"] == 1.6
    monkeypatch.setattr(threads, "busy_now", lambda seconds=threads.SAMPLE_SECONDS: None)
    used = threads.apply("auto")
    assert used["threads"] == 1 and used["busy_from"] == "load average"


IDLE_NEEDED = 0.8  # CPUs idle around a try: most of one, for the spinner to show as about 1


def spin_and_sample() -> tuple[float | None, float | None, float | None, float | None]:
    """busy_now before anything spins (the other jobs), while another process spins on a CPU, while a thread of this
    process spins, and after (the other jobs again)."""
    import subprocess
    import sys
    import threading
    import time

    before = threads.busy_now(0.3)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        other = threads.busy_now(0.3)
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        own = threads.busy_now(0.3)
    finally:
        stop.set()
        worker.join()
    return before, other, own, threads.busy_now(0.3)


@pytest.mark.skipif(not os.path.exists("/proc/stat") or threads.cpus() < 2, reason="needs Linux and 2 CPUs")
def test_busy_now_sees_another_process_spinning_and_not_itself():
    """A real sample: another process spinning on a CPU counts about 1; this process spinning does not count. Other
    jobs on a shared machine move both samples, so it takes the best of three tries, and counts only the tries with
    a CPU idle (IDLE_NEEDED) just before and just after: on a saturated machine (load 20 on 2 CPUs) the spinner gets
    no CPU of its own and every sample reads "all busy" (other 2.0, own 1.8), so with no such try there is nothing to
    see, and the test says so and skips."""
    cpus = threads._read_ticks()[2]  # the CPUs /proc/stat counts, as busy_now does
    tries = [spin_and_sample() for _ in range(3)]
    assert all(None not in sample for sample in tries), tries
    idle = [(other, own) for before, other, own, after in tries if cpus - max(before, after) >= IDLE_NEEDED]
    if not idle:
        pytest.skip(f"no idle CPU to observe: of {cpus} CPUs, other jobs kept "
                    f"{', '.join(f'{max(before, after):.1f}' for before, _, _, after in tries)} busy around each try "
                    f"(needs {IDLE_NEEDED} idle)")
    assert any(other >= 0.6 and own < other - 0.4 for other, own in idle), tries
