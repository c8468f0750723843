"""Related heads: the JS divergence against closed forms and a float64 oracle, the sample, MDS, and `related`."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES
from scipy.spatial.distance import jensenshannon
from test_cli import assert_one_line_error, run

from attnprobe import io
from attnprobe.similarity import (
    LN2,
    PairwiseJS,
    classical_mds,
    head_similarity,
    js_divergence,
    nearest_heads,
    pairwise_js_sums,
    row_entries,
    sample_indices,
)

TOLERANCE = dict(rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE)


def softmax_rows(heads: int, rows: int, keys: int, seed: int = 0, sharp: float = 3.0) -> torch.Tensor:
    scores = torch.randn(heads, rows, keys, generator=torch.Generator().manual_seed(seed)) * sharp
    return scores.softmax(dim=-1)  # [head, row, key]


def mean_js(maps: torch.Tensor, budget: int | None = None) -> np.ndarray:
    """[head, row, key] -> [head, head] JS averaged over the rows, through PairwiseJS."""
    total = PairwiseJS(maps.shape[0], budget=budget)
    total.add(maps.reshape(maps.shape[0], -1), maps.shape[1])  # [head, entry]
    return total.mean()


# ---------- closed forms ----------

def test_identical_heads_diverge_by_zero():
    rows = softmax_rows(1, 6, 9)  # [1, row, key]
    maps = torch.cat([rows, rows, softmax_rows(1, 6, 9, seed=1)])  # heads 0 and 1 identical
    js = mean_js(maps)
    assert js[0, 1] == pytest.approx(0.0, abs=FLOAT32_TOLERANCE)
    assert js[0, 2] > 0.05  # a different head is not


def test_disjoint_one_hot_rows_diverge_by_ln_2():
    keys = 5
    a = torch.eye(keys)[[0, 1, 2, 3]]  # [row, key]: row r puts everything on key r
    b = torch.eye(keys)[[1, 2, 3, 4]]  # on key r + 1: disjoint from a on every row
    js = mean_js(torch.stack([a, b]))
    assert js[0, 1] == pytest.approx(math.log(2), rel=FLOAT32_TOLERANCE)
    assert js_divergence(a, b).tolist() == pytest.approx([math.log(2)] * 4, rel=FLOAT32_TOLERANCE)
    assert LN2 == pytest.approx(math.log(2))


def test_half_overlap_by_hand():
    # P = (1, 0), Q = (1/2, 1/2): M = (3/4, 1/4); JS = H(M) - H(Q) / 2 = H(3/4, 1/4) - ln 2 / 2
    p, q = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]])
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - math.log(2) / 2
    assert mean_js(torch.stack([p, q]))[0, 1] == pytest.approx(expected, rel=FLOAT32_TOLERANCE)


def test_symmetric_zero_diagonal_and_within_0_and_ln_2():
    js = mean_js(softmax_rows(7, 5, 11))
    np.testing.assert_array_equal(js, js.T)
    np.testing.assert_array_equal(np.diag(js), 0.0)
    off = js[~np.eye(7, dtype=bool)]
    assert (off > 0).all() and (off <= math.log(2)).all()


def test_every_pair_equals_scipys_jensen_shannon_row_by_row():
    """scipy's jensenshannon (a distance, base e) squared is the divergence: an implementation of its own."""
    maps = softmax_rows(6, 4, 8, seed=3)  # [head, row, key]
    js = mean_js(maps)
    for a, b in itertools.combinations(range(6), 2):
        rows = [jensenshannon(maps[a, r].double().numpy(), maps[b, r].double().numpy()) ** 2 for r in range(4)]
        assert js[a, b] == pytest.approx(np.mean(rows), rel=FLOAT32_TOLERANCE, abs=FLOAT32_TOLERANCE), (a, b)


