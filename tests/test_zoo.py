"""Every architecture of the zoo (tests/zoo.py) against transformers' own eager maps.

Architectures whose attention runs through AttentionInterface run on blocked attention by default, and their
blocked statistics equal the statistics of their eager maps to float32's bound (relative above 1), with padding
and blocks of 3 rows, so that a block border falls inside the sliding window of 4. Those that compute attention
themselves (GPT-J, Falcon, BLOOM, MPT) run on the eager hooks, whose maps are the ones the model returns with
output_attentions=True. The table of architectures in docs/long-documents.md is the discovery's own list.
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES, locked_transformers_only
from test_blocked import assert_close, corpus_of
from zoo import OWN_ATTENTION, OWN_MASK, WINDOW, ZOO, architecture_row, make

from attnprobe import kernel
from attnprobe.analysis import analyze_loaded
from attnprobe.batching import pad_batch
from attnprobe.errors import AttnprobeError
from attnprobe.metrics import sentence_stats
from attnprobe.model import forward_kwargs, load_model
from attnprobe.planning import Options
from attnprobe.scores import VW_METRICS

TABLE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "long-documents.md"  # "Architectures"
SINK, RECENT = 1, 3  # small, so that sink_window is defined on the test sentences


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return lambda name: make(name, root / re.sub(r"\W+", "_", name)) if not (root / re.sub(
        r"\W+", "_", name) / "config.json").is_file() else root / re.sub(r"\W+", "_", name)


def analyzed(loaded, attention, **options):
    return analyze_loaded(loaded, corpus_of(SENTENCES), batch_size=3, resamples=5, keep_per_sentence=True,
                          options=Options(attention=attention, sink=SINK, window=RECENT, **options))


@pytest.fixture(scope="module")
def eager_of(zoo_dir):
    runs = {}

    def get(name):
        if name not in runs:
            loaded = load_model(str(zoo_dir(name)), "cpu")
            runs[name] = (loaded, analyzed(loaded, "eager"))
        return runs[name]

    return get


def assert_same_statistics(got, eager, what):
    for column in eager.per_sentence.columns:
        if column != "category":
            assert_close(got.per_sentence[column], eager.per_sentence[column], f"{what} {column}")
    for column in eager.positions.columns:
        assert_close(got.positions[column], eager.positions[column], f"{what} positions {column}")
    np.testing.assert_allclose(got.example["maps"], eager.example["maps"], atol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("name", sorted(set(ZOO) - OWN_ATTENTION))
def test_the_eager_path_finds_the_model_s_own_eager_function(eager_of, name):
    """The eager path calls the model's own eager attention (found through wrappers such as transformers 5.24's
    deprecate_kwarg, whose globals are not the model's) and so measures the value-weighted scores."""
    import inspect
    import sys

    from attnprobe import values
    from attnprobe.model import attention_modules

    loaded, eager = eager_of(name)
    for module, _ in attention_modules(loaded.model):
        defining = next(c for c in type(module).__mro__ if "forward" in c.__dict__)
        expected = inspect.unwrap(defining.forward).__globals__["eager_attention_forward"]
        assert values.eager_function(module) is expected
        assert expected is sys.modules[defining.__module__].eager_attention_forward
    assert eager.run["value_weighted"]["measured"] is True, eager.run["value_weighted"]
    assert set(VW_METRICS) <= set(eager.heads.columns)
    assert eager.heads[["entropy_vw", "output_norm"]].notna().all().all()  # others are undefined for some models


@pytest.mark.parametrize("name", sorted(set(ZOO) - OWN_ATTENTION - OWN_MASK))
def test_blocked_statistics_equal_the_eager_maps(eager_of, name):
    loaded, eager = eager_of(name)
    found = kernel.discover(loaded)
    assert found.reason is None and len(found.features) == loaded.num_layers
    blocked = analyzed(loaded, "auto", block_rows=3)  # auto: short sentences run blocked
    assert blocked.run["attention"]["path"] == "fused", blocked.run["attention"]
    assert blocked.run["attention"]["fused_min_tokens"] > max(len(t) for t in loaded.tokenizer(SENTENCES)["input_ids"])
    assert blocked.run["attention"]["features"] == found.record()
    # the value-weighted scores too: the eager run reads the values through the model's own eager function
    assert eager.run["value_weighted"]["measured"] and blocked.run["value_weighted"]["measured"], name
    assert set(VW_METRICS) <= set(eager.per_sentence.columns)
    assert_same_statistics(blocked, eager, f"{name} blocked")


@pytest.mark.parametrize("name", sorted(set(ZOO) - OWN_ATTENTION - OWN_MASK))
def test_fused_statistics_equal_the_eager_maps(eager_of, name):
    """--attention fused: the fused kernel on every layer it computes exactly (the others run blocked)."""
    loaded, eager = eager_of(name)
    fused = analyzed(loaded, "fused", block_rows=3)
    assert fused.run["attention"]["path"] == "fused" and fused.run["attention"]["fused_min_tokens"] == 0
    layers = fused.run["attention"]["fused_layers"]
    assert layers == [k for k, f in enumerate(kernel.discover(loaded).features) if kernel.fusable(f)]
    assert_same_statistics(fused, eager, f"{name} fused")


