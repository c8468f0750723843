"""Value-weighted scores and output_norm (attnprobe.values) against a float64 computation of our own.

The oracle: transformers' eager maps (output_attentions), the values the model's own value projection computes
(read by a forward hook on it), and the model's own output-projection weights, all in float64: f_h(x_j) =
W_O^h v_j^h at the model's width, a~_ij = a_ij |f_h(x_j)| / sum_k a_ik |f_h(x_k)|, its statistics from
metrics.sentence_stats, and output_norm = mean over real rows of |sum_j a_ij f_h(x_j)|.
"""

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_gpt2, save_tokenizer
from test_blocked import assert_close, corpus_of
from typer.testing import CliRunner

from attnprobe import kernel, values
from attnprobe.analysis import analyze_loaded
from attnprobe.batching import pad_batch
from attnprobe.classify import Thresholds, classify, head_types, output_ratio
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import VALUE_WEIGHTED, bin_count, sentence_stats
from attnprobe.model import forward_kwargs, load_model
from attnprobe.planning import Options
from attnprobe.scores import VW_METRICS

SINK, WINDOW = 1, 3  # small, so that sink_window is defined on the test sentences
PATHS = ("blocked", "fused", "eager")
runner = CliRunner()


# ---- the oracle -----------------------------------------------------------------------------------------------

def value_reader(model, kind: str, layer: int):
    """(module, values from its output [batch, seq, kv heads x head size]) of the model's own value projection."""
    if kind == "gpt2":
        module = model.h[layer].attn.c_attn
        return module, lambda out: out[..., 2 * model.config.n_embd :]
    if kind == "llama":
        return model.layers[layer].self_attn.v_proj, lambda out: out
    return model.encoder.layer[layer].attention.self.value, lambda out: out


def output_slices(model, kind: str, layer: int, heads: int) -> torch.Tensor:
    """W_O^h of every head, [head, width, head size], float64, from the output projection's own weights."""
    if kind == "gpt2":
        weight = model.h[layer].attn.c_proj.weight.t()  # Conv1D keeps [in, out]
    elif kind == "llama":
        weight = model.layers[layer].self_attn.o_proj.weight
    else:
        weight = model.encoder.layer[layer].attention.output.dense.weight
    weight = weight.detach()
    width = weight.shape[0]
    return weight.double().reshape(width, heads, -1).permute(1, 0, 2)  # [head, width, head size]


def oracle(loaded, kind: str, texts: list[str]) -> dict[str, np.ndarray]:
    """Per score [sentence, layer, head]: the value-weighted statistics and output_norm in float64, all texts in
    one right-padded batch."""
    model = loaded.model
    ids = [loaded.tokenizer(t)["input_ids"] for t in texts]
    input_ids, mask = pad_batch(ids, loaded.device)  # [batch, seq] each
    heads, kv_heads = loaded.num_heads, loaded.num_kv_heads
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in range(loaded.num_layers):
        module, pick = value_reader(model, kind, layer)
        hooks.append(module.register_forward_hook(
            lambda _m, _a, out, layer=layer, pick=pick: seen.__setitem__(layer, pick(out).detach())))
    try:
        with torch.inference_mode():
            maps = model(**forward_kwargs(model, input_ids, mask), output_attentions=True).attentions
    finally:
        for hook in hooks:
            hook.remove()
    real = mask.bool()  # [batch, seq]
    result: dict[str, list] = {}
    for layer, p in enumerate(maps):
        batch, _, n, _ = p.shape
        v = seen[layer].double().view(batch, n, kv_heads, -1).transpose(1, 2)  # [batch, kv head, key, head size]
        v = v.repeat_interleave(heads // kv_heads, dim=1)  # [batch, head, key, head size]
        moved = torch.einsum("hwd,bhkd->bhkw", output_slices(model, kind, layer, heads), v)  # [b, head, key, width]
        norms = moved.norm(dim=-1)  # [batch, head, key]
        weighted = p.double() * norms[:, :, None, :]  # [batch, head, query, key]
        weighted = weighted / weighted.sum(dim=-1, keepdim=True)
        stats = sentence_stats(weighted, mask, loaded.causal, sink=SINK, window=WINDOW)
        out = torch.einsum("bhqk,bhkw->bhqw", p.double(), moved).norm(dim=-1)  # [batch, head, query]
        stats["output_norm"] = torch.where(real[:, None, :], out, 0.0).sum(-1) / real.sum(-1)[:, None]
        for name in VALUE_WEIGHTED:
            result.setdefault(f"{name}_vw", []).append(stats[name].numpy())
        result.setdefault("output_norm", []).append(stats["output_norm"].numpy())
    return {name: np.stack(per_layer, axis=1) for name, per_layer in result.items()}  # [sentence, layer, head]


@pytest.fixture(scope="module", params=["gpt2", "llama", "bert"])
def model_and_oracle(request):
    loaded = load_model(str(request.getfixturevalue(f"{request.param}_dir")), "cpu")
    return loaded, oracle(loaded, request.param, SENTENCES)


def per_sentence_array(frame: pd.DataFrame, name: str, shape: tuple[int, int, int]) -> np.ndarray:
    return frame.sort_values(["sentence", "layer", "head"])[name].to_numpy(dtype=float).reshape(shape)


@pytest.mark.parametrize("attention", PATHS)
def test_value_weighted_scores_equal_a_float64_computation(model_and_oracle, attention):
    """GPT-2 (Conv1D projections), Llama (grouped-query: 4 query heads on 2 KV heads) and BERT (the projection in
    attention.output), in batches of 3 padded sentences, on every path; blocks of 3 rows on the blocked one."""
    loaded, expected = model_and_oracle
    result = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5, keep_per_sentence=True,
                            options=Options(attention=attention, sink=SINK, window=WINDOW, block_rows=3))
    assert result.run["attention"]["path"] == attention
    assert result.run["value_weighted"]["measured"] is True
    shape = (len(SENTENCES), loaded.num_layers, loaded.num_heads)
    assert float(np.nanmax(expected["output_norm"])) > 1.0  # the relative bound is exercised
    for name in VW_METRICS:
        assert_close(per_sentence_array(result.per_sentence, name, shape), expected[name], f"{attention} {name}")
    assert set(VW_METRICS) <= set(result.heads.columns) and set(VW_METRICS) <= set(result.layers.columns)
    assert {f"{name}_ci_low" for name in VW_METRICS} <= set(result.heads.columns)
    assert {"entropy_vw", "first_token_vw", "output_norm"} <= set(result.positions.columns)
    assert set(VW_METRICS) <= set(result.resamples)


