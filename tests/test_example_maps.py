"""Every example map (examples.npz, report.html) is right on every attention path and batch size: finite, each row
a probability distribution, and equal to transformers' own eager map of that sentence run alone (an independent
oracle: `output_attentions` on the sentence by itself, no padding, no attnprobe kernel)."""

import numpy as np
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from transformers import AutoModel, AutoTokenizer

from attnprobe.analysis import analyze
from attnprobe.planning import Options

# One sentence alone through transformers' eager attention vs attnprobe's paths: the maps are softmaxes of the same
# float32 scores computed in other orders, so they agree to float32's error carried through a few layers.
TOLERANCE = FLOAT32_TOLERANCE


def oracle_maps(model_dir, text: str, n: int) -> np.ndarray:
    """[layer, head, n, n]: transformers' eager maps of `text` run alone, first n tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions  # per layer [1, head, seq, seq]
    return torch.stack([m[0, :, :n, :n] for m in maps]).numpy()


@pytest.mark.parametrize("model_name", ["gpt2_dir", "llama_dir"])
@pytest.mark.parametrize("attention", ["auto", "fused", "blocked", "eager"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_every_example_map_is_the_sentence_alone(request, corpus_file, model_name, attention, batch_size):
    model_dir = request.getfixturevalue(model_name)
    result = analyze(str(model_dir), str(corpus_file), batch_size=batch_size, device="cpu", resamples=10,
                     options=Options(attention=attention))
    assert len(result.examples) >= 4  # the example and others: the batches hold several of them
    for example in result.examples:
        maps = example["maps"]  # [layer, head, query, key]
        n = len(example["tokens"])
        assert maps.shape[-2:] == (n, n)
        assert np.isfinite(maps).all(), f"example {example['index']} ({attention}, batch {batch_size}) has NaN"
        assert (maps >= 0).all() and (maps <= 1 + TOLERANCE).all()
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=TOLERANCE)
        expected = oracle_maps(model_dir, SENTENCES[example["index"]], n)
        np.testing.assert_allclose(maps, expected, atol=TOLERANCE)


@pytest.mark.parametrize(("attention", "expected"), [("auto", "blocked"), ("fused", "fused"), ("blocked", "blocked"),
                                                     ("eager", "eager")])
def test_run_json_says_which_kernel_measured_the_sequences(gpt2_dir, corpus_file, attention, expected):
    """Short sentences under auto run blocked (fused from kernel.FUSED_MIN_TOKENS): run.json's attention.sequences
    counts each sentence under the kernel that measured it."""
    result = analyze(str(gpt2_dir), str(corpus_file), batch_size=3, device="cpu", resamples=10,
                     options=Options(attention=attention))
    assert result.run["attention"]["sequences"] == {expected: len(SENTENCES)}


def test_auto_runs_long_batches_fused_and_short_ones_blocked(gpt2_dir, corpus_file, monkeypatch):
    """With the threshold between the corpus's lengths, the long batches run fused and the short ones blocked."""
    from attnprobe import kernel

    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    lengths = sorted(len(tokenizer(s)["input_ids"]) for s in SENTENCES)
    monkeypatch.setattr(kernel, "FUSED_MIN_TOKENS", lengths[4])
    result = analyze(str(gpt2_dir), str(corpus_file), batch_size=1, device="cpu", resamples=10)
    long = sum(n >= lengths[4] for n in lengths)
    assert result.run["attention"]["sequences"] == {"fused": long, "blocked": len(SENTENCES) - long}
