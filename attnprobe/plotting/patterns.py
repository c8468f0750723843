"""`plot`'s head_patterns: attention maps of the clearest head of each type (`representatives`) or of chosen heads
on one example sentence, each panel titled with the head's type and scores; `draw_pattern` draws one map."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties

from attnprobe import defaults
from attnprobe.classify import ALL_TYPES
from attnprobe.errors import AttnprobeError
from attnprobe.naming import head_name
from attnprobe.plotting.style import (
    Undrawable,
    any_script_figure,
    one_line,
    plain_text,
    settle_layout,
    short_text,
    spaced_suptitle,
    token_label,
)

PICK_BY = {  # the clearest head of each type: (column, largest?)
    "previous": ("previous_token", True), "local": ("diagonal_unforced", True), "sink": ("first_token_unforced", True),
    "dormant": ("output_norm_ratio", False), "copy": ("entropy_unforced", False), "broad": ("entropy_norm", True),
    "streaming": ("sink_window", True), "full-cache": ("sink_window", False),
}


MIN_LABEL_PT = 6.0  # smaller tick labels are thinned out instead
PANEL_TITLE_PT = 9.0  # a pattern panel's title (head, type, scores)
TITLE_MARGIN = 0.9  # inches of a pattern panel's nominal side its title leaves free (the map is drawn narrower)
TITLE_WIDTH = 3.4  # inches a pattern panel's title may take at least: two scores a line
TITLE_GAP_IN = 0.4  # inches between two pattern panels' titles side by side, at least


def pattern_label_size(n: int, side: float) -> tuple[float, int]:
    """Font size (pt) of a pattern panel's token labels, and every how many tokens one is shown: labels stay
    at least MIN_LABEL_PT and are thinned out where `n` tokens do not fit the panel's `side` inches."""
    spacing = max(side - 1.6, 1.0) * 72.0 / max(n, 1)  # points per token along an axis
    size = min(8.0, 0.75 * spacing)
    if size >= MIN_LABEL_PT:
        return size, 1
    return MIN_LABEL_PT, math.ceil(MIN_LABEL_PT / (0.75 * spacing))


def label_room(tokens: list[str], side: float) -> float:
    """Inches the token labels take beside a pattern panel (rotated below it, and to its left)."""
    size, _ = pattern_label_size(len(tokens), side)
    longest = max((len(token_label(t)) for t in tokens), default=1)
    return (longest * size * 0.62 + 14.0) / 72.0


def pattern_side(n: int) -> float:
    """Inches per pattern panel for `n` tokens: room for readable labels up to 40 tokens, at most 7.5 inches."""
    return min(7.5, max(3.5, 0.15 * n + 1.6))


