"""Composition scores: planted heads in closed form, the random baseline against dense products, TransformerLens 4.3's
scores of two tiny models (a committed fixture, and live where transformer_lens imports), and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_cli import assert_one_line_error, run

from attnprobe.composition import (
    MODES,
    HeadWeights,
    compose,
    compose_loaded,
    compose_weights,
    composition_scores,
    random_baseline,
)
from attnprobe.model import load_model

DATA = Path(__file__).parent / "data" / "composition"
FIXTURE = json.loads((DATA / "tl_scores.json").read_text(encoding="utf-8"))
EPS32 = float(np.finfo(np.float32).eps)


def tolerance(d_model: int) -> float:
    """TransformerLens computes in float32: each score is a ratio of three Frobenius norms of products whose inner
    sums run over at most d_model terms, each off by at most d_model float32 roundings of its size; a score is at
    most 1, so 2 d_model eps bounds the difference from attnprobe's float64 (7.6e-6 at d_model 32)."""
    return 2 * d_model * EPS32


def tl_array(name: str, mode: str) -> np.ndarray:
    return np.asarray(FIXTURE["models"][name][mode], dtype=np.float64)  # [layer, head, layer, head]


def compare_with_tl(scores: np.ndarray, tl: np.ndarray, d_model: int) -> None:
    """attnprobe's scores (NaN where the receiver is not later) against TransformerLens' (0 there)."""
    layers = scores.shape[0]
    later = np.arange(layers)[:, None, None, None] < np.arange(layers)[None, None, :, None]  # [L, 1, L, 1]
    later = np.broadcast_to(later, scores.shape)
    assert np.isnan(scores[~later]).all() and (tl[~later] == 0).all()
    np.testing.assert_allclose(scores[later], tl[later], rtol=0, atol=tolerance(d_model))


# ---- closed form: planted heads --------------------------------------------------------------------------------


def unit(d: int, i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), d).double()  # [d]


def planted_weights(d: int = 16, k: int = 4) -> HeadWeights:
    """Two layers of two heads, random but for the planted ones: L0H0 writes u -> v (OV = u v^T); L1H0 reads v with
    its queries (QK = v z^T) and with its values; L1H1 reads w (orthogonal to v) with queries, keys and values."""
    torch.manual_seed(0)
    shape = (2, 2, d, k)
    w_q, w_k, w_v = (torch.randn(shape, dtype=torch.float64) for _ in range(3))  # [layer, head, d, k] each
    w_o = torch.randn(2, 2, k, d, dtype=torch.float64)  # [layer, head, k, d]
    u, v, w, z = (unit(d, i) for i in range(4))
    w_v[0, 0], w_o[0, 0] = 0, 0
    w_v[0, 0][:, 0], w_o[0, 0][0] = u, v  # OV = u v^T
    for head, reads in ((0, v), (1, w)):
        w_q[1, head], w_k[1, head], w_v[1, head] = 0, 0, 0
        w_q[1, head][:, 1], w_k[1, head][:, 1], w_v[1, head][:, 2] = reads, z, reads  # QK = reads z^T
    return HeadWeights(w_q, w_k, w_v, w_o, kv_heads=2, norm="rmsnorm")


def test_planted_heads_compose_with_score_one_and_orthogonal_ones_with_zero():
    weights = planted_weights()
    q, k, v = (composition_scores(weights, mode) for mode in MODES)  # [L, H, L, H] each
    assert q[0, 0, 1, 0] == pytest.approx(1.0, abs=1e-12)  # writes v, the queries read v
    assert q[0, 0, 1, 1] == pytest.approx(0.0, abs=1e-12)  # the queries read w, orthogonal to v
    assert k[0, 0, 1, 0] == pytest.approx(0.0, abs=1e-12)  # the keys read z, orthogonal to v
    assert v[0, 0, 1, 0] == pytest.approx(1.0, abs=1e-12)
    assert v[0, 0, 1, 1] == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(q[1].numpy()).all() and np.isnan(q[:, :, 0].numpy()).all()  # no later receiver
    assert 0.0 < q[0, 1, 1, 0] < 1.0  # a random sender reads partly into the planted receiver


