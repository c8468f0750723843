"""`attnprobe retrieval`: Wu et al.'s retrieval score, against an independent eager recomputation and closed forms."""

import json

import numpy as np
import pytest
import torch
from conftest import SENTENCES, make_gpt2, make_llama
from typer.testing import CliRunner
from zoo import make

from attnprobe import io
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.export import load_scores
from attnprobe.model import load_model
from attnprobe.retrieval import build_prompt, retrieval, rouge1_recall, tabulate, top1_hits

runner = CliRunner()
HAYSTACK = " ".join(SENTENCES)
NEEDLE = " Birds sing."  # words of the tiny tokenizers' vocabulary
QUESTION = "Who wrote the letter?"
TIE = 1e-5  # float32 rows (cached decode vs one full pass) may order two keys closer than this differently


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_top1_hit_needs_the_span_and_the_token():
    ids = torch.tensor([5, 7, 9, 7, 3])  # [keys]; the needle is ids[1:4] = 7 9 7
    rows = torch.tensor([[[0.1, 0.6, 0.1, 0.1, 0.1],  # top key 1 (in the span, token 7)
                          [0.1, 0.1, 0.6, 0.1, 0.1],  # top key 2 (in the span, token 9)
                          [0.1, 0.1, 0.1, 0.1, 0.6],  # top key 4: outside the span
                          [0.6, 0.1, 0.1, 0.1, 0.1]]])  # top key 0: outside the span (token 5)
    assert top1_hits(rows, ids, 1, 4, token=7).tolist() == [[True, False, False, False]]
    assert top1_hits(rows, ids, 1, 4, token=9).tolist() == [[False, True, False, False]]
    assert top1_hits(rows, ids, 1, 4, token=3).tolist() == [[False, False, False, False]]  # 3 only outside
    tie = torch.tensor([[[0.4, 0.4, 0.2, 0.0, 0.0]]])  # a tie goes to the first key (outside the span here)
    assert top1_hits(tie, ids, 1, 4, token=7).tolist() == [[False]]
    cut = torch.tensor([[[-1.0, -1.0, 0.3, 0.7, 0.0]]])  # a sliding-window layer: -1 where no key is kept
    assert top1_hits(cut, ids, 1, 4, token=7).tolist() == [[True]]


def test_scores_in_closed_form():
    """A head that copies every needle token scores 1; one that copies k of n scores k / n; the mean and the
    Poisson-bootstrap interval are over trials, and the JSON lists each trial's score."""
    from attnprobe.retrieval import Trial

    def trial(hits):
        return Trial(8, 50.0, list(range(8)), 2, 6, [0] * 4, [0] * 4, np.array(hits), 1.0, True)

    trials = [trial([[4, 1]]), trial([[4, 3]]), trial([[2, 0]])]  # needle of 4 tokens, 1 layer, 2 heads
    assert np.allclose(trials[0].scores, [[1.0, 0.25]])
    frame, per_trial = tabulate(trials, kv_heads=1, resamples=200, seed=0)
    assert frame["mean"].tolist() == pytest.approx([10 / 12, 4 / 12])
    assert frame["kv_head"].tolist() == [0, 0] and frame["trials"].tolist() == [3, 3]
    assert per_trial == {"0-0": [1.0, 1.0, 0.5], "0-1": [0.25, 0.75, 0.0]}
    assert (frame["ci_low"] <= frame["mean"]).all() and (frame["mean"] <= frame["ci_high"]).all()
    assert rouge1_recall([7, 9, 1], [7, 9, 7]) == pytest.approx(2 / 3)


