"""The fused path: every statistic from the fused kernel's logsumexp, against a float64 softmax computed here."""

import math

import numpy as np
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_blocked import assert_close, corpus_of

from attnprobe import kernel, values
from attnprobe.analysis import analyze_loaded
from attnprobe.metrics import VALUE_WEIGHTED, TokenClasses, bin_count, received, sentence_stats
from attnprobe.model import load_model
from attnprobe.planning import Options


def sharp_heads(n: int, logits: float, seed: int = 0):
    """q [2, 4, n, 16] and k, v [2, 2, n, 16] (grouped-query), scaled so that the largest logits reach about
    `logits`; the second sequence is padded after two thirds."""
    torch.manual_seed(seed)
    b, h, kv, d = 2, 4, 2, 16
    radius = math.sqrt(logits * math.sqrt(d))
    q = torch.randn(b, h, n, d)
    k = torch.randn(b, kv, n, d)
    q = q / q.norm(dim=-1, keepdim=True) * radius
    k = k / k.norm(dim=-1, keepdim=True) * radius + 0.3  # off-centre keys: the centring has work to do
    v = torch.randn(b, kv, n, d)
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, n - n // 3 :] = False
    return q, k, v, real


def oracle(q, k, real, causal):
    """The float64 softmax map [batch, head, query, key] of the same scores and mask."""
    groups = q.shape[1] // k.shape[1]
    n = q.shape[2]
    scores = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    allowed = real[:, None, None, :] & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1), scores


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "logits"), [(40, 50.0), (700, 48.0)])
def test_fused_statistics_equal_a_float64_softmax_with_sharp_heads(causal, n, logits):
    q, k, v, real = sharp_heads(n, logits)
    special = torch.zeros(2, n, dtype=torch.bool)
    special[:, 0] = special[:, 5] = True
    info = kernel.Batch(layers={}, last_layer=0, special=special, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=(1, 12), on_layer=lambda *_: None)
    sums, example, output = kernel.fused_attend(q, k, v, real, None, causal, info)
    p, scores = oracle(q, k, real, causal)
    assert float(scores[scores.isfinite()].abs().max()) > 0.7 * logits  # the heads are as sharp as promised
    expected = sentence_stats(p, real.long(), causal, special, sink=2, window=8)
    for name, value in sums.means().items():
        assert_close(value.double(), expected[name], name)
    np.testing.assert_allclose(example, p[1, :, :12, :12].float(), atol=FLOAT32_TOLERANCE)
    reference = (p.float() @ v.repeat_interleave(2, 1)).transpose(1, 2)  # [batch, query, head, dim]
    assert float((output - reference)[real].abs().max()) < FLOAT32_TOLERANCE * max(1.0, float(reference.abs().max()))


@pytest.mark.parametrize("causal", [True, False])
def test_fused_value_weighted_statistics_equal_a_float64_softmax_with_sharp_heads(causal):
    """The value-weighted map's statistics (their own call; the single weights and the recent window's band derived
    from the map's scores with the lse and bias differences) on 700 sharp tokens against the float64 weighted map."""
    n = 700
    q, k, v, real = sharp_heads(n, 40.0)
    torch.manual_seed(1)
    v = v * torch.randn(*v.shape[:-1], 1).mul(1.5).exp()  # [batch, kv head, key, dim]: norms spread widely
    v[:, 0, 3] = 0.0  # a key of norm 0 for KV head 0
    projection = torch.nn.Linear(4 * 16, 24)
    factors = values.head_factors(projection, 4)  # [head, 16, 16]
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=None, on_layer=lambda *_: None)
    sums, _, _ = kernel.fused_attend(q, k, v, real, None, causal, info, factors=factors)
    p, _ = oracle(q, k, real, causal)
    slices = projection.weight.detach().double().view(24, 4, 16).transpose(0, 1)  # [head, width, head size]
    norms = torch.einsum("hwd,bhkd->bhkw", slices, v.double().repeat_interleave(2, 1)).norm(dim=-1)  # [b, h, key]
    weighted = p * norms[:, :, None, :]  # [batch, head, query, key]
    weighted = weighted / weighted.sum(dim=-1, keepdim=True)
    expected = sentence_stats(weighted, real.long(), causal, None, sink=2, window=8)
    got = sums.means()
    for name in VALUE_WEIGHTED:
        assert_close(got[name + "_vw"].double(), expected[name], name + "_vw")
    assert (got["entropy_vw"] - got["entropy"]).abs().max() > 0.01  # not the map's own under another name


