"""Corpus parsing: comments, blank lines and `# category:` tags."""

import pytest

from attnprobe.corpus import parse_lines, read_corpus
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
