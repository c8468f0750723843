"""The Poisson bootstrap: per-sentence weights, intervals that collapse, widen and cover."""

import math

import numpy as np
import pytest

from attnprobe.bootstrap import interval, poisson_weights, resampled_means


def test_weights_are_poisson_one_and_depend_only_on_seed_and_index():
    weights = poisson_weights(range(7), 4000, seed=1)
    assert weights.shape == (4000, 7)
    assert weights.min() == 0 and (weights == np.round(weights)).all()
    assert weights.mean() == pytest.approx(1.0, abs=0.02) and weights.var() == pytest.approx(1.0, abs=0.05)
    shard = poisson_weights([5, 2], 4000, seed=1)  # another batch, another order, another process
    np.testing.assert_array_equal(shard, weights[:, [5, 2]])
    assert not np.array_equal(poisson_weights([5], 4000, seed=2)[:, 0], weights[:, 5])
    assert not np.array_equal(weights[:, 0], weights[:, 1])  # sentences get independent weights


def test_identical_sentences_give_a_point_interval():
    values = np.full((20, 3), 1.25)  # [sentence, head]
    low, high = interval(resampled_means(values, poisson_weights(range(20), 200, seed=0)))
    np.testing.assert_allclose(low, 1.25)
    np.testing.assert_allclose(high, 1.25)


def test_one_sentence_gives_a_point_interval_despite_empty_resamples():
    weights = poisson_weights([0], 500, seed=0)
    assert (weights == 0).any()  # about 37% of resamples draw nothing
    low, high = interval(resampled_means(np.array([[0.7]]), weights))
    assert low[0] == pytest.approx(0.7) and high[0] == pytest.approx(0.7)


def test_differing_sentences_give_an_interval_around_the_mean():
    values = np.arange(40, dtype=float)[:, None]  # mean 19.5, sd 11.5
    low, high = interval(resampled_means(values, poisson_weights(range(40), 2000, seed=0)))
    assert low[0] < 19.5 < high[0]
    se = values.std(ddof=1) / np.sqrt(40)
    assert high[0] - low[0] == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_same_seed_same_interval_other_seed_other_interval():
    values = np.random.default_rng(3).normal(size=(30, 4))
    a = interval(resampled_means(values, poisson_weights(range(30), 300, seed=5)))
    b = interval(resampled_means(values, poisson_weights(range(30), 300, seed=5)))
    c = interval(resampled_means(values, poisson_weights(range(30), 300, seed=6)))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])


def test_nan_values_are_skipped():
    values = np.array([[1.0], [np.nan], [3.0]])
    means = resampled_means(values, np.array([[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]]))
    assert means[0, 0] == pytest.approx(2.0)
    assert np.isnan(means[1, 0])  # drew only the sentence without a value


def coverage_rate(trials: int, n: int, resamples: int) -> float:
    """The share of `trials` samples of `n` exponential values (mean 1) whose 95% interval holds 1.0 (seed 11).
    `make figures` quotes it (figures/steps.py coverage)."""
    rng = np.random.default_rng(11)
    covered = 0
    for trial in range(trials):
        sample = rng.exponential(1.0, size=(n, 1))  # [sentence, 1]
        weights = poisson_weights(range(trial * n, (trial + 1) * n), resamples, seed=0)
        low, high = interval(resampled_means(sample, weights))
        covered += bool(low[0] <= 1.0 <= high[0])
    return covered / trials


def test_95_percent_intervals_cover_a_known_mean_95_percent_of_the_time():
    """Repeated samples of 60 exponential values (mean 1, skewed): the interval should hold 1.0 in
    about 95% of them. The percentile bootstrap of a mean runs a little under its nominal level at
    this size (about 0.93-0.94), so the band is 3 binomial sd around 0.95, widened by 0.02 below."""
    trials = 300
    rate = coverage_rate(trials, n=60, resamples=400)
    sd = math.sqrt(0.95 * 0.05 / trials)
    assert 0.95 - 3 * sd - 0.02 <= rate <= 0.95 + 3 * sd, rate
