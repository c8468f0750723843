"""The classification rule and its order, on hand-built heads.csv tables."""

import math

import pandas as pd
import pytest

from attnprobe.classify import Thresholds, classify, counts_per_layer, head_types
from attnprobe.errors import AttnprobeError


def heads(rows):
    return pd.DataFrame(rows, columns=["layer", "head", "entropy_unforced", "entropy_norm", "diagonal_unforced"])


def test_previous_token_head_is_local_although_its_entropy_is_low():
    table = heads([(0, 0, 0.0, 0.0, 1.0)])
    assert head_types(table).tolist() == ["local"]


def test_even_split_over_two_tokens_is_copy():
    table = heads([(0, 0, math.log(2), 0.3, 0.2)])
    assert head_types(table).tolist() == ["copy"]


def test_rule_order_local_copy_broad_mixed():
    table = heads([
        (0, 0, 0.1, 0.05, 0.95),  # sharp and local -> local
        (0, 1, 0.2, 0.10, 0.30),  # sharp, far -> copy
        (1, 0, 2.0, 0.90, 0.40),  # spread -> broad
        (1, 1, 1.2, 0.50, 0.40),  # neither -> mixed
        (1, 2, 2.5, 0.95, 0.85),  # spread but local -> local first
    ])
    assert head_types(table).tolist() == ["local", "copy", "broad", "mixed", "local"]


def test_thresholds_move_the_boundaries():
    table = heads([(0, 0, 1.0, 0.6, 0.75)])
    assert head_types(table).tolist() == ["mixed"]
    assert head_types(table, Thresholds(local_min_diagonal=0.7)).tolist() == ["local"]
    assert head_types(table, Thresholds(copy_max_entropy=1.0)).tolist() == ["copy"]
    assert head_types(table, Thresholds(broad_min_entropy_norm=0.6)).tolist() == ["broad"]


def test_missing_normalized_entropy_is_not_broad():
    table = heads([(0, 0, 1.5, float("nan"), 0.5)])
    assert head_types(table).tolist() == ["mixed"]


def test_classify_keeps_the_values_the_rule_used_and_counts_every_type():
    table = heads([(0, 0, 0.0, 0.0, 1.0), (0, 1, 2.0, 0.9, 0.1), (1, 0, 2.0, 0.9, 0.1)])
    result = classify(table)
    assert list(result.columns) == ["layer", "head", "head_type", "diagonal_unforced", "entropy_unforced",
                                    "entropy_norm"]
    assert result["diagonal_unforced"].tolist() == [1.0, 0.1, 0.1]
    counts = counts_per_layer(result)
    assert list(counts.columns) == ["local", "copy", "broad", "mixed"]
    assert counts.loc[0].tolist() == [1, 0, 1, 0]
    assert counts.loc[1].tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("kwargs", [
    {"local_min_diagonal": 1.5}, {"copy_max_entropy": -0.1}, {"broad_min_entropy_norm": -0.2},
])
def test_out_of_range_thresholds_are_refused(kwargs):
    with pytest.raises(AttnprobeError, match="must be"):
        Thresholds(**kwargs)


def extended_heads(rows):
    return pd.DataFrame(rows, columns=["layer", "head", "entropy_unforced", "entropy_norm", "diagonal_unforced",
                                       "first_token_unforced", "previous_token"])


def test_extended_scheme_splits_previous_and_sink():
    table = extended_heads([
        (0, 0, 0.05, 0.02, 0.98, 0.10, 0.95),  # local, dominated by i - 1 -> previous
        (0, 1, 0.90, 0.40, 0.90, 0.10, 0.30),  # local, spread over the window -> local
        (1, 0, 0.10, 0.05, 0.20, 0.92, 0.05),  # copy onto the first token -> sink
        (1, 1, 0.40, 0.20, 0.20, 0.10, 0.05),  # copy onto content -> copy
        (2, 0, 2.00, 0.90, 0.30, 0.60, 0.10),  # broad stays broad even with a heavy first token
        (2, 1, 1.20, 0.50, 0.40, 0.70, 0.60),  # mixed stays mixed
    ])
    assert head_types(table, scheme="extended").tolist() == ["previous", "local", "sink", "copy", "broad", "mixed"]
    assert head_types(table).tolist() == ["local", "local", "copy", "copy", "broad", "mixed"]  # default unchanged
    result = classify(table, scheme="extended")
    assert list(result.columns) == ["layer", "head", "head_type", "diagonal_unforced", "entropy_unforced",
                                    "entropy_norm", "first_token_unforced", "previous_token"]
    assert list(counts_per_layer(result).columns) == ["previous", "local", "sink", "copy", "broad", "mixed"]


def test_extended_thresholds():
    table = extended_heads([(0, 0, 0.1, 0.05, 0.2, 0.45, 0.0)])
    assert head_types(table, scheme="extended").tolist() == ["copy"]
    assert head_types(table, Thresholds(sink_min_first_token=0.4), scheme="extended").tolist() == ["sink"]
    with pytest.raises(AttnprobeError, match="--previous-min-previous-token 2"):
        Thresholds(previous_min_previous_token=2)