def draw_pattern(ax: Axes, attention: np.ndarray, tokens: list[str], title: str, side: float | None = None) -> Any:
    """One head's attention on the example sentence: rows are queries, columns keys."""
    image = ax.imshow(attention, cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
    labels = [token_label(t) for t in tokens]
    size, step = pattern_label_size(len(labels), side if side is not None else pattern_side(len(labels)))
    shown = range(0, len(labels), step)
    ax.set_xticks(shown, [labels[k] for k in shown], rotation=90, fontsize=size)
    ax.set_yticks(shown, [labels[k] for k in shown], fontsize=size)
    thinned = f", every {step}th token labelled" if step > 1 else ""
    ax.set_xlabel(f"key (attended to){thinned}", fontsize=9)
    ax.set_ylabel("query", fontsize=9)
    ax.set_title(title, fontsize=PANEL_TITLE_PT)
    return image


def head_table(types: pd.DataFrame, heads: pd.DataFrame | None = None) -> pd.DataFrame:
    """head_types.csv with the columns of heads.csv it lacks (for the scores shown in each pattern panel)."""
    if heads is None:
        return types.reset_index(drop=True)
    extra = [c for c in heads.columns if c not in types.columns]
    return types.merge(heads[["layer", "head", *extra]], on=["layer", "head"], how="left")


def is_first_token_sink(row: pd.Series | pd.DataFrame) -> Any:
    """Whether most of a head's attention goes to the first token (the extended scheme's sink rule)."""
    return row["first_token_unforced"] > defaults.SINK_MIN_FIRST_TOKEN + 1e-6


def representatives(types: pd.DataFrame, heads: pd.DataFrame | None = None) -> dict[str, tuple[int, int]]:
    """The clearest head of each type present: (layer, head).

    The sharpest copy head is often a pure first-token sink, which shows nothing of copying: where
    `first_token_unforced` is known (in `types` or `heads`), a copy head that is no sink is preferred."""
    table = head_table(types, heads)
    picks: dict[str, tuple[int, int]] = {}
    for kind, group in table.groupby("head_type"):
        if kind == "copy" and "first_token_unforced" in group.columns:
            others = group[~is_first_token_sink(group).fillna(False).astype(bool)]
            group = others if not others.empty else group
        column, largest = PICK_BY.get(str(kind), ("entropy", None))
        if not group[column if largest is not None else "entropy_unforced"].notna().any():
            continue  # the score that picks the clearest head holds no value (all NaN): no head can be named
        if largest is None:  # mixed: the most typical, nearest the median entropy
            index = (group["entropy_unforced"] - group["entropy_unforced"].median()).abs().idxmin()
        else:
            index = group[column].idxmax() if largest else group[column].idxmin()
        picks[str(kind)] = (int(group.loc[index, "layer"]), int(group.loc[index, "head"]))
    return {kind: picks[kind] for kind in ALL_TYPES if kind in picks}


def text_inches(text: str, size: float) -> float:
    """The width of one line of `text` at `size` pt, in inches, in the current font, as Agg draws it."""
    from matplotlib.backends.backend_agg import RendererAgg

    width, _, _ = RendererAgg(1, 1, 72).get_text_width_height_descent(text, FontProperties(size=size), ismath=False)
    return width / 72.0  # at 72 dpi a pixel is a point


def fit_lines(pieces: list[str], width: float, size: float, sep: str, balanced: bool = False) -> list[str]:
    """`pieces` joined by `sep` into lines no wider than `width` inches at `size` pt (a piece wider than that
    alone gets a line of its own): a panel's title stays above its panel, clear of its neighbours and the colour
    bar (side by side, 70-character lines of scores ran into each other). `balanced`: as many lines, each as
    short as that allows, so that a last line is not left with one word where the words allow (not "... like
    every copy head / here")."""
    def greedy(limit: float) -> list[str]:
        lines: list[str] = []
        for piece in pieces:
            if lines and text_inches(lines[-1] + sep + piece, size) <= limit:
                lines[-1] += sep + piece
            else:
                lines.append(piece)
        return lines

    lines = greedy(width)
    if not balanced or len(lines) < 2:
        return lines
    low, high = max(text_inches(piece, size) for piece in pieces), width  # greedy(high) has len(lines) lines
    for _ in range(20):  # the narrowest width that needs no more lines
        middle = (low + high) / 2
        if len(greedy(middle)) <= len(lines):
            high = middle
        else:
            low = middle
    return greedy(high)


def panel_title(heading: str, scores: list[str], width: float) -> str:
    """A pattern panel's title: the heading (head, type, note) broken between words and the scores between
    scores, each line no wider than `width` inches."""
    lines = fit_lines(heading.split(" "), width, PANEL_TITLE_PT, " ", balanced=True)
    return "\n".join(lines + fit_lines(scores, width, PANEL_TITLE_PT, ", "))


# A pattern panel's score names: the words report.html's score menu uses (its labels, "entropy, unforced", with the
# qualifier in brackets, since ", " parts the scores), not heads.csv's column names
SCORE_WORDS = {
    "entropy": "entropy", "entropy_unforced": "entropy (unforced)", "entropy_norm": "normalized entropy",
    "diagonal": "diagonal", "diagonal_unforced": "diagonal (unforced)",
    "first_token_unforced": "first token (unforced)", "previous_token": "previous token",
    "sink_window": "sink + window",
}


def head_scores(row: pd.Series) -> list[str]:
    """The scores that decide a head's type, for its pattern panel's title, in words (SCORE_WORDS): they are the
    head's means over the corpus (heads.csv's unforced scores where it has them), not the example's."""
    def value(*columns: str) -> tuple[str, float] | None:
        found = [(c, float(row[c])) for c in columns if c in row.index and pd.notna(row[c])]
        return found[0] if found else None

    first = [value("entropy_unforced", "entropy"), value("entropy_norm")]
    second = [value("diagonal_unforced", "diagonal"), value("first_token_unforced"), value("previous_token"),
              value("sink_window")]

    def shown(name: str, score: float) -> str:
        return f"{SCORE_WORDS[name]} {score:.2f}" + (" nats" if name in ("entropy", "entropy_unforced") else "")

    return [shown(*found) for found in (*first, *second) if found]


SCORES_NOTE = "panel scores: the head's means over the corpus (heads.csv), not this sentence's"


def example_caption(example: dict[str, Any], limit: int = 110) -> str:
    """`"The sentence ..." (line 12, svo, first 40 of 52 tokens)` for a figure title."""
    n = len(example["tokens"])
    bits = [f"line {example['line']}" if example.get("line", -1) >= 0 else "", str(example.get("category") or "")]
    total = int(example.get("total_tokens", n))
    bits.append(f"first {n} of {total} tokens" if total > n else f"{n} tokens")
    sentence = plain_text(short_text(one_line(example["sentence"]), limit), newlines=False)
    return f'"{sentence}" ({plain_text(", ".join(b for b in bits if b))})'


def choose_example(examples: list[dict[str, Any]], wanted: str | int | None) -> dict[str, Any]:
    """The example sentence `wanted` names: its number among `examples` (0 = the default example) or its text
    (the whole sentence, or a piece found in exactly one of them, any case); the first for None."""
    if not examples:
        raise AttnprobeError("no example sentences in the results folder: run `attnprobe analyze` again")
    if wanted is None:
        return examples[0]
    listed = "; ".join(f"{k} {short_text(e['sentence'], 40)!r}" for k, e in enumerate(examples))
    text = str(wanted).strip()
    if text.isdigit():
        if int(text) < len(examples):
            return examples[int(text)]
        raise AttnprobeError(f"--example {text}: analyze kept {len(examples)} example sentence(s), numbered "
                             f"0-{len(examples) - 1}: {listed}")
    exact = [e for e in examples if e["sentence"].strip() == text]
    found = exact or [e for e in examples if text.casefold() in e["sentence"].casefold()]
    if len(found) == 1:
        return found[0]
    if found:
        raise AttnprobeError(f"--example {text!r} is in {len(found)} example sentences: give more of the text or "
                             f"a number: {listed}")
    raise AttnprobeError(f"--example {text!r} is not among the {len(examples)} example sentence(s) analyze kept "
                         f"(plot loads no model, so it can draw only these; `attnprobe rollout --example` runs any "
                         f"text): pick a number or text: {listed}")


def panel_grid(count: int) -> tuple[int, int]:
    """(rows, columns) of pattern panels: one row up to 3, 2 x 2 for 4, else rows of 3."""
    columns = count if count <= 3 else (2 if count == 4 else 3)
    return math.ceil(count / columns), columns


def pattern_caption(kind: str, layer: int, head: int, table: pd.DataFrame, chosen: bool, width: float) -> str:
    """A pattern panel's title: the head's name, its type (and whether a copy head is a first-token sink), and the
    scores that decide the type, in lines no wider than `width` inches."""
    row = table.loc[(layer, head)] if (layer, head) in table.index else pd.Series(dtype=float)
    note = ""
    if kind == "copy" and "first_token_unforced" in row.index and is_first_token_sink(row):
        note = ": a first-token sink" + ("" if chosen else ", like every copy head here")
    heading = f"{head_name(layer, head)}" + (f" {kind}" if kind else "") + note
    return panel_title(heading, head_scores(row) if not row.empty else [], width)


@any_script_figure
def head_patterns_figure(
    example: dict[str, Any], types: pd.DataFrame, heads: pd.DataFrame | None = None,
    chosen: list[tuple[int, int]] | None = None, title: str | None = None,
) -> Figure:
    """Attention maps on one example sentence: the clearest head of each type, or the `chosen` (layer, head)s.

    Each panel is titled with the head's name, its type and the scores that decide the type; a copy head
    that is a first-token sink says so (the pick prefers one that is not, when `heads` or `types` tell)."""
    table = head_table(types, heads).set_index(["layer", "head"])
    if chosen:
        panels = [(str(table.loc[pair, "head_type"]) if pair in table.index else "", pair) for pair in chosen]
    else:
        panels = list(representatives(types, heads).items())
    if not panels and not table.empty:
        raise Undrawable("heads.csv holds no value (all NaN) in the scores that pick each type's clearest head")
    if not panels:
        raise AttnprobeError("no head to draw: head_types.csv is empty")
    tokens = example["tokens"]
    n = len(tokens)
    side = pattern_side(n)
    labels_in = label_room(tokens, side)
    captions = [pattern_caption(kind, layer, head, table, chosen is not None, max(side - TITLE_MARGIN, TITLE_WIDTH))
                for kind, (layer, head) in panels]
    widest = max(text_inches(line, PANEL_TITLE_PT) for caption in captions for line in caption.split("\n"))
    lines = max(caption.count("\n") + 1 for caption in captions)
    rows, columns = panel_grid(len(panels))
    column = max(side, widest + TITLE_GAP_IN) + labels_in + 0.35  # a title never wider than its column
    row = side + labels_in + 0.35 + lines * PANEL_TITLE_PT * 1.3 / 72.0
    figure = Figure(figsize=(columns * column + 1.1, rows * row + 0.7), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    image = None
    for ax, caption, (_, (layer, head)) in zip(axes, captions, panels):
        image = draw_pattern(ax, example["maps"][layer, head], tokens, caption, side)
    spare = axes[len(panels):]
    if len(spare):  # the colour bar goes into the first free slot of the grid, the rest stay empty
        for ax in spare:
            ax.set_axis_off()
        figure.colorbar(image, cax=spare[0].inset_axes((0.05, 0.1, 0.06, 0.8)), label="attention weight")
    else:
        figure.colorbar(image, ax=list(axes), label="attention weight", shrink=0.8 if rows == 1 else 0.5)
    what = "The chosen heads" if chosen else "One head of each type"
    heading = f"{what} on {example_caption(example)}\n{SCORES_NOTE}"
    spaced_suptitle(figure, f"{plain_text(title)}\n{heading}" if title else heading, fontsize=11)
    settle_layout(figure)
    return figure
