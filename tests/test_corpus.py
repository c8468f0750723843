"""Corpus parsing: comments, blank lines, `# category:` tags and the split modes."""

import hashlib

import pytest

from attnprobe.corpus import SPLITS, parse_lines, read_corpus
from attnprobe.errors import AttnprobeError


def test_untagged_corpus_has_no_categories():
    sentences = parse_lines(["# a comment", "", "One.", "  Two.  "])
    assert [(s.text, s.line, s.category) for s in sentences] == [("One.", 3, None), ("Two.", 4, None)]


def test_tags_apply_until_the_next_tag():
    lines = ["Before.", "# category: passive", "A.", "", "# just a note", "B.", "#Category:  long clause ", "C."]
    sentences = parse_lines(lines)
    assert [(s.text, s.category) for s in sentences] == [
        ("Before.", None), ("A.", "passive"), ("B.", "passive"), ("C.", "long clause"),
    ]


def test_comment_that_merely_mentions_category_is_a_comment():
    assert [s.category for s in parse_lines(["# categories follow", "X."])] == [None]


def test_tag_without_a_name_is_an_error(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# category: svo\nA.\n# category:\nB.\n", encoding="utf-8")
    with pytest.raises(AttnprobeError, match=r"line 3: '# category:' has no name"):
        read_corpus(path)


def test_utf8_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffFirst.\nSecond.\n".encode())
    assert read_corpus(path).texts == ["First.", "Second."]


# A small corpus with CRLF endings, `#` lines, indentation, and runs of blank and whitespace-only lines.
MIXED = (
    "# category: svo\r\n"
    "The cat sat.  \r\n"
    "# Heading\r\n"
    "\r\n"
    "  \t \r\n"
    "\r\n"
    "  Second para, line one.\r\n"
    "  indented line two.\t\r\n"
    " \r\n"
    "# 2024-01-01 log line\r\n"
    "\r\n"
)


def _write(tmp_path, text, name="c.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def test_splits_constant_names_the_three_modes():
    assert SPLITS == ("lines", "paragraphs", "file")


def test_lines_mode_is_the_default_and_unchanged(tmp_path):
    path = _write(tmp_path, MIXED)
    expected = [("The cat sat.", 2, "svo"), ("Second para, line one.", 7, "svo"), ("indented line two.", 8, "svo")]
    for corpus in (read_corpus(path), read_corpus(path, split="lines")):
        assert [(s.text, s.line, s.category) for s in corpus.sentences] == expected


def test_paragraphs_mode_keeps_hash_lines_and_numbers_blocks_by_first_line(tmp_path):
    corpus = read_corpus(_write(tmp_path, MIXED), split="paragraphs")
    assert [(s.text, s.line, s.category) for s in corpus.sentences] == [
        ("# category: svo\nThe cat sat.\n# Heading", 1, None),
        ("Second para, line one.\n  indented line two.", 7, None),
        ("# 2024-01-01 log line", 10, None),
    ]


def test_paragraphs_mode_never_yields_an_empty_paragraph(tmp_path):
    text = "\n\n \n\tA.\n\n\n\n   \n\nB.\n\n\n"
    corpus = read_corpus(_write(tmp_path, text), split="paragraphs")
    assert [(s.text, s.line) for s in corpus.sentences] == [("A.", 4), ("B.", 10)]


def test_paragraphs_mode_keeps_a_last_paragraph_without_a_final_newline(tmp_path):
    corpus = read_corpus(_write(tmp_path, "A.\r\n\r\nB.\r\nC."), split="paragraphs")
    assert [(s.text, s.line) for s in corpus.sentences] == [("A.", 1), ("B.\nC.", 3)]


def test_file_mode_is_one_text_with_crlf_normalised(tmp_path):
    corpus = read_corpus(_write(tmp_path, "\r\n" + MIXED), split="file")
    assert [(s.line, s.category) for s in corpus.sentences] == [(1, None)]
    assert corpus.texts == [
        "# category: svo\nThe cat sat.  \n# Heading\n\n  \t \n\n  Second para, line one.\n"
        "  indented line two.\t\n \n# 2024-01-01 log line"
    ]


@pytest.mark.parametrize("split", SPLITS)
def test_byte_order_mark_is_ignored_and_hash_is_of_raw_bytes(tmp_path, split):
    raw = "\ufeff# Title\nBody.\n".encode()
    path = tmp_path / "bom.txt"
    path.write_bytes(raw)
    corpus = read_corpus(path, split=split)
    assert corpus.texts[0].startswith("Body." if split == "lines" else "# Title")
    assert corpus.sha256 == hashlib.sha256(raw).hexdigest()


def test_unknown_split_is_an_error(tmp_path):
    path = _write(tmp_path, "A.\n")
    with pytest.raises(AttnprobeError, match=r"^unknown --split 'sentences': use lines, paragraphs or file$"):
        read_corpus(path, split="sentences")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("text", ["", " \r\n\t\n\n", "\ufeff\n \n", "\u00a0\n\u2003\n"])
def test_empty_or_whitespace_only_file_is_an_error_in_every_mode(tmp_path, split, text):
    path = _write(tmp_path, text)
    # "lines" mode reports a BOM- or Unicode-space-only file as having no sentences, as it always has.
    pattern = r"is empty: add \S"
    if split == "lines" and text.strip(" \r\n\t"):
        pattern = r"has no sentences, only blank or '#' comment lines: add one sentence per line$"
    with pytest.raises(AttnprobeError, match=pattern):
        read_corpus(path, split=split)


@pytest.mark.parametrize("split", SPLITS)
def test_file_errors_are_the_same_in_every_mode(tmp_path, split):
    with pytest.raises(AttnprobeError, match=r"file not found"):
        read_corpus(tmp_path / "missing.txt", split=split)
    with pytest.raises(AttnprobeError, match=r"is a directory"):
        read_corpus(tmp_path, split=split)
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"A.\n\nB \xe9.\n")
    with pytest.raises(AttnprobeError, match=r"not UTF-8: line 3, byte 3"):
        read_corpus(path, split=split)
