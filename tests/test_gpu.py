"""The fused path's CUDA branch: aten's memory-efficient attention behind kernel.flash (kernel.efficient_kernel).

On CPU the branch runs with a plain-torch stand-in for the aten call (tests/efficient_reference.py: the same
signature, layout and input checks), so everything but the call itself is tested here: Q and K at their own head
size with wider values, the bias padded and broadcast as the kernel reads it, the logsumexp cut from its multiple of
32. The statistics must equal a float64 softmax and the CPU kernel's fused results, and whole models' statistics
their eager maps. The tests marked `cuda` run the real kernel on a GPU (`make gpu-check` on a lent machine) and are
skipped elsewhere: fused = blocked = eager on the zoo's main families in float32 and bfloat16, and no [n, n] map.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from efficient_reference import efficient_attention
from test_blocked import assert_close, corpus_of
from zoo import make

from attnprobe import kernel, values
from attnprobe.analysis import analyze_loaded
from attnprobe.kernel import triton_path
from attnprobe.metrics import VALUE_WEIGHTED, TokenClasses, bin_count, received, sentence_stats
from attnprobe.model import load_model
from attnprobe.planning import Options

CUDA = torch.cuda.is_available()
FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "bert")  # the zoo's main families: tests/zoo.py
SINK, RECENT = 1, 3  # small, so that sink_window is defined on the test sentences

# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8. Eager attention in bfloat16 rounds each score twice (the
# product q.k, then its scaling), so a score s moves by up to 2 u |s|, and rounds each weight p_ij (relative u); the
# blocked path rounds the scores as eager does, the fused path takes the scores of the model's bfloat16 queries and
# keys in float32 and rounds neither. A row's log-weights then move by up to 2 u MAX_LOGIT against eager's, and its
# statistics (functions of the weights whose first-order change is bounded by the largest change of a log-weight,
# relative above 1) and the layer's output, which the next layer reads, by about as much. The bound is loose for
# typical rows (rounding errors of many scores cancel) and still far below the tenths to whole units by which a
# structural fault (a mask, a row, a head, a logsumexp read off its place) moves them; precision is checked by the
# float32 runs and by the float32 statistics of bfloat16 inputs against a float64 softmax.
# aten's memory-efficient kernel multiplies float32 on GPUs of compute capability 8.0 and later as three TF32 products
# (CUTLASS's 3xTF32, OpMultiplyAddFastF32): each product keeps about 2^-21 of its value, 8 times float32's 2^-24, so
# what the CUDA kernel computes in float32 is held to 8 times float32's bound.
CUDA_FLOAT32_TOLERANCE = 8 * FLOAT32_TOLERANCE
BFLOAT16_UNIT = 2.0**-8
MAX_LOGIT = 32.0  # the zoo's scores on the test sentences stay below this (test_the_zoo_s_scores_stay_below_max_logit)
BFLOAT16_TOLERANCE = 2 * BFLOAT16_UNIT * MAX_LOGIT


def cuda_test(test):
    """Marked `cuda` (`make gpu-check` runs `pytest -m cuda`) and skipped where torch sees no GPU."""
    skip = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: `make gpu-check` runs the tests marked cuda on a "
                              "lent machine (docs/development.md#gpu-check)")
    return pytest.mark.cuda(skip(test))


@pytest.fixture
def standin(monkeypatch):
    """The CPU's fused kernel replaced by the CUDA one (efficient_kernel) over the plain-torch stand-in; the
    (Q/K head size, V head size) of every call it makes."""
    calls = []

    def recorded(query, key, value, attn_bias, *args, **kwargs):
        calls.append((query.shape[-1], value.shape[-1]))
        return efficient_attention(query, key, value, attn_bias, *args, **kwargs)

    monkeypatch.setitem(kernel.KERNELS, "cpu", kernel.FusedKernel("stand-in", kernel.efficient_kernel(recorded),
                                                                    one_head_size=False))
    return calls


def sharp_heads(n: int, logits: float, dtype: torch.dtype, device: str, seed: int = 0):
    """q [2, 4, n, 16] and k, v [2, 2, n, 16] (grouped-query) in `dtype` on `device`, scaled so that the largest
    logits reach about `logits`; the second sequence is padded after two thirds (test_fused's, on any device)."""
    generator = torch.Generator().manual_seed(seed)
    b, h, kv, d = 2, 4, 2, 16
    radius = math.sqrt(logits * math.sqrt(d))
    q = torch.randn(b, h, n, d, generator=generator)
    k = torch.randn(b, kv, n, d, generator=generator)
    q = q / q.norm(dim=-1, keepdim=True) * radius
    k = k / k.norm(dim=-1, keepdim=True) * radius + 0.3  # off-centre keys: the centring has work to do
    v = torch.randn(b, kv, n, d, generator=generator)
    v = v * torch.randn(b, kv, n, 1, generator=generator).mul(1.5).exp()  # value norms spread widely
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, n - n // 3 :] = False
    return *(x.to(dtype).to(device) for x in (q, k, v)), real.to(device)


def oracle(q, k, real, causal):
    """The float64 softmax map [batch, head, query, key] of the same (rounded) queries and keys, on CPU."""
    q, k, real = q.double().cpu(), k.double().cpu(), real.cpu()
    groups, n = q.shape[1] // k.shape[1], q.shape[2]
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    allowed = real[:, None, None, :] & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def check_fused_against_a_float64_softmax(device: str, dtype: torch.dtype, causal: bool, n: int = 300,
                                          logits: float = 40.0, tolerance: float = FLOAT32_TOLERANCE) -> None:
    """fused_attend's every statistic (special tokens, token scores and the mass received, the value-weighted ones),
    example map and output against the float64 map of the same rounded inputs: the statistics are float32 whatever
    the model's dtype, so to float32's bound (`tolerance`: the kernel's); the output in the model's dtype to its
    own."""
    q, k, v, real = sharp_heads(n, logits, dtype, device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (2, n), generator=generator)  # [batch, seq]: ids under 40 repeat
    tokens = TokenClasses(ids.to(device), (torch.rand(2, n, generator=generator) < 0.2).to(device))
    special = torch.zeros(2, n, dtype=torch.bool, device=device)
    special[:, 0] = special[:, 5] = True
    projection = torch.nn.Linear(4 * 16, 24).to(device)
    factors = values.head_factors(projection, 4)  # [head, 16, 16]
    info = kernel.Batch(layers={}, last_layer=0, special=special, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=(1, 12), on_layer=lambda *_: None, tokens=tokens)
    sums, example, output = kernel.fused_attend(q, k, v, real, None, causal, info, factors=factors)
    p = oracle(q, k, real, causal)
    cpu = {"real": real.cpu(), "special": special.cpu(), "tokens": TokenClasses(ids, tokens.punctuation.cpu())}
    expected = sentence_stats(p, cpu["real"].long(), causal, cpu["special"], sink=2, window=8, tokens=cpu["tokens"])
    got = {name: value.double().cpu() for name, value in sums.means().items()}
    for name, value in expected.items():
        assert_close(got[name], value, name, tolerance)
    slices = projection.weight.detach().double().cpu().view(24, 4, 16).transpose(0, 1)  # [head, width, head size]
    norms = torch.einsum("hwd,bhkd->bhkw", slices, v.double().cpu().repeat_interleave(2, 1)).norm(dim=-1)
    weighted = p * norms[:, :, None, :]  # [batch, head, query, key]
    weighted = weighted / weighted.sum(dim=-1, keepdim=True)
    weighted_expected = sentence_stats(weighted, cpu["real"].long(), causal, None, sink=2, window=8)
    for name in VALUE_WEIGHTED:
        assert_close(got[name + "_vw"], weighted_expected[name], name + "_vw", tolerance)
    assert_close(sums.received.double().cpu(), received(p, 0, cpu["real"].sum(dim=-1)), "received", tolerance)
    np.testing.assert_allclose(example.cpu(), p[1, :, :12, :12].float(), atol=tolerance)
    reference = (p @ v.double().cpu().repeat_interleave(2, 1)).transpose(1, 2)  # [batch, query, head, dim]
    bound = tolerance if dtype == torch.float32 else 4 * torch.finfo(dtype).eps / 2  # 4 unit roundoffs
    assert output.dtype == dtype
    error = (output.double().cpu() - reference)[cpu["real"]].abs().max()
    assert float(error) < bound * max(1.0, float(reference.abs().max())), float(error)


# ---- on CPU: the CUDA branch over the stand-in ---------------------------------------------------------------------


def test_the_stand_in_has_the_cuda_op_s_results():
    """The stand-in returns what torch's own shape function of the CUDA op says it returns: the output's shape,
    dtype and memory layout, and the float32 logsumexp padded to a multiple of 32 queries."""
    q, k = torch.randn(2, 3, 37, 16), torch.randn(2, 3, 37, 16)
    v = torch.randn(2, 3, 37, 24)
    bias = kernel.devices._kernel_bias(torch.zeros(2, 1, 1, 37), q, k)
    got = efficient_attention(q, k, v, bias, True, 0.0, True, scale=0.25)
    meta = torch.ops.aten._scaled_dot_product_efficient_attention(
        *(x.to("meta") for x in (q, k, v, bias)), True, 0.0, True, scale=0.25)
    for mine, theirs in zip(got[:2], meta[:2]):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    assert got[0].stride() == meta[0].stride()  # [batch, query, head, width] in memory
    assert got[1].shape[-1] == 64 and got[1][..., 37:].isnan().all()


@pytest.mark.parametrize("what", ["grouped heads", "different Q/K head sizes", "a bias of another dtype",
                                  "an unaligned bias"])
def test_the_stand_in_refuses_what_the_cuda_op_refuses(what):
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 4, 20, 16), torch.randn(1, 4, 20, 24)
    bias = None
    if what == "grouped heads":
        k, v = k[:, :2], v[:, :2]
    elif what == "different Q/K head sizes":
        k = torch.randn(1, 4, 20, 24)
    elif what == "a bias of another dtype":
        bias = torch.zeros(1, 4, 20, 20, dtype=torch.float64)
    else:
        bias = torch.zeros(1, 4, 20, 21)[..., :20]  # rows 21 floats apart: not a multiple of 16 bytes
    with pytest.raises(RuntimeError):
        efficient_attention(q, k, v, bias, True)