@pytest.mark.parametrize("budget", [1, 7, 50, 1 << 16])
def test_blocks_of_any_size_give_the_same_sums(budget):
    maps = softmax_rows(9, 5, 13, seed=4).reshape(9, -1)  # [head, entry]
    np.testing.assert_allclose(pairwise_js_sums(maps, budget).numpy(), pairwise_js_sums(maps, 10**9).numpy(),
                               rtol=1e-6, atol=1e-9)


def test_subnormal_weights_count_as_zero():
    maps = softmax_rows(4, 3, 6, seed=6)  # [head, row, key]
    tiny = maps.clone()
    tiny[0, :, 1] = 1e-40  # a sink head's other keys: below float32's smallest normal number
    zero = maps.clone()
    zero[0, :, 1] = 0.0
    np.testing.assert_allclose(mean_js(tiny), mean_js(zero), rtol=1e-7, atol=1e-12)


def test_buffered_batches_equal_one_pass(monkeypatch):
    import attnprobe.similarity as similarity

    maps = softmax_rows(5, 12, 7, seed=5)  # [head, row, key]
    monkeypatch.setattr(similarity, "FLUSH", 40)  # fold in after almost every batch
    total = PairwiseJS(5)
    for start in range(0, 12, 3):
        total.add(maps[:, start : start + 3].reshape(5, -1), 3)
    assert total.rows == 12
    np.testing.assert_allclose(total.mean(), mean_js(maps), rtol=1e-6, atol=1e-9)


def test_no_unforced_row_is_one_line():
    from attnprobe.errors import AttnprobeError

    with pytest.raises(AttnprobeError, match="2 or more keys"):
        PairwiseJS(3).mean()


# ---------- rows, sample, nearest, MDS ----------

def test_a_decoder_drops_row_0_and_keys_after_the_query():
    maps = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4)  # [head, query, key], padded to 4
    entries, rows = row_entries(maps, 3, causal=True)
    assert rows == 2  # rows 1 and 2 of 3 tokens
    expected = [maps[:, 1, 0], maps[:, 1, 1], maps[:, 2, 0], maps[:, 2, 1], maps[:, 2, 2]]
    torch.testing.assert_close(entries, torch.stack(expected, dim=1))


def test_an_encoder_keeps_every_row_and_key_but_no_padding():
    maps = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4)  # [head, query, key]
    entries, rows = row_entries(maps, 3, causal=False)
    assert rows == 3
    torch.testing.assert_close(entries, maps[:, :3, :3].reshape(2, 9))
    assert row_entries(maps, 1, causal=False)[1] == 0  # one token: its one row is forced


def test_the_sample_spreads_over_the_corpus():
    assert sample_indices(5, 200) == [0, 1, 2, 3, 4]
    assert sample_indices(10, 4) == [0, 2, 5, 7]  # floor(k * 10 / 4)
    spread = sample_indices(1000, 200)
    assert spread[:3] == [0, 5, 10] and spread[-1] == 995 and len(set(spread)) == 200


def test_nearest_heads_by_hand():
    js = np.array([[0.0, 0.3, 0.1, 0.2], [0.3, 0.0, 0.4, 0.5], [0.1, 0.4, 0.0, 0.6], [0.2, 0.5, 0.6, 0.0]])
    layer, head = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    assert nearest_heads(js, layer, head, 0, 0, 2) == [(1, 0, 0.1), (1, 1, 0.2)]
    assert nearest_heads(js, layer, head, 1, 1, 5) == [(0, 0, 0.2), (0, 1, 0.5), (1, 0, 0.6)]  # itself left out


def test_mds_recovers_points_in_a_plane():
    rng = np.random.default_rng(0)
    points = rng.normal(size=(12, 2)) * 0.2
    squared = ((points[:, None] - points[None]) ** 2).sum(-1)  # plays JS: the squared distance
    coords, shares = classical_mds(squared)
    recovered = ((coords[:, None] - coords[None]) ** 2).sum(-1)
    np.testing.assert_allclose(recovered, squared, atol=1e-12)
    assert shares.sum() == pytest.approx(1.0) and shares[0] >= shares[1]


