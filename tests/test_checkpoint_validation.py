"""A checkpoint is read from disk, so nothing in it is trusted (issue 27, cases 1, 2, 5, 9 and 14): each field is
checked against the others and against the run being resumed, and a checkpoint that fails is refused in one line,
with a non-zero exit, the file left as it was and no result written."""

import contextlib
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import SENTENCES
from test_cli import assert_one_line_error, run

from attnprobe import io
from attnprobe.commands import analyze as analyze_command
from attnprobe.errors import AttnprobeError
from attnprobe.resume import OTHER_MAPS

BATCHES = 12  # 24 sentences in batches of 2


def analyze(model, corpus, out, *extra):
    return run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples", "20",
               "--batch-size", "2", *extra)


@contextlib.contextmanager
def stopping_after(batches):
    """analyze's stop requests, answered yes after `batches` batches (as a Ctrl-C then would)."""
    calls = []

    @contextlib.contextmanager
    def requests():
        yield lambda: calls.append(1) or len(calls) >= batches

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(analyze_command, "stop_requests", requests)
        yield


def stop(model, corpus, out, batches, *extra):
    """A real checkpoint: analyze stopped after `batches` batches."""
    with stopping_after(batches):
        result = analyze(model, corpus, out, *extra)
    assert result.exit_code == 130, result.output
    assert (out / "checkpoint.npz").is_file() and not (out / "heads.csv").exists()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("\n".join(SENTENCES * 3) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, gpt2_dir, corpus):
    """Checkpoints stopped early (the example sentence's batch not yet run) and late (run)."""
    root = tmp_path_factory.mktemp("stopped")
    early, late = stop(gpt2_dir, corpus, root / "early", 2), stop(gpt2_dir, corpus, root / "late", 11)
    with np.load(early / "checkpoint.npz") as data:
        assert "example_maps" not in data
    with np.load(late / "checkpoint.npz") as data:
        assert "example_maps" in data
    return {"early": early, "late": late}


@pytest.fixture(scope="module")
def whole(tmp_path_factory, gpt2_dir, corpus):
    out = tmp_path_factory.mktemp("whole")
    assert analyze(gpt2_dir, corpus, out).exit_code == 0
    return out


def arrays(folder, name="checkpoint.npz"):
    with np.load(folder / name, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def tampered(stopped, tmp_path, change, which="late"):
    """A copy of a stopped run whose checkpoint `change` (a function of its arrays) has altered."""
    out = tmp_path / "out"
    shutil.copytree(stopped[which], out)
    fields = arrays(out)
    change(fields)
    np.savez_compressed(out / "checkpoint.npz", **fields)
    return out


def meta(fields):
    return json.loads(str(fields["meta"]))


def set_meta(fields, **changes):
    fields["meta"] = np.array(json.dumps({**meta(fields), **changes}))


def assert_refused(model, corpus, out, *fragments):
    """--resume gives one error line holding `fragments`, exits 1, and leaves the checkpoint and no result."""
    before = (out / "checkpoint.npz").read_bytes()
    result = analyze(model, corpus, out, "--resume")
    assert_one_line_error(result, *fragments)
    line = result.stderr.strip()
    assert "np." not in line and "Traceback" not in result.output
    assert (out / "checkpoint.npz").read_bytes() == before
    assert not (out / "heads.csv").exists() and not (out / "run.json").exists()
    return line


@pytest.mark.parametrize("which", ["early", "late"])
def test_an_untouched_checkpoint_resumes_to_the_uninterrupted_results(gpt2_dir, corpus, stopped, whole, tmp_path,
                                                                        which):
    out = tmp_path / "out"
    shutil.copytree(stopped[which], out)
    result = analyze(gpt2_dir, corpus, out, "--resume")
    assert result.exit_code == 0, result.output
    assert io.checkpoint_files(out) == []
    for name in ("heads.csv", "layers.csv", "positions.csv", "top_tokens.csv"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


# ---- case 1: the fields agree with each other and with the run --------------------------------------------------


@pytest.mark.parametrize("done", [10, 12])
def test_batches_done_that_disagrees_with_the_sums_is_refused(gpt2_dir, corpus, stopped, tmp_path, done):
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, batches_done=done))
    line = assert_refused(gpt2_dir, corpus, out, f"batches_done = {done}", "its sums hold 22 sentences",
                          "delete it and run without --resume")
    assert "checkpoint.npz" in line


