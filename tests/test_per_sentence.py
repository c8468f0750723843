"""--per-sentence: sentences.parquet streamed in row groups, equal to the in-memory per-sentence table."""

import numpy as np
import pandas as pd
from conftest import SENTENCES
from test_cli import run

from attnprobe.analysis import analyze
from attnprobe.corpus import Sentence
from attnprobe.io import SentenceWriter, read_sentences


def test_per_sentence_parquet_round_trip(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("# category: a\n" + "\n".join(SENTENCES[:3]) + "\n# category: b\n" + "\n".join(SENTENCES[3:]),
                      encoding="utf-8")
    out = tmp_path / "out"
    result = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu",
                 "--resamples", "5", "--per-sentence", "--batch-size", "3")
    assert result.exit_code == 0, result.output
    assert "sentences.par" in result.stdout  # (the console wraps long paths)
    table = read_sentences(out).read().to_pandas().sort_values(["sentence", "layer", "head"]).reset_index(drop=True)
    memory = analyze(str(gpt2_dir), str(corpus), device="cpu", batch_size=3, resamples=5, keep_per_sentence=True)
    expected = memory.per_sentence.sort_values(["sentence", "layer", "head"]).reset_index(drop=True)
    assert len(table) == len(SENTENCES) * 3 * 4
    for column in ("entropy", "diagonal", "sink_window", "first_token_unforced"):
        np.testing.assert_allclose(table[column], expected[column], atol=1e-12, err_msg=column)
    assert table["special_tokens"].isna().all()  # this tokenizer adds none
    assert table.loc[table["sentence"] == 0, "line"].iloc[0] == 2 and set(table["category"]) == {"a", "b"}
    heads = pd.read_csv(out / "heads.csv")
    np.testing.assert_allclose(table.groupby(["layer", "head"])["entropy"].mean(), heads["entropy"], atol=1e-8)
    again = run("analyze", "--model", gpt2_dir, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples", "5")
    assert again.exit_code == 0 and not (out / "sentences.parquet").exists()  # not left from the earlier run


def test_an_interrupted_writer_leaves_nothing(tmp_path):
    try:
        with SentenceWriter(tmp_path, ["entropy"]) as writer:
            writer.write([0, 1], {"entropy": np.zeros((2, 1, 1))}, [Sentence("A.", 1, None), Sentence("B.", 2, None)])
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert list(tmp_path.iterdir()) == []
