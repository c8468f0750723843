"""Read a corpus of sequences: a UTF-8 text file split in one of three modes (`SPLITS`), or a table of rows.

- "lines": one sentence per line; blank lines and `#` comments skipped, `# category: <name>` tags.
- "paragraphs": blocks separated by blank lines, each one text; `#` lines are content, no categories.
- "file": the whole file is one text.

A `.jsonl` file (one JSON object per line) or a `.parquet` file (read with pyarrow) holds one sequence per
row in a `text` field or column, with an optional `category` (string or null). Both are read as a stream,
and every format is hashed in chunks, so a large corpus is never held whole as raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnprobe.errors import AttnprobeError
from attnprobe.sources import file_sha256

SPLITS = ("lines", "paragraphs", "file")

# What a corpus file holds in each split mode, for the fix in error messages.
_UNITS = {"lines": "one sentence per line", "paragraphs": "paragraphs separated by blank lines", "file": "some text"}

_CATEGORY_TAG = re.compile(r"^#\s*category\s*:\s*(?P<name>.*?)\s*$", re.IGNORECASE)

_CHUNK = 1 << 20  # bytes read (and hashed) at a time
_BATCH_ROWS = 4096  # parquet rows decoded at a time
_JSONL, _PARQUET = ".jsonl", ".parquet"
_TABLE_FILES = {_JSONL: "one JSON object per line with a 'text' string", _PARQUET: "a 'text' column of strings"}
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


@dataclass(frozen=True)
class Sentence:
    text: str
    line: int  # 1-based line number in the corpus file (for .parquet: the 1-based row number)
    category: str | None  # from the nearest `# category: <name>` line above, or the row's `category`, if any


@dataclass(frozen=True)
class Corpus:
    path: Path
    sha256: str
    sentences: tuple[Sentence, ...]

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.sentences]


def read_corpus(path: str | Path, split: str = "lines") -> Corpus:
    """Load and validate a corpus file; raise AttnprobeError naming the problem and the fix."""
    if split not in SPLITS:
        raise AttnprobeError(f"unknown --split {split!r}: use lines, paragraphs or file")
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in _TABLE_FILES:
        if split != "lines":
            raise AttnprobeError(
                f"--split {split} applies to text files; a .jsonl/.parquet corpus already has one sequence "
                f"per row: drop --split for {path}"
            )
        _check_file(path, f"a single {suffix} file with {_TABLE_FILES[suffix]}")
        return _read_jsonl(path) if suffix == _JSONL else _read_parquet(path)
    _check_file(path, f"a text file with {_UNITS[split]}")
    digest = hashlib.sha256()
    lines, blank = _decode_lines(path, digest)
    if blank:
        raise AttnprobeError(f"corpus {path} is empty: add {_UNITS[split]}")
    sentences = tuple(_split(lines, split, source=str(path)))
    if not sentences and split != "lines":
        raise AttnprobeError(f"corpus {path} is empty: add {_UNITS[split]}")
    if not sentences:
        raise AttnprobeError(
            f"corpus {path} has no sentences, only blank or '#' comment lines: "
            "add one sentence per line"
        )
    return Corpus(path=path, sha256=digest.hexdigest(), sentences=sentences)


def _split(lines: list[str], split: str, source: str) -> list[Sentence]:
    if split == "paragraphs":
        return parse_paragraphs(lines)
    if split == "file":
        return parse_file(lines)
    return parse_lines(lines, source=source)


def parse_lines(lines: list[str], source: str = "corpus") -> list[Sentence]:
    """Sentences from text lines; `# category: <name>` tags the sentences below it, up to the next tag."""
    category: str | None = None
    sentences = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if text.startswith("#"):
            tag = _CATEGORY_TAG.match(text)
            if tag:
                category = tag.group("name")
                if not category:
                    raise AttnprobeError(
                        f"{source} line {number}: '# category:' has no name; write e.g. '# category: passive'"
                    )
            continue
        if text:
            sentences.append(Sentence(text=text, line=number, category=category))
    return sentences


def parse_paragraphs(lines: list[str]) -> list[Sentence]:
    """One text per block of non-blank lines, verbatim (`#` lines included); line = the block's first line."""
    sentences = []
    block: list[str] = []
    for number, line in enumerate([*lines, ""], start=1):
        if line.strip():
            block.append(line.rstrip())
            continue
        if block:
            sentences.append(Sentence(text="\n".join(block).strip(), line=number - len(block), category=None))
            block = []
    return sentences


def parse_file(lines: list[str]) -> list[Sentence]:
    """The whole text as one sentence at line 1, CRLF read as LF; none if it is only whitespace."""
    text = "\n".join(line.removesuffix("\r") for line in lines).strip()
    return [Sentence(text=text, line=1, category=None)] if text else []


def _check_file(path: Path, unit: str) -> None:
    if path.is_dir():
        raise AttnprobeError(f"corpus {path} is a directory: pass {unit}")
    if not path.exists():
        raise AttnprobeError(f"corpus file not found: {path}: check the path to --corpus")


