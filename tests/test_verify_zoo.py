"""verify recomputes every architecture of the zoo (tests/zoo.py) from scratch, and fails when the recomputation is
deliberately wrong: a rope theta, a window, a soft-cap, an ALiBi slope or two heads' weights."""

import re

import pytest
import torch
from zoo import OWN_ATTENTION, ZOO, make

from attnprobe import recompute
from attnprobe.model import attention_modules, load_model
from attnprobe.verify import DEFAULT_SENTENCES, NOTE_WIDTH, RECOMPUTED, verify

# transformers' eager Falcon added the ALiBi twice while it computed its attention itself (to the logits and again
# through the mask; its SDPA path once; up to 5.24): verify says so instead of passing. From 5.25 Falcon runs through
# AttentionInterface and adds it once, and verify passes.
ALIBI_TWICE = {"falcon (alibi)"} & OWN_ATTENTION


@pytest.fixture(scope="module")
def zoo_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo-verify")

    def get(name, dtype="auto"):
        folder = root / re.sub(r"\W+", "_", name)
        if not (folder / "config.json").is_file():
            make(name, folder)
        return load_model(str(folder), "cpu", dtype)

    return get


def recomputed(loaded):
    return next(c for c in verify(loaded, list(DEFAULT_SENTENCES)) if c.name == RECOMPUTED)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_verify_recomputes_every_zoo_architecture(zoo_model, name):
    loaded = zoo_model(name)
    checks = verify(loaded, list(DEFAULT_SENTENCES))
    check = next(c for c in checks if c.name == RECOMPUTED)
    assert not check.skipped, check
    sdpa = next(c for c in checks if c.name.startswith("eager output"))
    assert len(check.note) <= NOTE_WIDTH and len(sdpa.note) <= NOTE_WIDTH, (check.note, sdpa.note)
    if name in ALIBI_TWICE:
        assert not check.passed and check.note == "maps add ALiBi twice (transformers bug)"
        return
    assert check.passed, check
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


def swap_heads(loaded, first=0, second=1):
    """Swap two query heads' rows of every layer's query projection (or GPT-2's and Falcon's fused one): the maps
    the model computes are unchanged, so the recomputation of the swapped weights must disagree with them."""
    config = loaded.model.config
    head_dim = loaded.head_dim
    for module, _ in attention_modules(loaded.model):
        projection = next(getattr(module, n) for n in ("q_proj", "query", "q_lin", "c_attn", "qkv_proj", "Wqkv",
                                                        "query_key_value") if hasattr(module, n))
        weight = projection.weight
        conv = type(projection).__name__ == "Conv1D"
        per_head = {"gpt_neox": 3 * head_dim, "bloom": 3 * head_dim}.get(config.model_type, head_dim)
        if config.model_type == "falcon" and not config.multi_query:
            per_head = 3 * head_dim
        a, b = slice(first * per_head, first * per_head + head_dim), slice(second * per_head,
                                                                            second * per_head + head_dim)
        with torch.no_grad():
            if conv:
                weight[:, a], weight[:, b] = weight[:, b].clone(), weight[:, a].clone()
            else:
                weight[a], weight[b] = weight[b].clone(), weight[a].clone()
            if projection.bias is not None:
                projection.bias[a], projection.bias[b] = projection.bias[b].clone(), projection.bias[a].clone()


def changed_under_the_recomputation(loaded, monkeypatch, change):
    """Run `change()` once the maps are captured, when the recomputation starts (the model reads some settings,
    such as its window, as it runs)."""
    real = recompute.RECOMPUTE[loaded.model.config.model_type]
    done = []

    def after_change(module, hidden, config, layer):
        if not done:
            change()
            done.append(True)
        return real(module, hidden, config, layer)

    monkeypatch.setitem(recompute.RECOMPUTE, loaded.model.config.model_type, after_change)


@pytest.mark.parametrize("name", sorted(set(ZOO) - ALIBI_TWICE))
def test_verify_fails_when_two_heads_are_swapped_under_it(zoo_model, name, monkeypatch):
    """The maps are captured first, then the weights the recomputation reads are swapped."""
    loaded = zoo_model(name)
    changed_under_the_recomputation(loaded, monkeypatch, lambda: swap_heads(loaded))
    check = recomputed(loaded)
    assert not check.passed and check.max_abs_diff > 1e-3, check


