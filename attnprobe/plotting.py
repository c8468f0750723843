"""Figures from result tables. Each `draw_*` fills the Axes it is given; nothing here writes files."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from attnprobe import defaults
from attnprobe.classify import ALL_TYPES, counts_per_layer
from attnprobe.errors import AttnprobeError
from attnprobe.naming import counted, head_name, visible

TYPE_COLORS = {  # previous sits inside local and sink inside copy: each pair told apart by hue, not shade
    "previous": "#e6ab02", "local": "#1b9e77", "sink": "#e7298a", "dormant": "#8e0152", "copy": "#d95f02",
    "broad": "#7570b3", "mixed": "#a6a6a6", "streaming": "#4575b4", "retrieval": "#d73027",
}
PICK_BY = {  # the clearest head of each type: (column, largest?)
    "previous": ("previous_token", True), "local": ("diagonal_unforced", True), "sink": ("first_token_unforced", True),
    "dormant": ("output_norm_ratio", False), "copy": ("entropy_unforced", False), "broad": ("entropy_norm", True),
    "streaming": ("sink_window", True), "retrieval": ("sink_window", False),
}
MISSING_COLOR = "#e0e0e0"  # a head grid's cell without a value (a head ablate did not ablate)
MAX_ANNOTATED_CELLS = 400  # beyond this many heads the heatmap drops its per-cell numbers
HEADROOM = 0.08  # share of the highest value left free above it on a y axis from 0
MEAN_COLOR = "#08306b"  # the mean over heads: darker than any head-type or category colour
CATEGORY_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")  # matplotlib's tab10, one per sentence category
# Fonts tried in turn for each character, so token labels in any script draw without a "Glyph ... missing"
# warning: DejaVu Sans (Latin, Greek, Cyrillic, Arabic, Hebrew, many symbols and emoji), then whatever of
# these is installed, then matplotlib's Last Resort font (3.10+), which draws a box naming the script.
FALLBACK_FONTS = (
    "DejaVu Sans", "Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans CJK KR", "Noto Sans JP", "Noto Sans SC",
    "Noto Sans KR", "Noto Sans", "Noto Sans Devanagari", "Noto Sans Thai", "Noto Sans Symbols 2", "Noto Emoji",
    "Droid Sans Fallback", "WenQuanYi Zen Hei", "Arial Unicode MS", "Symbola", "Last Resort High-Efficiency",
)
LABEL_MAX_CHARS = 12  # a longer token label is cut, with an ellipsis
CONTINUATION = "\u00b7"  # the label of a token that only carries more bytes of the character before it
MIN_LABEL_PT = 6.0  # smaller tick labels are thinned out instead
PANEL_TITLE_PT = 9.0  # a pattern panel's title (head, type, scores)
TITLE_MARGIN = 0.9  # inches of a pattern panel's nominal side its title leaves free (the map is drawn narrower)
TITLE_WIDTH = 3.4  # inches a pattern panel's title may take at least: two scores a line
TITLE_GAP_IN = 0.4  # inches between two pattern panels' titles side by side, at least


@functools.cache
def installed_fallback_fonts() -> tuple[str, ...]:
    """FALLBACK_FONTS that matplotlib can find here (naming a missing one would log a findfont warning)."""
    from matplotlib import font_manager

    present = {font.name for font in font_manager.fontManager.ttflist}
    return tuple(name for name in FALLBACK_FONTS if name in present)


def any_script() -> Any:
    """A context in which new text falls back through FALLBACK_FONTS, after the user's own font family."""
    families = list(matplotlib.rcParams["font.family"])
    extra = [name for name in installed_fallback_fonts() if name not in families]
    return matplotlib.rc_context({"font.family": families + extra})


def any_script_figure(build: Callable[..., Figure]) -> Callable[..., Figure]:
    """Build the figure inside `any_script()`: each Text keeps its fonts, so drawing it later needs no context."""

    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Figure:
        with any_script():
            return build(*args, **kwargs)

    return wrapper


def plain_text(text: str, newlines: bool = True) -> str:
    """`text` as matplotlib should show it literally: `$` escaped (no mathtext), control characters as escapes
    (line breaks kept unless `newlines` is False). Every title, label and legend entry that holds text from
    outside attnprobe (a model or folder name, a corpus, a category, a token) goes through it, once."""
    return visible(text, keep="\n" if newlines else "").replace("$", r"\$")


def token_label(token: str, limit: int = LABEL_MAX_CHARS) -> str:
    """How a token label reads on an axis: stripped; whitespace as its repr; "" (the further bytes of a
    character split over tokens) as a middle dot; cut to `limit` characters."""
    if token == "":
        return CONTINUATION
    shown = token.strip() or repr(token)
    shown = shown if len(shown) <= limit else shown[: limit - 1] + "\u2026"
    return plain_text(shown, newlines=False)


TITLE_GAP = 0.08  # inches of space (constrained layout's h_pad) around panels, so a figure title clears panel titles


def spaced_suptitle(figure: Figure, text: str, **kwargs: Any) -> None:
    """The figure's title, with room between it and the panels' own titles (they touched)."""
    figure.suptitle(text, **kwargs)
    figure.get_layout_engine().set(h_pad=TITLE_GAP)


def settle_layout(figure: Figure, passes: int = 6) -> None:
    """Run constrained layout until the panels stop moving, then keep that layout (no layout engine from here on).

    With fixed-aspect panels (attention maps) one pass of constrained layout does not converge: it placed the
    panels from extents measured before their aspect was applied, and the top row's "key (attended to)" label ran
    into the bottom row's titles (issue 34); savefig draws once or twice, so what it saved depended on that. Kept
    fixed in figure fractions, the layout is the same at any dpi."""
    before: list[tuple[float, ...]] = []
    for _ in range(passes):
        figure.draw_without_rendering()
        now = [tuple(ax.get_position().bounds) for ax in figure.axes]
        if before and np.allclose(now, before, rtol=0, atol=1e-4):
            break
        before = now
    figure.set_layout_engine("none")


def one_line(text: str) -> str:
    """`text` with each run of whitespace (line breaks of a long document included) as one space."""
    return " ".join(text.split())