def test_scores_equal_dense_products_in_float64():
    """The factored norms against |W_V W_O W_Q W_K^T| built at d_model x d_model, per mode."""
    torch.manual_seed(1)
    layers, heads, d, k = 3, 2, 12, 3
    w_q, w_k, w_v = (torch.randn(layers, heads, d, k, dtype=torch.float64) for _ in range(3))
    w_o = torch.randn(layers, heads, k, d, dtype=torch.float64)
    weights = HeadWeights(w_q, w_k, w_v, w_o, kv_heads=heads, norm="layernorm")
    ov = w_v @ w_o  # [L, H, d, d]
    qk = w_q @ w_k.transpose(-1, -2)  # [L, H, d, d]
    right = {"Q": qk, "K": qk.transpose(-1, -2), "V": ov}
    for mode in MODES:
        scores = composition_scores(weights, mode)
        for s_layer, s_head, r_layer, r_head in np.ndindex(layers, heads, layers, heads):
            if r_layer <= s_layer:
                continue
            a, b = ov[s_layer, s_head], right[mode][r_layer, r_head]
            dense = torch.linalg.matrix_norm(a @ b) / torch.linalg.matrix_norm(a) / torch.linalg.matrix_norm(b)
            assert scores[s_layer, s_head, r_layer, r_head] == pytest.approx(float(dense), rel=1e-12)


def test_baseline_equals_dense_random_products_and_about_one_over_root_d():
    d, k, samples = 48, 6, 64
    baseline = random_baseline(d, k, samples=samples, seed=3)
    draws = torch.randn((samples, 4, d, k), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a, b, c, e = draws.unbind(1)  # as random_baseline draws them
    left, right = a @ b.transpose(-1, -2), c @ e.transpose(-1, -2)  # [sample, d, d] each
    dense = (torch.linalg.matrix_norm(left @ right) / torch.linalg.matrix_norm(left)
             / torch.linalg.matrix_norm(right))  # [sample]
    assert baseline["mean"] == pytest.approx(float(dense.mean()), rel=1e-12)
    assert baseline["sd"] == pytest.approx(float(dense.std()), rel=1e-10)
    # |A B C D|^2 / (|A B|^2 |C D|^2) has expectation about 1 / d for Gaussian factors, whatever k
    assert baseline["mean"] == pytest.approx(d ** -0.5, rel=0.2)
    assert random_baseline(d, k, samples=8, seed=3)["mean"] == random_baseline(d, k, samples=8, seed=3)["mean"]


def test_baseline_in_chunks_is_the_same_distribution(monkeypatch):
    """A large model's baseline is drawn a few samples at a time (memory stays bounded): the same mean within its
    sampling error."""
    from attnprobe import composition

    whole = random_baseline(32, 4, samples=300, seed=0)
    monkeypatch.setattr(composition, "BASELINE_ELEMENTS", 4 * 32 * 4 * 7)  # 7 samples a chunk
    chunked = random_baseline(32, 4, samples=300, seed=0)
    assert chunked["samples"] == 300
    assert abs(chunked["mean"] - whole["mean"]) < 5 * whole["sd"] / 300 ** 0.5


def test_one_layer_is_refused():
    weights = planted_weights()
    one = HeadWeights(*(w[:1] for w in (weights.w_q, weights.w_k, weights.w_v, weights.w_o)), kv_heads=2,
                      norm="rmsnorm")
    with pytest.raises(Exception, match="two different layers"):
        compose_weights(one)


# ---- TransformerLens 4.3 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_models() -> dict:
    return {name: load_model(str(DATA / name), "cpu", "float32") for name in ("gpt2", "llama")}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_scores_equal_transformerlens_fixture(fixture_models, name):
    """TransformerLens 4.3's all_composition_scores after HookedTransformer's processing (fold_ln,
    center_writing_weights), recorded by tests/data/composition/make_fixture.py: GPT-2 (LayerNorm folded and
    centred, W_O centred) and Llama (RMSNorm folded, 4 query heads on 2 KV heads)."""
    loaded = fixture_models[name]
    result = compose_loaded(loaded)
    assert result.info["norm"] == {"gpt2": "layernorm", "llama": "rmsnorm"}[name]
    assert (result.info["gqa"] is not None) == (name == "llama")
    for m, mode in enumerate(MODES):
        compare_with_tl(result.scores[m], tl_array(name, mode), result.info["d_model"])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_fixture_tells_folding_apart(fixture_models, name):
    """Without folding the norms (their weights set to 1, biases 0) the scores miss TransformerLens' by far more
    than the tolerance: the fixture would catch a folding left out."""
    model = fixture_models[name].model
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    try:
        with torch.no_grad():
            for module in model.modules():
                if "Norm" in type(module).__name__:
                    module.weight.fill_(1.0)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
        unfolded = compose_loaded(fixture_models[name])
    finally:
        model.load_state_dict(saved)
    tl = tl_array(name, "Q")
    later = np.isfinite(unfolded.scores[0])
    assert np.abs(unfolded.scores[0][later] - tl[later]).max() > 1000 * tolerance(32)


def fresh_models(folder: Path) -> list[Path]:
    """A tiny GPT-2 and a tiny Llama of other shapes than the fixture's (and 2 query heads per KV head), their
    norms' weights and biases random, saved as causal LMs with make_fixture.py's tokenizer."""
    import importlib.util

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("make_fixture", DATA / "make_fixture.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    torch.manual_seed(7)
    made = []
    for name, build in (("gpt2", lambda vocab: GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab, n_positions=16, n_embd=48, n_layer=4, n_head=6, n_inner=64, initializer_range=0.2))),
                        ("llama", lambda vocab: LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=16, initializer_range=0.2)))):
        target = folder / name
        model = build(maker.save_tokenizer(target))
        maker.randomise_norms(model)
        model.save_pretrained(target)
        made.append(target)
    return made


