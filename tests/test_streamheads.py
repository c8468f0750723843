"""`attnprobe ablate --method streaming`: streaming heads (DuoAttention) against an independent eager recomputation.

The oracle is a dense attention function of its own, in float64 on a float64 copy of the model: the model's eager
mask (causal, padding, sliding window) plus, for each query head marked streaming, every key outside the first S
and the last W hidden, one (i, j) at a time. It shares nothing with streamheads' blocked computation.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_bert, make_gpt2
from test_ablate import make_llama_lm
from test_cli import assert_one_line_error, run
from zoo import make

from attnprobe import ablate as ab
from attnprobe import kernel
from attnprobe import streamheads as sh
from attnprobe.corpus import read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.model import attention_modules, forward_kwargs, load_model

ORACLE = "attnprobe_test_streaming_oracle"
_ORACLE_STATE: dict = {}


def atol(*operands) -> float:
    """FLOAT32_TOLERANCE relative to each operand's magnitude (float32 against float64 through a few layers)."""
    return FLOAT32_TOLERANCE * sum(max(1.0, float(np.max(np.abs(np.asarray(x))))) for x in operands)


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dense float64 attention: the eager mask, and for streaming query heads only keys j < S or i - j < W."""
    state = _ORACLE_STATE
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [batch, head, n, dim]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (q @ k.transpose(-1, -2)) * scale  # [batch, head, n, n]
    n = q.shape[2]
    if attention_mask is not None:
        scores = scores + attention_mask[..., :n].double()
    else:  # no mask handed over: plain causal
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    layer = state["layers"][id(module)]
    hidden = torch.zeros(q.shape[1], n, n, dtype=torch.bool)
    for h in range(q.shape[1]):
        if state["heads"][layer, h]:
            for i in range(n):
                for j in range(n):
                    hidden[h, i, j] = not (j < state["sink"] or i - j < state["recent"])
    scores = scores.masked_fill(hidden, torch.finfo(torch.float64).min)
    p = torch.softmax(scores, dim=-1)
    return (p @ v).transpose(1, 2).to(query.dtype), None


def oracle_model(loaded, name=ORACLE, attention=None):
    """A float64 copy of the model (and LM head) that runs `attention` (oracle_attention) under `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, attention or oracle_attention)
    AttentionMaskInterface.register(name, eager_mask)
    model = copy.deepcopy(loaded.model).double()
    model.set_attn_implementation(name)
    return model, copy.deepcopy(loaded.lm_head).double()


def oracle_final(loaded, model, query_heads, sink, recent, input_ids, mask):
    """The float64 oracle's last hidden state with the query heads query_heads [layer, head] streaming."""
    _ORACLE_STATE.update(layers={id(m): layer for layer, (m, _) in enumerate(attention_modules(model))},
                         heads=np.asarray(query_heads, dtype=bool), sink=sink, recent=recent)
    with torch.inference_mode():
        return model(**forward_kwargs(model, input_ids, mask)).last_hidden_state  # [batch, seq, hidden]


def query_heads_of(kv_mask: np.ndarray, heads: int) -> np.ndarray:
    """[layer, kv head] -> [layer, query head] by the definition: query head h reads KV head h // (heads / kv)."""
    layers, kv_heads = kv_mask.shape
    out = np.zeros((layers, heads), dtype=bool)
    for layer in range(layers):
        for h in range(heads):
            out[layer, h] = kv_mask[layer, h // (heads // kv_heads)]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamheads")
    return {
        "gpt2": load_model(str(make_gpt2(root / "gpt2")), "cpu", lm_head=True),
        "llama-gqa": load_model(str(make_llama_lm(root / "llama")), "cpu", lm_head=True),
        "mistral-window": load_model(str(make("mistral (sliding window)", root / "mistral", lm_head=True,
                                              sliding_window=5)), "cpu", lm_head=True),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("streamheads-corpus") / "c.txt"
    path.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return read_corpus(path)


def padded_batch(loaded, corpus):
    from attnprobe.batching import tokenize

    ids = tokenize(loaded, corpus).ids
    batch = ab.make_batches(loaded, ids, 8)[0]  # every sentence, right-padded to the longest
    return batch


def some_heads(loaded, seed=0) -> np.ndarray:
    """A mixed [layer, kv head] mask: some KV heads streaming in every layer, not all."""
    rng = np.random.default_rng(seed)
    mask = rng.random((loaded.num_layers, loaded.num_kv_heads)) < 0.5
    mask[:, 0], mask[:, -1] = True, False
    return mask


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
@pytest.mark.parametrize("budget", [sh.defaults.BLOCK_MIB, 0, None])  # 0: blocks of one query row; None: of a few
def test_streaming_attention_equals_a_float64_eager_oracle(models, corpus, name, budget):
    loaded = models[name]
    batch = padded_batch(loaded, corpus)
    if budget is None:  # blocks of about 30 rows x keys: several rows each, fewer as the keys grow
        rows, heads = batch.input_ids.shape[0], loaded.num_heads
        budget = rows * heads * 4 * kernel.blocked.TEMPORARIES * 30 / 2**20
        assert len({q1 - q0 for q0, q1 in sh.blocks(rows, heads, batch.input_ids.shape[1], int(budget * 2**20),
                                                      None)}) > 2
    kv_mask = some_heads(loaded)
    sink, recent = 2, 3
    with torch.inference_mode(), sh.streaming(loaded, kv_mask, sink, recent, budget_mib=budget):
        got = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    model, _ = oracle_model(loaded)
    want = oracle_final(loaded, model, query_heads_of(kv_mask, loaded.num_heads), sink, recent, batch.input_ids,
                        batch.mask)
    real = batch.mask.bool()
    np.testing.assert_allclose(got[real].double().numpy(), want[real].numpy(), rtol=0, atol=atol(want[real]))
    # and the streaming heads do change it: the full model differs by far more than the tolerance
    full = oracle_final(loaded, model, np.zeros((loaded.num_layers, loaded.num_heads), bool), sink, recent,
                        batch.input_ids, batch.mask)
    assert (full[real] - want[real]).abs().max() > 100 * atol(want[real])


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_loss_change_and_kl_equal_the_oracle(models, corpus, name):
    """streaming.csv's chosen row: the mean per predicted token of the loss, its change and the KL, against the
    float64 oracle's next-token distributions on every real token of the (padded) corpus."""
    loaded = models[name]
    kv_mask = some_heads(loaded, seed=3)
    heads = [(int(layer), int(head)) for layer, head in zip(*np.nonzero(kv_mask))]
    result = sh.streaming_ablate_loaded(loaded, corpus, client="duo-attention",
                                        heads=heads, sink=1, recent=2, curve=False, batch_size=3,
                                        resamples=50)
    batch = padded_batch(loaded, corpus)
    model, head = oracle_model(loaded)
    full = oracle_final(loaded, model, np.zeros((loaded.num_layers, loaded.num_heads), bool), 1, 2, batch.input_ids,
                        batch.mask)
    cut = oracle_final(loaded, model, query_heads_of(kv_mask, loaded.num_heads), 1, 2, batch.input_ids, batch.mask)
    with torch.inference_mode():
        log_p = torch.log_softmax(head(full[batch.predicts]), dim=-1)  # [predicted, vocab]
        log_q = torch.log_softmax(head(cut[batch.predicts]), dim=-1)
    nll_p = -log_p.gather(-1, batch.targets[:, None])[:, 0]
    nll_q = -log_q.gather(-1, batch.targets[:, None])[:, 0]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    row = result.curve.iloc[0]
    assert row["order"] == "chosen" and row["kv_heads_streaming"] == kv_mask.sum()
    assert row["loss"] == pytest.approx(float(nll_q.mean()), abs=atol(nll_q))
    assert row["loss_change"] == pytest.approx(float((nll_q - nll_p).mean()), abs=2 * atol(nll_q))
    assert row["kl"] == pytest.approx(float(kl.mean()), abs=2 * atol(nll_q))
    assert abs(float(kl.mean())) > 100 * atol(nll_q)  # the heads made a difference worth testing
    assert result.run["streaming_heads"] == [f"L{layer}H{h}" for layer, h in heads]


def baseline_loss(loaded, corpus) -> float:
    """The unablated mean loss per predicted token from the model's own attention (no streaming function)."""
    batch = padded_batch(loaded, corpus)
    with torch.inference_mode():
        final = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
        logits = loaded.lm_head(final[batch.predicts]).double()
    return float(torch.nn.functional.cross_entropy(logits, batch.targets))


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
def test_a_cache_wider_than_the_text_changes_nothing(models, corpus, name):
    """S + W >= every sequence's length: every head streaming still sees every key, so the loss is the unablated
    one (the model's own attention) to float32 tolerance, and the change and the KL are exactly 0."""
    loaded = models[name]
    longest = int(padded_batch(loaded, corpus).mask.sum(-1).max())
    every = [(layer, head) for layer in range(loaded.num_layers) for head in range(loaded.num_kv_heads)]
    result = sh.streaming_ablate_loaded(loaded, corpus, client="duo-attention",
                                        heads=every, sink=longest // 2, recent=longest - longest // 2,
                                        curve=False, batch_size=3, resamples=20)
    row = result.curve.iloc[0]
    assert row["kv_heads_streaming"] == len(every)
    assert row["loss_change"] == 0.0 and row["kl"] == 0.0
    base = baseline_loss(loaded, corpus)
    assert row["loss"] == pytest.approx(base, abs=atol(base))


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
def test_no_head_streaming_is_the_model_itself(models, corpus, name):
    loaded = models[name]
    batch = padded_batch(loaded, corpus)
    with torch.inference_mode():
        own = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
        with sh.streaming(loaded, np.zeros((loaded.num_layers, loaded.num_kv_heads), bool), 1, 1):
            got = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    real = batch.mask.bool()
    np.testing.assert_allclose(got[real].numpy(), own[real].numpy(), rtol=0, atol=atol(own[real]))
    assert loaded.model.config._attn_implementation != sh.NAME  # put back


def test_a_kv_head_streaming_makes_all_its_query_heads_streaming(models, corpus):
    """GQA (4 query heads over 2 KV heads): KV head 0 streaming is query heads 0 and 1 streaming, not query head 0
    alone; `pool` maps query head h to KV head h // groups, as transformers' repeat_kv does."""
    from transformers.models.llama.modeling_llama import repeat_kv

    loaded = models["llama-gqa"]
    assert loaded.num_heads == 4 and loaded.num_kv_heads == 2
    kv = torch.tensor([[True, False]])
    assert sh.pool(kv, 2).tolist() == [[True, True, False, False]]
    keys = torch.arange(2.0).view(1, 2, 1, 1)  # [batch, kv head, 1, 1]: KV head k holds k
    assert repeat_kv(keys, 2).flatten().tolist() == [0.0, 0.0, 1.0, 1.0]  # query head h reads KV head h // 2
    batch = padded_batch(loaded, corpus)
    kv_mask = np.zeros((loaded.num_layers, 2), dtype=bool)
    kv_mask[:, 0] = True
    with torch.inference_mode(), sh.streaming(loaded, kv_mask, 1, 2):
        got = loaded.model(**forward_kwargs(loaded.model, batch.input_ids, batch.mask)).last_hidden_state
    model, _ = oracle_model(loaded)
    pooled = np.zeros((loaded.num_layers, 4), dtype=bool)
    pooled[:, :2] = True
    alone = np.zeros((loaded.num_layers, 4), dtype=bool)
    alone[:, 0] = True
    real = batch.mask.bool()
    want = oracle_final(loaded, model, pooled, 1, 2, batch.input_ids, batch.mask)[real]
    other = oracle_final(loaded, model, alone, 1, 2, batch.input_ids, batch.mask)[real]
    np.testing.assert_allclose(got[real].double().numpy(), want.numpy(), rtol=0, atol=atol(want))
    assert (other - want).abs().max() > 100 * atol(want)


def test_copies_of_a_batch_each_get_their_own_heads(models, corpus):
    """One pass with per-row masks equals each mask run alone (how the curve stacks its points)."""
    loaded = models["llama-gqa"]
    batch = padded_batch(loaded, corpus)
    masks = np.stack([some_heads(loaded, 0), np.zeros((2, 2), bool), some_heads(loaded, 5)])  # [copies, layer, kv]
    rows = torch.as_tensor(masks).repeat_interleave(len(batch.indices), dim=0)
    with torch.inference_mode():
        with sh.streaming(loaded, rows, 1, 2):
            stacked = ab.run_full(loaded, batch, 3).unflatten(0, (3, len(batch.indices)))
        for c, mask in enumerate(masks):
            with sh.streaming(loaded, mask, 1, 2):
                alone = ab.run_full(loaded, batch, 1)
            real = batch.mask.bool()
            np.testing.assert_allclose(stacked[c][real].numpy(), alone[real].numpy(), rtol=0, atol=atol(alone[real]))


def write_pattern(folder: Path, scores: np.ndarray, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.savetxt(folder / "full_attention_heads.tsv", scores, delimiter="\t")  # as DuoAttention's own files
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_pattern_order_and_sparsity_follow_kvpress(tmp_path):
    """round(size x sparsity) KV heads with the lowest scores are streaming (DuoAttentionPress); the pattern's
    config.json gives S and W (a value outside [0, 1] is refused: test_adversary_33_34)."""
    scores = np.array([[0.9, 0.2, 0.5], [0.1, 0.7, 1.0]])
    pattern = sh.read_pattern(write_pattern(tmp_path / "p", scores, {"sink_size": 3, "recent_size": 7}))
    assert (pattern.sink, pattern.recent) == (3, 7)
    assert pattern.scores.max() == 1.0
    order = sh.ranked(pattern.scores)
    assert order == [(1, 0), (0, 1), (0, 2), (1, 1), (0, 0), (1, 2)]
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        mask = sh.first_share(order, share, 2, 3)
        n = round(6 * share)
        assert mask.sum() == n
        flat = np.argsort(np.clip(scores, 0, 1), axis=None)[:n]  # kvpress's rule (distinct scores: same heads)
        want = np.zeros(6, dtype=bool)
        want[flat] = True
        assert (mask.reshape(-1) == want).all()
    one_row = sh.read_pattern(write_pattern(tmp_path / "one", np.array([[0.3, 0.6]])))
    assert one_row.scores.shape == (1, 2) and one_row.sink is None


def test_the_curve(models, corpus, tmp_path):
    loaded = models["llama-gqa"]
    scores = np.array([[0.9, 0.1], [0.4, 0.6]])
    result = sh.streaming_ablate_loaded(loaded, corpus, client="duo-attention",
                                        pattern=write_pattern(tmp_path / "p", scores,
                                        {"sink_size": 1, "recent_size": 2}), sparsity=0.5, batch_size=4,
                                        resamples=50, seed=3)
    curve = result.curve
    assert list(curve["order"].unique()) == ["chosen", "pattern", "random"]
    points = curve[curve["order"] != "chosen"]
    assert (points["kv_heads_streaming"] == [round(4 * s) for s in points["share"]]).all()
    assert (points.loc[points["share"] == 0, ["loss_change", "kl"]] == 0).all().all()
    ends = points[points["share"] == 1]
    assert ends["loss"].nunique() == 1 and ends["kl"].nunique() == 1  # every KV head streaming, whichever order
    chosen, half = curve.iloc[0], points[(points["order"] == "pattern") & (points["share"] == 0.5)].iloc[0]
    assert chosen[["loss", "loss_change", "kl"]].tolist() == half[["loss", "loss_change", "kl"]].tolist()
    assert result.run["streaming_heads"] == ["L0H1", "L1H0"]  # the two lowest scores
    assert (result.run["sink_size"], result.run["recent_size"]) == (1, 2)
    for name in sh.MEASURES:
        assert (curve[f"{name}_ci_low"] <= curve[name] + 1e-12).all()
        assert (curve[name] <= curve[f"{name}_ci_high"] + 1e-12).all()


def test_defaults_are_duoattentions_without_a_config(models, corpus, tmp_path):
    result = sh.streaming_ablate_loaded(models["gpt2"], corpus, client="duo-attention",
                                        pattern=write_pattern(tmp_path / "p", np.ones((3, 4))),
                                        curve=False, resamples=10)
    assert (result.run["sink_size"], result.run["recent_size"]) == (sh.DUO_SINK, sh.DUO_RECENT)


def test_intervals_over_sequences_or_tokens():
    """Pooled mean per token; Poisson over sequences from 10 on, the block bootstrap over tokens below."""
    rng = np.random.default_rng(0)
    values = {i: rng.normal(size=(len(sh.MEASURES), 2, 5 + i)) for i in range(12)}
    tokens = {i: 5 + i for i in range(12)}
    summary, basis = sh.summarize(values, tokens, 2, 200, 0)
    everything = np.concatenate([v for v in values.values()], axis=-1)  # [measure, mask, tokens]
    np.testing.assert_allclose(summary["mean"], everything.mean(-1), rtol=1e-12)
    assert basis["method"] == "poisson"
    sums = {i: v.sum(-1, keepdims=True) for i, v in values.items()}  # what measure keeps for the Poisson bootstrap
    from_sums, _ = sh.summarize(sums, tokens, 2, 200, 0)
    for part in ("mean", "low", "high"):
        np.testing.assert_allclose(from_sums[part], summary[part], rtol=1e-12)
    few = {i: values[i] for i in range(3)}
    summary, basis = sh.summarize(few, tokens, 2, 200, 0)
    assert basis["method"] == "block" and len(basis["block_lengths"]) == 3
    assert (summary["low"] <= summary["mean"]).all() and (summary["mean"] <= summary["high"]).all()
    assert (summary["low"] < summary["high"]).all()


def test_an_encoder_is_refused(tmp_path, corpus):
    loaded = load_model(str(make_bert(tmp_path / "bert")), "cpu", lm_head=True)
    with pytest.raises(AttnprobeError, match="encoder"):
        sh.streaming_ablate_loaded(loaded, corpus, client="duo-attention", heads=[(0, 0)])


def test_cli_writes_the_curve(models, corpus_file, tmp_path):
    pattern = write_pattern(tmp_path / "pattern", np.array([[0.9, 0.1], [0.4, 0.6]]), {"sink_size": 1,
                                                                                        "recent_size": 2})
    out = tmp_path / "out"
    result = run("ablate", "--model", models["llama-gqa"].source, "--corpus", corpus_file, "--out", out, "--method",
                 "streaming", "--pattern", pattern, "--sparsity", "0.25", "--shares", "0,0.5,1", "--resamples", "20",
                 "--client", "duo-attention", "--task", "text", "--random-orders", "1")
    assert result.exit_code == 0, result.output
    curve = pd.read_csv(out / "streaming.csv")
    assert curve["order"].tolist() == ["chosen"] + ["pattern"] * 3 + ["random"] * 3
    assert curve["kv_heads_streaming"].tolist() == [1, 0, 2, 4, 0, 2, 4]
    run_info = json.loads((out / "streaming.json").read_text())
    assert run_info["streaming_heads"] == ["L0H1"] and run_info["sparsity"] == 0.25
    assert (out / "streaming.png").is_file() and not (out / "importance.csv").exists()
    assert "chosen" in result.stdout


@pytest.mark.parametrize("extra, fragments", [
    (["--sparsity", "1.5"], ["--sparsity 1.5", "from 0 to 1"]),
    (["--sparsity", "-0.1"], ["--sparsity -0.1"]),
    (["--shares", "0,2"], ["--shares 2.0"]),
    (["--recent-size", "0"], ["--recent-size 0"]),
    (["--sink-size", "-1"], ["--sink-size -1"]),
    (["--heads", "L0H1"], ["--pattern and --heads"]),
    (["--layers"], ["--layers"]),
])
def test_cli_bad_streaming_settings_are_one_line(models, corpus_file, tmp_path, extra, fragments):
    pattern = write_pattern(tmp_path / "pattern", np.array([[0.9, 0.1], [0.4, 0.6]]))
    result = run("ablate", "--model", models["llama-gqa"].source, "--corpus", corpus_file, "--out", tmp_path / "o",
                 "--method", "streaming", "--pattern", pattern, *extra)
    assert_one_line_error(result, *fragments)


def test_cli_pattern_of_another_model_is_one_line(models, corpus_file, tmp_path):
    pattern = write_pattern(tmp_path / "pattern", np.ones((3, 4)))  # GPT-2's shape, not the Llama's 2 x 2
    result = run("ablate", "--model", models["llama-gqa"].source, "--corpus", corpus_file, "--out", tmp_path / "o",
                 "--method", "streaming", "--pattern", pattern)
    assert_one_line_error(result, "3 layers x 4 KV heads", "2 x 2")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "full_attention_heads.tsv").write_text("0.1\tnope\n", encoding="utf-8")
    result = run("ablate", "--model", models["llama-gqa"].source, "--corpus", corpus_file, "--out", tmp_path / "o",
                 "--method", "streaming", "--pattern", broken)
    assert_one_line_error(result, "not a tab-separated table")


@pytest.mark.parametrize("args, fragments", [
    (["--method", "streaming"], ["--pattern DIR", "--heads"]),
    (["--method", "streaming", "--heads", "L0H2"], ["--heads L0H2", "heads 0-1"]),  # 2 KV heads
    (["--method", "streaming", "--heads", "L0H1", "--sparsity", "0.5"], ["--sparsity", "--pattern"]),
    (["--sparsity", "0.5"], ["--sparsity applies to --method streaming"]),
    (["--sink-size", "4"], ["--sink-size applies to --method streaming"]),
])
def test_cli_streaming_needs_its_heads_in_one_line(models, corpus_file, tmp_path, args, fragments):
    result = run("ablate", "--model", models["llama-gqa"].source, "--corpus", corpus_file, "--out", tmp_path / "o",
                 *args, *(["--client", "duo-attention", "--task", "text"] if "streaming" in args else []))
    assert_one_line_error(result, *fragments)


def test_an_export_and_its_results_folder_give_the_same_heads(models, tmp_path):
    """analyze -> export --format duo-attention -> ablate --method streaming --pattern: the exported folder and the
    results folder it came from choose the same heads with the run's S and W."""
    source = models["llama-gqa"].source
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["The bridge was painted by two workers in the early spring of last year ."] * 10),
                      encoding="utf-8")
    results, duo = tmp_path / "run", tmp_path / "duo"
    assert run("analyze", "--model", source, "--corpus", corpus, "--out", results, "--sink-tokens", 2, "--window", 3,
               "--resamples", 20, "--threads", 1).exit_code == 0
    assert run("export", "--out", results, "--format", "duo-attention", "--to", duo).exit_code == 0
    exported, analyzed = sh.read_pattern(duo), sh.read_pattern(results)
    np.testing.assert_allclose(exported.scores, analyzed.scores, rtol=0, atol=1e-12)  # np.savetxt's %.18e
    assert (exported.sink, exported.recent) == (analyzed.sink, analyzed.recent) == (2, 3)
    out = tmp_path / "streaming"
    result = run("ablate", "--model", source, "--corpus", corpus, "--out", out, "--method", "streaming", "--pattern",
                 duo, "--no-pruning", "--resamples", 20, "--client", "duo-attention", "--task", "text")
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "streaming.json").read_text())
    assert (recorded["sink_size"], recorded["recent_size"], recorded["kv_heads_streaming"]) == (2, 3, 2)
    want = sh.first_share(sh.ranked(analyzed.scores), 0.5, 2, 2)
    assert recorded["streaming_heads"] == [f"L{layer}H{head}" for layer, head in zip(*np.nonzero(want))]
    assert pd.read_csv(out / "streaming.csv")["order"].tolist() == ["chosen"]


def test_ten_sequences_or_more_resample_sequences(models, tmp_path):
    """From 10 sequences the measure keeps sums only; the means are those of every token's values."""
    loaded = models["gpt2"]
    path = tmp_path / "twelve.txt"
    path.write_text("\n".join(SENTENCES + SENTENCES[:4]) + "\n", encoding="utf-8")
    result = sh.streaming_ablate_loaded(loaded, read_corpus(path), client="duo-attention",
                                        heads=[(0, 1), (2, 3)], sink=1, recent=2,
                                        curve=False, batch_size=5, resamples=100)
    basis = result.run["bootstrap"]["per_task"]["text"]
    assert basis["method"] == "poisson" and basis["over"] == "sequences"
    from attnprobe.batching import tokenize

    batches = ab.make_batches(loaded, tokenize(loaded, read_corpus(path)).ids, 5)
    mask = np.zeros((3, 4), dtype=bool)
    mask[0, 1] = mask[2, 3] = True
    every, counts = sh.measure(loaded, ab.find_stack(loaded), batches, [mask], 1, 2, every_token=True)
    pooled = np.concatenate(list(every.values()), axis=-1).mean(-1)[:, 0]  # [measure]
    row = result.curve.iloc[0]
    np.testing.assert_allclose([row[name] for name in sh.MEASURES], pooled, rtol=1e-12, atol=1e-15)
    assert counts == {i: v.shape[-1] for i, v in every.items()}


@pytest.mark.parametrize("n", [1, 7, 100, 1000])
@pytest.mark.parametrize("cells", [1, 30, 5000, 10**7])
def test_blocks_cover_the_rows_each_within_the_budget(n, cells):
    """streamheads.blocks: consecutive blocks from row 0 to n; a causal block of rows [q0, q1) sees q1 keys, and holds
    at most `cells` rows x keys unless it is one row; each takes as many rows as fit (the next row would not)."""
    unit = 2 * 3 * 4 * kernel.blocked.TEMPORARIES  # batch 2, 3 heads
    found = sh.blocks(2, 3, n, cells * unit, None)
    assert found[0][0] == 0 and found[-1][1] == n and all(a[1] == b[0] for a, b in zip(found, found[1:]))
    for q0, q1 in found:
        rows = q1 - q0
        assert rows == 1 or rows * q1 <= cells
        assert q1 == n or (rows + 1) * (q1 + 1) > cells  # no room for one more row
    windowed = sh.blocks(2, 3, n, cells * unit, 4)  # a window of 4: kernel.block_size's rows, all alike
    assert len({q1 - q0 for q0, q1 in windowed[:-1]}) <= 1 and windowed[-1][1] == n
