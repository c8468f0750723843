"""`attnprobe export`: DuoAttention's folder and Retrieval_Head's JSON, read back the way those tools read them."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import make_llama, restamp, unstamp
from typer.testing import CliRunner

from attnprobe import io
from attnprobe.cli import app
from attnprobe.errors import AttnprobeError
from attnprobe.export import HeadScores, duo_attention, kv_scores, load_scores, pool_kv_heads

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def duo_load(folder):
    """DuoAttention's duo_attn/utils.py load_attn_pattern and kvpress 0.5.5's DuoAttentionPress
    .load_attention_pattern, on a local folder: loadtxt with a tab delimiter, clip to [0, 1], json config."""
    scores = np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t")
    scores = np.clip(scores, 0, 1)
    config = json.loads((folder / "config.json").read_text())
    return config["sink_size"], config["recent_size"], scores


@pytest.fixture(scope="module")
def gqa_run(tmp_path_factory):
    """analyze of a tiny Llama with 3 layers, 4 query heads and 2 KV heads, short enough sinks and window that
    sink_window is defined."""
    root = tmp_path_factory.mktemp("export")
    model = make_llama(root / "llama", layers=3, heads=4, kv_heads=2)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(["The bridge was painted by two workers in the early spring of last year ."] * 12),
                      encoding="utf-8")
    out = root / "run"
    result = invoke("analyze", "--model", model, "--corpus", corpus, "--out", out, "--sink-tokens", 2,
                    "--window", 3, "--resamples", 20, "--threads", 1)
    assert result.exit_code == 0, result.output
    return out


def test_pooling_takes_the_largest_score_of_each_kv_heads_query_heads():
    per_query = np.array([[0.1, 0.7, 0.2, 0.3], [0.0, 0.0, 0.9, 0.4]])  # [layer, head], 2 query heads per KV head
    assert pool_kv_heads(per_query, 2).tolist() == [[0.7, 0.3], [0.0, 0.9]]
    assert pool_kv_heads(per_query, 4).tolist() == per_query.tolist()  # multi-head: one each
    assert pool_kv_heads(per_query, 1).tolist() == [[0.7], [0.9]]  # multi-query: every head shares one
    with pytest.raises(AttnprobeError, match="kv_heads 3 does not divide the 4"):
        pool_kv_heads(per_query, 3)


def test_kv_score_is_one_minus_sink_window_and_undefined_keeps_the_full_cache():
    heads = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "sink_window": [0.9, np.nan, 0.25, 1.0]})
    assert np.allclose(kv_scores(heads, 2, 2), [[0.1, 1.0], [0.75, 0.0]])
    scores = HeadScores(kv_scores(heads, 2, 2), "kv", {"spec": "m", "layers": 2, "heads": 2, "kv_heads": 1}, 4, 256)
    table, config = duo_attention(scores)
    assert np.allclose(table, [[1.0], [0.75]]) and config == {"sink_size": 4, "recent_size": 256}


def test_duo_attention_folder_loads_as_duo_attention_and_kvpress_read_it(gqa_run, tmp_path):
    result = invoke("export", "--out", gqa_run, "--format", "duo-attention", "--to", tmp_path / "duo")
    assert result.exit_code == 0, result.output
    sink, recent, scores = duo_load(tmp_path / "duo")
    assert (sink, recent) == (2, 3)  # the run's --sink-tokens and --window
    assert scores.shape == (3, 2)  # [layers, KV heads]
    heads = pd.read_csv(gqa_run / "heads.csv")
    heads["share"] = ((1 - heads["sink_window"]) / (1 - heads["first_token"])).clip(0, 1)  # the kv score
    expected = np.zeros((3, 2))
    for (layer, kv), group in heads.groupby([heads["layer"], heads["head"] // 2]):
        expected[layer, kv] = group["share"].max()  # the KV head needs the cache if any reader does
    assert np.allclose(scores, expected, atol=1e-7)  # written with 8 significant digits
    # kvpress: the lowest round(size x ratio) KV heads become streaming; ours must be the ones with the least far share
    streaming = np.unravel_index(np.argsort(scores, axis=None)[:2], scores.shape)
    assert set(zip(*map(list, streaming))) == set(zip(*np.unravel_index(np.argsort(expected, axis=None)[:2],
                                                                          expected.shape)))


def test_retrieval_head_json_from_sink_window(gqa_run, tmp_path):
    result = invoke("export", "--out", gqa_run, "--format", "retrieval-head", "--to", tmp_path / "rh")
    assert result.exit_code == 0, result.output
    [path] = [p for p in (tmp_path / "rh").iterdir() if p.name != "attnprobe.json"]  # beside export's record
    assert path.name == "llama.json"
    scores = json.loads(path.read_text())  # one line, as Retrieval_Head writes it
    assert len(path.read_text().splitlines()) == 1
    heads = pd.read_csv(gqa_run / "heads.csv")
    assert list(scores) == [f"{layer}-{head}" for layer in range(3) for head in range(4)]
    for row in heads.itertuples():
        share = min(1.0, (1 - row.sink_window) / (1 - row.first_token))  # the kv score
        assert scores[f"{row.layer}-{row.head}"] == pytest.approx([share], abs=1e-7)


def write_retrieval(folder, spec="m", layers=2, heads=4, kv_heads=2, means=None):
    """A results folder as `attnprobe retrieval` writes it (for export's reading side)."""
    folder.mkdir(parents=True, exist_ok=True)
    means = np.arange(layers * heads).reshape(layers, heads) / (layers * heads) if means is None else np.asarray(means)
    rows = [{"layer": la, "head": h, "kv_head": h // (heads // kv_heads), "mean": means[la, h]}
            for la in range(layers) for h in range(heads)]
    pd.DataFrame(rows).to_csv(folder / io.RETRIEVAL_FILE, index=False)
    trials = {f"{la}-{h}": [float(means[la, h])] * 2 for la in range(layers) for h in range(heads)}
    (folder / io.RETRIEVAL_SCORES_FILE).write_text(json.dumps(trials))
    record = {"model": {"spec": spec, "source": spec, "layers": layers, "heads": heads, "kv_heads": kv_heads}}
    (folder / io.RETRIEVAL_RUN_FILE).write_text(json.dumps(record))
    return folder


def test_retrieval_scores_win_where_retrieval_ran(tmp_path):
    folder = write_retrieval(tmp_path / "r")
    scores = load_scores(folder, sink=8, recent=64)
    assert scores.source == "retrieval"
    table, config = duo_attention(scores)
    assert np.allclose(table, np.array([[1, 3], [5, 7]]) / 8) and config == {"sink_size": 8, "recent_size": 64}
    result = invoke("export", "--out", folder, "--to", tmp_path / "duo", "--sink-size", 8, "--recent-size", 64)
    assert result.exit_code == 0, result.output
    assert np.allclose(duo_load(tmp_path / "duo")[2], table)
    result = invoke("export", "--out", folder, "--format", "retrieval-head", "--to", tmp_path / "rh",
                    "--sink-size", 8, "--recent-size", 64)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "rh" / "m.json").read_text())["1-3"] == [7 / 8, 7 / 8]


