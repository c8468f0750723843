"""Issue 42's cases: export names that collided with export's own files, inputs whose read fails, settings the
records left out, repeated or idle options, errors that quoted another run's default, and what logs and figures say.
Each case once lost data, ended in a traceback, or said something wrong or unreadable."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
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
