"""Marked regions of a markdown page: the blocks that `make figures` rewrites.

A region is a line `<!-- figure:NAME -->`, the generated text, and a line `<!-- /figure -->`; each marker is a
line of its own, outside fenced code blocks (so a page can show the syntax in a code block). NAME is a figure
of figures/registry.py. Everything outside the markers is left exactly as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OPEN = re.compile(r"^<!-- figure:([a-z0-9][a-z0-9-]*) -->$")
CLOSE = "<!-- /figure -->"
FENCE = re.compile(r"^\s*(```|~~~)")


class RegionError(ValueError):
    """A marker without its pair, a nested one, or a marker that is not a line of its own."""


@dataclass(frozen=True)
class Region:
    name: str
    start: int  # index of the opening marker's line
    end: int  # index of the closing marker's line
    body: str  # the lines between, joined


def lines_outside_code(lines: list[str]) -> list[bool]:
    """Per line: True when it is outside a fenced code block (the fence lines themselves count as inside)."""
    outside, fenced = [], False
    for line in lines:
        if FENCE.match(line):
            fenced = not fenced
            outside.append(False)
        else:
            outside.append(not fenced)
    return outside


def find(text: str) -> list[Region]:
    """Every region of `text`, in order; RegionError when the markers are not well formed."""
    lines = text.split("\n")
    regions, open_at, name = [], None, ""
    for i, (line, outside) in enumerate(zip(lines, lines_outside_code(lines))):
        if not outside:
            continue
        stripped = line.strip()
        opening = OPEN.match(stripped)
        if stripped.startswith(("<!-- figure", "<!-- /figure")) and not (opening or stripped == CLOSE):
            raise RegionError(f"line {i + 1}: a figure marker must be a line of its own: {line!r}")
        if opening and line != stripped or stripped == CLOSE and line != CLOSE:
            raise RegionError(f"line {i + 1}: a figure marker starts at the line's first column: {line!r}")
        if opening:
            if open_at is not None:
                raise RegionError(f"line {i + 1}: figure {opening[1]!r} opens inside figure {name!r} "
                                  f"(line {open_at + 1})")
            open_at, name = i, opening[1]
        elif stripped == CLOSE:
            if open_at is None:
                raise RegionError(f"line {i + 1}: {CLOSE} closes no figure")
            regions.append(Region(name, open_at, i, "\n".join(lines[open_at + 1 : i])))
            open_at = None
    if open_at is not None:
        raise RegionError(f"line {open_at + 1}: figure {name!r} is never closed with {CLOSE}")
    return regions


def block(body: str) -> str:
    """A region's text between its markers: one blank line each side, so markdown reads it as its own block."""
    return "\n" + body.strip("\n") + "\n"


def rewrite(text: str, bodies: dict[str, str]) -> str:
    """`text` with the body of every region named in `bodies` replaced; other regions and text unchanged."""
    lines = text.split("\n")
    out, last = [], 0
    for region in find(text):
        if region.name not in bodies:
            continue
        out.extend(lines[last : region.start + 1])
        out.extend(block(bodies[region.name]).split("\n"))
        last = region.end
    out.extend(lines[last:])
    return "\n".join(out)


def outside(text: str) -> str:
    """`text` with every region's body and every fenced code block blanked (lines kept, so numbers still
    point at the right line): what a person types by hand."""
    lines = text.split("\n")
    keep = lines_outside_code(lines)
    for region in find(text):
        for i in range(region.start, region.end + 1):
            keep[i] = False
    return "\n".join(line if k else "" for line, k in zip(lines, keep))
