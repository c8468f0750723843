"""The documentation stays in step with the code (issue 20): docs/commands.md is the CLI's own --help."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_site_builds_with_every_link_and_page(tmp_path):
    """`make docs` in a test: --strict fails on a link to a missing page or heading, or a page left out of nav."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material (dev extras) are not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
               "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    assert (site / "guides" / "analyze.html").is_file()
    # The site opens from disk (file://, no server): every link of index.html names a page, never a folder (which
    # a browser shows as a directory listing), and the page is there.
    links = re.findall(r'href="([^"#?]*)[^"]*"', (site / "index.html").read_text(encoding="utf-8"))
    local = [link for link in links if link and "://" not in link and not link.startswith(("assets/", "//"))]
    assert "guides/analyze.html" in local and "commands.html" in local, local
    for link in local:
        assert not link.endswith("/") and link.endswith(".html"), link
        assert (site / link).is_file(), link


def test_the_architecture_table_and_the_python_block_live_in_the_docs():
    """tests/test_zoo.py and tests/test_notebook_api.py read these pages: the markers and the block must stay."""
    page = (ROOT / "docs" / "long-documents.md").read_text(encoding="utf-8")
    assert page.count("<!-- figure:architectures -->") == 1
    assert "# Using it from Python" in (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")


def test_the_readme_is_a_landing_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= 250
    assert "make demo" in readme and "make test" in readme and ". .venv/bin/activate" in readme
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert any(target.startswith("docs/") for target in targets)
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_every_example_names_a_file_that_exists():
    """The long-document examples once read a book.txt that nobody had."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert "book.txt" not in page.read_text(encoding="utf-8"), page
