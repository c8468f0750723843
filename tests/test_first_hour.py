"""A new user's first hour (issue 13): one-line errors, -h, no hub, GGUF conversion status, few sentences,
outputs that go stale, probe's own folder and which heads are above chance."""

import io as stdio
import json
import os
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest
from conftest import SENTENCES
from rich.console import Console
from test_cli import run
from typer.testing import CliRunner

from attnprobe import sources
from attnprobe.cli import app
from attnprobe.commands import common
from attnprobe.errors import AttnprobeError
from attnprobe.model import PROXY_VARIABLES
from attnprobe.tables import FEW_SENTENCES, few_sentences_note

runner = CliRunner()


def attnprobe_process(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "attnprobe", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


# ---- errors and messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], *[[c.name or c.callback.__name__] for c in app.registered_commands]])
def test_dash_h_is_help_everywhere(command):
    result = runner.invoke(app, [*command, "-h"], prog_name="attnprobe")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"Usage: attnprobe {' '.join(command)}".rstrip())
    assert "-h, --help" in result.stdout


def test_misspelt_choice_is_one_plain_line():
    done = attnprobe_process("classify", "--scheme", "extnded")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["Error: --scheme 'extnded' is not one of default, extended, kv"]
    done = attnprobe_process("probe", "-m", "x", "--kind", "inducton")
    assert done.stderr.strip().splitlines() == ["Error: --kind 'inducton' is not one of induction, duplicate, "
                                                "previous"]


def test_bad_number_is_plain_words():
    done = attnprobe_process("analyze", "-m", "x", "-c", "y", "--batch-size", "eight")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "Error: Invalid value for '--batch-size' / '-b': not a whole number (see `attnprobe analyze --help`)"]


def test_copy_max_entropy_default_reads_ln_2():
    result = run("classify", "--help")
    text = " ".join(result.stdout.split())
    assert "[default: ln 2 = 0.693]" in text and "0.6931471805599453" not in text


def without_hub(tmp_path, **extra):
    """An environment whose hub refuses connections at once (nothing listens on port 9), HF_HUB_OFFLINE unset."""
    unset = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *PROXY_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub-cache"), **extra)
    return env


def test_unreachable_hub_fails_fast_with_one_line(tmp_path, corpus_file):
    """Without the check, the hub client retried every request 5 times (about 23 s each, with a log line per try)."""
    started = time.perf_counter()
    done = attnprobe_process("analyze", "--model", "attnprobe-test/no-such-model", "--corpus", corpus_file,
                             "--out", tmp_path / "out", env=without_hub(tmp_path))
    elapsed = time.perf_counter() - started
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: cannot reach the model hub (http://127.0.0.1:9) and 'attnprobe-test/no-such-model' is not in the "
        "local Hugging Face cache: pass a local folder saved with save_pretrained, or a short name such as "
        "smollm2-135m"]
    assert elapsed < 30, elapsed  # import time only; the retries alone took over 40 s
    assert not (tmp_path / "out").exists()


def test_unreachable_hub_still_loads_a_cached_model(tmp_path, corpus_file, gpt2_dir):
    snapshot = tmp_path / "hub-cache" / "models--attnprobe-test--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(gpt2_dir, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    done = attnprobe_process("analyze", "--model", "attnprobe-test/tiny", "--corpus", corpus_file, "--out",
                             tmp_path / "out", "--resamples", "20", "--device", "cpu", env=without_hub(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Retry" not in done.stderr and "thrown while requesting" not in done.stderr
    assert json.loads((tmp_path / "out" / "run.json").read_text())["model"]["spec"] == "attnprobe-test/tiny"


def test_hub_client_logs_are_quiet_while_loading():
    import logging

    from attnprobe.model import quiet_transformers

    hub = logging.getLogger("huggingface_hub")
    before = hub.level
    with quiet_transformers():
        assert not hub.isEnabledFor(logging.WARNING)  # its "Retrying in 1s [Retry 1/5]" lines
    assert hub.level == before


def test_gguf_conversion_says_once_where_and_how_big(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def fake_convert(path, folder, on_status=None):
        on_status("de-quantizing the weights (step 2 of 4, the longest)")
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"\0" * 2_000_000)

    monkeypatch.setattr(sources, "convert_gguf", fake_convert)
    heard = []
    folder = sources.gguf_folder(gguf, "ab" * 32, heard.append)
    assert heard[0] == f"Converting tiny.gguf to float32 weights, once: into {folder} (later runs reuse it)"
    assert heard[1].startswith("de-quantizing")
    assert heard[2].startswith("Converted tiny.gguf in ") and heard[2].endswith(f"s: 2 MB in {folder}")
    again = []
    assert sources.gguf_folder(gguf, "ab" * 32, again.append) == folder and again == []  # cached: nothing to say


def test_loading_prints_what_the_conversion_says(monkeypatch):
    buffer = stdio.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buffer, width=200))
    with common.loading("smollm2-135m") as on_status:
        on_status("Converting x.gguf to float32 weights, once: into /cache (later runs reuse it)")
    assert "Converting x.gguf to float32 weights, once" in buffer.getvalue()
    with common.loading("m", enabled=False) as on_status:
        assert on_status is None