def short_text(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def layer_ticks(ax: Axes, layers: Any) -> None:
    """Ticks on existing layers only (every one up to 16, else a round step and the last layer), no margin
    that would invite a tick past the last layer."""
    present = sorted({int(x) for x in layers})
    if not present:
        return
    first, last = present[0], present[-1]
    if len(present) <= 16:
        ticks = present
    else:
        step = next(s for s in (2, 5, 10, 20, 50, 100, 200, 500, 1000) if (last - first) / s <= 10)
        ticks = list(range(first, last + 1, step))
        if last - ticks[-1] >= step / 2:
            ticks.append(last)
    ax.set_xticks(ticks)
    ax.set_xlim(first - 0.6, last + 0.6)


def grid(heads: pd.DataFrame, column: str) -> np.ndarray:
    """A [layer, head] array of one column of heads.csv."""
    table = heads.pivot(index="layer", columns="head", values=column).sort_index().sort_index(axis=1)
    return table.to_numpy(dtype=float)  # [layer, head]


def draw_head_grid(
    ax: Axes, heads: pd.DataFrame, column: str, title: str, cmap: str, vmin: float | None = None,
    vmax: float | None = None, digits: int = 2,
) -> Any:
    """A layers x heads grid of one column, each cell annotated while there are few enough: with `digits`
    decimals, or, for `digits` < 0, with -`digits` significant digits. The numbers are black on light cells and
    white on dark ones, whichever way the colour map runs."""
    values = grid(heads, column)  # [layer, head]
    n_layers, n_heads = values.shape
    colors = colormaps[cmap].with_extremes(bad=MISSING_COLOR)  # a cell without a value is grey, not a colour
    image = ax.imshow(np.ma.masked_invalid(values), cmap=colors, aspect="auto", interpolation="nearest", vmin=vmin,
                      vmax=vmax)
    ax.set_title(title)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    if values.size <= MAX_ANNOTATED_CELLS:
        size = 8 if values.size <= 160 else 6
        for (layer, head), value in np.ndenumerate(values):
            if not np.isfinite(value):
                continue  # no value, no number: the cell stays grey
            ax.text(head, layer, cell_text(value, digits), ha="center", va="center", fontsize=size,
                    color=ink_on(colors(image.norm(value))))
    return image


def ink_on(rgba: Any) -> str:
    """Black or white, whichever reads on a cell of colour `rgba`."""
    red, green, blue = rgba[:3]
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def cell_text(value: float, digits: int) -> str:
    """`value` with `digits` decimals, or with -`digits` significant digits when `digits` is negative."""
    if digits >= 0:
        return f"{value:.{digits}f}"
    return f"{value:.{-digits}g}"


ENTROPY_CMAP = "viridis"  # as in report.html's grid: low entropy (sharp) dark, high entropy (diffuse) light
ENTROPY_BAR_LABEL = "entropy (nats): dark = sharp, light = diffuse"


def draw_entropy_heatmap(ax: Axes, heads: pd.DataFrame) -> Any:
    return draw_head_grid(ax, heads, "entropy", "Mean attention entropy per head (dark = sharp)", ENTROPY_CMAP)


def draw_layer_entropy(ax: Axes, heads: pd.DataFrame, layers: pd.DataFrame) -> None:
    """Each head as a dot, the middle half of the layer's heads as a band (quartiles: never below 0 nats, as
    a mean - sd band can be), and the mean over heads as a line."""
    per_layer = heads.groupby("layer")["entropy"]
    low, high = per_layer.quantile(0.25), per_layer.quantile(0.75)  # indexed by layer
    ax.scatter(heads["layer"], heads["entropy"], s=10, color="#9ecae1", label="one head", zorder=1)
    ax.fill_between(low.index, low.to_numpy(), high.to_numpy(), color="#3182bd", alpha=0.25, linewidth=0,
                    label="middle half of heads (quartiles)", zorder=0)
    ax.plot(layers["layer"], layers["entropy"], marker="o", markersize=4, color=MEAN_COLOR, label="mean over heads",
            zorder=2)
    ax.set_title("Entropy by depth")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention entropy (nats)")
    from_zero(ax, [heads["entropy"], high, layers["entropy"]])
    layer_ticks(ax, layers["layer"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the axes: it covers no head


def from_zero(ax: Axes, values: list[Any]) -> None:
    """The y axis from 0 to HEADROOM above the largest of `values`: autoscaling put the top right at the largest
    value, so where every value is about the same (all near 1) the lines and dots lay on the top spine."""
    finite = np.concatenate([np.asarray(v, dtype=float).ravel() for v in values])
    finite = finite[np.isfinite(finite)]
    top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    ax.set_ylim(0.0, top * (1.0 + HEADROOM))


def category_score(categories: pd.DataFrame) -> str:
    """The column the category panel draws: normalized entropy when categories.csv has it, else raw entropy."""
    return "entropy_norm" if "entropy_norm" in categories.columns else "entropy"


def draw_category_lines(ax: Axes, categories: pd.DataFrame, layers: pd.DataFrame) -> None:
    """One line per sentence category with its 95% interval as a band, and the mean of all sentences dashed."""
    score = category_score(categories)
    if score in layers.columns:
        ax.plot(layers["layer"], layers[score], color="black", linestyle="--", linewidth=1.2, label="all sentences")
    for k, (category, group) in enumerate(categories.groupby("category", sort=False)):
        color = CATEGORY_COLORS[k % len(CATEGORY_COLORS)]
        if {f"{score}_ci_low", f"{score}_ci_high"} <= set(group.columns):
            ax.fill_between(group["layer"], group[f"{score}_ci_low"], group[f"{score}_ci_high"], color=color,
                            alpha=0.15, linewidth=0)
        count = f" ({int(group['sentences'].iloc[0])})" if "sentences" in group.columns else ""
        ax.plot(group["layer"], group[score], linewidth=1.3, color=color, label=plain_text(f"{category}{count}"))
    if score == "entropy_norm":
        ax.set_ylabel("normalized entropy H / ln(keys)")
        ax.set_title("By sentence category (bands: 95% intervals)")
    else:
        ax.set_ylabel("mean attention entropy (nats)")
        ax.set_title("By sentence category (bands: 95% intervals)\n"
                     "raw entropy: longer sentences sit higher", fontsize=10)
    ax.set_xlabel("layer")
    drawn = [categories[c] for c in (score, f"{score}_ci_high") if c in categories.columns]
    from_zero(ax, [*drawn, layers[score] if score in layers.columns else []])
    layer_ticks(ax, categories["layer"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="category (sentences)")


def draw_type_distribution(ax: Axes, types: pd.DataFrame) -> None:
    """Stacked bars of the types present (the first type at the bottom); the legend lists them top-down, as stacked."""
    counts = counts_per_layer(types)  # the same columns `attnprobe classify` prints
    bottom = np.zeros(len(counts))
    for kind in counts.columns:
        if counts[kind].sum() == 0:
            continue  # a type no head has stays out of the bars and the legend
        ax.bar(counts.index, counts[kind], bottom=bottom, color=TYPE_COLORS[kind], label=kind)
        bottom += counts[kind].to_numpy()
    ax.set_title("Head types by layer")
    ax.set_xlabel("layer")
    ax.set_ylabel("number of heads")
    ax.set_ylim(0, max(bottom.max(), 1.0) * 1.02)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    layer_ticks(ax, counts.index)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title="head type")


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


class Undrawable(AttnprobeError):
    """A figure whose data hold no value (a score column all NaN): `plot` skips it with a warning."""


def check_has_values(heads: pd.DataFrame, column: str) -> None:
    """Refuse (Undrawable) to draw a score of which heads.csv holds no value."""
    if column in heads.columns and not heads[column].notna().any():
        raise Undrawable(f"heads.csv's {column} holds no value (all NaN)")


@any_script_figure
def entropy_heatmap_figure(heads: pd.DataFrame, title: str | None = None) -> Figure:
    check_has_values(heads, "entropy")
    n_layers, n_heads = grid(heads, "entropy").shape
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    figure.colorbar(draw_entropy_heatmap(ax, heads), ax=ax, label=ENTROPY_BAR_LABEL)
    if title is not None:  # the title names what is drawn; the panel's own title says how to read it
        figure.suptitle(plain_text(title))
        ax.set_title("dark = sharp heads, light = diffuse ones", fontsize=10)
    return figure


@any_script_figure
def layer_gradient_figure(
    heads: pd.DataFrame, layers: pd.DataFrame, types: pd.DataFrame, categories: pd.DataFrame | None = None,
    title: str | None = None,
) -> Figure:
    """Entropy by depth (heads, quartile band, mean), by sentence category when there are categories, and the
    head types per layer."""
    if categories is None:
        figure = Figure(figsize=(13.0, 4.8), layout="constrained")
        left, right = figure.subplots(1, 2)
    else:
        figure = Figure(figsize=(19.0, 4.8), layout="constrained")
        left, middle, right = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 1.2, 1.0]})
        draw_category_lines(middle, categories, layers)
    draw_layer_entropy(left, heads, layers)
    draw_type_distribution(right, types)
    if title is not None:
        spaced_suptitle(figure, plain_text(title))
    return figure


