"""analyze() on tiny GPT-2 models saved to disk and loaded by path: closed forms and invariances."""

import math

import numpy as np
import pandas as pd
import pytest
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_gpt2
from transformers import AutoTokenizer

from attnprobe.analysis import analyze
from attnprobe.batching import length_batches
from attnprobe.corpus import read_corpus
from attnprobe.tables import early_late


def test_uniform_heads_give_closed_form_values(uniform_gpt2_dir, corpus_file):
    result = analyze(str(uniform_gpt2_dir), str(corpus_file), batch_size=3, device="cpu", keep_per_sentence=True)
    tok = AutoTokenizer.from_pretrained(uniform_gpt2_dir)
    tokenizer_lengths = [len(tok(s)["input_ids"]) for s in SENTENCES]
    frame = result.per_sentence
    for sentence, n in enumerate(tokenizer_lengths):
        rows = frame[frame["sentence"] == sentence]
        assert len(rows) == 3 * 4  # every (layer, head)
        h = sum(math.log(i + 1) for i in range(n)) / n
        d = sum(min(3, i + 1) / (i + 1) for i in range(n)) / n
        np.testing.assert_allclose(rows["entropy"], h, atol=1e-5)
        np.testing.assert_allclose(rows["diagonal"], d, atol=1e-5)
        np.testing.assert_allclose(rows["entropy_norm"], 1.0, atol=1e-5)
    # a head's value: each sentence weighs the same
    expected = np.mean([sum(math.log(i + 1) for i in range(n)) / n for n in tokenizer_lengths])
    np.testing.assert_allclose(result.heads["entropy"], expected, atol=1e-5)
    np.testing.assert_allclose(result.layers["entropy"], expected, atol=1e-5)
    assert result.run["tokens"] == sum(tokenizer_lengths)


def test_results_do_not_depend_on_batch_size(gpt2_dir, corpus_file):
    runs = [analyze(str(gpt2_dir), str(corpus_file), batch_size=b, device="cpu") for b in (1, 3, 16)]
    base = runs[0].heads
    assert base["entropy"].std() > 0.01  # random heads differ, so equality below means something
    for other in runs[1:]:
        pd.testing.assert_frame_equal(other.heads, base, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
        np.testing.assert_allclose(other.example["maps"], runs[0].example["maps"], atol=1e-5)


def test_heads_are_means_over_sentences_with_sample_std(gpt2_dir, corpus_file):
    result = analyze(str(gpt2_dir), str(corpus_file), batch_size=4, device="cpu", keep_per_sentence=True)
    one = result.per_sentence.query("layer == 1 and head == 2")
    row = result.heads.query("layer == 1 and head == 2").iloc[0]
    assert row["entropy"] == pytest.approx(one["entropy"].mean())
    assert row["entropy_std"] == pytest.approx(one["entropy"].std(ddof=1))
    assert row["sentences"] == len(SENTENCES)
    assert list(result.heads.columns[:6]) == ["layer", "head", "entropy", "entropy_norm", "diagonal", "first_token"]


def test_example_maps_are_proper_causal_rows(gpt2_dir, corpus_file):
    result = analyze(str(gpt2_dir), str(corpus_file), batch_size=8, device="cpu", keep_per_sentence=True)
    maps = result.example["maps"]  # [layer, head, query, key]
    n = len(result.example["tokens"])
    assert maps.shape == (3, 4, n, n)
    np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=1e-5)
    assert np.all(np.triu(maps, k=1) == 0.0)
    assert abs(n - 12) <= 3  # the sentence closest to 12 tokens


def test_long_sentences_are_truncated_to_the_context(tmp_path, corpus_file):
    model = make_gpt2(tmp_path / "short", n_positions=8, uniform_heads=True)
    result = analyze(str(model), str(corpus_file), batch_size=2, device="cpu", keep_per_sentence=True)
    assert result.run["truncated_sentences"] == 5  # all but the 7-, 3- and 3-token sentences
    assert result.run["model"]["max_length"] == 8
    longest = sum(math.log(i + 1) for i in range(8)) / 8
    assert result.per_sentence.query("sentence == 1")["entropy"].iloc[0] == pytest.approx(longest, abs=1e-5)


def test_length_batches_cover_every_sentence_once_sorted_by_length():
    ids = [[1] * n for n in (5, 2, 9, 2, 7)]
    batches = length_batches(ids, 2)
    assert batches == [[1, 3], [0, 4], [2]]


