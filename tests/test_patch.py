"""`attnprobe patch`: activation, attribution and path patching against plain-transformers hook oracles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import zoo
from conftest import FLOAT32_TOLERANCE
from test_cli import assert_one_line_error, run

from attnprobe import ioi
from attnprobe import patching as pt
from attnprobe.model import load_model

# pairs of one length each (word-level tokenizer of the zoo), two lengths in all: the batch is padded
PAIRS = [
    ioi.Pair("The cat sat on the mat", "The dog sat on the mat", " the", " cat"),
    ioi.Pair("When the engineer opened the panel", "When the owner opened the panel", " she", " the"),
    ioi.Pair("Rain fell on the old bridge", "Birds sang on the old bridge", " in", " the"),
]
# the module whose input is the concatenated head outputs, as each family's source names it (the oracle's own
# lookup; patching finds it by what it does)
PROJECTION = {"gpt2": "transformer.h.{}.attn.c_proj", "llama": "model.layers.{}.self_attn.o_proj",
              "mistral (sliding window)": "model.layers.{}.self_attn.o_proj",
              "gemma2": "model.layers.{}.self_attn.o_proj", "gpt_oss": "model.layers.{}.self_attn.o_proj",
              "opt": "model.decoder.layers.{}.self_attn.out_proj", "gpt_neox": "gpt_neox.layers.{}.attention.dense"}
FAMILIES = list(PROJECTION)


def atol(*operands) -> float:
    """float32's bound on a difference of two computations of one result, relative to its operands' size."""
    return FLOAT32_TOLERANCE * sum(max(1.0, float(np.max(np.abs(x)))) for x in operands)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    folder = zoo.make(name, tmp_path_factory.mktemp(f"patch-{name.split()[0]}"), lm_head=True)
    return name, folder


def oracle_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def oracle_metric(model, ids: list[int], answer: int, wrong: int, pre: dict | None = None) -> torch.Tensor:
    """logit(answer) - logit(wrong) at the last position of one prompt, the model's own logits, with pre-hooks
    {module: hook} on for the run."""
    handles = [module.register_forward_pre_hook(hook) for module, hook in (pre or {}).items()]
    try:
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]  # [vocab]
    finally:
        for handle in handles:
            handle.remove()
    return (logits[answer] - logits[wrong]).double()


def head_outputs(model, name: str, ids: list[int], layers: int) -> list[torch.Tensor]:
    """Each layer's projection input [seq, heads * head_dim] on one prompt."""
    seen = []
    handles = [model.get_submodule(PROJECTION[name].format(i)).register_forward_pre_hook(
        lambda _m, args: seen.append(args[0][0].detach().clone())) for i in range(layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def swap_hook(layer_source: torch.Tensor, head: int, dim: int, position: int | None = None):
    """Pre-hook: the head's slice of the projection input (all positions, or one) from the source run."""
    def hook(_module, args):
        x = args[0].clone()  # [1, seq, heads * dim]
        cut = slice(head * dim, (head + 1) * dim)
        where = slice(None) if position is None else slice(position, position + 1)
        x[0, where, cut] = layer_source[where, cut]
        return (x, *args[1:])

    return hook


def setup(folder: Path):
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    parts = pt.find_parts(loaded)
    prompts = pt.tokenize_pairs(loaded, PAIRS)
    return loaded, parts, prompts


def rows_of(prompts: pt.Prompts, ids: torch.Tensor, k: int) -> list[int]:
    return ids[k, : int(prompts.last[k]) + 1].tolist()


def prefixes(loaded, parts, prompts, direction: str):
    """The base and source runs, kept, under the attention the patching then runs with (the model's own here)."""
    base_ids, source_ids = pt.base_and_source(prompts, direction)
    with torch.inference_mode():
        return (pt.run_prefix(loaded, parts, base_ids, prompts.mask),
                pt.run_prefix(loaded, parts, source_ids, prompts.mask))


def test_activation_patching_equals_the_hook_oracle(family):
    """Every head, all positions and the last one (GPT-2 and Llama also each position): the patched metric of each
    pair equals one plain forward per head with the source run's slice put into o_proj's input, on models with GQA,
    sliding windows, soft-capping, sinks (GPT-2 noising: the clean run patched from the corrupt one; the rest
    denoising)."""
    name, folder = family
    direction = "noise" if name == "gpt2" else "denoise"
    loaded, parts, prompts = setup(folder)
    model = oracle_model(folder)
    layers, heads, dim = loaded.num_layers, loaded.num_heads, loaded.head_dim
    every = [(layer, head) for layer in range(layers) for head in range(heads)]
    base, source = prefixes(loaded, parts, prompts, direction)
    base_ids, source_ids = pt.base_and_source(prompts, direction)
    for positions in ("all", "last", "each") if name in ("gpt2", "llama") else ("all", "last"):  # each: one oracle
        # forward per head and position, so on two families only (the suite's time)
        targets, got = pt.activation_patching(loaded, parts, prompts, every, positions=positions,
                                              kind="logit-diff", base=base, source=source)
        for k in range(len(PAIRS)):
            ids, src = rows_of(prompts, base_ids, k), rows_of(prompts, source_ids, k)
            outs = head_outputs(model, name, src, layers)
            want = []
            for t in targets:
                at = len(ids) - 1 if positions == "last" else t.position
                if at is not None and at >= len(ids):  # past this pair's end: no value
                    want.append(np.nan)
                    continue
                with torch.no_grad():
                    want.append(oracle_metric(model, ids, int(prompts.answer[k]), int(prompts.wrong[k]), {
                        model.get_submodule(PROJECTION[name].format(t.layer)): swap_hook(outs[t.layer], t.head, dim,
                                                                                         at)}).item())
            np.testing.assert_allclose(got[k], np.array(want), rtol=0, atol=atol(np.array(want)) * 10)


def test_attribution_equals_the_oracle_gradient(family):
    """Attribution: the metric of the base run plus the oracle's gradient . (source - base) over each head's slice
    (autograd through plain forward hooks), at all positions and at each."""
    name, folder = family
    loaded, parts, prompts = setup(folder)
    model = oracle_model(folder)
    layers, heads, dim = loaded.num_layers, loaded.num_heads, loaded.head_dim
    every = [(layer, head) for layer in range(layers) for head in range(heads)]
    _, source = prefixes(loaded, parts, prompts, "denoise")
    for positions in ("all", "each"):
        targets, got = pt.attribution_patching(loaded, parts, prompts, every, direction="denoise",
                                               positions=positions, kind="logit-diff", source=source)
        for k in range(len(PAIRS)):
            ids, src = rows_of(prompts, prompts.corrupt, k), rows_of(prompts, prompts.clean, k)
            clean_out = head_outputs(model, name, src, layers)
            # the grad of a detached input would miss later layers' dependence on it: use x + 0-leaf instead
            leaves = [torch.zeros(len(ids), heads * dim, requires_grad=True) for _ in range(layers)]

            def add(i, leaves=leaves):
                return lambda _m, args: (args[0] + leaves[i][None], *args[1:])

            value = oracle_metric(model, ids, int(prompts.answer[k]), int(prompts.wrong[k]), {
                model.get_submodule(PROJECTION[name].format(i)): add(i) for i in range(layers)})
            grads = torch.autograd.grad(value, leaves)
            base_out = head_outputs(model, name, ids, layers)
            want = []
            for t in targets:
                cut = slice(t.head * dim, (t.head + 1) * dim)
                term = (grads[t.layer][:, cut].double() * (clean_out[t.layer][:, cut] - base_out[t.layer][:, cut])
                        .double()).sum(-1)  # [seq]
                want.append(value.item() + (float(term.sum()) if t.position is None else
                                            (float(term[t.position]) if t.position < len(ids) else np.nan)))
            np.testing.assert_allclose(got[k], np.array(want), rtol=0, atol=atol(np.array(want)) * 10)


def test_path_patching_equals_a_hand_frozen_oracle(tmp_path):
    """Path patching on a tiny Llama (grouped-query): run 1 freezes every head at the corrupt run but the sender
    (whose output is the clean run's) and records the receivers' queries / keys / values / outputs, run 2 is the
    corrupt run with those put back; computed here by hand with plain hooks, one prompt at a time."""
    folder = zoo.make("llama", tmp_path / "llama", lm_head=True, num_hidden_layers=3)
    loaded, parts, prompts = setup(folder)
    model = oracle_model(folder)
    dim = loaded.head_dim
    base, source = prefixes(loaded, parts, prompts, "denoise")
    senders, receivers = [(0, 1), (1, 2)], [(2, 0), (2, 3)]
    for via in ("q", "k", "v", "out"):
        rows, got = pt.path_patching(loaded, parts, prompts, senders, receivers, direction="denoise", via=via,
                                     kind="logit-diff", base=base, source=source)
        assert [r for _, r in rows] == [receivers, receivers]
        for k in range(len(PAIRS)):
            ids, src = rows_of(prompts, prompts.corrupt, k), rows_of(prompts, prompts.clean, k)
            corrupt_out = head_outputs(model, "llama", ids, 3)
            clean_out = head_outputs(model, "llama", src, 3)
            want = [hand_path(model, ids, prompts, k, sender, receivers, via, corrupt_out, clean_out, dim)
                    for sender in senders]
            np.testing.assert_allclose(got[k], np.array(want), rtol=0, atol=atol(np.array(want)) * 10)


def hand_path(model, ids, prompts, k, sender, receivers, via, corrupt_out, clean_out, dim) -> float:
    """Wang et al.'s two runs, by hand."""
    layers = model.config.num_hidden_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    attention = [model.model.layers[i].self_attn for i in range(layers)]
    recorded: dict = {}

    def frozen(i):
        def hook(_m, args):
            x = corrupt_out[i].clone()[None]  # [1, seq, heads * dim]
            if i == sender[0]:
                cut = slice(sender[1] * dim, (sender[1] + 1) * dim)
                x[0, :, cut] = clean_out[i][:, cut]
            return (x, *args[1:])

        return hook

    def record_out(i):
        def hook(_m, args):
            recorded[i] = args[0].detach().clone()

        return hook

    def record_map(i):
        def hook(_m, _a, output):
            recorded[i] = output.detach().clone()

        return hook

    def cut_of(head):
        h = head if via in ("q", "out") else head // group
        return slice(h * dim, (h + 1) * dim)

    def put_out(i):
        def hook(_m, args):
            x = args[0].clone()
            for layer, head in receivers:
                if layer == i:
                    x[..., cut_of(head)] = recorded[i][..., cut_of(head)]
            return (x, *args[1:])

        return hook

    def put_map(i):
        def hook(_m, _a, output):
            x = output.clone()
            for layer, head in receivers:
                if layer == i:
                    x[..., cut_of(head)] = recorded[i][..., cut_of(head)]
            return x

        return hook

    mapped = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
    layers_in = sorted({layer for layer, _ in receivers})
    handles = []
    with torch.no_grad():
        for i in layers_in:  # recorders first: they see what the receivers compute themselves
            if via == "out":
                handles.append(attention[i].o_proj.register_forward_pre_hook(record_out(i)))
            else:
                handles.append(getattr(attention[i], mapped[via]).register_forward_hook(record_map(i)))
        handles += [attention[i].o_proj.register_forward_pre_hook(frozen(i)) for i in range(layers)]
        model(input_ids=torch.tensor([ids]))
        for handle in handles:
            handle.remove()
        pre = {attention[i].o_proj: put_out(i) for i in layers_in} if via == "out" else {}
        handles = [] if via == "out" else [getattr(attention[i], mapped[via]).register_forward_hook(put_map(i))
                                           for i in layers_in]
        value = oracle_metric(model, ids, int(prompts.answer[k]), int(prompts.wrong[k]), pre)
        for handle in handles:
            handle.remove()
    return float(value)


def test_a_query_or_key_norm_over_every_head_refuses_via_q_and_k(tmp_path):
    """OLMo2's q_norm and k_norm normalise all heads' queries (keys) together: a receiver's pre-norm slice patched
    alone would move every head's normalised query, so --via q and k are refused there in one line; per-head norms
    (Qwen3's, one head wide) and --via v are fine."""
    loaded, parts, _ = setup(zoo.make("olmo2", tmp_path / "olmo2", lm_head=True))
    for via in ("q", "k"):
        with pytest.raises(pt.AttnprobeError, match=f"--via {via}: .*{via}_norm normalises every head's"):
            pt.qkv_slices(parts, 1, via, 0)
    pt.qkv_slices(parts, 1, "v", 0)
    loaded, parts, _ = setup(zoo.make("qwen3", tmp_path / "qwen3", lm_head=True))
    pt.qkv_slices(parts, 1, "q", 0)


def test_a_planted_head_is_the_answers_only_route(tmp_path):
    """A model whose answer reaches the logits only through one head: patching that head restores the clean metric
    exactly (effect 1) and every other head changes nothing (effect 0)."""
    folder = planted_model(tmp_path / "planted")
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    pairs = [ioi.Pair("b a a", "b c a", " a", " b"), ioi.Pair("c b b", "c a b", " b", " c"),
             ioi.Pair("a c c", "a b c", " c", " a")]
    result = pt.patch(loaded, pairs, method="both", resamples=50)
    table = result.table.set_index(["layer", "head"])
    assert abs(result.run["ld_clean"]["mean"] - result.run["ld_corrupt"]["mean"]) > 1
    assert table.loc[(1, 0), "effect"] == pytest.approx(1, abs=1e-5)
    others = table.drop(index=(1, 0))
    np.testing.assert_allclose(others["effect"], 0, atol=1e-5)
    np.testing.assert_allclose(others["attribution"], 0, atol=1e-5)  # their outputs do not change: no estimate


def planted_model(folder: Path) -> Path:
    """A 2-layer GPT-2 (4 heads of 4) whose weights are zero but for one route: layer 1's head 0 attends to position
    1 (its query is a constant bias, its key reads a marker only position 1 carries) and copies that token's
    embedding channels, through c_proj, to channels the LM head reads. Every other head and MLP writes exactly 0, and
    the final norm's mean and spread are the same whichever token is copied. Vocabulary: a, b, c."""
    model, hidden = zoo.blank_gpt2(folder)
    with torch.no_grad():
        model.transformer.wpe.weight[1, 8], model.transformer.wpe.weight[1, 9] = 40.0, -40.0  # position 1's marker
        attn = model.transformer.h[1].attn
        attn.c_attn.bias[0] = 100.0  # head 0's query: constant
        attn.c_attn.weight[8, hidden] = 1.0  # head 0's key <- the marker
        for j in range(4):
            attn.c_attn.weight[j, 2 * hidden + j] = 1.0  # head 0's value <- token channel j
            attn.c_proj.weight[j, 10 + j] = 10.0  # head 0's output -> channel 10 + j
            model.lm_head.weight[j, 10 + j] = 1.0  # token j's logit <- channel 10 + j
    model.save_pretrained(folder)
    return folder


def test_ioi_pairs_tokenize_alike(smollm2_tokenizer_loaded):
    """The generated IOI pairs (both corruptions) are one length per pair for SmolLM2's tokenizer, the answer the
    clean prompt's indirect object."""
    for corruption in ioi.CORRUPTIONS:
        pairs = ioi.ioi_pairs(smollm2_tokenizer_loaded, 12, corruption)
        prompts = pt.tokenize_pairs(smollm2_tokenizer_loaded, pairs)
        assert prompts.clean.shape == prompts.corrupt.shape
        for pair in pairs:
            assert pair.answer.strip() in pair.clean and pair.wrong.strip() in pair.clean
            if corruption == "abc":
                assert pair.answer.strip() not in pair.corrupt and pair.wrong.strip() not in pair.corrupt


@pytest.fixture(scope="module")
def smollm2_tokenizer_loaded():
    return load_model("smollm2-135m", "cpu", lm_head=True)


def test_smollm2_ioi_matches_the_oracle(smollm2_tokenizer_loaded):
    """SmolLM2 on 3 IOI pairs: the denoising sweep of a few heads of layers 17-23 equals one plain forward per head
    with the clean slice hooked into o_proj; the clean and corrupt logit differences have opposite signs (s2)."""
    loaded = smollm2_tokenizer_loaded
    pairs = ioi.ioi_pairs(loaded, 3, "s2")
    heads = [(17, 4), (20, 0), (23, 3)]
    result = pt.patch(loaded, pairs, heads=heads, resamples=50)
    parts = pt.find_parts(loaded)
    prompts = pt.tokenize_pairs(loaded, pairs)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(loaded.model.config).eval()
    model.model, model.lm_head = loaded.model, loaded.lm_head
    assert result.run["ld_clean"]["mean"] > 0 > result.run["ld_corrupt"]["mean"]
    want = []
    for layer, head in heads:
        values = []
        for k in range(len(pairs)):
            ids, src = rows_of(prompts, prompts.corrupt, k), rows_of(prompts, prompts.clean, k)
            seen: list = []
            handle = parts.projections[layer].register_forward_pre_hook(
                lambda _m, a, seen=seen: seen.append(a[0][0].clone()))
            with torch.no_grad():
                model(input_ids=torch.tensor([src]))
            handle.remove()
            hook = swap_hook(seen[0], head, loaded.head_dim)
            with torch.no_grad():
                values.append(float(oracle_metric(model, ids, int(prompts.answer[k]), int(prompts.wrong[k]),
                                                  {model.model.layers[layer].self_attn.o_proj: hook})))
        want.append(np.mean(values))
    np.testing.assert_allclose(result.table["ld"], want, rtol=0, atol=atol(np.array(want)) * 10)


def test_logprob_is_the_models_log_probability(tmp_path):
    """--metric logprob: the clean and corrupt runs' log p(answer) at the last position, as the model's own
    log-softmax gives them (Gemma 2: after its final soft-capping)."""
    folder = zoo.make("gemma2", tmp_path / "gemma2", lm_head=True)
    loaded = load_model(str(folder), "cpu", "float32", lm_head=True)
    result = pt.patch(loaded, PAIRS, heads=[(1, 0)], kind="logprob", resamples=20)
    model = oracle_model(folder)
    prompts = pt.tokenize_pairs(loaded, PAIRS)
    for name, ids in (("ld_clean", prompts.clean), ("ld_corrupt", prompts.corrupt)):
        with torch.no_grad():
            want = np.mean([torch.log_softmax(model(input_ids=torch.tensor([rows_of(prompts, ids, k)])).logits[0, -1]
                                              .double(), -1)[int(prompts.answer[k])].item() for k in range(len(PAIRS))])
        assert result.run[name]["mean"] == pytest.approx(want, abs=atol(want))


def test_effects_are_the_ratio_of_means():
    """effect = (mean patched - mean corrupt) / (mean clean - mean corrupt); noising mirrors it; with one resample
    of weight 1 on every pair the interval is the point."""
    patched = np.array([[1.0, 3.0], [3.0, 5.0]])  # [pairs, target]
    clean, corrupt = np.array([4.0, 6.0]), np.array([0.0, 2.0])
    ones = np.ones((1, 2))
    effect, low, high, mean = pt.effects(patched, clean, corrupt, "denoise", ones)
    np.testing.assert_allclose(effect, [(2 - 1) / 4, (4 - 1) / 4])
    np.testing.assert_allclose(low, effect)
    np.testing.assert_allclose(mean, [2, 4])
    effect, *_ = pt.effects(patched, clean, corrupt, "noise", ones)
    np.testing.assert_allclose(effect, [(5 - 2) / 4, (5 - 4) / 4])


def test_a_position_some_pairs_lack_is_measured_over_the_pairs_that_have_it():
    """--positions each with pairs of other lengths: a patch that changes nothing (patched = corrupt on the pairs
    that have the position, NaN on the others) has effect 0, in the point and in every resample, though the clean
    and corrupt means over all pairs differ from those over the pairs that have it."""
    clean, corrupt = np.array([3.0, 3.0, 5.0, 5.0]), np.array([0.0, 0.0, 2.0, 2.0])
    patched = np.array([[0.0, np.nan], [0.0, np.nan], [2.0, 2.0], [2.0, 2.0]])  # [pairs, target]
    weights = np.random.default_rng(0).poisson(1.0, size=(50, 4)).astype(float) + 0.1  # [resample, pairs]
    effect, low, high, mean = pt.effects(patched, clean, corrupt, "denoise", weights)
    np.testing.assert_allclose(effect, [0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose([low, high], np.zeros((2, 2)), atol=1e-12)
    np.testing.assert_allclose(mean, [1.0, 2.0])
    effect, *_ = pt.effects(np.array([[3.0, np.nan], [3.0, np.nan], [5.0, 5.0], [5.0, 5.0]]), clean, corrupt,
                            "denoise", weights)
    np.testing.assert_allclose(effect, [1.0, 1.0])  # the clean values restored: 1 at both


def test_read_pairs_refuses_bad_lines(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"clean": "a", "corrupt": "b", "answer": " c"}\n', encoding="utf-8")
    with pytest.raises(pt.AttnprobeError, match="line 1: 'wrong' is missing"):
        pt.read_pairs(path)
    path.write_text("not json\n", encoding="utf-8")
    with pytest.raises(pt.AttnprobeError, match="line 1 is not JSON"):
        pt.read_pairs(path)


def test_cli_writes_the_files_and_refuses_unequal_lengths(tmp_path):
    folder = zoo.make("llama", tmp_path / "llama", lm_head=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p.__dict__) + "\n" for p in PAIRS), encoding="utf-8")
    out = tmp_path / "out"
    result = run("patch", "--model", folder, "--pairs", pairs, "--out", out, "--method", "both", "--resamples", 20)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "patching.csv")
    assert list(table.columns[:5]) == ["layer", "head", "effect", "effect_lo", "effect_hi"]
    assert len(table) == 8
    info = json.loads((out / "patch.json").read_text())
    assert info["pairs"]["count"] == 3 and len(info["pairs"]["sha256"]) == 64
    assert (out / "patching.png").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"clean": "The cat sat", "corrupt": "The cat sat on", "answer": " the",
                               "wrong": " cat"}) + "\n", encoding="utf-8")
    result = run("patch", "--model", folder, "--pairs", bad, "--out", tmp_path / "o2")
    assert_one_line_error(result, "pair 1: the clean prompt is")


