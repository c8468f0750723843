"""Issue 27, case 15: run.json records the sha256 of every file analyze wrote, and the readers refuse a result file
from another run, even one of a model of the same shape (whose tables fit heads.csv row for row)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import CORPUS_PATH, make_gpt2, restamp
from test_cli import assert_one_line_error, run

from attnprobe import io
from attnprobe.errors import AttnprobeError


def analyzed(folder: Path, model: Path, *extra: str) -> Path:
    """analyze then classify `model` into `folder` (classify: plot then prints no note before its error)."""
    done = run("analyze", "--model", model, "--corpus", CORPUS_PATH, "--out", folder, "--device", "cpu", "--limit",
               "12", "--resamples", "20", *extra)
    assert done.exit_code == 0, done.output
    classified = run("classify", "--out", folder)
    assert classified.exit_code == 0, classified.output
    return folder


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two runs of two tiny GPT-2s of the same shape (3 x 4) but other weights (seeds 0 and 1)."""
    base = tmp_path_factory.mktemp("stamp")
    one, two = (make_gpt2(base / f"model{seed}", seed=seed) for seed in (0, 1))
    return analyzed(base / "a", one), analyzed(base / "b", two)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def written(folder: Path) -> dict[str, float]:
    """Every file of `folder` and its modification time: what a refused command must leave as it was."""
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_run_json_records_the_sha256_of_every_other_file_of_the_run(two_runs):
    a, _ = two_runs
    record = json.loads((a / io.RUN_FILE).read_text(encoding="utf-8"))[io.RUN_FILES_KEY]
    present = {name for name in io.RUN_FILES if (a / name).is_file()}
    assert {io.HEADS_FILE, io.LAYERS_FILE, io.POSITIONS_FILE, io.EXAMPLES_FILE, io.RESAMPLES_FILE} <= present
    assert set(record) == present  # not run.json itself, nor classify's head_types.csv
    assert all(record[name] == sha256(a / name) for name in present)


def test_the_two_runs_have_the_same_shape_and_other_numbers(two_runs):
    """The case's premise: the copied tables fit heads.csv row for row, so only the record can tell."""
    a, b = two_runs
    for name in (io.HEADS_FILE, io.LAYERS_FILE, io.POSITIONS_FILE):
        assert io.read_columns(a, name) == io.read_columns(b, name)
        assert (a / name).read_text().count("\n") == (b / name).read_text().count("\n")
        assert sha256(a / name) != sha256(b / name)


@pytest.mark.parametrize("name", [io.POSITIONS_FILE, io.EXAMPLES_FILE, io.LAYERS_FILE, io.HEADS_FILE])
@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_file_of_another_run_of_a_same_shaped_model_is_refused(two_runs, tmp_path, name, command):
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    shutil.copy2(b / name, target / name)
    before = written(target)
    result = run(command, "--out", target)
    assert_one_line_error(result, f"{name} in {target} was not written by the run that wrote run.json",
                          "sha256 differs", "copy the whole folder")
    assert written(target) == before  # nothing written


@pytest.mark.parametrize("command", ["plot", "report"])
def test_an_untouched_run_still_plots_and_reports(two_runs, tmp_path, command):
    target = tmp_path / "run"
    shutil.copytree(two_runs[0], target)  # a whole folder, copied: still its run's
    result = run(command, "--out", target)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["plot", "report"])
def test_an_older_run_without_a_record_is_read_as_before(two_runs, tmp_path, command):
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    info = json.loads((target / io.RUN_FILE).read_text(encoding="utf-8"))
    del info[io.RUN_FILES_KEY]
    (target / io.RUN_FILE).write_text(json.dumps(info), encoding="utf-8")
    shutil.copy2(b / io.POSITIONS_FILE, target / io.POSITIONS_FILE)  # nothing to tell it by
    result = run(command, "--out", target)
    assert result.exit_code == 0, result.output


def test_a_file_the_run_did_not_write_is_refused(two_runs, tmp_path):
    """A leftover (or a copy) under a name of analyze's that its run.json does not list."""
    target = tmp_path / "run"
    shutil.copytree(two_runs[0], target)
    info = json.loads((target / io.RUN_FILE).read_text(encoding="utf-8"))
    del info[io.RUN_FILES_KEY][io.POSITIONS_FILE]
    (target / io.RUN_FILE).write_text(json.dumps(info), encoding="utf-8")
    assert_one_line_error(run("plot", "--out", target), f"{io.POSITIONS_FILE} in {target} was not written",
                          "the run wrote no positions.csv", "remove it")


