"""Write docs/commands.md, the command reference, from the live CLI: every command's `--help` as click renders it.

    python -m attnprobe.cli_reference            # rewrite docs/commands.md
    python -m attnprobe.cli_reference --check    # exit 1 when docs/commands.md differs from what the CLI says

The help comes from the Typer app's own click introspection (`typer.main.get_command`, then each command's
`get_help`; typer vendors click) at a fixed width, so the page does not depend on the terminal that generates
it. tests/test_docs.py fails when the committed page is out of date.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import typer

WIDTH = 100  # columns of the rendered help, whatever the terminal
PAGE = Path(__file__).resolve().parent.parent / "docs" / "commands.md"
REGENERATE = "python -m attnprobe.cli_reference (or `make reference`)"

HEADER = """\
# Command reference

<!-- Generated from the CLI by `python -m attnprobe.cli_reference`: do not edit by hand. -->

This page is each command's `--help`, generated from the CLI itself; a test fails when it and the CLI differ.
The guides explain the commands: [analyze](guides/analyze.md), [classify](guides/classify.md),
[plot](guides/plot.md), [report](guides/report.md), [probe](guides/probe.md), [verify](guides/verify.md),
[compare](guides/compare.md), [rollout](guides/rollout.md), [ablate](guides/ablate.md).
"""


def _help(command, name: str, parent: typer.Context | None) -> tuple[str, typer.Context]:
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}  # e.g. -h
    ctx = typer.Context(command, info_name=name, parent=parent, **settings)
    return command.get_help(ctx).rstrip() + "\n", ctx


def render() -> str:
    """The reference page: the top-level help, then every command's, in the order `attnprobe --help` lists them."""
    from attnprobe.cli import app

    root = typer.main.get_command(app)
    text, root_ctx = _help(root, "attnprobe", None)
    parts = [HEADER, "## `attnprobe`\n", "```text\n" + text + "```\n"]
    for name in root.list_commands(root_ctx):
        command = root.get_command(root_ctx, name)
        if command is None or command.hidden:
            continue
        text, _ = _help(command, name, root_ctx)
        parts += [f"## `attnprobe {name}`\n", "```text\n" + text + "```\n"]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is out of date")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"the page to write or check (default {PAGE})")
    args = parser.parse_args(argv)
    want = render()
    if args.check:
        have = args.page.read_text(encoding="utf-8") if args.page.is_file() else ""
        if have == want:
            return 0
        diff = difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(args.page), "the CLI's help")
        sys.stdout.writelines(diff)
        print(f"{args.page} is out of date with the CLI: regenerate it with {REGENERATE}")
        return 1
    args.page.parent.mkdir(parents=True, exist_ok=True)
    args.page.write_text(want, encoding="utf-8")
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
