"""Attention rollout: the arithmetic against hand-computed cases, padding, real tiny models, and the CLI."""

import numpy as np
import pytest
import torch
from test_cli import assert_one_line_error, run

from attnprobe.rollout import BatchRollout, rollout, rollout_batch, rollout_loaded, with_residual


def random_maps(*shape: int, causal: bool = False, seed: int = 0) -> torch.Tensor:
    """Softmax rows over the last axis, [..., query, key]; causal masks keys after the query."""
    scores = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3.0  # [..., query, key]
    if causal:
        n = shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1)  # [..., query, key]


def test_identity_maps_roll_out_to_the_identity():
    eye = torch.eye(6).expand(4, 6, 6)  # [layer, query, key]
    result = rollout(eye)  # [layer, query, key]
    assert result.shape == (4, 6, 6)
    assert torch.equal(result, torch.eye(6).expand(4, 6, 6))


@pytest.mark.parametrize("residual", [0.0, 0.3, 0.5, 1.0])
def test_rows_sum_to_one(residual):
    maps = random_maps(5, 7, 7)  # [layer, query, key]
    result = rollout(maps, residual)  # [layer, query, key]
    assert torch.allclose(result.sum(dim=-1), torch.ones(5, 7), atol=1e-6)
    assert (result >= 0).all()


def test_residual_weight_one_is_the_identity_and_zero_the_plain_product():
    maps = random_maps(3, 4, 4)  # [layer, query, key]
    assert torch.allclose(rollout(maps, 1.0), torch.eye(4).expand(3, 4, 4))
    assert torch.allclose(rollout(maps, 0.0)[-1], maps[2] @ maps[1] @ maps[0], atol=1e-6)


def test_two_layers_by_hand():
    # layer 0: two heads whose average is [[1, 0], [0.5, 0.5]]; layer 1: one map [[1, 0], [0.2, 0.8]]
    layer0 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])  # [head, query, key]
    layer1 = torch.tensor([[[1.0, 0.0], [0.2, 0.8]], [[1.0, 0.0], [0.2, 0.8]]])  # [head, query, key]
    attention, rolled = rollout_batch([layer0[None], layer1[None]], [2])  # each [batch=1, head, q, k]
    # A0' = 0.5 A0 + 0.5 I = [[1, 0], [0.25, 0.75]];  A1' = [[1, 0], [0.1, 0.9]]
    # R1 = A1' @ A0' = [[1, 0], [0.1 + 0.9 * 0.25, 0.9 * 0.75]] = [[1, 0], [0.325, 0.675]]
    np.testing.assert_allclose(attention[0][0], [[1.0, 0.0], [0.5, 0.5]], atol=1e-6)
    np.testing.assert_allclose(rolled[0][0], [[1.0, 0.0], [0.25, 0.75]], atol=1e-6)
    np.testing.assert_allclose(rolled[0][1], [[1.0, 0.0], [0.325, 0.675]], atol=1e-6)


def test_two_layers_by_hand_bidirectional():
    a0 = torch.tensor([[0.5, 0.5], [0.5, 0.5]])  # A0' = [[0.75, 0.25], [0.25, 0.75]]
    a1 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # A1' = [[0.5, 0.5], [0.5, 0.5]]
    result = rollout(torch.stack([a0, a1]))  # [layer, query, key]
    torch.testing.assert_close(result[0], torch.tensor([[0.75, 0.25], [0.25, 0.75]]))
    torch.testing.assert_close(result[1], torch.full((2, 2), 0.5))


def test_rows_are_renormalised():
    # rows that do not sum to 1 (a bfloat16 map, say) come out normalised
    skewed = torch.tensor([[0.9, 0.0], [0.3, 0.6]])  # [query, key]
    mixed = with_residual(skewed)  # [query, key]
    torch.testing.assert_close(mixed.sum(dim=-1), torch.ones(2))
    torch.testing.assert_close(mixed[1], torch.tensor([0.15, 0.8]) / 0.95)


