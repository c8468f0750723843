"""What heads attend to by token: punctuation, duplicate and top_tokens.csv against closed forms and a float64
oracle of our own (transformers' eager maps, output_attentions, in float64; the sentences in one right-padded
batch), on every path (blocked, fused, eager)."""

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_blocked import assert_close, corpus_of

from attnprobe import kernel, tokens
from attnprobe.accumulate import Accumulator, Shape
from attnprobe.analysis import analyze_loaded
from attnprobe.batching import pad_batch
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import key_range, uniform_received
from attnprobe.model import forward_kwargs, load_model
from attnprobe.planning import Options

PATHS = ("blocked", "fused", "eager")
TEXTS = [*SENTENCES, "The cat , the dog , the mat .", "Rain ! Rain ? Rain ."]  # duplicates and punctuation


def test_is_punctuation_strips_markers_and_wants_all_p_characters():
    for text in (",", "Ġ.", "▁?!", "##,", " --", "»", "…"):
        assert tokens.is_punctuation(text), text
    for text in ("", "Ġ", "$", "+", "a,", "the", "12"):
        assert not tokens.is_punctuation(text), text


def oracle(loaded, texts):
    """Per sentence [sentence, layer, head]: punctuation and duplicate; and per token id the mass received
    [layer, head, vocab], the uniform rows' [layer, vocab] and the occurrences [vocab], all in float64."""
    tok = loaded.tokenizer
    encoded = [tok(t, return_special_tokens_mask=True) for t in texts]
    ids = [e["input_ids"] for e in encoded]
    input_ids, mask = pad_batch(ids, loaded.device)  # [batch, seq] each
    with torch.inference_mode():
        maps = loaded.model(**forward_kwargs(loaded.model, input_ids, mask), output_attentions=True).attentions
    table = tokens.punctuation_table(tok, len(tok))
    vocab = max(loaded.model.config.vocab_size, len(tok))
    layers, heads = len(maps), maps[0].shape[1]
    punct = np.full((len(texts), layers, heads), np.nan)
    dup = np.full((len(texts), layers, heads), np.nan)
    mass, uniform, count = np.zeros((layers, heads, vocab)), np.zeros((layers, vocab)), np.zeros(vocab)
    for s, (row_ids, e) in enumerate(zip(ids, encoded)):
        n = len(row_ids)
        flags = np.array([table[t] and not sp for t, sp in zip(row_ids, e["special_tokens_mask"])], dtype=float)
        np.add.at(count, row_ids, 1)
        for layer, p in enumerate(maps):
            a = p[s, :, :n, :n].double().numpy()  # [head, q, k]
            punct[s, layer] = (a @ flags).mean(axis=-1)
            rows = []
            for i in range(n):
                keys = range(i + 1) if loaded.causal else range(n)
                same = [j for j in keys if j != i and row_ids[j] == row_ids[i]]
                if same:
                    rows.append(a[:, i, same].sum(axis=-1))
                for j in keys:
                    uniform[layer, row_ids[j]] += 1.0 / len(keys)
            if rows:
                dup[s, layer] = np.mean(rows, axis=0)
            np.add.at(mass[layer].T, row_ids, a.sum(axis=1).T)  # [key, head] by token
    return punct, dup, mass, uniform, count


def expected_top(mass, uniform, count):
    """Every token's lift and mass share per head, as a frame keyed by (layer, head, token_id)."""
    layers, heads, _ = mass.shape
    rows = []
    for layer in range(layers):
        for head in range(heads):
            for t in np.flatnonzero(count >= 1):
                rows.append((layer, head, t, mass[layer, head, t] / uniform[layer, t],
                             mass[layer, head, t] / mass[layer, head].sum()))
    return pd.DataFrame(rows, columns=["layer", "head", "token_id", "lift", "mass_share"]).set_index(
        ["layer", "head", "token_id"])


@pytest.fixture(scope="module", params=["gpt2", "llama", "bert"])
def model(request):
    return load_model(str(request.getfixturevalue(f"{request.param}_dir")), "cpu")


@pytest.mark.parametrize("path", PATHS)
def test_every_path_equals_the_float64_oracle(model, path):
    punct, dup, mass, uniform, count = oracle(model, TEXTS)
    options = Options(attention=path, top_tokens_min=1, block_rows=3)  # several blocks per sentence
    result = analyze_loaded(model, corpus_of(TEXTS), batch_size=4, resamples=10, options=options)
    assert result.run["attention"]["path"] == path
    heads = result.heads
    assert_close(heads["punctuation"], punct.mean(axis=0).ravel(), f"{path} punctuation")
    with np.errstate(all="ignore"):
        assert_close(heads["duplicate_token"], np.nanmean(dup, axis=0).ravel(), f"{path} duplicate")
    assert (heads["punctuation"] > 0).all() and (heads["duplicate_token"] > 0).all()  # the test can fail
    top = result.top_tokens
    assert list(top.columns) == ["layer", "head", "rank", "token_id", "token", "occurrences", "mass_share", "lift"]
    assert len(top) == len(heads) * tokens.TOP_TOKENS
    expected = expected_top(mass, uniform, count).loc[list(zip(top["layer"], top["head"], top["token_id"]))]
    assert_close(top["lift"], expected["lift"], f"{path} lift")
    assert_close(top["mass_share"], expected["mass_share"], f"{path} mass_share")
    assert (top["occurrences"].to_numpy() == count[top.token_id]).all()
    best = expected_top(mass, uniform, count).groupby(level=[0, 1])["lift"].max()  # rank 1 is the largest lift
    assert_close(top[top["rank"] == 1]["lift"], best.to_numpy(), f"{path} rank 1")
    assert (np.diff(top["lift"].to_numpy().reshape(-1, tokens.TOP_TOKENS), axis=1) <= 1e-12).all()