def test_mds_of_fewer_heads_than_axes():
    coords, shares = classical_mds(np.zeros((1, 1)))
    assert coords.shape == (1, 2) and shares.tolist() == [0.0, 0.0]


# ---------- an independent oracle on tiny models ----------

def oracle(folder, texts: list[str], max_tokens: int, causal: bool) -> tuple[np.ndarray, list[int]]:
    """Per pair of heads, the JS divergence averaged over every row with 2+ keys, in float64 from transformers'
    own eager attention maps, one sentence at a time, written out pair by pair and row by row; and each
    sentence's length before the cut."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager", dtype=torch.float64).eval()
    per_sentence, lengths = [], []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        lengths.append(ids.shape[1])
        ids = ids[:, :max_tokens]
        with torch.no_grad():
            maps = model(input_ids=ids, output_attentions=True).attentions  # per layer [1, head, n, n]
        per_sentence.append(torch.cat([m[0] for m in maps]).numpy())  # [layer * head, n, n]
    count = per_sentence[0].shape[0]
    js = np.zeros((count, count))
    for a, b in itertools.combinations(range(count), 2):
        values = []
        for maps in per_sentence:
            n = maps.shape[-1]
            for i in range(n):
                keys = i + 1 if causal else n
                if keys < 2:
                    continue
                p, q = maps[a, i, :keys], maps[b, i, :keys]
                m = (p + q) / 2
                entropy = lambda x: -sum(v * math.log(v) for v in x if v > 0)  # noqa: E731
                values.append(entropy(m) - (entropy(p) + entropy(q)) / 2)
        js[a, b] = js[b, a] = sum(values) / len(values)
    return js, lengths


@pytest.mark.parametrize("name", ["gpt2_dir", "llama_dir", "bert_dir"])
def test_head_similarity_equals_a_float64_oracle(name, request):
    folder = request.getfixturevalue(name)
    texts = SENTENCES[:5]
    result = head_similarity(str(folder), texts, max_tokens=9, batch_size=2, device="cpu")
    causal = name != "bert_dir"
    expected, lengths = oracle(folder, texts, 9, causal)
    np.testing.assert_allclose(result.js, expected, **TOLERANCE)
    assert result.indices == list(range(5)) and result.max_tokens == 9
    assert result.cut == sum(n > 9 for n in lengths) > 0 and result.tokens == sum(min(n, 9) for n in lengths)
    assert result.rows == sum(min(n, 9) - 1 if causal else min(n, 9) for n in lengths)
    assert result.layer.tolist()[:5] == [0, 0, 0, 0, 1] and result.head.tolist()[:5] == [0, 1, 2, 3, 0]


def test_the_sample_is_the_spread_sentences(gpt2_dir):
    texts = SENTENCES[:8]
    sampled = head_similarity(str(gpt2_dir), texts, sentences=3, device="cpu")
    assert sampled.indices == [0, 2, 5]
    alone = head_similarity(str(gpt2_dir), [texts[0], texts[2], texts[5]], device="cpu")
    np.testing.assert_allclose(sampled.js, alone.js, rtol=1e-6, atol=1e-7)
    assert sampled.rows == alone.rows


# ---------- the command ----------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, gpt2_dir):
    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("related") / "run"
    analyzed = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
                   "--resamples", "50")
    assert analyzed.exit_code == 0, analyzed.output
    assert run("classify", "--out", out).exit_code == 0
    return out


def test_related_writes_head_similarity(copy_of, gpt2_dir):
    result = run("related", "--out", copy_of, "--sentences", "5", "--max-tokens", "8", "--heads", "L1H2,L0H0")
    assert result.exit_code == 0, result.output
    similarity = io.read_similarity(copy_of)
    assert set(similarity) == {"js", "layer", "head", "sentences", "rows", "tokens", "max_tokens", "cut", "indices",
                               "model", "corpus_sha256", "causal", "threads", "sentences_asked", "pair_rows",
                               "bos", "dtype"}
    assert similarity["js"].shape == (12, 12) and int(similarity["sentences"]) == 5
    assert similarity["indices"].tolist() == [0, 1, 3, 4, 6]
    assert int(similarity["max_tokens"]) == 8 and bool(similarity["causal"])
    run_info = json.loads((copy_of / io.RUN_FILE).read_text())
    assert similarity["model"] == run_info["model"]["spec"]
    assert str(similarity["corpus_sha256"]) == run_info["corpus"]["sha256"]
    expected = head_similarity(str(gpt2_dir), [SENTENCES[i] for i in (0, 1, 3, 4, 6)], max_tokens=8, device="cpu")
    np.testing.assert_allclose(similarity["js"], expected.js, rtol=1e-6, atol=1e-7)
    assert int(similarity["rows"]) == expected.rows
    nearest = expected.nearest(1, 2)
    line = next(line for line in result.stdout.splitlines() if line.startswith("L1H2: nearest"))
    assert line == "L1H2: nearest " + ", ".join(f"L{a}H{b} {v:.4f}" for a, b, v in nearest)
    assert "Most alike heads" in result.stdout and "head_similarity.npz" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--sentences", "0"], "--sentences 0"), (["--max-tokens", "1"], "--max-tokens 1"),
    (["--heads", "L9H0"], "--heads L9H0"), (["--batch-size", "0"], "--batch-size 0"),
])
def test_bad_options_are_one_line(copy_of, args, fragment):
    assert_one_line_error(run("related", "--out", copy_of, *args), fragment)


def test_a_changed_or_missing_corpus_is_one_line(copy_of, tmp_path):
    assert_one_line_error(run("related", "--out", tmp_path / "nothing"), "run.json")
    run_info = json.loads((copy_of / io.RUN_FILE).read_text())
    corpus = tmp_path / "changed.txt"
    corpus.write_text("Another sentence.\n", encoding="utf-8")
    run_info["corpus"]["path"] = str(corpus)
    (copy_of / io.RUN_FILE).write_text(json.dumps(run_info))
    assert_one_line_error(run("related", "--out", copy_of), "changed since")
    run_info["corpus"]["path"] = str(tmp_path / "gone.txt")
    (copy_of / io.RUN_FILE).write_text(json.dumps(run_info))
    assert_one_line_error(run("related", "--out", copy_of), "is not there any more")
    run_info["corpus"]["path"] = "<in memory>"
    (copy_of / io.RUN_FILE).write_text(json.dumps(run_info))
    assert_one_line_error(run("related", "--out", copy_of), "attnprobe.head_similarity")


def test_a_damaged_file_is_refused(copy_of):
    np.savez(copy_of / io.SIMILARITY_FILE, js=np.full((2, 3), 0.1), layer=np.zeros(2, dtype=np.int64),
             head=np.arange(2), sentences=np.int64(1), rows=np.int64(1), model=np.asarray("x"))
    from attnprobe.errors import AttnprobeError

    with pytest.raises(AttnprobeError, match="symmetric"):
        io.read_similarity(copy_of)


# ---------- the figures (pure: arrays in, a Figure out) ----------

def planted(groups: int = 3, size: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [head, head] JS matrix of `groups` groups of alike heads (0.05 within, 0.5 between), heads shuffled over
    the layers, with each row's layer and head."""
    count = groups * size
    group = np.random.default_rng(seed).permutation(np.repeat(np.arange(groups), size))  # [head]
    js = np.where(group[:, None] == group[None], 0.05, 0.5)
    np.fill_diagonal(js, 0.0)
    layer, head = np.divmod(np.arange(count), size)
    return js, layer, head


