"""Bootstrap intervals: collapse when every sentence agrees, widen when they differ, repeat with a seed."""

import numpy as np
import pytest

from attnprobe.bootstrap import interval, resample_counts, resampled_means


def test_counts_draw_every_resample_in_full():
    counts = resample_counts(7, 50, seed=1)
    assert counts.shape == (50, 7)
    assert (counts.sum(axis=1) == 7).all()


def test_identical_sentences_give_a_point_interval():
    values = np.full((20, 3), 1.25)  # [sentence, head]
    low, high = interval(resampled_means(values, resample_counts(20, 200, seed=0)))
    np.testing.assert_allclose(low, 1.25)
    np.testing.assert_allclose(high, 1.25)


def test_differing_sentences_give_an_interval_around_the_mean():
    values = np.arange(40, dtype=float)[:, None]  # mean 19.5, sd 11.5
    low, high = interval(resampled_means(values, resample_counts(40, 2000, seed=0)))
    assert low[0] < 19.5 < high[0]
    se = values.std(ddof=1) / np.sqrt(40)
    assert high[0] - low[0] == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_same_seed_same_interval_other_seed_other_interval():
    values = np.random.default_rng(3).normal(size=(30, 4))
    a = interval(resampled_means(values, resample_counts(30, 300, seed=5)))
    b = interval(resampled_means(values, resample_counts(30, 300, seed=5)))
    c = interval(resampled_means(values, resample_counts(30, 300, seed=6)))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])


def test_nan_values_are_skipped():
    values = np.array([[1.0], [np.nan], [3.0]])
    means = resampled_means(values, np.array([[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]]))
    assert means[0, 0] == pytest.approx(2.0)
    assert np.isnan(means[1, 0])  # drew only the sentence without a value
