"""The corpus streams: read_corpus holds no text, a run holds one window of sentences at a time.

Windows of WINDOW_SENTENCES sentences are tokenized, sorted by length and batched on their own; with
tiny windows (monkeypatched) a run must give the results of one window holding the whole corpus, and a
stopped run must still resume to identical results.
"""

import numpy as np
import pandas as pd
import pytest
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_cli import run

from attnprobe import analysis, batching, distributed, metrics, planning
from attnprobe.analysis import analyze_loaded
from attnprobe.batching import batch_count, windows
from attnprobe.corpus import Sentence, read_corpus
from attnprobe.errors import AttnprobeError
from attnprobe.model import load_model
from attnprobe.resume import Checkpointing, Stopped


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "c.txt"
    path.write_text("Untagged first.\n# category: a\n" + "\n".join(SENTENCES[:4]) + "\n# category: b\n"
                    + "\n".join(SENTENCES[4:]) + "\n", encoding="utf-8")
    return path


def test_read_corpus_holds_no_sentences_and_streams_them_again(tagged):
    corpus = read_corpus(tagged)
    assert corpus._held is None and "sentences" not in vars(corpus)  # nothing read into memory yet
    assert len(corpus) == 1 + len(SENTENCES) and corpus.tagged and corpus.labels == (None, "a", "b")
    first, second = list(corpus.stream()), list(corpus.stream())
    assert first == second and first[0] == Sentence("Untagged first.", 1, None) and first[1].category == "a"


def test_a_file_changed_while_streaming_is_refused(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("One.\nTwo.\n", encoding="utf-8")
    corpus = read_corpus(path)
    path.write_text("One.\nTwo!\n", encoding="utf-8")
    with pytest.raises(AttnprobeError, match="changed while attnprobe was reading it"):
        list(corpus.stream())


def test_windows_cover_the_stream_in_order():
    items = [Sentence(str(i), i + 1, None) for i in range(7)]
    got = list(windows(iter(items), 3))
    assert [(first, [s.text for s in w]) for first, w in got] == [(0, ["0", "1", "2"]), (3, ["3", "4", "5"]),
                                                                   (6, ["6"])]


@pytest.mark.parametrize("size,rank,world_size,window,expected", [
    (10, 0, 1, 4, 2 + 2 + 1),  # windows of 4, 4, 2 sentences in batches of 2
    (10, 0, 2, 4, 1 + 1 + 1),  # rank 0 gets indices 0, 2 | 4, 6 | 8
    (10, 1, 2, 3, 1 + 1 + 1 + 1),  # rank 1: 1 | 3, 5 | 7 | 9
])
def test_batch_count(monkeypatch, size, rank, world_size, window, expected):
    monkeypatch.setattr(batching, "WINDOW_SENTENCES", window)
    world = distributed.World(rank=rank, size=world_size, local_rank=rank)
    assert batch_count(size, 2, world) == expected


@pytest.mark.parametrize("batch_size,batches,expected", [
    (2, 3, ([2, 2, 2], 8)),  # windows of 4, 4, 2 sentences: batches of 2, 2 | 2, 2 | 2
    (3, 3, ([3, 1, 3], 8)),  # batches of 3, 1 | 3, 1 | 2: a window's last batch is shorter
    (3, 5, ([3, 1, 3, 1, 2], 10)),
    (3, 9, ([3, 1, 3, 1, 2], 10)),  # more than the run has: all of them
    (3, 0, ([], 0)),
])
def test_batch_sizes_follow_the_windows(monkeypatch, batch_size, batches, expected):
    """The sizes of a rank's first batches and the corpus index after their last window, as batch_count counts."""
    monkeypatch.setattr(batching, "WINDOW_SENTENCES", 4)
    world = distributed.World(rank=0, size=1, local_rank=0)
    assert batching.batch_sizes(10, batch_size, world, batches) == expected
    assert len(batching.batch_sizes(10, batch_size, world, 10**6)[0]) == batch_count(10, batch_size, world)


def test_small_windows_give_the_results_of_one_window(gpt2_dir, tagged, monkeypatch):
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged)
    whole = analyze_loaded(loaded, corpus, batch_size=2, resamples=50, keep_per_sentence=True)
    monkeypatch.setattr(batching, "WINDOW_SENTENCES", 3)
    windowed = analyze_loaded(loaded, corpus, batch_size=2, resamples=50, keep_per_sentence=True)
    # the same sentences' values: batches differ only in padding, so equal to float32 rounding
    np.testing.assert_allclose(windowed.per_sentence["entropy"], whole.per_sentence["entropy"], atol=1e-5)
    pd.testing.assert_frame_equal(windowed.heads, whole.heads, atol=1e-5)
    pd.testing.assert_frame_equal(windowed.categories, whole.categories, atol=1e-5)
    pd.testing.assert_frame_equal(windowed.positions, whole.positions, atol=1e-5)
    np.testing.assert_allclose(windowed.example["maps"], whole.example["maps"], atol=1e-5)
    assert windowed.run["example_sentence"] == whole.run["example_sentence"]
    assert windowed.run["tokens"] == whole.run["tokens"] and windowed.run["sentences"] == len(corpus)