def test_the_matrix_is_reordered_so_that_groups_are_blocks():
    from attnprobe import plotting

    js, layer, head = planted()
    figure = plotting.head_similarity_figure(js, layer, head, title="a title")
    ax = next(a for a in figure.axes if a.images and a.images[0].get_array().shape == js.shape)
    shown = np.asarray(ax.images[0].get_array())
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert len(names) == 12  # every head named: few heads
    position = {(int(n[1:n.index("H")]), int(n[n.index("H") + 1:])): k for k, n in enumerate(names)}
    order = [position[(int(a), int(b))] for a, b in zip(layer, head)]
    np.testing.assert_array_equal(shown[np.ix_(order, order)], js)  # the same matrix, rows and columns permuted
    group = np.where(js[0] < 0.1)[0]  # head 0 and its alike heads sit side by side in the order
    spots = sorted(order[i] for i in group)
    assert spots == list(range(spots[0], spots[0] + 4))
    image = ax.images[0]
    assert image.get_cmap().name.startswith("viridis") and image.get_clim() == (0.0, pytest.approx(math.log(2)))
    assert "a title" in figure._suptitle.get_text()


def test_the_type_strip_and_legend_use_the_type_colours():
    from matplotlib.colors import to_rgb

    from attnprobe import plotting

    js, layer, head = planted()
    kinds = ["local", "copy", "broad"] * 4
    types = pd.DataFrame({"layer": layer, "head": head, "head_type": kinds})
    figure = plotting.head_similarity_figure(js, layer, head, types)
    strip = next(a for a in figure.axes if a.images and a.images[0].get_array().shape[1:] == (1, 3))
    ax = next(a for a in figure.axes if a.images and a.images[0].get_array().shape == js.shape)
    names = [t.get_text() for t in ax.get_yticklabels()]
    kind_of = {f"L{a}H{b}": k for a, b, k in zip(layer, head, kinds)}
    colours = np.asarray(strip.images[0].get_array())[:, 0, :]
    for name, colour in zip(names, colours):
        assert tuple(colour) == pytest.approx(to_rgb(plotting.TYPE_COLORS[kind_of[name]]))
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == ["local (4)", "copy (4)", "broad (4)"]


