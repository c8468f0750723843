"""Tiny models built in the tests and saved to disk, so every test loads them by path like a user."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an uncached hub id fails at once instead of after ~26 s
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton path's tests (test_triton.py) run its kernels through Triton's interpreter where no CUDA device is
# present. Triton reads the switch when a kernel is defined, so it is set before anything imports them; it changes
# nothing else (auto takes the Triton path on CUDA only).
if "TRITON_INTERPRET" not in os.environ and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Two kernels (blocked vs eager, batched vs alone, one process vs two, Intel vs AMD) round float32 differently;
# a statistic carried through a few layers agrees to about 1e-5 relative (float32 epsilon 1.2e-7 times the
# accumulated error of sums over keys and layers). Tests comparing such results use this bound, relative above 1.
FLOAT32_TOLERANCE = 1e-5

# Test modules whose checks do not depend on the torch or transformers release: what they assert is computed by numpy,
# pandas, matplotlib, mkdocs or the browser (docs, figures, the report, plots, classification, bootstrap and corpus
# arithmetic, the import graph). A model run inside some of them only makes a results folder to read, and the tests
# of that run (analysis, kernels, the model zoo, ...) run in every suite. They are marked version_free: the locked
# suite (`make test`) runs them, `make test-latest` and `make test-lowest` leave them out (MARKS, docs/development.md).
VERSION_FREE = frozenset({
    "test_allocator.py", "test_block_bootstrap.py", "test_bootstrap.py", "test_classify.py", "test_classify_kv.py",
    "test_corpus.py", "test_docs.py", "test_export_kv_score.py", "test_figures.py", "test_import_layers.py",
    "test_io_package.py", "test_plot_options.py", "test_plots_at_scale.py", "test_plotting.py",
    "test_plot_circuit.py", "test_position_plot.py", "test_report.py", "test_report_circuit.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in VERSION_FREE:
            item.add_marker(pytest.mark.version_free)


CORPUS_PATH = Path(__file__).resolve().parent.parent / "corpora" / "sentences.txt"
LOCK_PATH = Path(__file__).resolve().parent.parent / "constraints.txt"


def locked_version(package: str) -> str | None:
    """The version of `package` that constraints.txt (the lock `make setup` installs from) pins, or None."""
    for line in LOCK_PATH.read_text(encoding="utf-8").splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower().replace("_", "-") == package.lower().replace("_", "-"):
            return version.strip()
    return None


def at_locked_transformers() -> bool:
    import transformers

    return transformers.__version__ == locked_version("transformers")


# What the docs say of architectures and files was measured with the locked transformers (make figures): tests that
# compare the docs with what the installed transformers does run there; `make test-latest`/`test-lowest` skip them.
locked_transformers_only = pytest.mark.skipif(
    not at_locked_transformers(), reason=f"the docs were made with transformers {locked_version('transformers')} "
    "(constraints.txt); this run tests another version of the declared range")

SENTENCES = [
    "The cat sat on the mat.",
    "A dog that barked all night was finally taken home by its owner.",
    "Rain fell.",
    "When the engineer opened the panel, she found a loose wire near the old fan.",
    "Who wrote the letter that was left on the kitchen table?",
    "The bridge was painted by two workers in the early spring of last year.",
    "Birds sing.",
    "The library closed early because the heating had failed again this week.",
]


def words_of(texts: list[str]) -> list[str]:
    return sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]+", t)})


def save_tokenizer(folder: Path, texts: list[str], *, bos: bool = False) -> int:
    """A word-level tokenizer with GPT-2's habits: no pad token, `<|endoftext|>` as eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *words_of(texts)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+ and [^\w\s]+ pieces
    if bos:
        core.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return len(vocab)


def make_gpt2(folder: Path, texts: list[str] = SENTENCES, *, layers: int = 3, heads: int = 4,
              n_positions: int = 64, uniform_heads: bool = False, seed: int = 0) -> Path:
    """Save a random tiny GPT-2 (and tokenizer) to `folder`; `uniform_heads` zeroes Q and K."""
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    vocab_size = save_tokenizer(folder, texts)
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=layers, n_head=heads,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.4)  # sharp, varied heads
    model = GPT2Model(config)
    if uniform_heads:
        with torch.no_grad():
            for block in model.h:
                block.attn.c_attn.weight[:, : 2 * config.n_embd] = 0.0  # [embd, 3*embd]: Q and K columns
                block.attn.c_attn.bias[: 2 * config.n_embd] = 0.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return make_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def uniform_gpt2_dir(tmp_path_factory) -> Path:
    return make_gpt2(tmp_path_factory.mktemp("gpt2_uniform"), uniform_heads=True)