@pytest.mark.parametrize("extra, word", [(["--pairs", "PAIRS", "--n", "8"], "--n"),
                                         (["--pairs", "PAIRS", "--corruption", "s2"], "--corruption"),
                                         (["--task", "ioi", "--method", "path", "--senders", "L0H0", "--receivers",
                                           "all", "--heads", "L1H0"], "--heads"),
                                         (["--task", "ioi", "--method", "path", "--senders", "L0H0", "--receivers",
                                           "all", "--positions", "last"], "--positions")])
def test_options_the_run_would_not_use_are_refused(tmp_path, extra, word):
    """--n and --corruption build --task's pairs, --heads and --positions choose what path patching does not: given
    where they do nothing they are refused in one line (the record would otherwise hide that they were asked for)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p.__dict__) + "\n" for p in PAIRS), encoding="utf-8")
    args = [str(pairs) if a == "PAIRS" else a for a in extra]
    result = run("patch", "--model", tmp_path / "no-model", *args, "--out", tmp_path / "out")
    assert_one_line_error(result, f"{word} does nothing here")



def test_ctrl_c_leaves_nothing_half_written(tmp_path, monkeypatch):
    """A Ctrl-C in the middle of the sweep: no result file, no temporary file, the folder's lock released (a run
    into it right after works)."""
    folder = zoo.make("llama", tmp_path / "llama", lm_head=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p.__dict__) + "\n" for p in PAIRS), encoding="utf-8")
    out = tmp_path / "out"
    real = pt.activation_patching

    def interrupted(*args, **kwargs):
        kwargs["progress"] = lambda *_: (_ for _ in ()).throw(KeyboardInterrupt)
        return real(*args, **kwargs)

    monkeypatch.setattr(pt, "activation_patching", interrupted)
    stopped = run("patch", "--model", folder, "--pairs", pairs, "--out", out, "--resamples", 5)
    assert stopped.exit_code != 0  # click's answer to Ctrl-C (130, or 1 with "Aborted!" in older releases)
    left = [p.name for p in out.iterdir()] if out.exists() else []
    assert not [name for name in left if not name.startswith(".attnprobe.lock")], left
    monkeypatch.setattr(pt, "activation_patching", real)
    result = run("patch", "--model", folder, "--pairs", pairs, "--out", out, "--resamples", 5)
    assert result.exit_code == 0, result.output
    assert (out / "patching.csv").is_file()


def test_a_model_whose_blocks_cannot_be_rerun_is_refused(tmp_path):
    """BLOOM passes its ALiBi as batch x heads rows, which stacked copies of the pairs cannot extend: one line, no
    wrong number (patch reruns the last block as two copies and compares, before any patching)."""
    folder = zoo.make("bloom", tmp_path / "bloom", lm_head=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p.__dict__) + "\n" for p in PAIRS), encoding="utf-8")
    result = run("patch", "--model", folder, "--pairs", pairs, "--out", tmp_path / "out")
    assert_one_line_error(result, "patching does not support BloomModel")
    assert not (tmp_path / "out" / "patching.csv").exists()
