"""Edge cases found in review: each once crashed, printed noise, or passed without testing anything."""

import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
from conftest import SENTENCES, save_tokenizer
from typer.testing import CliRunner

from attnprobe.analysis import EXAMPLE_MAX_TOKENS, analyze
from attnprobe.batching import tokenize
from attnprobe.cli import app
from attnprobe.corpus import Corpus, Sentence
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model
from attnprobe.probe import probe
from attnprobe.verify import DEFAULT_SENTENCES, verify

runner = CliRunner()


def make_llama(folder, rope_parameters=None):
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    vocab = save_tokenizer(folder, SENTENCES + list(DEFAULT_SENTENCES))
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=0, eos_token_id=0, initializer_range=0.3)
    LlamaModel(config).save_pretrained(folder)
    return folder


def test_verify_recomputes_a_small_grouped_query_llama(tmp_path):
    loaded = load_model(str(make_llama(tmp_path / "llama")), "cpu")
    checks = verify(loaded, list(DEFAULT_SENTENCES))
    assert all(c.passed and not c.skipped for c in checks), checks


def test_verify_recomputes_linear_rope_scaling(tmp_path):
    """Linear rope scaling was skipped before verify recomputed every rope type (recompute.py); now it is checked."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    loaded = load_model(str(make_llama(tmp_path / "linear", rope)), "cpu")
    check = verify(loaded, list(DEFAULT_SENTENCES))[3]
    assert check.name.startswith("softmax") and not check.skipped and check.passed, check


def test_verify_says_when_a_check_had_nothing_to_compare(gpt2_dir):
    loaded = load_model(str(gpt2_dir), "cpu")
    checks = {c.name: c for c in verify(loaded, ["Rain fell."])}
    assert checks["batched = one at a time"].skipped
    assert not checks["future/padded keys get 0"].skipped  # the future is masked even without padding
    result = runner.invoke(app, ["verify", "--model", str(gpt2_dir), "-n", "2"])
    assert "2 sentences" in " ".join(result.stdout.split())  # -n applies to the built-in sentences too


def test_probe_asks_each_kind_once(gpt2_dir):
    loaded = load_model(str(gpt2_dir), "cpu")
    once = probe(loaded, kinds=("previous",), lengths=(4,), sequences=3, resamples=20)
    twice = probe(loaded, kinds=("previous", "previous"), lengths=(4,), sequences=3, resamples=20)
    pd.testing.assert_frame_equal(once.scores, twice.scores)


def test_probe_command_reports_a_repeated_kind_once(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["probe", "--model", str(gpt2_dir), "--kind", "previous", "--kind", "previous",
                                 "--lengths", "4", "--sequences", "3", "--resamples", "20", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("Top previous heads") == 1
    from matplotlib.image import imread

    once = runner.invoke(app, ["probe", "--model", str(gpt2_dir), "--kind", "previous", "--lengths", "4",
                               "--sequences", "3", "--resamples", "20", "--out", str(tmp_path / "once")])
    assert once.exit_code == 0, once.output
    # one panel, as for the kind asked once (the title, which names the model's path, sets the width)
    assert imread(tmp_path / "probe_heatmap.png").shape == imread(tmp_path / "once" / "probe_heatmap.png").shape


def test_negative_seed_is_refused_before_any_work(gpt2_dir, corpus_file):
    with pytest.raises(AttnprobeError, match="--seed -1 is negative"):
        analyze(str(gpt2_dir), str(corpus_file), seed=-1)
    result = runner.invoke(app, ["probe", "--model", str(gpt2_dir), "--seed", "-2", "--lengths", "4", "--out", "x"])
    assert result.exit_code == 1 and "--seed -2" in result.stderr


def test_long_example_sentence_keeps_only_its_first_tokens(gpt2_dir, tmp_path):
    corpus = tmp_path / "long.txt"
    corpus.write_text(" ".join(SENTENCES[1:6]) + "\n", encoding="utf-8")  # about 70 tokens
    out = tmp_path / "out"
    assert runner.invoke(app, ["analyze", "-m", str(gpt2_dir), "-c", str(corpus), "--out", str(out)]).exit_code == 0
    with np.load(out / "example_attention.npz") as data:
        assert data["maps"].shape[-2:] == (EXAMPLE_MAX_TOKENS, EXAMPLE_MAX_TOKENS)
        assert int(data["total_tokens"]) > EXAMPLE_MAX_TOKENS
    assert runner.invoke(app, ["plot", "--out", str(out)]).exit_code == 0
    from matplotlib.image import imread

    assert imread(out / "head_patterns.png").shape[1] < 5000  # pixels: bounded, whatever the length


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.assign(entropy_unforced=f["entropy_unforced"].astype(object).where(f.index != 2, "abc")),
     "not numbers in entropy_unforced"),
    (lambda f: pd.concat([f, f.iloc[[0]]]), "repeats a (layer, head) row"),
])
def test_damaged_heads_csv(tmp_path, damage, message):
    heads = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "entropy_unforced": [0.1, 1.0, 2.0],
                          "entropy_norm": [0.1, 0.5, 0.9], "diagonal_unforced": [0.9, 0.3, 0.2],
                          "entropy": [0.1, 1.0, 2.0]})  # plot draws entropy, and requires it
    damage(heads).to_csv(tmp_path / "heads.csv", index=False)
    for command in ("classify", "plot"):
        result = runner.invoke(app, [command, "--out", str(tmp_path)])
        assert result.exit_code == 1 and message in result.stderr, result.output


def test_unwritable_gguf_cache(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNPROBE_CACHE", str(blocker))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    from attnprobe.sources import resolve

    with pytest.raises(AttnprobeError, match="cannot write the GGUF cache.*ATTNPROBE_CACHE"):
        resolve(str(fake))


def test_one_token_sentences_and_long_inputs_print_no_warnings(gpt2_dir, tmp_path, caplog):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Rain\nBirds\n" + " ".join(SENTENCES) + "\n", encoding="utf-8")
    model = __import__("conftest").make_gpt2(tmp_path / "short", n_positions=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = analyze(str(model), str(corpus), device="cpu", resamples=50)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert not [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]
    assert result.run["truncated_sentences"] == 1
    assert result.heads["entropy_norm"].notna().all()  # the long sentence still defines it


def test_special_tokens_are_the_ones_the_tokenizer_adds(minilm):
    corpus = Corpus(path=__import__("pathlib").Path("x"), sha256="-",
                    sentences=(Sentence("A smile \U0001f642 and a [MASK] here.", 1, None),))
    tokens = tokenize(minilm, corpus)
    ids, special = tokens.ids[0], tokens.special[0]
    assert minilm.tokenizer.unk_token_id in ids  # the emoji
    assert special.tolist() == [1] + [0] * (len(ids) - 2) + [1]  # only [CLS] and [SEP]


def test_misspelt_option_value_is_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "attnprobe", "analyze", "-m", "x", "-c", "y", "--device", "tpu"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["Error: --device 'tpu' is not one of auto, cpu, cuda, mps"]
    bare = subprocess.run([sys.executable, "-m", "attnprobe"], capture_output=True, text=True)
    assert bare.returncode == 0 and bare.stdout.startswith("Usage: attnprobe")