# ---- few sentences -------------------------------------------------------------------------------------------


def test_few_sentences_warn_that_intervals_mean_little(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", tmp_path / "out", "--device", "cpu",
                 "--resamples", "50")
    assert result.exit_code == 0, result.output
    assert "Warning: only 1 sequence: the 95% intervals come from a block bootstrap over the query rows within it " \
           "(blocks of 2 rows), not over sentences" in " ".join(result.stderr.split())
    notes = json.loads((tmp_path / "out" / "run.json").read_text())["notes"]
    assert len(notes) == 1 and notes[0].startswith("only 1 sequence")
    assert few_sentences_note(FEW_SENTENCES) is None and "only 9 sequences" in few_sentences_note(9)
    assert ", 1 sentence, " in " ".join(result.stdout.split())


def test_one_document_is_counted_as_one_sequence(gpt2_dir, tmp_path):
    """`--split file` makes one sequence of the whole file: the summary says "1 sequence", not "1 sentence" (a
    document is no sentence), and counts keep their plurals right (issue 34)."""
    from attnprobe.naming import counted, sequence_noun

    corpus = tmp_path / "doc.txt"
    corpus.write_text("The cat sat on the mat.\nThe dog sat on the log.\n", encoding="utf-8")
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--split", "file", "--out", tmp_path / "out",
                 "--device", "cpu", "--resamples", "20")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert ", 1 sequence, " in text and "1 sentence" not in text
    assert counted(1, "sequence") == "1 sequence" and counted(2, "query row") == "2 query rows"
    assert sequence_noun("lines") == "sentence" and sequence_noun("paragraphs") == "sequence"


# ---- outputs that mix or go stale ----------------------------------------------------------------------------


