"""`import attnprobe` as a notebook uses it (issue 13): the functions, what they accept, attention_maps, and the
Python API page's block (docs/python-api.md, "Using it from Python"), run on a tiny model."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_gpt2

import attnprobe
from attnprobe import AttnprobeError

ROOT = Path(__file__).resolve().parent.parent
PYTHON_PAGE = ROOT / "docs" / "python-api.md"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny GPT-2 with room for the probe's default lengths (2 x 40 tokens)."""
    return make_gpt2(tmp_path_factory.mktemp("tiny"), n_positions=128)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return attnprobe.load_model(str(tiny_dir), device="cpu")


def test_import_is_light_and_names_every_function():
    probe = "import sys, attnprobe; print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert attnprobe.__all__ == ["AttnprobeError", "__version__", *attnprobe._FUNCTIONS, *attnprobe._CALLABLE_MODULES]
    for name in attnprobe.__all__:
        assert getattr(attnprobe, name) is not None, name
        assert name in dir(attnprobe)
    with pytest.raises(AttributeError, match="no attribute 'analyse'"):
        attnprobe.analyse  # noqa: B018


@pytest.mark.parametrize("name", ["classify", "probe", "verify", "compare", "ablate", "rollout"])
def test_modules_are_callable_as_their_function(name):
    import inspect

    module = getattr(attnprobe, name)
    function = getattr(module, name)
    assert module.__name__ == f"attnprobe.{name}" and callable(module)
    assert inspect.signature(module) == inspect.signature(function)
    __import__(f"attnprobe.{name}")  # importing it again leaves it callable
    assert callable(sys.modules[f"attnprobe.{name}"]) and getattr(attnprobe, name) is module


def test_analyze_takes_a_name_a_loaded_model_or_a_transformers_pair(tiny_dir, tiny):
    from transformers import AutoModel, AutoTokenizer

    texts = SENTENCES[:4]
    by_name = attnprobe.analyze(str(tiny_dir), texts, device="cpu", resamples=50)
    by_loaded = attnprobe.analyze(tiny, texts, resamples=50)
    pair = AutoModel.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    assert pair[0].config._attn_implementation != "eager"  # SDPA: switched for the measurement
    by_pair = attnprobe.analyze(pair, texts, resamples=50)
    for other in (by_loaded, by_pair):
        np.testing.assert_allclose(other.heads["entropy"], by_name.heads["entropy"], rtol=FLOAT32_TOLERANCE,
                                   atol=FLOAT32_TOLERANCE)
    assert by_pair.run["model"]["architecture"] == "GPT2Model" and by_pair.run["corpus"]["path"] == "<in memory>"


def test_analyze_takes_a_language_model_through_its_base(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(tiny_dir)
    loaded = attnprobe.from_transformers(lm, AutoTokenizer.from_pretrained(tiny_dir))
    assert type(loaded.model).__name__ == "GPT2Model" and loaded.lm_head is not None and loaded.causal


@pytest.mark.parametrize("model, message", [
    (42, "model: expected a model name or path (str), a LoadedModel from attnprobe.load_model, or a "
         "(transformers model, tokenizer) pair; got int"),
    (("a", "b"), "model: expected a model name or path"),
])
def test_wrong_model_types_name_what_is_accepted(model, message):
    with pytest.raises(AttnprobeError, match=re.escape(message)):
        attnprobe.analyze(model, ["Rain fell."])


def test_a_model_without_its_tokenizer_is_refused(tiny):
    with pytest.raises(AttnprobeError, match=r"a GPT2Model needs its tokenizer: pass \(model, tokenizer\)"):
        attnprobe.analyze(tiny.model, ["Rain fell."])
    with pytest.raises(AttnprobeError, match="tokenizer: expected a transformers tokenizer; got str"):
        attnprobe.analyze((tiny.model, "gpt2"), ["Rain fell."])


@pytest.mark.parametrize("corpus, message", [
    (3.5, "corpus: expected a corpus file (str or Path), a list of sentences (str) or a Corpus; got float"),
    (["Rain fell.", 7], "corpus[1] is a int: pass sentences as strings"),
    (["Rain fell.", "  "], "corpus[1] is empty"),
    ([], "the list of sentences is empty"),
    ("The cat sat on the mat.", "to pass sentences, pass a list of strings"),
])
def test_wrong_corpus_types_name_what_is_accepted(tiny, corpus, message):
    with pytest.raises(AttnprobeError, match=re.escape(message)):
        attnprobe.analyze(tiny, corpus)


def test_probe_and_verify_take_a_model_name(tiny_dir):
    scores = attnprobe.probe(str(tiny_dir), device="cpu", kinds=("previous",), lengths=(4,), sequences=2,
                             resamples=20).scores
    assert len(scores) == 3 * 4 and "previous_above_chance" in scores.columns
    checks = attnprobe.verify(str(tiny_dir), device="cpu")
    assert checks and all(check.passed for check in checks)
    with pytest.raises(AttnprobeError, match="sentences: expected a list of non-empty strings"):
        attnprobe.verify(str(tiny_dir), "Rain fell.")


def test_attention_maps_of_one_text(tiny):
    from matplotlib.figure import Figure

    from attnprobe.verify import capture

    text = "The cat sat on the mat."
    attention = attnprobe.attention_maps(tiny, text)
    maps, tokens = attention
    ids = tiny.tokenizer(text)["input_ids"]
    assert maps.shape == (3, 4, len(ids), len(ids)) and maps.dtype == np.float32
    assert "".join(tokens) == text  # labels are the text's own spans
    np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=1e-5)
    assert np.triu(maps, k=1).max() == 0.0  # causal
    import torch

    expected = capture(tiny, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).maps
    np.testing.assert_allclose(maps, np.stack([m[0].numpy() for m in expected]), atol=1e-5)
    assert isinstance(attention.figure(2, 3), Figure)
    assert attnprobe.attention_maps(tiny, text, max_tokens=3).maps.shape == (3, 4, 3, 3)
    with pytest.raises(AttnprobeError, match="no head L3H0"):
        attention.figure(3, 0)
    with pytest.raises(AttnprobeError, match="text: expected a non-empty string"):
        attnprobe.attention_maps(tiny, "")
    rolled = attnprobe.rollout(maps.mean(axis=1))  # numpy in, numpy out
    assert isinstance(rolled, np.ndarray) and rolled.shape == (3, len(ids), len(ids))
    np.testing.assert_allclose(rolled.sum(axis=-1), 1.0, atol=1e-5)
    with pytest.raises(AttnprobeError, match="expected a torch Tensor or numpy array"):
        attnprobe.rollout([[1.0]])


def python_page_block() -> str:
    text = PYTHON_PAGE.read_text(encoding="utf-8")
    section = text[text.index("# Using it from Python"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_python_page_example_runs(tiny_dir, monkeypatch):
    code = python_page_block()
    assert code.count('"minilm-l6"') == 1
    monkeypatch.chdir(ROOT)  # the block reads corpora/sentences.txt
    namespace: dict = {}
    exec(compile(code.replace('"minilm-l6"', repr(str(tiny_dir))), "docs/python-api.md", "exec"), namespace)
    assert namespace["maps"].shape[:2] == (3, 4) and namespace["few"].run["notes"]
    assert namespace["result"].run["sentences"] == 100 and namespace["whole"].run["sentences"] == 1