def test_uniform_heads_give_the_share_of_punctuation_keys_and_lift_one(uniform_gpt2_dir):
    """Zeroed query weights: every row is uniform over the j <= i, so punctuation = mean over rows of (punctuation
    keys seen / keys seen) and every token's lift is 1."""
    loaded = load_model(str(uniform_gpt2_dir), "cpu")
    texts = ["the cat , the dog .", "Rain fell .", "Who wrote the letter ? the letter ."]
    table = tokens.punctuation_table(loaded.tokenizer, len(loaded.tokenizer))
    expected, duplicate = [], []
    for text in texts:
        ids = loaded.tokenizer(text)["input_ids"]
        flags = np.array([table[t] for t in ids], dtype=float)
        expected.append(np.mean([flags[: i + 1].mean() for i in range(len(ids))]))
        rows = [sum(ids[j] == ids[i] for j in range(i)) / (i + 1) for i in range(len(ids))
                if any(ids[j] == ids[i] for j in range(i))]
        duplicate += [np.mean(rows)] if rows else []
    assert duplicate  # "the" repeats
    for path in PATHS:
        result = analyze_loaded(loaded, corpus_of(texts), resamples=10,
                                options=Options(attention=path, top_tokens_min=1))
        assert_close(result.heads["punctuation"], np.full(len(result.heads), np.mean(expected)), path)
        assert_close(result.heads["duplicate_token"], np.full(len(result.heads), np.mean(duplicate)), path)
        assert_close(result.top_tokens["lift"], np.ones(len(result.top_tokens)), path)


def test_planted_previous_token_head_attends_to_the_punctuation_before_it(planted_dir):
    """Head 0.0 of the planted model puts nearly all of row i on key i - 1: its punctuation mass is the share of
    rows whose previous token is punctuation, to within the mass it leaves elsewhere (1 - previous_token)."""
    loaded = load_model(str(planted_dir), "cpu")
    text = ". , ? . the cat sat on the mat"  # previous token punctuation in 4 rows of 10; uniform rows see more
    ids = loaded.tokenizer(text)["input_ids"]
    table = tokens.punctuation_table(loaded.tokenizer, len(loaded.tokenizer))
    rows = [float(table[ids[i - 1]]) if i else 0.0 for i in range(len(ids))]  # row 0 sees only itself
    for path in PATHS:
        result = analyze_loaded(loaded, corpus_of([text]), resamples=10, options=Options(attention=path))
        head = result.heads.iloc[0]
        slack = 1.0 - head["previous_token"] + 1.0 / len(ids)  # row 0 and what the others leave elsewhere
        assert head["previous_token"] > 0.9
        assert abs(head["punctuation"] - np.mean(rows)) <= slack, path
        uniform = np.mean([np.mean([table[t] for t in ids[: i + 1]]) for i in range(len(ids))])
        assert_close(result.heads.iloc[1]["punctuation"], uniform, path)  # head 0.1 is uniform
        assert abs(uniform - np.mean(rows)) > 3 * slack  # and far from the planted head's


@pytest.mark.parametrize("rows", [2, 4, 64])
def test_same_token_tiles_hold_the_pairs_of_the_dense_comparison_once_each(rows):
    """The duplicate tiles of a batch (token_tiles, which the fused and Triton paths read: packs of whole groups of one
    sentence, a large group cut by rows) hold every pair of positions with the same id in the same sentence exactly
    once, the padding none, and has_duplicate marks the rows that have one."""
    ids = torch.tensor([[5, 1, 5, 5, 2, 1, 5, 7, 2, 5, 3, 5, 5, 9, 1, 5, 4, 4],
                        [4, 4, 1, 4, 1, 6, 6, 2, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4]])
    lengths = torch.tensor([18, 11])  # the second sentence's last seven are padding
    for causal in (True, False):
        plan = kernel.duplicates.token_tiles(ids, lengths, causal, rows)
        assert [tuple(t) for t in plan.tiles.tolist()] == list(plan.spans)
        pairs = []
        for sentence, r0, r1, c0, c1 in plan.spans:
            assert r1 - r0 <= rows and (plan.sentence[r0:c1] == sentence).all()
            for a in range(r0, r1):
                for c in range(c0, c1):
                    if plan.group[a] == plan.group[c] and (c < a if causal else c != a):
                        pairs.append((sentence, int(plan.positions[a]), int(plan.positions[c])))
        dense = [(b, i, j) for b in range(2) for i in range(int(lengths[b])) for j in range(int(lengths[b]))
                 if ids[b, i] == ids[b, j] and (j < i if causal else j != i)]
        assert sorted(pairs) == dense and len(pairs) == len(set(pairs))
        has = kernel.duplicates.has_duplicate(plan, causal, None)[:, 0]  # [batch, n]
        assert has.tolist() == [[any(d[:2] == (b, i) for d in dense) for i in range(18)] for b in range(2)]


