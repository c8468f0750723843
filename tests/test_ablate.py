"""`attnprobe ablate`: head ablation against independent oracles, gradient importance, pruning, the CLI."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES, bundled_sentences, make_bert, make_gpt2, make_llama
from test_cli import assert_one_line_error, run

from attnprobe import ablate as ab
from attnprobe.batching import tokenize
from attnprobe.corpus import read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model


def make_llama_lm(folder: Path) -> Path:
    """make_llama's tiny grouped-query Llama (4 query heads, 2 KV heads), saved with a seeded LM head."""
    from transformers import LlamaForCausalLM

    make_llama(folder)
    torch.manual_seed(1)
    LlamaForCausalLM.from_pretrained(folder).save_pretrained(folder)  # the missing lm_head is drawn once, here
    return folder


def atol(*operands) -> float:
    """The float32 bound on a difference of results that two kernels computed: 1e-5 relative to each operand's
    magnitude (a loss change of 1.4 between losses of ~7 nats agrees to ~1.4e-4, not to 1e-5; cosine distances and
    KLs, whose operands are log-probabilities of that size, likewise)."""
    return FLOAT32_TOLERANCE * sum(max(1.0, float(np.max(np.abs(x)))) for x in operands)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("ablate-corpus") / "c.txt"
    path.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return read_corpus(path)


@pytest.fixture(scope="module")
def gpt2_lm(tmp_path_factory):
    return load_model(str(make_gpt2(tmp_path_factory.mktemp("gpt2-lm"))), "cpu", lm_head=True)


@pytest.fixture(scope="module")
def llama_lm(tmp_path_factory):
    return load_model(str(make_llama_lm(tmp_path_factory.mktemp("llama-lm"))), "cpu", lm_head=True)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return load_model(str(make_bert(tmp_path_factory.mktemp("bert-abl"))), "cpu", lm_head=True)


def projection_weight(loaded, layer: int) -> torch.Tensor:
    return ab.find_stack(loaded).projections[layer].weight


def head_slice(loaded, weight: torch.Tensor, head: int) -> tuple:
    """The part of the output projection's weight that reads head `head`: GPT-2's Conv1D weight is [in, out]
    (rows), nn.Linear's [out, in] (columns)."""
    d = loaded.head_dim
    rows = slice(head * d, (head + 1) * d)
    return (rows, slice(None)) if loaded.model.config.model_type == "gpt2" else (slice(None), rows)


@contextmanager
def edited(tensor: torch.Tensor, edit):
    """Change a weight in place for the duration of the block, then put it back exactly."""
    saved = tensor.detach().clone()
    with torch.no_grad():
        edit(tensor)
    try:
        yield
    finally:
        with torch.no_grad():
            tensor.copy_(saved)


def oracle_log_probs(loaded, ids) -> list[torch.Tensor]:
    """Next-token log-probabilities of each sentence run alone (no padding, no hooks, the model's own attention)."""
    out = []
    with torch.inference_mode():
        for tokens in ids:
            x = torch.tensor([list(tokens)], dtype=torch.long)  # [1, seq]
            logits = loaded.lm_head(loaded.model(input_ids=x).last_hidden_state)[0, :-1]  # [seq - 1, vocab]
            out.append(torch.log_softmax(logits.double(), dim=-1))  # [seq - 1, vocab]
    return out


def oracle_losses(loaded, ids) -> np.ndarray:
    """Mean next-token loss of each sentence run alone."""
    return np.array([-lp.gather(-1, torch.tensor(list(t[1:]), dtype=torch.long)[:, None]).mean().item()
                     for lp, t in zip(oracle_log_probs(loaded, ids), ids)])


def oracle_kl(before: list[torch.Tensor], after: list[torch.Tensor]) -> np.ndarray:
    """Per sentence, the mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), written out."""
    return np.array([(b.exp() * (b - a)).sum(-1).mean().item() for b, a in zip(before, after)])