def test_live_transformerlens(tmp_path):
    """TransformerLens itself, where it imports (it is not an attnprobe dependency: see make_fixture.py for its
    virtualenv), on the fixture models and a fresh GPT-2 and Llama of other shapes."""
    pytest.importorskip("transformer_lens", reason="transformer_lens is not installed (make_fixture.py says how)")
    from transformer_lens.model_bridge import TransformerBridge

    for folder in (DATA / "gpt2", DATA / "llama", *fresh_models(tmp_path)):
        bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32)
        bridge.enable_compatibility_mode(disable_warnings=True)
        result = compose_loaded(load_model(str(folder), "cpu", "float32"))
        for m, mode in enumerate(MODES):
            tl = bridge.all_composition_scores(mode).scores.detach().double().numpy()
            compare_with_tl(result.scores[m], tl, result.info["d_model"])


# ---- the command -----------------------------------------------------------------------------------------------


def test_cli_writes_the_scores_the_record_and_the_figure(tmp_path):
    out = tmp_path / "out"
    result = run("compose", "--model", DATA / "llama", "--out", out, "--top", "5", "--samples", "20")
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "composition.csv")
    assert list(table.columns) == ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "mode", "score",
                                   "baseline", "baseline_sd"]
    pairs = 4 * 4 * 3  # 3 layers of 4 heads: (0 -> 1), (0 -> 2), (1 -> 2)
    assert len(table) == 3 * pairs and (table["sender_layer"] < table["receiver_layer"]).all()
    for mode in MODES:
        rows = table[table["mode"] == mode]
        got = rows["score"].to_numpy()
        tl = tl_array("llama", mode)[rows["sender_layer"], rows["sender_head"], rows["receiver_layer"],
                                     rows["receiver_head"]]
        np.testing.assert_allclose(got, tl, rtol=0, atol=tolerance(32))
        assert (np.diff(got) <= 0).all()  # strongest first
    record = json.loads((out / "composition.json").read_text(encoding="utf-8"))
    assert record["norm"] == "rmsnorm" and "repeat" in record["gqa"] and record["baseline"]["samples"] == 20
    assert record["model"]["spec"] == str(DATA / "llama") and len(record["modes"]["Q"]["strongest"]) == 5
    assert (out / "composition.png").stat().st_size > 0
    assert "Strongest composition" in result.stdout and "composition.csv" in result.stdout


@pytest.mark.parametrize("args, fragment", [(["--samples", "1"], "--samples 1"), (["--top", "0"], "--top 0"),
                                            (["--samples", "10000000"], "--samples 10000000")])
def test_cli_bad_settings_are_one_line(tmp_path, args, fragment):
    result = run("compose", "--model", DATA / "llama", "--out", tmp_path, *args)
    assert_one_line_error(result, fragment)


def test_cli_refuses_an_encoder_in_one_line(bert_dir, tmp_path):
    result = run("compose", "--model", bert_dir, "--out", tmp_path)
    assert_one_line_error(result, "pre-norm")