def test_the_kernel_s_bias_is_aligned_broadcast_and_equal_to_the_mask():
    """_kernel_bias: the queries' dtype, rows starting on a multiple of 16 elements, every query row the same memory
    (stride 0: no [n, n] copy), and the values of the [batch, head or 1, 1, key] term it was given."""
    q, k = torch.randn(2, 4, 37, 8, dtype=torch.bfloat16), torch.randn(2, 4, 37, 8, dtype=torch.bfloat16)
    additive = torch.zeros(2, 1, 1, 37).masked_fill_(torch.arange(37) > 30, float("-inf"))
    bias = kernel.devices._kernel_bias(additive, q, k)
    assert bias.shape == (2, 4, 37, 37) and bias.dtype == torch.bfloat16
    assert bias.stride(2) == 0 and bias.stride(1) == 0 and bias.stride(0) % kernel.BIAS_ALIGNMENT == 0
    assert torch.equal(bias[1, 3, 5].float(), additive[1, 0, 0])


def test_the_seam_gives_the_cpu_kernel_s_results_through_the_cuda_branch(standin):
    """kernel.flash with Q/K narrower than V, a padding and bias term and 37 queries (no multiple of 16 or 32): the
    CUDA branch over the stand-in and the CPU kernel (which widens Q and K itself) agree."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 4, 37, 16), torch.randn(2, 4, 37, 40)
    additive = torch.randn(2, 4, 1, 37).masked_fill_(torch.arange(37) > 30, float("-inf"))
    for causal in (True, False):
        out, lse = kernel.flash(q, k, v, causal, additive, 0.3)
        assert standin[-1] == (16, 40)  # Q/K at their own head size
        cpu = kernel.KERNELS["cpu"]
        kernel.KERNELS["cpu"] = kernel.FusedKernel("cpu", kernel.devices._cpu_flash, one_head_size=True)
        try:
            out_cpu, lse_cpu = kernel.flash(q, k, v, causal, additive, 0.3)
        finally:
            kernel.KERNELS["cpu"] = cpu
        assert out.shape == out_cpu.shape == (2, 4, 37, 40) and lse.shape == lse_cpu.shape == (2, 4, 37)
        assert_close(out, out_cpu, "output")
        assert_close(lse, lse_cpu, "logsumexp")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_branch_s_statistics_equal_a_float64_softmax(standin, causal, dtype):
    check_fused_against_a_float64_softmax("cpu", dtype, causal)
    assert {qk for qk, _ in standin} == {16}  # every call kept Q and K at the head size ...
    assert max(v for _, v in standin) > 16  # ... while the statistics' values were wider


@pytest.mark.parametrize("causal", [True, False])
def test_the_cpu_kernel_s_statistics_equal_the_same_float64_softmax(causal):
    """The current fused results (aten's CPU flash kernel) pass the same check: the stand-in changes nothing."""
    check_fused_against_a_float64_softmax("cpu", torch.float32, causal)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make(name, root / re.sub(r"\W+", "_", name)) for name in FAMILIES}


