"""Progress inside one long sequence (issue 34): layer_progress.watching reports each layer as it finishes, for
sequences of more than LONG_TOKENS only, leaves no hook behind and changes no number; analyze, retrieval and the
CLI's bars and log lines show it."""

import numpy as np
import pytest
import torch
from conftest import make_llama
from test_blocked import corpus_of
from test_cli import run

from attnprobe import layer_progress
from attnprobe.layer_progress import Shown, Within, reporter, watching
from attnprobe.model import load_model

LONG_TEXT = "The cat sat on the mat. " * 160  # about 1,100 tokens for the tiny tokenizer
LAYERS = 3


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A tiny 3-layer Llama (with its LM head, for retrieval) that takes 2,048 positions."""
    return make_llama(tmp_path_factory.mktemp("long_llama"), layers=LAYERS, max_positions=2048, lm_head=True)


@pytest.fixture(scope="module")
def loaded(long_llama):
    return load_model(str(long_llama), "cpu")


def hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def long_ids(loaded, text=LONG_TEXT):
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > layer_progress.LONG_TOKENS, ids.shape
    return ids


def test_a_long_sequence_reports_every_layer_in_order_and_leaves_no_hook(loaded):
    ids = long_ids(loaded)
    before = hooks_left(loaded.model)
    with torch.inference_mode():
        plain = loaded.model(input_ids=ids).last_hidden_state
        seen = []
        with watching(loaded.model, ids.shape[1], seen.append, every=0):
            assert hooks_left(loaded.model) == before + LAYERS  # one per layer, while the block runs
            watched = loaded.model(input_ids=ids).last_hidden_state
    assert seen == [Within(layer, LAYERS) for layer in range(1, LAYERS + 1)]
    assert seen[-1].done and not seen[0].done and str(seen[0]) == "layer 1/3"
    assert torch.equal(plain, watched)  # the hooks read nothing and change nothing
    assert hooks_left(loaded.model) == before


def test_a_short_sequence_registers_no_hook(loaded):
    before = hooks_left(loaded.model)
    seen = []
    with watching(loaded.model, layer_progress.LONG_TOKENS, seen.append, every=0):
        assert hooks_left(loaded.model) == before  # 1,024 tokens or fewer: exactly as without
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([[1, 2, 3]]))
    with watching(loaded.model, 5000, None):  # no callback: no hook either
        assert hooks_left(loaded.model) == before
    assert seen == []


def test_the_hooks_go_when_the_forward_fails(loaded):
    before = hooks_left(loaded.model)

    def fail(within):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"), torch.inference_mode():
        with watching(loaded.model, 5000, fail):
            loaded.model(input_ids=torch.tensor([[1, 2, 3]]))
    assert hooks_left(loaded.model) == before


def test_reports_are_throttled_but_the_last_layer_always_comes(loaded):
    """Several passes (one per mask, as ablate runs them): numbered; within the throttle only the first report and
    the last layer of the last pass."""
    ticks = iter(range(100))
    seen, every = [], []
    with torch.inference_mode(), watching(loaded.model, 5000, seen.append, runs=2, every=0):
        for _ in range(2):
            loaded.model(input_ids=torch.tensor([[1, 2, 3]]))
    assert [(w.run, w.layer) for w in seen] == [(r, la) for r in (1, 2) for la in range(1, LAYERS + 1)]
    assert [w.done for w in seen] == [False] * (2 * LAYERS - 1) + [True]
    assert str(seen[0]) == "pass 1/2, layer 1/3"
    with torch.inference_mode(), watching(loaded.model, 5000, every.append, runs=2, every=1000,
                                          clock=lambda: next(ticks)):
        for _ in range(2):
            loaded.model(input_ids=torch.tensor([[1, 2, 3]]))
    assert every == [Within(1, LAYERS, 1, 2), Within(LAYERS, LAYERS, 2, 2)]


def test_a_progress_callback_without_within_gets_no_layers():
    calls = []

    def stage(stage, done, total, within=None):
        calls.append((stage, done, total, within))

    assert reporter(None) is None
    assert reporter(calls.append, 0.0) is None  # a builtin: its signature says nothing of `within`
    assert reporter(lambda stage, done, total: None, "s", 0, 1) is None
    on_layer = reporter(stage, "streaming", 0, 4)
    on_layer(Within(2, 30))
    assert calls == [("streaming", 0, 4, Within(2, 30))]
    assert reporter(lambda *args, **kwargs: None, 1) is not None


def test_the_words_next_to_a_bar_and_in_a_log():
    clock = iter([0.0, 1.0, 2.0, 12.0, 13.0, 14.0]).__next__
    shown = Shown("sequences", every=10, clock=clock)  # started at 0
    assert shown.description("streaming", 0, 1, Within(12, 30)) == "streaming: sequence 1/1, layer 12/30"
    assert shown.description("streaming", 0, 1, Within(30, 30)) == "streaming"  # through: the plain stage
    assert shown.description("streaming", 1, 1, None) == "streaming"
    assert Shown("trials").words(2, 20, Within(3, 30, 2, 5)) == "trial 3/20, pass 2/5, layer 3/30"
    batch = Shown("sentences")  # a batch of 8 from sentence 9 on; analyze's count moves as its layers finish
    assert batch.words(8, 11, Within(1, 3, rows=8)) == "sentences 9-11/11, layer 1/3"
    assert batch.words(8 + 8 / 3, 11, Within(2, 3, rows=8)) == "sentences 9-11/11, layer 2/3"
    assert batch.words(16, 11, Within(3, 3, rows=8)) == ""  # through
    assert batch.words(0, 40, Within(1, 3, rows=8)) == "sentences 1-8/40, layer 1/3"
    assert shown.line("streaming", 0, 1, Within(1, 30)) is None  # 1 s: too soon within a sequence
    assert shown.line("streaming", 0, 1, Within(2, 30)) is None  # 2 s
    assert shown.line("streaming", 0, 1, Within(3, 30)) == "streaming: 0/1 sequences, sequence 1/1, layer 3/30 (12.0 s)"
    assert shown.line("streaming", 0, 1, Within(4, 30)) is None  # 13 s: 1 s after the last line
    assert shown.line("streaming", 1, 1) == "streaming: 1/1 sequences (14.0 s)"  # a step: always


@pytest.mark.parametrize("attention", ["auto", "eager"])
def test_analyze_reports_layers_of_a_long_document_and_the_numbers_stay(loaded, monkeypatch, attention):
    """The last layer comes as the batch ends: analysis stops the forward inside it (LastLayerDone)."""
    from attnprobe.analysis import analyze_loaded
    from attnprobe.planning import Options

    monkeypatch.setattr(layer_progress, "EVERY_SECONDS", 0.0)

    corpus = corpus_of([LONG_TEXT, "The cat sat."])
    steps, seen = [], []

    def progress(done, within=None):
        steps.append(done)
        if within is not None:
            seen.append(within)

    before = hooks_left(loaded.model)
    options = Options(attention=attention)
    plain = analyze_loaded(loaded, corpus, resamples=5, batch_size=1, progress=lambda done: None, options=options)
    watched = analyze_loaded(loaded, corpus, resamples=5, batch_size=1, progress=progress, options=options)
    assert watched.run["attention"]["path"] == plain.run["attention"]["path"]
    assert [w.layer for w in seen] == list(range(1, LAYERS + 1))  # the long document only, each layer in order
    assert sum(steps) == pytest.approx(2.0)  # the within-reports advance by nothing
    numbers = plain.heads.select_dtypes("number").columns
    assert np.array_equal(plain.heads[numbers].to_numpy(), watched.heads[numbers].to_numpy(), equal_nan=True)
    assert hooks_left(loaded.model) == before


def test_analyze_logs_the_layers_of_a_long_document_off_a_terminal(long_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(layer_progress, "LOG_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(layer_progress, "EVERY_SECONDS", 0.0)
    corpus = tmp_path / "doc.txt"
    corpus.write_text(LONG_TEXT + "\n", encoding="utf-8")
    result = run("analyze", "--model", long_llama, "--corpus", corpus, "--out", tmp_path / "o", "--device", "cpu",
                 "--resamples", 5, "--threads", 1)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("analyze:")]
    assert [line.split(" (")[0] for line in lines] == [
        f"analyze: 0/1 sentences, sentence 1/1, layer {layer}/{LAYERS}" for layer in range(1, LAYERS)] + \
        ["analyze: 1/1 sentences"], result.stderr


def test_retrieval_logs_the_layers_of_a_long_prefill(long_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(layer_progress, "LOG_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(layer_progress, "EVERY_SECONDS", 0.0)
    haystack = tmp_path / "hay.txt"
    haystack.write_text(LONG_TEXT, encoding="utf-8")
    result = run("retrieval", "--model", long_llama, "--haystack", haystack, "--out", tmp_path / "r", "--device",
                 "cpu", "--lengths", 1100, "--depths", "50", "--decode", "forced", "--needle", " Birds sing.",
                 "--resamples", 5, "--threads", 1)
    assert result.exit_code == 0, result.output
    lines = [line.split(" (")[0] for line in result.stderr.splitlines() if line.startswith("retrieval:")]
    assert lines == [f"retrieval: 0/1 trials, trial 1/1, layer {layer}/{LAYERS}" for layer in range(1, LAYERS)] + \
        ["retrieval: 1/1 trials"], result.stderr


def test_a_terminal_bar_names_the_sequence_and_layer(monkeypatch):
    """stage_progress on a terminal: the stage's bar reads 'streaming: sequence 1/1, layer 12/30' while the sequence
    runs, and the plain stage once a step comes."""
    import io
    import time

    from rich.console import Console

    from attnprobe.commands import common

    screen = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=screen, force_terminal=True, width=120))
    with common.stage_progress("sequences") as progress:
        progress("streaming", 0, 1, within=Within(12, 30))
        time.sleep(0.3)  # a refresh or two
        progress("streaming", 1, 1)
        time.sleep(0.3)
    shown = screen.getvalue()
    assert "streaming: sequence 1/1, layer 12/30" in shown, shown


def test_analyze_bar_names_the_layer_then_drops_it():
    from rich.progress import Progress

    lines = []
    shown = Shown("sentences", every=0, log=lines.append)
    with Progress(disable=True) as bar:
        task = bar.add_task("sentences", total=2)
        shown.advance(bar, task, 1 / 3)
        shown.advance(bar, task, 0.0, Within(1, 3))
        assert bar.tasks[0].description == "sentences: sentence 1/2, layer 1/3"
        shown.advance(bar, task, 2 / 3)
        shown.advance(bar, task, 0.0, Within(3, 3))  # through: the plain count again
        assert bar.tasks[0].description == "sentences" and bar.tasks[0].completed == pytest.approx(1.0)
    assert [line.split(" (")[0] for line in lines] == ["analyze: 0/2 sentences, sentence 1/2, layer 1/3",
                                                      "analyze: 1/2 sentences"]  # a sentence through: its count


def test_a_log_of_short_sentences_gets_a_count_line_every_interval():
    """Short sentences report no layers: off a terminal analyze's count comes as a line once `every` seconds have
    passed and a sentence is through (a batch advances by shares of a layer), never more often."""
    from rich.progress import Progress

    lines, now = [], [0.0]
    shown = Shown("sentences", every=10, clock=lambda: now[0], log=lines.append)
    with Progress(disable=True) as bar:
        task = bar.add_task("sentences", total=1000)
        for second in range(1, 61):  # a batch of 8 sentences a second, over 4 layers
            now[0] = float(second)
            for _ in range(4):
                shown.advance(bar, task, 8 / 4)
    assert [line.split(" (")[0] for line in lines] == [f"analyze: {8 * (s - 1) + 2}/1000 sentences"
                                                       for s in (10, 20, 30, 40, 50, 60)]
    assert [line.split(" (")[1] for line in lines] == [f"{s}.0 s)" for s in (10, 20, 30, 40, 50, 60)]
