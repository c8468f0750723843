"""The Triton path (kernel/triton_path.py) under Triton's interpreter on a CPU (conftest sets TRITON_INTERPRET=1 where
no CUDA device is present; on a GPU the same tests compile the kernels): every statistic, the output, the logsumexp
and the mass each key receives against a float64 map computed here and against the blocked path, for each feature
the kernel covers; and `--attention triton` end to end against `--attention blocked`."""

import ast
import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_blocked import assert_close
from typer.testing import CliRunner

from attnprobe import kernel, values
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.kernel import triton_path
from attnprobe.metrics import VALUE_WEIGHTED, TokenClasses, bin_count, received, sentence_stats
from attnprobe.model import load_model
from attnprobe.planning import attention_path
from attnprobe.scores import OUTPUT_NORM, VW

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = 24  # the output projection's width in the value-weighted cases
runner = CliRunner()
needs_triton = pytest.mark.skipif(triton_path.unavailable(torch.device(DEVICE)) is not None,
                                  reason=str(triton_path.unavailable(torch.device(DEVICE))))


compilable = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")


def _script_constants(path: Path) -> dict:
    """The literal module-level constants of a script, read without importing it (triton_compile.py drops
    TRITON_INTERPRET when imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, (ast.Constant, ast.Dict))}


COMPILE_SCRIPT = Path(__file__).resolve().parent / "triton_compile.py"
TARGETS = _script_constants(COMPILE_SCRIPT)  # TARGET_VARIANT, TARGETS, REACHED


def heads_of(n, groups, dim, heads=4, seed=0, dtype=torch.float32):
    """q [2, heads, n, dim] and k, v [2, heads / groups, n, dim] with logits of a few units, off-centre keys and
    values of widely spread norms (one of norm 0); the second sequence is padded after two thirds (n > 2)."""
    torch.manual_seed(seed)
    q = torch.randn(2, heads, n, dim) * 1.5
    k = torch.randn(2, heads // groups, n, dim) + 0.3
    v = torch.randn(2, heads // groups, n, dim) * torch.randn(2, heads // groups, n, 1).exp()
    v[:, 0, min(3, n - 1)] = 0.0
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, max(1, n - n // 3):] = False
    return (*(x.to(DEVICE, dtype) for x in (q, k, v)), real.to(DEVICE))


def oracle_map(q, k, real, causal, span, softcap, sinks):
    """The float64 attention map [batch, head, query, key] of the layer's scores, mask, soft-cap and sinks."""
    groups = q.shape[1] // k.shape[1]
    n = q.shape[2]
    scores = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    offset = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]  # j - i
    allowed = real[:, None, None, :].expand(-1, 1, n, n)
    if causal:
        allowed = allowed & (offset <= 0)
    if span is not None:
        allowed = allowed & ((offset > -span) if causal else (offset.abs() <= span))
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [batch, head, query, 1]
    return torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped


def batch_info(n, special=None, tokens=None, example=None):
    return kernel.Batch(layers={}, last_layer=0, special=special, sink=2, window=5, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=example, on_layer=lambda *_: None, tokens=tokens)