@pytest.mark.parametrize(("name", "setting", "value"), [
    ("llama", "rope_theta", 500.0), ("qwen2", "rope_theta", 500.0), ("gpt_neox", "partial_rotary_factor", 1.0),
    ("phi", "partial_rotary_factor", 1.0), ("gemma3_text", "rope_theta", 500.0), ("gpt_oss", "factor", 4.0),
])
def test_verify_fails_when_the_rope_in_the_config_is_wrong(zoo_model, name, setting, value):
    """The recomputation reads the rotary parameters from the config: perturbed in memory after the model ran,
    the check fails (the model's own rotary embedding was built before)."""
    loaded = zoo_model(name)
    rope = loaded.model.config.rope_parameters
    for part in ([rope[t] for t in rope] if isinstance(next(iter(rope.values())), dict) else [rope]):
        part[setting] = value
    assert not recomputed(loaded).passed


@pytest.mark.parametrize(("name", "setting", "value"), [
    ("gemma2", "attn_logit_softcapping", 50.0), ("mistral (sliding window)", "sliding_window", 2),
    ("gemma2", "query_pre_attn_scalar", 8), ("granite", "attention_multiplier", 0.5),
])
def test_verify_fails_when_a_setting_in_the_config_is_wrong(zoo_model, name, setting, value, monkeypatch):
    loaded = zoo_model(name)
    changed_under_the_recomputation(loaded, monkeypatch, lambda: setattr(loaded.model.config, setting, value))
    assert not recomputed(loaded).passed


def test_verify_fails_with_wrong_alibi_slopes(zoo_model, monkeypatch):
    loaded = zoo_model("bloom")
    monkeypatch.setattr(recompute, "alibi_slopes", lambda n: torch.full((n,), 0.5))
    assert not recomputed(loaded).passed


def test_a_rope_type_without_a_recomputation_is_named_in_one_short_line(zoo_model):
    loaded = zoo_model("llama")
    loaded.model.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    check = recomputed(loaded)
    assert check.skipped and check.note == "not recomputed: rope type 'longrope'" and len(check.note) <= NOTE_WIDTH


def test_llama3_frequencies_follow_the_published_formula():
    """Llama 3's scaling: long wavelengths divided by the factor, short ones kept, a blend between."""
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    got = recompute.llama3_frequencies(base, rope)
    wavelength = 2 * torch.pi / base
    assert torch.equal(got[wavelength < 8192 / 4], base[wavelength < 8192 / 4])
    assert torch.allclose(got[wavelength > 8192], base[wavelength > 8192] / 8)
    between = (wavelength >= 8192 / 4) & (wavelength <= 8192)
    assert between.any() and ((got[between] < base[between]) & (got[between] > base[between] / 8)).all()


BFLOAT16_FAMILIES = ["llama", "qwen2", "gemma2", "gpt_neox", "phi3", "bert", "gpt2", "bloom"]
# what a family cannot compare in any dtype: BLOOM computes its own attention (no SDPA, no kernel), Gemma 2 soft-caps
CANNOT = {"bloom": {"eager output = SDPA output", "blocked statistics = eager", "blocked position bins = eager",
                    "fused statistics = eager"},
          "gemma2": {"eager output = SDPA output"}}


@pytest.mark.parametrize("name", BFLOAT16_FAMILIES)
def test_verify_runs_a_bfloat16_model_in_bfloat16_and_still_catches_swapped_heads(zoo_model, name, monkeypatch):
    """A bf16 model is checked in bf16 (its memory), every check with a bound derived for bf16: the recomputation's
    and the batch's per weight (recompute_bound, pair_bound), the others per layer (depth_bound). All pass on the
    true maps, and the recomputation fails where two heads' weights are swapped."""
    loaded = zoo_model(name, "bfloat16")
    assert loaded.dtype == "bfloat16"
    checks = verify(loaded, list(DEFAULT_SENTENCES))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    check = next(c for c in checks if c.name == RECOMPUTED)
    assert not check.skipped and check.note == "bfloat16: bound per weight"
    assert next(c for c in checks if c.name == "rows sum to 1").tolerance == pytest.approx(1e-5 + 2.0**-8)
    skipped = {c.name for c in checks if c.skipped}
    assert skipped == CANNOT.get(name, set()), [c for c in checks if c.skipped]
    assert not any("float32" in c.note for c in checks)
    changed_under_the_recomputation(loaded, monkeypatch, lambda: swap_heads(loaded))
    assert not recomputed(loaded).passed


def test_a_parameter_in_the_recomputation_raises_no_gradient_warning(zoo_model):
    """GPT-OSS's sinks are a parameter: read into the recomputation, they once made float() warn ("Converting a
    tensor with requires_grad=True to a scalar")."""
    import warnings

    loaded = zoo_model("gpt_oss", "float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*requires_grad.*")
        assert recomputed(loaded).passed
