"""The kv scheme (streaming / full-cache from sink_window) and the KV-cache estimate, on hand-built tables."""

import json
import math

import pandas as pd
import pytest

from attnprobe.classify import (
    ALL_TYPES,
    Thresholds,
    classify,
    counts_per_layer,
    head_types,
    kv_cache_estimate,
    required_columns,
)
from attnprobe.errors import AttnprobeError

NAN = float("nan")


def kv_heads_table(values, heads_per_layer=None):
    """One row per head, layer by layer, from a flat list of sink_window values."""
    n = heads_per_layer or len(values)
    return pd.DataFrame({"layer": [i // n for i in range(len(values))], "head": [i % n for i in range(len(values))],
                         "sink_window": values})


# Layer 0: heads 0, 1, 2 streaming, 3 full-cache; layer 1: head 0 full-cache, 1, 2, 3 streaming.
# With 2 KV heads per layer, KV head 0 of layer 0 and KV head 1 of layer 1 are streaming.
GQA_VALUES = [0.99, 0.97, 0.96, 0.50, 0.20, 0.99, 0.98, 0.97]


def test_threshold_boundary_and_option():
    table = kv_heads_table([0.95, 0.9499, 1.0, 0.0, NAN])
    assert head_types(table, scheme="kv").tolist() == ["streaming", "full-cache", "streaming", "full-cache",
                                                       "full-cache"]
    moved = Thresholds(streaming_min_sink_window=0.9)
    assert head_types(table, moved, scheme="kv").tolist() == [
        "streaming", "streaming", "streaming", "full-cache", "full-cache"]
    assert head_types(table, Thresholds(streaming_min_sink_window=0.99), scheme="kv").tolist()[:2] == [
        "full-cache", "full-cache"]


@pytest.mark.parametrize("value", [-0.01, 1.5])
def test_out_of_range_streaming_threshold_is_refused(value):
    with pytest.raises(AttnprobeError, match=f"--streaming-min-sink-window {value} must be between 0 and 1"):
        Thresholds(streaming_min_sink_window=value)


def test_all_missing_sink_window_names_the_fix():
    table = kv_heads_table([NAN, NAN, NAN])
    with pytest.raises(AttnprobeError, match="no sequence was longer than the sink \\+ window") as caught:
        head_types(table, scheme="kv")
    assert "--split paragraphs" in str(caught.value) and "--window" in str(caught.value)
    with pytest.raises(AttnprobeError, match="no sequence"):
        classify(table, scheme="kv", kv_heads=1)


def test_classify_kv_columns_without_kv_heads():
    result = classify(kv_heads_table([0.96, 0.3]), scheme="kv")
    assert list(result.columns) == ["layer", "head", "head_type", "sink_window"]
    assert result["head_type"].tolist() == ["streaming", "full-cache"]
    assert required_columns("kv") == ["layer", "head", "sink_window"]


def test_gqa_kv_head_is_streaming_only_if_every_sharer_is():
    result = classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=2)
    assert list(result.columns) == ["layer", "head", "head_type", "sink_window", "kv_head", "kv_head_streaming"]
    assert result["kv_head"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert result["kv_head_streaming"].tolist() == [True, True, False, False, False, False, True, True]


def test_one_kv_head_per_query_head_and_one_for_all():
    mha = classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=4)
    assert mha["kv_head"].tolist() == [0, 1, 2, 3] * 2
    assert mha["kv_head_streaming"].tolist() == (mha["head_type"] == "streaming").tolist()
    mqa = classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=1)
    assert mqa["kv_head"].tolist() == [0] * 8
    assert not mqa["kv_head_streaming"].any()


@pytest.mark.parametrize("kv_heads", [3, 0, 8, 2.0])
def test_kv_heads_must_divide_the_query_heads(kv_heads):
    with pytest.raises(AttnprobeError, match=f"kv_heads {kv_heads} must divide the 4 query heads"):
        classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=kv_heads)


def test_kv_heads_is_refused_outside_the_kv_scheme():
    with pytest.raises(AttnprobeError, match="only to the kv scheme"):
        classify(kv_heads_table(GQA_VALUES, 4), kv_heads=2)


def test_counts_per_layer_for_kv_keeps_zero_columns():
    counts = counts_per_layer(classify(kv_heads_table(GQA_VALUES, 4), scheme="kv"))
    assert list(counts.columns) == ["streaming", "full-cache"]
    assert counts.loc[0].tolist() == [3, 1] and counts.loc[1].tolist() == [3, 1]
    only_streaming = counts_per_layer(classify(kv_heads_table([0.99, 0.98]), scheme="kv"))
    assert list(only_streaming.columns) == ["streaming", "full-cache"]
    assert only_streaming.loc[0].tolist() == [2, 0]


def estimate(**changes):
    types = classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=2)
    options = dict(layers=2, kv_heads=2, head_dim=8, dtype_bytes=2, sink=4, window=12,
                   lengths={"long": 100, "short": 10, "exact": 16})
    return kv_cache_estimate(types, **{**options, **changes})


