"""`related` scales its sample to the head count (issue 28, item 5c): at most --pair-rows pairs of heads x query
rows, so a 32 x 32 model samples a few dozen sentences (minutes) while a 12 x 12 model keeps the whole default
sample and the same results as without a budget."""

import numpy as np
import pytest
import torch
from conftest import SENTENCES, save_tokenizer
from test_cli import run

from attnprobe import io
from attnprobe.similarity import MAX_TOKENS, PAIR_ROWS, budgeted_sentences, head_similarity, sample_indices
from attnprobe.similarity import SENTENCES as DEFAULT_SENTENCES


def test_small_models_keep_the_whole_default_sample():
    for heads in (12 * 12, 30 * 9, 6 * 12):  # GPT-2 small, SmolLM2-135M, MiniLM-L6
        assert budgeted_sentences(DEFAULT_SENTENCES, heads, MAX_TOKENS) == DEFAULT_SENTENCES


def test_a_32_by_32_model_samples_a_few_dozen_sentences():
    kept = budgeted_sentences(DEFAULT_SENTENCES, 32 * 32, MAX_TOKENS)
    pairs = 1024 * 1023 // 2
    assert kept * pairs * MAX_TOKENS <= PAIR_ROWS < (kept + 1) * pairs * MAX_TOKENS
    assert 20 <= kept <= 40  # at ~5.6 s a 64-token sentence on 2 cores (issue 28): 2-4 minutes, not 19
    assert budgeted_sentences(DEFAULT_SENTENCES, 32 * 32, MAX_TOKENS, 0) == DEFAULT_SENTENCES  # 0: no budget
    assert budgeted_sentences(DEFAULT_SENTENCES, 10**6, MAX_TOKENS) == 1  # never an empty sample


@pytest.fixture(scope="module")
def gpt2_12x12(tmp_path_factory):
    """A random GPT-2 of 12 layers x 12 heads (GPT-2 small's head count), tiny otherwise."""
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path_factory.mktemp("gpt2_12x12")
    torch.manual_seed(0)
    vocab = save_tokenizer(folder, SENTENCES)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=12, n_head=12, bos_token_id=0,
                        eos_token_id=0, initializer_range=0.4)
    GPT2Model(config).save_pretrained(folder)
    return folder


def test_a_12_by_12_model_gives_the_same_results_under_the_default_budget(gpt2_12x12):
    texts = SENTENCES * 3
    default = head_similarity(str(gpt2_12x12), texts, max_tokens=16, device="cpu")
    unlimited = head_similarity(str(gpt2_12x12), texts, max_tokens=16, device="cpu", pair_rows=0)
    assert default.indices == unlimited.indices == list(range(len(texts)))
    assert np.array_equal(default.js, unlimited.js) and default.rows == unlimited.rows
    assert default.info["sentences_asked"] == DEFAULT_SENTENCES and default.info["pair_rows"] == PAIR_ROWS


def test_a_budget_cuts_the_sample_to_the_sentences_spread_over_the_corpus(gpt2_12x12):
    texts = SENTENCES * 3
    pairs = 144 * 143 // 2
    small = head_similarity(str(gpt2_12x12), texts, max_tokens=16, device="cpu", pair_rows=5 * pairs * 16)
    assert small.indices == sample_indices(len(texts), 5)
    alone = head_similarity(str(gpt2_12x12), [texts[i] for i in small.indices], max_tokens=16, device="cpu",
                            pair_rows=0)
    np.testing.assert_array_equal(small.js, alone.js)


def test_related_states_its_budget(tmp_path, gpt2_dir):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    assert run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
               "--resamples", "20").exit_code == 0
    pairs = 12 * 11 // 2  # the tiny GPT-2: 3 x 4 heads
    result = run("related", "--out", out, "--max-tokens", "8", "--pair-rows", str(3 * pairs * 8))
    assert result.exit_code == 0, result.output
    saved = io.read_similarity(out)
    assert int(saved["sentences"]) == 3 and int(saved["sentences_asked"]) == 200
    assert int(saved["pair_rows"]) == 3 * pairs * 8
    assert f"(not 200: 12 heads keep pairs of heads x query rows within --pair-rows {3 * pairs * 8})" in \
        " ".join(result.stdout.split())
    whole = run("related", "--out", out, "--max-tokens", "8")
    assert whole.exit_code == 0 and "not 200" not in whole.stdout
    assert int(io.read_similarity(out)["sentences"]) == len(SENTENCES)


def test_a_negative_budget_is_one_line(tmp_path, gpt2_dir):
    from test_cli import assert_one_line_error

    out = tmp_path / "run"
    assert_one_line_error(run("related", "--out", out, "--pair-rows", "-1"), "--pair-rows -1")