def oracle_embeddings(loaded, ids) -> list[torch.Tensor]:
    with torch.inference_mode():
        inputs = [torch.tensor([list(t)], dtype=torch.long) for t in ids]  # [1, seq] each
        return [loaded.model(input_ids=x).last_hidden_state[0] for x in inputs]  # [seq, hidden] each


def measured(loaded, corpus, targets, *, method="zero", batch_size=3, **kwargs):
    stack = ab.find_stack(loaded)
    ids = tokenize(loaded, corpus).ids
    batches = ab.make_batches(loaded, ids, batch_size)
    with ab.fast_attention(loaded.model):
        fill = ab.head_fill(loaded, stack, batches, method)
        return ab.measure(loaded, stack, batches, targets, fill, **kwargs), ids


# ---- ablation against zeroed weights -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt2_lm", "llama_lm"])
def test_ablating_a_head_equals_zeroing_the_weights_that_read_it(model, corpus, request):
    loaded = request.getfixturevalue(model)
    if model == "llama_lm":
        assert loaded.num_kv_heads < loaded.num_heads  # grouped-query attention: a query head alone
    heads = [(0, 0), (0, loaded.num_heads - 1), (loaded.num_layers - 1, 1)]
    values, ids = measured(loaded, corpus, [(layer, (head,)) for layer, head in heads])
    before, maps_before = oracle_losses(loaded, ids), oracle_log_probs(loaded, ids)
    for k, (layer, head) in enumerate(heads):
        weight = projection_weight(loaded, layer)
        where = head_slice(loaded, weight, head)
        with edited(weight, lambda w, where=where: w[where].zero_()):
            after, maps_after = oracle_losses(loaded, ids), oracle_log_probs(loaded, ids)
        np.testing.assert_allclose(values["loss_change"][:, k], after - before, rtol=0, atol=atol(before, after))
        np.testing.assert_allclose(values["kl"][:, k], oracle_kl(maps_before, maps_after), rtol=0,
                                   atol=atol(before, after))
        assert np.abs(after - before).max() > 1e-3  # the head does something: the test can fail


def test_mean_ablation_equals_moving_the_head_mean_into_the_bias(gpt2_lm, corpus):
    loaded, layer, head = gpt2_lm, 1, 2
    values, ids = measured(loaded, corpus, [(layer, (head,))], method="mean")
    stack = ab.find_stack(loaded)
    batches = ab.make_batches(loaded, ids, 3)
    mean = ab.head_means(loaded, stack, batches)[layer, head]  # [head_dim]
    projection = stack.projections[layer]
    where = head_slice(loaded, projection.weight, head)
    with torch.no_grad():
        shift = mean @ projection.weight[where]  # [hidden]: what the mean output adds (Conv1D: x @ W + b)
    before = oracle_losses(loaded, ids)
    with edited(projection.bias, lambda b: b.add_(shift)), edited(projection.weight, lambda w: w[where].zero_()):
        after = oracle_losses(loaded, ids)
    np.testing.assert_allclose(values["loss_change"][:, 0], after - before, rtol=0, atol=atol(before, after))


@pytest.mark.parametrize("model", ["gpt2_lm", "llama_lm"])
def test_ablating_every_head_of_a_layer_equals_the_layer_ablation(model, corpus, request):
    loaded = request.getfixturevalue(model)
    layer, every = 1, tuple(range(loaded.num_heads))
    values, ids = measured(loaded, corpus, [(layer, every)])
    before = oracle_losses(loaded, ids)
    with edited(projection_weight(loaded, layer), lambda w: w.zero_()):  # every head's weights (a bias stays)
        after = oracle_losses(loaded, ids)
    np.testing.assert_allclose(values["loss_change"][:, 0], after - before, rtol=0, atol=atol(before, after))
    stack = ab.find_stack(loaded)  # the pruning path: every head of the layer removed, whole network rerun
    mask = np.zeros((loaded.num_layers, loaded.num_heads), dtype=bool)
    mask[layer] = True
    batches = ab.make_batches(loaded, ids, 3)
    with ab.fast_attention(loaded.model), torch.inference_mode():
        pruned = ab.prune_passes(loaded, stack, batches, [mask], ab.zero_fill(loaded, stack))
    np.testing.assert_allclose(pruned["loss_change"][:, 0], values["loss_change"][:, 0], rtol=0,
                               atol=atol(before, after))
    np.testing.assert_allclose(pruned["kl"][:, 0], values["kl"][:, 0], rtol=0, atol=atol(before, after))


