"""Nothing silently wrong (issue 21, cases 4 on): tampered or stale inputs get one plain line, not a wrong result."""

import errno
import json
import re
import shutil
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import make_gpt2, unstamp
from test_cli import assert_one_line_error, run

from attnprobe import io
from attnprobe.analysis import analyze_loaded
from attnprobe.corpus import read_corpus
from attnprobe.model import load_model
from attnprobe.resume import Checkpointing, Stopped


def analyze(model, corpus, out, *extra):
    return run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples", "20",
               "--batch-size", "2", *extra)


def stopped_run(model, corpus, out):
    """A checkpoint.npz in `out` as a run of `analyze(model, corpus, out)` stopped after its first batch leaves it."""
    saved = []
    checkpointing = Checkpointing(save=saved.append, should_stop=lambda: True)
    with pytest.raises(Stopped):
        analyze_loaded(load_model(str(model), "cpu"), read_corpus(corpus), batch_size=2, resamples=20,
                       checkpointing=checkpointing)
    io.write_files(out, {io.CHECKPOINT_FILE: io.npz_writer(**saved[0].to_arrays())})
    return saved[0]


# case 4: the weights changed at the same path


def test_resume_refuses_weights_changed_at_the_same_path(tmp_path, corpus_file):
    model, out = make_gpt2(tmp_path / "model"), tmp_path / "out"
    state = stopped_run(model, corpus_file, out)
    assert state.fingerprint["model_sha256"].startswith("sha256:")
    make_gpt2(model, seed=1)  # other weights, same folder
    result = analyze(model, corpus_file, out, "--resume")
    assert_one_line_error(result, "weights", str(model), "changed", "without --resume")
    assert (out / "checkpoint.npz").is_file() and not (out / "heads.csv").exists()


def test_resume_with_the_same_weights_completes(tmp_path, corpus_file):
    model, out = make_gpt2(tmp_path / "model"), tmp_path / "out"
    stopped_run(model, corpus_file, out)
    result = analyze(model, corpus_file, out, "--resume")
    assert result.exit_code == 0, result.output
    assert (out / "heads.csv").is_file() and not (out / "checkpoint.npz").exists()


def test_large_weights_are_fingerprinted_by_name_size_and_mtime(tmp_path, monkeypatch):
    from attnprobe import sources

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    monkeypatch.setattr(sources, "HASH_LIMIT_BYTES", 10)
    first = sources.weights_fingerprint(folder)
    assert first.startswith("stat:")
    (folder / "model.safetensors").write_bytes(b"y" * 101)
    assert sources.weights_fingerprint(folder) != first


# case 5: a tampered checkpoint


def tamper(out, change):
    """Rewrite out/checkpoint.npz after `change(arrays)` (a dict of its arrays, changed in place)."""
    path = out / "checkpoint.npz"
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    change(arrays)
    with open(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def set_meta(key, value):
    def change(arrays):
        meta = json.loads(str(arrays["meta"]))
        meta[key] = value
        arrays["meta"] = np.array(json.dumps(meta))

    return change


def first_sum(change_value):
    def change(arrays):
        key = sorted(k for k in arrays if k.startswith("sum:sum/"))[0]
        arrays[key] = change_value(arrays[key])

    return change


def drop(name):
    return lambda arrays: arrays.pop(name if name != "a sum" else sorted(k for k in arrays if k.startswith("sum:"))[0])


TAMPERED = {
    "batches_done huge": set_meta("batches_done", 10**9),
    "batches_done negative": set_meta("batches_done", -5),
    "batches_done fraction": set_meta("batches_done", 1.5),
    "batches_done zero": set_meta("batches_done", 0),
    "batches_done null": set_meta("batches_done", None),
    "batches_done text": set_meta("batches_done", "2"),
    "fingerprint missing": lambda arrays: arrays.update(meta=np.array(json.dumps({"batches_done": 1}))),
    "meta a list": lambda arrays: arrays.update(meta=np.array("[1, 2]")),
    "meta not json": lambda arrays: arrays.update(meta=np.array("{")),
    "meta missing": drop("meta"),
    "a sum missing": drop("a sum"),
    "nan sum": first_sum(lambda value: value * np.nan),
    "inf sum": first_sum(lambda value: value + np.inf),
    "wrong shape": first_sum(lambda value: value[:1]),
    "text sum": first_sum(lambda value: value.astype(str)),
    "extra array": lambda arrays: arrays.update(junk=np.zeros(3)),
    "example maps flat": lambda arrays: arrays.update(example_maps=np.zeros(3)),
}


@pytest.mark.parametrize("how", list(TAMPERED))
def test_a_tampered_checkpoint_is_refused_in_one_line(gpt2_dir, corpus_file, tmp_path, how):
    out = tmp_path / "out"
    stopped_run(gpt2_dir, corpus_file, out)
    tamper(out, TAMPERED[how])
    saved = (out / "checkpoint.npz").read_bytes()
    result = analyze(gpt2_dir, corpus_file, out, "--resume")
    assert_one_line_error(result, str(out / "checkpoint.npz"), "delete it", "without --resume")
    assert (out / "checkpoint.npz").read_bytes() == saved and not (out / "heads.csv").exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"\x93NUMPY", "npy"])