def test_cli_refuses_norms_inside_attention_in_one_line(tmp_path):
    """Qwen3 normalises queries and keys: its circuits are not linear, so no score."""
    from conftest import save_tokenizer
    from transformers import Qwen3Config, Qwen3Model

    folder = tmp_path / "qwen3"
    vocab = save_tokenizer(folder, ["a b c"])
    Qwen3Model(Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(folder)
    result = run("compose", "--model", folder, "--out", tmp_path / "out")
    assert_one_line_error(result, "q_norm")
    assert not (tmp_path / "out" / "composition.csv").exists()



def test_notebook_api_takes_a_name_or_a_loaded_model(fixture_models):
    import attnprobe

    by_path = attnprobe.compose(str(DATA / "gpt2"), samples=10)
    loaded = compose(fixture_models["gpt2"], samples=10)
    np.testing.assert_array_equal(by_path.scores, loaded.scores)
    assert len(by_path.table()) == 3 * 4 * 4 * 3 and by_path.baseline["samples"] == 10
    with pytest.raises(attnprobe.AttnprobeError, match="--samples"):
        attnprobe.compose(fixture_models["gpt2"], samples=1)


def hand_folded(model, scale_of) -> HeadWeights:
    """An independent reading of a Llama-style model's heads: q/k/v/o_proj as [head, d, k] with the pre-attention
    norm's scale `scale_of(norm)` multiplied in, K and V repeated over each group."""
    config = model.config
    heads, kv, k = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    parts = []
    for layer in model.layers:
        attn, scale = layer.self_attn, scale_of(layer.input_layernorm).double()  # [d]
        w_q = (attn.q_proj.weight.double() * scale).reshape(heads, k, -1).transpose(1, 2)  # [head, d, k]
        w_k = (attn.k_proj.weight.double() * scale).reshape(kv, k, -1).transpose(1, 2)  # [kv, d, k]
        w_v = (attn.v_proj.weight.double() * scale).reshape(kv, k, -1).transpose(1, 2)  # [kv, d, k]
        w_o = attn.o_proj.weight.double().T.reshape(heads, k, -1)  # [head, k, d]
        group = heads // kv
        parts.append((w_q, w_k.repeat_interleave(group, 0), w_v.repeat_interleave(group, 0), w_o))
    return HeadWeights(*(torch.stack(p).detach() for p in zip(*parts)), kv_heads=kv, norm="rmsnorm")


def test_gemma_folds_one_plus_its_norm_weight(tmp_path):
    """Gemma's RMSNorm scales by 1 + weight: the scale read from the norm itself, against the hand-folded one."""
    from zoo import make

    loaded = load_model(str(make("gemma", tmp_path / "gemma")), "cpu", "float32")
    with torch.no_grad():
        for layer in loaded.model.layers:
            layer.input_layernorm.weight.copy_(torch.linspace(-0.9, 2.0, layer.input_layernorm.weight.numel()))
    result = compose_loaded(loaded)
    oracle = hand_folded(loaded.model, lambda norm: 1.0 + norm.weight)
    wrong = hand_folded(loaded.model, lambda norm: norm.weight)  # Llama's rule on Gemma's weights
    for m, mode in enumerate(MODES):
        expected = composition_scores(oracle, mode).numpy()
        # the norm's scale is read by running it in float32: each channel's 1 + w and 1 / rms rounded once or twice
        np.testing.assert_allclose(result.scores[m], expected, rtol=4 * EPS32, atol=0)
        assert np.nanmax(np.abs(composition_scores(wrong, mode).numpy() - expected)) > 1e-2


@pytest.mark.parametrize("name, outcome", [("opt", "layernorm"), ("phi", "layernorm"), ("gpt_neox", "q_proj"),
                                           ("gemma2", "pre_feedforward_layernorm"), ("olmo", "pre-attention norm")])
def test_other_families_score_or_are_refused_in_one_line(tmp_path, name, outcome):
    """OPT (out_proj, self_attn_layer_norm) and Phi (dense) score; GPT-NeoX's interleaved query_key_value, Gemma 2's
    norm on the attention output and OLMo's norm without weights are refused, naming why."""
    from zoo import make

    folder = make(name, tmp_path / "model")
    if outcome in ("layernorm", "rmsnorm"):
        result = compose_loaded(load_model(str(folder), "cpu", "float32"))
        assert result.info["norm"] == outcome
        finite = result.scores[np.isfinite(result.scores)]
        assert finite.size == 3 * 4 * 4 and ((finite > 0) & (finite <= 1)).all()  # 2 layers of 4 heads, 3 modes
    else:
        result = run("compose", "--model", folder, "--out", tmp_path / "out")
        assert_one_line_error(result, outcome)


def test_receivers_in_chunks_give_the_same_scores(monkeypatch):
    """A large model's receivers are scored a few at a time (memory stays bounded): the same scores."""
    from attnprobe import composition

    weights = planted_weights()
    whole = composition_scores(weights, "K")
    monkeypatch.setattr(composition, "PAIR_ELEMENTS", 2 * 4 * 4)  # one receiver a chunk for 2 senders of size 4
    # float64 products of other shapes may round differently in the last bits (BLAS picks kernels by shape)
    np.testing.assert_allclose(composition_scores(weights, "K").numpy(), whole.numpy(), rtol=1e-13, atol=1e-15)
