"""attnprobe's streamed, batched, vectorised statistics against a plain reference.

The reference takes transformers' own `output_attentions` maps, one sentence at a time (no
padding, no hooks, nothing stopped early), and computes every score row by row in Python from
the definitions in docs/metrics.md. Every optimisation must leave the numbers unchanged (1e-5).
"""

import math

import numpy as np
import pytest
import torch
from conftest import SENTENCES

from attnprobe.analysis import analyze_loaded
from attnprobe.corpus import Corpus, Sentence
from attnprobe.metrics import METRICS
from attnprobe.model import load_model
from attnprobe.planning import Options

SINK, WINDOW = 1, 3  # small, so that sink_window is defined on short sentences


def reference_row_scores(p: np.ndarray, i: int, n: int, causal: bool) -> dict[str, float]:
    """Every score of row i of one head's map p [query, key], straight from the definitions."""
    kept = [j for j in range(i + 1) if j < SINK or j > i - WINDOW]  # sinks and the recent window
    keys = list(range(i + 1)) if causal else list(range(n))
    k = len(keys)
    row = [float(p[i, j]) for j in keys]
    entropy = -sum(x * math.log(x) for x in row if x > 0)
    near = [j for j in keys if abs(i - j) <= 2]
    diagonal = sum(float(p[i, j]) for j in near)
    return {
        "entropy": entropy,
        "entropy_norm": entropy / math.log(k) if k >= 2 else math.nan,
        "diagonal": diagonal,
        "first_token": float(p[i, 0]),
        "previous_token": float(p[i, i - 1]) if k >= 2 and i >= 1 else math.nan,
        "self": float(p[i, i]) if k >= 2 else math.nan,
        "distance": sum(float(p[i, j]) * abs(i - j) for j in keys),
        "diagonal_excess": diagonal - len(near) / k,
        "sink_window": sum(float(p[i, j]) for j in kept) if causal and i >= SINK + WINDOW else math.nan,
        "entropy_unforced": entropy if k >= 2 else math.nan,
        "diagonal_unforced": diagonal if len(near) < k else math.nan,
        "first_token_unforced": float(p[i, 0]) if k >= 2 else math.nan,
    }


def reference_sentence(model, tokenizer, text: str, causal: bool) -> dict[str, np.ndarray]:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        maps = model(**ids, output_attentions=True).attentions  # per layer [1, head, n, n]
    n = ids["input_ids"].shape[1]
    out = {name: np.zeros((len(maps), maps[0].shape[1])) for name in METRICS}
    for layer, attention in enumerate(maps):
        for head in range(attention.shape[1]):
            rows = [reference_row_scores(attention[0, head].numpy(), i, n, causal) for i in range(n)]
            for name in METRICS:
                values = [r[name] for r in rows if not math.isnan(r[name])]
                out[name][layer, head] = sum(values) / len(values) if values else math.nan
    return out


@pytest.mark.parametrize("attention", ["blocked", "eager"])
@pytest.mark.parametrize("which", ["gpt2", "minilm"])
def test_streamed_statistics_equal_the_reference(which, attention, request):
    loaded = load_model(str(request.getfixturevalue("gpt2_dir")), "cpu") if which == "gpt2" else \
        request.getfixturevalue("minilm")
    texts = SENTENCES[:5]
    corpus = Corpus(path=__import__("pathlib").Path("x.txt"), sha256="-",
                    sentences=tuple(Sentence(t, i + 1, None) for i, t in enumerate(texts)))
    options = Options(attention=attention, sink=SINK, window=WINDOW, block_rows=4)
    result = analyze_loaded(loaded, corpus, batch_size=3, resamples=10, options=options, keep_per_sentence=True)
    assert result.run["attention"]["path"] == attention
    frame = result.per_sentence
    for s, text in enumerate(texts):
        expected = reference_sentence(loaded.model, loaded.tokenizer, text, loaded.causal)
        got = frame[frame["sentence"] == s].sort_values(["layer", "head"])
        for name in METRICS:
            np.testing.assert_allclose(got[name].to_numpy(), expected[name].ravel(), atol=1e-5, err_msg=name)
    assert frame["sink_window"].notna().any() == loaded.causal  # defined for decoders only