def test_cache_estimate_in_closed_form():
    # A key and a value: 8 * 2 * 2 = 32 bytes per KV head per token; 2 layers x 2 KV heads -> 128 per token.
    # 2 of the 4 KV heads are streaming and keep min(T, 4 + 12 = 16) tokens.
    result = estimate()
    assert result["assumptions"] == {"layers": 2, "kv_heads": 2, "head_dim": 8, "dtype_bytes": 2, "sink": 4,
                                     "window": 12}
    assert result["bytes_per_token_full"] == 128
    assert result["counts"] == {"query_heads_streaming": 6, "query_heads_full_cache": 2, "kv_heads_streaming": 2,
                                "kv_heads_total": 4}
    long = result["lengths"]["long"]
    assert (long["tokens"], long["full_bytes"], long["streaming_bytes"]) == (100, 12800, (2 * 16 + 2 * 100) * 32)
    assert long["ratio"] == pytest.approx(7424 / 12800)
    for name, tokens in (("short", 10), ("exact", 16)):  # nothing to drop when T <= sink + window
        entry = result["lengths"][name]
        assert entry == {"tokens": tokens, "full_bytes": tokens * 128, "streaming_bytes": tokens * 128, "ratio": 1.0}
    assert json.loads(json.dumps(result)) == result


def test_cache_estimate_with_no_streaming_kv_head_saves_nothing():
    types = classify(kv_heads_table(GQA_VALUES, 4), scheme="kv", kv_heads=1)
    result = kv_cache_estimate(types, layers=2, kv_heads=1, head_dim=64, dtype_bytes=2, sink=4, window=256,
                               lengths={"32k": 32768})
    assert result["counts"]["kv_heads_streaming"] == 0
    assert result["lengths"]["32k"]["streaming_bytes"] == result["lengths"]["32k"]["full_bytes"] == 32768 * 2 * 256
    assert math.isclose(result["lengths"]["32k"]["ratio"], 1.0)


def test_cache_estimate_refuses_inconsistent_inputs():
    with pytest.raises(AttnprobeError, match="4 KV heads, not layers 3 x kv_heads 2"):
        estimate(layers=3)
    with pytest.raises(AttnprobeError, match="head_dim 0 must be 1 or more"):
        estimate(head_dim=0)
    with pytest.raises(AttnprobeError, match="length zero = 0"):
        estimate(lengths={"zero": 0})
    with pytest.raises(AttnprobeError, match="no kv_head_streaming column"):
        kv_cache_estimate(classify(kv_heads_table(GQA_VALUES, 4), scheme="kv"), layers=2, kv_heads=2, head_dim=8,
                          dtype_bytes=2, sink=4, window=12, lengths={"long": 100})


def test_default_and_extended_schemes_are_unchanged():
    table = pd.DataFrame(
        [(0, 0, 0.05, 0.02, 0.98, 0.10, 0.95, 0.99), (0, 1, 0.40, 0.20, 0.20, 0.10, 0.05, 0.10),
         (1, 0, 2.00, 0.90, 0.30, 0.60, 0.10, NAN), (1, 1, 1.20, 0.50, 0.40, 0.70, 0.60, 0.97)],
        columns=["layer", "head", "entropy_unforced", "entropy_norm", "diagonal_unforced", "first_token_unforced",
                 "previous_token", "sink_window"],
    )
    assert ALL_TYPES[:7] == ("previous", "local", "sink", "dormant", "copy", "broad", "mixed")
    assert ALL_TYPES[7:] == ("streaming", "full-cache")
    assert required_columns() == ["layer", "head", "diagonal_unforced", "entropy_unforced", "entropy_norm"]
    assert required_columns("extended") == [*required_columns(), "first_token_unforced", "previous_token"]
    default = classify(table)
    assert list(default.columns) == ["layer", "head", "head_type", "diagonal_unforced", "entropy_unforced",
                                     "entropy_norm"]
    assert default["head_type"].tolist() == ["local", "copy", "broad", "mixed"]
    assert list(counts_per_layer(default).columns) == ["local", "copy", "broad", "mixed"]
    extended = classify(table, scheme="extended")
    assert extended["head_type"].tolist() == ["previous", "copy", "broad", "mixed"]
    assert list(counts_per_layer(extended).columns) == ["previous", "local", "sink", "copy", "broad", "mixed"]
    assert classify(table, scheme="kv")["head_type"].tolist() == ["streaming", "full-cache", "full-cache", "streaming"]


def test_an_older_folders_retrieval_label_is_read_as_full_cache(tmp_path):
    """head_types.csv (and compare_types.csv) written before the rename say `retrieval` for the kv scheme's
    non-streaming heads: every reader (report, compare, plot) gets `full-cache`, and no label is called retrieval."""
    from attnprobe import io
    from attnprobe.classify import KV_TYPES
    from attnprobe.compare import scheme_of

    old = kv_heads_table([0.99, 0.20, 0.97, 0.10], heads_per_layer=2).assign(
        head_type=["streaming", "retrieval", "streaming", "retrieval"], kv_head=0, kv_head_streaming=False)
    old.to_csv(tmp_path / io.TYPES_FILE, index=False)
    read = io.read_table(tmp_path, io.TYPES_FILE, ["layer", "head", "head_type"], "attnprobe classify")
    assert read["head_type"].tolist() == ["streaming", "full-cache", "streaming", "full-cache"]
    assert "retrieval" not in ALL_TYPES
    assert scheme_of(read) == "kv"
    assert read["head_type"].value_counts().reindex(KV_TYPES).tolist() == [2, 2]  # compare's counts
