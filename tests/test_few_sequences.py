"""Runs of fewer than 10 sequences: block-bootstrap intervals over query rows, and wording that says so.

The oracle: every row's scores straight from transformers' own attention maps (test_reference's
definitions), resampled by the same blocks (`BlockResampler` with the run's seed and each sequence's
index), averaged over sequences per resample. analyze's resamples.npz must equal it on every path.
"""

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from test_cli import run
from test_reference import SINK, WINDOW, reference_row_scores

from attnprobe.analysis import analyze_loaded
from attnprobe.bootstrap import BlockResampler, block_length, interval
from attnprobe.corpus import Corpus, Sentence
from attnprobe.metrics import METRICS
from attnprobe.model import load_model
from attnprobe.planning import Options
from attnprobe.tables import few_sentences_note

RESAMPLES, SEED = 60, 3


def corpus_of(texts: list[str], categories: list[str | None] | None = None) -> Corpus:
    categories = categories or [None] * len(texts)
    return Corpus(Path("x.txt"), "-", [Sentence(t, i + 1, c) for i, (t, c) in enumerate(zip(texts, categories))])


def reference_rows(model, tokenizer, text: str, causal: bool) -> dict[str, np.ndarray]:
    """Per score [layer, head, row]: each row's value from the eager maps, NaN where it has none."""
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        maps = model(**ids, output_attentions=True).attentions  # per layer [1, head, n, n]
    n = ids["input_ids"].shape[1]
    out = {name: np.full((len(maps), maps[0].shape[1], n), np.nan) for name in METRICS}
    for layer, attention in enumerate(maps):
        for head in range(attention.shape[1]):
            p = attention[0, head].double().numpy()  # [query, key]
            for i in range(n):
                for name, value in reference_row_scores(p, i, n, causal).items():
                    out[name][layer, head, i] = value
    return out