def test_the_layers_option_adds_one_row_per_layer_equal_to_all_its_heads(gpt2_lm, corpus):
    result = ab.ablate_loaded(gpt2_lm, corpus, layers=True, heads=[(0, 1)], resamples=50, pruning=False)
    assert list(result.layers["layer"]) == [0, 1, 2]
    every = [(1, tuple(range(gpt2_lm.num_heads)))]
    values, ids = measured(gpt2_lm, corpus, every, batch_size=8)
    before = oracle_losses(gpt2_lm, ids)
    assert result.layers.loc[1, "loss_change"] == pytest.approx(np.nanmean(values["loss_change"][:, 0]),
                                                                abs=atol(before, before + values["loss_change"]))
    assert len(result.heads) == 1 and result.pruning is None


def test_a_head_with_a_zero_projection_has_importance_zero_and_kl_zero(gpt2_lm, corpus):
    weight = projection_weight(gpt2_lm, 1)
    where = head_slice(gpt2_lm, weight, 2)
    with edited(weight, lambda w: w[where].zero_()):
        result = ab.ablate_loaded(gpt2_lm, corpus, resamples=50, pruning=False)
    row = result.heads.set_index(["layer", "head"]).loc[(1, 2)]
    # The gradient through a zero weight slice is 0 exactly (0 times a finite number) on any CPU. The loss and the
    # KL come from two forward passes, the ablated one resumed from a stored layer: equal only to float32's bound
    # (a loss of ~7 nats to 1e-5 relative, twice; the KL, first-order zero, to 1e-6; AMD EPYC gives KL 1.5e-10).
    assert row["gradient_importance"] == 0.0
    assert max(abs(row["kl"]), abs(row["kl_ci_low"]), abs(row["kl_ci_high"])) <= 1e-6
    before = oracle_losses(gpt2_lm, tokenize(gpt2_lm, corpus).ids)
    assert abs(row["loss_change"]) <= atol(before, before)
    others = result.heads.drop(result.heads.index[(result.heads["layer"] == 1) & (result.heads["head"] == 2)])
    assert (others["gradient_importance"] > 0).all() and (others["kl"] > 0).all()


# ---- the restart at layer l equals the whole network ---------------------------------------------------


@pytest.mark.parametrize("model", ["gpt2_lm", "llama_lm", "bert"])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_reusing_the_lower_layers_equals_full_recomputation(model, method, corpus, request):
    loaded = request.getfixturevalue(model)
    targets = [(layer, (head,)) for layer in range(loaded.num_layers) for head in range(loaded.num_heads)]
    targets.append((1, tuple(range(loaded.num_heads))))
    reused, ids = measured(loaded, corpus, targets, method=method)
    assert len({len(t) for t in ids}) > 3  # batches of 3 mix lengths: right padding is exercised
    full, _ = measured(loaded, corpus, targets, method=method, reuse=False)
    one_at_a_time, _ = measured(loaded, corpus, targets, method=method, group=1, batch_size=1)
    before = oracle_losses(loaded, ids)[:, None] if loaded.causal else np.ones(1)  # encoders: cosines, scale 1
    for name in reused:
        assert not np.isnan(reused[name]).any()
        np.testing.assert_allclose(reused[name], full[name], rtol=0, atol=atol(before, before + reused[name]))
        np.testing.assert_allclose(reused[name], one_at_a_time[name], rtol=0, atol=atol(before, before + reused[name]))