def test_many_heads_name_only_the_labelled_ones_and_the_cluster_centres():
    from attnprobe import plotting

    rng = np.random.default_rng(1)
    points = rng.normal(size=(270, 3)) * 0.2
    js = np.minimum(((points[:, None] - points[None]) ** 2).sum(-1), 0.69)
    layer, head = np.divmod(np.arange(270), 9)
    figure = plotting.head_similarity_figure(js, layer, head, labelled=[(17, 4), (18, 6)])
    ax = next(a for a in figure.axes if a.images and a.images[0].get_array().shape == js.shape)
    names = {t.get_text() for t in ax.get_yticklabels()}
    centres = {line.split("centre ")[1] for a in figure.axes for line in (t.get_text() for t in a.texts)
               if "centre " in line}
    assert {"L17H4", "L18H6"} <= names <= {"L17H4", "L18H6"} | centres  # issue 28: plus each cluster's centre
    assert len(names) <= plotting.MAX_NAMED
    assert "270 heads in cluster order" in ax.get_xlabel()


def test_the_head_map_places_heads_by_mds_and_colours_them_by_type():
    from matplotlib.colors import to_rgba

    from attnprobe import plotting

    js, layer, head = planted()
    kinds = ["local", "copy", "broad"] * 4
    types = pd.DataFrame({"layer": layer, "head": head, "head_type": kinds})
    figure = plotting.head_map_figure(js, layer, head, types, labelled=[(1, 2)], title="t")
    ax = figure.axes[0]
    coords, shares = classical_mds(js)
    by_kind = {}
    for collection in ax.collections[:3]:
        kind = collection.get_label().split(" (")[0]
        by_kind[kind] = collection
        assert tuple(collection.get_facecolor()[0][:3]) == pytest.approx(to_rgba(plotting.TYPE_COLORS[kind])[:3])
    for kind, collection in by_kind.items():
        expected = coords[[i for i, k in enumerate(kinds) if k == kind]]
        np.testing.assert_allclose(collection.get_offsets(), expected)
    assert [t.get_text() for t in ax.texts] == ["L1H2"]
    assert f"{shares[0]:.0%}" in ax.get_xlabel() and f"{shares[1]:.0%}" in ax.get_ylabel()