def test_batches_done_beyond_the_run_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, batches_done=BATCHES + 1))
    assert_refused(gpt2_dir, corpus, out, f"batches_done = {BATCHES + 1}", f"the run has {BATCHES} batches")


def test_all_batches_done_with_the_sums_of_a_few_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, batches_done=BATCHES), which="early")
    assert_refused(gpt2_dir, corpus, out, f"batches_done = {BATCHES}", "its sums hold 4 sentences")


@pytest.mark.parametrize("value", [-1, 1e18, 1e12, -5, 2.5, 3])
def test_a_wrong_pending_fill_is_refused(gpt2_dir, corpus, stopped, tmp_path, value):
    def change(fields):
        fields["sum:pending/fill"][0] = value

    out = tampered(stopped, tmp_path, change)
    plain = str(int(value)) if float(value).is_integer() else str(value)
    assert_refused(gpt2_dir, corpus, out, "pending/fill", plain)


@pytest.mark.parametrize("value", [-1, 1e18, 1e12, -5, 24])
def test_a_pending_index_outside_the_corpus_is_refused(gpt2_dir, corpus, stopped, tmp_path, value):
    def change(fields):
        fields["sum:pending/index"][0] = value

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "pending/index holds", str(int(value)))


def test_a_sentence_pending_twice_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["sum:pending/index"][1] = fields["sum:pending/index"][0]

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "pending/index holds a sentence twice")


@pytest.mark.parametrize("key", ["count/entropy", "rows", "wcount/entropy", "tokcount", "pending/present"])
def test_negative_counts_are_refused(gpt2_dir, corpus, stopped, tmp_path, key):
    def change(fields):
        fields[f"sum:{key}"].flat[0] = -780

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, f"{key} holds -780", "whole number of 0 or more")


def test_a_fractional_count_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["sum:count/entropy"].flat[3] += 0.5

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "count/entropy holds", ".5")


def test_a_count_above_the_sentences_held_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["sum:count/entropy"].flat[0] = 500

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "count/entropy counts 500 sentences", "its sums hold 22")


def test_a_sum_without_a_count_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        empty = fields["sum:bincount/entropy"] == 0  # the bins no sentence reaches
        assert empty.any()
        fields["sum:binsum/entropy"][empty] = 3.0

    out = tampered(stopped, tmp_path, change, which="early")  # its short sentences leave the last bins empty
    assert_refused(gpt2_dir, corpus, out, "binsum/entropy holds 3", "counts no sentence")


@pytest.mark.parametrize("key", ["sum/entropy", "wsum/entropy", "count/entropy"])
def test_sums_in_another_dtype_are_refused(gpt2_dir, corpus, stopped, tmp_path, key):
    def change(fields):
        fields[f"sum:{key}"] = fields[f"sum:{key}"].astype(np.float16)

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, f"sum {key} is float16", "attnprobe writes float64")


def test_a_deeply_nested_meta_record_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["meta"] = np.array("[" * 100_000 + "]" * 100_000)

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "damaged", "meta record is not the JSON", "without --resume")


def test_a_nested_fingerprint_value_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        record = meta(fields)
        record["fingerprint"]["seed"] = [[[0]]]
        fields["meta"] = np.array(json.dumps(record))

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "not a number or a text")


# ---- case 2: the example maps -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "shown"), [(np.nan, "nan"), (7.0, "7"), (-0.25, "-0.25")])
def test_example_maps_that_are_not_probabilities_are_refused(gpt2_dir, corpus, stopped, tmp_path, value, shown):
    def change(fields):
        fields["example_maps"][1, 2, 3, 0] = value

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, f"example_maps holds {shown}", "not a probability")


