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


# ---- layer budgets (kvpress's PerLayerCompressionPress) ------------------------------------------------------------


def test_layer_budgets_in_closed_form():
    """kept_l = clip(c x s_l, floor, 1), mean = target: worked by hand."""
    from attnprobe.budgets import allocate

    # no clipping: c = 4 x 0.25 / 10
    assert np.allclose(allocate(np.array([1.0, 2.0, 3.0, 4.0]), 0.25, 0.01), [0.1, 0.2, 0.3, 0.4])
    # layer 3 would keep 10 x 0.125 = 1.25: it keeps 1, and the others share the rest, c = (4 x 0.5 - 1) / 6
    assert np.allclose(allocate(np.array([1.0, 2.0, 3.0, 10.0]), 0.5, 0.1), [1 / 6, 2 / 6, 3 / 6, 1.0])
    # layer 0 would keep 0.1 x 1.6 / 3.1 < 0.2: it keeps the floor, c = (4 x 0.4 - 0.2) / 3
    assert np.allclose(allocate(np.array([0.1, 1.0, 1.0, 1.0]), 0.4, 0.2), [0.2, 1.4 / 3, 1.4 / 3, 1.4 / 3])
    # both ends at once: c = (5 x 0.5 - 1 - 0.1) / (1 + 2 + 3)
    c = (2.5 - 1.1) / 6
    assert np.allclose(allocate(np.array([0.01, 1.0, 2.0, 3.0, 50.0]), 0.5, 0.1), [0.1, c, 2 * c, 3 * c, 1.0])
    assert np.allclose(allocate(np.array([2.0, 2.0, 2.0]), 0.3, 0.1), [0.3, 0.3, 0.3])  # equal layers, equal shares
    assert np.allclose(allocate(np.array([0.0, 1.0]), 0.1, 0.1), [0.1, 0.1])  # the target at the floor
    with pytest.raises(AttnprobeError, match="at most 0.55"):
        allocate(np.array([0.0, 1.0]), 0.6, 0.1)  # a layer at entropy 0 keeps only the floor


def budgets_from_heads(heads, ratio, floor):
    """The budgets from heads.csv, independently: the layers' mean entropy, then c by bisection on the mean."""
    s = heads.groupby("layer")["entropy"].mean().to_numpy()
    low, high = 0.0, 1e6
    for _ in range(200):
        c = (low + high) / 2
        low, high = (c, high) if np.clip(c * s, floor, 1).mean() < 1 - ratio else (low, c)
    return s, np.clip(high * s, floor, 1)


def test_layer_budgets_file_says_what_it_means_and_kvpress_keeps_as_stated(gqa_run, tmp_path):
    result = invoke("export", "--out", gqa_run, "--format", "layer-budgets", "--to", tmp_path / "b",
                    "--compression-ratio", 0.4, "--min-kept", 0.2)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "b" / "layer_budgets.json").read_text())
    entropy, kept = budgets_from_heads(pd.read_csv(gqa_run / "heads.csv"), 0.4, 0.2)
    assert np.allclose(record["kept"], kept, atol=1e-9) and np.isclose(np.mean(record["kept"]), 0.6)
    assert np.allclose([row["entropy"] for row in record["layers"]], entropy)
    assert np.allclose(record["compression_ratios"], 1 - kept) and record["press"]["name"] == "PerLayerCompressionPress"
    assert record["compression_ratio"] == 0.4 and record["min_kept"] == 0.2 and record["statistic"]["name"] == "entropy"
    assert {"meaning", "format_version", "model"} <= set(record)
    # kvpress 0.5.5's PerLayerCompressionPress: layer l keeps compute_n_kept(L, ratio_l) = max(1, int(L (1 - ratio_l)))
    for length in (17, 256, 4096):
        entries = [max(1, int(length * (1 - r))) for r in record["compression_ratios"]]
        assert all(0 <= k * length - n < 1 + 1e-9 for k, n in zip(kept, entries))  # the budget x L, rounded down


def test_layer_budget_options_are_checked_in_one_line(gqa_run, tmp_path):
    for extra, fragment in ((["--compression-ratio", 0.95], "below --min-kept 0.1"),
                            (["--min-kept", 0], "--min-kept 0 is out of range"),
                            (["--compression-ratio", -0.1], "--compression-ratio -0.1 is out of range")):
        result = invoke("export", "--out", gqa_run, "--format", "layer-budgets", "--to", tmp_path / "b", *extra)
        assert result.exit_code == 1 and fragment in result.output and len(result.output.splitlines()) == 1
    result = invoke("export", "--out", gqa_run, "--to", tmp_path / "d", "--compression-ratio", 0.5)
    assert result.exit_code == 1 and "--compression-ratio does nothing with --format duo-attention" in result.output
    assert not (tmp_path / "b").exists() and not (tmp_path / "d").exists()


# ---- every head score in one parquet file, and export --from it ----------------------------------------------------