def test_a_damaged_copy_is_named_for_its_damage_first(two_runs, tmp_path):
    """The file's own checks run before the sha256 one: a copy that lacks a column says so."""
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    text = (b / io.POSITIONS_FILE).read_text(encoding="utf-8").replace("first_token", "other", 1)
    (target / io.POSITIONS_FILE).write_text(text, encoding="utf-8")
    assert_one_line_error(run("plot", "--out", target), "lacks column(s) first_token")


@pytest.mark.parametrize("command", [["classify"], ["export", "--scores", "kv"]])
def test_other_readers_refuse_a_copied_heads_csv_too(two_runs, tmp_path, command):
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    shutil.copy2(b / io.HEADS_FILE, target / io.HEADS_FILE)
    args = [*command, "--out", target] + (["--to", tmp_path / "exported"] if "export" in command else [])
    assert_one_line_error(run(*args), f"{io.HEADS_FILE} in {target} was not written by the run")


def test_compare_refuses_copied_resamples(two_runs, tmp_path):
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    shutil.copy2(b / io.RESAMPLES_FILE, target / io.RESAMPLES_FILE)
    assert_one_line_error(run("compare", a, target, "--out", tmp_path / "cmp"),
                          f"{io.RESAMPLES_FILE} in {target} was not written by the run")
    assert not (tmp_path / "cmp").exists()
    with pytest.raises(AttnprobeError, match=r"resamples.npz in .* was not written by the run"):
        io.read_resamples(target)


def test_restamp_makes_a_rewritten_file_the_runs_own(two_runs, tmp_path):
    """conftest.restamp: what the tests that stand for a legitimate rewrite use."""
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    shutil.copy2(b / io.POSITIONS_FILE, target / io.POSITIONS_FILE)
    restamp(target)
    assert run("plot", "--out", target).exit_code == 0


def test_a_record_that_is_not_names_and_sha256s_is_refused(two_runs, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(two_runs[0], target)
    info = json.loads((target / io.RUN_FILE).read_text(encoding="utf-8"))
    info[io.RUN_FILES_KEY] = {io.HEADS_FILE: 5}
    (target / io.RUN_FILE).write_text(json.dumps(info), encoding="utf-8")
    assert_one_line_error(run("plot", "--out", target), "files", "not a file name -> sha256 object")


def test_an_edit_after_a_read_is_seen_though_hashes_are_remembered(two_runs, tmp_path):
    """The per-process memory of hashes is keyed by modification time and size: a file changed since is hashed
    again."""
    a, b = two_runs
    target = tmp_path / "run"
    shutil.copytree(a, target)
    io.read_table(target, io.LAYERS_FILE, ["layer"], "attnprobe analyze")
    shutil.copy(b / io.LAYERS_FILE, target / io.LAYERS_FILE)  # a new modification time
    with pytest.raises(AttnprobeError, match="layers.csv in .* was not written by the run"):
        io.read_table(target, io.LAYERS_FILE, ["layer"], "attnprobe analyze")


def test_write_run_is_atomic_and_writes_run_json_last(tmp_path):
    """All temporary files, then all renames: a failure while writing run.json leaves the old folder as it was."""
    out = tmp_path / "out"
    io.write_run(out, {io.HEADS_FILE: io.text_writer("old\n")}, {"n": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(TypeError):
        io.write_run(out, {io.HEADS_FILE: io.text_writer("new\n")}, {"n": object()})  # run.json cannot be written
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary file either
    order = [p.name for p in io.write_run(out, {io.HEADS_FILE: io.text_writer("new\n")}, {"n": 2})]
    assert order == [io.HEADS_FILE, io.RUN_FILE]
    info = json.loads((out / io.RUN_FILE).read_text(encoding="utf-8"))
    assert info == {"n": 2, "files": {io.HEADS_FILE: hashlib.sha256(b"new\n").hexdigest()}}


def test_sentences_parquet_is_recorded_and_checked(tmp_path):
    model = make_gpt2(tmp_path / "model")
    out = tmp_path / "run"
    done = run("analyze", "--model", model, "--corpus", CORPUS_PATH, "--out", out, "--device", "cpu", "--limit",
               "6", "--resamples", "20", "--per-sentence")
    assert done.exit_code == 0, done.output
    record = json.loads((out / io.RUN_FILE).read_text(encoding="utf-8"))[io.RUN_FILES_KEY]
    assert record[io.SENTENCES_FILE] == sha256(out / io.SENTENCES_FILE)
    io.read_sentences(out)
    with open(out / io.SENTENCES_FILE, "ab") as handle:
        handle.write(b"x")
    with pytest.raises(AttnprobeError, match="sentences.parquet in .* was not written by the run"):
        io.read_sentences(out)