def test_a_run_over_many_windows_resumes_to_identical_results(gpt2_dir, tagged, monkeypatch):
    monkeypatch.setattr(batching, "WINDOW_SENTENCES", 3)
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged)
    whole = analyze_loaded(loaded, corpus, batch_size=2, resamples=50)
    saved = []
    calls = iter(range(100))  # stop after the 4th batch: inside the second window of 3 sentences
    stopping = Checkpointing(save=saved.append, every_seconds=1e9, should_stop=lambda: next(calls) >= 3)
    with pytest.raises(Stopped, match="stopped after 4 of 6 batches"):
        analyze_loaded(loaded, corpus, batch_size=2, resamples=50, checkpointing=stopping)
    resumed = analyze_loaded(loaded, corpus, batch_size=2, resamples=50,
                             checkpointing=Checkpointing(save=saved.append, resume_from=saved[0]))
    for name in ("heads", "layers", "positions", "categories"):
        pd.testing.assert_frame_equal(getattr(resumed, name), getattr(whole, name), check_exact=True)
    np.testing.assert_array_equal(resumed.example["maps"], whole.example["maps"])


def test_the_truncation_warning_names_the_lines(tmp_path):
    from conftest import make_gpt2

    model = make_gpt2(tmp_path / "short", n_positions=8)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join([SENTENCES[2], SENTENCES[0], SENTENCES[1]]) + "\n", encoding="utf-8")  # 3, 7, 14
    result = run("analyze", "--model", model, "--corpus", corpus, "--out", tmp_path / "out", "--device", "cpu",
                 "--resamples", "5")
    assert result.exit_code == 0, result.output
    assert "1 sentence(s) were longer than the model's 8 tokens and were truncated: line 3 (6 tokens over the limit)" \
        in " ".join(result.stderr.split())


def test_examples_span_categories_and_lengths_and_match_each_sentence_alone(gpt2_dir, tagged, tmp_path):
    loaded = load_model(str(gpt2_dir), "cpu")
    result = analyze_loaded(loaded, read_corpus(tagged), batch_size=2, resamples=5)
    examples = result.examples
    assert 2 <= len(examples) <= batching.EXAMPLES
    assert examples[0]["index"] == result.run["example_sentence"]["index"]  # the plot's example comes first
    assert len({e["index"] for e in examples}) == len(examples)
    assert {"a", "b"} <= {e["category"] for e in examples}  # each category has one
    for example in examples:
        alone = tmp_path / f"alone{example['index']}.txt"
        alone.write_text(example["sentence"] + "\n", encoding="utf-8")
        single = analyze_loaded(loaded, read_corpus(alone), batch_size=1, resamples=5)
        np.testing.assert_allclose(example["maps"], single.example["maps"], atol=1e-5)
        assert example["tokens"] == single.example["tokens"]


def _counting(monkeypatch, module, name):
    """Wrap module.`name` to record the length of its second argument (sentences, ids) at each call."""
    calls = []
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(len(args[1]) if name == "tokenize_sentences" else 1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("window", [None, 3])
def test_a_window_is_tokenized_once(monkeypatch, gpt2_dir, tagged, window):
    """The scan's ids of the first window serve the measuring pass; only later windows are tokenized again."""
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged)
    whole = analyze_loaded(loaded, corpus, batch_size=2, resamples=5)
    if window:
        monkeypatch.setattr(batching, "WINDOW_SENTENCES", window)
    calls = _counting(monkeypatch, batching, "tokenize_sentences")
    again = analyze_loaded(loaded, corpus, batch_size=2, resamples=5)
    assert sum(calls) == len(corpus) + (len(corpus) - window if window else 0)
    pd.testing.assert_frame_equal(again.heads, whole.heads, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("attention", ["auto", "eager"])
def test_a_run_is_planned_once(monkeypatch, gpt2_dir, tagged, attention):
    """The attention path and the value-weighted plan are decided once per run (planning.plan), not per batch."""
    loaded = load_model(str(gpt2_dir), "cpu")
    paths = _counting(monkeypatch, planning, "attention_path")
    weighted = _counting(monkeypatch, planning, "value_weighted_plan")
    result = analyze_loaded(loaded, read_corpus(tagged), batch_size=2, resamples=5,
                            options=planning.Options(attention=attention))
    assert sum(result.run["attention"]["sequences"].values()) == len(read_corpus(tagged)) > 2  # several batches
    assert (len(paths), len(weighted)) == (1, 1)


@pytest.mark.parametrize("attention", ["blocked", "eager"])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_examples_come_from_the_corpus_pass(monkeypatch, gpt2_dir, tagged, attention, batch_size):
    """The other examples' maps are taken from their batches (no pass of their own, but for one whose batch
    already gave the blocked path's single example) and equal each sentence run alone."""
    loaded = load_model(str(gpt2_dir), "cpu")
    corpus = read_corpus(tagged)
    options = planning.Options(attention=attention)
    calls = _counting(monkeypatch, analysis, "measure_batch")
    result = analyze_loaded(loaded, corpus, batch_size=batch_size, resamples=5, options=options)
    batches = batch_count(len(corpus), batch_size, distributed.current())
    extra = len(calls) - batches  # examples run alone after the corpus pass
    scanned = batching.scan(loaded, corpus)
    assert len(result.examples) == 1 + len(scanned.others) >= 3
    if attention == "eager" or batch_size == 1:
        assert extra == 0
    elif batch_size < len(corpus):  # blocked: one sentence's maps per batch; others sharing it run alone
        assert extra < len(scanned.others)
    shape = analysis.Shape(names=metrics.METRICS, bin_names=metrics.POSITION_METRICS, layers=loaded.num_layers,
                           heads=loaded.num_heads, bins=1, resamples=1, seed=0, categories=())
    alone = analysis.more_examples(loaded, planning.plan(loaded, options), scanned, shape)
    for got, want in zip(result.examples[1:], alone):
        assert (got["index"], got["tokens"], got["total_tokens"]) == (want["index"], want["tokens"],
                                                                       want["total_tokens"])
        np.testing.assert_allclose(got["maps"], want["maps"], atol=1e-5)
