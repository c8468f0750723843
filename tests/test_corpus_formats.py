"""Table corpora: `.jsonl` and `.parquet` files with a `text` column and an optional `category`."""

import hashlib
import json
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SENTENCES, make_gpt2
from typer.testing import CliRunner

import attnprobe.corpus as corpus_module
from attnprobe.cli import app
from attnprobe.corpus import read_corpus
from attnprobe.errors import AttnprobeError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def triples(corpus):
    return [(s.text, s.line, s.category) for s in corpus.sentences]


def raises_one_line(path, *fragments, split="lines"):
    with pytest.raises(AttnprobeError) as caught:
        read_corpus(path, split=split)
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---- JSON Lines ----


def test_jsonl_without_categories(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "One."}\n\n  \n{"text": "  Two.  ", "id": 7}\n', encoding="utf-8")
    assert triples(read_corpus(path)) == [("One.", 1, None), ("Two.", 4, None)]


def test_jsonl_with_categories_and_nulls(tmp_path):
    rows = [{"text": "A.", "category": "svo"}, {"text": "B."}, {"text": "C.", "category": None},
            {"text": "D.", "category": " passive "}]
    corpus = read_corpus(write_jsonl(tmp_path / "c.jsonl", rows))
    assert triples(corpus) == [("A.", 1, "svo"), ("B.", 2, None), ("C.", 3, None), ("D.", 4, "passive")]


def test_jsonl_suffix_is_case_insensitive_and_keeps_newlines_in_text(tmp_path):
    corpus = read_corpus(write_jsonl(tmp_path / "C.JSONL", [{"text": "Line one.\nLine two."}]))
    assert corpus.texts == ["Line one.\nLine two."]


def test_jsonl_crlf_and_byte_order_mark(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "A."}\r\n{"text": "B."}\r\n')
    assert triples(read_corpus(path)) == [("A.", 1, None), ("B.", 2, None)]


def test_jsonl_sha256_is_that_of_the_file_bytes(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": s} for s in SENTENCES])
    assert read_corpus(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_jsonl_lines_across_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_CHUNK", 3)  # lines and the hash cross many chunk boundaries
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": s, "category": f"k{i % 2}"} for i, s in enumerate(SENTENCES)])
    corpus = read_corpus(path)
    assert corpus.texts == SENTENCES
    assert [s.line for s in corpus.sentences] == list(range(1, len(SENTENCES) + 1))
    assert corpus.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_jsonl_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "A."}\n{"text": "B.",}\n', encoding="utf-8")
    raises_one_line(path, str(path), "line 2", "not valid JSON", "one JSON object per line")


@pytest.mark.parametrize(("row", "kind"), [('"just text"', "a string"), ("[1, 2]", "an array"), ("3", "a number")])
def test_jsonl_row_that_is_not_an_object_names_the_line(tmp_path, row, kind):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "A."}\n\n' + row + "\n", encoding="utf-8")
    raises_one_line(path, str(path), "line 3", kind, "not a JSON object")


def test_jsonl_missing_text_lists_the_fields_found(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "A."}, {"sentence": "B.", "category": "x"}])
    raises_one_line(path, str(path), "line 2", "no 'text' field", "sentence, category")


@pytest.mark.parametrize(("text", "fragment"), [(5, "is a number, not a string"), (None, "is null, not a string"),
                                                ([], "is an array, not a string"), ("", "is empty"),
                                                ("  \t ", "is empty")])
def test_jsonl_bad_text_names_the_line(tmp_path, text, fragment):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "A."}, {"text": text}])
    raises_one_line(path, str(path), "line 2", "'text'", fragment)


@pytest.mark.parametrize(("category", "fragment"), [(1, "is a number, not a string"), (True, "is a boolean"),
                                                    ({"a": 1}, "is an object"), ("", "is empty")])
def test_jsonl_bad_category_names_the_line(tmp_path, category, fragment):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "A."}, {"text": "B.", "category": category}])
    raises_one_line(path, str(path), "line 2", "'category'", fragment, "null for none")


