"""The metric definitions, checked on hand-built attention tensors with closed-form answers."""

import math

import pytest
import torch

from attnprobe.metrics import (
    SentenceSums,
    key_counts,
    row_diagonal,
    row_entropy,
    sentence_stats,
    valid_keys,
)


def uniform_causal(n: int, batch: int = 1, heads: int = 1) -> torch.Tensor:
    p = torch.tril(torch.ones(n, n))  # [query, key]
    p = p / p.sum(dim=-1, keepdim=True)
    return p.expand(batch, heads, n, n).clone()  # [batch, head, query, key]


def previous_token(n: int) -> torch.Tensor:
    p = torch.zeros(1, 1, n, n)  # [batch, head, query, key]
    p[0, 0, 0, 0] = 1.0
    for i in range(1, n):
        p[0, 0, i, i - 1] = 1.0
    return p


def test_uniform_causal_rows_match_closed_form():
    n = 7
    p = uniform_causal(n)
    expected_h = torch.tensor([math.log(i + 1) for i in range(n)])
    expected_d = torch.tensor([min(3, i + 1) / (i + 1) for i in range(n)])
    assert torch.allclose(row_entropy(p)[0, 0], expected_h, atol=1e-6)
    assert torch.allclose(row_diagonal(p)[0, 0], expected_d, atol=1e-6)


def test_sentence_stats_of_uniform_causal_head():
    n = 9
    stats = sentence_stats(uniform_causal(n), torch.ones(1, n, dtype=torch.long), causal=True)
    assert stats["entropy"].item() == pytest.approx(sum(math.log(i + 1) for i in range(n)) / n, abs=1e-6)
    assert stats["diagonal"].item() == pytest.approx(sum(min(3, i + 1) / (i + 1) for i in range(n)) / n, abs=1e-6)
    assert stats["first_token"].item() == pytest.approx(sum(1 / (i + 1) for i in range(n)) / n, abs=1e-6)
    # row 0 has a single key, so it is left out of the normalized mean; every other row is exactly uniform
    assert stats["entropy_norm"].item() == pytest.approx(1.0, abs=1e-6)


def test_previous_token_head_is_sharp_and_diagonal():
    n = 6
    stats = sentence_stats(previous_token(n), torch.ones(1, n, dtype=torch.long), causal=True)
    assert stats["entropy"].item() == pytest.approx(0.0, abs=1e-7)
    assert stats["diagonal"].item() == pytest.approx(1.0)
    assert stats["first_token"].item() == pytest.approx(2 / n)  # rows 0 and 1 look at token 0


def test_padded_rows_and_keys_never_count():
    n, pad = 5, 3
    p = uniform_causal(n + pad)  # the padded part holds garbage-but-finite values
    p[..., :n, :n] = uniform_causal(n)[0, 0]
    p[..., :n, n:] = 0.0
    p[..., n:, :] = torch.nan  # a padded query row can hold anything, even NaN
    mask = torch.tensor([[1] * n + [0] * pad])
    stats = sentence_stats(p, mask, causal=True, sink=1, window=1)  # sink_window defined from row 2 on
    alone = sentence_stats(uniform_causal(n), torch.ones(1, n, dtype=torch.long), causal=True, sink=1, window=1)
    assert not any(v.isnan().any() for v in alone.values())
    for name in stats:
        assert stats[name].item() == pytest.approx(alone[name].item(), abs=1e-6)


def test_encoder_rows_see_every_valid_token():
    n = 4
    p = torch.full((1, 1, n, n), 1.0 / n)  # [batch, head, query, key]
    stats = sentence_stats(p, torch.ones(1, n, dtype=torch.long), causal=False)
    assert stats["entropy"].item() == pytest.approx(math.log(n), abs=1e-6)
    assert stats["entropy_norm"].item() == pytest.approx(1.0, abs=1e-6)  # ln(k) with k = n for every row
    # window +-2 covers both sides: rows 0..3 see 3, 4, 4, 3 of the 4 keys
    assert stats["diagonal"].item() == pytest.approx((3 + 4 + 4 + 3) / (4 * n), abs=1e-6)
    keys = valid_keys(torch.tensor([[1, 1, 1, 0]]), causal=False)
    assert keys.sum(dim=-1).tolist() == [[3, 3, 3, 0]]