def test_ablate_leaves_the_attention_implementation_as_it_was(gpt2_lm, corpus):
    ab.ablate_loaded(gpt2_lm, corpus, heads=[(0, 0)], resamples=20, pruning=False)
    assert gpt2_lm.model.config._attn_implementation == "eager"


# ---- gradient importance -------------------------------------------------------------------------------


# GPT-2 runs wholly in float64. Llama's RMSNorm computes in float32 whatever the model's dtype, so its central
# difference needs a larger step (float32 noise / eps) and gets a looser tolerance; a 5% error still fails.
@pytest.mark.parametrize(("make", "eps", "rtol", "atol"), [(make_gpt2, 1e-5, 1e-5, 1e-9),
                                                           (make_llama_lm, 1e-3, 2e-3, 2e-4)])
def test_gradient_importance_equals_finite_differences(make, eps, rtol, atol, corpus, tmp_path):
    loaded = load_model(str(make(tmp_path / "m")), "cpu", lm_head=True)
    loaded.model.double()
    loaded.lm_head.double()
    stack = ab.find_stack(loaded)
    batches = ab.make_batches(loaded, tokenize(loaded, corpus).ids, 3)
    grads = ab.gradient_importance(loaded, stack, batches)  # [sentence, layer, head]
    for batch in batches:
        for layer, head in [(0, 1), (1, 3), (loaded.num_layers - 1, 0)]:
            gates = torch.ones(len(batch.indices), loaded.num_layers, loaded.num_heads, dtype=torch.float64)
            up, down = gates.clone(), gates.clone()
            up[:, layer, head] += eps
            down[:, layer, head] -= eps
            with torch.inference_mode():
                slope = (ab.gated_objective(loaded, stack, batch, up)
                         - ab.gated_objective(loaded, stack, batch, down)) / (2 * eps)  # [batch]
            np.testing.assert_allclose(grads[batch.indices, layer, head], slope.abs().numpy(), rtol=rtol, atol=atol)


def test_encoder_gradient_is_the_probed_norm_of_the_embedding_jacobian(corpus, tmp_path):
    """importance = sqrt(mean over probes v of (v . d unit_embedding / d gate)^2), with the Jacobian column from a
    central difference (float64) and the same probes: exact, whatever their number. E[(v . j)^2] = |j|^2."""
    bert = load_model(str(make_bert(tmp_path / "b")), "cpu")
    bert.model.double()
    stack = ab.find_stack(bert)
    batches = ab.make_batches(bert, tokenize(bert, corpus).ids, 8)
    grads = ab.gradient_importance(bert, stack, batches, seed=3)  # [sentence, layer, head]
    batch, eps = batches[0], 1e-5
    probes = ab.probe_vectors(torch.Generator().manual_seed(3), len(batch.indices), 32).double()  # the first batch's

    def unit_embedding(gates):  # [batch, hidden]: the mean-pooled final states, normalised
        hooks = [ab.gate_hook(stack, gates[:, layer]) for layer in range(bert.num_layers)]
        with ab.hooked(stack.projections, hooks), torch.inference_mode():
            final = bert.model(input_ids=batch.input_ids, attention_mask=batch.mask).last_hidden_state
        real = batch.mask[..., None].double()  # [batch, seq, 1]
        pooled = (final * real).sum(1) / real.sum(1)  # [batch, hidden]
        return pooled / pooled.norm(dim=-1, keepdim=True)

    for layer, head in [(0, 0), (1, 2)]:
        up = torch.ones(len(batch.indices), bert.num_layers, bert.num_heads, dtype=torch.float64)
        down = up.clone()
        up[:, layer, head] += eps
        down[:, layer, head] -= eps
        column = (unit_embedding(up) - unit_embedding(down)) / (2 * eps)  # [batch, hidden]
        expected = (probes * column).sum(-1).square().mean(0).sqrt()  # [batch]
        np.testing.assert_allclose(grads[batch.indices, layer, head], expected.numpy(), rtol=1e-6)
        assert expected.min() > 1e-3


