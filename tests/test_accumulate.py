"""Sums instead of per-sentence tables: the same numbers as computing from every sentence's values."""

import warnings

import numpy as np
import pandas as pd
import pytest
from conftest import CORPUS_PATH

from attnprobe.accumulate import Accumulator, Shape
from attnprobe.analysis import analyze_loaded
from attnprobe.bootstrap import interval, poisson_weights, resampled_means
from attnprobe.corpus import read_corpus
from attnprobe.tables import summarize_layers


@pytest.fixture(scope="module")
def bundled(minilm):
    corpus = read_corpus(CORPUS_PATH)
    return corpus, analyze_loaded(minilm, corpus, batch_size=8, resamples=300, seed=4, keep_per_sentence=True)


def scores(frame):
    return [c for c in frame.columns if c not in ("sentence", "layer", "head", "category")]


def test_head_means_std_and_intervals_equal_the_per_sentence_computation(bundled):
    corpus, result = bundled
    frame = result.per_sentence
    grouped = frame.groupby(["layer", "head"], sort=True)
    expected = grouped[scores(frame)].mean().reset_index()  # the pre-accumulator computation
    for name in scores(frame):
        np.testing.assert_allclose(result.heads[name], expected[name], rtol=0, atol=1e-9, err_msg=name)
    np.testing.assert_allclose(result.heads["entropy_std"], grouped["entropy"].std(ddof=1).to_numpy(), atol=1e-9)
    assert (result.heads["sentences"] == len(corpus.sentences)).all()
    weights = poisson_weights(range(len(corpus.sentences)), 300, seed=4)  # [resample, sentence]
    n_layers, n_heads = result.heads["layer"].nunique(), result.heads["head"].nunique()
    for name in ("entropy", "diagonal", "first_token"):
        values = frame.sort_values(["sentence", "layer", "head"])[name].to_numpy()
        values = values.reshape(len(corpus.sentences), n_layers, n_heads)
        low, high = interval(resampled_means(values, weights))
        np.testing.assert_allclose(result.heads[f"{name}_ci_low"], low.ravel(), atol=1e-9)
        np.testing.assert_allclose(result.heads[f"{name}_ci_high"], high.ravel(), atol=1e-9)
    np.testing.assert_allclose(result.layers["entropy"], summarize_layers(expected)["entropy"], atol=1e-9)


def test_categories_equal_the_per_sentence_computation(bundled):
    corpus, result = bundled
    frame = result.per_sentence
    weights = poisson_weights(range(len(corpus.sentences)), 300, seed=4)
    for name in ("entropy", "entropy_norm"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            by_sentence = frame.groupby(["sentence", "layer"])[name].mean().unstack().to_numpy()  # [s, layer]
        for category, rows in result.categories.groupby("category", sort=False):
            chosen = [i for i, s in enumerate(corpus.sentences) if s.category == category]
            np.testing.assert_allclose(rows[name], by_sentence[chosen].mean(axis=0), atol=1e-9)
            low, high = interval(resampled_means(by_sentence[chosen], weights[:, chosen]))
            np.testing.assert_allclose(rows[f"{name}_ci_low"], low, atol=1e-9)
            np.testing.assert_allclose(rows[f"{name}_ci_high"], high, atol=1e-9)
            assert (rows["sentences"] == len(chosen)).all()


def random_batch(rng, indices, layers=2, heads=3, bins=4):
    shape = (len(indices), layers, heads)
    stats = {"entropy": rng.random(shape), "diagonal": rng.random(shape)}
    stats["diagonal"][0, 0, 0] = np.nan  # an undefined value is skipped
    bin_values = {"entropy": rng.random((len(indices), layers, heads, bins))}
    return stats, bin_values


def four_batches():
    """A two-score shape and four batches of 5 random sentences (corpus indices 0-19), labelled a, b, a, b, ..."""
    shape = Shape(names=("entropy", "diagonal"), bin_names=("entropy",), layers=2, heads=3, bins=4, resamples=50,
                  seed=1, categories=("a", "b"))
    rng = np.random.default_rng(0)
    batches = [list(range(k, k + 5)) for k in range(0, 20, 5)]
    data = [random_batch(rng, b) for b in batches]
    labels = ["a", "b"] * 10
    return shape, batches, data, labels


def test_accumulators_of_shards_merge_to_the_whole():
    shape, batches, data, labels = four_batches()
    whole, left, right = Accumulator(shape), Accumulator(shape), Accumulator(shape)
    for k, (batch, (stats, bins)) in enumerate(zip(batches, data)):
        args = (batch, stats, bins, [9] * len(batch), [labels[i] for i in batch])
        whole.add(*args)
        (left if k % 2 else right).add(*args)
    left.merge(right)
    pd.testing.assert_frame_equal(left.heads(), whole.heads(), atol=1e-12, rtol=0)
    pd.testing.assert_frame_equal(left.positions(9), whole.positions(9), atol=1e-12, rtol=0)
    pd.testing.assert_frame_equal(left.categories(), whole.categories(), atol=1e-12, rtol=0)
    np.testing.assert_allclose(left.resampled_head_means("entropy"), whole.resampled_head_means("entropy"))
    all_entropy = np.concatenate([d[0]["entropy"] for d in data])  # [sentence, layer, head]
    np.testing.assert_allclose(whole.heads()["entropy"], all_entropy.mean(axis=0).ravel(), atol=1e-12)
    np.testing.assert_allclose(whole.entropy_std().ravel(), all_entropy.std(axis=0, ddof=1).ravel(), atol=1e-12)
    assert whole.heads()["diagonal"].iloc[0] == pytest.approx(np.nanmean(
        np.concatenate([d[0]["diagonal"] for d in data])[:, 0, 0]))


def test_memory_does_not_hold_sentences():
    shape = Shape(names=("entropy",), bin_names=(), layers=2, heads=2, bins=1, resamples=10, seed=0, categories=())
    accumulator = Accumulator(shape)
    size = sum(v.nbytes for v in accumulator.sums.values())
    rng = np.random.default_rng(1)
    for start in range(0, 400, 8):
        accumulator.add(list(range(start, start + 8)), {"entropy": rng.random((8, 2, 2))}, {}, [5] * 8)
    assert sum(v.nbytes for v in accumulator.sums.values()) == size  # 400 sentences later, not a byte more


@pytest.mark.parametrize("pending", [3, 5, 64])  # smaller than a batch, equal to it, larger than the corpus
def test_the_buffer_of_waiting_sentences_changes_nothing(monkeypatch, pending):
    """Sentences wait in a buffer before their resample sums are folded in; batches larger than the buffer go in
    slices. Whatever its size, the intervals are those of the per-sentence computation."""
    from attnprobe import accumulate

    monkeypatch.setattr(accumulate, "PENDING_SENTENCES", pending)
    shape, batches, data, labels = four_batches()
    totals = Accumulator(shape)
    for batch, (stats, bins) in zip(batches, data):
        totals.add(batch, stats, bins, [9] * len(batch), [labels[i] for i in batch])
    weights = poisson_weights(range(20), 50, seed=1)  # [resample, sentence]
    for name in shape.names:
        values = np.concatenate([stats[name] for stats, _ in data])  # [sentence, layer, head]
        np.testing.assert_allclose(totals.resampled_head_means(name), resampled_means(values, weights), atol=1e-12)
        np.testing.assert_allclose(totals.head_means()[name], np.nanmean(values, axis=0), atol=1e-12)
    assert totals.categories()["sentences"].tolist() == [10, 10, 10, 10]