def token_classes(n, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(0, 6, (2, n))  # few ids: many duplicates
    return TokenClasses(ids.to(DEVICE), (torch.rand(2, n) < 0.2).to(DEVICE))


CASES = {  # name -> (n, causal, query heads per KV head, head size, window span, soft-cap, sinks, query heads)
    "one token": (1, True, 1, 64, None, None, False, 2),
    "decoder, odd length, GQA 2, head 80, sinks": (37, True, 2, 80, None, None, True, 4),
    "encoder, GQA 4, head 96, window": (45, False, 4, 96, 6, None, False, 4),
    "decoder, GQA 8, head 128, window, soft-cap": (50, True, 8, 128, 9, 5.0, False, 8),
    "encoder, soft-cap and sinks, head 64": (33, False, 1, 64, None, 4.0, True, 2),
}


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_triton_statistics_equal_a_float64_map_and_the_blocked_path(case, monkeypatch):
    """Every statistic (the map's and the value-weighted map's, special, punctuation, duplicate), output_norm, the
    output, the example maps and the mass each key receives: to float32's bound against a float64 map, and against
    the blocked path. Blocks of 32 rows and 16 keys make several blocks of the short sequences, none a multiple."""
    monkeypatch.setattr(triton_path, "BLOCK_M", 32)
    monkeypatch.setattr(triton_path, "BLOCK_N", 16)
    n, causal, groups, dim, span, softcap, has_sinks, heads = CASES[case]
    q, k, v, real = heads_of(n, groups, dim, heads)
    sinks = torch.linspace(-1.0, 2.0, heads, device=DEVICE) if has_sinks else None
    special = torch.zeros(2, n, dtype=torch.bool, device=DEVICE)
    special[:, 0] = special[:, min(5, n - 1)] = True
    tokens = token_classes(n)
    projection = torch.nn.Linear(heads * dim, WIDTH).to(DEVICE)
    factors = values.head_factors(projection, heads)  # [head, k, dim]
    kept = min(n, 12)
    args = (q, k, v, real, None, causal)
    options = {"span": span, "softcap": softcap, "sinks": sinks, "factors": factors}
    got, example, output = triton_path.triton_attend(*args, batch_info(n, special, tokens, (1, kept)), **options)
    blocked, _, blocked_output = kernel.attend(*args, batch_info(n, special, tokens, (1, kept)), **options)

    p = oracle_map(q, k, real, causal, span, softcap, sinks).nan_to_num(0.0)  # [batch, head, q, key] float64: a
    # padded row beyond a window sees no key
    expected = sentence_stats(p, real.long(), causal, special, sink=2, window=5, span=span, tokens=tokens)
    groups_v = v.double().repeat_interleave(groups, 1)  # [batch, head, key, dim]
    slices = projection.weight.detach().double().view(WIDTH, heads, dim).transpose(0, 1)  # [head, width, dim]
    norms = torch.einsum("hwd,bhkd->bhkw", slices, groups_v).norm(dim=-1)  # [batch, head, key]
    weighted = p * norms[:, :, None, :]
    weighted = weighted / weighted.sum(dim=-1, keepdim=True)
    by_weight = sentence_stats(weighted, real.long(), causal, None, sink=2, window=5, span=span)
    expected.update({name + VW: by_weight[name] for name in VALUE_WEIGHTED})
    out = p @ groups_v  # [batch, head, q, dim]
    row_norms = torch.einsum("hwd,bhqd->bhqw", slices, out).norm(dim=-1)  # [batch, head, q]
    lengths = real.sum(dim=-1)
    expected[OUTPUT_NORM] = torch.stack([row_norms[b, :, : lengths[b]].mean(dim=-1) for b in range(2)])

    means, blocked_means = got.means(), blocked.means()
    assert set(means) == set(expected) == set(blocked_means)
    for name, value in means.items():
        assert_close(value.cpu().double(), expected[name].cpu(), name)
        assert_close(value.cpu(), blocked_means[name].cpu(), name + " (blocked)")
    assert_close(got.received.cpu().double(), received(p, 0, lengths).cpu(), "received")
    assert_close(got.received.cpu(), blocked.received.cpu(), "received (blocked)")
    np.testing.assert_allclose(example.cpu(), p[1, :, :kept, :kept].float().cpu(), atol=FLOAT32_TOLERANCE)
    reference = out.transpose(1, 2).float()  # [batch, query, head, dim]
    bound = FLOAT32_TOLERANCE * max(1.0, float(reference.abs().max()))
    assert float((output - reference)[real].abs().max()) < bound
    assert float((output - blocked_output)[real].abs().max()) < bound


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
def test_tokens_that_repeat_more_than_a_tile_of_rows(causal, monkeypatch):
    """Two token ids over 70 positions: groups of about 35 positions, cut into tiles of 16 rows against all their
    keys (duplicates.token_tiles' large groups), beside a third id packed with others; duplicate and its rows
    against the float64 map, and the plan's tiles cover each repeated position once as a row."""
    monkeypatch.setattr(triton_path, "BLOCK_M", 16)
    monkeypatch.setattr(triton_path, "BLOCK_N", 16)
    n = 70
    q, k, v, real = heads_of(n, 1, 32, heads=2, seed=4)
    torch.manual_seed(5)
    ids = torch.randint(0, 2, (2, n))
    ids[:, 10], ids[:, 40] = 7, 7
    tokens = TokenClasses(ids.to(DEVICE), torch.zeros(2, n, dtype=torch.bool, device=DEVICE))
    info = batch_info(n, tokens=tokens)
    sums, _, _ = triton_path.triton_attend(q, k, v, real, None, causal, info, need_output=False)
    p = oracle_map(q, k, real, causal, None, None, None)
    expected = sentence_stats(p, real.long(), causal, None, sink=2, window=5, tokens=tokens)
    assert_close(sums.means()["duplicate_token"].cpu().double(), expected["duplicate_token"].cpu(), "duplicate")
    plan = next(entry[1] for key, entry in info.kept.items() if key[0] == "token tiles")
    rows = torch.cat([torch.arange(r0, r1) for _, r0, r1, _, _ in plan.tiles.tolist()])
    assert sorted(rows.tolist()) == list(range(len(plan.positions)))
    assert int((plan.tiles[:, 2] - plan.tiles[:, 1]).max()) <= 16 < int((plan.tiles[:, 4] - plan.tiles[:, 3]).max())


@needs_triton
def test_int64_tile_offsets_give_the_same_statistics(monkeypatch):
    """Past 2**31 keys x stride the kernel offsets its tiles in int64 (WIDE) instead of int32: forced here on a short
    sequence, every statistic and the output equal the int32 offsets' (the same arithmetic, other addresses)."""
    monkeypatch.setattr(triton_path, "BLOCK_M", 32)
    monkeypatch.setattr(triton_path, "BLOCK_N", 16)
    q, k, v, real = heads_of(45, 2, 80)
    tokens, special = token_classes(45), torch.zeros(2, 45, dtype=torch.bool, device=DEVICE)
    runs = []
    for wide in (2**31, 1):
        monkeypatch.setattr(triton_path, "WIDE_OFFSETS", wide)
        sums, _, out = triton_path.triton_attend(q, k, v, real, None, False, batch_info(45, special, tokens), span=9)
        runs.append((sums.means(), out))
    for name, value in runs[0][0].items():
        assert torch.equal(value.nan_to_num(-1.0), runs[1][0][name].nan_to_num(-1.0)), name
    assert torch.equal(runs[0][1], runs[1][1])


@needs_triton
def test_a_few_hundred_tokens_in_the_default_blocks():
    """The default block sizes over 301 tokens (odd, padded): the logsumexp and every statistic against the float64
    map; blocks far from the diagonal, the sink and the recent window skip those sums (the kernel's tile tests)."""
    n = 301
    q, k, v, real = heads_of(n, 2, 64, heads=2, seed=1)
    info = batch_info(n)
    lengths = real.sum(dim=-1)
    lse, _, _ = triton_path._forward(q, k, v, lengths.int(), 64**-0.5, True, info, None, None, None, None, False)
    sums, _, _ = triton_path.triton_attend(q, k, v, real, None, True, info, need_output=False)
    p = oracle_map(q, k, real, True, None, None, None)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 64**-0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
    expected_lse = scores.masked_fill(~(causal & real[:, None, None, :]), float("-inf")).logsumexp(dim=-1)
    rows = real[:, None, :].expand_as(expected_lse)
    assert float((lse - expected_lse)[rows].abs().max()) < FLOAT32_TOLERANCE * float(expected_lse.abs().max())
    expected = sentence_stats(p, real.long(), True, None, sink=2, window=5)
    for name, value in sums.means().items():
        assert_close(value.cpu().double(), expected[name].cpu(), name)


@needs_triton
def test_bfloat16_inputs_give_float32_statistics_within_bfloat16s_rounding():
    """bfloat16 queries, keys and values: the scores are exact float32 products of bfloat16 inputs and p is rounded
    to bfloat16 only for the output's product, so the statistics match the float64 map of the same bfloat16 inputs
    to float32's bound and the output to bfloat16's unit roundoff (2^-8) of its largest value."""
    n = 40
    q, k, v, real = heads_of(n, 2, 64, dtype=torch.bfloat16)
    sums, _, output = triton_path.triton_attend(q, k, v, real, None, True, batch_info(n))
    p = oracle_map(q, k, real, True, None, None, None)
    expected = sentence_stats(p, real.long(), True, None, sink=2, window=5)
    for name, value in sums.means().items():
        assert_close(value.cpu().double(), expected[name].cpu(), name)
    assert output.dtype == torch.bfloat16
    reference = (p @ v.double().repeat_interleave(2, 1)).transpose(1, 2)  # [batch, query, head, dim]
    scale = float(reference.abs().max())
    assert float((output.double() - reference)[real].abs().max()) < 4 * 2**-8 * scale


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_hold_every_statistic_to_its_rounding_bound(dtype, monkeypatch):
    """bfloat16 and float16 queries, keys and values with special tokens, token classes and sinks, against the float64
    map of the same rounded inputs. The scores are exact float32 products, so every statistic is held to float32's
    bound except the flag masses (special_tokens, punctuation), which meet the feature columns through p rounded to
    the model's dtype (unit roundoff u = 2^-precision: 2^-8 for bfloat16, 2^-11 for float16): each flag's share of
    the same rounded p is off by at most 2u M (1 - M) <= u / 2 for a row mass M, plus, in float16, 2^-25 per key for
    p below its normal range."""
    monkeypatch.setattr(triton_path, "BLOCK_M", 32)
    monkeypatch.setattr(triton_path, "BLOCK_N", 16)
    n, heads = 40, 4
    q, k, v, real = heads_of(n, 2, 64, heads=heads, seed=3, dtype=dtype)
    sinks = torch.linspace(-1.0, 2.0, heads, device=DEVICE)
    special = torch.zeros(2, n, dtype=torch.bool, device=DEVICE)
    special[:, 0] = special[:, 7] = True
    tokens = token_classes(n, seed=2)
    info = batch_info(n, special, tokens)
    sums, _, _ = triton_path.triton_attend(q, k, v, real, None, True, info, need_output=False, sinks=sinks)
    p = oracle_map(q, k, real, True, None, None, sinks)
    expected = sentence_stats(p, real.long(), True, special, sink=2, window=5, tokens=tokens)
    u = 2**-8 if dtype == torch.bfloat16 else 2**-11
    rounded = u / 2 + (n * 2**-25 if dtype == torch.float16 else 0.0) + FLOAT32_TOLERANCE
    means = sums.means()
    assert set(means) == set(expected)
    for name, value in means.items():
        flag = name in ("special_tokens", "punctuation")
        assert_close(value.cpu().double(), expected[name].cpu(), name, rounded if flag else FLOAT32_TOLERANCE)
    lengths = real.sum(dim=-1)
    assert_close(sums.received.cpu().double(), received(p, 0, lengths).cpu(), "received")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_16_bit_value_weighted_sums_on_the_tensor_cores_hold_float32s_bound(dtype, causal, monkeypatch):
    """16-bit inputs sum the value-weighted map's totals, ln w and distances as p @ G on the tensor cores: p cut in
    two tensorfloat-32 parts (within 2^-20 of p), G's columns in three (exact), so each sum is within 2^-20 of the
    sum of its terms' sizes, and every value-weighted statistic within float32's bound of the float64 map of the
    same rounded inputs (decoder and encoder, whose tiles right of the rows count the distance the other way). G is
    built as the kernel reads it (weight_columns): its keys in TF32_ORDER, each column's parts adding up exactly."""
    monkeypatch.setattr(triton_path, "BLOCK_M", 32)
    monkeypatch.setattr(triton_path, "BLOCK_N", 16)
    n, heads, dim = 70, 4, 64  # the encoder's first block of rows sees the keys 32-63 whole, right of its rows
    q, k, v, real = heads_of(n, 2, dim, heads=heads, seed=6, dtype=dtype)
    projection = torch.nn.Linear(heads * dim, WIDTH).to(DEVICE)
    factors = values.head_factors(projection, heads)  # [head, k, dim]
    sums, _, _ = triton_path.triton_attend(q, k, v, real, None, causal, batch_info(n), need_output=False,
                                           factors=factors)
    p = oracle_map(q, k, real, causal, None, None, None)  # [batch, head, q, key]
    slices = projection.weight.detach().double().view(WIDTH, heads, dim).transpose(0, 1)  # [head, width, dim]
    norms = torch.einsum("hwd,bhkd->bhkw", slices, v.double().repeat_interleave(2, 1)).norm(dim=-1)  # [b, h, key]
    weighted = p * norms[:, :, None, :]
    weighted = weighted / weighted.sum(dim=-1, keepdim=True)
    expected = sentence_stats(weighted, real.long(), causal, None, sink=2, window=5)
    means = sums.means()
    for name in VALUE_WEIGHTED:
        assert_close(means[name + VW].cpu().double(), expected[name].cpu(), name + VW)
    w, columns = triton_path.weight_columns(norms.float(), 16)  # [b, h, key'], [b, h, 16, key']
    order = torch.tensor(triton_path.TF32_ORDER).repeat(w.shape[-1] // 8) + torch.arange(w.shape[-1]) // 8 * 8
    parts = columns[..., order.argsort()].double().view(2, heads, 4, 4, -1).sum(dim=2)  # [b, h, 4, key']
    assert torch.equal(parts[:, :, 0], w.double()) and torch.equal(parts[:, :, 3], w.double())
    assert torch.equal(parts[:, :, 2], (w * (torch.arange(w.shape[-1]) % 16)).double())


@needs_triton
def test_an_interpreter_before_3_9_is_refused_in_one_line(monkeypatch):
    """triton 3.6 (torch 2.11's) cannot run the kernels in its interpreter: --attention triton on a CPU is refused
    there in one line, and the tests that run the kernels skip (needs_triton)."""
    monkeypatch.setenv(triton_path.INTERPRET, "1")
    fake = type(sys)("triton")
    fake.__version__ = "3.6.0"
    fake.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    monkeypatch.setitem(sys.modules, "triton", fake)
    assert "before 3.9 cannot run" in triton_path.unavailable(torch.device("cpu"))
    fake.__version__ = "3.9.0"
    assert triton_path.unavailable(torch.device("cpu")) is None


@needs_triton
def test_triton_is_refused_on_a_cpu_without_the_interpreter(monkeypatch, llama_dir):
    monkeypatch.delenv(triton_path.INTERPRET, raising=False)
    loaded = load_model(str(llama_dir), "cpu")
    with pytest.raises(AttnprobeError, match=r"TRITON_INTERPRET=1.*use --attention auto, fused or blocked"):
        attention_path(loaded, "triton")
    assert attention_path(loaded, "auto") == "fused"  # auto takes triton on CUDA only


def test_auto_takes_triton_on_cuda_and_falls_back_naming_why(monkeypatch, llama_dir):
    """--attention auto on a (stubbed) CUDA device: the Triton path where triton imports, and `triton` asked for is
    taken; where triton is missing, the fused path, run.json saying why and --attention triton refused in that line;
    a layer the kernel does not cover (a head of 512) is named with its reason while the others stay on Triton."""
    from attnprobe import planning

    on_cpu = load_model(str(llama_dir), "cpu")
    features = kernel.discover(on_cpu)  # learnt on the CPU (the stub's device cannot run a pass)
    on_gpu = dataclasses.replace(on_cpu, device=torch.device("cuda"))
    monkeypatch.setattr(kernel, "unsupported", lambda loaded: None)
    monkeypatch.setattr(kernel, "discover", lambda loaded: features)
    monkeypatch.setattr(triton_path, "unavailable", lambda device: None)
    assert triton_path.AUTO_ON_CUDA is True
    assert attention_path(on_gpu, "auto") == attention_path(on_gpu, "triton") == "triton"
    record = planning.plan(on_gpu, planning.Options()).record(on_gpu.device, {"triton": 3}, 3)
    assert record["path"] == "triton" and record["triton_layers"] == [0, 1] and record["not_triton"] is None
    assert "why_not_triton" not in record
    wide = dataclasses.replace(features.features[1], head_size=512)
    monkeypatch.setattr(kernel, "discover", lambda loaded: dataclasses.replace(
        features, features=(features.features[0], wide)))
    record = planning.plan(on_gpu, planning.Options()).record(on_gpu.device, {"triton": 3}, 3)
    assert record["triton_layers"] == [0] and record["not_triton"] == {
        "a head size of 512 (the Triton kernel takes up to 256)": [1]}
    assert record["fused_min_tokens"] == kernel.FUSED_MIN_TOKENS  # that layer runs fused from there, else blocked
    missing = "--attention triton needs the triton package (CUDA builds of torch bring it): pip install triton"
    monkeypatch.setattr(triton_path, "unavailable", lambda device: missing)
    assert attention_path(on_gpu, "auto") == "fused"
    with pytest.raises(AttnprobeError, match="needs the triton package"):
        attention_path(on_gpu, "triton")
    record = planning.plan(on_gpu, planning.Options()).record(on_gpu.device, {"fused": 3}, 3)
    assert record["path"] == "fused" and record["why_not_triton"] == missing
    assert "why_not_triton" not in planning.plan(on_cpu, planning.Options()).record(on_cpu.device, {"fused": 3}, 3)


def test_a_kernel_that_fails_to_launch_falls_back_under_auto_and_stops_an_explicit_triton_run(monkeypatch, llama_dir):
    """A Triton kernel that cannot compile or launch here (out of shared memory on a smaller card, say): under auto
    (triton_fallback) every layer runs on the other paths, equal to a run without Triton, and the failure is named
    as the layers' reason (run.json's not_triton) without a retry; under --attention triton the run stops in one
    line."""
    from attnprobe.batching import pad_batch
    from attnprobe.kernel import attention

    loaded = load_model(str(llama_dir), "cpu")
    ids, mask = pad_batch([loaded.tokenizer(t)["input_ids"] for t in SENTENCES[:3]], loaded.device)
    tried = []

    def failing(*args, **kwargs):
        tried.append(1)
        raise triton_path.LaunchFailed("the Triton statistics kernel could not run here (OutOfResources: out of "
                                       "resource: shared memory; float32, head size 16): use --attention fused or "
                                       "blocked")

    monkeypatch.setattr(attention, "triton_attend", failing)
    monkeypatch.setattr(triton_path, "FAILED", {})

    def run(**options):
        found = {}
        with kernel.statistics_attention(loaded):
            path = kernel.run_batch(loaded, ids, mask, lambda layer, sums, maps: found.update({layer: sums.total}),
                                    **options)
        return path, found

    with pytest.raises(AttnprobeError, match="could not run here.*--attention fused or blocked"):
        run(triton=True)
    assert not triton_path.FAILED
    path, fell_back = run(triton=True, triton_fallback=True)
    assert path == "blocked" and len(tried) == 2  # the second layer, of the same shape, did not try again
    _, plain = run()
    assert set(fell_back) == set(plain) == set(range(loaded.num_layers))
    for layer in plain:
        torch.testing.assert_close(fell_back[layer], plain[layer], rtol=0, atol=0, equal_nan=True)
    found = triton_path.record(kernel.discover(loaded).features, torch.float32)
    assert found["triton_layers"] == [] and list(found["not_triton"].values()) == [[0, 1]]
    assert "failed here under --attention auto (the Triton statistics kernel could not run here" in \
        next(iter(found["not_triton"]))


def test_layers_the_triton_kernel_does_not_cover_are_named_by_reason():
    plain = kernel.LayerFeatures(causal=True, span=4, softcap=30.0, sinks=True, groups=8, scale=0.1, head_size=128)
    wide = kernel.LayerFeatures(**{**plain.__dict__, "head_size": 512})
    assert triton_path.reason(plain, torch.bfloat16) is None
    assert "512" in triton_path.reason(wide, torch.float32)
    assert "float64" in triton_path.reason(plain, torch.float64)
    found = triton_path.record((plain, wide, plain), torch.float32)
    assert found["triton_layers"] == [0, 2] and list(found["not_triton"].values()) == [[1]]


@needs_triton
def test_analyze_attention_triton_equals_attention_blocked(llama_dir, tmp_path):
    """`attnprobe analyze --attention triton` as a user runs it (under the interpreter here), a tiny grouped-query
    Llama: heads.csv and top_tokens.csv equal the blocked path's to float32's bound, and run.json names the path,
    its layers and the sequences it ran."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    found = {}
    for path in ("triton", "blocked"):
        out = tmp_path / path
        result = runner.invoke(app, ["analyze", "--model", str(llama_dir), "--corpus", str(corpus), "--out", str(out),
                                     "--attention", path, "--resamples", "5", "--device", DEVICE, "--top-tokens-min",
                                     "1"])
        assert result.exit_code == 0, result.output
        found[path] = {name: pd.read_csv(out / name) for name in ("heads.csv", "top_tokens.csv")}
        found[path]["run"] = json.loads((out / "run.json").read_text(encoding="utf-8"))["attention"]
    record = found["triton"]["run"]
    assert record["path"] == "triton" and record["triton_layers"] == [0, 1] and record["not_triton"] is None
    assert record["sequences"] == {"triton": len(SENTENCES)}
    for name in ("heads.csv", "top_tokens.csv"):
        got, expected = found["triton"][name], found["blocked"][name]
        assert list(got.columns) == list(expected.columns) and len(got) == len(expected) > 0
        assert_close(got.select_dtypes("number"), expected.select_dtypes("number"), name)


@pytest.fixture(scope="module")
def compiled_offline():
    """tests/triton_compile.py's default variants, compiled once: {name: {count: value}} and its output."""
    env = {key: value for key, value in os.environ.items() if key != triton_path.INTERPRET}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns that 3.10 changes the default
    done = subprocess.run([sys.executable, str(COMPILE_SCRIPT)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=COMPILE_SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {line[3:].split(":", 1)[0]: {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", line)}
             for line in done.stdout.splitlines() if line.startswith("OK ")}
    return found, done.stdout


@compilable
def test_the_kernels_compile_for_an_h100_without_one(compiled_offline):
    """Triton's compiler (not the interpreter, which runs what the compiler refuses) builds the richest variants and
    analyze's default down to a cubin for sm_90, each within an H100's 227 KiB of shared memory."""
    found, output = compiled_offline
    assert len(found) == 5 and max(counts["shared"] for counts in found.values()) <= 227 * 1024, output


@compilable
def test_the_default_variant_meets_its_machine_code_targets(compiled_offline):
    """analyze's default features on a bfloat16 model of head size 64, compiled for sm_90: within triton_compile's
    TARGETS (no spills, at most 168 registers, 500 instructions per tile of the main loop) and what the kernel
    reached (REACHED; see docs/development.md)."""
    found, output = compiled_offline
    counts = found[TARGETS["TARGET_VARIANT"]]
    if "registers" not in counts:
        pytest.skip("this triton wheel ships no ptxas and nvdisasm to count with")
    for bound in (TARGETS["TARGETS"], TARGETS["REACHED"]):
        for name, most in bound.items():
            assert counts[name] <= most, (name, counts, output)
    assert counts["loop_spills"] == 0, output


def test_a_kernel_triton_cannot_run_is_one_line_naming_the_fix():
    """Triton's own errors at compile or launch (out of shared memory on a smaller GPU, ...) become one line that
    names --attention fused or blocked; any other error passes through as it is."""
    OutOfResources = type("OutOfResources", (Exception,), {"__module__": "triton.runtime.errors"})
    with pytest.raises(AttnprobeError, match=r"Triton statistics kernel could not run here \(OutOfResources: out of "
                                             r"resource: shared memory.*head size 256\): use --attention fused"):
        with triton_path._launching("statistics", torch.float32, 256):
            raise OutOfResources("out of resource: shared memory, Required: 336000\nmore")
    with pytest.raises(KeyError):
        with triton_path._launching("statistics", torch.float32, 256):
            raise KeyError("not triton's")


@needs_triton
def test_the_layers_of_a_batch_share_its_inputs_and_bin_positions_once(monkeypatch):
    """Every layer of a batch reuses the first's geometry, position bins (computed on the host: one sync per batch,
    not per layer) and kernel inputs (Batch.shared)."""
    from attnprobe import metrics
    q, k, v, real = heads_of(20, 2, 16)
    info = batch_info(20, tokens=token_classes(20))
    calls = []
    monkeypatch.setattr(metrics, "position_bin", lambda i: calls.append(i) or torch.zeros_like(i))
    for _ in range(3):
        triton_path.triton_attend(q, k, v, real, None, True, info, need_output=False)
    assert len(calls) == 1
    assert len([key for key in info.kept if key[0] == "triton inputs"]) == 1


def test_the_grid_keeps_its_second_axis_within_cudas_limit():
    """(sequence, head) pairs go on the grid's first axis (2**31 - 1 programs): 4,096 sentences x 64 heads (the
    largest --batch-size) would pass the second axis' 65,535 there; the row blocks of 32,768 tokens in 16-row blocks
    fit the second. The indexing itself is proven by the interpreter runs above (2 sentences x 2 to 8 heads)."""
    assert triton_path.launch_grid(32_768, 16, 4096, 64) == (4096 * 64, 2048)
    first, second = triton_path.launch_grid(32_768, 16, 4096, 64)
    assert first <= 2**31 - 1 and second <= triton_path.MAX_GRID_Y < 4096 * 64
    assert triton_path.launch_grid(1, 64, 1, 1) == (1, 1)
    assert triton_path.launch_grid(65, 64, 3, 5) == (15, 2)


def test_float32_blocks_fit_an_a100_at_every_head_size():
    """The block sizes _blocks picks are those tests/triton_compile.py compiles within an A100's 163 KiB of shared
    memory (--all --arch 80): 64 x 64 up to 64 channels, 32 x 32 up to 128, 16 x 32 above."""
    assert triton_path._blocks(torch.float32, 64) == (64, 64)
    assert triton_path._blocks(torch.float32, 128) == (32, 32)
    assert triton_path._blocks(torch.float32, 256) == (16, 32)
    assert triton_path._blocks(torch.bfloat16, 256) == (64, 64)


def test_registers_are_capped_where_the_compile_found_no_spill():
    """stats_forward's register cap (tests/triton_compile.py: 167 registers, no spill, for 16-bit heads of 64 without
    value weighting; the value-weighted kernel would spill 1,244 bytes at the cap, 118 accesses of them in the main
    loop, wider heads more)."""
    assert triton_path.register_cap(torch.bfloat16, 64, False) == {"maxnreg": 168}
    assert triton_path.register_cap(torch.float16, 32, False) == {"maxnreg": 168}
    assert triton_path.register_cap(torch.bfloat16, 64, True) == {}
    assert triton_path.register_cap(torch.bfloat16, 128, False) == {}
    assert triton_path.register_cap(torch.float32, 64, False) == {}
    assert triton_path.stages(256) == 2 and triton_path.stages(128) == 3