def test_example_map_rows_that_do_not_sum_to_one_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["example_maps"] *= np.float32(0.5)

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "a row of example_maps sums to 0.5")


def test_example_maps_gone_from_a_batch_marked_done_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    out = tampered(stopped, tmp_path, lambda f: f.pop("example_maps"))
    assert_refused(gpt2_dir, corpus, out, "covers the example sentence's batch", "no example_maps")


def test_example_maps_before_their_batch_ran_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    maps = arrays(stopped["late"])["example_maps"]
    out = tampered(stopped, tmp_path, lambda f: f.update(example_maps=maps), which="early")
    assert_refused(gpt2_dir, corpus, out, "holds example_maps", "does not reach the example sentence's batch")


def test_example_maps_in_another_dtype_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    def change(fields):
        fields["example_maps"] = fields["example_maps"].astype(np.float16)

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "example_maps is float16", "float32")


# ---- case 5: a folder in place of the checkpoint; plain numbers in messages ------------------------------------


@pytest.mark.parametrize("resume", [True, False])
def test_a_folder_named_checkpoint_npz_is_named_as_a_folder(gpt2_dir, corpus, tmp_path, resume):
    out = tmp_path / "out"
    (out / "checkpoint.npz").mkdir(parents=True)
    (out / "checkpoint.npz" / "mine.txt").write_text("kept", encoding="utf-8")
    result = analyze(gpt2_dir, corpus, out, *(["--resume"] if resume else []))
    assert_one_line_error(result, "checkpoint.npz is a folder, not a checkpoint", "move or rename it")
    assert "but checkpoint.npz" not in result.stderr
    assert (out / "checkpoint.npz" / "mine.txt").read_text(encoding="utf-8") == "kept"
    assert not (out / "heads.csv").exists()


def test_a_table_value_is_named_as_a_plain_number(tmp_path):
    pd.DataFrame({"layer": [0, 0.5], "head": [0, 1], "entropy": [1.0, 2.0]}).to_csv(tmp_path / "heads.csv",
                                                                                      index=False)
    with pytest.raises(AttnprobeError) as refused:
        io.read_table(tmp_path, "heads.csv", ["layer", "head", "entropy"], "attnprobe analyze")
    assert "(0.5)" in str(refused.value) and "np." not in str(refused.value)


# ---- case 9: the tokenizer is part of the run's fingerprint -----------------------------------------------------


def test_a_changed_tokenizer_is_refused(gpt2_dir, corpus, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(gpt2_dir, model)
    out = stop(model, corpus, tmp_path / "out", 3)
    path = model / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]  # same size, other ids
    path.write_text(json.dumps(tokenizer), encoding="utf-8")
    line = assert_refused(model, corpus, out, "tokenizer", "changed since the checkpoint was made")
    assert "--resume" in line


# ---- case 14: --overwrite keeps the stopped run's checkpoint until it completes --------------------------------


