"""Nothing silently wrong (issue 21, cases 4 on): tampered or stale inputs get one plain line, not a wrong result."""


import pytest
from conftest import make_gpt2
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