@pytest.fixture()
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("# a test corpus\n\n" + "\n".join(SENTENCES) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session", autouse=True)
def gguf_cache(tmp_path_factory) -> Path:
    """Convert GGUF models once per test run, into a fresh cache (set ATTNPROBE_CACHE to reuse one)."""
    if not os.environ.get("ATTNPROBE_CACHE"):
        os.environ["ATTNPROBE_CACHE"] = str(tmp_path_factory.mktemp("attnprobe-cache"))
    return Path(os.environ["ATTNPROBE_CACHE"])


def bundled_sentences(n: int) -> list[str]:
    from attnprobe.corpus import read_corpus

    texts = read_corpus(CORPUS_PATH).texts
    return texts[:: max(1, len(texts) // n)][:n]  # spread over the categories


@pytest.fixture(scope="session")
def minilm():
    from attnprobe.model import load_model

    return load_model("minilm-l6", "cpu")


@pytest.fixture(scope="session")
def smollm2():
    from attnprobe.model import load_model

    return load_model("smollm2-135m", "cpu")


def make_planted_gpt2(folder: Path, scale: float = 1.5) -> Path:
    """A 2-layer GPT-2 whose head 0.0 attends to the previous token; every other head is uniform.

    Token embeddings are zero and position i is the one-hot vector e_i, so after ln_1 the
    hidden state is about 8 e_i - 0.13. Head 0.0 reads q_i = e_i and k_j = e_(j+1): the score
    is high exactly when j = i - 1.
    """
    import torch
    from transformers import GPT2Config, GPT2Model

    save_tokenizer(folder, SENTENCES)
    config = GPT2Config(vocab_size=len(words_of(SENTENCES)) + 2, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2Model(config)
    embd, head_dim = config.n_embd, config.n_embd // config.n_head
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wpe.weight.copy_(torch.eye(config.n_positions, embd))  # [position, embd]: one-hot
        for block in model.h:
            block.attn.c_attn.weight[:, : 2 * embd] = 0.0  # [embd, 3*embd]: every Q and K zero -> uniform
            block.attn.c_attn.bias[: 2 * embd] = 0.0
        weight = model.h[0].attn.c_attn.weight
        for d in range(head_dim):
            weight[d, d] = scale  # q_i[d] = h_i[d]
            if d >= 1:
                weight[d - 1, embd + d] = scale  # k_j[d] = h_j[d - 1]
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def planted_dir(tmp_path_factory) -> Path:
    return make_planted_gpt2(tmp_path_factory.mktemp("planted"))


def make_llama(folder: Path, texts: list[str] = SENTENCES, *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               max_positions: int = 128, hidden: int = 32, seed: int = 0, lm_head: bool = False) -> Path:
    """Save a random tiny Llama (grouped-query attention, a BOS token) to `folder`; `lm_head`: with its (untied)
    LM head, as a causal-LM checkpoint (what ablate and retrieval load)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    torch.manual_seed(seed)
    vocab_size = save_tokenizer(folder, texts, bos=True)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, initializer_range=0.4, bos_token_id=0,
                         eos_token_id=0)
    (LlamaForCausalLM if lm_head else LlamaModel)(config).save_pretrained(folder)
    return folder


def make_bert(folder: Path, texts: list[str] = SENTENCES, *, layers: int = 2, heads: int = 4, seed: int = 0) -> Path:
    """Save a random tiny BERT encoder to `folder`."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    vocab_size = save_tokenizer(folder, texts)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=heads, max_position_embeddings=128, initializer_range=0.4)
    BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory) -> Path:
    return make_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture()
def copy_of(run_dir, tmp_path):
    """A copy of the module's `run_dir` (a finished run), for a test that changes its files."""
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def restamp(out: Path) -> None:
    """Record the files of analyze now in `out` as its run's: run.json's `files` gets the sha256 of each.

    analyze records every file it writes (io.write_run), and plot, report, classify, compare and export refuse a
    file whose sha256 is not the recorded one: a copy from another run. A test that stands for a legitimate
    later rewrite of such a file with the run's own content (adding example sentences, setting up one column of
    heads.csv for a case, giving the run a categories.csv it would have written on a tagged corpus) calls this
    after the rewrite, as if analyze had written it. A run.json without a record (an older run) stays without."""
    import hashlib
    import json

    from attnprobe import io

    path = out / io.RUN_FILE
    run = json.loads(path.read_text(encoding="utf-8"))
    if io.RUN_FILES_KEY not in run:
        return
    run[io.RUN_FILES_KEY] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                             for name in io.RUN_FILES if (out / name).is_file()}
    path.write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")


def unstamp(out: Path) -> None:
    """Make `out` an older run's folder: run.json without the `files` record, whose files nothing can tell from
    another run's but their own checks (shapes, intervals, heads). A test of those checks calls this."""
    import json

    from attnprobe import io

    path = out / io.RUN_FILE
    run = json.loads(path.read_text(encoding="utf-8"))
    run.pop(io.RUN_FILES_KEY, None)
    path.write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
