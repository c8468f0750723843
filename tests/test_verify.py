"""verify: passes on true maps, and fails when the maps are not the model's."""

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from attnprobe import recompute
from attnprobe import verify as verify_module
from attnprobe.cli import app
from attnprobe.commands import common
from attnprobe.model import load_model
from attnprobe.verify import DEFAULT_SENTENCES, STATS_TOLERANCE, verify

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    return load_model(str(gpt2_dir), "cpu")


def test_all_checks_pass_on_gpt2(gpt2):
    checks = verify(gpt2, list(DEFAULT_SENTENCES[:3]))
    assert len(checks) == 8
    for check in checks:
        assert check.passed and not check.skipped, check
        assert 0.0 <= check.max_abs_diff <= check.tolerance


def test_a_wrong_recomputation_is_caught(gpt2, monkeypatch):
    def unscaled(module, hidden, config, layer):
        scores = recompute.gpt2_scores(module, hidden, config, layer)
        return dataclasses.replace(scores, logits=scores.logits * 1.5)

    monkeypatch.setitem(recompute.RECOMPUTE, "gpt2", unscaled)
    check = verify(gpt2, list(DEFAULT_SENTENCES[:2]))[3]
    assert not check.passed and check.max_abs_diff > 1e-3


def test_leaking_attention_is_caught():
    p = torch.full((1, 1, 3, 3), 1 / 3)  # [batch, head, query, key]: uniform, future included
    capture = verify_module.Capture(maps=[p], inputs=[])
    mask = torch.ones(1, 3, dtype=torch.long)
    check = verify_module.masked_keys_are_zero(capture, mask, True, [None])
    assert not check.passed and check.max_abs_diff == pytest.approx(1 / 3)
    assert verify_module.rows_sum_to_one(capture, mask).passed
    causal = torch.tensor([[[[1, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]]]])  # row 2 sees key 0: a window of 2 leaks
    assert verify_module.masked_keys_are_zero(verify_module.Capture(maps=[causal], inputs=[]), mask, True, [3]).passed
    leak = verify_module.masked_keys_are_zero(verify_module.Capture(maps=[causal], inputs=[]), mask, True, [2])
    assert not leak.passed and leak.max_abs_diff == pytest.approx(0.25)