def test_causal_maps_give_lower_triangular_rollouts():
    maps = random_maps(4, 3, 6, 6, causal=True)  # [layer, head, query, key]
    _, rolled = rollout_batch([maps[layer][None] for layer in range(4)], [6])
    for layer_rollout in rolled[0]:  # [query, key]
        assert np.all(np.triu(layer_rollout, 1) == 0.0)


def test_padding_is_dropped_per_sentence():
    """A sentence padded into a batch (garbage in its padded rows and columns) rolls out as if alone."""
    lengths, n = [5, 3, 7], 7
    batch = []  # per layer [batch, head, query, key]
    for layer in range(3):
        padded = random_maps(3, 4, n, n, seed=10 + layer)  # [batch, head, query, key], garbage everywhere
        for b, size in enumerate(lengths):
            padded[b, :, :size, :size] = random_maps(4, size, size, seed=100 * layer + b)  # the real maps
        batch.append(padded)
    attention, rolled = rollout_batch(batch, lengths)
    for b, size in enumerate(lengths):
        alone = [layer_maps[b : b + 1, :, :size, :size] for layer_maps in batch]  # [1, head, q, k] each
        attention_alone, rolled_alone = rollout_batch(alone, [size])
        assert rolled[b].shape == (3, size, size)
        np.testing.assert_array_equal(rolled[b], rolled_alone[0])
        np.testing.assert_array_equal(attention[b], attention_alone[0])


def test_batch_rollout_matches_the_functional_form():
    maps = random_maps(3, 2, 5, 5)  # [layer, head, query, key]
    batch = BatchRollout([5])
    for layer_maps in maps:
        batch.add(layer_maps[None])  # [1, head, query, key]
    _, rolled = batch.results()
    np.testing.assert_allclose(rolled[0], rollout(maps.mean(dim=1)).numpy(), atol=1e-6)


TEXTS = ["The cat sat on the mat.", "Rain fell.", "A dog that barked all night was finally taken home by its owner."]


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    from attnprobe.model import load_model

    return load_model(str(gpt2_dir), "cpu")


@pytest.fixture(scope="module")
def bert(bert_dir):
    from attnprobe.model import load_model

    return load_model(str(bert_dir), "cpu")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_batched_model_equals_one_sentence_at_a_time(name, request):
    loaded = request.getfixturevalue(name)
    together = rollout_loaded(loaded, TEXTS)
    for k, text in enumerate(TEXTS):
        alone = rollout_loaded(loaded, [text])
        assert together.tokens[k] == alone.tokens[0]
        np.testing.assert_allclose(together.rollout[k], alone.rollout[0], atol=1e-5)
        np.testing.assert_allclose(together.attention[k], alone.attention[0], atol=1e-5)
        np.testing.assert_allclose(together.rollout[k].sum(axis=-1), 1.0, atol=1e-5)


def test_real_decoder_is_lower_triangular_and_encoder_is_not(gpt2, bert):
    decoder = rollout_loaded(gpt2, TEXTS[:1]).rollout[0]  # [layer, query, key]
    encoder = rollout_loaded(bert, TEXTS[:1]).rollout[0]  # [layer, query, key]
    assert decoder.shape == (3, 7, 7)
    assert np.all(np.triu(decoder, 1) == 0.0)
    assert np.triu(encoder, 1).max() > 1e-3


def test_rollout_equals_the_head_averaged_maps_rolled_out(gpt2):
    result = rollout_loaded(gpt2, TEXTS[:2], residual=0.3)
    for attention, rolled in zip(result.attention, result.rollout):
        np.testing.assert_allclose(rolled, rollout(torch.from_numpy(attention), 0.3).numpy(), atol=1e-6)
    np.testing.assert_array_equal(result.raw[0], result.attention[0][-1])


def test_cutting_a_decoder_sentence_equals_cropping_its_rollout(gpt2):
    full = rollout_loaded(gpt2, [TEXTS[2]])
    cut = rollout_loaded(gpt2, [TEXTS[2]], max_tokens=5)
    assert cut.total_tokens == [14] and len(cut.tokens[0]) == 5
    np.testing.assert_allclose(cut.rollout[0], full.rollout[0][:, :5, :5], atol=1e-5)


