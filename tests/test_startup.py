"""The CLI starts fast: --help, classify and plot never import torch or transformers."""

import subprocess
import sys

PROBE = """
import sys
from attnprobe.cli import app
for args in {runs!r}:
    try:
        app(args, standalone_mode=False)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def heavy_modules_after(runs):
    done = subprocess.run([sys.executable, "-c", PROBE.format(runs=runs)], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_help_imports_no_torch():
    assert heavy_modules_after([["--help"], ["analyze", "--help"], ["verify", "--help"], ["compose", "--help"]]) == "[]"


def test_classify_and_plot_import_no_torch(tmp_path):
    # results to work on: a hand-made heads.csv and layers.csv are all classify needs
    import pandas as pd
    from typer.testing import CliRunner

    from attnprobe.cli import app

    heads = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "entropy": [0.1, 2.0, 1.0, 0.5],
                          "entropy_norm": [0.1, 0.9, 0.5, 0.3], "diagonal": [0.95, 0.2, 0.4, 0.3]})
    heads["entropy_unforced"], heads["diagonal_unforced"] = heads["entropy"], heads["diagonal"]
    heads.to_csv(tmp_path / "heads.csv", index=False)
    assert CliRunner().invoke(app, ["classify", "--out", str(tmp_path)]).exit_code == 0
    assert heavy_modules_after([["classify", "--out", str(tmp_path)], ["plot", "--out", str(tmp_path)]]) == "[]"