@pytest.mark.parametrize("every", ["300", "0"])
def test_overwrite_keeps_the_stopped_checkpoint_until_it_completes(gpt2_dir, corpus, stopped, whole, tmp_path,
                                                                   every):
    out = tmp_path / "out"
    shutil.copytree(stopped["late"], out)
    original = (out / "checkpoint.npz").read_bytes()
    with stopping_after(3):  # stopped (or killed) after its first save
        result = analyze(gpt2_dir, corpus, out, "--overwrite", "--checkpoint-every", every)
    assert result.exit_code == 130, result.output
    assert "--resume in place of --overwrite" in result.stderr
    assert (out / "checkpoint.npz").read_bytes() == original
    assert meta(arrays(out, "checkpoint-overwrite.npz"))["batches_done"] == 3
    assert not (out / "heads.csv").exists()
    resumed = analyze(gpt2_dir, corpus, out, "--resume")  # continues the replacing run, the later
    assert resumed.exit_code == 0, resumed.output
    assert io.checkpoint_files(out) == []  # both go once it completes
    for name in ("heads.csv", "layers.csv", "positions.csv"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_plain_run_still_refuses_the_checkpoint_an_overwrite_left(gpt2_dir, corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-overwrite.npz").write_bytes(b"progress")
    assert_one_line_error(analyze(gpt2_dir, corpus, out), "holds a stopped run", "--resume")
    assert (out / "checkpoint-overwrite.npz").read_bytes() == b"progress"
    assert io.is_result_name("checkpoint-overwrite.npz") and io.is_result_name("checkpoint-rank1-of-2-overwrite.npz")


# ---- the checks know every batching: windows cut in the middle, the block bootstrap of few sentences -----------


@pytest.mark.parametrize(("sentences", "window", "batches"), [(24, 5, 4), (24, 5, 6), (3, 4096, 1)])
def test_checkpoints_of_other_batchings_resume_to_the_uninterrupted_results(gpt2_dir, tmp_path, monkeypatch,
                                                                          sentences, window, batches):
    from attnprobe import batching

    monkeypatch.setattr(batching, "WINDOW_SENTENCES", window)  # windows of 5: batches of 2, 2, 1 each
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join((SENTENCES * 3)[:sentences]) + "\n", encoding="utf-8")
    assert analyze(gpt2_dir, corpus, tmp_path / "whole").exit_code == 0
    out = stop(gpt2_dir, corpus, tmp_path / "out", batches)
    result = analyze(gpt2_dir, corpus, out, "--resume")
    assert result.exit_code == 0, result.output
    for name in ("heads.csv", "layers.csv", "positions.csv"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    if sentences < 5:
        assert json.loads((out / "run.json").read_text(encoding="utf-8"))["bootstrap"]["method"] == "block"


# ---- the threads the stopped run used ------------------------------------------------------------------------------


def test_a_checkpoint_records_its_threads_and_auto_resumes_at_them(gpt2_dir, corpus, stopped, tmp_path):
    assert meta(arrays(stopped["late"]))["threads"] >= 1  # torch's threads while it ran
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, threads=1))
    result = analyze(gpt2_dir, corpus, out, "--resume", "--threads", "auto")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "run.json").read_text())["threads"]
    assert record["requested"] == "auto" and record["resumed"] == 1 and record["threads"] == 1
    assert "Note:" not in result.stderr


