"""Read a corpus of sequences: a UTF-8 text file split in one of three modes (`SPLITS`), or a table of rows.

- "lines": one sentence per line; blank lines and `#` comments skipped, `# category: <name>` tags.
- "paragraphs": blocks separated by blank lines, each one text; `#` lines are content, no categories.
- "file": the whole file is one text.

A `.jsonl` file (one JSON object per line) or a `.parquet` file (read with pyarrow) holds one sequence per
row in a `text` field or column, with an optional `category` (string or null). Both are read as a stream,
and every format is hashed in chunks, so a large corpus is never held whole as raw bytes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import sys
from collections.abc import Iterable, Iterator
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


CHARS_PER_TOKEN = 32  # generous: tokenizers average 3-5 characters per token of text, rarely over 16


def clip_text(text: str, max_tokens: int) -> str:
    """`text` cut to `max_tokens` x CHARS_PER_TOKEN characters before it is tokenized: a model keeps at most
    `max_tokens` tokens of it, and tokenizing a 50 MB line whole would take minutes and gigabytes only to
    cut it there."""
    limit = max(1, max_tokens) * CHARS_PER_TOKEN
    return text if len(text) <= limit else text[:limit]


class Corpus:
    """A corpus file, read as a stream: `stream()` yields its sentences afresh from the file each time.

    `read_corpus` checks the whole file once (sha256, number of sentences, categories) and keeps none
    of its text, so a corpus of millions of sentences costs no memory until it is streamed. A Corpus
    made from sentences in memory, `Corpus(path, sha256, sentences)`, streams those. `sentences` and
    `texts` read every sentence into memory: for small corpora and tests.
    """

    def __init__(
        self, path: str | Path, sha256: str, sentences: Iterable[Sentence] | None = None, *, split: str = "lines",
        count: int | None = None, labels: tuple[str | None, ...] | None = None,
    ) -> None:
        self.path, self.sha256, self.split = Path(path), sha256, split
        self._held = tuple(sentences) if sentences is not None else None
        self.count = len(self._held) if self._held is not None else int(count or 0)
        held = self._held or ()
        # every distinct category, None included, in order of first appearance
        self.labels = labels if labels is not None else tuple(dict.fromkeys(s.category for s in held))
        self.limit: int | None = None  # set by `head`: only the first `limit` sequences are streamed
        self._source: Corpus | None = None  # `head` of a file: the whole corpus, streamed up to `count`

    def head(self, limit: int | None) -> Corpus:
        """This corpus cut to its first `limit` sequences (`--limit`); itself for None. The sha256 stays the
        whole file's, and `limit` records the cut."""
        if limit is None:
            return self
        check_limit(limit)
        first = list(itertools.islice(self.stream(), limit)) if self._held is not None else None
        if first is not None:
            cut = Corpus(self.path, self.sha256, first, split=self.split)
        else:
            labels = tuple(dict.fromkeys(s.category for s in itertools.islice(self.stream(), limit)))
            cut = Corpus(self.path, self.sha256, split=self.split, count=min(limit, self.count), labels=labels)
            cut._source = self
        cut.limit = limit
        return cut

    def __len__(self) -> int:
        return self.count

    @property
    def tagged(self) -> bool:
        """Whether any sentence has a category."""
        return any(label is not None for label in self.labels)

    def stream(self) -> Iterator[Sentence]:
        """Every sentence, in order; a file that changed since `read_corpus` is refused when the stream ends."""
        if self._held is not None:
            yield from self._held
            return
        if self._source is not None:  # `head`: the first sequences of the whole corpus (its end, and hash, never read)
            yield from itertools.islice(self._source.stream(), self.count)
            return
        digest = hashlib.sha256()
        yield from _sentences(self.path, self.split, digest)
        if _sha256(self.path, digest) != self.sha256:
            raise AttnprobeError(f"corpus {self.path} changed while attnprobe was reading it: run again on a "
                                 "file nothing else writes to")

    @functools.cached_property
    def sentences(self) -> tuple[Sentence, ...]:
        return self._held if self._held is not None else tuple(self.stream())

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.sentences]


MAX_LIMIT = sys.maxsize  # the most sequences --limit can ask for (what islice can count to)


