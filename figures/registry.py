"""Figures: named generators of the docs' measured blocks.

A figure has a name (its markers in the docs: `<!-- figure:NAME -->` ... `<!-- /figure -->`), the runs whose
outputs it reads (figures/runs.py), a `collect` function that reads those outputs into plain JSON data, and a
`render` function that formats that data as markdown. `make figures` runs the commands, collects every figure's
data into figures/measured.json, renders it into the docs and copies the figure's images into docs/images/.
Rendering reads only measured.json, so a change of wording or format is `python -m figures --render`, with no
model run, and tests/test_figures.py checks that the committed docs are exactly what the data renders to.

Adding a figure:

    @figure("my-table", runs=("demo",), images={"demo/entropy_heatmap.png": "smollm2-135m-entropy_heatmap.png"})
    def my_table(out: Outputs) -> dict:
        heads = out.csv("demo", "heads.csv")
        return {"sharpest": fmt.head(*heads.loc[heads["entropy"].idxmin(), ["layer", "head"]])}

    @my_table.renderer
    def _(d: dict) -> str:
        return f"The sharpest head is {d['sharpest']}.\\n\\n" + fmt.source("`make demo`")

then put the two marker lines where the block goes, and run `python -m figures --only my-table`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from figures import runs as runs_module


@dataclass
class Figure:
    name: str
    runs: tuple[str, ...]
    collect: Callable[[Outputs], dict]
    images: dict[str, str] = field(default_factory=dict)  # "run/file in its folder" -> name in docs/images
    render: Callable[[dict], str] | None = None

    def renderer(self, fn: Callable[[dict], str]) -> Callable[[dict], str]:
        self.render = fn
        return fn


FIGURES: dict[str, Figure] = {}


def figure(name: str, *, runs: tuple[str, ...], images: dict[str, str] | None = None
           ) -> Callable[[Callable[[Outputs], dict]], Figure]:
    """Register `collect` as figure `name`; decorate its renderer with `@<collect>.renderer`."""

    def register(collect: Callable[[Outputs], dict]) -> Figure:
        if name in FIGURES:
            raise ValueError(f"figure {name!r} is defined twice")
        unknown = [r for r in runs if r not in runs_module.RUNS]
        if unknown:
            raise ValueError(f"figure {name!r} reads unknown runs {unknown}")
        made = Figure(name, tuple(runs), collect, dict(images or {}))
        FIGURES[name] = made
        return made

    return register


class Outputs:
    """The files the runs wrote under the work folder."""

    def __init__(self, work: Path):
        self.work = Path(work)

    def folder(self, run: str) -> Path:
        return self.work / run

    def path(self, run: str, name: str) -> Path:
        return self.work / run / name

    def csv(self, run: str, name: str) -> pd.DataFrame:
        return pd.read_csv(self.path(run, name))

    def json(self, run: str, name: str) -> Any:
        return json.loads(self.path(run, name).read_text(encoding="utf-8"))

    def record(self, run: str) -> dict:
        found = runs_module.record(self.work, run)
        if found is None:
            raise FileNotFoundError(f"run {run!r} has no record in {self.work / '_runs'}")
        return found

    def step(self, run: str, key: str) -> dict:
        """The record of the step of `run` whose key is `key`: its seconds, peak RSS, stdout, stderr."""
        return next(s for s in self.record(run)["steps"] if s["key"] == key)

    def when(self, run: str) -> dict:
        """Date, machine and load average of a run, for the line that says where a timing comes from."""
        rec = self.record(run)
        loads = [s[k] for s in rec["steps"] for k in ("load_average", "load_average_after") if s.get(k) is not None]
        return {"date": rec["date"], "machine": rec["machine"], "load": max(loads) if loads else None}
