"""Rows the mask forces (one valid key, or a window that holds every key) never decide a label."""

import math

import pandas as pd
import pytest
import torch

from attnprobe.classify import classify, head_types
from attnprobe.metrics import sentence_stats


def head_table(p: torch.Tensor) -> pd.DataFrame:
    """heads.csv of a one-head model from its causal map p [query, key] on one sentence."""
    n = p.shape[-1]
    stats = sentence_stats(p[None, None], torch.ones(1, n, dtype=torch.long), causal=True)
    return pd.DataFrame([{"layer": 0, "head": 0, **{name: float(v[0, 0]) for name, v in stats.items()}}])


def test_an_even_split_between_the_first_two_tokens_is_not_a_sink():
    n = 12
    p = torch.zeros(n, n)
    p[0, 0] = 1.0  # row 0 has no choice
    p[1:, 0] = p[1:, 1] = 0.5  # every other row splits evenly between tokens 0 and 1
    heads = head_table(p)
    assert heads["first_token"][0] == pytest.approx((1 + 0.5 * (n - 1)) / n)  # as defined: row 0 included
    assert heads["first_token"][0] > 0.5
    assert heads["first_token_unforced"][0] == 0.5
    assert heads["entropy_unforced"][0] == pytest.approx(math.log(2))  # copy: an even split over two tokens
    assert head_types(heads, scheme="extended").tolist() == ["copy"]  # not sink: 0.5 is not "mostly"


def test_a_head_mostly_on_the_first_token_is_a_sink():
    n = 12
    p = torch.zeros(n, n)
    p[0, 0] = 1.0
    p[1:, 0], p[1:, 1] = 0.9, 0.1
    assert head_types(head_table(p), scheme="extended").tolist() == ["sink"]


def test_rows_whose_window_holds_every_key_do_not_make_a_head_local():
    n = 4  # a uniform causal head: rows 0-2 score diagonal 1 whatever the head does
    p = torch.ones(n, n).tril()
    p = p / p.sum(-1, keepdim=True)
    heads = head_table(p)
    assert heads["diagonal"][0] == (3 + 0.75) / 4  # >= 0.8 with the forced rows
    assert heads["diagonal_unforced"][0] == 0.75  # row 3 only
    assert head_types(heads).tolist() != ["local"]


def test_row_zero_does_not_make_a_head_copy():
    heads = pd.DataFrame([{"layer": 0, "head": 0, "entropy": 0.5, "entropy_unforced": 0.9, "entropy_norm": 0.5,
                           "diagonal_unforced": 0.3}])
    assert head_types(heads).tolist() == ["mixed"]  # the raw entropy (0.5 <= ln 2) would have said copy
    assert list(classify(heads).columns) == ["layer", "head", "head_type", "diagonal_unforced", "entropy_unforced",
                                             "entropy_norm"]