def test_retrieval_beside_analyze_of_the_same_model_takes_its_sink_and_window(gqa_run, tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(gqa_run, folder)
    run = json.loads((folder / "run.json").read_text())
    write_retrieval(folder, spec=run["model"]["spec"], layers=3, heads=4, kv_heads=2)
    scores = load_scores(folder)
    assert scores.source == "retrieval" and (scores.sink, scores.recent) == (2, 3)
    assert load_scores(folder, "kv").source == "kv"
    write_retrieval(folder, spec="another", layers=3, heads=4, kv_heads=2)
    with pytest.raises(AttnprobeError, match="retrieval.json is of another but run.json of"):
        load_scores(folder)


def test_bad_inputs_are_one_line_errors(gqa_run, tmp_path):
    missing = tmp_path / "nothing"
    result = invoke("export", "--out", missing, "--to", tmp_path / "duo")
    assert result.exit_code == 1 and "is not a results folder" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("export", "--out", empty, "--to", tmp_path / "duo")
    assert result.exit_code == 1 and "no run.json in" in result.output and len(result.output.splitlines()) == 1
    folder = tmp_path / "noheads"
    shutil.copytree(gqa_run, folder)
    (folder / "heads.csv").unlink()
    result = invoke("export", "--out", folder, "--to", tmp_path / "duo")
    assert result.exit_code == 1 and "no heads.csv in" in result.output
    assert not (tmp_path / "duo").exists()  # nothing half-written
    zeros = write_retrieval(tmp_path / "z", means=np.zeros((2, 4)))
    with pytest.raises(AttnprobeError, match="never copied the needle"):
        load_scores(zeros, sink=4, recent=8)


def test_results_without_the_needed_scores_are_refused(gqa_run, tmp_path):
    folder = tmp_path / "short"
    shutil.copytree(gqa_run, folder)
    heads = pd.read_csv(folder / "heads.csv")
    heads["sink_window"] = np.nan  # no sequence reached past the sinks and the window
    heads.to_csv(folder / "heads.csv", index=False)
    restamp(folder)  # as analyze writes it for such a corpus
    with pytest.raises(AttnprobeError, match="sink_window is empty"):
        load_scores(folder)
    heads.drop(columns="sink_window").to_csv(folder / "heads.csv", index=False)
    with pytest.raises(AttnprobeError, match="lacks column"):
        load_scores(folder)
    heads = pd.read_csv(gqa_run / "heads.csv").iloc[:-1]
    heads.to_csv(folder / "heads.csv", index=False)
    unstamp(folder)  # an older run, without run.json's record of its files: only the count of heads tells
    with pytest.raises(AttnprobeError, match="holds 11 heads, not the model's 3 layers x 4 heads"):
        load_scores(folder)
    run = json.loads((gqa_run / "run.json").read_text())
    run["model"]["causal"] = False
    run.pop("files")  # an older run's
    (folder / "run.json").write_text(json.dumps(run))
    with pytest.raises(AttnprobeError, match="is an encoder"):
        load_scores(folder)