@pytest.mark.parametrize(("causal", "span"), [(True, None), (False, None), (True, 3), (False, 2)])
def test_uniform_received_equals_counting_every_row(causal, span):
    lengths = torch.tensor([7, 4])
    got = uniform_received(lengths, 7, causal, span)  # [batch, key]
    i = torch.arange(7)
    first, last = key_range(i, lengths, causal, span)  # [batch, rows]
    expected = torch.zeros(2, 7, dtype=torch.float64)
    for b in range(2):
        for row in range(int(lengths[b])):
            lo, hi = int(first[b, row]), int(last[b, row])
            expected[b, lo : hi + 1] += 1.0 / (hi - lo + 1)
    assert torch.allclose(got, expected, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE)
    assert torch.allclose(got.sum(dim=1), lengths.double())  # every real row gives 1


def test_token_sums_merge_by_adding(tmp_path):
    shape = Shape(names=("entropy",), bin_names=(), layers=1, heads=2, bins=1, resamples=2, seed=0, categories=(),
                  vocab=6)
    parts = [Accumulator(shape) for _ in range(3)]
    batches = [(torch.tensor([1, 2, 2]), torch.rand(1, 2, 3), torch.rand(1, 3)),
               (torch.tensor([5, 1]), torch.rand(1, 2, 2), torch.rand(1, 2))]
    for ids, mass, uniform in batches:
        parts[0].add_tokens(ids, mass, uniform)
    parts[1].add_tokens(*batches[0])
    parts[2].add_tokens(*batches[1])
    parts[1].merge(parts[2])
    for key in ("tokmass", "tokuniform", "tokcount"):
        assert np.allclose(parts[0].sums[key], parts[1].sums[key])
    assert parts[0].sums["tokcount"].tolist() == [0, 2, 2, 0, 0, 1]
    assert np.isclose(parts[0].sums["tokmass"][2, 0, 0], float(batches[0][1][0, 0, 1:].sum()))


def test_top_tokens_min_and_off(gpt2_dir, tmp_path):
    loaded = load_model(str(gpt2_dir), "cpu")
    result = analyze_loaded(loaded, corpus_of(TEXTS), resamples=10, options=Options(top_tokens_min=3))
    counts = result.top_tokens.groupby(["layer", "head"]).size()
    assert (result.top_tokens["occurrences"] >= 3).all() and (counts <= tokens.TOP_TOKENS).all()
    assert result.run["top_tokens"]["min_occurrences"] == 3
    off = analyze_loaded(loaded, corpus_of(TEXTS), resamples=10, options=Options(top_tokens=False))
    assert off.top_tokens is None and "top_tokens" not in off.run
    with pytest.raises(AttnprobeError, match="--top-tokens-min 0"):
        analyze_loaded(loaded, corpus_of(TEXTS), options=Options(top_tokens_min=0))
    too_rare = tokens.top_tokens(np.ones((3, 1, 1)), np.ones((3, 1)), np.array([1, 1, 1]), str, min_occurrences=2)
    assert too_rare.empty and "lift" in too_rare.columns


def test_analyze_writes_top_tokens_csv_and_a_later_run_without_removes_it(gpt2_dir, corpus_file, tmp_path):
    from typer.testing import CliRunner

    from attnprobe.cli import app

    runner = CliRunner()
    out = tmp_path / "out"
    base = ["analyze", "--model", str(gpt2_dir), "--corpus", str(corpus_file), "--out", str(out), "--resamples", "10"]
    done = runner.invoke(app, [*base, "--top-tokens-min", "2"])
    assert done.exit_code == 0, done.output
    top = pd.read_csv(out / "top_tokens.csv")
    assert len(top) and (top["occurrences"] >= 2).all() and (top["lift"] > 0).all()
    heads = pd.read_csv(out / "heads.csv")
    assert {"punctuation", "duplicate_token", "punctuation_ci_low", "duplicate_token_ci_high"} <= set(heads.columns)
    again = runner.invoke(app, [*base, "--no-top-tokens"])
    assert again.exit_code == 0, again.output
    assert not (out / "top_tokens.csv").exists()
    bad = runner.invoke(app, [*base, "--top-tokens-min", "0"])
    assert bad.exit_code != 0 and "--top-tokens-min 0" in bad.output
