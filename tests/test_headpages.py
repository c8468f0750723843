"""Each head's examples across the corpus: the top keys per query row against the eager maps (the oracle), the
streamed selection against a sort of every value, and head_examples.npz as analyze writes it and io reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SENTENCES

from attnprobe import headpages
from attnprobe.batching import pad_batch, tokenize_sentences
from attnprobe.corpus import Sentence
from attnprobe.headpages import DECILES, EXTREMES, Selection, top_keys, unit_id, unit_parts, window_means
from attnprobe.model import load_model

TOLERANCE = 1e-5  # float32 softmax of the same scores (the eager map's own rounding, ~1e-7 relative, a few ulps)


def eager_maps(loaded, input_ids, mask) -> list[np.ndarray]:
    """Per layer [batch, head, query, key]: transformers' own eager maps in float64."""
    with torch.no_grad():
        maps = loaded.model(input_ids=input_ids, attention_mask=mask, output_attentions=True).attentions
    return [m.double().numpy() for m in maps]


def assert_top_keys(keys, weights, maps, lengths, rows=None):
    """keys/weights [layer, batch, head, row, k] are torch.topk of each real row of the float64 maps: the weights
    equal the top-k weights, each key holds the weight given for it, no key twice; keys of equal weight may come in
    any order (ties)."""
    k = keys.shape[-1]
    for layer, p in enumerate(maps):
        for b, n in enumerate(lengths):
            for slot, q in enumerate(range(n) if rows is None else rows):
                for h in range(p.shape[1]):
                    row = p[b, h, q, :n]
                    best = torch.topk(torch.from_numpy(row), min(k, n)).values.numpy()
                    best = best[best > 0]
                    got_k, got_w = keys[layer, b, h, slot], weights[layer, b, h, slot]
                    real = got_k >= 0
                    assert real.sum() == len(best), (layer, b, h, q)
                    np.testing.assert_allclose(got_w[real], best, atol=TOLERANCE)
                    np.testing.assert_allclose(row[got_k[real]], got_w[real], atol=TOLERANCE)
                    assert len(set(got_k[real].tolist())) == real.sum()
                    assert (got_w[~real] == 0).all()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_top_keys_are_the_top_k_of_the_eager_map(family, gpt2_dir, llama_dir, bert_dir):
    folder = {"gpt2": gpt2_dir, "llama": llama_dir, "bert": bert_dir}[family]
    loaded = load_model(str(folder), device="cpu")
    texts = [SENTENCES[0], SENTENCES[3] + " " + SENTENCES[5]]  # two lengths: the shorter one right-padded
    ids = tokenize_sentences(loaded, [Sentence(t, i + 1, None) for i, t in enumerate(texts)]).ids
    input_ids, mask = pad_batch([t.tolist() for t in ids], loaded.device)
    keys, weights = top_keys(loaded, input_ids, mask, k=3)
    assert keys.shape == (loaded.num_layers, 2, loaded.num_heads, input_ids.shape[1], 3)
    maps = eager_maps(loaded, input_ids, mask)
    assert_top_keys(keys, weights, maps, [len(t) for t in ids])
    # the first row of a causal model sees one key: one top key, the others none
    if loaded.causal:
        assert (keys[:, :, :, 0, 0] == 0).all() and (keys[:, :, :, 0, 1:] == -1).all()
    # only some rows (a long sequence's windows), in small blocks: the same rows' keys
    one, one_mask = pad_batch([ids[1].tolist()], loaded.device)
    rows = [1, 2, 3, len(ids[1]) - 1]
    part_k, part_w = top_keys(loaded, one, one_mask, rows=rows, k=2, budget_mib=1e-4)
    assert_top_keys(part_k, part_w, eager_maps(loaded, one, one_mask), [len(ids[1])], rows)


def test_ties_are_any_of_the_tied_keys(uniform_gpt2_dir):
    """A uniform model: every key of a row ties; the kept keys are distinct allowed keys of weight 1/(i+1)."""
    loaded = load_model(str(uniform_gpt2_dir), device="cpu")
    ids = tokenize_sentences(loaded, [Sentence(SENTENCES[1], 1, None)]).ids[0]
    input_ids, mask = pad_batch([ids.tolist()], loaded.device)
    keys, weights = top_keys(loaded, input_ids, mask, k=3)
    maps = eager_maps(loaded, input_ids, mask)
    assert_top_keys(keys, weights, maps, [len(ids)])
    q = len(ids) - 1
    np.testing.assert_allclose(weights[:, 0, :, q], 1 / (q + 1), atol=TOLERANCE)
    assert (keys[:, 0, :, q] <= q).all()