def check_limit(limit: object) -> None:
    """`--limit N`: a whole number of sequences, 1 or more."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise AttnprobeError(f"--limit {limit!r} is not a whole number: give how many sequences to use, e.g. 100")
    if limit < 1:
        raise AttnprobeError(f"--limit {limit} is below 1: give how many of the first sequences to use, e.g. 100")
    if limit > MAX_LIMIT:  # itertools.islice takes at most sys.maxsize
        raise AttnprobeError(f"--limit {limit} is above {MAX_LIMIT:,}, more sequences than any corpus holds: give "
                             "how many of the first sequences to use, e.g. 100, or leave --limit out for all")


def read_corpus(path: str | Path, split: str = "lines") -> Corpus:
    """Check a corpus file in one streaming pass; raise AttnprobeError naming the problem and the fix."""
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
    else:
        _check_file(path, f"a text file with {_UNITS[split]}")
    digest = hashlib.sha256()
    count, labels = 0, {}
    for sentence in _sentences(path, split, digest):
        count += 1
        labels.setdefault(sentence.category)
    return Corpus(path, _sha256(path, digest), split=split, count=count, labels=tuple(labels))


def _sentences(path: Path, split: str, digest) -> Iterator[Sentence]:
    """The sentences of a corpus file, streamed; `digest` sees the bytes of text and .jsonl files."""
    suffix = path.suffix.lower()
    if suffix == _JSONL:
        return _read_jsonl(path, digest)
    if suffix == _PARQUET:
        return _read_parquet(path)
    return _read_text(path, split, digest)


def _sha256(path: Path, digest) -> str:
    """The file's sha256: from the digest its stream fed, or (Parquet, read by pyarrow) read afresh."""
    if path.suffix.lower() != _PARQUET:
        return digest.hexdigest()
    try:
        return file_sha256(path)
    except OSError as err:
        raise AttnprobeError(f"cannot read corpus {path}: {err.strerror}") from err


def _read_text(path: Path, split: str, digest) -> Iterator[Sentence]:
    seen = {"content": False, "sentences": False}

    def lines() -> Iterator[str]:
        for number, raw in _raw_lines(path, digest):
            seen["content"] = seen["content"] or bool(raw.strip())
            yield _decode(path, number, raw)

    for sentence in _split(lines(), split, source=str(path)):
        seen["sentences"] = True
        yield sentence
    if not seen["content"] or (not seen["sentences"] and split != "lines"):
        raise AttnprobeError(f"corpus {path} is empty: add {_UNITS[split]}")
    if not seen["sentences"]:
        raise AttnprobeError(
            f"corpus {path} has no sentences, only blank or '#' comment lines: add one sentence per line"
        )


def _split(lines: Iterable[str], split: str, source: str) -> Iterable[Sentence]:
    if split == "paragraphs":
        return iter_paragraphs(lines)
    if split == "file":
        return parse_file(lines)
    return iter_lines(lines, source=source)


def parse_lines(lines: Iterable[str], source: str = "corpus") -> list[Sentence]:
    """Sentences from text lines; `# category: <name>` tags the sentences below it, up to the next tag."""
    return list(iter_lines(lines, source))


def iter_lines(lines: Iterable[str], source: str = "corpus") -> Iterator[Sentence]:
    """`parse_lines`, one sentence at a time."""
    category: str | None = None
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
            yield Sentence(text=text, line=number, category=category)


def parse_paragraphs(lines: Iterable[str]) -> list[Sentence]:
    """One text per block of non-blank lines, verbatim (`#` lines included); line = the block's first line."""
    return list(iter_paragraphs(lines))


def iter_paragraphs(lines: Iterable[str]) -> Iterator[Sentence]:
    """`parse_paragraphs`, one paragraph at a time."""
    block: list[str] = []
    for number, line in enumerate(itertools.chain(lines, [""]), start=1):
        if line.strip():
            block.append(line.rstrip())
            continue
        if block:
            yield Sentence(text="\n".join(block).strip(), line=number - len(block), category=None)
            block = []


def parse_file(lines: Iterable[str]) -> list[Sentence]:
    """The whole text as one sentence at line 1, CRLF read as LF; none if it is only whitespace."""
    text = "\n".join(line.removesuffix("\r") for line in lines).strip()
    return [Sentence(text=text, line=1, category=None)] if text else []


IN_MEMORY = "<in memory>"  # the path of a corpus made from a list of sentences
CORPUS_KINDS = "a corpus file (str or Path), a list of sentences (str) or a Corpus"


def as_corpus(corpus: object, split: str = "lines") -> Corpus:
    """What the notebook API accepts as a corpus: a Corpus as it is, a file read with `read_corpus`, or a
    list (or tuple) of sentences, each one sequence, uncategorized."""
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, (str, Path)):
        if isinstance(corpus, str) and not Path(corpus).exists() and (" " in corpus or "\n" in corpus):
            raise AttnprobeError(f"corpus file not found: {corpus[:40]!r}: to pass sentences, pass a list of "
                                 "strings, e.g. [\"The cat sat.\"]")
        return read_corpus(corpus, split=split)
    if isinstance(corpus, (list, tuple)):
        return corpus_from_texts(corpus)
    raise AttnprobeError(f"corpus: expected {CORPUS_KINDS}; got {type(corpus).__name__}")


