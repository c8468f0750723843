"""Model folders with bad weight files fail as one plain line, never a traceback, and never unpickle code."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model

SAFETENSORS_FIX = r"model\.safetensors is not a readable safetensors file \(truncated or corrupt\)"


class CreatesFile:
    """Unpickling this opens (creates) a file: what a malicious pytorch_model.bin could do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def copy_model(gpt2_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(gpt2_dir, folder)
    return folder


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def to_pickle(folder: Path) -> Path:
    """Replace model.safetensors by the same weights as a torch.save pickle."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin"


def malicious_pickle(folder: Path, marker: Path, *, zipped: bool) -> None:
    import torch

    (folder / "model.safetensors").unlink()
    payload = {"wte.weight": CreatesFile(marker)}
    if zipped:
        torch.save(payload, folder / "pytorch_model.bin")  # torch's zip format, data.pkl inside
    else:
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(payload))  # a bare pickle stream
    assert not marker.exists()


def assert_one_line(err: pytest.ExceptionInfo, folder: Path) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    assert f"cannot load model from {folder}" in message, message
    return message


@pytest.mark.parametrize("corrupt", [garbage, half, empty], ids=["garbage", "truncated", "zero-bytes"])
def test_corrupt_safetensors_is_one_line(gpt2_dir, tmp_path, corrupt):
    folder = copy_model(gpt2_dir, tmp_path)
    corrupt(folder / "model.safetensors")
    with pytest.raises(AttnprobeError, match=SAFETENSORS_FIX) as err:
        load_model(str(folder), "cpu")
    assert "save_pretrained" in assert_one_line(err, folder)


def test_corrupt_shard_is_named(gpt2_dir, tmp_path):
    from transformers import AutoModel

    folder = tmp_path / "sharded"
    shutil.copytree(gpt2_dir, folder)
    (folder / "model.safetensors").unlink()
    AutoModel.from_pretrained(gpt2_dir).save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    half(shards[1])
    with pytest.raises(AttnprobeError, match=rf"{shards[1].name} is not a readable safetensors file") as err:
        load_model(str(folder), "cpu")
    assert_one_line(err, folder)


@pytest.mark.parametrize("zipped", [True, False], ids=["torch-save", "bare-pickle"])
def test_malicious_pickle_is_refused_without_running(gpt2_dir, tmp_path, zipped):
    folder = copy_model(gpt2_dir, tmp_path)
    marker = tmp_path / "created-by-unpickling"
    malicious_pickle(folder, marker, zipped=zipped)
    with pytest.raises(AttnprobeError, match=r"pytorch_model\.bin") as err:
        load_model(str(folder), "cpu")
    message = assert_one_line(err, folder)
    assert "safetensors" in message and "safe_serialization=True" in message, message
    assert not marker.exists()


@pytest.mark.parametrize("corrupt", [half, empty], ids=["truncated", "zero-bytes"])
def test_corrupt_pickle_is_one_line(gpt2_dir, tmp_path, corrupt):
    folder = copy_model(gpt2_dir, tmp_path)
    corrupt(to_pickle(folder))
    with pytest.raises(AttnprobeError, match=r"pytorch_model\.bin") as err:
        load_model(str(folder), "cpu")
    assert "safe_serialization=True" in assert_one_line(err, folder)


def test_plain_pickled_weights_still_load(gpt2_dir, tmp_path):
    """A plain state dict is read by torch's weights-only loader (no code runs): that stays allowed."""
    folder = copy_model(gpt2_dir, tmp_path)
    to_pickle(folder)
    assert load_model(str(folder), "cpu").num_layers == 3


def run_cli(folder: Path, corpus_file: Path, out: Path):
    args = ["analyze", "--model", folder, "--corpus", corpus_file, "--out", out, "--device", "cpu"]
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_cli_error(result, out: Path, *fragments: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("corrupt", [garbage, empty], ids=["garbage", "zero-bytes"])
def test_cli_corrupt_safetensors(gpt2_dir, tmp_path, corpus_file, corrupt):
    folder = copy_model(gpt2_dir, tmp_path)
    corrupt(folder / "model.safetensors")
    out = tmp_path / "results"
    assert_cli_error(run_cli(folder, corpus_file, out), out, "model.safetensors", "save_pretrained")


def test_cli_malicious_pickle(gpt2_dir, tmp_path, corpus_file):
    folder = copy_model(gpt2_dir, tmp_path)
    marker = tmp_path / "created-by-unpickling"
    malicious_pickle(folder, marker, zipped=True)
    out = tmp_path / "results"
    assert_cli_error(run_cli(folder, corpus_file, out), out, "pytorch_model.bin", "safetensors")
    assert not marker.exists()


# ---- no model hub (issue 34): fail within the hub check's timeout, name lookup included -----------------------


def hanging(*args, **kwargs):
    import time

    time.sleep(30)  # a resolver (or route) that never answers
    raise OSError("timed out")


@pytest.mark.parametrize("where", ["getaddrinfo", "create_connection"])
def test_an_unanswered_hub_check_gives_up_after_its_timeout(monkeypatch, where):
    import socket
    import time

    from attnprobe import model

    for name in model.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, where, hanging)
    started = time.perf_counter()
    assert model.hub_reachable(timeout=0.5) is False
    assert time.perf_counter() - started < 3.0


def test_a_hub_id_fails_fast_without_a_network(monkeypatch, tmp_path):
    """Without HF_HUB_OFFLINE, a hub id not in the cache fails in about HUB_TIMEOUT, not after the resolver's
    retries (22 s) or the hub client's (a minute)."""
    import socket
    import time

    from attnprobe import model

    for name in model.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(model, "hub_offline", lambda: False)
    monkeypatch.setattr(model, "HUB_TIMEOUT", 0.5)
    monkeypatch.setattr(model.hub_reachable, "__defaults__", (0.5,))
    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    started = time.perf_counter()
    with pytest.raises(AttnprobeError, match="cannot reach the model hub"):
        load_model("attnprobe-test/not-cached", device="cpu")
    assert time.perf_counter() - started < 10.0


def test_a_hub_that_accepts_connections_but_never_answers_counts_as_unreachable(monkeypatch):
    """A firewall that completes the TCP handshake and then says nothing: the hub client waited 10 s per file."""
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from attnprobe import model

    for name in model.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # connections complete in the backlog; nothing ever reads or answers them
    try:
        monkeypatch.setattr(model, "hub_endpoint", lambda: f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.perf_counter()
        assert model.hub_reachable(timeout=0.5) is False
        assert time.perf_counter() - started < 3.0
    finally:
        silent.close()

    class Answer(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (http.server's name)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(model, "hub_endpoint", lambda: f"http://127.0.0.1:{server.server_port}")
        assert model.hub_reachable(timeout=2.0) is True  # any HTTP answer: the hub client takes it from there
    finally:
        server.shutdown()
        server.server_close()