def test_spearman_matches_the_rank_formula():
    a = np.array([0.1, 0.5, 0.3, 0.9, 0.7])
    b = np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    assert ab.spearman(a, b) == pytest.approx(1.0)
    assert ab.spearman(a, -b) == pytest.approx(-1.0)
    c = np.array([2.0, 1.0, 4.0, 3.0, 5.0])  # d = ranks(a) - ranks(c) = (-1, 2, -2, 2, -1): 1 - 6*14/120 = 0.3
    assert ab.spearman(a, c) == pytest.approx(0.3)
    assert ab.spearman(np.array([1.0, np.nan]), np.array([1.0, 2.0])) is None


# ---- encoders ------------------------------------------------------------------------------------------


def test_encoder_measures_equal_zeroed_weights_on_a_tiny_bert(bert, corpus):
    layer, head = 1, 2
    values, ids = measured(bert, corpus, [(layer, (head,))])
    before = oracle_embeddings(bert, ids)
    weight = projection_weight(bert, layer)
    with edited(weight, lambda w: w[head_slice(bert, weight, head)].zero_()):
        after = oracle_embeddings(bert, ids)
    cos = torch.nn.functional.cosine_similarity
    pooled = [1 - cos(a.mean(0), b.mean(0), dim=0).item() for a, b in zip(after, before)]
    tokens = [(1 - cos(a, b, dim=-1)).mean().item() for a, b in zip(after, before)]
    np.testing.assert_allclose(values["embedding_change"][:, 0], pooled, rtol=0, atol=atol(1.0, 1.0))  # cosines
    np.testing.assert_allclose(values["hidden_change"][:, 0], tokens, rtol=0, atol=atol(1.0, 1.0))
    assert min(pooled) > 1e-4


def test_minilm_ablation(minilm, tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(bundled_sentences(8)) + "\n", encoding="utf-8")
    result = ab.ablate_loaded(minilm, read_corpus(path), resamples=200, layers=True)
    heads = result.heads
    assert len(heads) == 6 * 12 and "loss_change" not in heads.columns
    for name in ("embedding_change", "hidden_change"):
        assert heads[name].between(-1e-6, 2).all()
        assert (heads[f"{name}_ci_low"] <= heads[name] + 1e-9).all()
        assert (heads[name] <= heads[f"{name}_ci_high"] + 1e-9).all()
    assert (heads["gradient_importance"] > 0).all()
    assert sorted(heads["rank"]) == list(range(1, 73))
    assert heads.loc[heads["rank"] == 1, "embedding_change"].item() == heads["embedding_change"].max()
    assert -1 <= result.run["spearman"] <= 1 and not result.run["model"]["causal"]
    curve = result.pruning
    assert set(curve["order"]) == {"ablation", "gradient", "random"}
    assert curve.loc[curve["percent"] == 0, "embedding_change"].abs().max() < 1e-5
    everything = curve.loc[curve["percent"] == 100, "embedding_change"]
    assert everything.nunique() == 1 and everything.iloc[0] > heads["embedding_change"].max()
    assert (result.layers["embedding_change"] > 0).all()
    assert minilm.model.config._attn_implementation == "eager"


# ---- settings and the command line ---------------------------------------------------------------------


