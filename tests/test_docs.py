"""The documentation stays in step with the code (issue 20): docs/commands.md is the CLI's own --help."""

from pathlib import Path

from attnprobe import cli_reference

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_reference_is_what_the_cli_says():
    page = ROOT / "docs" / "commands.md"
    assert page == cli_reference.PAGE
    want = cli_reference.render()
    have = page.read_text(encoding="utf-8") if page.is_file() else ""
    assert have == want, (
        f"docs/commands.md differs from the CLI's --help: regenerate it with {cli_reference.REGENERATE} "
        "and commit the page"
    )


def test_the_reference_names_every_command_and_option():
    from attnprobe.cli import app

    page = cli_reference.render()
    for info in app.registered_commands:
        name = info.name or info.callback.__name__
        assert f"## `attnprobe {name}`" in page, name
    assert "--corpus" in page and "--scheme" in page and "-h, --help" in page


def test_check_mode_says_how_to_regenerate(tmp_path, capsys):
    stale = tmp_path / "commands.md"
    stale.write_text("# Command reference\n", encoding="utf-8")
    assert cli_reference.main(["--check", "--page", str(stale)]) == 1
    assert "python -m attnprobe.cli_reference" in capsys.readouterr().out
    assert cli_reference.main(["--page", str(stale)]) == 0
    assert cli_reference.main(["--check", "--page", str(stale)]) == 0
