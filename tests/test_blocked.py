"""The statistics attention function: exact eager results in blocks of query rows, never an n x n map."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES

from attnprobe import kernel
from attnprobe.analysis import Options, analyze_loaded
from attnprobe.corpus import Corpus, Sentence
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import (
    SentenceSums,
    bin_count,
    bin_range,
    block_row_stats,
    position_bin,
    row_sink_window,
    sentence_stats,
)
from attnprobe.model import load_model

SINK, WINDOW = 1, 3  # small, so that sink_window is defined on the test sentences


def corpus_of(texts):
    return Corpus(path=__import__("pathlib").Path("x.txt"), sha256="-",
                  sentences=tuple(Sentence(t, i + 1, None) for i, t in enumerate(texts)))


def assert_close(got, expected, what, tolerance=FLOAT32_TOLERANCE):
    """Equal to float32's bound, relative above 1 (distance is in tokens); NaN exactly where expected is NaN."""
    got, expected = np.asarray(got, dtype=float), np.asarray(expected, dtype=float)
    assert (np.isnan(got) == np.isnan(expected)).all(), what
    diff = np.abs(np.nan_to_num(got) - np.nan_to_num(expected))
    assert (diff <= tolerance * np.maximum(1.0, np.abs(np.nan_to_num(expected)))).all(), (what, diff.max())


@pytest.fixture(scope="module", params=["gpt2", "llama", "bert"])
def loaded(request):
    return load_model(str(request.getfixturevalue(f"{request.param}_dir")), "cpu")


@pytest.fixture(scope="module")
def eager_result(loaded):
    options = Options(attention="eager", sink=SINK, window=WINDOW)
    return analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=20, options=options,
                          keep_per_sentence=True)


@pytest.mark.parametrize("rows", [1, 7, 10_000])
def test_blocked_statistics_equal_the_eager_ones(loaded, eager_result, rows):
    options = Options(attention="blocked", sink=SINK, window=WINDOW, block_rows=rows)
    blocked = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=20, options=options,
                             keep_per_sentence=True)
    assert blocked.run["attention"]["path"] == "blocked" and eager_result.run["attention"]["path"] == "eager"
    # Blocks (one-row blocks use a matrix-vector kernel) sum in another order than eager's matrix product, and
    # each CPU rounds its own way: equal to float32's bound through the layers, not to one machine's digits.
    for column in eager_result.per_sentence.columns:
        if column != "category":
            assert_close(blocked.per_sentence[column], eager_result.per_sentence[column], column)
    for column in eager_result.positions.columns:
        assert_close(blocked.positions[column], eager_result.positions[column], f"positions {column}")
    np.testing.assert_allclose(blocked.example["maps"], eager_result.example["maps"], atol=FLOAT32_TOLERANCE)
    assert_close(blocked.heads["entropy_ci_low"], eager_result.heads["entropy_ci_low"], "interval")


def test_auto_uses_the_blocked_path_for_supported_models(loaded):
    result = analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5)
    assert result.run["attention"] == {"requested": "auto", "path": "blocked", "block_budget_mib": 64,
                                       "sink_tokens": 4, "window": 256}


