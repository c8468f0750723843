"""The suites CI runs: the version_free modules that test-latest and test-lowest leave out exist, and are marked."""

from __future__ import annotations

from pathlib import Path

from conftest import VERSION_FREE

TESTS = Path(__file__).resolve().parent


def test_every_version_free_module_exists():
    assert sorted(name for name in VERSION_FREE if not (TESTS / name).is_file()) == []


def test_version_free_tests_are_marked(request):
    marked = {item.path.name for item in request.session.items if item.get_closest_marker("version_free")}
    collected = {item.path.name for item in request.session.items}
    assert marked == VERSION_FREE & collected
    assert "test_suites.py" not in marked  # this module runs in every suite