def test_verify_command_prints_every_check(gpt2_dir):
    result = runner.invoke(app, ["verify", "--model", str(gpt2_dir), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    for name in ("rows sum to 1", "future/padded keys get 0", "batched = one at a time", "eager output"):
        assert name in result.stdout
    assert result.stdout.count("pass") == 8


def test_verify_command_fails_with_exit_1(gpt2_dir, monkeypatch):
    def flat(module, hidden, config, layer):
        scores = recompute.gpt2_scores(module, hidden, config, layer)
        return dataclasses.replace(scores, logits=torch.zeros_like(scores.logits))

    monkeypatch.setitem(recompute.RECOMPUTE, "gpt2", flat)
    result = runner.invoke(app, ["verify", "--model", str(gpt2_dir), "--device", "cpu"])
    assert result.exit_code == 1
    assert "FAIL" in result.stdout and result.stderr.startswith("Error: 1 check(s) failed")


def test_verify_reads_sentences_from_a_corpus(gpt2_dir, corpus_file):
    result = runner.invoke(app, ["verify", "--model", str(gpt2_dir), "--corpus", str(corpus_file), "-n", "2"])
    assert result.exit_code == 0 and "2 sentences" in " ".join(result.stdout.split())  # the title folds by its path
    bad = runner.invoke(app, ["verify", "--model", str(gpt2_dir), "-n", "0"])
    assert bad.exit_code == 1 and "--sentences 0" in bad.stderr


def test_blocked_checks_pass_within_float32_bounds_and_catch_a_wrong_kernel(gpt2, monkeypatch):
    checks = {c.name: c for c in verify(gpt2, list(DEFAULT_SENTENCES))}
    assert checks["blocked statistics = eager"].max_abs_diff <= STATS_TOLERANCE
    assert "blocks of" in checks["blocked statistics = eager"].note
    real = verify_module.kernel.softmax_with_entropy

    def hotter(scores, *rest):
        return real(scores * 1.01, *rest)

    monkeypatch.setattr(verify_module.kernel.blocked, "softmax_with_entropy", hotter)
    checks = {c.name: c for c in verify(gpt2, list(DEFAULT_SENTENCES))}
    assert not checks["blocked statistics = eager"].passed
    assert not checks["blocked position bins = eager"].passed
    assert checks["fused statistics = eager"].passed  # the fused path takes no softmax of its own ...
    assert checks["fused statistics = eager"].note == "every layer fused"
    assert verify_module._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    real_flash = verify_module.kernel.flash

    def off(query, key, value, causal, additive, scale):
        return real_flash(query, key, value, causal, additive, scale * 1.01)

    monkeypatch.setattr(verify_module.kernel.fused, "flash", off)  # ... but a kernel 1% off fails it
    assert not {c.name: c for c in verify(gpt2, list(DEFAULT_SENTENCES))}["fused statistics = eager"].passed


def test_blocked_checks_are_skipped_where_the_kernel_does_not_apply(gpt2_dir):
    loaded = load_model(str(gpt2_dir), "cpu")
    loaded.model.config.reorder_and_upcast_attn = True
    checks = {c.name: c for c in verify(loaded, list(DEFAULT_SENTENCES[:2]))}
    assert checks["blocked statistics = eager"].skipped
    assert "reorder_and_upcast_attn" in checks["blocked statistics = eager"].note


@pytest.fixture(scope="module")
def gpt2_bf16_dir(gpt2_dir, tmp_path_factory):
    """The test GPT-2 saved in bfloat16 (config.json records it), so that --dtype auto runs it in bfloat16."""
    import shutil

    from transformers import GPT2Model

    folder = tmp_path_factory.mktemp("gpt2-bf16") / "model"
    shutil.copytree(gpt2_dir, folder)
    GPT2Model.from_pretrained(gpt2_dir).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture()
def gpt2_bf16(gpt2_bf16_dir):
    loaded = load_model(str(gpt2_bf16_dir), "cpu")  # --dtype auto
    assert loaded.dtype == "bfloat16"
    return loaded


def checks_of(loaded):
    return {c.name: c for c in verify(loaded, list(DEFAULT_SENTENCES))}


def test_every_check_runs_and_passes_in_bfloat16(gpt2_bf16):
    """No check is skipped for the dtype: each has a bound derived from bfloat16's unit roundoff."""
    checks = checks_of(gpt2_bf16)
    assert len(checks) == 8
    for check in checks.values():
        assert not check.skipped and check.passed, check
    u = 2.0**-8
    assert checks["rows sum to 1"].tolerance == pytest.approx(1e-5 + u)
    assert checks["batched = one at a time"].note == "bfloat16: bound per weight"
    # the statistics: float32's 1e-5, plus 2 x PER_LAYER x (l + 1) u at the layer nearest its bound (3 layers)
    allowed = {STATS_TOLERANCE + 2 * verify_module.PER_LAYER * layers * u for layers in (1, 2, 3)}
    for name in ("blocked statistics = eager", "fused statistics = eager"):
        assert any(checks[name].tolerance == pytest.approx(t) for t in allowed), checks[name]
    sdpa = checks["eager output = SDPA output"]  # "|output| <= 3.1 (layer 2)": the layer nearest its bound
    scale, layer = sdpa.note.removeprefix("|output| <= ").removesuffix(")").split(" (layer ")
    bound = (1e-5 + 2 * verify_module.PER_LAYER * (int(layer) + 1) * u) * max(1.0, float(scale))
    assert sdpa.tolerance == pytest.approx(bound, rel=1e-2)
    assert verify_module.depth_bound("float32", 5) == 0.0
    assert verify_module.depth_bound("float16", 0) == pytest.approx(2 * verify_module.PER_LAYER * 2.0**-11)


def test_a_wrong_kernel_fails_in_bfloat16(gpt2_bf16, monkeypatch):
    """bfloat16's bounds are wide enough for its roundings, not for a wrong path: scores 1.5x too hot in the
    blocked kernel, then in the fused kernel, fail their checks."""
    real = verify_module.kernel.softmax_with_entropy
    monkeypatch.setattr(verify_module.kernel.blocked, "softmax_with_entropy",
                        lambda scores, *rest: real(scores * 1.5, *rest))
    checks = checks_of(gpt2_bf16)
    assert not checks["blocked statistics = eager"].passed and not checks["blocked position bins = eager"].passed
    monkeypatch.setattr(verify_module.kernel.blocked, "softmax_with_entropy", real)
    real_flash = verify_module.kernel.flash

    def hot(query, key, value, causal, additive, scale):
        return real_flash(query, key, value, causal, additive, scale * 1.5)

    monkeypatch.setattr(verify_module.kernel.fused, "flash", hot)
    checks = checks_of(gpt2_bf16)
    assert not checks["fused statistics = eager"].passed, checks["fused statistics = eager"]
    assert checks["blocked statistics = eager"].passed


def test_a_wrong_sdpa_or_batch_fails_in_bfloat16(gpt2_bf16, monkeypatch):
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def hot(*args, scale=None, **kwargs):
        return real_sdpa(*args, scale=(scale or args[0].shape[-1] ** -0.5) * 1.5, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", hot)
    checks = checks_of(gpt2_bf16)
    assert not checks["eager output = SDPA output"].passed, checks["eager output = SDPA output"]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real_sdpa)
    real_capture = verify_module.capture

    def swapped(loaded, input_ids, mask):  # the padded batch's maps with heads 0 and 1 swapped
        found = real_capture(loaded, input_ids, mask)
        if input_ids.shape[0] > 1:
            found.maps = [p[:, [1, 0, 2, 3]] for p in found.maps]
        return found

    monkeypatch.setattr(verify_module, "capture", swapped)
    check = checks_of(gpt2_bf16)["batched = one at a time"]
    assert not check.passed and check.max_abs_diff > 1e-2, check


def test_verify_command_runs_every_check_in_bfloat16(gpt2_bf16_dir, monkeypatch):
    monkeypatch.setattr(common.out_console, "width", 1000)  # the title and the headings on one line, however long
    result = runner.invoke(app, ["verify", "--model", str(gpt2_bf16_dir), "--device", "cpu"])  # the model's path
    assert result.exit_code == 0, result.output
    assert "bfloat16 (auto)" in result.stdout and "diff at tightest" in result.stdout
    assert result.stdout.count("pass") == 8 and "skipped" not in result.stdout


def test_every_check_runs_and_passes_in_float16(gpt2_dir):
    """float16 (a GPU's half precision; here a caller's float16 model on the CPU, through the Python API): the same
    bounds with u = 2^-11."""
    from transformers import AutoTokenizer, GPT2Model

    model = GPT2Model.from_pretrained(gpt2_dir, dtype=torch.float16, attn_implementation="eager")
    checks = verify((model, AutoTokenizer.from_pretrained(gpt2_dir)), list(DEFAULT_SENTENCES))
    assert len(checks) == 8
    for check in checks:
        assert not check.skipped and check.passed, check
    assert checks[0].tolerance == pytest.approx(1e-5 + 2.0**-11)