def test_the_output_equals_eager_attention_with_grouped_query_heads_and_padding():
    """attend() against transformers' own Llama eager_attention_forward (repeat_kv, additive mask)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    batch, heads, kv_heads, n, dim = 2, 6, 2, 11, 8
    q = torch.randn(batch, heads, n, dim)  # [batch, head, query, dim]
    k, v = torch.randn(batch, kv_heads, n, dim), torch.randn(batch, kv_heads, n, dim)  # [batch, kv_head, key, dim]
    padding = torch.ones(batch, n, dtype=torch.bool)
    padding[1, 7:] = False  # the second sequence has 7 tokens
    lengths = padding.sum(-1)
    allowed = padding[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()  # [batch, 1, q, k]
    additive = torch.zeros(batch, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    expected, weights = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    for rows in (1, 4, 50):
        info = kernel.Batch(layers={}, last_layer=0, special=None, sink=1, window=2, bins=bin_count(n),
                            budget_bytes=2**20, block_rows=rows, example=(1, 5), on_layer=lambda *_: None)
        sums, example, output = kernel.attend(q, k, v, padding, 0.3, True, info)
        real = padding[:, :, None, None]  # [batch, query, 1, 1]
        assert float(torch.where(real, output - expected, 0.0).abs().max()) < FLOAT32_TOLERANCE
        reference = sentence_stats(weights, padding.long(), True, sink=1, window=2)
        for name, value in sums.means().items():
            assert_close(value, reference[name], name)
        assert torch.allclose(example, weights[1, :, :5, :5], atol=FLOAT32_TOLERANCE)
        assert lengths.tolist() == [11, 7]


def test_row_statistics_do_not_depend_on_where_blocks_start():
    torch.manual_seed(1)
    n = 13
    scores = torch.randn(2, 3, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    p = scores.softmax(-1)  # [batch, head, query, key]
    lengths = torch.tensor([n, 9])
    whole = block_row_stats(p, 0, lengths, True, sink=2, window=3)
    for q0, q1 in ((0, 1), (1, 6), (6, 13)):
        part = block_row_stats(p[:, :, q0:q1, :q1], q0, lengths, True, sink=2, window=3)  # causal: keys < q1
        for name, values in part.items():
            torch.testing.assert_close(values, whole[name][..., q0:q1], equal_nan=True, msg=name)


def uniform_causal(n):
    p = torch.ones(n, n).tril()
    return (p / p.sum(-1, keepdim=True))[None, None]  # [1, 1, query, key]


def test_sink_window_closed_forms():
    n, sink, window = 20, 2, 5
    uniform = row_sink_window(uniform_causal(n), 0, True, sink, window)[0, 0]
    for i in range(n):
        expected = (sink + window) / (i + 1) if i >= sink + window else math.nan
        assert (math.isnan(expected) and math.isnan(uniform[i])) or uniform[i] == pytest.approx(expected)
    first = torch.zeros(1, 1, n, n)
    first[..., 0] = 1.0  # every row on the first token
    previous = torch.zeros(1, 1, n, n)
    previous[0, 0, 0, 0] = 1.0
    previous[0, 0, torch.arange(1, n), torch.arange(n - 1)] = 1.0  # row i on token i - 1
    for p in (first, previous):
        values = row_sink_window(p, 0, True, sink, window)[0, 0, sink + window :]
        assert torch.all(values == 1.0)
    middle = torch.zeros(1, 1, n, n)
    middle[0, 0, :, 2] = 1.0  # key 2: neither a sink nor recent for rows i >= 7
    assert torch.all(row_sink_window(middle, 0, True, sink, window)[0, 0, sink + window :] == 0.0)
    assert row_sink_window(uniform_causal(n), 0, False, sink, window).isnan().all()  # encoders: no KV cache


def test_position_bins_double():
    i = torch.arange(0, 17)
    assert position_bin(i).tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5]
    assert [bin_range(b) for b in range(4)] == [(0, 0), (1, 1), (2, 3), (4, 7)]
    assert [bin_count(n) for n in (1, 2, 3, 4, 5, 8, 9, 32_768)] == [1, 2, 3, 3, 4, 4, 5, 16]
    big = torch.tensor([2**20 - 1, 2**20])  # exact where a float log2 would round
    assert position_bin(big).tolist() == [20, 21]


def test_position_means_of_a_uniform_head():
    n = 10
    sums = SentenceSums()
    lengths = torch.tensor([n])
    sums.add(block_row_stats(uniform_causal(n), 0, lengths, True), 0, lengths, bin_count(n))
    entropy = sums.bin_means()["entropy"][0, 0]  # [bin]
    for b in range(bin_count(n)):
        lo, hi = bin_range(b)
        rows = range(lo, min(hi, n - 1) + 1)
        assert float(entropy[b]) == pytest.approx(sum(math.log(i + 1) for i in rows) / len(rows), abs=1e-6)


def test_positions_table_on_a_uniform_model(uniform_gpt2_dir):
    loaded = load_model(str(uniform_gpt2_dir), "cpu")
    texts = SENTENCES[:4]
    result = analyze_loaded(loaded, corpus_of(texts), batch_size=2, resamples=5)
    positions = result.positions
    lengths = [len(t) for t in loaded.tokenizer(texts)["input_ids"]]
    layer0 = positions[(positions["layer"] == 0) & (positions["head"] == 0)]
    assert layer0["rows"].sum() == sum(lengths)
    for _, row in layer0.iterrows():
        per_sentence = []
        for length in lengths:
            rows = range(int(row["position_min"]), min(int(row["position_max"]), length - 1) + 1)
            if len(rows):
                per_sentence.append(sum(math.log(i + 1) for i in rows) / len(rows))
        assert row["entropy"] == pytest.approx(sum(per_sentence) / len(per_sentence), abs=1e-5)
    assert set(positions.columns) >= {"layer", "head", "bin", "position_min", "position_max", "rows", "entropy",
                                      "entropy_norm", "first_token", "diagonal", "distance", "sink_window"}


def test_a_model_feature_the_kernel_lacks_is_refused(llama_dir):
    loaded = load_model(str(llama_dir), "cpu")
    loaded.model.config.sliding_window = 8
    assert "sliding-window attention" in kernel.unsupported(loaded)
    with pytest.raises(AttnprobeError, match="sliding-window attention.*--attention eager"):
        analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5, options=Options(attention="blocked"))
    auto = analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5)
    assert auto.run["attention"]["path"] == "eager"


@pytest.mark.parametrize(("kwarg", "feature"), [("softcap", "soft-capping"), ("sliding_window", "sliding-window"),
                                                ("s_aux", "learned attention sinks")])
def test_refused_arguments_of_the_attention_call(kwarg, feature):
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(AttnprobeError, match=feature):
        kernel.stats_attention(torch.nn.Module(), q, q, q, None, **{kwarg: 4})


def test_a_custom_mask_pattern_is_refused():
    with pytest.raises(AttnprobeError, match="custom attention mask"):
        kernel.stats_mask(1, 4, 4, mask_function=lambda *a: True, attention_mask=torch.ones(1, 4))
    assert kernel.stats_mask(1, 4, 4, attention_mask=torch.ones(1, 4)).shape == (1, 4)  # never [n, n]


def test_other_architectures_are_refused_or_take_the_eager_path():
    other = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(model_type="gemma2")))
    assert "gemma2 architecture" in kernel.unsupported(other)


def test_a_block_fits_the_budget():
    assert kernel.block_size(1, 9, 4096, 256 * 2**20) == 256 * 2**20 // (9 * 4096 * 4 * kernel.TEMPORARIES)
    assert kernel.block_size(8, 64, 10**6, 1) == 1


def test_options_are_checked():
    with pytest.raises(AttnprobeError, match="--window 0"):
        analyze_loaded(None, corpus_of(["x"]), options=Options(window=0))
    with pytest.raises(AttnprobeError, match="--block-mib 0"):
        analyze_loaded(None, corpus_of(["x"]), options=Options(budget_mib=0))
    with pytest.raises(AttnprobeError, match="--attention 'fast'"):
        analyze_loaded(None, corpus_of(["x"]), options=Options(attention="fast"))


def test_positions_frame_is_tidy(loaded, eager_result):
    positions = eager_result.positions
    assert isinstance(positions, pd.DataFrame)
    assert len(positions) == loaded.num_layers * loaded.num_heads * positions["bin"].nunique()