def test_prompt_puts_the_needle_after_a_sentence_end_at_the_depth():
    haystack = [1, 2, 0, 3, 4, 5, 0, 6]  # 0 is the period
    ids, start, end = build_prompt(haystack, [8, 9], [7], [99], length=12, depth=50, periods={0})
    assert len(ids) == 12 and ids[0] == 99 and ids[-1] == 7 and ids[start:end] == [8, 9]
    assert ids[start - 1] == 0  # right after a sentence end (budget 8, depth 50%: point 4 -> after index 2)
    assert build_prompt(haystack, [8, 9], [7], [], length=11, depth=0, periods={0})[1] == 0
    assert build_prompt(haystack, [8, 9], [7], [], length=11, depth=100, periods={0})[1:] == (7, 9)  # last "."
    assert build_prompt([1, 2, 3], [8, 9], [7], [], length=7, depth=50, periods={0})[1] == 2  # none: at the depth
    with pytest.raises(AttnprobeError, match="leaves no room for the haystack"):
        build_prompt(haystack, [8, 9], [7], [], length=3, depth=0, periods={0})


def eager_hits(loaded, trial):
    """The hits recomputed from one eager pass over prompt + answer with output_attentions, argmax in float64;
    also how many (step, layer, head) rows have a top-2 gap below TIE."""
    sequence = trial.ids + trial.answer
    input_ids = torch.tensor([sequence[:-1]])  # [1, n]: every query the decoding steps ran
    with torch.inference_mode():
        attentions = loaded.model(input_ids=input_ids, output_attentions=True).attentions
    hits = np.zeros((len(attentions), attentions[0].shape[1]), dtype=np.int64)  # [layer, head]
    ties = 0
    for step, token in enumerate(trial.answer):
        query = len(trial.ids) - 1 + step
        for layer, weights in enumerate(attentions):
            rows = weights[0, :, query, : query + 1].double()  # [head, keys]
            best = rows.topk(2, dim=-1).values
            ties += int((best[:, 0] - best[:, 1] < TIE).sum())
            top = rows.argmax(dim=-1)  # [head]
            for head, key in enumerate(top.tolist()):
                hits[layer, head] += trial.start <= key < trial.end and sequence[key] == token
    return hits, ties


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    return {
        "gpt2": make_gpt2(root / "gpt2", n_positions=128),
        "llama-gqa": make_llama(root / "llama", layers=2, heads=4, kv_heads=2, lm_head=True),
        # a window of 16: the needle at depth 100 lies inside it, at depth 0 outside (the cache drops those keys)
        "mistral-window": make("mistral (sliding window)", root / "mistral", lm_head=True, sliding_window=16),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
@pytest.mark.parametrize("decode", ["forced", "greedy"])
def test_scores_equal_an_eager_recomputation(models, name, decode):
    loaded = load_model(str(models[name]), "cpu", lm_head=True)
    result = retrieval(loaded, HAYSTACK, lengths=[30, 50], depths=[0, 40, 100], needle=NEEDLE, question=QUESTION,
                       decode=decode, resamples=20)
    assert len(result.trials) == 6
    total_ties = 0
    for trial in result.trials:
        expected, ties = eager_hits(loaded, trial)
        total_ties += ties
        if ties == 0:
            assert (trial.hits == expected).all(), (trial.length, trial.depth)
        else:
            assert np.abs(trial.hits - expected).sum() <= ties
        if decode == "forced":
            assert trial.answer == trial.ids[trial.start : trial.end]
    assert total_ties <= 6 * 4 * 2 * 3 // 10  # near-ties are rare in these random heads
    forced = [t for t in result.trials if decode == "forced"]
    if forced and name != "mistral-window":  # the needle's own tokens make hits possible: some head finds them
        assert sum(int(t.hits.sum()) for t in forced) > 0
    if name == "llama-gqa" and not result.heads.empty:
        assert result.heads["kv_head"].tolist() == [0, 0, 1, 1] * 2


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-window"])
def test_a_decoding_steps_rows_are_the_full_pass_rows(models, name):
    """The cached decode's row of every head, placed at absolute key positions, equals the eager full pass's row;
    a sliding-window cache holds only its last keys, and the keys it dropped read -1 (never a top-1 key)."""
    from attnprobe.retrieval import decode_step, prefill

    loaded = load_model(str(models[name]), "cpu", lm_head=True)
    ids = list(range(1, 41))
    with torch.inference_mode():
        cache, _ = prefill(loaded, ids[:-1])
        rows, _, _ = decode_step(loaded, cache, ids[-1], len(ids))  # [layer, head, keys]
        full = loaded.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    expected = torch.stack([a[0, :, -1, :] for a in full])  # [layer, head, keys]
    kept = rows >= 0
    assert torch.allclose(rows[kept], expected[kept], atol=1e-6)
    assert (expected[~kept] == 0).all()  # dropped keys are outside the window
    if name == "mistral-window":
        assert int(kept[0, 0].sum()) < len(ids)  # the cache dropped keys: the offsets were exercised


def test_cli_writes_the_table_the_json_and_export_reads_them(models, tmp_path):
    haystack = tmp_path / "haystack.txt"
    haystack.write_text(HAYSTACK, encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("retrieval", "--model", models["llama-gqa"], "--haystack", haystack, "--out", out,
                    "--lengths", "30,50", "--depths", "0,50,100", "--needle", NEEDLE, "--question", QUESTION,
                    "--decode", "forced", "--resamples", 50, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    info = json.loads((out / io.RETRIEVAL_RUN_FILE).read_text())
    assert info["decode"] == "forced" and info["trials_scored"] == info["trials_total"] == 6
    assert info["prefill"] == ["sdpa"] and info["model"]["kv_heads"] == 2
    scores = json.loads((out / io.RETRIEVAL_SCORES_FILE).read_text())
    assert list(scores) == [f"{la}-{h}" for la in range(2) for h in range(4)]
    assert all(len(v) == 6 for v in scores.values())
    table = io.read_table(out, io.RETRIEVAL_FILE, ["layer", "head", "kv_head", "mean", "ci_low", "ci_high"],
                          "attnprobe retrieval")
    assert np.allclose(table["mean"], [np.mean(scores[f"{r.layer}-{r.head}"]) for r in table.itertuples()])
    exported = load_scores(out, sink=4, recent=16)
    assert exported.source == "retrieval" and exported.per_trial == scores


def test_a_model_that_never_copies_gets_a_note_not_a_table(models, tmp_path):
    haystack = tmp_path / "haystack.txt"
    haystack.write_text(HAYSTACK, encoding="utf-8")
    out = tmp_path / "out"
    (out).mkdir()
    (out / io.RETRIEVAL_FILE).write_text("stale")  # an earlier run's table must not stay beside this run's record
    result = invoke("retrieval", "--model", models["gpt2"], "--haystack", haystack, "--out", out, "--lengths", "30",
                    "--depths", "50", "--needle", NEEDLE, "--question", QUESTION, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    info = json.loads((out / io.RETRIEVAL_RUN_FILE).read_text())
    if info["trials_copied"] == 0:  # a random tiny model: it does not copy
        assert "copied the needle in none" in result.output and "--decode forced" in result.output
        assert not (out / io.RETRIEVAL_FILE).exists() and not (out / io.RETRIEVAL_SCORES_FILE).exists()
        with pytest.raises(AttnprobeError, match="scored no trial"):
            load_scores(out, sink=4, recent=16)


def test_bad_inputs_are_one_line_errors(models, tmp_path):
    haystack = tmp_path / "haystack.txt"
    haystack.write_text(HAYSTACK, encoding="utf-8")
    cases = [
        (["--lengths", "500"], "does not fit"),
        (["--lengths", "a,b"], "give numbers separated by commas"),
        (["--depths", "150"], "percents between 0 and 100"),
    ]
    for extra, message in cases:
        result = invoke("retrieval", "--model", models["gpt2"], "--haystack", haystack, "--out", tmp_path / "o",
                        "--device", "cpu", *extra)
        assert result.exit_code == 1 and message in result.output, result.output
    result = invoke("retrieval", "--model", models["gpt2"], "--haystack", tmp_path / "none.txt", "--out",
                    tmp_path / "o")
    assert result.exit_code == 1 and "--haystack file not found" in result.output
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    result = invoke("retrieval", "--model", models["gpt2"], "--haystack", empty, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "is empty" in result.output