def test_sentence_means_skip_nan_and_padded_rows():
    values = torch.tensor([[[1.0, torch.nan, 3.0, 100.0]]])  # [batch, head, query]: row 3 is padding
    sums = SentenceSums()
    sums.add({"x": values}, 0, torch.tensor([3]), bins=1)
    assert sums.means()["x"].item() == pytest.approx(2.0)
    empty = SentenceSums()
    empty.add({"x": values}, 0, torch.tensor([0]), bins=1)  # no real row at all
    assert empty.means()["x"].isnan().all()


def test_inputs_are_not_modified():
    p = uniform_causal(5)
    p[..., 3, :] = torch.nan  # would be overwritten by an in-place mask
    before = p.clone()
    sentence_stats(p, torch.tensor([[1, 1, 1, 0, 0]]), causal=True)
    assert torch.equal(p.isnan(), before.isnan())
    assert torch.equal(p.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_diagonal_read_off_the_diagonals_equals_the_band_sum(n):
    p = torch.rand(2, 3, n, n)  # [batch, head, query, key]
    i = torch.arange(n)[:, None]
    band = (i - i.T).abs() <= 2  # [query, key]
    assert torch.allclose(row_diagonal(p), (p * band).sum(-1), atol=1e-6)


def test_key_counts():
    i, lengths = torch.arange(4), torch.tensor([3, 4])  # query positions; a padded and a full sentence
    assert key_counts(i, lengths, causal=True).tolist() == [[1, 2, 3, 3], [1, 2, 3, 4]]
    assert key_counts(i, lengths, causal=False).tolist() == [[3, 3, 3, 3], [4, 4, 4, 4]]


def test_previous_token_pattern_scores():
    n = 6
    stats = sentence_stats(previous_token(n), torch.ones(1, n, dtype=torch.long), causal=True)
    assert stats["previous_token"].item() == pytest.approx(1.0)  # rows 1..5: all on i - 1
    assert stats["self"].item() == pytest.approx(0.0)  # row 0 (one key) is left out
    assert stats["distance"].item() == pytest.approx((n - 1) / n)  # row 0 at distance 0, the rest at 1


def test_identity_pattern_scores():
    n = 5
    p = torch.eye(n).expand(1, 2, n, n)  # [batch, head, query, key]
    for causal in (True, False):
        stats = sentence_stats(p, torch.ones(1, n, dtype=torch.long), causal=causal)
        assert torch.allclose(stats["self"], torch.ones(1, 2))
        assert torch.allclose(stats["previous_token"], torch.zeros(1, 2))
        assert torch.allclose(stats["distance"], torch.zeros(1, 2))


def test_uniform_causal_distance_and_diagonal_excess_from_the_formulas():
    n = 8
    stats = sentence_stats(uniform_causal(n), torch.ones(1, n, dtype=torch.long), causal=True)
    distance = sum(sum(i - j for j in range(i + 1)) / (i + 1) for i in range(n)) / n  # = mean of i / 2
    assert stats["distance"].item() == pytest.approx(distance, abs=1e-6)
    assert stats["diagonal_excess"].item() == pytest.approx(0.0, abs=1e-6)  # uniform is exactly chance
    assert stats["previous_token"].item() == pytest.approx(sum(1 / (i + 1) for i in range(1, n)) / (n - 1))


def test_diagonal_excess_of_an_encoder_previous_token_head():
    n = 6
    p = torch.zeros(1, 1, n, n)  # [batch, head, query, key]
    p[0, 0, 0, 1] = 1.0
    for i in range(1, n):
        p[0, 0, i, i - 1] = 1.0
    stats = sentence_stats(p, torch.ones(1, n, dtype=torch.long), causal=False)
    window = [min(i, 2) + min(n - 1 - i, 2) + 1 for i in range(n)]  # 3, 4, 5, 5, 4, 3
    assert stats["diagonal_excess"].item() == pytest.approx(sum(1 - w / n for w in window) / n, abs=1e-6)
    assert stats["previous_token"].item() == pytest.approx(1.0)  # row 0 has no previous token