def _raw_lines(path: Path, digest) -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of each line split at b"\\n" (the last one may be b""), hashing every chunk read."""
    number, pending = 1, []
    try:
        with path.open("rb") as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
                if b"\n" not in chunk:
                    pending.append(chunk)
                    continue
                pieces = chunk.split(b"\n")
                pieces[0] = b"".join([*pending, pieces[0]])
                pending = [pieces.pop()]
                for piece in pieces:
                    yield number, piece
                    number += 1
    except OSError as err:
        raise AttnprobeError(f"cannot read corpus {path}: {err.strerror}") from err
    yield number, b"".join(pending)


def _decode(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise AttnprobeError(
            f"corpus {path} is not UTF-8: line {number}, byte {err.start + 1} "
            f"(0x{raw[err.start]:02x}); re-save the file as UTF-8"
        ) from err


def _decode_lines(path: Path, digest) -> tuple[list[str], bool]:
    """The decoded lines of a text file, and whether the file is only (ASCII) whitespace."""
    lines, blank = [], True
    for number, raw in _raw_lines(path, digest):
        blank = blank and not raw.strip()
        lines.append(_decode(path, number, raw))
    return lines, blank


def _row_sentence(path: Path, where: str, number: int, text, category) -> Sentence:
    """A Sentence from one row's `text` and `category` values, checked; `where` is "line" or "row"."""
    if not isinstance(text, str):
        raise AttnprobeError(
            f"corpus {path} {where} {number}: 'text' is {_JSON_TYPES.get(type(text), type(text).__name__)}, "
            "not a string: give every row a non-empty 'text' string"
        )
    if not text.strip():
        raise AttnprobeError(f"corpus {path} {where} {number}: 'text' is empty: give the row some text or remove it")
    if category is not None:
        if not isinstance(category, str):
            raise AttnprobeError(
                f"corpus {path} {where} {number}: 'category' is "
                f"{_JSON_TYPES.get(type(category), type(category).__name__)}, not a string: "
                "use a category name, or null for none"
            )
        if not category.strip():
            raise AttnprobeError(
                f"corpus {path} {where} {number}: 'category' is empty: use a category name, or null for none"
            )
        category = category.strip()
    return Sentence(text=text.strip(), line=number, category=category)


def _read_jsonl(path: Path) -> Corpus:
    digest = hashlib.sha256()
    sentences = []
    for number, raw in _raw_lines(path, digest):
        line = _decode(path, number, raw)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise AttnprobeError(
                f"corpus {path} line {number} is not valid JSON ({err.msg}, column {err.colno}): "
                'write one JSON object per line, e.g. {"text": "The cat sat."}'
            ) from err
        if not isinstance(row, dict):
            raise AttnprobeError(
                f"corpus {path} line {number} is {_JSON_TYPES.get(type(row), 'a value')}, not a JSON object: "
                'write one object per line, e.g. {"text": "The cat sat."}'
            )
        if "text" not in row:
            found = ", ".join(row) or "none"
            raise AttnprobeError(
                f"corpus {path} line {number} has no 'text' field (fields found: {found}): "
                "give every row a 'text' string"
            )
        sentences.append(_row_sentence(path, "line", number, row["text"], row.get("category")))
    if not sentences:
        raise AttnprobeError(f"corpus {path} is empty: add {_TABLE_FILES[_JSONL]}")
    return Corpus(path=path, sha256=digest.hexdigest(), sentences=tuple(sentences))


def _read_parquet(path: Path) -> Corpus:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise AttnprobeError(f"reading the .parquet corpus {path} needs pyarrow: pip install pyarrow") from err
    try:
        sha256 = file_sha256(path)
    except OSError as err:
        raise AttnprobeError(f"cannot read corpus {path}: {err.strerror}") from err

    def unreadable(err: Exception) -> AttnprobeError:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return AttnprobeError(
            f"cannot read corpus {path} as Parquet ({reason}): write it with pyarrow or pandas, or use .jsonl"
        )

    try:
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
    except (pa.ArrowException, OSError) as err:
        raise unreadable(err) from err
    if "text" not in names:
        found = ", ".join(names) or "none"
        raise AttnprobeError(
            f"corpus {path} has no 'text' column (columns found: {found}): name the column of sequences 'text'"
        )
    columns = ["text", "category"] if "category" in names else ["text"]
    sentences = []
    number = 0
    try:
        for batch in table.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            texts = batch.column(0).to_pylist()
            categories = batch.column(1).to_pylist() if len(columns) == 2 else [None] * len(texts)
            for text, category in zip(texts, categories):
                number += 1
                sentences.append(_row_sentence(path, "row", number, text, category))
    except (pa.ArrowException, OSError) as err:
        raise unreadable(err) from err
    finally:
        table.close()
    if not sentences:
        raise AttnprobeError(f"corpus {path} has no rows: add rows with {_TABLE_FILES[_PARQUET]}")
    return Corpus(path=path, sha256=sha256, sentences=tuple(sentences))