def test_early_late_uses_thirds_of_the_layers():
    layers = pd.DataFrame({"layer": range(12), "entropy": [2.0] * 4 + [1.0] * 4 + [0.5] * 4})
    summary = early_late(layers)
    assert summary["early_layers"] == [0, 3] and summary["late_layers"] == [8, 11]
    assert summary["difference"] == pytest.approx(1.5)
    assert early_late(pd.DataFrame({"layer": [0, 1], "entropy": [3.0, 1.0]}))["difference"] == pytest.approx(2.0)


def test_bundled_corpus_is_100_tagged_sentences():
    corpus = read_corpus(__import__("conftest").CORPUS_PATH)
    assert len(corpus.sentences) == 100
    counts = pd.Series([s.category for s in corpus.sentences]).value_counts()
    for category in ("svo", "relative_clause", "passive", "coreference"):
        assert counts[category] >= 20
    assert counts["question"] >= 5 and counts["long"] >= 5


def test_bfloat16_runs_with_float32_statistics(gpt2_dir, corpus_file):
    full = analyze(str(gpt2_dir), str(corpus_file), device="cpu", keep_per_sentence=True)
    half = analyze(str(gpt2_dir), str(corpus_file), device="cpu", dtype="bfloat16")
    assert half.run["dtype"] == "bfloat16" and full.run["dtype"] == "float32"
    assert half.heads["entropy"].dtype == "float64"
    np.testing.assert_allclose(half.heads["entropy"], full.heads["entropy"], atol=0.05)
    assert not np.allclose(half.heads["entropy"], full.heads["entropy"], atol=1e-7, rtol=0)


def test_float16_on_cpu_is_refused(gpt2_dir, corpus_file):
    from attnprobe.errors import AttnprobeError

    with pytest.raises(AttnprobeError, match="float16 needs a GPU"):
        analyze(str(gpt2_dir), str(corpus_file), device="cpu", dtype="float16")


def test_tagged_corpus_gives_categories_with_intervals(gpt2_dir, tmp_path):
    corpus = tmp_path / "tagged.txt"
    corpus.write_text("Rain fell.\n# category: short\nBirds sing.\nThe cat sat on the mat.\n"  # 10 sentences: Poisson
                      "# category: long\n" + "\n".join(SENTENCES[3:8] + SENTENCES[:2]) + "\n", encoding="utf-8")
    result = analyze(str(gpt2_dir), str(corpus), device="cpu", resamples=200, keep_per_sentence=True)
    cats = result.categories
    assert list(cats.columns) == ["category", "layer", "entropy", "entropy_ci_low", "entropy_ci_high", "entropy_norm",
                                  "entropy_norm_ci_low", "entropy_norm_ci_high", "sentences"]
    assert list(dict.fromkeys(cats["category"])) == ["untagged", "short", "long"]
    assert cats.groupby("category")["sentences"].first().to_dict() == {"untagged": 1, "short": 2, "long": 7}
    frame = result.per_sentence
    short = frame[frame["sentence"].isin([1, 2]) & (frame["layer"] == 1)]
    expected = short.groupby("sentence")["entropy"].mean().mean()  # mean over heads, then over sentences
    assert cats.query("category == 'short' and layer == 1")["entropy"].iloc[0] == pytest.approx(expected)
    single = cats.query("category == 'untagged'")
    np.testing.assert_allclose(single["entropy_ci_low"], single["entropy"])  # one sentence: no spread
    assert (cats["entropy_ci_low"] <= cats["entropy"] + 1e-9).all()


def test_intervals_follow_the_seed(gpt2_dir, corpus_file):
    a = analyze(str(gpt2_dir), str(corpus_file), device="cpu", resamples=300, seed=1)
    b = analyze(str(gpt2_dir), str(corpus_file), device="cpu", resamples=300, seed=1)
    c = analyze(str(gpt2_dir), str(corpus_file), device="cpu", resamples=300, seed=2)
    pd.testing.assert_frame_equal(a.heads, b.heads)
    assert not np.allclose(a.heads["entropy_ci_low"], c.heads["entropy_ci_low"])
    pd.testing.assert_series_equal(a.heads["entropy"], c.heads["entropy"])  # point values never move
    low, high = a.run["summary"]["difference_ci"]
    assert low < a.run["summary"]["difference"] < high
    layer = a.layers.iloc[1]
    assert layer["entropy_ci_low"] < layer["entropy"] < layer["entropy_ci_high"]