def test_the_selection_keeps_the_extremes_and_one_unit_per_decile():
    rng = np.random.default_rng(0)
    units, layers, heads = 300, 2, 3
    values = rng.normal(size=(units, layers, heads))
    values[5, 0, 0] = np.nan  # not defined there: never picked
    selection = Selection(["entropy", "first_token"], layers, heads)
    ids = np.array([unit_id(i // 3, i % 3) for i in range(units)])
    for start in range(0, units, 7):  # batches of 7
        selection.offer(ids[start:start + 7], {"entropy": values[start:start + 7],
                                               "first_token": -values[start:start + 7]})
    picks = selection.picks()
    entropy = [p for p in picks if p.score == "entropy" and (p.layer, p.head) == (0, 0)]
    finite = np.flatnonzero(np.isfinite(values[:, 0, 0]))
    order = finite[np.argsort(values[finite, 0, 0], kind="stable")]
    top = [p.unit for p in entropy if p.extreme == 1]
    bottom = [p.unit for p in entropy if p.extreme == -1]
    assert top == ids[order[::-1][:EXTREMES]].tolist() and bottom == ids[order[:EXTREMES]].tolist()
    assert all(p.decile == DECILES - 1 for p in entropy if p.extreme == 1)
    assert all(p.decile == 0 for p in entropy if p.extreme == -1)
    deciles = [p for p in entropy if p.extreme == 0]
    m = len(finite)  # every unit is in the sample (300 <= SAMPLE), in corpus order: the deciles are exact
    rank = np.empty(m, dtype=int)
    rank[np.argsort(values[finite, 0, 0], kind="stable")] = np.arange(m)
    first = [finite[np.flatnonzero(rank * DECILES // m == d)[0]] for d in range(DECILES)]  # first unit of each tenth
    assert [p.unit for p in deciles] == ids[first].tolist()
    assert [p.decile for p in deciles] == list(range(DECILES))
    for p in deciles:
        sentence, window = unit_parts(np.array([p.unit]))
        assert p.value == values[sentence[0] * 3 + window[0], 0, 0]
    flipped = [p for p in picks if p.score == "first_token" and (p.layer, p.head) == (1, 2) and p.extreme == 1]
    assert [p.unit for p in flipped] == ids[np.argsort(values[:, 1, 2], kind="stable")[:EXTREMES]].tolist()


def test_window_means_leave_out_missing_rows():
    rows = torch.arange(2 * 150, dtype=torch.float32).view(2, 150)  # [head, query]
    rows[0, 3] = torch.nan
    means = window_means(rows, 130)  # windows of 64: rows 0-63, 64-127, 128-129
    assert means.shape == (3, 2)
    expected = [np.nanmean(np.where(np.arange(150) == 3, np.nan, np.arange(150))[a:b]) for a, b in
                ((0, 64), (64, 128), (128, 130))]
    np.testing.assert_allclose(means[:, 0].numpy(), expected)
    assert headpages.SEGMENT_TOKENS == 64


def test_analyze_writes_each_heads_examples_with_their_values_and_top_keys(gpt2_dir, tmp_path, monkeypatch):
    """head_examples.npz of a run: a short sentence's value is its row in sentences.parquet, a window of a long
    sequence has the mean of its rows' values straight from the eager maps (test_few_sequences' reference), and the
    top keys stored are the eager map's top-k of those rows."""
    from test_cli import run
    from test_few_sequences import reference_rows

    from attnprobe import io

    monkeypatch.setattr(headpages, "SEGMENT_TOKENS", 16)  # the tiny model's context is 64 tokens
    long_text = " ".join(SENTENCES[1:6])  # 40-odd tokens: judged in windows of 16 rows
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([*SENTENCES, long_text]) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples",
                 "20", "--per-sentence", "--head-examples")
    assert result.exit_code == 0, result.output
    found = io.read_head_examples(out)
    names = found["scores"].tolist()
    assert names[:3] == ["entropy", "first_token", "previous_token"]
    parquet = io.read_sentences(out).read().to_pandas().set_index(["sentence", "layer", "head"])
    segment = found["entry_segment"][found["pick_entry"]]  # [pick]
    sentence = found["segment_sentence"][segment]
    start, stop, total = (found[f"segment_{key}"][segment] for key in ("start", "stop", "tokens"))
    layer, head = found["entry_layer"][found["pick_entry"]], found["entry_head"][found["pick_entry"]]
    whole = (start == 0) & (stop == total)
    assert whole.any() and (~whole).any()
    for k in np.flatnonzero(whole):
        expected = parquet.loc[(sentence[k], layer[k], head[k]), names[found["pick_score"][k]]]
        assert found["pick_value"][k] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    loaded = load_model(str(gpt2_dir), device="cpu")
    texts = [*SENTENCES, long_text]
    rows = {i: reference_rows(loaded.model, loaded.tokenizer, texts[i], True) for i in set(sentence[~whole])}
    checked = 0
    for k in np.flatnonzero(~whole):
        name = names[found["pick_score"][k]]
        if name not in rows[sentence[k]]:  # duplicate_token: test_reference's definitions leave it to test_tokens
            continue
        values = rows[sentence[k]][name][layer[k], head[k], start[k]:stop[k]]
        checked += 1
        assert found["pick_value"][k] == pytest.approx(np.nanmean(values), abs=1e-5)
    assert checked > 50
    # the top keys of every stored entry of the long sequence: the eager map's top-k of its rows
    ids = torch.tensor([tokenize_sentences(loaded, [Sentence(long_text, 1, None)]).ids[0].tolist()])
    maps = eager_maps(loaded, ids, torch.ones_like(ids))
    windows = np.flatnonzero(found["segment_sentence"] == len(SENTENCES))
    for entry in np.flatnonzero(np.isin(found["entry_segment"], windows))[:20]:
        seg = found["entry_segment"][entry]
        a, b = found["row_offsets"][entry], found["row_offsets"][entry + 1]
        q = list(range(found["segment_start"][seg], found["segment_stop"][seg]))
        keys = np.zeros((1, 1, 1, len(q), 3), dtype=np.int64)
        weights = np.zeros((1, 1, 1, len(q), 3), dtype=np.float32)
        keys[0, 0, 0], weights[0, 0, 0] = found["keys"][a:b], found["weights"][a:b]
        one = [maps[found["entry_layer"][entry]][:, [found["entry_head"][entry]]]]
        assert_top_keys(keys, weights, one, [ids.shape[1]], q)
        labels = found["labels"][found["label_offsets"][seg]:found["label_offsets"][seg + 1]]
        positions = found["label_positions"][found["label_offsets"][seg]:found["label_offsets"][seg + 1]]
        assert set(found["keys"][a:b][found["keys"][a:b] >= 0]) <= set(positions) and len(labels) == len(positions)