def test_reanalysing_removes_what_the_earlier_run_made_and_says_so(gpt2_dir, llama_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    base = ["--corpus", corpus_file, "--out", out, "--device", "cpu", "--resamples", "20"]
    assert run("analyze", "--model", gpt2_dir, *base).exit_code == 0
    assert run("classify", "--out", out, "--scheme", "extended").exit_code == 0
    assert run("plot", "--out", out).exit_code == 0
    assert run("report", "--out", out).exit_code == 0
    (out / "compare").mkdir()
    (out / "compare" / "compare.json").write_text("{}")
    made = {"head_types.csv", "entropy_heatmap.png", "layer_gradient.png", "head_patterns.png",
            "position_profile.png", "report.html"}
    assert made <= {p.name for p in out.iterdir()}
    # results of commands that run a model themselves: kept, and named when they are another model's
    (out / "probe.csv").write_text("layer,head\n")
    (out / "probe.json").write_text(json.dumps({"model": {"spec": "other", "source": "/models/other"}}))

    again = run("analyze", "--model", llama_dir, *base)
    assert again.exit_code == 0, again.output
    stderr = " ".join(again.stderr.split())
    assert f"Note: removed {len(made) + 1} file(s) made from the earlier run in {out}, which no longer match" in stderr
    for name in [*made, "compare/compare.json"]:
        assert name in stderr
        assert not (out / name).exists()
    assert not (out / "compare").exists()
    assert (out / "heads.csv").exists() and (out / "probe.csv").exists()
    assert "Note: kept probe.csv, probe.json in" in stderr and "`attnprobe probe` results for /models/other" in stderr
    assert "probe/probe.json" not in stderr  # no probe in its default folder

    # the same model again: nothing derived is left, and the probe files now match
    (out / "probe.json").write_text(json.dumps({"model": {"spec": str(llama_dir), "source": str(llama_dir.resolve())}}))
    third = run("analyze", "--model", llama_dir, *base)
    assert third.exit_code == 0
    assert "Note:" not in third.stderr

    # a rerun that writes the same results, file for file: what was made from them still matches, and stays
    assert run("classify", "--out", out).exit_code == 0
    assert run("plot", "--out", out).exit_code == 0
    before = json.loads((out / "run.json").read_text())["files"]
    fourth = run("analyze", "--model", llama_dir, *base)
    assert fourth.exit_code == 0
    assert json.loads((out / "run.json").read_text())["files"] == before
    assert "Note:" not in fourth.stderr and "removed" not in fourth.stderr
    assert (out / "head_types.csv").exists() and (out / "head_patterns.png").exists()


def test_probe_has_its_own_folder_and_provenance(planted_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("probe", "--model", planted_dir, "--lengths", "4,6", "--sequences", "4", "--resamples", "50",
                 "--kind", "previous", "--device", "cpu")
    assert result.exit_code == 0, result.output
    out = tmp_path / "outputs" / "probe"
    assert {p.name for p in out.iterdir()} == {"probe.csv", "probe.json", "probe_heatmap.png"}
    assert not (tmp_path / "outputs" / "probe.csv").exists()
    info = json.loads((out / "probe.json").read_text())
    assert info["attnprobe_version"] and info["created"].endswith("+00:00") and info["wall_seconds"] > 0
    assert set(info["versions"]) == {"python", "torch", "transformers"}
    assert info["model"]["spec"] == str(planted_dir) and info["model"]["architecture"] == "GPT2Model"
    assert info["model"]["layers"] == 2 and info["device"] == "cpu"


def test_report_finds_the_probe_in_its_default_folder(planted_dir, corpus_file, tmp_path, monkeypatch):
    from attnprobe.report import build_report

    monkeypatch.chdir(tmp_path)  # both commands write to their defaults: outputs/ and outputs/probe/
    assert run("analyze", "--model", planted_dir, "--corpus", corpus_file, "--device", "cpu",
               "--resamples", "20").exit_code == 0
    assert run("probe", "--model", planted_dir, "--lengths", "4", "--sequences", "2", "--resamples", "20",
               "--kind", "previous", "--device", "cpu").exit_code == 0
    assert '"key":"previous"' in build_report(tmp_path / "outputs").html


def test_probe_marks_heads_above_chance(planted_dir, tmp_path):
    result = run("probe", "--model", planted_dir, "--out", tmp_path, "--lengths", "4,6", "--sequences", "4",
                 "--resamples", "50", "--kind", "previous", "--device", "cpu")
    assert result.exit_code == 0, result.output
    scores = pd.read_csv(tmp_path / "probe.csv").set_index(["layer", "head"])
    assert scores["previous_above_chance"].tolist() == [True, False, False, False]  # only the planted head
    info = json.loads((tmp_path / "probe.json").read_text())
    assert info["above_chance"] == {"previous": 1}
    text = " ".join(result.stdout.split())
    assert "above chance: 95% interval above 0.218 (1 of 4 heads)" in text
    assert "No head scores above chance" not in text


def test_probe_says_plainly_when_no_head_is_above_chance(uniform_gpt2_dir, tmp_path):
    result = run("probe", "--model", uniform_gpt2_dir, "--out", tmp_path, "--lengths", "4,6", "--sequences", "4",
                 "--resamples", "50", "--device", "cpu")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    for kind in ("induction", "duplicate", "previous"):
        assert f"No head scores above chance on {kind}" in text
    assert not pd.read_csv(tmp_path / "probe.csv")["induction_above_chance"].any()


def test_probe_json_model_is_recorded_for_the_library_too(planted_dir):
    from attnprobe.probe import probe

    result = probe(str(planted_dir), device="cpu", kinds=("previous",), lengths=(4,), sequences=2, resamples=20)
    assert result.info["model"]["source"] == str(planted_dir.resolve())
    with pytest.raises(AttnprobeError, match="expected a model name or path"):
        probe(42)


def test_in_memory_corpus_is_recorded_as_such(gpt2_dir):
    from attnprobe.analysis import analyze

    result = analyze(str(gpt2_dir), SENTENCES[:3], device="cpu", resamples=20)
    assert result.run["corpus"]["path"] == "<in memory>" and result.run["sentences"] == 3