def test_the_weights_differ_from_the_raw_ones(model_and_oracle):
    """A test that cannot fail is a defect: the value-weighted scores are not the raw ones under another name."""
    loaded, expected = model_and_oracle
    result = analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5, keep_per_sentence=True)
    frame = result.per_sentence
    assert (frame["entropy_vw"] - frame["entropy"]).abs().max() > 0.01
    assert (frame["first_token_vw"] - frame["first_token"]).abs().max() > 0.01


# ---- a planted head: a sink whose first token moves nothing ----------------------------------------------------

def make_silent_sink(folder, gap: float = 8.0):
    """A 1-layer GPT-2 (2 heads of 16) whose head 0 puts all but ~1e-15 of every row on the first token (BOS),
    whose value there is exactly 0.

    BOS's embedding is e_0 - e_1 (mean exactly 0), so after ln_1 it is exactly 0 outside dims 0 and 1; head 0's
    values read dims 2+ only, without bias, so v_0 = 0 exactly. Its query is a constant `gap` e_0 (a bias) and
    its key reads dim 0, where BOS has about +4 and every other token about -4: a logit gap near 8 `gap`."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    vocab = save_tokenizer(folder, SENTENCES, bos=True)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0, initializer_range=0.4)
    model = GPT2Model(config)
    embd, size = 32, 16
    with torch.no_grad():
        model.wpe.weight.zero_()
        model.wte.weight[0] = 0.0
        model.wte.weight[0, 0], model.wte.weight[0, 1] = 1.0, -1.0
        model.wte.weight[1:, 0] = -3.0  # every other token far below on dim 0
        attn = model.h[0].attn.c_attn  # Conv1D [embd, 3 embd]: q | k | v, head 0 first in each
        attn.weight[:, :size] = 0.0
        attn.bias[:size] = 0.0
        attn.bias[0] = gap  # q = gap e_0
        attn.weight[:, embd : embd + size] = 0.0
        attn.bias[embd : embd + size] = 0.0
        attn.weight[0, embd] = 1.0  # k[0] = h[0]
        attn.weight[:2, 2 * embd : 2 * embd + size] = 0.0  # v reads dims 2+ only
        attn.bias[2 * embd : 2 * embd + size] = 0.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def silent_sink(tmp_path_factory):
    return load_model(str(make_silent_sink(tmp_path_factory.mktemp("silent_sink"))), "cpu")


@pytest.mark.parametrize("attention", PATHS)
def test_a_sink_on_a_first_token_that_moves_nothing(silent_sink, attention):
    result = analyze_loaded(silent_sink, corpus_of(SENTENCES), batch_size=3, resamples=5, keep_per_sentence=True,
                            options=Options(attention=attention))
    head = result.heads.set_index(["layer", "head"]).loc[(0, 0)]
    assert head["first_token"] == pytest.approx(1.0, abs=FLOAT32_TOLERANCE)
    assert head["first_token_unforced"] == pytest.approx(1.0, abs=FLOAT32_TOLERANCE)
    assert head["first_token_vw"] == pytest.approx(0.0, abs=FLOAT32_TOLERANCE)
    assert head["first_token_unforced_vw"] == pytest.approx(0.0, abs=FLOAT32_TOLERANCE)
    assert head["output_norm"] < 1e-6  # it writes (almost) nothing
    other = result.heads.set_index(["layer", "head"]).loc[(0, 1)]
    assert other["output_norm"] > 0.1
    # the first row sees only the first token, of norm 0: nothing to weigh, so it counts for no _vw score
    rows = result.per_sentence[result.per_sentence["head"] == 0]
    assert rows["first_token_vw"].notna().all()  # every sentence has rows past the first
    types = classify(result.heads, scheme="extended")
    assert types.set_index(["layer", "head"]).loc[(0, 0), "head_type"] == "dormant"


def test_a_row_with_nothing_to_weigh_is_nan_on_every_path():
    """q, k, v by hand: KV head 0's value at key 0 is zero; causal row 0 of heads 0-1 sees only it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    v[:, 0, 0] = 0.0
    factors = values.head_factors(torch.nn.Linear(32, 12), 4)
    info = kernel.Batch(layers={}, last_layer=0, special=None, sink=1, window=2, bins=bin_count(5),
                        budget_bytes=2**20, block_rows=2, example=None, on_layer=lambda *_: None)
    for attend in (kernel.attend, kernel.fused_attend):
        sums, _, _ = attend(q, k, v, None, None, True, info, factors=factors)
        counts = sums.counts["entropy_vw"][0]  # [head]: rows with a value
        assert counts.tolist() == [4.0, 4.0, 5.0, 5.0], attend.__name__
        assert sums.means()["first_token_vw"][0, :2].abs().max() < FLOAT32_TOLERANCE