def test_an_empty_truncated_or_foreign_checkpoint_is_refused_in_one_line(gpt2_dir, corpus_file, tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "checkpoint.npz"
    if content == "npy":
        np.save(path.with_suffix(".npy"), np.zeros(3))
        path.with_suffix(".npy").rename(path)
    else:
        path.write_bytes(content)
    result = analyze(gpt2_dir, corpus_file, out, "--resume")
    assert_one_line_error(result, str(path), "delete it", "without --resume")
    assert "Aborted" not in result.output


def test_a_truncated_real_checkpoint_is_refused_in_one_line(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    stopped_run(gpt2_dir, corpus_file, out)
    path = out / "checkpoint.npz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_one_line_error(analyze(gpt2_dir, corpus_file, out, "--resume"), str(path), "without --resume")


# case 6: NaN weights


@pytest.fixture(scope="module")
def nan_gpt2_dir(tmp_path_factory):
    import torch
    from transformers import GPT2Model

    folder = make_gpt2(tmp_path_factory.mktemp("nan_gpt2"))
    model = GPT2Model.from_pretrained(folder)
    with torch.no_grad():
        model.h[1].attn.c_attn.weight.fill_(float("nan"))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("attention", ["blocked", "eager"])
def test_nan_attention_stops_in_one_line(nan_gpt2_dir, corpus_file, tmp_path, attention):
    out = tmp_path / "out"
    result = analyze(nan_gpt2_dir, corpus_file, out, "--attention", attention)
    assert_one_line_error(result, "NaN or infinite attention", "layer 1", "corpus line", "weights")
    assert not out.exists() or list(out.iterdir()) == []


def test_json_files_are_valid_json_with_null_for_undefined_numbers(tmp_path):
    data = {"a": float("nan"), "b": [1.5, float("inf"), np.float32("nan")], "c": {"d": -np.inf, "e": np.float64(2)}}
    io.write_files(tmp_path, {"x.json": io.json_writer(data)})
    text = (tmp_path / "x.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.5, None, None], "c": {"d": None, "e": 2.0}}


# case 8: contradictory options


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory, gpt2_dir):
    """One analyze and classify run (3 sentences, 20 resamples), for the commands that read results."""
    root = tmp_path_factory.mktemp("analyzed")
    corpus = root / "c.txt"
    corpus.write_text("The cat sat on the mat.\nRain fell.\nBirds sing.\n", encoding="utf-8")
    out = root / "out"
    result = analyze(gpt2_dir, corpus, out)
    assert result.exit_code == 0, result.output
    assert run("classify", "--out", out).exit_code == 0
    return out


def test_compare_refuses_paired_with_unpaired(analyzed, tmp_path):
    for order in (["--paired", "--unpaired"], ["--unpaired", "--paired"]):
        result = run("compare", analyzed, analyzed, "--out", tmp_path / "cmp", *order)
        assert_one_line_error(result, "--paired and --unpaired", "pass one")
    assert not (tmp_path / "cmp").exists()
    assert run("compare", analyzed, analyzed, "--out", tmp_path / "cmp", "--unpaired").exit_code == 0
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["pairing"] == "unpaired"


# case 11: every numeric option is bounded


NUMBERS = [
    ("analyze", "--resamples", "1000000000", "outside 1-100,000"),
    ("analyze", "--batch-size", "100000", "outside 1-4,096"),
    ("analyze", "--seed", str(2**40), "outside 0-4,294,967,295"),
    ("analyze", "--block-mib", "inf", "not a finite number"),
    ("analyze", "--block-mib", "nan", "not a finite number"),
    ("analyze", "--block-mib", "1e12", "out of range: use a number above 0 and up to 1,048,576"),
    ("analyze", "--window", "1000000000", "outside 1-10,000,000"),
    ("analyze", "--sink-tokens", "1000000000", "outside 0-10,000,000"),
    ("analyze", "--checkpoint-every", "nan", "not a finite number"),
    ("analyze", "--checkpoint-every", "inf", "not a finite number"),
    ("ablate", "--resamples", "1000000000", "outside 1-100,000"),
    ("probe", "--sequences", "1000000000", "outside 1-100,000"),
    ("probe", "--resamples", "1000000000", "outside 1-100,000"),
    ("verify", "--sentences", "1000000000", "outside 1-100,000"),
    ("classify", "--copy-max-entropy", "nan", "not a finite number"),
    ("classify", "--copy-max-entropy", "inf", "not a finite number"),
    ("classify", "--local-min-diagonal", "nan", "between 0 and 1"),
    ("plot", "--dpi", "nan", "outside 10-1200"),
    ("rollout", "--residual", "nan", "outside [0, 1]"),
    ("compare", "--top", "1000000000", "outside 1-10,000"),
]


@pytest.mark.parametrize(("command", "option", "value", "fragment"), NUMBERS)
def test_every_numeric_option_is_bounded(gpt2_dir, corpus_file, analyzed, tmp_path, command, option, value, fragment):
    model, corpus = ["--model", gpt2_dir], ["--corpus", corpus_file]
    out = tmp_path / "out"
    args = {"analyze": [*model, *corpus, "--out", out], "ablate": [*model, *corpus, "--out", out],
            "probe": [*model, "--out", out], "verify": model, "classify": ["--out", analyzed],
            "plot": ["--out", analyzed], "rollout": [*model, *corpus, "--out", out],
            "compare": [analyzed, analyzed, "--out", out]}[command]
    before = sorted(p.name for p in analyzed.iterdir())
    result = run(command, *args, option, value)
    assert_one_line_error(result, option, fragment)
    assert not out.exists() and sorted(p.name for p in analyzed.iterdir()) == before


# case 12: a full disk


def full_disk(monkeypatch):
    """Every result writer writes a little, then fails as a full disk does."""
    def failing(path):
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    for name in ("csv_writer", "json_writer", "npz_writer", "figure_writer", "examples_writer", "text_writer"):
        monkeypatch.setattr(io, name, lambda *args, **kwargs: failing)


def files_under(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("command", ["analyze", "ablate", "rollout", "probe", "classify", "plot", "report", "compare"])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(gpt2_dir, corpus_file, analyzed, tmp_path,
                                                                 monkeypatch, command):
    results = tmp_path / "results"
    shutil.copytree(analyzed, results)
    before = {name: (results / name).read_bytes() for name in files_under(results)}
    out = tmp_path / "out"
    model, corpus, quick = ["--model", gpt2_dir], ["--corpus", corpus_file], ["--device", "cpu"]
    args = {"analyze": [*model, *corpus, "--out", out, *quick, "--resamples", "20"],
            "ablate": [*model, *corpus, "--out", out, *quick, "--resamples", "20", "--no-pruning"],
            "rollout": [*model, *corpus, "--out", out, *quick],
            "probe": [*model, "--out", out, *quick, "--lengths", "3", "--sequences", "2", "--resamples", "20"],
            "classify": ["--out", results], "plot": ["--out", results], "report": ["--out", results],
            "compare": [results, results, "--out", out]}[command]
    full_disk(monkeypatch)
    result = run(command, *args)
    if command == "ablate":  # off a terminal, ablate logs a line per finished step before the write fails
        steps = [line for line in result.stderr.splitlines() if re.fullmatch(r"\w+: \d+/\d+ \w+ \([\d.]+ s\)", line)]
        assert steps and all(line in result.stderr.splitlines()[: len(steps)] for line in steps)
        result = SimpleNamespace(exit_code=result.exit_code, output=result.output,
                                 stderr="\n".join(result.stderr.splitlines()[len(steps):]))
    assert_one_line_error(result, "cannot write", "No space left on device", "another --out")
    assert not [p for p in tmp_path.rglob("*.tmp")]
    assert not out.exists() or files_under(out) == []
    assert {name: (results / name).read_bytes() for name in files_under(results)} == before


def test_a_full_disk_during_per_sentence_rows_is_one_line(gpt2_dir, corpus_file, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    def failing(self, table, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    out = tmp_path / "out"
    result = analyze(gpt2_dir, corpus_file, out, "--per-sentence")
    assert_one_line_error(result, "cannot write", str(out / "sentences.parquet"), "No space left on device")
    assert files_under(out) == []


def test_a_full_disk_while_saving_a_checkpoint_is_one_line(gpt2_dir, corpus_file, tmp_path, monkeypatch):
    full_disk(monkeypatch)
    out = tmp_path / "out"
    result = analyze(gpt2_dir, corpus_file, out, "--checkpoint-every", "0")
    assert_one_line_error(result, "cannot write", str(out / "checkpoint.npz"), "No space left on device")
    assert files_under(out) == []


# case 13: inputs built to break the reader


def test_a_deeply_nested_jsonl_line_is_one_line(gpt2_dir, tmp_path):
    corpus = tmp_path / "deep.jsonl"
    corpus.write_text('{"text": "Rain fell."}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    assert_one_line_error(analyze(gpt2_dir, corpus, tmp_path / "out"), "line 2", "nested too deeply")


def test_a_lone_surrogate_is_one_line(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Rain fell."}\n{"text": "Birds \\ud800 sing."}\n', encoding="utf-8")
    assert_one_line_error(analyze(gpt2_dir, corpus, tmp_path / "out"), "line 2", "lone surrogate", "\\ud800")
    result = run("rollout", "--model", gpt2_dir, "--example", "Birds \udced sing.", "--out", tmp_path / "o2")
    assert_one_line_error(result, "--example", "not UTF-8")
    assert not (tmp_path / "out").exists() and not (tmp_path / "o2").exists()


BROKEN_RUN = {
    "a list": "[1, 2]\n",
    "nested too deeply": "[" * 100_000 + "]" * 100_000 + "\n",
    "summary null": None,
}


@pytest.mark.parametrize("how", list(BROKEN_RUN))
@pytest.mark.parametrize("command", ["report", "classify-kv", "compare"])
def test_a_broken_run_json_is_one_line(analyzed, tmp_path, how, command):
    results = tmp_path / "results"
    shutil.copytree(analyzed, results)
    if BROKEN_RUN[how] is None:
        data = json.loads((results / "run.json").read_text())
        data["summary"] = None
        (results / "run.json").write_text(json.dumps(data))
    else:
        (results / "run.json").write_text(BROKEN_RUN[how])
    args = {"report": ["report", "--out", results], "classify-kv": ["classify", "--scheme", "kv", "--out", results],
            "compare": ["compare", analyzed, results, "--out", tmp_path / "cmp"]}[command]
    assert_one_line_error(run(*args), str(results / "run.json"))
    assert not (results / "report.html").exists() and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("how", ["no entropy", "text in entropy"])
def test_plot_refuses_a_heads_csv_without_numeric_entropy(analyzed, tmp_path, how):
    import pandas as pd

    results = tmp_path / "results"
    shutil.copytree(analyzed, results)
    heads = pd.read_csv(results / "heads.csv")
    if how == "no entropy":
        heads = heads.drop(columns=["entropy"])
    else:
        heads["entropy"] = heads["entropy"].astype(str)
        heads.loc[0, "entropy"] = "abc"
    heads.to_csv(results / "heads.csv", index=False)
    assert_one_line_error(run("plot", "--out", results), "heads.csv", "entropy")
    assert not list(results.glob("*.png"))


# case 14: --out a dangling symlink or a symlink loop


@pytest.mark.parametrize("how", ["dangling", "loop", "under a dangling link"])
def test_a_broken_symlink_as_out_is_refused_before_the_run(gpt2_dir, corpus_file, tmp_path, how):
    link = tmp_path / "link"
    if how == "loop":
        link.symlink_to(tmp_path / "link")
    else:
        link.symlink_to(tmp_path / "nowhere")
    out = link / "sub" if how == "under a dangling link" else link
    result = analyze(gpt2_dir, corpus_file, out)
    assert_one_line_error(result, f"--out {out}", "symlink loop" if how == "loop" else "does not exist")
    assert not (tmp_path / "nowhere").exists() and link.is_symlink()
    fragment = "is a symlink loop" if how == "loop" else "is a symlink to"
    assert_one_line_error(run("probe", "--model", gpt2_dir, "--out", out), fragment)
    assert_one_line_error(run("rollout", "--model", gpt2_dir, "--example", "Rain fell.", "--out", out), fragment)


# case 17: a model folder without a tokenizer


@pytest.mark.parametrize(("model", "removed"), [("gpt2", ["tokenizer.json", "tokenizer_config.json"]),
                                                ("gpt2", ["tokenizer.json"]),
                                                ("llama", ["tokenizer.json", "tokenizer_config.json"])])
def test_a_model_without_a_tokenizer_says_so(gpt2_dir, llama_dir, corpus_file, tmp_path, model, removed):
    folder = tmp_path / "model"
    shutil.copytree({"gpt2": gpt2_dir, "llama": llama_dir}[model], folder)
    for name in removed:
        (folder / name).unlink()
    result = analyze(folder, corpus_file, tmp_path / "out")
    assert_one_line_error(result, f"model {folder} has no tokenizer", "tokenizer.json", "save_pretrained")
    assert not (tmp_path / "out").exists()


# case 19: what a killed run left behind


def test_a_killed_runs_temporary_files_are_removed_and_no_one_elses(gpt2_dir, corpus_file, tmp_path):
    import os
    import tempfile
    import time

    out = tmp_path / "out"
    out.mkdir()
    ours = []
    for name in ("checkpoint.npz", "sentences.parquet", "heads.csv", "checkpoint-rank1-of-2.npz"):
        # as io.write_files names them (io.temp_prefix), by a writer that is gone (no process has pid 999999999)
        fd, path = tempfile.mkstemp(dir=out, prefix=f".{name}.999999999-", suffix=".tmp")
        os.close(fd)
        ours.append(os.path.basename(path))
    (out / ".sentences.parquet.rank1.part").write_bytes(b"part")
    ours.append(".sentences.parquet.rank1.part")
    theirs = [".notes.txt.abcd1234.tmp", "mine.tmp", ".heads.csv.bak", ".heads.csv.abc.tmp", "heads.csv.abcd1234.tmp",
              ".heads.csv.abcd1234.tmp"]  # the last: no writer's pid, so nothing tells it is attnprobe's
    for name in theirs:
        (out / name).write_bytes(b"keep")
    old = time.time() - 60
    for name in ours + theirs:
        os.utime(out / name, (old, old))
    result = analyze(gpt2_dir, corpus_file, out)
    assert result.exit_code == 0, result.output
    left = {p.name for p in out.iterdir()}
    assert not left & set(ours), left
    assert set(theirs) <= left


def test_a_temporary_file_of_a_run_going_on_is_kept(tmp_path):
    import os
    import time

    name = f".checkpoint.npz.{os.getpid()}-abcd1234.tmp"  # this process's: its age tells
    (tmp_path / name).write_bytes(b"being written")
    assert io.remove_stale_temps(tmp_path, time.time() - 60) == []
    assert io.remove_stale_temps(tmp_path, time.time() + 60) == [name]


def test_device_map_leaves_no_offload_folder(gpt2_dir, corpus_file, tmp_path):
    import os
    import tempfile
    from pathlib import Path

    temp = Path(tempfile.gettempdir())
    dead = temp / "attnprobe-offload-999999999-abcdefgh"  # a pid above any pid_max: a killed run's folder
    dead.mkdir(exist_ok=True)
    mine = f"attnprobe-offload-{os.getpid()}-"
    before = {p.name for p in temp.glob(f"{mine}*")}
    result = analyze(gpt2_dir, corpus_file, tmp_path / "out", "--device-map", "auto")
    assert result.exit_code == 0, result.output
    assert {p.name for p in temp.glob(f"{mine}*")} == before
    assert not dead.exists()


# case 16: mathtext in names


def test_dollar_signs_in_model_and_folder_names_are_drawn_literally(gpt2_dir, corpus_file, analyzed, tmp_path):
    model = tmp_path / "$m^$"
    shutil.copytree(gpt2_dir, model)
    result = run("ablate", "--model", model, "--corpus", corpus_file, "--out", tmp_path / "$out^$", "--device", "cpu",
                 "--resamples", "20", "--no-pruning")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "$out^$" / "importance.png").stat().st_size > 0
    a, b = tmp_path / "$a^$", tmp_path / "$b_{x}^$"
    shutil.copytree(analyzed, a)
    shutil.copytree(analyzed, b)
    result = run("compare", a, b, "--out", tmp_path / "cmp")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0


def test_plot_draws_dollar_signs_in_names_literally(analyzed, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(analyzed, results)
    data = json.loads((results / "run.json").read_text())
    data["model"]["spec"], data["corpus"]["path"] = "$m^$", "/tmp/$c^$.txt"
    (results / "run.json").write_text(json.dumps(data))
    result = run("plot", "--out", results)
    assert result.exit_code == 0, result.output


def test_plain_text_escapes_once():
    from attnprobe.plotting import plain_text

    assert plain_text("$a^$ b") == r"\$a^\$ b"
    assert plain_text("x\x1by\nz", newlines=False) == "x\\x1by\\nz"


# case 20: bidi and control characters in names


def test_bidi_and_control_characters_in_a_model_name_show_as_escapes(gpt2_dir, corpus_file, tmp_path):
    model = tmp_path / "model\u202egnp.exe\x07"
    shutil.copytree(gpt2_dir, model)
    out = tmp_path / "out"
    result = analyze(model, corpus_file, out)
    assert result.exit_code == 0, result.output
    assert "\u202e" not in result.stdout and "\x07" not in result.stdout
    # the path is folded by the console's width, continuation lines indented under a centred title: read it unfolded
    assert "model\\u202egnp.exe\\x07" in "".join(result.stdout.split())
    assert run("report", "--out", out).exit_code == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "\u202e" not in page and "\x07" not in page
    assert "<title>attnprobe report: " in page and "model\\u202egnp.exe\\x07</title>" in page


def test_visible_escapes_only_what_hides_or_reorders_text():
    from attnprobe.naming import visible

    assert visible("abc\u202edef\u2066x\u2069\x1b[31m") == "abc\\u202edef\\u2066x\\u2069\\x1b[31m"
    assert visible("caf\u00e9 \u4e2d\u6587 \U0001f600 a\u200db") == "caf\u00e9 \u4e2d\u6587 \U0001f600 a\u200db"
    assert visible("a\nb", keep="\n") == "a\nb"


# case 21: library messages and wrapped errors


def test_verify_failure_is_one_unwrapped_line(gpt2_dir, monkeypatch):
    from attnprobe import verify
    from attnprobe.verify import Check

    checks = [Check(f"maps of layer {i} equal the model's own attention weights, batched and alone", 1.0, 1e-6)
              for i in range(3)]
    monkeypatch.setattr(verify, "verify", lambda loaded, texts: checks)
    result = run("verify", "--model", gpt2_dir, "--device", "cpu")
    assert_one_line_error(result, "3 check(s) failed", "layer 2")
    assert len(result.stderr.strip().splitlines()[0]) > 80


def cli_subprocess(*args):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    env.pop("TRANSFORMERS_VERBOSITY", None)  # as a user runs it: transformers at its default verbosity
    return subprocess.run([sys.executable, "-m", "attnprobe", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_no_library_message_reaches_the_output(gpt2_dir, corpus_file, tmp_path):
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    shutil.copytree(gpt2_dir, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin", pickle_protocol=4)
    (pickled / "model.safetensors").unlink()
    done = cli_subprocess("analyze", "--model", pickled, "--corpus", corpus_file, "--out", tmp_path / "a",
                          "--device", "cpu")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert "pickle" in lines[0] and "safetensors" in lines[0]
    done = cli_subprocess("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "b",
                          "--device", "cpu", "--resamples", "20", "--device-map", "auto", "--max-memory", "cpu=20KiB")
    assert done.returncode == 0, done.stderr
    assert "meta device" not in done.stderr and "[transformers]" not in done.stderr and "Warning:" not in \
        done.stderr.replace("Warning: only", ""), done.stderr


# case 15: damaged weights


def test_a_safetensors_tensor_of_the_wrong_shape_is_one_line(gpt2_dir, corpus_file, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(gpt2_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["h.0.attn.c_attn.weight"] = torch.zeros(5, 7)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(analyze(model, corpus_file, tmp_path / "out"), str(model), "another shape", "re-save")


@pytest.mark.parametrize("content", [
    b"GGUF",  # the magic alone
    b"GGUF" + struct.pack("<IQQ", 3, 0, 0),  # a header and nothing else
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"abc",  # a key 2^62 bytes long
])
def test_a_damaged_gguf_is_one_line(corpus_file, tmp_path, content):
    pytest.importorskip("gguf")
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    result = analyze(path, corpus_file, tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert errors == [errors[0]] and f"cannot read GGUF file {path}" in errors[0], result.stderr


# case 10: one huge line


class CountingTokenizer:
    """A tokenizer that remembers the longest text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, texts, *args, **kwargs):
        for text in [texts] if isinstance(texts, str) else texts:
            self.longest = max(self.longest, len(text))
        return self.tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_huge_line_is_cut_before_it_is_tokenized(gpt2_dir, tmp_path, suffix):
    from attnprobe.corpus import CHARS_PER_TOKEN

    huge = "The cat sat on the mat. " * 200_000  # 4.8 MB on one line
    corpus = tmp_path / f"c{suffix}"
    lines = ["Rain fell.", huge, "Birds sing."]
    corpus.write_text("\n".join(json.dumps({"text": t}) if suffix == ".jsonl" else t for t in lines) + "\n",
                      encoding="utf-8")
    loaded = load_model(str(gpt2_dir), "cpu")
    loaded.tokenizer = CountingTokenizer(loaded.tokenizer)
    result = analyze_loaded(loaded, read_corpus(corpus), resamples=20)
    assert 0 < loaded.tokenizer.longest <= loaded.max_length * CHARS_PER_TOKEN
    assert result.run["truncated_sentences"] == 1 and result.run["truncated_lines"][0]["line"] == 2
    assert result.run["longest_sequence"] == loaded.max_length
    assert all(len(example["sentence"]) <= loaded.max_length * CHARS_PER_TOKEN for example in result.examples)


# case 9: a corpus that is no file


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", ".jsonl fifo"])
def test_a_corpus_that_is_not_a_regular_file_is_refused(gpt2_dir, tmp_path, kind):
    import os

    if kind == "/dev/zero":
        corpus = "/dev/zero"
    else:
        corpus = tmp_path / ("c.jsonl" if kind.startswith(".jsonl") else "c.txt")
        os.mkfifo(corpus)  # opening it would wait for a writer forever
    for command in (["analyze", "--out", tmp_path / "out"], ["verify"], ["rollout", "--out", tmp_path / "out"]):
        result = run(command[0], "--model", gpt2_dir, "--corpus", corpus, "--device", "cpu", *command[1:])
        assert_one_line_error(result, f"corpus {corpus} is not a regular file")
    assert not (tmp_path / "out").exists()


# case 18: under torchrun, one line from rank 0


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_under_torchrun_rank_0_alone_prints_the_error(capsys, monkeypatch, tmp_path, rank, lines):
    from attnprobe.cli import main

    monkeypatch.setenv("RANK", rank)
    for args, code in ((["analyze", "--model", "m", "--corpus", tmp_path / "missing.txt", "--out", tmp_path / "o"], 1),
                       (["analyze", "--model", "m", "--corpus", "c.txt", "--batch-size", "x"], 2)):
        monkeypatch.setattr("sys.argv", ["attnprobe", *map(str, args)])
        with pytest.raises(SystemExit) as ended:
            main()
        assert ended.value.code == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == lines and all(line.startswith("Error: ") for line in err), err


# case 7: result files of another run


@pytest.fixture(scope="module")
def other_runs(tmp_path_factory, gpt2_dir):
    """Three runs over one tagged corpus: the 3-layer GPT-2 (seed 0 and seed 1) and a 2-layer Llama."""
    from conftest import SENTENCES, make_llama

    root = tmp_path_factory.mktemp("other_runs")
    corpus = root / "c.txt"
    corpus.write_text("# category: a\n" + "\n".join(SENTENCES[:4]) + "\n# category: b\n" + "\n".join(SENTENCES[4:]),
                      encoding="utf-8")
    llama = make_llama(root / "llama")
    runs = {"gpt2": analyze(gpt2_dir, corpus, root / "gpt2"), "seed1": analyze(gpt2_dir, corpus, root / "seed1",
                                                                                 "--seed", "1"),
            "llama": analyze(llama, corpus, root / "llama_out")}
    for result in runs.values():
        assert result.exit_code == 0, result.output
    folders = {"gpt2": root / "gpt2", "seed1": root / "seed1", "llama": root / "llama_out"}
    for folder in folders.values():
        assert run("classify", "--out", folder).exit_code == 0
    return folders


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older"])
@pytest.mark.parametrize("name", ["positions.csv", "categories.csv", "layers.csv"])
@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_table_of_a_run_of_another_shape_is_refused(other_runs, tmp_path, name, command, older):
    """run.json's record of its files tells the copy; in an older run without one, its layers and heads do."""
    results = tmp_path / "results"
    shutil.copytree(other_runs["llama"], results)  # 2 layers
    shutil.copy(other_runs["gpt2"] / name, results / name)  # 3 layers
    if older:
        unstamp(results)
    assert_one_line_error(run(command, "--out", results), name,
                          "another run" if older else "not written by the run that wrote run.json")
    assert not list(results.glob("*.png")) and not (results / "report.html").exists()


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older"])
def test_resamples_of_another_seed_are_not_paired(other_runs, tmp_path, older):
    """run.json's record of its files tells the copy; in an older run without one, its intervals do."""
    results = tmp_path / "results"
    shutil.copytree(other_runs["gpt2"], results)
    shutil.copy(other_runs["seed1"] / "resamples.npz", results / "resamples.npz")
    if older:
        unstamp(results)
    result = run("compare", other_runs["gpt2"], results, "--out", tmp_path / "cmp")
    assert_one_line_error(result, "resamples.npz", "another run" if older else "not written by the run")
    assert not (tmp_path / "cmp").exists()
    assert run("compare", other_runs["gpt2"], other_runs["seed1"], "--out", tmp_path / "ok").exit_code == 0


@pytest.mark.parametrize("value", ["-1", "0.5", "nan"])
@pytest.mark.parametrize("command", ["plot", "report", "classify"])
def test_a_heads_csv_with_a_layer_that_is_no_layer_is_refused(analyzed, tmp_path, value, command):
    results = tmp_path / "results"
    shutil.copytree(analyzed, results)
    lines = (results / "heads.csv").read_text().splitlines()
    first = lines[1].split(",")
    first[0] = value
    lines[1] = ",".join(first)
    (results / "heads.csv").write_text("\n".join(lines) + "\n")
    before = files_under(results)
    assert_one_line_error(run(command, "--out", results), "heads.csv", "layer", "whole number")
    assert files_under(results) == before