def test_plot_draws_the_figures_of_head_similarity(copy_of):
    assert run("related", "--out", copy_of, "--sentences", "4").exit_code == 0
    result = run("plot", "--out", copy_of)
    assert result.exit_code == 0, result.output
    assert (copy_of / io.SIMILARITY_FIGURE).is_file() and (copy_of / io.HEAD_MAP_FIGURE).is_file()
    (copy_of / io.SIMILARITY_FILE).unlink()  # without it, plot draws neither and removes the earlier ones
    assert run("plot", "--out", copy_of).exit_code == 0
    assert not (copy_of / io.SIMILARITY_FIGURE).exists() and not (copy_of / io.HEAD_MAP_FIGURE).exists()


def test_plot_refuses_head_similarity_of_another_model(copy_of):
    js, layer, head = planted(2, 3)
    np.savez(copy_of / io.SIMILARITY_FILE, js=js, layer=layer, head=head, sentences=np.int64(1),
             rows=np.int64(1), model=np.asarray("another"))
    assert_one_line_error(run("plot", "--out", copy_of), "head_similarity.npz does not match",
                          "attnprobe related --out")


def test_the_report_lists_each_heads_nearest_heads(copy_of):
    from test_report import page_data

    from attnprobe.report import build_report

    assert page_data(build_report(copy_of).html)["related"] is None
    assert run("related", "--out", copy_of, "--sentences", "4").exit_code == 0
    data = page_data(build_report(copy_of).html)
    similarity = io.read_similarity(copy_of)
    for layer, head in [(0, 0), (1, 2), (2, 3)]:
        nearest = nearest_heads(similarity["js"], similarity["layer"], similarity["head"], layer, head)
        i = layer * 4 + head
        assert data["related"]["nearest"][i] == [a * 4 + b for a, b, _ in nearest]
        assert data["related"]["js"][i] == pytest.approx([v for *_, v in nearest], rel=1e-4)
    assert data["related"]["sentences"] == 4 and data["related"]["rows"] == int(similarity["rows"])
    js, layer, head = planted(3, 4)
    np.savez(copy_of / io.SIMILARITY_FILE, js=js, layer=layer, head=head, sentences=np.int64(1),
             rows=np.int64(1), model=np.asarray("another"))
    report = build_report(copy_of)
    assert page_data(report.html)["related"] is None and any("another model" in n for n in report.notes)


def test_labels_of_close_dots_stack():
    from attnprobe.plotting import label_rises

    points = np.array([[0.0, 0.0], [0.01, 0.0], [1.0, 1.0], [0.02, 0.01]])
    assert label_rises(points, span=1.0) == [0.0, 11.0, 0.0, 22.0]  # the far one stays; the close ones stack


def test_analyze_keeps_head_similarity_and_names_another_models(copy_of, llama_dir, tmp_path):
    """head_similarity.npz is `related`'s measurement of a model: a new analysis into the folder keeps it, says so
    when it is of another model, and removes the figures plot drew of it."""
    assert run("related", "--out", copy_of, "--sentences", "3").exit_code == 0
    assert run("plot", "--out", copy_of).exit_code == 0
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    again = run("analyze", "--model", llama_dir, "--corpus", corpus, "--out", copy_of, "--device", "cpu",
                "--resamples", "20")
    assert again.exit_code == 0, again.output
    stderr = " ".join(again.stderr.split())
    assert "Note: kept head_similarity.npz in" in stderr and "`attnprobe related` results for" in stderr
    assert (copy_of / io.SIMILARITY_FILE).exists()
    assert not (copy_of / io.SIMILARITY_FIGURE).exists() and not (copy_of / io.HEAD_MAP_FIGURE).exists()
    assert run("classify", "--out", copy_of).exit_code == 0
    assert_one_line_error(run("plot", "--out", copy_of), "head_similarity.npz does not match")