def test_a_sink_of_norm_zero_far_above_the_rest_keeps_the_value_weighted_window():
    """Every row puts all but e^-100 of its weight on key 0, whose value is 0: its value-weighted map is the rest,
    whose weights underflow float32 in the map (e^-100 < 1e-38). The fused path keeps it in log space: the recent
    window's value-weighted mass is still the share of the window among the keys of norm above 0."""
    n, d = 40, 16
    q = torch.zeros(1, 2, n, d)
    q[..., 0] = 100.0 * d**0.5  # [batch, head, query, dim]: s_i0 = 100 (scale d^-0.5), every other score 0
    k = torch.zeros(1, 2, n, d)
    k[:, :, 0, 0] = 1.0
    k[:, :, 1:, 1] = 1.0
    v = torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(0))
    v[:, :, 0] = 0.0  # key 0 moves nothing
    factors = values.head_factors(torch.nn.Linear(2 * d, 8), 2)
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=None, on_layer=lambda *_: None)
    real = torch.ones(1, n, dtype=torch.bool)
    sums, _, _ = kernel.fused_attend(q, k, v, real, None, True, info, factors=factors)
    p, _ = oracle(q, k, real, True)  # float64: e^-100 is representable
    norms = values.key_norms(v, factors).double()  # [batch, head, key]
    weighted = p * norms[:, :, None, :]
    weighted = weighted / weighted.sum(dim=-1, keepdim=True)  # [batch, head, query, key]; row 0 is 0/0
    expected = sentence_stats(weighted, real.long(), True, None, sink=2, window=8)["sink_window"]
    assert float(p[0, 0, 20, 1]) < 1e-40  # the weights the window holds underflow float32
    assert 0.1 < float(expected.min())  # and the value-weighted window holds a good share
    assert_close(sums.means()["sink_window_vw"].double(), expected, "sink_window_vw")


@pytest.mark.parametrize("causal", [True, False])
def test_fused_token_scores_equal_a_float64_softmax_with_many_repeats(causal, monkeypatch):
    """duplicate (token-order tiles: small packs and a large group cut by rows and keys), punctuation and the mass
    each key receives, with few distinct ids so that most positions repeat, against the float64 map."""
    monkeypatch.setattr(kernel.duplicates, "TILE_ROWS", 8)
    monkeypatch.setattr(kernel.duplicates, "TILE_KEYS", 24)
    n = 300
    q, k, v, real = sharp_heads(n, 30.0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (2, n), generator=generator)  # [batch, seq]: ids under 40 repeat ...
    ids[:, ::3] = 7  # ... and one id fills a third of the positions
    tokens = TokenClasses(ids, torch.rand(2, n, generator=generator) < 0.2)
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=None, on_layer=lambda *_: None, tokens=tokens)
    sums, _, _ = kernel.fused_attend(q, k, v, real, None, causal, info)
    p, _ = oracle(q, k, real, causal)
    expected = sentence_stats(p, real.long(), causal, None, sink=2, window=8, tokens=tokens)
    for name, value in sums.means().items():
        assert_close(value.double(), expected[name], name)
    lengths = real.sum(dim=-1)
    assert_close(sums.received.double(), received(p, 0, lengths), "received")
    plans = [entry[1] for key, entry in info.kept.items() if key[0] == "token tiles"]
    assert len(plans) == 1  # the batch's pairs plan, kept for its other layers
    assert plans[0].sentence.unique().tolist() == [0, 1]  # both sentences' pairs ...
    assert all(int(plans[0].positions[plans[0].sentence == b].max()) < length for b, length in enumerate(lengths))


def test_the_fused_layers_of_a_batch_share_its_padding_and_token_plans(monkeypatch):
    """The fused path's host syncs happen once per batch, not per layer: whether any key is padded (Batch.hidden_keys)
    and the sentences' lengths for the same-token plan (token_tiles) are found by the first layer and kept;
    every layer's statistics are the same."""
    n = 40
    q, k, v, real = sharp_heads(n, 8.0)
    generator = torch.Generator().manual_seed(2)
    tokens = TokenClasses(torch.randint(0, 6, (2, n), generator=generator), torch.zeros(2, n, dtype=torch.bool))
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=2, window=8, bins=bin_count(n),
                        budget_bytes=2**20, block_rows=None, example=None, on_layer=lambda *_: None, tokens=tokens)
    made, plans = [], kernel.duplicates.token_tiles
    monkeypatch.setattr(kernel.duplicates, "token_tiles", lambda *args: made.append(1) or plans(*args))
    runs = [kernel.fused_attend(q, k, v, real, None, True, info)[0].means() for _ in range(3)]
    assert len(made) == 1
    assert [key[0] for key in info.kept].count("hidden keys") == 1
    hidden = next(entry[1] for key, entry in info.kept.items() if key[0] == "hidden keys")
    assert torch.equal(hidden[:, 0, 0], ~real)  # the second sequence is padded
    for name, value in runs[0].items():
        assert all(torch.equal(value.nan_to_num(-1.0), run[name].nan_to_num(-1.0)) for run in runs[1:]), name


