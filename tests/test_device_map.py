"""--device-map: a model spread over devices (here CPU and disk) gives the same statistics."""

import numpy as np
import pytest
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_blocked import corpus_of
from test_cli import assert_one_line_error, run

from attnprobe.analysis import analyze_loaded
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model, parse_max_memory


@pytest.mark.parametrize("device_map", ["auto", "disk"])
def test_offloaded_layers_give_the_same_statistics(gpt2_dir, tmp_path, device_map):
    placement = device_map if device_map == "auto" else {
        "wte": "cpu", "wpe": "cpu", "drop": "cpu", "h.0": "cpu", "h.1": "disk", "h.2": "cpu", "ln_f": "cpu"}
    spread = load_model(str(gpt2_dir), "cpu", device_map=placement, offload_folder=str(tmp_path))
    if device_map == "disk":
        assert spread.model.hf_device_map["h.1"] == "disk"
        # layer 1's weights live on the disk: its parameters are placeholders until accelerate loads them
        assert all(p.device.type == "meta" for p in spread.model.h[1].parameters())
    whole = load_model(str(gpt2_dir), "cpu")
    a = analyze_loaded(spread, corpus_of(SENTENCES), batch_size=3, resamples=20)
    b = analyze_loaded(whole, corpus_of(SENTENCES), batch_size=3, resamples=20)
    for column in ("entropy", "diagonal", "distance", "entropy_ci_low", "entropy_vw", "output_norm"):
        np.testing.assert_allclose(a.heads[column], b.heads[column], rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE,
                                   err_msg=column)


def test_max_memory_is_parsed_and_checked():
    assert parse_max_memory("0=20GiB, 1=20GiB,cpu=60GiB") == {0: "20GiB", 1: "20GiB", "cpu": "60GiB"}
    assert parse_max_memory(None) is None
    with pytest.raises(AttnprobeError, match="device=size pairs"):
        parse_max_memory("20GiB")


def test_cli_device_map(gpt2_dir, corpus_file, tmp_path):
    ok = run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "a", "--device", "cpu",
             "--device-map", "auto", "--max-memory", "cpu=2GiB", "--resamples", "5")
    assert ok.exit_code == 0, ok.output
    assert_one_line_error(run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "b",
                              "--max-memory", "cpu=2GiB"), "--device-map auto")
