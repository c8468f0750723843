"""`attnprobe plot` options (--example, --heads, --format, --dpi), titles, head names, and token labels that
read right in any script (byte-level BPE splits Cyrillic, Japanese and emoji characters over several tokens)."""

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli import assert_one_line_error, run

from attnprobe import io, naming
from attnprobe.errors import AttnprobeError
from attnprobe.tokens import token_labels

SCRIPTS = [
    "Привет, как дела у тебя сегодня?",
    "猫が好きです。",
    "I love my cat 🐱 and my dog 😀!",
    "مرحبا بالعالم",
    "The cat sat on the mat.",
]
CORPUS = ("# category: cyrillic\n" + SCRIPTS[0] + "\nМы пошли домой.\n"
          "# category: mixed\n" + "\n".join(SCRIPTS[1:]) + "\nRain fell.\n")


def byte_level_tokenizer(texts: list[str], *, bos: bool = False):
    """A tiny byte-level BPE (GPT-2's scheme): characters outside its few merges become several byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer)
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                            special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def byte_gpt2(tmp_path_factory) -> Path:
    """A random tiny GPT-2 with a byte-level BPE tokenizer, saved like a user's model folder."""
    import torch
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path_factory.mktemp("byte_gpt2")
    tokenizer = byte_level_tokenizer(["The cat sat on the mat. Rain fell. I love my cat and my dog."])
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=3, n_head=4,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.4)
    GPT2Model(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory, byte_gpt2) -> Path:
    corpus = tmp_path_factory.mktemp("corpus") / "多言語.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    out = tmp_path_factory.mktemp("out") / "results"
    analyzed = run("analyze", "--model", byte_gpt2, "--corpus", corpus, "--out", out, "--device", "cpu",
                   "--resamples", "50")
    assert analyzed.exit_code == 0, analyzed.output
    assert run("classify", "--out", out, "--scheme", "extended").exit_code == 0
    return out


# ---- token labels by text span ----------------------------------------------------------------------------


def bare(tokenizer):
    """What tokens.token_labels takes (as tokens.encode): a tokenizer alone, under --bos auto."""
    return SimpleNamespace(tokenizer=tokenizer)


@pytest.mark.parametrize("text", SCRIPTS + ["  two  spaces", "👨\u200d👩\u200d👧 family"])
def test_token_labels_join_back_into_the_sentence(text):
    tokenizer = byte_level_tokenizer(["The cat sat on the mat."])
    ids = tokenizer(text)["input_ids"]
    by_span = token_labels(bare(tokenizer), ids, text)
    assert len(by_span) == len(ids)
    assert "".join(by_span) == text
    assert not any("\ufffd" in label for label in by_span)
    decoded = token_labels(bare(tokenizer), ids)  # no text: decoded together, never a lone replacement character
    assert "".join(decoded) == text and not any("\ufffd" in label for label in decoded)


def test_token_labels_of_split_characters():
    tokenizer = byte_level_tokenizer(["The cat sat on the mat."])
    text = "猫 cat"
    ids = tokenizer(text)["input_ids"]
    labels = token_labels(bare(tokenizer), ids, text)
    assert len(ids) == 4  # 猫 is three bytes, so three tokens here, then " cat"
    assert labels[0] == "猫" and labels[1:3] == ["", ""]  # the first piece carries it, the others are empty
    assert labels[-1] == " cat"


def test_token_labels_keep_special_tokens_and_survive_a_cut():
    tokenizer = byte_level_tokenizer(["The cat sat on the mat."], bos=True)
    text = "Привет cat"
    ids = tokenizer(text)["input_ids"]
    labels = token_labels(bare(tokenizer), ids, text)
    assert labels[0] == "<|endoftext|>" and "".join(labels[1:]) == text
    cut = token_labels(bare(tokenizer), ids[:4], text)  # the first tokens only (a truncated example)
    assert cut == labels[:4]
    other = token_labels(bare(tokenizer), ids, "some other text")  # ids the text does not give: decoded instead
    assert "".join(other[1:]) == text


def test_analyze_stores_labels_that_read_right(results):
    for example in io.read_examples(results):
        n = len(example["tokens"])
        assert not any("\ufffd" in t for t in example["tokens"])
        if example["total_tokens"] == n:
            assert "".join(example["tokens"]) == example["sentence"]


