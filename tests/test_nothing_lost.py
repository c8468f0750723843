"""Nothing an attnprobe run is given, or has left waiting, is written over or removed (issue 21, cases 1-3)."""

import sys

import pytest
from test_cli import assert_one_line_error, run

from attnprobe import io
from attnprobe.cli import main


def analyze(model, corpus, out, *extra):
    return run("analyze", "--model", model, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples", "20",
               *extra)


@pytest.mark.parametrize("name", ["heads.csv", "run.json", "report.html", "checkpoint.npz", "compare/compare.json"])
def test_a_corpus_named_like_a_result_inside_out_is_refused(gpt2_dir, corpus_file, tmp_path, name):
    out = tmp_path / "out"
    inside = out / name
    inside.parent.mkdir(parents=True)
    text = corpus_file.read_text(encoding="utf-8")
    inside.write_text(text, encoding="utf-8")
    result = analyze(gpt2_dir, inside, out)
    assert_one_line_error(result, "--corpus", "would be overwritten", name, "another --out")
    assert inside.read_text(encoding="utf-8") == text
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [name]


def test_a_symlink_to_the_corpus_does_not_hide_it(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "layers.csv"
    target.write_text(corpus_file.read_text(encoding="utf-8"), encoding="utf-8")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert_one_line_error(analyze(gpt2_dir, link, out), "would be overwritten", "layers.csv")


def test_a_corpus_beside_the_results_under_its_own_name_is_fine(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "sentences.txt"
    mine.write_text(corpus_file.read_text(encoding="utf-8"), encoding="utf-8")
    assert analyze(gpt2_dir, mine, out).exit_code == 0
    assert (out / "heads.csv").is_file() and mine.read_text(encoding="utf-8") == corpus_file.read_text("utf-8")


@pytest.mark.parametrize("command", ["ablate", "rollout"])
def test_the_other_commands_that_read_a_corpus_refuse_too(gpt2_dir, corpus_file, tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    name = {"ablate": "importance.csv", "rollout": "rollout.npz"}[command]
    (out / name).write_text(corpus_file.read_text(encoding="utf-8"), encoding="utf-8")
    result = run(command, "--model", gpt2_dir, "--corpus", out / name, "--out", out, "--device", "cpu")
    assert_one_line_error(result, "would be overwritten", name)


def test_is_result_name_knows_every_file_a_run_writes():
    for name in ("heads.csv", "checkpoint-rank1-of-2.npz", "entropy_heatmap.svg", "probe/probe.csv",
                 "compare/compare_heads.csv", "sentences.parquet", "importance_vs_type.png", "gates.csv",
                 "train_checkpoint.npz", "train_pattern.json", "training.png"):
        assert io.is_result_name(name), name
    for name in ("sentences.txt", "checkpoint_epoch3.npz", "notes/heads.csv", "heads.csv.bak"):
        assert not io.is_result_name(name), name


@pytest.mark.parametrize("names", [["checkpoint.npz"], ["checkpoint-rank0-of-2.npz", "checkpoint-rank1-of-2.npz"]])
def test_a_waiting_checkpoint_of_any_process_count_is_kept(gpt2_dir, corpus_file, tmp_path, names):
    out = tmp_path / "out"
    out.mkdir()
    for name in names:
        (out / name).write_bytes(b"progress " + name.encode())
    result = analyze(gpt2_dir, corpus_file, out)
    assert_one_line_error(result, "holds a stopped run", "--resume", "--overwrite")
    for name in names:
        assert (out / name).read_bytes() == b"progress " + name.encode()
    assert not (out / "heads.csv").exists()


def test_overwrite_starts_afresh_and_discards_the_waiting_checkpoints(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("checkpoint-rank0-of-2.npz", "checkpoint-rank1-of-2.npz"):
        (out / name).write_bytes(b"progress")
    result = analyze(gpt2_dir, corpus_file, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "heads.csv").is_file() and io.checkpoint_files(out) == []


def test_resume_and_overwrite_together_are_refused(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.npz").write_bytes(b"progress")
    result = analyze(gpt2_dir, corpus_file, out, "--resume", "--overwrite")
    assert_one_line_error(result, "--resume and --overwrite")
    assert (out / "checkpoint.npz").read_bytes() == b"progress"


def usage_error(capsys, monkeypatch, *args):
    """attnprobe's own entry point in this process: (exit code, the lines it wrote to stderr)."""
    monkeypatch.setattr(sys, "argv", ["attnprobe", *map(str, args)])
    with pytest.raises(SystemExit) as ended:
        main()
    return ended.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("command", "value"), [("analyze", ""), ("analyze", "  "), ("ablate", ""), ("rollout", ""),
                                                ("probe", ""), ("plot", ""), ("classify", ""), ("report", "")])
def test_an_empty_out_is_refused(capsys, monkeypatch, tmp_path, command, value):
    monkeypatch.chdir(tmp_path)
    model = ["--model", "m"]
    args = {"analyze": [*model, "--corpus", "c.txt"], "ablate": [*model, "--corpus", "c.txt"],
            "rollout": [*model, "--corpus", "c.txt"], "probe": model}
    code, lines = usage_error(capsys, monkeypatch, command, *args.get(command, []), "--out", value)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: ")
    assert "--out" in lines[0] and "empty" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_compare_refuses_an_empty_folder(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for args in (["", "b"], ["a", ""], ["a", "b", "--out", ""]):
        code, lines = usage_error(capsys, monkeypatch, "compare", *args)
        assert code == 2 and len(lines) == 1 and "empty" in lines[0], lines
