"""The statistics attention function: exact eager results in blocks of query rows, never an n x n map."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES

from attnprobe import kernel
from attnprobe.analysis import analyze_loaded
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
from attnprobe.planning import Options

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


def test_auto_uses_the_fused_path_for_supported_models(loaded):
    result = analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5)
    features = result.run["attention"].pop("features")
    assert result.run["attention"] == {"requested": "auto", "path": "fused", "block_budget_mib": 64,
                                       "sink_tokens": 4, "window": 256, "fused_min_tokens": 512,
                                       "fused_layers": list(range(loaded.num_layers)), "sequences": {"blocked": 2}}
    assert features == {"causal": loaded.causal, "query_heads_per_kv_head": loaded.num_heads // loaded.num_kv_heads,
                        "sliding_window": None, "softcap": None, "attention_sinks": False,
                        "scale": [pytest.approx(loaded.head_dim**-0.5)]}


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


def test_an_attention_argument_the_kernel_lacks_is_refused_by_name(llama_dir, monkeypatch):
    """Support is decided by what a model passes, not by its name: an ALiBi-like bias refuses the blocked path."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaAttention.forward

    def with_bias(self, *args, **kwargs):
        return original(self, *args, position_bias=torch.zeros(1), **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_bias)
    loaded = load_model(str(llama_dir), "cpu")
    assert "position_bias" in kernel.unsupported(loaded)
    with pytest.raises(AttnprobeError, match="position_bias.*--attention eager"):
        analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5, options=Options(attention="blocked"))
    auto = analyze_loaded(loaded, corpus_of(SENTENCES[:2]), resamples=5)
    assert auto.run["attention"]["path"] == "eager"


def features_of(**kwargs):
    q = torch.zeros(1, 4, 2, 8)  # [batch, head, query, dim]
    mask = kernel.stats_mask(1, 2, 2, attention_mask=torch.ones(1, 2))
    return kernel.layer_features(torch.nn.Module(), q, q[:, :2], mask, None, kwargs.pop("dropout", 0.0), kwargs, None)


def test_arguments_of_the_attention_call_are_implemented_or_refused():
    features, sinks = features_of(softcap=30.0, s_aux=torch.ones(4), position_ids=torch.arange(2), use_cache=False)
    assert features == kernel.LayerFeatures(causal=True, span=None, softcap=30.0, sinks=True, groups=2,
                                            scale=8**-0.5)
    assert sinks.shape == (4,)
    for kwargs, feature in [({"sliding_window": 4}, "sliding window of 4 that its attention mask does not apply"),
                            ({"position_bias": torch.zeros(2)}, "position_bias"), ({"dropout": 0.1}, "dropout"),
                            ({"encoder_hidden_states": torch.zeros(1)}, "cross-attention"),
                            ({"s_aux": torch.ones(3)}, "one logit per head")]:
        with pytest.raises(kernel.Unsupported, match=feature):
            features_of(**kwargs)


def test_masks_are_read_by_what_they_do():
    from transformers.masking_utils import (
        and_masks,
        chunked_causal_mask_function,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    assert kernel.probe_mask(None, None) == (True, None)
    assert kernel.probe_mask(lambda b, h, q, k: k <= q, None) == (True, None)  # the same rule, another function
    assert kernel.probe_mask(lambda b, h, q, k: q >= 0, None) == (False, None)
    assert kernel.probe_mask(sliding_window_causal_mask_function(4), 4) == (True, 4)
    assert kernel.probe_mask(sliding_window_bidirectional_mask_function(3), 3) == (False, 3)
    with pytest.raises(kernel.Unsupported, match="chunked, packed or custom"):
        kernel.probe_mask(chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)), 4)
    with pytest.raises(kernel.Unsupported, match="chunked, packed or custom"):
        kernel.probe_mask(and_masks(lambda b, h, q, k: k <= q, lambda b, h, q, k: k != 1), None)
    with pytest.raises(kernel.Unsupported, match="custom attention mask"):
        kernel.probe_mask(lambda b, h, q, k: {}[0], None)
    real = kernel.stats_mask(1, 4, 4, attention_mask=torch.ones(1, 4))
    assert real.shape == (1, 4) and real.attnprobe_mask == (True, None)  # never [n, n]


def test_a_model_that_computes_its_own_attention_is_refused():
    class Own:
        config = SimpleNamespace(model_type="gptj")

        def _can_set_attn_implementation(self):
            return False

    assert "computes its attention itself" in kernel.config_reason(SimpleNamespace(model=Own()))


def test_a_block_fits_the_budget():
    assert kernel.block_size(1, 9, 4096, 256 * 2**20) == 256 * 2**20 // (9 * 4096 * 4 * kernel.TEMPORARIES)
    assert kernel.block_size(8, 64, 10**6, 1) == 1
    rows = kernel.block_size(1, 9, 10**6, 64 * 2**20, extra=4095)  # a windowed layer: r (r + 4095) cells
    unit = 9 * 4 * kernel.TEMPORARIES
    assert rows * (rows + 4095) * unit <= 64 * 2**20 < (rows + 1) * (rows + 4096) * unit


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
