"""What a newcomer reads first (issue 27): `analyze --help` in groups, and tables that keep their rows in a pipe."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from attnprobe.cli import app
from attnprobe.commands import common

ROOT = Path(__file__).resolve().parent.parent
PANELS = ["Input:", "Scores:", "Run control:", "Output:", "Options:"]


def sections(text: str) -> dict[str, list[str]]:
    """The help's sections (lines ending in ':' at column 0) and the option names listed in each."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = found.setdefault(line, [])
        elif current is not None and line.startswith("  -"):
            current.append(line.split()[0].rstrip(","))
    return found


def test_analyze_help_groups_every_option_under_one_heading():
    result = CliRunner().invoke(app, ["analyze", "--help"])
    assert result.exit_code == 0, result.output
    found = sections(result.output)
    assert list(found) == PANELS, list(found)
    assert found["Input:"][:2] == ["-m", "-c"] and "--split" in found["Input:"] and "--limit" in found["Input:"]
    assert {"--resamples", "--value-weighted", "--top-tokens", "--top-tokens-min"} <= set(found["Scores:"])
    assert {"--threads", "--resume", "--device", "-b"} <= set(found["Run control:"])
    assert found["Output:"] == ["--out", "--per-sentence", "--head-examples"]
    assert found["Options:"] == ["-h"]
    command = typer.main.get_command(app).commands["analyze"]
    options = [p for p in command.params if p.param_type_name == "option"]
    assert sum(len(names) for names in found.values()) == len(options) + 1  # each once; +1: --help


def test_the_corpus_help_names_every_format_and_the_tags():
    result = CliRunner().invoke(app, ["analyze", "--help"])
    text = " ".join(result.output.split())
    assert ".jsonl" in text and ".parquet" in text and "# category: NAME" in text


def test_other_commands_keep_one_options_section():
    """The shared --model option's panel is analyze's alone: ablate's help is click's usual single list."""
    result = CliRunner().invoke(app, ["ablate", "--help"])
    assert list(sections(result.output)) == ["Options:"]
    assert "-m, --model" in result.output


@pytest.mark.parametrize(("tty", "columns", "want"), [
    (True, "", None), (False, "", common.PIPE_WIDTH), (False, "200", 200), (False, "junk", common.PIPE_WIDTH),
])
def test_stdout_width(monkeypatch, tty, columns, want):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty, raising=False)
    monkeypatch.setenv("COLUMNS", columns)
    assert common.stdout_width() == want


def narrow_terminal(columns: int) -> tuple[int, int]:
    """A pseudo-terminal `columns` wide (leader, follower): the terminal the command is started from. The leader
    stays open while the command runs: once it is closed the follower reports no size."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    assert os.get_terminal_size(follower).columns == columns
    return leader, follower


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal with a set size: Linux")
def test_a_table_piped_from_a_narrow_terminal_keeps_its_rows(gpt2_dir, tmp_path):
    """`attnprobe analyze ... | tee log` from a 50-column terminal: Rich took the terminal's width from stdin and
    stderr and wrapped the summary's rows (57 columns) in the log. Piped, stdout's tables are PIPE_WIDTH wide."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\nRain fell.\nBirds sing.\n", encoding="utf-8")
    leader, terminal = narrow_terminal(50)
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    try:
        done = subprocess.run([sys.executable, "-m", "attnprobe", "analyze", "--model", str(gpt2_dir), "--corpus",
                               str(corpus), "--out", str(tmp_path / "out"), "--device", "cpu", "--resamples", "50"],
                              stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                              timeout=300)
    finally:
        os.close(terminal)
        os.close(leader)
    assert done.returncode == 0, done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("│ early - late")]
    assert len(rows) == 1, done.stdout  # before: "│ early - late │ -0.222 │ [-0.261," and the rest below
    assert rows[0].rstrip().endswith("│") and "[" in rows[0] and "]" in rows[0], done.stdout  # the whole row


def test_every_command_summary_in_the_top_help_is_whole():
    """`attnprobe --help` lists each command with click's short help: the first sentence, cut at 45 characters
    with "...". A period inside the first sentence ("Wu et al.") cut retrieval's at "(Wu et al." (issue 34)."""
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:")[1].splitlines()
    for name, command in typer.main.get_command(app).commands.items():
        for limit in (45, 80, 300):  # the listing's width follows the terminal's (docs/commands.md's is wider)
            summary = command.get_short_help_str(limit=limit)
            assert summary.count("(") == summary.count(")") or summary.endswith("..."), (name, limit, summary)
            assert not summary.endswith(" al."), (name, limit, summary)
        line = next(line.split(None, 1)[1] for line in listed if line.split()[:1] == [name])
        assert line.count("(") == line.count(")") or line.endswith("..."), (name, line)