def analyzed(loaded, attention):
    return analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5, keep_per_sentence=True,
                          options=Options(attention=attention, sink=SINK, window=RECENT, block_rows=3))


def assert_paths_agree(folder, device: str, dtype: str) -> None:
    """fused (every fusable layer, every batch) = blocked = eager, per sentence and by position, on `device`."""
    loaded = load_model(str(folder), device, dtype)
    runs = {a: analyzed(loaded, a) for a in ("eager", "blocked", "fused")}
    assert runs["fused"].run["attention"]["path"] == "fused"
    assert runs["fused"].run["attention"]["fused_layers"] == list(range(loaded.num_layers))
    eager = runs["eager"]
    for way in ("blocked", "fused"):
        tolerance = BFLOAT16_TOLERANCE if dtype == "bfloat16" else \
            CUDA_FLOAT32_TOLERANCE if device == "cuda" and way == "fused" else FLOAT32_TOLERANCE
        for column in eager.per_sentence.columns:
            if column != "category":
                assert_close(runs[way].per_sentence[column], eager.per_sentence[column], f"{way} {column}", tolerance)
        for column in eager.positions.columns:
            assert_close(runs[way].positions[column], eager.positions[column], f"{way} positions {column}",
                         tolerance)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cuda_branch_equals_the_eager_maps_on_cpu(standin, families, name):
    assert_paths_agree(families[name], "cpu", "float32")
    assert standin


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_cuda_branch_equals_the_eager_maps_in_bfloat16_on_cpu(standin, families, name):
    assert_paths_agree(families[name], "cpu", "bfloat16")
    assert standin


