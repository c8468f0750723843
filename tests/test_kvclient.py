"""`ablate --method streaming --client kvpress` against kvpress 0.5.5's DuoAttentionPress, re-implemented from its
source in float64, and the tasks it scores (kvtasks).

What kvpress does (presses/duo_attention_press.py, attention_patch.py, pipeline.py of kvpress 0.5.5): the pipeline
prefills the context through the model into a `DynamicCache()` with full attention; the press's `compress` records,
per streaming KV head, the prefill's keys `[sink_size : -recent_size]` (Python's slice of the context's keys); every
later forward through the cache (query length != key length: the question, each decoded token) replaces those keys by
a fake key of zero weight. The oracle below does exactly that with two forward passes through a real KV cache (the
context, then the rest with its positions), one sequence at a time, hiding the recorded keys by an index list built
with the same slice. It shares nothing with streamheads' one-pass blocked mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_cli import assert_one_line_error, run
from test_streamheads import atol, corpus, models, oracle_model, padded_batch, some_heads  # noqa: F401 (fixtures)

from attnprobe import kvtasks
from attnprobe import streamheads as sh
from attnprobe.model import attention_modules, forward_kwargs

ORACLE = "attnprobe_test_kvpress_oracle"
_STATE: dict = {}


def kvpress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dense float64 attention; after the prefill, a streaming KV head's recorded context keys get zero weight."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale  # [batch, head, q, keys]
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[2]].double()
    if query.shape[2] != key.shape[2]:  # attention_patch: decoding, masked_key_indices set by compress
        hidden = list(range(_STATE["context"]))[_STATE["sink"] : -_STATE["recent"]]
        layer = _STATE["layers"][id(module)]
        for kv_head in range(k.shape[1]):
            if _STATE["heads"][layer, kv_head] and hidden:
                for h in range(kv_head * groups, (kv_head + 1) * groups):
                    scores[:, h, :, hidden] = -torch.inf  # the fake key: exp(<q, k>) = 0
    p = torch.softmax(scores, dim=-1)
    return (p @ v.repeat_interleave(groups, dim=1)).transpose(1, 2).to(query.dtype), None


def kvpress_model(loaded):
    """A float64 copy of the model (and LM head) that runs kvpress_attention."""
    return oracle_model(loaded, ORACLE, kvpress_attention)


def kvpress_final(model, kv_mask, sink, recent, ids, context):
    """The oracle's last hidden state [n, hidden] of one sequence ids [n] whose first `context` tokens are the
    context: prefill into a DynamicCache, then the rest through it at positions context..n-1."""
    from transformers import DynamicCache

    _STATE.update(layers={id(m): layer for layer, (m, _) in enumerate(attention_modules(model))},
                  heads=np.asarray(kv_mask, dtype=bool), sink=sink, recent=recent, context=context)
    cache = DynamicCache()
    n = ids.shape[0]
    with torch.inference_mode():
        first = model(input_ids=ids[None, :context], past_key_values=cache, use_cache=True).last_hidden_state
        rest = model(input_ids=ids[None, context:], past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(context, n)[None]).last_hidden_state
    return torch.cat([first, rest], dim=1)[0]  # [n, hidden]


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
def test_the_kvpress_client_equals_kvpress_from_its_source(models, corpus, name):  # noqa: F811
    """A padded batch, each row with its own context length, in one pass: every real position equals the oracle's
    two-pass KV-cache run of that sequence alone."""
    loaded = models[name]
    batch = padded_batch(loaded, corpus)
    lengths = batch.mask.sum(-1).tolist()
    contexts = [max(1, n - 3) for n in lengths]  # the last 3 tokens come after the context
    kv_mask = some_heads(loaded, seed=1)
    sink, recent = 1, 2
    with torch.inference_mode(), sh.streaming(loaded, kv_mask, sink, recent, context=contexts):
        got = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
        duo = None
    with torch.inference_mode(), sh.streaming(loaded, kv_mask, sink, recent):
        duo = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    model, _ = kvpress_model(loaded)
    changed = 0.0
    for row, (n, context) in enumerate(zip(lengths, contexts)):
        want = kvpress_final(model, kv_mask, sink, recent, batch.input_ids[row, :n], context)  # [n, hidden]
        full = kvpress_final(model, np.zeros_like(kv_mask), sink, recent, batch.input_ids[row, :n], context)
        np.testing.assert_allclose(got[row, :n].double().numpy(), want.numpy(), rtol=0, atol=atol(want))
        # the context itself is the full model's (prefill), and what follows is not
        np.testing.assert_allclose(want[:context].numpy(), full[:context].numpy(), rtol=0, atol=atol(want))
        changed = max(changed, float((want[context:] - full[context:]).abs().max()))
        if context > sink + recent:  # the duo-attention client restricts the context too: another intervention
            assert float((duo[row, :context].double() - full[:context]).abs().max()) > 100 * atol(want)
    assert changed > 100 * atol(got)


def test_recent_past_the_context_hides_nothing(models, corpus):  # noqa: F811
    """kvpress's slice `sink : -recent` is empty when the context holds no more than sink + recent keys."""
    loaded = models["llama-gqa"]
    batch = padded_batch(loaded, corpus)
    every = np.ones((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    contexts = [3] * len(batch.indices)
    with torch.inference_mode():
        own = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
        with sh.streaming(loaded, every, 1, 2, context=contexts):
            got = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    real = batch.mask.bool()
    np.testing.assert_allclose(got[real].numpy(), own[real].numpy(), rtol=0, atol=atol(own[real]))


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    from attnprobe.corpus import read_corpus

    path = tmp_path_factory.mktemp("kvclient") / "long.txt"
    path.write_text("\n".join(" ".join(SENTENCES[k:] + SENTENCES[:k]) for k in range(3)) + "\n", encoding="utf-8")
    return read_corpus(path)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_text_task_scores_the_continuation_as_kvpress_would(models, long_corpus, name):  # noqa: F811
    """The kvpress text task: per document the last `continuation` tokens, each predicted by a query after the
    context (which ends one token before them); the loss, its change, the KL and the accuracy equal the oracle's."""
    from attnprobe.batching import tokenize

    loaded = models[name]
    kv_mask = some_heads(loaded, seed=2)
    heads = [(int(layer), int(head)) for layer, head in zip(*np.nonzero(kv_mask))]
    continuation, sink, recent = 5, 1, 2
    result = sh.streaming_ablate_loaded(loaded, long_corpus, heads=heads, sink=sink, recent=recent, curve=False,
                                        batch_size=2, resamples=20, client="kvpress", task="text",
                                        continuation=continuation)
    model, head = kvpress_model(loaded)
    nll_p, nll_q, kl, hits = [], [], [], []
    for ids in tokenize(loaded, long_corpus).ids:
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = ids.shape[0]
        context = n - continuation - 1
        cut = kvpress_final(model, kv_mask, sink, recent, ids, context)
        full = kvpress_final(model, np.zeros_like(kv_mask), sink, recent, ids, context)
        at = slice(n - continuation - 1, n - 1)  # the positions predicting the scored tokens
        target = ids[n - continuation :]
        with torch.inference_mode():
            log_p = torch.log_softmax(head(full[at]), dim=-1)  # [continuation, vocab]
            log_q = torch.log_softmax(head(cut[at]), dim=-1)
        nll_p.append(-log_p.gather(-1, target[:, None])[:, 0])
        nll_q.append(-log_q.gather(-1, target[:, None])[:, 0])
        kl.append((log_p.exp() * (log_p - log_q)).sum(-1))
        hits.append((log_q.argmax(-1) == target).double())
    nll_p, nll_q, kl, hits = (torch.cat(x) for x in (nll_p, nll_q, kl, hits))
    row = result.curve.iloc[0]
    assert (row["task"], row["order"]) == ("text", "chosen")
    assert result.run["predicted_tokens"] == len(nll_q) == 3 * continuation
    assert row["loss"] == pytest.approx(float(nll_q.mean()), abs=atol(nll_q))
    assert row["loss_change"] == pytest.approx(float((nll_q - nll_p).mean()), abs=2 * atol(nll_q))
    assert row["kl"] == pytest.approx(float(kl.mean()), abs=2 * atol(nll_q))
    assert row["accuracy"] == pytest.approx(float(hits.mean()), abs=1e-12)
    assert abs(float(kl.mean())) > 100 * atol(nll_q)
    assert result.run["client"] == "kvpress" and kvtasks.KVPRESS_VERSION in result.run["client_semantics"]


def test_needle_task_prompts_and_scored_answer(models, long_corpus):  # noqa: F811
    """The needle task: retrieval's prompt at each length and depth, the needle as the answer after the question;
    only the answer's tokens are scored and (kvpress) the context ends where the question begins."""
    from attnprobe import retrieval as rt

    loaded = models["llama-gqa"]
    haystack = " ".join(SENTENCES)
    found = kvtasks.Sequences()
    kvtasks.add_needle(found, loaded, haystack, "kvpress", lengths=[40, 60], depths=[0.0, 50.0],
                       needle=rt.DEFAULT_NEEDLE, question=rt.DEFAULT_QUESTION)
    answer = kvtasks.answer_ids(loaded, rt.DEFAULT_NEEDLE)
    parts = rt.prompt_parts(loaded, rt.DEFAULT_NEEDLE, rt.DEFAULT_QUESTION)
    assert len(found.ids) == 4 and [t["length"] for t in found.trials] == [40, 40, 60, 60]
    for ids, first, context, trial in zip(found.ids, found.first, found.context, found.trials):
        assert len(ids) == trial["length"] + len(answer) and first == trial["length"]
        assert list(ids[first:]) == answer
        assert list(ids[context:first]) == parts.tail
        assert list(ids[trial["needle_start"] : trial["needle_end"]]) == parts.needle
    duo = kvtasks.Sequences()
    kvtasks.add_needle(duo, loaded, haystack, "duo-attention", lengths=[40], depths=[0.0],
                       needle=rt.DEFAULT_NEEDLE, question=rt.DEFAULT_QUESTION)
    assert duo.context == [None]
    result = sh.streaming_ablate_loaded(
        loaded, long_corpus, heads=[(0, 0), (1, 1)], sink=1, recent=4, curve=True, shares=(0.0, 1.0), resamples=20,
        task="needle", needle=sh.Needle(haystack, lengths=(40, 60), depths=(0.0, 50.0)), random_orders=2)
    assert set(result.curve["task"]) == {"needle"}
    assert result.run["tasks"]["needle"] == {"sequences": 4, "scored_tokens": 4 * len(answer), "skipped": 0}
    zero = result.curve[(result.curve["order"] == "random") & (result.curve["share"] == 0.0)].iloc[0]
    assert zero["loss_change"] == 0.0 and zero["kl"] == 0.0


def test_random_rows_are_the_mean_of_the_random_orders(models, long_corpus):  # noqa: F811
    """The "random" row at a share is the token-weighted mean over `random_orders` orders: with one order it is
    that order, and the mean of orders 0 and 1 lies between them."""
    loaded = models["gpt2"]
    common = dict(heads=[(0, 0)], sink=1, recent=2, shares=(0.5,), resamples=20, client="kvpress", task="text",
                  continuation=5)
    one = sh.streaming_ablate_loaded(loaded, long_corpus, random_orders=1, **common).curve
    two = sh.streaming_ablate_loaded(loaded, long_corpus, random_orders=2, **common).curve
    layers, kv = loaded.num_layers, loaded.num_kv_heads
    second = sh.first_share(sh.random_order(layers, kv, 0, 1), 0.5, layers, kv)
    named = [(int(layer), int(head)) for layer, head in zip(*np.nonzero(second))]
    rest = {k: v for k, v in common.items() if k != "heads"}
    alone = sh.streaming_ablate_loaded(loaded, long_corpus, heads=named, curve=False, **rest).curve
    first_row = one[one["order"] == "random"].iloc[0]
    mean_row = two[two["order"] == "random"].iloc[0]
    want = (first_row["loss"] + alone.iloc[0]["loss"]) / 2  # every order scores the same tokens
    assert mean_row["loss"] == pytest.approx(want, abs=FLOAT32_TOLERANCE * max(1.0, abs(want)))


def test_cli_client_and_task_options_are_bounded(models, tmp_path):  # noqa: F811
    corpus_path = tmp_path / "c.txt"
    corpus_path.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    model = models["gpt2"].spec
    base = ["ablate", "--model", model, "--corpus", str(corpus_path), "--method", "streaming", "--heads", "L0H0",
            "--out", str(tmp_path / "o")]
    for extra, fragment in (
        (["--client", "vllm"], "--client"),
        (["--task", "qa"], "--task"),
        (["--continuation", "0"], "--continuation"),
        (["--random-orders", "0"], "--random-orders"),
        (["--task", "text"], "--continuation"),  # one-sentence lines are shorter than a 64-token continuation
        (["--task", "text", "--needle", "A sentence."], "--needle sets the needle task"),
        (["--client", "duo-attention", "--continuation", "5"], "--continuation applies"),
        (["--random-orders", "101"], "--random-orders"),
        (["--task", "needle", "--needle", " "], "--needle"),
    ):
        result = run(*base, *extra)
        assert_one_line_error(result, fragment)


def test_cli_runs_both_tasks_for_kvpress_by_default(models, tmp_path):  # noqa: F811
    """The defaults: the kvpress client, the text and needle tasks (the haystack: the corpus), a curve per task
    against the mean of the random orders; streaming.json names the kvpress version modelled."""
    import json

    import pandas as pd

    corpus_path = tmp_path / "doc.txt"
    corpus_path.write_text(" ".join(SENTENCES * 2) + "\n", encoding="utf-8")
    out = tmp_path / "o"
    result = run("ablate", "--model", models["llama-gqa"].spec, "--corpus", corpus_path, "--split", "file",
                 "--method", "streaming", "--heads", "L0H0,L1H1", "--out", out, "--sink-size", 1, "--recent-size", 4,
                 "--continuation", 8, "--lengths", "40,60", "--depths", "0,50", "--shares", "0,0.5,1",
                 "--random-orders", 2, "--resamples", 20)
    assert result.exit_code == 0, result.output
    curve = pd.read_csv(out / "streaming.csv")
    assert curve["task"].tolist() == ["text"] * 4 + ["needle"] * 4
    assert curve["order"].tolist() == ["chosen", "random", "random", "random"] * 2
    recorded = json.loads((out / "streaming.json").read_text())
    assert recorded["client"] == "kvpress" and "0.5.5" in recorded["client_semantics"]
    assert recorded["tasks"]["text"]["scored_tokens"] == 8 and recorded["tasks"]["needle"]["sequences"] == 4
    assert recorded["continuation"] == 8 and len(recorded["needle"]["trials"]) == 4
    assert set(recorded["result"]) == {"text", "needle"}
    assert "needle task" in result.stdout and "text task" in result.stdout
    assert (out / "streaming.png").is_file()


def test_progress_names_the_layers_within_a_long_sequence(models, long_corpus, monkeypatch):  # noqa: F811
    """Within a sequence longer than layer_progress.LONG_TOKENS the measure reports each pass's layers, in order,
    as well as the sequences done; the numbers are those of a run without the reports."""
    from attnprobe import layer_progress

    loaded = models["gpt2"]
    common = dict(heads=[(0, 0)], sink=1, recent=2, shares=(0.0, 0.5), resamples=20, task="text", continuation=5,
                  random_orders=1, batch_size=1)
    quiet = sh.streaming_ablate_loaded(loaded, long_corpus, **common).curve
    monkeypatch.setattr(layer_progress, "LONG_TOKENS", 4)
    monkeypatch.setattr(layer_progress, "EVERY_SECONDS", 0.0)
    seen = []

    def progress(stage, done, total, within=None):
        seen.append((stage, done, total, within))

    loud = sh.streaming_ablate_loaded(loaded, long_corpus, progress=progress, **common).curve
    layers = [w for *_, w in seen if w is not None]
    assert layers and {w.layers for w in layers} == {loaded.num_layers}
    first_pass = [w.layer for w in layers if w.run == 1][: loaded.num_layers]
    assert first_pass == list(range(1, loaded.num_layers + 1))
    assert [s[1] for s in seen if s[3] is None] == [1, 2, 3]  # the sequences done
    numeric = [c for c in quiet.columns if c not in ("task", "order")]
    np.testing.assert_array_equal(quiet[numeric].to_numpy(), loud[numeric].to_numpy())