@pytest.mark.parametrize("name", sorted(OWN_MASK))
def test_a_model_that_builds_its_own_mask_runs_on_the_hooks(zoo_dir, name):
    """Falcon with ALiBi (transformers 5.25 on) adds its ALiBi to the mask it builds: the statistics paths refuse
    that mask in one line, and auto runs the eager hooks, whose statistics equal the model's own maps."""
    loaded = load_model(str(zoo_dir(name)), "cpu")
    assert "did not come from attnprobe's mask function" in kernel.discover(loaded).reason
    with pytest.raises(AttnprobeError, match="mask.*--attention eager or auto"):
        analyzed(loaded, "fused")
    result = analyzed(loaded, "auto")
    assert result.run["attention"]["path"] == "eager", result.run["attention"]
    assert_equals_model_maps(loaded, result, name)


@pytest.mark.parametrize("name", sorted(OWN_ATTENTION))
def test_models_that_compute_attention_themselves_run_on_the_hooks(zoo_dir, name):
    loaded = load_model(str(zoo_dir(name)), "cpu")
    assert "computes its attention itself" in kernel.unsupported(loaded)
    with pytest.raises(AttnprobeError, match="computes its attention itself.*--attention eager"):
        analyzed(loaded, "blocked")
    result = analyzed(loaded, "auto")
    assert result.run["attention"]["path"] == "eager" and "itself" in result.run["attention"]["why_eager"]
    # their values never pass through a function attnprobe can call: the value-weighted scores are left out, saying so
    assert result.run["value_weighted"]["measured"] is False
    assert "cannot read the values" in result.run["value_weighted"]["why"]
    assert not set(VW_METRICS) & set(result.heads.columns)
    assert_equals_model_maps(loaded, result, name)


def assert_equals_model_maps(loaded, result, name):
    """The oracle: the maps the model itself returns for the whole batch at once, with output_attentions=True."""
    ids = [loaded.tokenizer(t)["input_ids"] for t in SENTENCES[:3]]
    input_ids, mask = pad_batch(ids, loaded.device)
    with torch.inference_mode():
        maps = loaded.model(**forward_kwargs(loaded.model, input_ids, mask)).attentions
    assert len(maps) == loaded.num_layers
    rows = result.per_sentence[result.per_sentence["sentence"] < 3]
    for layer, p in enumerate(maps):
        expected = sentence_stats(p, mask, True, sink=SINK, window=RECENT)  # [batch, head] each
        for column in ("entropy", "distance", "first_token", "sink_window", "entropy_norm"):
            got = rows[rows["layer"] == layer].sort_values(["sentence", "head"])[column].to_numpy()
            assert_close(got, expected[column].flatten().numpy(), f"{name} {column}")


@pytest.mark.parametrize("name", ["mistral (sliding window)", "modernbert"])
@pytest.mark.parametrize("attention", ["blocked", "eager"])
def test_a_uniform_head_in_a_windowed_layer_spreads_over_its_window(zoo_dir, tmp_path, name, attention):
    """Zero query weights: every row is uniform over the keys its window lets it see, a closed form:
    entropy ln k and entropy_norm 1, with k = min(i + 1, W) (causal) or the keys within W of i (encoder)."""
    loaded = load_model(str(zoo_dir(name)), "cpu")
    for module in loaded.model.modules():
        for weight_name in ("q_proj", "Wqkv"):
            projection = getattr(module, weight_name, None)
            if isinstance(projection, torch.nn.Linear):
                rows = slice(0, projection.out_features // 3) if weight_name == "Wqkv" else slice(None)
                with torch.no_grad():
                    projection.weight[rows] = 0
                    if projection.bias is not None:
                        projection.bias[rows] = 0
    spans = kernel.discover(loaded).spans(loaded.num_layers)
    assert WINDOW in spans or (name == "modernbert" and WINDOW // 2 in spans)
    result = analyzed(loaded, attention, block_rows=3)
    frame = result.per_sentence
    lengths = [len(loaded.tokenizer(t)["input_ids"]) for t in SENTENCES]
    for layer, span in enumerate(spans):
        for s, n in enumerate(lengths):
            counts = []
            for i in range(n):
                lo = 0 if span is None else max(0, i - span + 1 if loaded.causal else i - span)
                hi = i if loaded.causal else (n - 1 if span is None else min(n - 1, i + span))
                counts.append(hi - lo + 1)
            got = frame[(frame["sentence"] == s) & (frame["layer"] == layer)]
            want = sum(math.log(k) for k in counts) / n
            assert np.allclose(got["entropy"], want, atol=FLOAT32_TOLERANCE), (layer, s, got["entropy"], want)
            if any(k >= 2 for k in counts):
                assert np.allclose(got["entropy_norm"], 1.0, atol=FLOAT32_TOLERANCE), (layer, s)


def architecture_table() -> dict[str, tuple[str, str]]:
    """The docs' architecture table (docs/long-documents.md): name -> (path, features)."""
    text = TABLE_PAGE.read_text(encoding="utf-8")
    start = text.index("<!-- figure:architectures -->")  # written by `make figures` (figures/benchmarks.py)
    end = text.index("<!-- /figure -->", start)
    rows = {}
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("architecture", "---"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


@locked_transformers_only
def test_the_architecture_table_is_the_discovery_s_own_list(zoo_dir):
    table = architecture_table()
    assert set(table) == set(ZOO)
    for name in ZOO:
        loaded = load_model(str(zoo_dir(name)), "cpu")
        assert table[name] == architecture_row(name, loaded), name
    assert sum(path != "eager (hooks)" for path, _ in table.values()) >= 25
