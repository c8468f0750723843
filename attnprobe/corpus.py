"""Read a corpus of UTF-8 text, split into sentences in one of three modes (`SPLITS`).

- "lines": one sentence per line; blank lines and `#` comments skipped, `# category: <name>` tags.
- "paragraphs": blocks separated by blank lines, each one text; `#` lines are content, no categories.
- "file": the whole file is one text.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from attnprobe.errors import AttnprobeError

SPLITS = ("lines", "paragraphs", "file")

# What a corpus file holds in each split mode, for the fix in error messages.
_UNITS = {"lines": "one sentence per line", "paragraphs": "paragraphs separated by blank lines", "file": "some text"}

_CATEGORY_TAG = re.compile(r"^#\s*category\s*:\s*(?P<name>.*?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Sentence:
    text: str
    line: int  # 1-based line number in the corpus file
    category: str | None  # from the nearest `# category: <name>` line above, if any


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
    raw = _read_bytes(path, _UNITS[split])
    if not raw.strip():
        raise AttnprobeError(f"corpus {path} is empty: add {_UNITS[split]}")
    sentences = tuple(_split(_decode_lines(path, raw), split, source=str(path)))
    if not sentences and split != "lines":
        raise AttnprobeError(f"corpus {path} is empty: add {_UNITS[split]}")
    if not sentences:
        raise AttnprobeError(
            f"corpus {path} has no sentences, only blank or '#' comment lines: "
            "add one sentence per line"
        )
    return Corpus(path=path, sha256=hashlib.sha256(raw).hexdigest(), sentences=sentences)


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


def _read_bytes(path: Path, unit: str) -> bytes:
    if path.is_dir():
        raise AttnprobeError(f"corpus {path} is a directory: pass a text file with {unit}")
    if not path.exists():
        raise AttnprobeError(f"corpus file not found: {path}: check the path to --corpus")
    try:
        return path.read_bytes()
    except OSError as err:
        raise AttnprobeError(f"cannot read corpus {path}: {err.strerror}") from err


def _decode_lines(path: Path, raw: bytes) -> list[str]:
    lines = []
    for number, chunk in enumerate(raw.split(b"\n"), start=1):
        try:
            text = chunk.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise AttnprobeError(
                f"corpus {path} is not UTF-8: line {number}, byte {err.start + 1} "
                f"(0x{chunk[err.start]:02x}); re-save the file as UTF-8"
            ) from err
        lines.append(text)
    return lines