def test_rollout_figure(gpt2):
    from attnprobe.plotting import rollout_figure

    figure = rollout_figure(rollout_loaded(gpt2, TEXTS[:2]), "tiny-gpt2")
    assert len(figure.axes) == 5  # two sentences x (rollout, raw) + the colorbar
    assert "tiny-gpt2" in figure._suptitle.get_text()


def test_cli_writes_rollout_of_the_example_analyze_picks(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("rollout", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert (out / "rollout.png").stat().st_size > 0
    with np.load(out / "rollout.npz", allow_pickle=False) as data:
        # the sentence closest to 12 tokens, as `analyze` picks it (12 word-level tokens here)
        assert data["sentence"].tolist() == ["Who wrote the letter that was left on the kitchen table?"]
        assert data["index"].tolist() == [4] and data["lengths"].tolist() == [12]
        assert data["rollout"].shape == (1, 3, 12, 12) and data["raw"].shape == (1, 12, 12)
        assert data["tokens"][0].tolist()[:2] == ["Who", " wrote"]  # each token's span of the text, space and all
        np.testing.assert_allclose(data["rollout"].sum(axis=-1), 1.0, atol=1e-5)
        np.testing.assert_array_equal(data["raw"][0], data["attention"][0, -1])
        assert float(data["residual"]) == 0.5
    assert "rollout" in result.stdout and "rollout.npz" in result.stdout


def test_cli_examples_and_indices_pad_with_nan(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("rollout", "-m", gpt2_dir, "-c", corpus_file, "--out", out, "--index", 2, "--example",
                 "The cat sat on the mat.", "--device", "cpu")
    assert result.exit_code == 0, result.output
    with np.load(out / "rollout.npz", allow_pickle=False) as data:
        assert data["sentence"].tolist() == ["Rain fell.", "The cat sat on the mat."]
        assert data["index"].tolist() == [2, -1] and data["lengths"].tolist() == [3, 7]
        assert data["rollout"].shape == (2, 3, 7, 7)
        assert np.isnan(data["rollout"][0, :, 3:, :]).all() and not np.isnan(data["rollout"][0, :, :3, :3]).any()
        assert data["tokens"][0].tolist()[3:] == [""] * 4


def test_cli_example_needs_no_corpus(gpt2_dir, tmp_path):
    result = run("rollout", "-m", gpt2_dir, "--example", "Birds sing.", "--out", tmp_path, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rollout.npz").is_file()


@pytest.mark.parametrize("args, fragment", [
    (["--index", "99"], "--index 99"),
    (["--index", "-1"], "--index -1"),
    (["--index", "0"] * 5 + ["--example", "Hi."] * 4, "at most 8"),
    (["--residual", "1.5"], "--residual 1.5"),
    (["--max-tokens", "0"], "--max-tokens 0"),
    (["--example", " "], "--example is empty"),
])
def test_cli_bad_options_are_one_line(gpt2_dir, corpus_file, tmp_path, args, fragment):
    result = run("rollout", "-m", gpt2_dir, "-c", corpus_file, "--out", tmp_path / "out", "--device", "cpu", *args)
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "out" / "rollout.npz").exists()


def test_cli_bad_inputs_are_one_line(gpt2_dir, tmp_path):
    assert_one_line_error(run("rollout", "-m", gpt2_dir, "--out", tmp_path, "--device", "cpu"), "--corpus")
    assert_one_line_error(run("rollout", "-m", gpt2_dir, "--index", "0", "--out", tmp_path), "--corpus")
    missing = run("rollout", "-m", gpt2_dir, "-c", tmp_path / "nope.txt", "--out", tmp_path)
    assert_one_line_error(missing, "nope.txt")
    assert_one_line_error(run("rollout", "-m", tmp_path / "no-model", "--example", "Hi.", "--out", tmp_path),
                          "no-model")
    # a bad choice of sentences is refused before the model is loaded
    corpus = tmp_path / "c.txt"
    corpus.write_text("One.\nTwo.\n", encoding="utf-8")
    early = run("rollout", "-m", tmp_path / "no-model", "-c", corpus, "--index", "2", "--out", tmp_path)
    assert_one_line_error(early, "--index 2", "has 2 sentences, numbered 0 to 1")