def test_resuming_at_other_threads_runs_and_says_what_it_costs(gpt2_dir, corpus, stopped, tmp_path):
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, threads=2))
    result = analyze(gpt2_dir, corpus, out, "--resume", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "the stopped run used 2 threads and this one --threads 1" in result.stderr
    assert "not byte for byte" in result.stderr and "resume with --threads 2 or auto" in result.stderr
    record = json.loads((out / "run.json").read_text())["threads"]
    assert record["threads"] == 1 and "resumed" not in record


def test_a_checkpoint_without_threads_resumes_as_a_new_run_chooses(gpt2_dir, corpus, stopped, whole, tmp_path):
    def older(fields):  # an attnprobe before the field: no threads in meta
        record = meta(fields)
        del record["threads"]
        fields["meta"] = np.array(json.dumps(record))

    out = tampered(stopped, tmp_path, older)
    result = analyze(gpt2_dir, corpus, out, "--resume")
    assert result.exit_code == 0, result.output
    assert "resumed" not in json.loads((out / "run.json").read_text())["threads"]


@pytest.mark.parametrize(("value", "shown"), [(-1, "-1"), ("two", "two"), (True, "True"), (1.5, "1.5")])
def test_a_threads_record_that_is_not_a_count_is_refused(gpt2_dir, corpus, stopped, tmp_path, value, shown):
    out = tampered(stopped, tmp_path, lambda f: set_meta(f, threads=value))
    assert_refused(gpt2_dir, corpus, out, f"threads = {shown} is not a whole number of threads", "damaged")


# ---- the other example sentences' maps ---------------------------------------------------------------------------


def other_maps(fields):
    return {key: value for key, value in fields.items() if key.startswith(OTHER_MAPS)}


def test_the_other_examples_maps_resume_from_the_checkpoint(gpt2_dir, corpus, stopped, whole, tmp_path):
    """The maps of the examples captured before the stop come back from the checkpoint (measured alone instead, they
    round differently from their batch): a checkpoint's maps, changed to other valid maps, are what examples.npz
    then holds; untouched, examples.npz is the uninterrupted run's byte for byte."""
    saved = other_maps(arrays(stopped["late"]))
    assert set(other_maps(arrays(stopped["early"]))) < set(saved)  # the late stop ran more of their batches
    key = sorted(saved)[0]
    index = int(key[len(OTHER_MAPS):])

    def uniform(fields):  # causal rows spread evenly: attention maps still, but not the model's
        maps = fields[key]
        rows = np.tril(np.ones(maps.shape[-2:], dtype=maps.dtype))
        fields[key] = np.broadcast_to(rows / rows.sum(-1, keepdims=True), maps.shape).copy()

    out = tampered(stopped, tmp_path, uniform)
    result = analyze(gpt2_dir, corpus, out, "--resume")
    assert result.exit_code == 0, result.output
    with np.load(out / "examples.npz") as data:
        which = [i for i in range(int(data["count"])) if int(data[f"index_{i}"]) == index]
        assert which, "the example is written"
        maps = data[f"maps_{which[0]}"]
        assert np.array_equal(maps, np.broadcast_to(maps[0, 0], maps.shape))  # the checkpoint's, not measured again
    copy = tmp_path / "untouched"
    shutil.copytree(stopped["late"], copy)
    assert analyze(gpt2_dir, corpus, copy, "--resume").exit_code == 0
    assert (copy / "examples.npz").read_bytes() == (whole / "examples.npz").read_bytes()


def test_other_example_maps_the_run_does_not_keep_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    def stranger(fields):
        key = sorted(other_maps(fields))[0]
        fields[f"{OTHER_MAPS}9999"] = fields.pop(key)

    out = tampered(stopped, tmp_path, stranger)
    assert_refused(gpt2_dir, corpus, out, f"{OTHER_MAPS}9999", "not one of the examples")


def test_other_example_maps_of_another_shape_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    def cut(fields):
        key = sorted(other_maps(fields))[0]
        fields[key] = fields[key][:, :, :-1, :-1].copy()

    out = tampered(stopped, tmp_path, cut)
    assert_refused(gpt2_dir, corpus, out, "has shape", "this run")


@pytest.mark.parametrize(("change", "words"), [
    (lambda maps: maps.__setitem__((0, 0, 1, 0), np.nan), "not a probability"),
    (lambda maps: maps.__imul__(np.float32(0.5)), "sums to 0.5"),
])
def test_other_example_maps_that_are_not_attention_are_refused(gpt2_dir, corpus, stopped, tmp_path, change, words):
    out = tampered(stopped, tmp_path, lambda fields: change(fields[sorted(other_maps(fields))[0]]))
    assert_refused(gpt2_dir, corpus, out, OTHER_MAPS, words)


def test_other_example_maps_before_their_batch_ran_are_refused(gpt2_dir, corpus, stopped, tmp_path):
    early, late = other_maps(arrays(stopped["early"])), other_maps(arrays(stopped["late"]))
    later = {key: value for key, value in late.items() if key not in early}  # of batches the early stop had not run
    assert later
    out = tampered(stopped, tmp_path, lambda fields: fields.update(later), which="early")
    assert_refused(gpt2_dir, corpus, out, "does not reach corpus sentence")


def test_a_misnamed_other_example_array_is_refused(gpt2_dir, corpus, stopped, tmp_path):
    out = tampered(stopped, tmp_path, lambda fields: fields.update({f"{OTHER_MAPS}x": np.zeros((1, 1, 1, 1))}))
    assert_refused(gpt2_dir, corpus, out, f"unknown array {OTHER_MAPS}x")
