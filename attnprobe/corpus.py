"""Read a corpus: UTF-8 text, one sentence per line, `#` comments and blank lines skipped."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from attnprobe.errors import AttnprobeError

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


def read_corpus(path: str | Path) -> Corpus:
    """Load and validate a corpus file; raise AttnprobeError naming the problem and the fix."""
    path = Path(path)
    raw = _read_bytes(path)
    if not raw.strip():
        raise AttnprobeError(f"corpus {path} is empty: add one sentence per line")
    sentences = tuple(parse_lines(_decode_lines(path, raw), source=str(path)))
    if not sentences:
        raise AttnprobeError(
            f"corpus {path} has no sentences, only blank or '#' comment lines: "
            "add one sentence per line"
        )
    return Corpus(path=path, sha256=hashlib.sha256(raw).hexdigest(), sentences=sentences)


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


def _read_bytes(path: Path) -> bytes:
    if path.is_dir():
        raise AttnprobeError(
            f"corpus {path} is a directory: pass a text file with one sentence per line"
        )
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