# ---- which models, and how run.json says so ---------------------------------------------------------------------

def test_turned_off_or_not_found_they_are_left_out_with_the_reason(gpt2_dir, tmp_path):
    loaded = load_model(str(gpt2_dir), "cpu")
    off = analyze_loaded(loaded, corpus_of(SENTENCES[:3]), resamples=5, options=Options(value_weighted=False))
    assert not set(VW_METRICS) & set(off.heads.columns)
    assert off.run["value_weighted"] == {"measured": False, "why": "turned off (--no-value-weighted)"}
    assert not any("value-weighted" in note for note in off.run["notes"])
    original = values.PROJECTIONS
    try:
        values.PROJECTIONS = ("o_proj",)  # as if GPT-2's c_proj were unknown
        missing = analyze_loaded(loaded, corpus_of(SENTENCES[:3]), resamples=5)
    finally:
        values.PROJECTIONS = original
    assert not set(VW_METRICS) & set(missing.heads.columns)
    assert missing.run["value_weighted"]["measured"] is False
    assert "GPT2Attention (layer 0) has no output projection" in missing.run["value_weighted"]["why"]
    assert any("value-weighted scores and output_norm not measured" in note for note in missing.run["notes"])


def test_find_projections_checks_the_width():
    class Attention(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.o_proj = torch.nn.Linear(width, 8)

    model = torch.nn.Sequential(Attention(12), Attention(10))
    found, _ = values.find_projections(model, list(model), heads=2)
    assert found is not None and len(found) == 2
    found, why = values.find_projections(model, list(model), heads=4)
    assert found is None and "reads 10 values, not a multiple of its 4 heads" in why


def test_factors_give_the_norms_of_the_full_projection():
    torch.manual_seed(0)
    projection = torch.nn.Linear(6 * 8, 20)
    factors = values.head_factors(projection, 6)  # [head, 8, 8]
    x = torch.randn(3, 6, 5, 8)  # [batch, head, n, head size]
    slices = projection.weight.double().view(20, 6, 8).permute(1, 0, 2)  # [head, width, head size]
    expected = torch.einsum("hwd,bhnd->bhnw", slices, x.double()).norm(dim=-1)
    torch.testing.assert_close(values.head_norms(x, factors).double(), expected, rtol=FLOAT32_TOLERANCE, atol=0)
    grouped = torch.randn(3, 2, 5, 8)  # two KV heads, three query heads each
    expected = torch.einsum("hwd,bhnd->bhn" + "w", slices, grouped.double().repeat_interleave(3, 1)).norm(dim=-1)
    torch.testing.assert_close(values.key_norms(grouped, factors).double(), expected, rtol=FLOAT32_TOLERANCE, atol=0)
    with torch.no_grad():
        projection.weight.mul_(2.0)  # a changed weight is factored again
    assert torch.allclose(values.head_factors(projection, 6).abs(), 2 * factors.abs(), rtol=FLOAT32_TOLERANCE)


def test_unloaded_projection_weights_are_refused_by_name():
    projection = torch.nn.Linear(8, 4, device="meta")  # no accelerate map to read them from
    with pytest.raises(AttnprobeError, match="not loaded.*--no-value-weighted"):
        values.head_factors(projection, 2)


# ---- classification: dormant sinks -----------------------------------------------------------------------------

def sink_table(norms: list[float]) -> pd.DataFrame:
    """One layer of sinks (copy heads on the first token) with these output norms."""
    n = len(norms)
    return pd.DataFrame({"layer": [0] * n, "head": range(n), "diagonal_unforced": [0.1] * n,
                         "entropy_unforced": [0.2] * n, "entropy_norm": [0.1] * n, "first_token_unforced": [0.9] * n,
                         "previous_token": [0.0] * n, "output_norm": norms})


def test_a_sink_below_half_its_layer_s_median_output_is_dormant():
    table = sink_table([1.0, 2.0, 4.0, 0.99, 4.0])  # median 2: ratios 0.5, 1, 2, 0.495, 2
    assert output_ratio(table).tolist() == pytest.approx([0.5, 1.0, 2.0, 0.495, 2.0])
    assert head_types(table, scheme="extended").tolist() == ["sink", "sink", "sink", "dormant", "sink"]
    assert head_types(table, Thresholds(dormant_max_output_ratio=0.6), scheme="extended").tolist() == [
        "dormant", "sink", "sink", "dormant", "sink"]
    assert head_types(table, scheme="default").tolist() == ["copy"] * 5  # the default scheme has no dormant
    types = classify(table, scheme="extended")
    assert list(types.columns[-2:]) == ["output_norm", "output_norm_ratio"]
    assert head_types(table.drop(columns="output_norm"), scheme="extended").tolist() == ["sink"] * 5
    with pytest.raises(AttnprobeError, match="--dormant-max-output-ratio 1.5"):
        Thresholds(dormant_max_output_ratio=1.5)


def test_classify_cli_takes_the_dormant_threshold_and_says_when_it_cannot(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    sink_table([1.0, 2.0, 4.0, 0.99, 4.0]).to_csv(out / "heads.csv", index=False)
    done = runner.invoke(app, ["classify", "--out", str(out), "--scheme", "extended",
                               "--dormant-max-output-ratio", "0.6"])
    assert done.exit_code == 0, done.output
    assert pd.read_csv(out / "head_types.csv")["head_type"].tolist().count("dormant") == 2
    sink_table([1.0, 2.0]).drop(columns="output_norm").to_csv(out / "heads.csv", index=False)
    done = runner.invoke(app, ["classify", "--out", str(out), "--scheme", "extended"])
    assert done.exit_code == 0 and "no output_norm" in done.stderr


def test_analyze_cli_writes_value_weighted_columns_to_every_file(tmp_path, corpus_file):
    model = make_gpt2(tmp_path / "gpt2")
    out = tmp_path / "out"
    done = runner.invoke(app, ["analyze", "--model", str(model), "--corpus", str(corpus_file), "--out", str(out),
                               "--per-sentence", "--resamples", "5"])
    assert done.exit_code == 0, done.output
    rows = pd.read_parquet(out / "sentences.parquet")
    assert set(VW_METRICS) <= set(rows.columns) and rows["output_norm"].notna().all()
    assert {"entropy_vw", "output_norm_ci_low"} <= set(pd.read_csv(out / "layers.csv").columns)
    done = runner.invoke(app, ["analyze", "--model", str(model), "--corpus", str(corpus_file), "--out", str(out),
                               "--per-sentence", "--resamples", "5", "--no-value-weighted"])
    assert done.exit_code == 0, done.output
    assert not set(VW_METRICS) & set(pd.read_csv(out / "heads.csv").columns)
    assert not set(VW_METRICS) & set(pd.read_parquet(out / "sentences.parquet").columns)
