"""Issue 27's adversary cases: each once exited 0 with wrong results or ended in a traceback."""

from __future__ import annotations


def run_cli(args: list[str]):
    from typer.testing import CliRunner

    from attnprobe.cli import app

    return CliRunner().invoke(app, args)


def one_error_line(result) -> str:
    """The CLI failed with one plain line (no traceback) and nothing else on its error stream."""
    text = result.output.strip()
    assert result.exit_code != 0, text
    assert "Traceback" not in text and result.exception is None or isinstance(result.exception, SystemExit), text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error"), text
    return lines[0]


# ---- case 3: the truncation warning counts the tokens beyond the limit, never as a negative number ---------------


def test_truncation_counts_tokens_beyond_the_limit_and_says_more_than_for_a_clipped_line(gpt2_dir, tmp_path):
    from attnprobe.analysis import analyze_loaded, truncation_message
    from attnprobe.corpus import CHARS_PER_TOKEN, read_corpus
    from attnprobe.model import load_model

    loaded = load_model(str(gpt2_dir), "cpu")
    over = 7
    words = loaded.max_length + over  # "cat" is one token of the word-level tokenizer, no special tokens
    huge = "cat " * (loaded.max_length * CHARS_PER_TOKEN)  # far beyond the characters kept before tokenizing
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["Rain fell.", " ".join(["cat"] * words), huge]) + "\n", encoding="utf-8")
    run = analyze_loaded(loaded, read_corpus(corpus), resamples=10).run
    exact, clipped = run["truncated_lines"]
    assert exact == {"line": 2, "tokens_cut": over, "at_least": False}
    assert clipped["line"] == 3 and clipped["at_least"] and 0 < clipped["tokens_cut"] < len(huge.split())
    message = truncation_message(run)
    assert f"line 2 ({over} tokens over the limit)" in message
    assert f"line 3 (more than {clipped['tokens_cut']} tokens over the limit)" in message
    assert "(-" not in message