def reference_resamples(loaded, texts: list[str]) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Per score [resample, layer, head]: the mean over sequences of each one's block-resampled row means; and per
    sequence, per score [resample, layer, head] (for the categories)."""
    per_sequence = []
    for index, text in enumerate(texts):
        rows = reference_rows(loaded.model, loaded.tokenizer, text, loaded.causal)
        layers, heads, n = rows["entropy"].shape
        resampler = BlockResampler.draw(index, n, RESAMPLES, SEED)
        per_sequence.append({name: resampler.means(values.reshape(layers * heads, n)).reshape(-1, layers, heads)
                             for name, values in rows.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = {name: np.nanmean([s[name] for s in per_sequence], axis=0) for name in METRICS}
    return means, per_sequence


def assert_close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, expected, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE, err_msg=what)


@pytest.mark.parametrize("attention", ["blocked", "fused", "eager"])
@pytest.mark.parametrize("which", ["gpt2", "minilm"])
def test_block_resamples_equal_the_reference(which, attention, request):
    loaded = load_model(str(request.getfixturevalue("gpt2_dir")), "cpu") if which == "gpt2" else \
        request.getfixturevalue("minilm")
    texts = SENTENCES[:3]
    options = Options(attention=attention, sink=SINK, window=WINDOW, block_rows=4)  # block borders inside sentences
    result = analyze_loaded(loaded, corpus_of(texts), batch_size=2, resamples=RESAMPLES, seed=SEED, options=options)
    assert result.run["attention"]["path"] == attention and result.run["bootstrap"]["method"] == "block"
    expected, _ = reference_resamples(loaded, texts)
    for name in METRICS:
        assert_close(result.resamples[name], expected[name], name)
        low, high = interval(expected[name])
        assert_close(result.heads[f"{name}_ci_low"].to_numpy(), low.ravel(), name)
        assert_close(result.heads[f"{name}_ci_high"].to_numpy(), high.ravel(), name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer_low, _ = interval(np.nanmean(expected["entropy"], axis=2))  # [layer]: the mean over heads
    assert_close(result.layers["entropy_ci_low"].to_numpy(), layer_low, "layers")
    tokens = [len(loaded.tokenizer(t)["input_ids"]) for t in texts]
    assert result.run["bootstrap"]["sequence_rows"] == tokens
    assert result.run["bootstrap"]["block_lengths"] == [block_length(n) for n in tokens]


def test_block_resamples_do_not_depend_on_the_batches_and_categories_use_them(gpt2_dir):
    loaded = load_model(str(gpt2_dir), "cpu")
    texts, tags = SENTENCES[:4], ["a", "b", "a", "b"]
    options = Options(sink=SINK, window=WINDOW)
    one = analyze_loaded(loaded, corpus_of(texts, tags), batch_size=1, resamples=RESAMPLES, seed=SEED,
                         options=options)
    four = analyze_loaded(loaded, corpus_of(texts, tags), batch_size=4, resamples=RESAMPLES, seed=SEED,
                          options=options)
    for name in METRICS:
        assert_close(one.resamples[name], four.resamples[name], name)
    _, per_sequence = reference_resamples(loaded, texts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        by_head = [np.nanmean(s["entropy"], axis=2) for s in per_sequence]  # per sequence [resample, layer]
    points = [np.nanmean(reference_rows(loaded.model, loaded.tokenizer, t, True)["entropy"], axis=2).mean(axis=1)
              for t in texts]  # per sequence [layer]: the mean over rows, then over heads
    for category, members in (("a", [0, 2]), ("b", [1, 3])):
        low, high = interval(np.mean([by_head[k] for k in members], axis=0))  # [layer] each
        rows = one.categories[one.categories["category"] == category]
        assert_close(rows["entropy_ci_low"].to_numpy(), low, category)
        assert_close(rows["entropy_ci_high"].to_numpy(), high, category)
        assert_close(rows["entropy"].to_numpy(), np.mean([points[k] for k in members], axis=0), category)
        assert (rows["sentences"] == 2).all()


# ---- one long document from the command line -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_document(tmp_path_factory, llama_dir):
    """`analyze --split file` on one ~110-token document, then `report`."""
    folder = tmp_path_factory.mktemp("fewseq")
    document = folder / "doc.txt"
    document.write_text(" ".join(SENTENCES[:8]) + "\n", encoding="utf-8")
    out = folder / "out"
    analyzed = run("analyze", "--model", llama_dir, "--corpus", document, "--split", "file", "--out", out,
                   "--device", "cpu", "--sink-tokens", "1", "--window", "8", "--resamples", "200")
    reported = run("report", "--out", out)
    return out, analyzed, reported


def test_one_document_gets_intervals_of_some_width_around_the_point(one_document):
    out, analyzed, _ = one_document
    assert analyzed.exit_code == 0, analyzed.output
    info = json.loads((out / "run.json").read_text())
    assert info["sentences"] == 1
    rows = info["tokens"]
    assert info["bootstrap"] | {"block_rule": None} == {
        "resamples": 200, "seed": 0, "confidence": 0.95, "method": "block",
        "over": "query rows, in blocks within each sequence", "sequence_rows": [rows],
        "block_lengths": [block_length(rows)], "block_rule": None}
    heads = pd.read_csv(out / "heads.csv")
    for name in ("entropy", "entropy_norm", "diagonal", "first_token", "distance", "sink_window"):
        low, point, high = heads[f"{name}_ci_low"], heads[name], heads[f"{name}_ci_high"]
        assert (high - low > 1e-6 * np.maximum(1.0, point.abs())).all(), name  # not zero width
        assert ((low <= point) & (point <= high)).all(), name
    for key in ("early_entropy", "late_entropy", "difference"):
        low, high = info["summary"][f"{key}_ci"]
        assert low < info["summary"][key] < high, key


def test_one_document_says_what_its_intervals_are_over(one_document):
    out, analyzed, reported = one_document
    info = json.loads((out / "run.json").read_text())
    block = block_length(info["tokens"])
    assert len(info["notes"]) == 1 and info["notes"][0].startswith("only 1 sequence: the 95% intervals come from a "
                                                                  f"block bootstrap over the query rows within it "
                                                                  f"(blocks of {block} rows), not over sentences")
    assert "Warning: only 1 sequence" in analyzed.stderr
    caption = " ".join(analyzed.stdout.split())  # rich wraps the table's caption
    assert f"intervals: block bootstrap over the query rows of 1 sequence, blocks of {block} rows, 200 resamples; " \
           "not intervals over sentences (see the warning)" in caption
    assert "another sample" not in caption
    assert reported.exit_code == 0, reported.output
    page = (out / "report.html").read_text(encoding="utf-8")
    summary = page[page.index('id="summary"'):].split("</p>")[0]
    assert "block bootstrap over the query rows of 1 sequence" in summary
    assert "would survive" not in page and "another sample of sentences" not in summary
    assert "only 1 sequence: the 95% intervals come from a block bootstrap" in page  # run.json's notes
    assert "block bootstrap over the query rows of 1 sequence" in page[page.index('id="provenance"'):]
    assert '"intervalsOver":"blocks of query rows"' in page  # the layer chart's caption


def test_few_sentences_note_names_the_blocks():
    assert few_sentences_note(10) is None
    note = few_sentences_note(3, [4, 5, 5])
    assert note.startswith("only 3 sequences: the 95% intervals come from a block bootstrap over the query rows "
                           "within each (blocks of 4-5 rows), not over sentences")
    assert "say nothing about another sample of sentences" in note


# ---- compare, probe and ablate ----------------------------------------------------------------------------------


def test_compare_pairs_block_runs_only_over_the_same_rows(gpt2_dir, llama_dir, tmp_path):
    from attnprobe.compare import compare

    document = tmp_path / "doc.txt"
    document.write_text(" ".join(SENTENCES[:4]) + "\n", encoding="utf-8")  # within tiny GPT-2's 64 positions
    folders = {}
    for name, model in (("gpt2", gpt2_dir), ("again", gpt2_dir), ("llama", llama_dir)):
        folders[name] = tmp_path / name
        result = run("analyze", "--model", model, "--corpus", document, "--split", "file", "--out", folders[name],
                     "--device", "cpu", "--resamples", "100")
        assert result.exit_code == 0, result.output
    same = compare(folders["gpt2"], folders["again"])
    assert same.info["pairing"] == "paired" and "drew the same query rows (block bootstrap)" in \
        same.info["pairing_reason"]
    assert same.info["bootstrap_over"] == "query rows"
    assert (same.heads["entropy_diff_ci_low"] == 0).all()  # the same rows in both runs: B_r - A_r = 0
    assert same.info["notes"][0].startswith("A has only 1 sequence: its intervals, and those of the differences, "
                                            "come from a block bootstrap over query rows")
    other = compare(folders["gpt2"], folders["llama"])  # the Llama tokenizer adds BOS: other rows
    assert other.info["pairing"] == "unpaired"
    assert "the sequences' query rows differ" in other.info["pairing_reason"]
    assert "(independent samples of query rows)" in other.info["pairing_reason"]


def test_probe_and_ablate_warn_below_ten(gpt2_dir, tmp_path):
    probed = run("probe", "--model", gpt2_dir, "--lengths", "4", "--sequences", "3", "--resamples", "20",
                 "--out", tmp_path / "probe", "--device", "cpu")
    assert probed.exit_code == 0, probed.output
    note = "only 3 random sequences: 95% intervals from a bootstrap over fewer than 10 random sequences mean little"
    assert json.loads((tmp_path / "probe" / "probe.json").read_text())["notes"][0].startswith(note)
    assert f"Warning: {note}" in " ".join(probed.stderr.split())
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES[:2]) + "\n", encoding="utf-8")
    ablated = run("ablate", "--model", gpt2_dir, "--corpus", corpus, "--out", tmp_path / "ablate", "--device", "cpu",
                  "--resamples", "20", "--no-pruning")
    assert ablated.exit_code == 0, ablated.output
    note = "only 2 sentences: 95% intervals from a bootstrap over fewer than 10 sentences mean little"
    assert json.loads((tmp_path / "ablate" / "ablate.json").read_text())["notes"][0].startswith(note)
    assert f"Warning: {note}" in " ".join(ablated.stderr.split())
    again = run("probe", "--model", gpt2_dir, "--lengths", "4,5", "--sequences", "5", "--resamples", "20",
                "--out", tmp_path / "probe", "--device", "cpu")  # 10 sequences in all
    assert json.loads((tmp_path / "probe" / "probe.json").read_text())["notes"] == [] and "Warning" not in again.stderr


@pytest.mark.parametrize(("bootstrap", "sentences", "verdict"), [
    ({"method": "poisson"}, 100, "so the gradient would survive another sample of sentences"),
    ({"method": "poisson"}, 5, "but an interval over fewer than 10 sentences means little"),  # a run from before
    ({"method": "block", "block_lengths": [12]}, 1, "so the gradient holds along these sequences' rows"),
])
def test_only_a_bootstrap_over_enough_sentences_speaks_of_another_sample(bootstrap, sentences, verdict):
    from attnprobe.report import summary_sentence

    run_info = {"sentences": sentences, "bootstrap": bootstrap, "summary": {
        "early_entropy": 2.0, "late_entropy": 1.0, "difference": 1.0, "early_layers": [0, 0], "late_layers": [1, 1],
        "difference_ci": [0.5, 1.5]}}
    sentence = summary_sentence(run_info)
    assert verdict in sentence
    assert ("another sample of sentences" in sentence) == (sentences == 100)
    run_info["summary"]["difference_ci"] = [-0.5, 1.5]
    assert "the interval includes 0" in summary_sentence(run_info)