def test_plot_in_any_script_prints_no_glyph_warning(results):
    for k in range(len(io.read_examples(results))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run("plot", "--out", results, "--example", k)
        assert result.exit_code == 0, result.output
        assert "Glyph" not in result.output
        assert not [str(w.message) for w in caught if "Glyph" in str(w.message)]


# ---- --example, --heads, --format, --dpi ----------------------------------------------------------------


def test_format_svg_and_pdf_write_those_files(results, tmp_path):
    for fmt in ("svg", "pdf"):
        result = run("plot", "--out", results, "--format", fmt)
        assert result.exit_code == 0, result.output
        for stem in ("entropy_heatmap", "layer_gradient", "head_patterns", "position_profile"):
            path = results / f"{stem}.{fmt}"
            assert path.is_file() and str(path) in result.stdout.replace("\n", "")
    assert (results / "layer_gradient.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")
    assert (results / "layer_gradient.pdf").read_bytes().startswith(b"%PDF")


def test_dpi_scales_png_figures(results):
    from matplotlib.image import imread

    sizes = {}
    for dpi in (50, 100):
        assert run("plot", "--out", results, "--dpi", dpi).exit_code == 0
        sizes[dpi] = imread(results / "entropy_heatmap.png").shape[0]  # the height: a long title (the model's path)
        # widens the tight box by text, whose pixels do not scale exactly with the dpi
    assert sizes[100] == pytest.approx(2 * sizes[50], rel=0.05)


@pytest.mark.parametrize("args, fragments", [
    (["--dpi", "0"], ["--dpi 0", "10-1200"]),
    (["--heads", "L1H2,17"], ["--heads", "'17' is not a head", "L17H4,L18H6"]),
    (["--heads", "L1H2;L0H0"], ["--heads", "L<layer>H<head>"]),
    (["--heads", ","], ["names no head"]),
    (["--heads", "L3H0"], ["--heads L3H0", "layers 0-2 and heads 0-3"]),
    (["--heads", ",".join(f"L0H{h}" for h in range(4)) + ",L1H0,L1H1,L1H2,L1H3,L2H0,L2H1,L2H2,L2H3,L0H0"], []),
    (["--example", "99"], ["--example 99", "numbered 0-"]),
    (["--example", "no such sentence here"], ["not among the", "example sentence", "猫が好きです。"]),
])
def test_bad_options_are_one_line(results, args, fragments):
    result = run("plot", "--out", results, *args)
    if not fragments:  # 12 distinct heads: allowed
        assert result.exit_code == 0, result.output
        return
    assert_one_line_error(result, *fragments)


def test_example_by_number_or_text(results, monkeypatch):
    figures = capture_figures(monkeypatch)
    examples = io.read_examples(results)
    assert run("plot", "--out", results, "--example", "1").exit_code == 0
    assert examples[1]["sentence"][:20] in figures["head_patterns.png"]._suptitle.get_text()
    assert run("plot", "--out", results, "--example", "MY CAT", "--heads", "L2H1,L0H3").exit_code == 0
    figure = figures["head_patterns_selected.png"]  # its own file: head_patterns keeps one head of each type
    assert "I love my cat" in figure._suptitle.get_text()
    assert [ax.get_title().split(" ")[0] for ax in figure.axes if ax.images] == ["L2H1", "L0H3"]


def test_every_figure_title_names_the_model_and_the_corpus(results, byte_gpt2, monkeypatch):
    figures = capture_figures(monkeypatch)
    assert run("plot", "--out", results).exit_code == 0
    spec = json.loads((results / "run.json").read_text(encoding="utf-8"))["model"]["spec"]
    assert set(figures) >= {"entropy_heatmap.png", "layer_gradient.png", "head_patterns.png", "position_profile.png"}
    for name, figure in figures.items():
        title = figure._suptitle.get_text()
        assert spec in title and "多言語.txt" in title, (name, title)


def capture_figures(monkeypatch) -> dict:
    """Record the figures `plot` hands to io.figure_writer, by file name (png unless --format says otherwise)."""
    figures: dict = {}
    original = io.figure_writer

    def recording(figure, fmt="png", dpi=120):
        write = original(figure, fmt, dpi)

        def record(path):
            figures[Path(path).name.split(".")[1] + "." + fmt] = figure
            write(path)

        return record

    monkeypatch.setattr(io, "figure_writer", recording)
    return figures


# ---- head names -----------------------------------------------------------------------------------------


def test_head_names_are_unambiguous():
    assert naming.head_name(0, 1) == "L0H1" and naming.head_name(0, 10) == "L0H10"
    assert naming.parse_heads("L17H4, l18h6,17.4") == [(17, 4), (18, 6)]
    with pytest.raises(AttnprobeError, match="not a head"):
        naming.parse_heads("L17")
    with pytest.raises(AttnprobeError, match="L0H0 to L1H2"):
        naming.check_heads_exist([(2, 0)], 2, 3)


def test_types_legend_and_pattern_titles_use_head_names(results, monkeypatch):
    figures = capture_figures(monkeypatch)
    assert run("plot", "--out", results).exit_code == 0
    titles = [ax.get_title() for ax in figures["head_patterns.png"].axes if ax.images]
    assert titles and all(title.startswith("L") and "H" in title.split(" ")[0] for title in titles)
    assert not any("layer " in title.split("\n")[0] for title in titles)
