"""How heads are named in every table, plot and message: L0H10 is layer 0, head 10 (TransformerLens's names).

CSV files keep separate `layer` and `head` columns; only what a person reads uses these names.
"""

from __future__ import annotations

import re
import unicodedata

from attnprobe.errors import AttnprobeError

_NAME = re.compile(r"L(\d+)H(\d+)", re.IGNORECASE)
_DOTTED = re.compile(r"(\d+)\.(\d+)")  # the older layer.head form, still accepted on input


# characters that reorder or hide the text around them: bidi embeddings, overrides and isolates, marks, and
# line/paragraph separators (control characters, category Cc, are escaped too)
_HIDDEN = {"\u061c", "\u200e", "\u200f", "\u2028", "\u2029", *map(chr, range(0x202A, 0x202F)),
           *map(chr, range(0x2066, 0x206A))}


def visible(text: str, keep: str = "") -> str:
    """`text` with control and bidi characters written as escapes (`\\x1b`, `\\u202e`), so that a name shows what
    it holds and cannot reverse or hide what follows it (characters in `keep`, e.g. a newline, stay)."""
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if (unicodedata.category(ch) == "Cc" or ch in _HIDDEN) and ch not in keep else ch for ch in text)


def counted(n: object, noun: str) -> str:
    """`1 sentence`, `2 sentences`: `n` and the noun, in the plural unless n is 1 (a count not known, "?", too)."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def sequence_noun(split: object) -> str:
    """What one item of a corpus is called: a sentence where it is split into lines (the default), a sequence where
    `--split paragraphs` or `--split file` made it (one document is no sentence)."""
    return "sentence" if split in (None, "lines") else "sequence"


def head_name(layer: int, head: int) -> str:
    """`L{layer}H{head}`: unambiguous where `0.1` and `0.10` read as the same number."""
    return f"L{int(layer)}H{int(head)}"


def parse_head(text: str) -> tuple[int, int] | None:
    """(layer, head) from `L17H4` (any case) or `17.4`; None when `text` is neither."""
    text = text.strip()
    match = _NAME.fullmatch(text) or _DOTTED.fullmatch(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_heads(text: str, option: str = "--heads") -> list[tuple[int, int]]:
    """`L17H4,L18H6` -> [(17, 4), (18, 6)], in the given order, each head once; one-line errors."""
    pairs = []
    for part in text.split(","):
        if not part.strip():
            continue
        pair = parse_head(part)
        if pair is None:
            raise AttnprobeError(f"{option} {text!r}: {part.strip()!r} is not a head; name heads as L<layer>H<head> "
                                 "separated by commas, e.g. L17H4,L18H6")
        pairs.append(pair)
    if not pairs:
        raise AttnprobeError(f"{option} {text!r} names no head: give e.g. L17H4,L18H6")
    return list(dict.fromkeys(pairs))


def check_heads_exist(heads: list[tuple[int, int]], layers: int, per_layer: int, option: str = "--heads") -> None:
    """One line naming the first head outside a model of `layers` x `per_layer` heads."""
    for layer, head in heads:
        if not (0 <= layer < layers and 0 <= head < per_layer):
            raise AttnprobeError(f"{option} {head_name(layer, head)}: the model has layers 0-{layers - 1} and heads "
                                 f"0-{per_layer - 1} (L0H0 to {head_name(layers - 1, per_layer - 1)})")
