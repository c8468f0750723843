"""Issue 42's cases: export names that collided with export's own files, inputs whose read fails, settings the
records left out, repeated or idle options, errors that quoted another run's default, and what logs and figures say.
Each case once lost data, ended in a traceback, or said something wrong or unreadable."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from test_adversary_27 import one_error_line
from test_adversary_33_34 import write_retrieval
from typer.testing import CliRunner

from attnprobe.cli import app
from attnprobe.export import PROVENANCE_FILE


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def named_retrieval(folder, name):
    """A retrieval results folder whose model folder is called `name`."""
    write_retrieval(folder, np.arange(8).reshape(2, 4) / 8)
    record = json.loads((folder / "retrieval.json").read_text())
    record["model"] |= {"spec": f"/models/{name}", "source": f"/models/{name}"}
    (folder / "retrieval.json").write_text(json.dumps(record))
    return folder


def check_record(to):
    """attnprobe.json lists only files that are there with the sha256 it records."""
    record = json.loads((to / PROVENANCE_FILE).read_text())
    for entry in record["exports"].values():
        for name, digest in entry["files"].items():
            assert (to / name).is_file() and sha256(to / name) == digest, name
    return record


# ---- item 1: every format's files are apart from the others' and from export's record -----------------------------


def test_a_model_named_attnprobe_keeps_its_retrieval_head_scores(tmp_path):
    folder = named_retrieval(tmp_path / "r", "attnprobe")
    result = invoke("export", "--out", folder, "--format", "retrieval-head", "--to", tmp_path / "to")
    assert result.exit_code == 0, result.output
    scores = json.loads((tmp_path / "to" / "attnprobe.retrieval-head.json").read_text())
    assert scores["1-3"] == [7 / 8]
    assert set(check_record(tmp_path / "to")["exports"]) == {"retrieval-head"}


@pytest.mark.parametrize("order", [("duo-attention", "retrieval-head"), ("retrieval-head", "duo-attention")])
def test_a_model_named_config_keeps_both_formats_in_one_folder(tmp_path, order):
    folder = named_retrieval(tmp_path / "r", "Config")  # case-blind: macOS folders take Config.json for config.json
    to = tmp_path / "to"
    for fmt in order:
        result = invoke("export", "--out", folder, "--format", fmt, "--to", to)
        assert result.exit_code == 0, result.output
    assert json.loads((to / "config.json").read_text()) == {"sink_size": 4, "recent_size": 256}
    assert json.loads((to / "Config.retrieval-head.json").read_text())["0-1"] == [1 / 8]
    assert set(check_record(to)["exports"]) == {"duo-attention", "retrieval-head"}
    assert sorted(p.name for p in to.iterdir()) == sorted(["Config.retrieval-head.json", "attnprobe.json",
                                                           "config.json", "full_attention_heads.tsv"])


def test_the_record_drops_an_earlier_export_whose_file_this_one_replaces(tmp_path):
    from attnprobe.export import provenance

    to = tmp_path / "to"
    to.mkdir()
    (to / "x.json").write_text("old")
    earlier = {"exports": {"retrieval-head": {"files": {"x.json": sha256(to / "x.json")}}}}
    scores = type("S", (), {"model": {}, "results": None, "source": "kv", "secondary_name": None, "sink": 4,
                            "recent": 8, "sizes_from": "x"})()
    record = provenance(earlier, scores, "duo-attention", {"X.json": "new digest"}, to)
    assert set(record["exports"]) == {"duo-attention"}


# ---- item 2: a full disk under the results-folder lock, a haystack whose read fails --------------------------------


def test_a_full_disk_under_the_lock_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, gpt2_dir):
    import errno
    import os

    from attnprobe import lock

    real_write = os.write

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(lock.LOCK_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    out = tmp_path / "out"
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n", encoding="utf-8")
    line = one_error_line(invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out))
    assert "lock file" in line and "No space left on device" in line and "--out" in line
    assert not out.exists()  # the folder the lock made goes with its empty lock file
    out.mkdir()
    one_error_line(invoke("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out))
    assert list(out.iterdir()) == []


def unreadable(monkeypatch, path):
    """`path` opens but cannot be read, as a file on a failing disk or one this user may not read."""
    import pathlib

    real_open = pathlib.Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refuse)


@pytest.mark.parametrize("command", [["retrieval"], ["train-pattern"]])
def test_a_haystack_whose_read_fails_is_one_line(tmp_path, monkeypatch, command):
    line = one_error_line(invoke(*command, "--model", tmp_path / "m", "--haystack", "/proc/self/mem", "--out",
                                 tmp_path / "o"))
    assert line.startswith("Error: cannot read --haystack /proc/self/mem: ") and "Input/output error" in line
    text = tmp_path / "h.txt"
    text.write_text("A long text.\n", encoding="utf-8")
    unreadable(monkeypatch, text)
    line = one_error_line(invoke(*command, "--model", tmp_path / "m", "--haystack", text, "--out", tmp_path / "o"))
    assert f"cannot read --haystack {text}: Permission denied" in line


def test_a_haystack_reads_as_before(tmp_path):
    from attnprobe.retrieval import read_haystack

    path = tmp_path / "h.txt"
    for data in (b"\xef\xbb\xbfOne\r\ntwo\rthree\n\nfour", b"  x  ", b"caf\xc3\xa9\n" * 40_000):
        path.write_bytes(data)
        assert read_haystack(path) == path.read_text(encoding="utf-8")
    path.write_bytes(b"ok \xff")
    with pytest.raises(Exception, match="is not UTF-8 text \\(byte 3\\)"):
        read_haystack(path)