def test_the_mass_received_is_computed_only_when_top_tokens_reads_it(llama_dir, monkeypatch):
    """The fused path's received costs a call of its own: without top_tokens.csv no layer makes it, and every other
    score is the same."""
    loaded = load_model(str(llama_dir), "cpu")
    made = []
    real = kernel.fused._fused_received
    monkeypatch.setattr(kernel.fused, "_fused_received", lambda *args: made.append(1) or real(*args))
    runs = {}
    for top in (True, False):
        made.clear()
        runs[top] = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=4, resamples=5,
                                   options=Options(attention="fused", top_tokens=top))
        batches = -(-len(SENTENCES) // 4)
        assert len(made) == (loaded.num_layers * batches if top else 0)
    assert runs[True].top_tokens is not None and runs[False].top_tokens is None
    assert runs[True].heads.equals(runs[False].heads)


def test_auto_fuses_batches_from_the_threshold_on(llama_dir, monkeypatch):
    """auto runs the fused kernel on batches of FUSED_MIN_TOKENS or more and blocked below: both equal eager."""
    monkeypatch.setattr(kernel, "FUSED_MIN_TOKENS", 12)  # the test sentences run 3 to 16 tokens
    loaded = load_model(str(llama_dir), "cpu")
    ran = []
    real = kernel.fused_attend

    def counted(query, *args, **kwargs):
        ran.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(kernel.attention, "fused_attend", counted)
    runs = {a: analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=2, resamples=5, keep_per_sentence=True,
                              options=Options(attention=a, sink=1, window=4)) for a in ("auto", "eager")}
    assert runs["auto"].run["attention"]["path"] == "fused" and runs["auto"].run["attention"]["fused_min_tokens"] == 12
    assert ran and min(ran) >= 12  # some batches fused, none shorter than the threshold ...
    assert min(len(t) for t in loaded.tokenizer(SENTENCES)["input_ids"]) < 12  # ... though shorter ones ran
    for column in runs["eager"].per_sentence.columns:
        if column != "category":
            assert_close(runs["auto"].per_sentence[column], runs["eager"].per_sentence[column], column)


def test_layers_the_identity_does_not_cover_are_not_fused():
    plain = kernel.LayerFeatures(causal=True, span=None, softcap=None, sinks=False, groups=1, scale=0.125)
    assert kernel.fusable(plain)
    for change in ({"span": 4}, {"softcap": 30.0}, {"sinks": True}):
        assert not kernel.fusable(kernel.LayerFeatures(**{**plain.__dict__, **change}))


def test_a_bfloat16_model_gets_its_output_from_its_own_call_and_float32_statistics():
    """float32 values ride along in the statistics call; bfloat16 ones get their own call in bfloat16, while the
    statistics are computed in float32 either way (bfloat16's 8 bits could not hold an entropy to 1e-5)."""
    q, k, v, real = sharp_heads(40, 20.0)
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=2, window=8, bins=bin_count(40),
                        budget_bytes=2**20, block_rows=None, example=None, on_layer=lambda *_: None)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sums, _, output = kernel.fused_attend(q16, k16, v16, real, None, True, info)
    p, _ = oracle(q16.float(), k16.float(), real, True)
    expected = sentence_stats(p, real.long(), True, None, sink=2, window=8)
    for name, value in sums.means().items():
        assert_close(value.double(), expected[name], name)
    assert output.dtype == torch.bfloat16
    reference = (p.float() @ v16.float().repeat_interleave(2, 1)).transpose(1, 2)  # [batch, query, head, dim]
    bfloat16 = 2**-8  # its unit roundoff: the kernel rounds p and the sums to 8 significant bits
    assert float((output.float() - reference)[real].abs().max()) < 4 * bfloat16 * float(reference.abs().max())