def corpus_from_texts(texts: list[str] | tuple[str, ...]) -> Corpus:
    """A corpus of these sentences, held in memory; its sha256 is that of the sentences joined by newlines."""
    bad = next((k for k, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise AttnprobeError(f"corpus[{bad}] is a {type(texts[bad]).__name__}: pass sentences as strings")
    empty = next((k for k, text in enumerate(texts) if not text.strip()), None)
    if empty is not None:
        raise AttnprobeError(f"corpus[{empty}] is empty: every sentence needs some text")
    if not texts:
        raise AttnprobeError("corpus: the list of sentences is empty: pass at least one")
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    return Corpus(IN_MEMORY, digest, [Sentence(text=text, line=k + 1, category=None) for k, text in enumerate(texts)])


def read_text_file(path: str | Path, option: str) -> str:
    """A whole UTF-8 text file that is not a corpus (retrieval's and train-pattern's --haystack), read and checked as
    a corpus is (`_check_file`, `_raw_lines`): a directory, a missing file, a device or a read that fails (EIO,
    permission) is one line naming `option`. Newlines are read as Python's text mode reads them (\r\n and \r as
    \n)."""
    path = Path(path)
    unit = "a long UTF-8 text file"
    _check_file(path, unit, option)
    data = b"\n".join(raw for _, raw in _raw_lines(path, hashlib.sha256(), option))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise AttnprobeError(f"{option} {path} is not UTF-8 text (byte {err.start}): convert it to UTF-8") from None
    if not text.strip():
        raise AttnprobeError(f"{option} {path} is empty: pass {unit}")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_file(path: Path, unit: str, option: str = "--corpus") -> None:
    what = "corpus" if option == "--corpus" else option
    if path.is_dir():
        raise AttnprobeError(f"{what} {path} is a directory: pass {unit}")
    if not path.exists():
        raise AttnprobeError(f"{what} file not found: {path}: check the path to {option}")
    if not path.is_file():  # a device (/dev/zero never ends), a FIFO (waits for a writer) or a socket
        raise AttnprobeError(f"{what} {path} is not a regular file (a device, pipe or socket): save the text to a "
                             f"file and pass {unit}")


def _raw_lines(path: Path, digest, option: str = "--corpus") -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of each line split at b"\\n" (the last one may be b""), hashing every chunk read; a
    read that fails (EIO, permission) is one line naming the file as `option`'s."""
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
        what = "corpus" if option == "--corpus" else option
        raise AttnprobeError(f"cannot read {what} {path}: {err.strerror}") from err
    yield number, b"".join(pending)


def _decode(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise AttnprobeError(
            f"corpus {path} is not UTF-8: line {number}, byte {err.start + 1} "
            f"(0x{raw[err.start]:02x}); re-save the file as UTF-8"
        ) from err


def unencodable(text: str) -> int | None:
    """The position of the first lone surrogate in `text` (a JSON "\\ud800" escape, or a byte that was not UTF-8
    in a command-line argument), which no tokenizer takes; None when the text is plain Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def _row_sentence(path: Path, where: str, number: int, text, category) -> Sentence:
    """A Sentence from one row's `text` and `category` values, checked; `where` is "line" or "row"."""
    if not isinstance(text, str):
        raise AttnprobeError(
            f"corpus {path} {where} {number}: 'text' is {_JSON_TYPES.get(type(text), type(text).__name__)}, "
            "not a string: give every row a non-empty 'text' string"
        )
    if not text.strip():
        raise AttnprobeError(f"corpus {path} {where} {number}: 'text' is empty: give the row some text or remove it")
    position = unencodable(text)
    if position is not None:
        raise AttnprobeError(
            f"corpus {path} {where} {number}: 'text' holds a lone surrogate (\\u{ord(text[position]):04x}, character "
            f"{position + 1}), which is not a character: fix the \\u escape"
        )
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


def _read_jsonl(path: Path, digest) -> Iterator[Sentence]:
    rows = 0
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
        except RecursionError:
            raise AttnprobeError(
                f"corpus {path} line {number} is nested too deeply to read: "
                'write one flat JSON object per line, e.g. {"text": "The cat sat."}'
            ) from None
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
        rows += 1
        yield _row_sentence(path, "line", number, row["text"], row.get("category"))
    if not rows:
        raise AttnprobeError(f"corpus {path} is empty: add {_TABLE_FILES[_JSONL]}")


def _read_parquet(path: Path) -> Iterator[Sentence]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise AttnprobeError(f"reading the .parquet corpus {path} needs pyarrow: pip install pyarrow") from err

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
    number = 0
    try:
        for batch in _parquet_batches(table, columns, unreadable):
            texts = batch.column(0).to_pylist()
            categories = batch.column(1).to_pylist() if len(columns) == 2 else [None] * len(texts)
            for text, category in zip(texts, categories):
                number += 1
                yield _row_sentence(path, "row", number, text, category)
    finally:
        table.close()
    if not number:
        raise AttnprobeError(f"corpus {path} has no rows: add rows with {_TABLE_FILES[_PARQUET]}")


def _parquet_batches(table, columns: list[str], unreadable) -> Iterator:
    """Record batches of `columns`, pyarrow's errors as one line (not those of the code consuming them)."""
    import pyarrow as pa

    batches = table.iter_batches(batch_size=_BATCH_ROWS, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as err:
            raise unreadable(err) from err
        yield batch