def write_trained(folder, layers=3, kv_heads=2, spec="m", heads=4):
    """train-pattern's gates.csv and train_pattern.json (with the sha256 of gates.csv), as it writes them."""
    from attnprobe.io import hash_file

    rows = [{"layer": la, "kv_head": k, "gate": (la * kv_heads + k) / (layers * kv_heads)}
            for la in range(layers) for k in range(kv_heads)]
    pd.DataFrame(rows).to_csv(folder / "gates.csv", index=False)
    record = {"command": "attnprobe train-pattern", "settings": {"sink": 2, "recent": 3}, "kv_heads": kv_heads,
              "model": {"spec": spec, "source": spec, "layers": layers, "heads": heads, "kv_heads": kv_heads},
              "files": {"gates.csv": hash_file(folder / "gates.csv")}}
    (folder / "train_pattern.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def every_score(gqa_run, tmp_path_factory):
    """analyze, retrieval and train-pattern results of one model in one folder."""
    folder = tmp_path_factory.mktemp("every") / "run"
    shutil.copytree(gqa_run, folder)
    run = json.loads((folder / "run.json").read_text())
    spec = run["model"]["spec"]
    write_retrieval(folder, spec=spec, layers=3, heads=4, kv_heads=2,
                    means=np.array([[0.0, 0.5, 0.5, 0.25], [0.0, 0.0, 0.75, 1.0], [0.5, 0.0, 0.0, 0.25]]))
    write_trained(folder, spec=spec)
    return folder


FROM_CASES = [("duo-attention", []), ("duo-attention", ["--scores", "kv"]), ("duo-attention", ["--scores", "retrieval",
              "--sink-size", 3]), ("retrieval-head", ["--scores", "retrieval"]), ("retrieval-head", ["--scores", "kv"]),
              ("layer-budgets", ["--compression-ratio", 0.3]), ("head-scores", [])]


def test_export_from_the_parquet_equals_the_export_from_the_folder(every_score, tmp_path):
    import pyarrow.parquet as pq

    from attnprobe import __version__

    result = invoke("export", "--out", every_score, "--format", "head-scores", "--to", tmp_path / "pub")
    assert result.exit_code == 0, result.output
    path = tmp_path / "pub" / "head_scores.parquet"
    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    run = json.loads((every_score / "run.json").read_text())
    assert meta["model.name"] == run["model"]["spec"] and meta["attnprobe.version"] == __version__
    record = json.loads(meta["attnprobe"])
    assert record["format_version"] == 1 and set(record["parts"]) == {"analyze", "retrieval", "train-pattern"}
    assert record["parts"]["analyze"]["record"]["attention"] == run["attention"]  # the settings
    frame = table.to_pandas()
    heads = pd.read_csv(every_score / "heads.csv")
    assert len(frame) == 12 and list(frame.columns[:3]) == ["layer", "head", "kv_head"]
    merged = frame.merge(heads, on=["layer", "head"], suffixes=("", "_csv"))
    assert np.allclose(merged["entropy"], merged["entropy_csv"]) and "retrieval_trials" in frame.columns
    assert frame.loc[(frame["layer"] == 1) & (frame["head"] == 3), "trained_gate"].item() == pytest.approx(3 / 6)
    for fmt, extra in FROM_CASES + [("duo-attention", ["--scores", "trained"])]:
        folders = {}
        for name, source in (("folder", ["--out", every_score]), ("file", ["--from", path])):
            folders[name] = tmp_path / f"{fmt}-{len(extra)}-{name}"
            result = invoke("export", *source, "--format", fmt, "--to", folders[name], *extra)
            assert result.exit_code == 0, (fmt, extra, result.output)
        names = sorted(p.name for p in folders["folder"].iterdir() if p.name != "attnprobe.json")
        assert names == sorted(p.name for p in folders["file"].iterdir() if p.name != "attnprobe.json")
        for name in names:  # byte for byte
            assert (folders["folder"] / name).read_bytes() == (folders["file"] / name).read_bytes(), (fmt, name)


def test_a_file_that_is_not_head_scores_is_one_line(every_score, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert invoke("export", "--out", every_score, "--format", "head-scores", "--to", tmp_path).exit_code == 0
    good = pq.read_table(tmp_path / "head_scores.parquet")
    text = tmp_path / "notes.parquet"
    text.write_text("layer,head\n0,0\n")
    bare = tmp_path / "bare.parquet"
    pq.write_table(pa.table({"layer": [0], "head": [0]}), bare)
    dropped = tmp_path / "dropped.parquet"
    pq.write_table(good.drop(["sink_window"]), dropped)
    record = json.loads(good.schema.metadata[b"attnprobe"])
    newer = tmp_path / "newer.parquet"
    pq.write_table(good.replace_schema_metadata({**good.schema.metadata, b"attnprobe": json.dumps(
        record | {"format_version": 2}).encode()}), newer)
    short = tmp_path / "short.parquet"
    pq.write_table(good.slice(0, 11), short)
    cases = [(tmp_path / "none.parquet", "is not a file"), (text, "is not a parquet file"),
             (bare, "is a parquet file but not attnprobe's head scores"), (dropped, "lacks column(s) sink_window"),
             (newer, "of format version 2"), (short, "does not hold one row for each of its model's 3 x 4 heads")]
    for path, fragment in cases:
        result = invoke("export", "--from", path, "--to", tmp_path / "duo")
        assert result.exit_code == 1 and fragment in result.output, (path, result.output)
        assert len(result.output.splitlines()) == 1 and not (tmp_path / "duo").exists()
    result = invoke("export", "--from", tmp_path / "head_scores.parquet", "--out", every_score, "--to", tmp_path / "d")
    assert result.exit_code == 1 and "--from and --out both" in result.output