def text_inches(text: str, size: float) -> float:
    """The width of one line of `text` at `size` pt, in inches, in the current font, as Agg draws it."""
    from matplotlib.backends.backend_agg import RendererAgg

    width, _, _ = RendererAgg(1, 1, 72).get_text_width_height_descent(text, FontProperties(size=size), ismath=False)
    return width / 72.0  # at 72 dpi a pixel is a point


def fit_lines(pieces: list[str], width: float, size: float, sep: str, balanced: bool = False) -> list[str]:
    """`pieces` joined by `sep` into lines no wider than `width` inches at `size` pt (a piece wider than that
    alone gets a line of its own): a panel's title stays above its panel, clear of its neighbours and the colour
    bar (side by side, 70-character lines of scores ran into each other). `balanced`: as many lines, each as
    short as that allows, so that a last line is not left with one word where the words allow (issue 34: "... like
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
# qualifier in brackets, since ", " parts the scores), not heads.csv's column names (issue 34)
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


@any_script_figure
def probe_heatmap_figure(
    scores: pd.DataFrame, kinds: list[str], model: str, chance: dict[str, float] | None = None
) -> Figure:
    """One layers x heads panel per probe kind, stacked, on a shared 0-1 scale (dark = strong); `chance` (per kind, the
    score of uniform attention) is drawn as a red line on the colour bar."""
    n_layers, n_heads = grid(scores, kinds[0]).shape
    width = float(np.clip(0.45 * n_heads + 2.0, 6.0, 15.0))  # panels stacked: the figure is as wide as one panel
    panel = float(np.clip(0.32 * n_layers + 1.3, 2.6, 24.0 / len(kinds)))  # and at most ~26 in tall in all
    figure = Figure(figsize=(width + 1.5, panel * len(kinds) + 1.0), layout="constrained")
    axes = np.atleast_1d(figure.subplots(len(kinds), 1))
    image = None
    chance = {k: float(v) for k, v in (chance or {}).items() if k in kinds}
    for ax, kind in zip(axes, kinds):
        heading = f"{kind} score" + (f" (chance {chance[kind]:.3f})" if kind in chance else "")
        image = draw_head_grid(ax, scores, kind, heading, "Purples", vmin=0.0, vmax=1.0)
    label = "mean attention to the target token"
    bar = figure.colorbar(image, ax=list(axes), label=label, shrink=0.8)
    if chance:
        levels: dict[str, list[str]] = {}
        for kind, value in chance.items():
            levels.setdefault(f"{value:.3f}", []).append(kind)
            bar.ax.axhline(value, color="#d62728", linewidth=2.0)
        where = "; ".join(f"{', '.join(names)} {level}" for level, names in levels.items())
        bar.set_label(f"{label}\nred line: chance, uniform attention ({where})")
    spaced_suptitle(figure, f"Synthetic probes on {plain_text(model)}: random tokens repeated twice")
    return figure


# layers coloured by depth: light = early, dark = deep, from report.js's drawPositions colours (issue 34: the PNG ran
# viridis, dark = early, the report's chart the other way)
DEPTH_LIGHT, DEPTH_DARK = "#bec8dc", "#14285a"  # rgb(190, 200, 220) and rgb(20, 40, 90), as report.js
POSITION_CMAP = LinearSegmentedColormap.from_list("attnprobe_depth", [DEPTH_LIGHT, DEPTH_DARK])


POSITION_XLABEL = "query position (0-based, log scale of position + 1)"


def position_x(positions: pd.DataFrame) -> pd.Series:
    """Where a bin sits on the 0-based position axis: the geometric centre of its first and last positions + 1,
    less 1 (bin 0 at 0, bin 1 at 1)."""
    return np.sqrt((positions["position_min"] + 1.0) * (positions["position_max"] + 1.0)) - 1.0


def _log1p(x: Any) -> Any:
    return np.log1p(np.maximum(x, 0.0))


def position_scale(ax: Axes, longest: float) -> None:
    """A log scale of position + 1 on the x axis, so 0-based position 0 has a place, with ticks at 0-based
    positions 0, 1, 10, 100, ... (and 3, 30, 300, ... while there are few decades) up to `longest`."""
    ax.set_xscale("function", functions=(_log1p, np.expm1))
    ticks, decade = [0, 1], 10
    while decade <= max(longest, 1.0):
        ticks.append(decade)
        decade *= 10
    if len(ticks) <= 4:
        ticks = sorted(ticks + [3 * t for t in ticks[1:] if 3 * t <= longest])
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlim(-0.1, max(longest, 1.0) * 1.1)


def layer_norm(positions: pd.DataFrame) -> Normalize:
    """Maps layer numbers onto the colormap; a single layer lands in its middle."""
    layers = positions["layer"].dropna()
    if layers.empty:
        return Normalize(0.0, 1.0)
    low, high = float(layers.min()), float(layers.max())
    return Normalize(low - 0.5, high + 0.5) if low == high else Normalize(low, high)


def draw_position_profile(ax: Axes, positions: pd.DataFrame, column: str, ylabel: str) -> ScalarMappable:
    """One line per layer, the mean over its heads per position bin, coloured by depth; bins without a value skipped.

    Returns the mappable for a colour bar labelled by layer."""
    table = positions.groupby(["layer", "bin"]).agg(
        position_min=("position_min", "min"), position_max=("position_max", "max"), value=(column, "mean"),
    ).reset_index()  # mean skips NaN: the nanmean over heads, NaN where no head has a value
    table["x"] = position_x(table)
    norm = layer_norm(positions)
    cmap = POSITION_CMAP
    for layer, group in table.groupby("layer"):
        group = group.sort_values("bin").dropna(subset=["value"])
        if group.empty:
            continue
        ax.plot(group["x"], group["value"], marker="o", markersize=2.5, linewidth=1.2,
                color=cmap(norm(layer)), label=f"layer {layer}")
    position_scale(ax, float(table["position_max"].max()) if table["position_max"].notna().any() else 1.0)
    ax.set_xlabel(POSITION_XLABEL)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    return ScalarMappable(norm=norm, cmap=cmap)


@any_script_figure
def position_profile_figure(positions: pd.DataFrame, title: str | None = None) -> Figure:
    """Entropy and first-token mass against query position, one line per layer, with a layer colour bar."""
    figure = Figure(figsize=(12.0, 4.6), layout="constrained")
    left, right = figure.subplots(1, 2)
    mappable = draw_position_profile(left, positions, "entropy", "mean attention entropy (nats)")
    left.set_title("Entropy by query position")
    draw_position_profile(right, positions, "first_token", "attention mass on the first token")
    right.set_title("First-token mass by query position")
    bar = figure.colorbar(mappable, ax=[left, right], label="layer (light = early, dark = deep)", shrink=0.9)
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


DIFF_CMAP = "RdBu_r"  # B - A: blue where B is lower, red where higher, white at 0


def difference_norm(values: np.ndarray) -> TwoSlopeNorm:
    """Centred on 0 and symmetric, so equal colours mean equal changes either way (all zeros too)."""
    largest = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    largest = largest if largest > 0 else 1e-9
    return TwoSlopeNorm(vcenter=0.0, vmin=-largest, vmax=largest)


def draw_difference_grid(ax: Axes, heads: pd.DataFrame, score: str) -> Any:
    """B - A of one score per head (compare_heads.csv), a box around heads whose interval excludes 0."""
    values = grid(heads, f"{score}_diff")  # [layer, head]
    changed = (grid(heads, f"{score}_diff_ci_low") > 0) | (grid(heads, f"{score}_diff_ci_high") < 0)  # [layer, head]
    norm = difference_norm(values)
    image = ax.imshow(values, cmap=DIFF_CMAP, norm=norm, aspect="auto", interpolation="nearest")
    n_layers, n_heads = values.shape
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"B - A: {score} per head (boxed: 95% interval excludes 0)", fontsize=10)
    for (layer, head), flag in np.ndenumerate(changed):
        if flag:
            ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.4))
    if values.size <= MAX_ANNOTATED_CELLS:
        digits = 2 if norm.vmax >= 0.5 else 3
        size = 7 if values.size <= 160 else 5
        for (layer, head), value in np.ndenumerate(values):
            color = "white" if abs(value) > 0.6 * norm.vmax else "black"
            ax.text(head, layer, f"{value:+.{digits}f}", ha="center", va="center", fontsize=size, color=color)
    return image


def draw_compared_layers(ax: Axes, layers: pd.DataFrame, score: str, labels: tuple[str, str], x: str) -> None:
    """Both runs' mean over heads per layer (x = `layer`) or per relative depth (x = `depth`), with intervals."""
    for side, label, color in (("a", labels[0], "#4d4d4d"), ("b", labels[1], "#d6604d")):
        ax.fill_between(layers[x], layers[f"{score}_{side}_ci_low"], layers[f"{score}_{side}_ci_high"], color=color,
                        alpha=0.2, linewidth=0)
        ax.plot(layers[x], layers[f"{score}_{side}"], marker="o" if x == "layer" else None, markersize=3, color=color,
                label=plain_text(f"{side.upper()}: {label}"))  # a depth grid interpolates between layers: no markers
    ax.set_xlabel("relative depth, layer / (layers - 1)" if x == "depth" else "layer")
    ax.set_ylabel(f"{score}, mean over the layer's heads")
    ax.set_title(f"{score} by {'relative depth' if x == 'depth' else 'layer'} (bands: 95% intervals)", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    if x == "layer":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_type_fractions(ax: Axes, types: pd.DataFrame | None, labels: tuple[str, str]) -> None:
    """Share of heads of each type in A and B, side by side."""
    ax.set_title("Head types (share of all heads)", fontsize=10)
    if types is None:
        ax.text(0.5, 0.5, "head types not comparable\n(different classify schemes)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    x = np.arange(len(types))
    for offset, side, label, color in ((-0.2, "a", labels[0], "#4d4d4d"), (0.2, "b", labels[1], "#d6604d")):
        ax.bar(x + offset, types[f"fraction_{side}"], width=0.4, color=color,
               label=plain_text(f"{side.upper()}: {label}"))
    ax.set_xticks(x, [plain_text(str(kind)) for kind in types["head_type"]])
    ax.set_ylabel("fraction of heads")
    ax.legend(loc="best", fontsize=8)


def draw_layer_difference(ax: Axes, layers: pd.DataFrame, score: str, x: str) -> None:
    """B - A of the layer means per layer or per relative depth, with its 95% interval and a line at 0."""
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.fill_between(layers[x], layers[f"{score}_diff_ci_low"], layers[f"{score}_diff_ci_high"], color="#d6604d",
                    alpha=0.25, linewidth=0, label="95% interval")
    ax.plot(layers[x], layers[f"{score}_diff"], marker="o" if x == "layer" else None, markersize=3, color="#b2182b",
            label="B - A")
    ax.set_xlabel("relative depth, layer / (layers - 1)" if x == "depth" else "layer")
    ax.set_ylabel(f"B - A ({score})")
    ax.set_title(f"B - A of the layer means of {score}", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    if x == "layer":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_label(side: dict[str, Any]) -> str:
    """`model (dtype) on corpus` of one side of compare.json."""
    model = (side.get("model") or {}).get("spec") or side.get("label", "?")
    dtype = f" ({side['dtype']})" if side.get("dtype") else ""
    corpus = (side.get("corpus") or {}).get("path")
    return f"{model}{dtype}" + (f" on {PurePath(str(corpus)).name}" if corpus else "")


@any_script_figure
def compare_figure(
    layers: pd.DataFrame, info: dict[str, Any], heads: pd.DataFrame | None = None, types: pd.DataFrame | None = None,
    score: str | None = None,
) -> Figure:
    """compare.png. Same shape: the B - A heatmap, both layer gradients and their difference.
    Different shapes: both curves and their difference by relative depth, and the head-type shares."""
    score = score or info["score"]
    labels = (info["a"]["label"], info["b"]["label"])
    if heads is not None:
        n_layers, n_heads = grid(heads, f"{score}_diff").shape
        width, height = max(6.0, 0.6 * n_heads + 2.5), max(7.0, 0.4 * n_layers + 1.5)
        figure = Figure(figsize=(width + 6.5, height), layout="constrained")
        spec = figure.add_gridspec(2, 2, width_ratios=[width, 6.5])
        heatmap = figure.add_subplot(spec[:, 0])
        figure.colorbar(draw_difference_grid(heatmap, heads, score), ax=heatmap, label=f"B - A ({score})")
        draw_compared_layers(figure.add_subplot(spec[0, 1]), layers, score, labels, "layer")
        draw_layer_difference(figure.add_subplot(spec[1, 1]), layers, score, "layer")
    else:
        figure = Figure(figsize=(18.0, 4.8), layout="constrained")
        curves, difference, shares = figure.subplots(1, 3)
        draw_compared_layers(curves, layers, score, labels, "depth")
        draw_layer_difference(difference, layers, score, "depth")
        draw_type_fractions(shares, types, labels)
    matched = "heads matched by position" if heads is not None else "heads not matched (different shapes)"
    figure.suptitle(plain_text(f"B - A: B = {run_label(info['b'])}, A = {run_label(info['a'])}\n"
                               f"{info['pairing']} bootstrap over {info.get('bootstrap_over', 'sentences')}; "
                               f"{matched}"), fontsize=11)
    return figure


IMPORTANCE_LABELS = {  # ablate's ranking measure: decoders, encoders
    "loss_change": "loss change when ablated (nats/token)",
    "embedding_change": "embedding change when ablated (1 - cosine)",
}


def importance_measure(importance: pd.DataFrame) -> str:
    """The column of importance.csv that ranks heads: loss_change (decoders) or embedding_change (encoders)."""
    return "loss_change" if "loss_change" in importance.columns else "embedding_change"


def full_grid(frame: pd.DataFrame, column: str, shape: tuple[int, int] | None = None) -> pd.DataFrame:
    """Every (layer, head) of a model of `shape` (layers, heads), NaN where `frame` has no row (ablate --heads);
    without `shape`, up to the largest layer and head in `frame`."""
    layers, heads = shape if shape is not None else (int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1)
    index = pd.MultiIndex.from_product([range(layers), range(heads)], names=["layer", "head"])
    values = frame.set_index(["layer", "head"])[column].reindex(index)
    return values.reset_index()


@any_script_figure
def importance_heatmap_figure(
    importance: pd.DataFrame, title: str | None = None, shape: tuple[int, int] | None = None
) -> Figure:
    """A layers x heads grid of the ranking measure: red = the model loses most without the head.

    `shape` (layers, heads) is the model's: with `ablate --heads` only the ablated heads have a value, and the
    others stay grey and blank."""
    column = importance_measure(importance)
    cells = full_grid(importance, column, shape)
    n_layers, n_heads = grid(cells, column).shape
    largest = float(np.nanmax(np.abs(cells[column]))) if cells[column].notna().any() else 0.0
    largest = largest if largest > 0 else 1e-9
    figure = Figure(figsize=(max(6.0, 0.6 * n_heads + 2.5), max(4.0, 0.4 * n_layers + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    heading = "Ablating one head: " + IMPORTANCE_LABELS[column]
    ablated = int(cells[column].notna().sum())
    if ablated < len(cells):
        heading += f"\n{ablated} of {len(cells)} heads ablated (grey: not ablated)"
    if column == "embedding_change":  # 1 - cosine is never negative: a sequential scale from 0, 3 significant digits
        image = draw_head_grid(ax, cells, column, heading, "Reds", vmin=0.0, vmax=largest, digits=-3)
    else:  # a loss change goes either way: centred on 0
        image = draw_head_grid(ax, cells, column, heading, "RdBu_r", vmin=-largest, vmax=largest)
    figure.colorbar(image, ax=ax, label=IMPORTANCE_LABELS[column])
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


PRUNING_COLORS = {"ablation": "#d62728", "kl": "#ff7f0e", "gradient": "#1f77b4", "random": "#7f7f7f"}
PRUNING_LABELS = {  # the measures of pruning.csv and layer_importance.csv, as an axis reads them
    "loss_change": "loss change (nats/token)", "kl": "KL(unablated || pruned) (nats/token)",
    "embedding_change": "embedding change (1 - cosine)", "hidden_change": "hidden-state change (1 - cosine)",
}


def pruning_measures(frame: pd.DataFrame) -> list[str]:
    """The measures of pruning.csv or layer_importance.csv drawn, one panel each: decoders loss change and KL,
    encoders embedding and hidden-state change."""
    return [name for name in PRUNING_LABELS if name in frame.columns]


@any_script_figure
def pruning_figure(pruning: pd.DataFrame, title: str | None = None) -> Figure:
    """pruning.csv: each measure against the percent of heads removed, one line per removal order, with its 95%
    interval as a band."""
    measures = pruning_measures(pruning)
    if "order" not in pruning.columns:
        raise AttnprobeError("pruning.csv has no order column: run `attnprobe ablate` again")
    if not measures:
        raise AttnprobeError("pruning.csv has no measure column (loss_change, kl, embedding_change or "
                             "hidden_change): run `attnprobe ablate` again")
    figure = Figure(figsize=(6.0 * len(measures) + 1.5, 4.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(measures)))
    for ax, name in zip(axes, measures):
        for k, (order, group) in enumerate(pruning.groupby("order", sort=False)):
            group = group.sort_values("percent")
            color = PRUNING_COLORS.get(str(order), CATEGORY_COLORS[k % len(CATEGORY_COLORS)])
            if {f"{name}_ci_low", f"{name}_ci_high"} <= set(group.columns):
                ax.fill_between(group["percent"], group[f"{name}_ci_low"], group[f"{name}_ci_high"], color=color,
                                alpha=0.15, linewidth=0)
            ax.plot(group["percent"], group[name], marker="o", markersize=3, color=color,
                    label=plain_text(str(order)))
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("heads removed (% of all heads)")
        ax.set_ylabel(PRUNING_LABELS[name])
        ax.set_title(f"{name} as heads are removed (bands: 95% intervals)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="removal order (least important first)")
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


STREAMING_COLORS = {"pattern": "#1f77b4", "random": "#7f7f7f"}
STREAMING_LABELS = {"loss_change": "loss change (nats/token)", "kl": "KL(full cache || streaming) (nats/token)"}


@any_script_figure
def streaming_figure(curve: pd.DataFrame, title: str | None = None) -> Figure:
    """streaming.csv: the loss change and the KL against the share of KV heads made streaming, one line per order
    (the pattern's, lowest score first, and random) with its 95% interval as a band; the chosen heads as a star.
    One row of panels per task (text, needle) where the table has a `task` column.

    Without a curve (`--no-pruning`: only the chosen heads' row) each panel shows that one result as a star with its
    95% interval as an error bar, and no band or legend; an order measured at one share only (`--shares 0.5`) is a
    point with an error bar too, not a one-point line (issue 34)."""
    tasks = list(dict.fromkeys(curve["task"])) if "task" in curve.columns else [None]
    figure = Figure(figsize=(13.5, 4.6 * len(tasks)), layout="constrained")
    axes = np.atleast_2d(figure.subplots(len(tasks), len(STREAMING_LABELS)))  # [task, measure]
    for task, row_axes in zip(tasks, axes):
        rows = curve if task is None else curve[curve["task"] == task]
        for ax, name in zip(row_axes, STREAMING_LABELS):
            streaming_panel(ax, rows, name)
            if task is not None:
                ax.set_title(f"{task} task: {ax.get_title()}", fontsize=10)
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


def streaming_panel(ax: Axes, curve: pd.DataFrame, name: str) -> None:
    """One measure of streaming.csv's rows against the share of KV heads streaming: a line and band per order
    measured at two shares or more, a point with an error bar where one share, and the chosen heads as a star."""
    def error_bar(x: float, row: pd.Series, **style: Any) -> None:
        low, high = row[name] - row[f"{name}_ci_low"], row[f"{name}_ci_high"] - row[name]
        ax.errorbar([x], [row[name]], yerr=[[max(low, 0.0)], [max(high, 0.0)]], capsize=3, linestyle="none", **style)

    lines = 0
    for k, (order, group) in enumerate(curve[curve["order"] != "chosen"].groupby("order", sort=False)):
        group = group.sort_values("share")
        color = STREAMING_COLORS.get(str(order), CATEGORY_COLORS[k % len(CATEGORY_COLORS)])
        percent = 100 * group["share"]
        if group["share"].nunique() < 2:  # one share: no curve to draw
            for _, row in group.iterrows():
                error_bar(100 * row["share"] + 1.5 * k, row, marker="o", markersize=5, color=color,  # side by side
                          label=plain_text(str(order)))
            continue
        lines += 1
        ax.fill_between(percent, group[f"{name}_ci_low"], group[f"{name}_ci_high"], color=color, alpha=0.15,
                        linewidth=0)
        ax.plot(percent, group[name], marker="o", markersize=3, color=color, label=plain_text(str(order)))
    chosen = curve[curve["order"] == "chosen"]
    for _, row in chosen.iterrows():
        error_bar(100 * row["share"], row, marker="*", markersize=11, color="#d62728",
                  label=f"chosen ({int(row['kv_heads_streaming'])} KV heads)")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("KV heads streaming (% of all KV heads)")
    ax.set_ylabel(STREAMING_LABELS[name])
    if lines:
        ax.set_title(f"{name} as KV heads keep only sink + recent keys (bands: 95% intervals)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="order (lowest score first)")
        return
    ax.set_xlim(0.0, 100.0)  # a point alone: where it sits among all KV heads
    if len(ax.get_legend_handles_labels()[0]) > 1:  # the chosen heads and orders at one share each
        ax.set_title(f"{name} at one share per order (bars: 95% intervals; no curve)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8, title="order (lowest score first)")
    else:
        ax.set_title(f"{name} with the chosen KV heads streaming (bar: 95% interval; no curve)", fontsize=10)
        for _, row in chosen.iterrows():
            ax.annotate(f"chosen: {int(row['kv_heads_streaming'])} KV heads", (100 * row["share"], row[name]),
                        xytext=(8, 6), textcoords="offset points", fontsize=8, color="#d62728")


@any_script_figure
def layer_importance_figure(layers: pd.DataFrame, title: str | None = None) -> Figure:
    """layer_importance.csv: per layer, each measure with every head of the layer ablated at once, as bars with
    their 95% intervals."""
    measures = pruning_measures(layers)
    if not measures:
        raise AttnprobeError("layer_importance.csv has no measure column: run `attnprobe ablate --layers` again")
    figure = Figure(figsize=(max(6.0, 0.35 * len(layers) + 3.0) * len(measures), 4.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(1, len(measures)))
    for ax, name in zip(axes, measures):
        values = layers[name].to_numpy(dtype=float)
        errors = None
        if {f"{name}_ci_low", f"{name}_ci_high"} <= set(layers.columns):
            errors = np.clip(np.vstack([values - layers[f"{name}_ci_low"].to_numpy(dtype=float),
                                        layers[f"{name}_ci_high"].to_numpy(dtype=float) - values]), 0.0, None)
        ax.bar(layers["layer"], values, color="#d6604d", yerr=errors, ecolor="black", capsize=2)
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("layer")
        ax.set_ylabel(PRUNING_LABELS[name])
        ax.set_title(f"Ablating a whole layer: {name} (bars: 95% intervals)", fontsize=10)
        layer_ticks(ax, layers["layer"])
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


def draw_importance_vs_entropy(ax: Axes, merged: pd.DataFrame, column: str) -> None:
    """One dot per head: entropy (x) against the ablation measure (y), with its 95% interval, coloured by type."""
    ax.errorbar(merged["entropy"], merged[column],
                yerr=[merged[column] - merged[f"{column}_ci_low"], merged[f"{column}_ci_high"] - merged[column]],
                fmt="none", ecolor="#bbbbbb", elinewidth=0.6, zorder=1)
    for kind, group in merged.groupby("head_type", sort=False):
        ax.scatter(group["entropy"], group[column], s=14, color=TYPE_COLORS.get(str(kind), "#333333"),
                   label=plain_text(f"{kind} ({len(group)})"), zorder=2)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("mean attention entropy (nats, heads.csv)")
    ax.set_ylabel(IMPORTANCE_LABELS[column])
    ax.set_title("Do sharp heads matter more?")
    ax.legend(loc="best", fontsize=8, title="head type")


def draw_importance_by_type(ax: Axes, merged: pd.DataFrame, column: str) -> None:
    """The ablation measure of every head of each type, jittered, with the type's median as a bar."""
    kinds = [k for k in ALL_TYPES if k in set(merged["head_type"])]
    kinds += sorted(set(merged["head_type"]) - set(kinds))
    jitter = np.random.default_rng(0)
    for x, kind in enumerate(kinds):
        values = merged.loc[merged["head_type"] == kind, column].dropna().to_numpy()
        ax.scatter(x + jitter.uniform(-0.2, 0.2, len(values)), values, s=12,
                   color=TYPE_COLORS.get(kind, "#333333"), alpha=0.8)
        if len(values):
            ax.hlines(np.median(values), x - 0.3, x + 0.3, color="black", linewidth=1.5)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(kinds)), [plain_text(str(kind)) for kind in kinds])
    ax.set_xlabel("head type (bar: median)")
    ax.set_ylabel(IMPORTANCE_LABELS[column])
    ax.set_title("Ablation by head type")


@any_script_figure
def importance_vs_type_figure(
    importance: pd.DataFrame, heads: pd.DataFrame, types: pd.DataFrame | None = None, title: str | None = None
) -> Figure:
    """Left: ablation measure against entropy, coloured by head type; right: the measure per type."""
    column = importance_measure(importance)
    merged = importance.merge(heads[["layer", "head", "entropy"]], on=["layer", "head"])
    if types is not None:
        merged = merged.merge(types[["layer", "head", "head_type"]], on=["layer", "head"], how="left")
        merged["head_type"] = merged["head_type"].fillna("unknown")
    else:
        merged["head_type"] = "all heads"
    figure = Figure(figsize=(13.0, 4.8), layout="constrained")
    left, right = figure.subplots(1, 2, sharey=True)
    draw_importance_vs_entropy(left, merged, column)
    draw_importance_by_type(right, merged, column)
    if title is not None:
        figure.suptitle(plain_text(title))
    return figure


@any_script_figure
def rollout_figure(rollout: Any, model: str, corpus: str | None = None) -> Figure:
    """Per example sentence (one row each): the rollout through every layer beside the last layer's raw map.

    `rollout` is a rollout.Rollout; both panels are head-averaged, on the same 0-1 scale. `corpus` (a name for
    the title) is where the sentences came from, None for sentences given on the command line.
    """
    rows = len(rollout.tokens)
    n = max(len(tokens) for tokens in rollout.tokens)
    side = pattern_side(n) + 0.4  # inches per panel
    labels_in = max(label_room(tokens, side) for tokens in rollout.tokens)
    figure = Figure(figsize=(2 * (side + labels_in + 0.35) + 1.1, rows * (side + labels_in + 0.6) + 0.5),
                    layout="constrained")
    axes = np.atleast_2d(figure.subplots(rows, 2, squeeze=False))  # [sentence, panel]
    image = None
    for s, tokens in enumerate(rollout.tokens):
        layers = rollout.rollout[s].shape[0]
        total = rollout.total_tokens[s]
        cut = f" (first {len(tokens)} of {total} tokens)" if total > len(tokens) else ""
        draw_pattern(axes[s, 0], rollout.rollout[s][-1], tokens,
                     f"rollout through {layers} layers{cut}\n"
                     f"{plain_text(short_text(one_line(rollout.sentences[s])), newlines=False)}", side)
        image = draw_pattern(axes[s, 1], rollout.raw[s], tokens, f"raw attention, last layer (layer {layers - 1})",
                             side)
    figure.colorbar(image, ax=list(axes.ravel()), label="share of the row (heads averaged)", shrink=0.6)
    source = f" on {corpus}" if corpus else " on the given sentences"
    figure.suptitle(plain_text(f"Attention rollout of {model}{source}: heads averaged, residual as identity with "
                               f"weight {rollout.residual:g}"))
    return figure


SIMILARITY_CMAP = "viridis"  # dark = alike (low JS), light = different: dark = low, as every grid here
SIMILARITY_BAR_LABEL = "Jensen-Shannon divergence (nats): dark = alike, light = different (ln 2 = 0.693: disjoint)"
MAX_HEAD_LABELS = 64  # up to this many heads the similarity matrix names every head; beyond, only the labelled ones
NO_TYPE_COLOR = "#333333"  # a head without a type (no head_types.csv row)


def head_kinds(layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None) -> list[str]:
    """The head type of each (layers[i], heads[i]) from head_types.csv's table ("" where it has none)."""
    if types is None:
        return [""] * len(layers)
    known = {(int(r.layer), int(r.head)): str(r.head_type) for r in types[["layer", "head", "head_type"]].itertuples()}
    return [known.get((int(layer), int(head)), "") for layer, head in zip(layers, heads)]


def type_handles(kinds: list[str]) -> list[Any]:
    """Legend patches of the types present, in classify's order, with their counts."""
    present = [k for k in ALL_TYPES if k in kinds] + sorted({k for k in kinds if k and k not in ALL_TYPES})
    return [Rectangle((0, 0), 1, 1, color=TYPE_COLORS.get(kind, NO_TYPE_COLOR),
                      label=plain_text(f"{kind} ({kinds.count(kind)})")) for kind in present]


CLUSTERS = 12  # a matrix of more than MAX_HEAD_LABELS heads is summarised as this many clusters of its tree
MAX_NAMED = 24  # at most this many heads named on a matrix or map of many heads
NAME_POINTS = 7  # the font size of those names; two names stay at least 1.4 times it apart


def cluster_exemplars(js: np.ndarray, clusters: np.ndarray) -> dict[int, int]:
    """Per cluster id, its most central head: the one of smallest mean JS to the others of its cluster."""
    out = {}
    for label in np.unique(clusters):
        members = np.flatnonzero(clusters == label)
        inner = js[np.ix_(members, members)].mean(axis=1)  # [member]
        out[int(label)] = int(members[int(np.argmin(inner))])
    return out


def spaced_names(wanted: list[int], position: np.ndarray, gap: float, limit: int = MAX_NAMED) -> list[int]:
    """Of the heads `wanted` (most important first), at most `limit` whose `position`s (in head units along the
    axis) lie at least `gap` apart, so their names do not overlap; later ones that would are left out."""
    kept: list[int] = []
    for i in dict.fromkeys(wanted):
        if len(kept) < limit and all(abs(position[i] - position[j]) >= gap for j in kept):
            kept.append(i)
    return kept


def cluster_summary(js: np.ndarray, clusters: np.ndarray, order: np.ndarray, kinds: list[str],
                    names: list[str]) -> list[tuple[int, int, int, str]]:
    """Per cluster in the matrix's order: (first position, last position + 1, its number from 1, a line saying its
    heads, mean JS within it, its commonest head type and its most central head)."""
    exemplar = cluster_exemplars(js, clusters)
    rows, start = [], 0
    ordered = clusters[order]
    for end in range(1, len(order) + 1):
        if end < len(order) and ordered[end] == ordered[start]:
            continue
        members = order[start:end]
        inner = js[np.ix_(members, members)]
        within = float(inner[np.triu_indices(len(members), k=1)].mean()) if len(members) > 1 else 0.0
        types = [kinds[i] for i in members if kinds[i]]
        common = max(dict.fromkeys(types), key=types.count) if types else ""  # a tie: the first in matrix order
        share = f", {types.count(common) / len(members):.0%} {common}" if common else ""
        number = len(rows) + 1
        rows.append((start, end, number, f"C{number}: {counted(len(members), 'head')}, JS within {within:.3f}{share}; "
                                         f"centre {names[exemplar[int(ordered[start])]]}"))
        start = end
    return rows


def names_caption(named: list[int], chosen: list[int], centres: list[int]) -> str:
    """What the names on a matrix of many heads are, as counted (issue 34: the caption said every cluster's centre
    was named where three were left out, their names too close to others)."""
    shown = set(named)
    chosen_shown = len(shown & set(chosen))
    centres_shown = sum(1 for i in centres if i in shown)
    parts = []
    if chosen:
        parts.append(f"{chosen_shown} of the {counted(len(set(chosen)), 'chosen head')}"
                     if chosen_shown < len(set(chosen)) else f"the {counted(len(set(chosen)), 'chosen head')}")
    if centres_shown == len(centres):
        parts.append("each cluster's centre")
    else:
        parts.append(f"the centres of {centres_shown} of the {counted(len(centres), 'cluster')}")
    left_out = "\n(names that would overlap are left out; every centre is listed on the right)" \
        if chosen_shown < len(set(chosen)) or centres_shown < len(centres) else ""
    return f"{len(named)} named: {' and '.join(parts)}{left_out}"


@any_script_figure
def head_similarity_figure(
    js: np.ndarray, layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None = None,
    labelled: list[tuple[int, int]] | None = None, title: str | None = None,
) -> Figure:
    """The [head, head] JS divergences of `attnprobe related`, rows and columns reordered by hierarchical
    clustering (average linkage on sqrt(JS)), with a strip of head-type colours on the left.

    Up to MAX_HEAD_LABELS heads the tree is drawn above and every head named. Beyond, the tree is cut into
    CLUSTERS clusters, shown as numbered bands above the matrix and lines across it and listed on the right
    (size, mean JS within, commonest type, most central head); at most MAX_NAMED heads are named (the `labelled`
    (layer, head)s first, then each cluster's centre), spaced so that no two names overlap."""
    from scipy.cluster.hierarchy import dendrogram, fcluster, leaves_list

    from attnprobe.similarity import LN2, cluster

    n = len(layers)
    tree = cluster(js) if n >= 2 else None
    order = leaves_list(tree) if tree is not None else np.arange(n)  # the tree's leaves, left to right
    names = [head_name(layers[i], heads[i]) for i in range(n)]
    kinds = head_kinds(layers, heads, types)
    many = n > MAX_HEAD_LABELS
    side = 9.0 if many else min(11.0, max(5.0, 0.16 * n + 3.0))
    listing = 4.2 if many else 0.0  # inches of the cluster list on the right
    figure = Figure(figsize=(side + 1.8 + listing, side + 2.6), layout="constrained")
    grid = figure.add_gridspec(2, 3 if many else 2, width_ratios=[0.35, side, listing][: 3 if many else 2],
                               height_ratios=[0.5 if many else 1.4, side])
    corner, tree_ax = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1])
    ax = figure.add_subplot(grid[1, 1])
    strip = figure.add_subplot(grid[1, 0], sharey=ax)
    image = ax.imshow(js[np.ix_(order, order)], cmap=SIMILARITY_CMAP, vmin=0.0, vmax=LN2, aspect="auto",
                      interpolation="nearest")
    colours = [matplotlib.colors.to_rgb(TYPE_COLORS.get(kinds[i], NO_TYPE_COLOR) if kinds[i] else "#ffffff")
               for i in order]
    strip.imshow(np.asarray(colours)[:, None, :], aspect="auto", interpolation="nearest")
    strip.set_xticks([])
    strip.set_ylabel("head type", fontsize=9)
    if types is None:
        strip.set_axis_off()  # no head types: no strip
    if not many:
        if tree is not None:  # the leaves sit at x = 5, 15, ...: the tree spans [0, 10 n] over the matrix's n columns
            dendrogram(tree, ax=tree_ax, no_labels=True, link_color_func=lambda _: "#555555")
            tree_ax.set_xlim(0, 10 * n)
        tree_ax.set_title("average-linkage tree on sqrt(JS)", fontsize=9)
        size = 8 if n <= 32 else 6
        ax.set_xticks(range(n), [names[i] for i in order], rotation=90, fontsize=size)
        ax.set_yticks(range(n), [names[i] for i in order], fontsize=size)
    else:
        clusters = fcluster(tree, t=min(CLUSTERS, n), criterion="maxclust")  # [head]: contiguous in the leaf order
        summary = cluster_summary(js, clusters, order, kinds, names)
        draw_cluster_bands(tree_ax, ax, summary, n)
        listed = figure.add_subplot(grid[1, 2])
        listed.set_axis_off()
        for k, (_, _, _, line) in enumerate(summary):
            listed.text(0.0, 1.0 - (k + 0.5) / max(len(summary), CLUSTERS), plain_text(line), fontsize=8,
                        va="center", ha="left", transform=listed.transAxes, wrap=False)
        listed.set_title("clusters of the tree, in matrix order", fontsize=9, loc="left")
        where = np.empty(n)
        where[order] = np.arange(n)  # [head]: its position in the matrix
        index = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(layers, heads))}
        chosen = [index[(int(a), int(b))] for a, b in labelled or [] if (int(a), int(b)) in index]
        centres = cluster_exemplars(js, clusters)
        centre_list = [centres[int(clusters[order[start]])] for start, *_ in summary]
        gap = 1.4 * NAME_POINTS / (side * 72 / n)  # heads between two names: 1.4 font heights
        named = sorted(spaced_names(chosen + centre_list, where, gap), key=lambda i: where[i])
        ax.set_xticks([where[i] for i in named], [names[i] for i in named], rotation=90, fontsize=NAME_POINTS)
        ax.set_yticks([where[i] for i in named], [names[i] for i in named], fontsize=NAME_POINTS)
        ax.set_xlabel(f"{counted(n, 'head')} in cluster order; {names_caption(named, chosen, centre_list)}",
                      fontsize=9)
    tree_ax.set_axis_off()
    ax.yaxis.tick_right()
    strip.tick_params(axis="y", left=False, labelleft=False)  # the names are on the matrix's right
    figure.colorbar(image, ax=ax, location="bottom", shrink=0.7, label=SIMILARITY_BAR_LABEL)
    corner.set_axis_off()
    handles = type_handles(kinds)
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=8,
                      title="head type (left strip)", frameon=False)
    heading = "How alike heads attend: JS divergence of every pair, clustered (dark blocks: groups of alike heads)"
    spaced_suptitle(figure, f"{plain_text(title)}\n{heading}" if title else heading, fontsize=11)
    return figure


def draw_cluster_bands(band_ax: Axes, ax: Axes, summary: list[tuple[int, int, int, str]], n: int) -> None:
    """The clusters as numbered bands above the matrix (the number where its band is wide enough) and thin
    white lines across the matrix between them."""
    for start, end, number, _ in summary:
        band_ax.axvspan(start - 0.5, end - 0.5, color="#d9d9e3" if number % 2 else "#a9a9bd", linewidth=0)
        if end - start >= n / 30:
            band_ax.text((start + end - 1) / 2, 0.5, f"C{number}", ha="center", va="center", fontsize=8)
        if start:
            ax.axhline(start - 0.5, color="white", linewidth=0.8)
            ax.axvline(start - 0.5, color="white", linewidth=0.8)
    band_ax.set_xlim(-0.5, n - 0.5)
    band_ax.set_ylim(0, 1)


def label_rises(points: np.ndarray, span: float, near: float = 0.05, step: float = 11.0) -> list[float]:
    """Points by which each label of `points` [label, 2] is raised so that the labels of dots close together
    (within `near` x `span`, the plot's extent) stack instead of overlapping: `step` above the highest earlier
    close one."""
    rises: list[float] = []
    for k, point in enumerate(points):
        close = [rises[j] for j in range(k) if np.abs(points[j] - point).max() <= near * span]
        rises.append(max(close) + step if close else 0.0)
    return rises


def separate_labels(figure: Figure, notes: list[Any], passes: int = 30) -> None:
    """Raise annotations whose drawn boxes overlap an earlier one's until none do (`label_rises` stacks those of
    close dots, but a long name can still reach a farther one): each pass draws the figure and moves every
    later label of an overlapping pair up by the overlap plus 2 points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    if len(notes) < 2:
        return
    canvas = FigureCanvasAgg(figure)
    for _ in range(passes):
        canvas.draw()
        boxes = [Text.get_window_extent(note, canvas.get_renderer()) for note in notes]  # the text, not its arrow
        moved = False
        for j in range(1, len(notes)):
            for i in range(j):
                a, b = boxes[i], boxes[j]
                if min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0):
                    x, y = notes[j].xyann
                    notes[j].xyann = (x, y + (a.y1 - b.y0) * 72.0 / figure.dpi + 2.0)  # pixels to points
                    moved = True
                    break
        if not moved:
            return


@any_script_figure
def head_map_figure(
    js: np.ndarray, layers: np.ndarray, heads: np.ndarray, types: pd.DataFrame | None = None,
    labelled: list[tuple[int, int]] | None = None, title: str | None = None,
) -> Figure:
    """Every head as a dot placed by classical multidimensional scaling of sqrt(JS): heads that attend alike lie
    close together. Coloured by head type; the `labelled` (layer, head)s are named."""
    from attnprobe.similarity import classical_mds

    coords, shares = classical_mds(js)
    kinds = head_kinds(layers, heads, types)
    dot_area = float(np.clip(22.0 * np.sqrt(200.0 / max(len(layers), 1)), 5.0, 22.0))  # smaller dots for many heads
    figure = Figure(figsize=(9.5, 7.0), layout="constrained")
    ax = figure.add_subplot()
    groups: dict[str, list[int]] = {}  # head type ("" for none) -> the heads' indices
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    for kind in [k for k in ALL_TYPES if k in groups] + sorted(k for k in groups if k not in ALL_TYPES):
        chosen = groups[kind]
        label = f"{kind} ({len(chosen)})" if kind else f"no type ({len(chosen)})" if types is not None else None
        ax.scatter(coords[chosen, 0], coords[chosen, 1], s=dot_area, alpha=0.85, linewidths=0,
                   color=TYPE_COLORS.get(kind, NO_TYPE_COLOR), label=plain_text(label) if label else None)
    index = {(int(layer), int(head)): i for i, (layer, head) in enumerate(zip(layers, heads))}
    named = [index[key] for key in dict.fromkeys((int(a), int(b)) for a, b in labelled or []) if key in index]
    named = named[:MAX_NAMED]
    notes = []
    for i, rise in zip(named, label_rises(coords[named], float(np.ptp(coords, axis=0).max()))):
        ax.scatter(coords[i, 0], coords[i, 1], s=60, facecolors="none", edgecolors="black", linewidths=1.0)
        notes.append(ax.annotate(
            head_name(layers[i], heads[i]), coords[i], xytext=(8, 4 + rise), textcoords="offset points", fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "#777777", "linewidth": 0.6},
            bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.75, "linewidth": 0}))
    ax.set_xlabel(f"MDS axis 1 ({shares[0]:.0%} of the spread)")
    ax.set_ylabel(f"MDS axis 2 ({shares[1]:.0%} of the spread)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.axhline(0.0, color="#dddddd", linewidth=0.6, zorder=0)
    ax.axvline(0.0, color="#dddddd", linewidth=0.6, zorder=0)
    if types is not None:  # beside the axes: over the dots of many heads it would hide some
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="head type")
    ax.set_title("Distance between dots approximates sqrt(JS): close = attend alike (circled: named heads)",
                 fontsize=9)
    separate_labels(figure, notes)
    heading = "Heads by how alike they attend (classical multidimensional scaling)"
    spaced_suptitle(figure, f"{plain_text(title)}\n{heading}" if title else heading, fontsize=11)
    return figure