@pytest.mark.parametrize("name", FAMILIES)
def test_the_zoo_s_scores_stay_below_max_logit(families, name, monkeypatch):
    """BFLOAT16_TOLERANCE assumes scores |s| below MAX_LOGIT on the test sentences: every score the blocked path
    computes (its own queries and keys, the model's scale) in float32."""
    largest = []
    real = kernel.attend

    def measured(query, key, value, padding, scaling, *args, **kwargs):
        groups = query.shape[1] // key.shape[1]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = scale * (query.float() @ key.float().repeat_interleave(groups, 1).transpose(-1, -2))
        largest.append(float(scores.abs().max()))  # padded keys too: an upper bound
        return real(query, key, value, padding, scaling, *args, **kwargs)

    monkeypatch.setattr(kernel.attention, "attend", measured)
    analyzed(load_model(str(families[name]), "cpu"), "blocked")
    assert largest and max(largest) < MAX_LOGIT, max(largest)


# ---- on a GPU: the aten kernel itself ------------------------------------------------------------------------------


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_seam_equals_the_stand_in(dtype, causal):
    """The aten call through efficient_kernel against the stand-in on the same inputs: the logsumexp (float32 from the
    rounded inputs) to the kernel's float32 bound; the output in the inputs' dtype to 4 of its unit roundoffs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 100, d).to(dtype) for d in (64, 64, 72))
    additive = torch.randn(2, 4, 1, 100).masked_fill_(torch.arange(100) > 80, float("-inf")).to(dtype)
    out, lse = kernel.flash(*(x.cuda() for x in (q, k, v)), causal, additive.cuda(), 0.125)
    ref_out, ref_lse = kernel.efficient_kernel(efficient_attention)(q, k, v, causal, additive, 0.125)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    assert_close(lse.cpu(), ref_lse, "logsumexp", CUDA_FLOAT32_TOLERANCE)
    bound = CUDA_FLOAT32_TOLERANCE if dtype == torch.float32 else 4 * torch.finfo(dtype).eps / 2
    assert float((out.cpu().double() - ref_out.double()).abs().max()) < bound * max(1.0, float(ref_out.abs().max()))


@cuda_test
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_statistics_equal_a_float64_softmax(causal, dtype):
    check_fused_against_a_float64_softmax("cuda", dtype, causal, n=700, logits=48.0, tolerance=CUDA_FLOAT32_TOLERANCE)


@cuda_test
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_fused_equals_blocked_equals_eager(families, name, dtype):
    assert_paths_agree(families[name], "cuda", dtype)


@cuda_test
def test_cuda_fused_path_never_builds_a_map():
    """16,384 tokens of 4 heads through the fused path (output, statistics, value-weighted, received): one [n, n]
    float32 map of one head would take 1 GiB; the whole call stays far below it."""
    n = 16384
    q, k, v, real = sharp_heads(n, 10.0, torch.bfloat16, "cuda")
    factors = values.head_factors(torch.nn.Linear(4 * 16, 24).cuda(), 4)
    ids = torch.randint(0, 1000, (2, n), device="cuda")
    tokens = TokenClasses(ids, torch.zeros(2, n, dtype=torch.bool, device="cuda"))
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=4, window=256, bins=bin_count(n),
                        budget_bytes=64 * 2**20, block_rows=None, example=None, on_layer=lambda *_: None,
                        tokens=tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sums, _, _ = kernel.fused_attend(q, k, v, real, None, True, info, factors=factors)
    assert sums.received is not None
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    one_map = n * n * 4
    assert peak < one_map / 4, (peak, one_map)


@cuda_test
def test_cuda_auto_runs_the_triton_kernel_and_fused_the_fused_kernel(families, monkeypatch):
    """--attention auto on a GPU: the Triton kernel on every layer of a plain model (triton_path.AUTO_ON_CUDA, which
    this test's passing justifies); --attention fused: the fused kernel from FUSED_MIN_TOKENS on."""
    monkeypatch.setattr(kernel, "FUSED_MIN_TOKENS", 1)
    loaded = load_model(str(families["llama"]), "cuda")
    assert triton_path.AUTO_ON_CUDA is True
    result = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5)
    assert result.run["attention"]["path"] == "triton"
    assert result.run["attention"]["triton_layers"] == list(range(loaded.num_layers))
    assert set(result.run["attention"]["sequences"]) == {"triton"}
    result = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5, options=Options(attention="fused"))
    assert result.run["attention"]["path"] == "fused"
    assert result.run["attention"]["fused_layers"] == list(range(loaded.num_layers))
    assert set(result.run["attention"]["sequences"]) == {"fused"}


