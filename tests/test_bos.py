"""--bos auto|always|never: the same text with and without a BOS token, whatever the tokenizer does."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_bert, make_gpt2, save_tokenizer
from typer.testing import CliRunner

from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model
from attnprobe.tokens import encode, set_bos, token_labels

runner = CliRunner()
BOS = 0  # <|endoftext|>, the tiny tokenizers' BOS (and the GPT-2 config's bos_token_id)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One tiny GPT-2 saved twice: with a tokenizer that adds no BOS (GPT-2's habit) and one that adds it (Llama's)."""
    root = tmp_path_factory.mktemp("bos")
    plain = make_gpt2(root / "plain")
    adding = root / "adding"
    shutil.copytree(plain, adding)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (adding / name).unlink(missing_ok=True)
    save_tokenizer(adding, SENTENCES, bos=True)
    return plain, adding


def loaded_with(folder, policy):
    loaded = load_model(str(folder), "cpu")
    set_bos(loaded, policy)
    return loaded


def test_encode_follows_the_policy(pair):
    plain, adding = pair
    text = "The cat sat on the mat."
    bare = load_model(str(plain), "cpu").tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encode(loaded_with(plain, "auto"), text)["input_ids"] == bare
    assert encode(loaded_with(plain, "always"), text)["input_ids"] == [BOS, *bare]
    assert encode(loaded_with(plain, "never"), text)["input_ids"] == bare
    assert encode(loaded_with(adding, "auto"), text)["input_ids"] == [BOS, *bare]
    assert encode(loaded_with(adding, "always"), text)["input_ids"] == [BOS, *bare]  # not twice
    assert encode(loaded_with(adding, "never"), text)["input_ids"] == bare
    both = encode(loaded_with(plain, "always"), [text, "Rain fell."], return_special_tokens_mask=True,
                  return_offsets_mapping=True)
    assert [row[0] for row in both["input_ids"]] == [BOS, BOS]
    assert [row[:2] for row in both["special_tokens_mask"]] == [[1, 0], [1, 0]]
    assert [tuple(row[0]) for row in both["offset_mapping"]] == [(0, 0), (0, 0)]
    assert [len(row) for row in both["input_ids"]] == [len(row) for row in both["offset_mapping"]]


def test_always_stays_within_max_length_and_a_bos_the_text_spells_stays(pair):
    plain, adding = pair
    text = "A dog that barked all night was finally taken home by its owner."
    cut = encode(loaded_with(plain, "always"), text, truncation=True, max_length=5)["input_ids"]
    assert len(cut) == 5 and cut[0] == BOS
    spelled = "<|endoftext|> Rain fell."  # the text's own special token: not added by the tokenizer
    kept = encode(loaded_with(plain, "never"), spelled)["input_ids"]
    assert kept[0] == BOS


def test_always_without_a_bos_token_is_refused(tmp_path):
    folder = make_bert(tmp_path / "bert")  # [CLS] is no BOS, and BERT's config names none
    loaded = load_model(str(folder), "cpu")
    with pytest.raises(AttnprobeError, match="--bos always: the tokenizer of .* names no BOS token"):
        set_bos(loaded, "always")
    set_bos(loaded, "never")  # nothing to remove
    assert encode(loaded, "Rain fell.")["input_ids"] == loaded.tokenizer("Rain fell.")["input_ids"]


def test_labels_of_a_prepended_or_removed_bos(pair):
    plain, adding = pair
    text = "Rain fell."
    loaded = loaded_with(plain, "always")
    ids = encode(loaded, text)["input_ids"]
    assert token_labels(loaded, ids, text) == ["<|endoftext|>", "Rain", " fell", "."]
    stripped = encode(loaded_with(adding, "never"), text)["input_ids"]
    assert token_labels(loaded_with(adding, "never"), stripped, text) == ["Rain", " fell", "."]


def analyze(model, corpus, out, bos):
    result = invoke("analyze", "--model", model, "--corpus", corpus, "--out", out, "--bos", bos, "--resamples", 20,
                    "--threads", 1, "--device", "cpu")
    assert result.exit_code == 0, result.output
    return pd.read_csv(out / "heads.csv"), json.loads((out / "run.json").read_text())


def test_always_and_never_make_the_two_tokenizers_agree(pair, corpus_file, tmp_path):
    """GPT-2's tokenizer with --bos always measures what a BOS-adding tokenizer measures by default, and the
    BOS-adding one with --bos never what GPT-2's does: the same token ids reach the same weights."""
    plain, adding = pair
    plain_always, run = analyze(plain, corpus_file, tmp_path / "pa", "always")
    assert run["bos"] == "always"
    adding_auto, auto_run = analyze(adding, corpus_file, tmp_path / "aa", "auto")
    assert auto_run["bos"] == "auto" and run["tokens"] == auto_run["tokens"]
    pd.testing.assert_frame_equal(plain_always, adding_auto, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE)
    adding_never, never_run = analyze(adding, corpus_file, tmp_path / "an", "never")
    plain_auto, plain_run = analyze(plain, corpus_file, tmp_path / "pn", "auto")
    assert never_run["tokens"] == plain_run["tokens"] == run["tokens"] - run["sentences"]
    pd.testing.assert_frame_equal(adding_never, plain_auto, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE)
    assert not np.allclose(plain_auto["entropy"], plain_always["entropy"])  # the BOS changes what heads do


def test_the_other_commands_take_bos(pair, corpus_file, tmp_path):
    plain, _ = pair
    out = tmp_path / "probe"
    result = invoke("probe", "--model", plain, "--out", out, "--bos", "always", "--lengths", "4", "--sequences", 2,
                    "--resamples", 10, "--device", "cpu")
    assert result.exit_code == 0, result.output
    info = json.loads((out / "probe.json").read_text())
    assert info["bos"] == "always" and info["special_prefix"] == [BOS]
    out = tmp_path / "rollout"
    result = invoke("rollout", "--model", plain, "--example", "Rain fell.", "--out", out, "--bos", "always",
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    with np.load(out / "rollout.npz", allow_pickle=False) as data:
        tokens = [str(t) for t in data[[k for k in data.files if "token" in k][0]].ravel()]
    assert tokens[0] == "<|endoftext|>"
    result = invoke("verify", "--model", plain, "--bos", "always", "--device", "cpu")
    assert result.exit_code == 0, result.output
    result = invoke("verify", "--model", plain, "--bos", "sometimes")
    assert result.exit_code == 2 and "--bos" in result.output
