"""--dtype auto (the default): a checkpoint runs in its own dtype, and every command that loads a model takes --dtype
and --device-map, recording the dtype asked for and the dtype that ran."""

import json

import numpy as np
import pytest
import torch
from conftest import SENTENCES, make_llama
from typer.testing import CliRunner

from attnprobe.analysis import analyze
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model, resolve_dtype, runnable_dtype

runner = CliRunner()

# bfloat16 keeps 8 significant bits: each rounding of an activation moves it by at most u = 2^-8 = 3.9e-3 of itself.
# Per layer the scores pass about 4 roundings before the softmax (the q and k projections, the rotary embedding, the
# product) and the hidden state about 4 more on its way to the next layer (attention output, output projection,
# residual sum, MLP); to first order these relative errors add, so after L layers the logits, and the statistics
# that are smooth functions of them (entropy in nats, distance in tokens, shares in [0, 1]), are off by at most
# 8 L u relative (above 1). For the 2-layer test model: 16 u = 0.0625. (Measured here: about 1.3 u, as the means over
# rows average the roundings.)
BFLOAT16_U = 2.0**-8
LAYERS = 2
BFLOAT16_TOLERANCE = 8 * LAYERS * BFLOAT16_U


def saved_as(source, folder, dtype):
    """A copy of the checkpoint in `source` (a causal LM with its head), saved in `dtype` (config.json records it)
    with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(source).to(dtype).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama32"), layers=LAYERS, lm_head=True)


@pytest.fixture(scope="module")
def llama16(llama32, tmp_path_factory):
    folder = saved_as(llama32, tmp_path_factory.mktemp("llama16"), torch.bfloat16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def test_a_bfloat16_checkpoint_stays_bfloat16_by_default(llama16):
    loaded = load_model(str(llama16), "cpu")
    assert (loaded.dtype, loaded.dtype_requested) == ("bfloat16", "auto")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_a_float32_checkpoint_stays_float32(llama32):
    loaded = load_model(str(llama32), "cpu")
    assert (loaded.dtype, loaded.dtype_requested) == ("float32", "auto")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


def test_dtype_float32_upcasts_a_bfloat16_checkpoint(llama16):
    loaded = load_model(str(llama16), "cpu", "float32")
    assert (loaded.dtype, loaded.dtype_requested) == ("float32", "float32")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


def test_a_float16_checkpoint_runs_in_float32_on_cpu(llama32, tmp_path):
    """attnprobe refuses float16 on CPU; auto then runs the checkpoint in float32 instead of refusing it."""
    folder = saved_as(llama32, tmp_path / "half", torch.float16)
    loaded = load_model(str(folder), "cpu")
    assert loaded.dtype == "float32" and {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    with pytest.raises(AttnprobeError, match="float16 needs a GPU"):
        load_model(str(folder), "cpu", "float16")


def test_runnable_dtype_of_what_a_config_records():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert runnable_dtype("bfloat16", cpu) == torch.bfloat16 and runnable_dtype(torch.float32, cpu) == torch.float32
    assert runnable_dtype("float16", cpu) == torch.float32 and runnable_dtype("float16", gpu) == torch.float16
    assert runnable_dtype("float64", cpu) == torch.float32 and runnable_dtype(None, cpu) is None
    assert resolve_dtype("auto", cpu) is None
    with pytest.raises(AttnprobeError, match="use auto, float32, bfloat16 or float16"):
        resolve_dtype("int8", cpu)


def test_bfloat16_statistics_equal_the_float32_ones_within_bfloat16_s_bound(llama16):
    """The same bf16 weights run in bf16 (auto) and upcast to float32: the statistics differ only by the
    activations' roundings (BFLOAT16_TOLERANCE, relative above 1)."""
    auto = analyze(str(llama16), list(SENTENCES), device="cpu", resamples=5)
    wide = analyze(str(llama16), list(SENTENCES), device="cpu", dtype="float32", resamples=5)
    assert (auto.run["dtype"], auto.run["dtype_requested"]) == ("bfloat16", "auto")
    assert (wide.run["dtype"], wide.run["dtype_requested"]) == ("float32", "float32")
    compared = 0
    for column in ("entropy", "entropy_norm", "distance", "first_token", "sink_window", "entropy_vw", "output_norm"):
        got, want = auto.heads[column].to_numpy(float), wide.heads[column].to_numpy(float)
        assert np.array_equal(np.isnan(got), np.isnan(want)), column
        diff = np.nan_to_num(np.abs(got - want) / np.maximum(1.0, np.abs(want)))
        assert diff.max() <= BFLOAT16_TOLERANCE, (column, diff.max())
        compared += 1
    assert compared == 7
    assert not auto.heads["entropy"].equals(wide.heads["entropy"])  # bf16 really ran: it rounds otherwise


def test_cli_analyze_records_the_dtype_asked_for_and_the_one_that_ran(llama16, corpus_file, tmp_path):
    out = tmp_path / "auto"
    result = runner.invoke(app, ["analyze", "-m", str(llama16), "-c", str(corpus_file), "--out", str(out),
                                 "--device", "cpu", "--resamples", "5", "--limit", "4"])
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert (run["dtype"], run["dtype_requested"]) == ("bfloat16", "auto")
    wide = tmp_path / "wide"
    result = runner.invoke(app, ["analyze", "-m", str(llama16), "-c", str(corpus_file), "--out", str(wide),
                                 "--device", "cpu", "--resamples", "5", "--limit", "4", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert json.loads((wide / "run.json").read_text())["dtype"] == "float32"
    # related loads the model in the dtype the run records as having run, unless --dtype says otherwise
    related = runner.invoke(app, ["related", "--out", str(wide), "-n", "2", "--device", "cpu"])
    assert related.exit_code == 0, related.output


@pytest.mark.parametrize("command", ["verify", "probe", "rollout", "ablate"])
def test_every_command_that_loads_a_model_takes_dtype_and_device_map(command, llama16, corpus_file, tmp_path):
    args = {
        "verify": ["verify", "-n", "2"],
        "probe": ["probe", "--lengths", "5", "--sequences", "2", "--resamples", "5", "--out", str(tmp_path)],
        "rollout": ["rollout", "--example", "The cat sat.", "--out", str(tmp_path)],
        "ablate": ["ablate", "-c", str(corpus_file), "--limit", "2", "--resamples", "5", "--no-pruning",
                   "--heads", "L0H1", "--out", str(tmp_path)],
    }[command] + ["-m", str(llama16), "--device", "cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = {"probe": "probe.json", "ablate": "ablate.json", "rollout": None, "verify": None}[command]
    if record:
        info = json.loads((tmp_path / record).read_text())
        assert (info["dtype"], info["dtype_requested"]) == ("bfloat16", "auto")
    if command == "verify":
        assert "bfloat16 (auto)" in result.stdout
    wide = runner.invoke(app, [*args, "--dtype", "float32", "--device-map", "auto"])
    assert wide.exit_code == 0, wide.output
    if record:
        info = json.loads((tmp_path / record).read_text())
        assert (info["dtype"], info["dtype_requested"]) == ("float32", "float32")
    alone = runner.invoke(app, [*args, "--max-memory", "cpu=2GiB"])
    assert alone.exit_code == 1 and "--device-map auto" in alone.stderr