@cuda_test
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", (*FAMILIES, "gemma2"))
def test_cuda_triton_equals_blocked(families, name, dtype, tmp_path_factory):
    """The compiled Triton kernel (--attention triton) = the blocked path on the GPU, per sentence and by position:
    to 1e-5 in float32 (both multiply in IEEE float32), to BFLOAT16_TOLERANCE in bfloat16 (the blocked path rounds
    its scores to bfloat16 as eager does, the kernel keeps them in float32). gemma2: soft-capping, sliding windows,
    its own scale."""
    folder = families[name] if name in families else make(name, tmp_path_factory.mktemp(name))
    loaded = load_model(str(folder), "cuda", dtype)
    runs = {a: analyzed(loaded, a) for a in ("blocked", "triton")}
    assert runs["triton"].run["attention"]["triton_layers"] == list(range(loaded.num_layers))
    tolerance = BFLOAT16_TOLERANCE if dtype == "bfloat16" else FLOAT32_TOLERANCE
    for column in runs["blocked"].per_sentence.columns:
        if column != "category":
            assert_close(runs["triton"].per_sentence[column], runs["blocked"].per_sentence[column], column, tolerance)
    for column in runs["blocked"].positions.columns:
        assert_close(runs["triton"].positions[column], runs["blocked"].positions[column], column, tolerance)