def test_parse_and_check_heads():
    assert ab.parse_heads("all") is None
    assert ab.parse_heads(" 0.1, 2.3,0.1") == [(0, 1), (2, 3)]
    assert ab.parse_heads("L0H1,l2h3") == [(0, 1), (2, 3)]
    for bad in ("3.x", "3", "1.2.3", "-1.0", ""):
        with pytest.raises(AttnprobeError, match="--heads"):
            ab.parse_heads(bad)
    assert ab.check_heads(None, 2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(AttnprobeError, match="layers 0-1 and heads 0-1"):
        ab.check_heads([(2, 0)], 2, 2)


def test_cli_ablate_writes_files_and_plot_draws_them(gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 50)
    assert result.exit_code == 0, result.output
    for name in ("importance.csv", "pruning.csv", "ablate.json", "importance.png"):
        assert (out / name).is_file(), name
    importance = pd.read_csv(out / "importance.csv")
    measures = [f"{m}{s}" for m in ("loss_change", "kl") for s in ("", "_ci_low", "_ci_high")]
    assert list(importance.columns) == ["layer", "head", *measures, "gradient_importance", "rank"]
    assert len(importance) == 12
    pruning = pd.read_csv(out / "pruning.csv")
    assert list(pruning["order"].unique()) == ["ablation", "kl", "gradient", "random"]
    assert len(pruning) == 4 * 11 and list(pruning["percent"].unique()) == list(range(0, 101, 10))
    assert pruning.loc[pruning["percent"] == 100, "heads_removed"].eq(12).all()
    info = json.loads((out / "ablate.json").read_text())
    assert info["method"] == "zero" and len(info["corpus"]["sha256"]) == 64 and info["wall_seconds"] > 0
    assert isinstance(info["spearman"], float) and not math.isnan(info["spearman"])
    again = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                "--resamples", 50, "--heads", "L0H1,2.3", "--layers", "--method", "mean", "--no-pruning")
    assert again.exit_code == 0, again.output
    assert len(pd.read_csv(out / "importance.csv")) == 2 and (out / "layer_importance.csv").is_file()
    assert not (out / "pruning.csv").exists()  # not made by this run
    assert run("analyze", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu").exit_code == 0
    plotted = run("plot", "--out", out)
    assert plotted.exit_code == 0, plotted.output
    assert (out / "importance_vs_type.png").stat().st_size > 0 and (out / "importance.png").stat().st_size > 0


def test_cli_ablate_an_encoder(bert_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("ablate", "--model", bert_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--resamples", 20, "--no-pruning")
    assert result.exit_code == 0, result.output
    importance = pd.read_csv(out / "importance.csv")
    assert "embedding_change" in importance.columns and "kl" not in importance.columns


@pytest.mark.parametrize(("heads", "fragment"), [("0.x", "is not a head"), ("L7H0", "layers 0-2 and heads 0-3")])
def test_cli_ablate_bad_heads_is_one_line(heads, fragment, gpt2_dir, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", out, "--device", "cpu",
                 "--heads", heads)
    assert_one_line_error(result, "--heads", fragment)
    assert not out.exists()


def test_cli_ablate_bad_settings_are_one_line(gpt2_dir, corpus_file, tmp_path):
    result = run("ablate", "--model", gpt2_dir, "--corpus", corpus_file, "--out", tmp_path / "o", "--batch-size", 0)
    assert_one_line_error(result, "--batch-size 0")


def test_fast_attention_keeps_a_soft_capping_models_own_attention(tmp_path):
    """SDPA cannot apply attention-logit soft-capping; transformers 5.17 still let Gemma 2 switch to it and dropped the
    soft-capping (its logits moved by 0.67 on this tiny model). Inside fast_attention the model's logits stay its
    eager logits, whichever release is installed."""
    from zoo import make

    loaded = load_model(str(make("gemma2", tmp_path / "gemma2", lm_head=True)), "cpu", "float32", lm_head=True)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    with torch.no_grad():
        want = loaded.lm_head(loaded.model(input_ids=ids).last_hidden_state)  # [1, seq, vocab]
        with ab.fast_attention(loaded.model):
            got = loaded.lm_head(loaded.model(input_ids=ids).last_hidden_state)  # [1, seq, vocab]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
