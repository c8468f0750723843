"""report.html's Circuit section: shown when a results folder holds the circuit command's edges.csv and
circuit.json, made from those files alone (test_report.py checks it inside a whole page)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from attnprobe.errors import AttnprobeError
from attnprobe.report import CIRCUIT_EDGES, CIRCUIT_RECORD, circuit_sections

EDGES = [  # sender, receiver, input, score, in_circuit
    ("input", "a0.h1", "q", 0.2, False), ("a0.h1", "a1.h0", "k", -1.5, True), ("a0.h0", "m0", "", 0.05, False),
    ("m0", "a1.h1", "v", 0.9, True), ("a1.h0", "logits", "", 2.5, True), ("m1", "logits", "", -0.4, True),
]
CURVE = [{"edges": k, "fraction": k / 6, "faithfulness": f, "random_mean": r, "random_low": r - 0.1,
          "random_high": r + 0.1} for k, f, r in ((1, 0.6, 0.0), (2, 0.9, 0.1), (4, 1.0, 0.3), (6, 1.0, 1.0))]


def write_circuit(folder: Path, *, in_circuit: bool = True, curve: bool = True) -> None:
    """A small circuit command's output in `folder`: edges.csv of a 2 x 2 model and circuit.json."""
    edges = pd.DataFrame(EDGES, columns=["sender", "receiver", "input", "score", "in_circuit"])
    edges.drop(columns=[] if in_circuit else ["in_circuit"]).to_csv(folder / CIRCUIT_EDGES, index=False)
    record = {"cpr": 0.8123, "cmd": 0.0456, "curve": CURVE if curve else [],
              "settings": {"task": "ioi", "pairs": 16, "method": "EAP-IG", "model": "<b>tiny</b>",
                           "ignored": {"nested": 1}}}
    (folder / CIRCUIT_RECORD).write_text(json.dumps(record), encoding="utf-8")


def write_command_record(folder: Path) -> None:
    """circuit.json as `attnprobe circuit` lays it out: the scores and the curve under "faithfulness", the settings
    as its own keys, the graph's shape under "graph", notes."""
    record = {"model": {"spec": "tiny-model"}, "pairs": {"from": "task ioi", "count": 16}, "method": "eap-ig",
              "steps": 5, "metric": "logit-diff", "graph": {"layers": 3, "heads": 2, "edges": 6},
              "circuit": {"chosen_by": "top", "top": 4, "threshold": None, "edges": [{"sender": "a1.h0"}] * 4},
              "faithfulness": {"ablation": "patch", "clean": 2.5, "corrupt": -0.25, "cpr": 0.71, "cmd": 0.3,
                               "random_cpr": 0.12, "random_cmd": 0.88, "curve": CURVE},
              "notes": ["the clean and corrupt metric differ by only +0.05"]}
    (folder / CIRCUIT_RECORD).write_text(json.dumps(record), encoding="utf-8")


def images(markup: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', markup)]


def test_no_section_without_both_files(tmp_path):
    assert circuit_sections(tmp_path) == []
    write_circuit(tmp_path)
    (tmp_path / CIRCUIT_RECORD).unlink()
    assert circuit_sections(tmp_path) == []


def test_the_section_shows_scores_settings_figures_and_the_strongest_edges(tmp_path):
    write_circuit(tmp_path)
    (section,) = circuit_sections(tmp_path)
    assert (section.id, section.title) == ("circuit", "Circuit")
    assert "CPR 0.8123" in section.html and "CMD 0.0456" in section.html
    assert "<td>&lt;b&gt;tiny&lt;/b&gt;</td>" in section.html and "nested" not in section.html
    pictures = images(section.html)
    assert len(pictures) == 2 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pictures)
    assert 'alt="the circuit: 4 of 6 edges, by layer"' in section.html
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td>"
                      r"<td>(yes|no)</td></tr>", section.html)
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    assert rows[0] == ("1", "a1.h0", "logits", "-", "+2.5", "yes")  # the largest |score| first
    assert rows[1] == ("2", "a0.h1", "a1.h0", "k", "-1.5", "yes")
    assert rows[-1] == ("6", "a0.h0", "m0", "-", "+0.05", "no")


def test_without_in_circuit_the_strongest_edges_are_drawn_and_without_a_curve_it_says_so(tmp_path):
    write_circuit(tmp_path, in_circuit=False, curve=False)
    (section,) = circuit_sections(tmp_path)
    assert "marks no circuit (no in_circuit column): the 50 strongest edges are drawn" in section.html
    assert "holds no faithfulness curve" in section.html
    assert len(images(section.html)) == 1 and 'alt="the circuit: 6 of 6 edges' in section.html


def test_an_edge_table_without_its_node_columns_is_refused_by_name(tmp_path):
    write_circuit(tmp_path)
    pd.read_csv(tmp_path / CIRCUIT_EDGES).drop(columns="receiver").to_csv(tmp_path / CIRCUIT_EDGES, index=False)
    with pytest.raises(AttnprobeError, match=r"edges\.csv lacks column\(s\) receiver: run `attnprobe circuit`"):
        circuit_sections(tmp_path)


def test_the_circuit_commands_own_layout_is_read_too(tmp_path, monkeypatch):
    """Scores and curve under "faithfulness", settings as the command's keys, the layer count from "graph" (3 rows
    although the edges name only 2 layers), its notes shown."""
    from attnprobe import plotting

    drawn_layers = []
    original = plotting.circuit_figure
    monkeypatch.setattr(plotting, "circuit_figure", lambda edges, layers: drawn_layers.append(layers) or original(
        edges, layers))
    write_circuit(tmp_path)
    write_command_record(tmp_path)
    (section,) = circuit_sections(tmp_path)
    assert drawn_layers == [3]
    assert "CPR 0.7100" in section.html and "CMD 0.3000" in section.html
    assert "random circuits of the same sizes: CPR 0.1200" in section.html
    assert "clean +2.5000, corrupt -0.2500" in section.html
    assert "<li>the clean and corrupt metric differ by only +0.05</li>" in section.html
    for label, value in (("model", "tiny-model"), ("method", "eap-ig"), ("pairs", "16"), ("top", "4"),
                         ("edges in the circuit", "4"), ("ablation", "patch")):
        assert f'<th scope="row">{label}</th><td>{value}</td>' in section.html
    assert "threshold" not in section.html  # None: not a setting that was used
    assert len(images(section.html)) == 2