def test_jsonl_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes('{"text": "A."}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    raises_one_line(path, str(path), "not UTF-8", "line 2")


@pytest.mark.parametrize("content", [b"", b"\n  \n\r\n"])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "c.jsonl"
    path.write_bytes(content)
    raises_one_line(path, str(path), "is empty", "one JSON object per line")


# ---- Parquet ----


def test_parquet_without_categories(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", {"id": [3, 4], "text": [" One. ", "Two."]})
    assert triples(read_corpus(path)) == [("One.", 1, None), ("Two.", 2, None)]


def test_parquet_with_categories_and_nulls(tmp_path):
    path = write_parquet(tmp_path / "c.PARQUET", {"text": ["A.", "B.", "C."], "category": ["svo", None, "passive"]})
    assert triples(read_corpus(path)) == [("A.", 1, "svo"), ("B.", 2, None), ("C.", 3, "passive")]


def test_parquet_from_pandas_with_a_categorical_column(tmp_path):
    path = tmp_path / "c.parquet"
    frame = pd.DataFrame({"text": ["A.", "B.", "C."], "category": pd.Categorical(["x", "y", "x"])})
    frame.to_parquet(path)
    assert triples(read_corpus(path)) == [("A.", 1, "x"), ("B.", 2, "y"), ("C.", 3, "x")]


def test_parquet_streams_batches_and_numbers_rows_across_them(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_BATCH_ROWS", 3)
    texts = [f"Row {i}." for i in range(10)]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    corpus = read_corpus(path)
    assert corpus.texts == texts
    assert [s.line for s in corpus.sentences] == list(range(1, 11))


def test_parquet_sha256_is_that_of_the_file_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_CHUNK", 7)
    path = write_parquet(tmp_path / "c.parquet", {"text": SENTENCES})
    assert read_corpus(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_parquet_missing_text_column_lists_the_columns(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", {"sentence": ["A."], "category": ["x"]})
    raises_one_line(path, str(path), "no 'text' column", "sentence, category")


@pytest.mark.parametrize(("column", "fragment"), [(pa.array(["A.", None]), "is null, not a string"),
                                                  (pa.array([1, 2]), "is a number, not a string"),
                                                  (pa.array(["A.", "   "]), "is empty")])
def test_parquet_bad_text_names_the_row(tmp_path, column, fragment):
    path = write_parquet(tmp_path / "c.parquet", {"text": column})
    row = "row 1" if fragment.startswith("is a number") else "row 2"
    raises_one_line(path, str(path), row, "'text'", fragment)


@pytest.mark.parametrize(("column", "fragment"), [(pa.array([None, 2]), "is a number, not a string"),
                                                  (pa.array(["x", ""]), "is empty")])
def test_parquet_bad_category_names_the_row(tmp_path, column, fragment):
    path = write_parquet(tmp_path / "c.parquet", {"text": ["A.", "B."], "category": column})
    raises_one_line(path, str(path), "row 2", "'category'", fragment)


def test_parquet_with_no_rows(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", {"text": pa.array([], pa.string())})
    raises_one_line(path, str(path), "has no rows", "'text' column")


@pytest.mark.parametrize("content", [b"", b"not a parquet file at all\n"])
def test_unreadable_parquet(tmp_path, content):
    path = tmp_path / "c.parquet"
    path.write_bytes(content)
    raises_one_line(path, str(path), "cannot read corpus", "as Parquet", "use .jsonl")


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "c.parquet", {"text": ["A."]})
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    raises_one_line(path, str(path), "needs pyarrow", "pip install pyarrow")


def test_parquet_directory(tmp_path):
    folder = tmp_path / "data.parquet"
    folder.mkdir()
    raises_one_line(folder, str(folder), "is a directory", "a single .parquet file")


# ---- both ----


@pytest.mark.parametrize("name", ["c.jsonl", "c.parquet"])
@pytest.mark.parametrize("split", ["paragraphs", "file"])
def test_split_other_than_lines_is_refused(tmp_path, name, split):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, [{"text": "A."}])
    else:
        write_parquet(path, {"text": ["A."]})
    raises_one_line(path, f"--split {split} applies to text files", "one sequence per row", str(path), split=split)


@pytest.mark.parametrize("name", ["gone.jsonl", "gone.parquet"])
def test_missing_table_file(tmp_path, name):
    raises_one_line(tmp_path / name, "not found", name)


def test_other_suffixes_stay_text(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"text": "A."}\n', encoding="utf-8")
    assert read_corpus(path).texts == ['{"text": "A."}']


def test_text_sha256_streams_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_CHUNK", 5)
    path = tmp_path / "c.txt"
    path.write_bytes("\ufeff# category: a\r\nOne line.\n\nTwo caf\u00e9 lines.\nno newline at end".encode())
    corpus = read_corpus(path)
    assert corpus.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert triples(corpus) == [("One line.", 2, "a"), ("Two caf\u00e9 lines.", 4, "a"), ("no newline at end", 5, "a")]


# ---- end to end ----

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gpt2_formats"), layers=2, heads=2)


def analyze(model_dir, corpus, out):
    args = ["analyze", "--model", model_dir, "--corpus", corpus, "--out", out, "--device", "cpu", "--resamples", 5]
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("name", ["c.jsonl", "c.parquet"])
def test_cli_analyze_untagged_table(tmp_path, model_dir, name):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, [{"text": s} for s in SENTENCES[:4]])
    else:
        write_parquet(path, {"text": SENTENCES[:4]})
    out = tmp_path / "out"
    result = analyze(model_dir, path, out)
    assert result.exit_code == 0, result.output
    assert (out / "heads.csv").exists()
    assert not (out / "categories.csv").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["c.jsonl", "c.parquet"])
def test_cli_analyze_tagged_table_writes_categories(tmp_path, model_dir, name):
    categories = ["short", "long", None, "long", "short"]
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, [{"text": s, "category": c} for s, c in zip(SENTENCES, categories)])
    else:
        write_parquet(path, {"text": SENTENCES[:5], "category": categories})
    out = tmp_path / "out"
    result = analyze(model_dir, path, out)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "categories.csv")
    assert list(dict.fromkeys(table["category"])) == ["short", "long", "untagged"]
    assert table["layer"].nunique() == 2


def test_cli_bad_jsonl_is_one_error_line(tmp_path, model_dir):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "Rain fell."}\n{"text": 3}\n', encoding="utf-8")
    out = tmp_path / "out"
    result = analyze(model_dir, path, out)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "line 2" in lines[0], result.stderr
    assert not out.exists()
