"""What every figure shares: the head-type and category colours, fonts that draw any script (`any_script_figure`),
literal text (`plain_text`, `token_label`), titles and layout, layer ticks, the layers x heads grid, the y axis from
0, and `Undrawable` (a figure whose data hold no value). Nothing here writes files (io.figure_writer saves)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnprobe.errors import AttnprobeError
from attnprobe.naming import visible

TYPE_COLORS = {  # previous sits inside local and sink inside copy: each pair told apart by hue, not shade
    "previous": "#e6ab02", "local": "#1b9e77", "sink": "#e7298a", "dormant": "#8e0152", "copy": "#d95f02",
    "broad": "#7570b3", "mixed": "#a6a6a6", "streaming": "#4575b4", "full-cache": "#d73027",
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
    into the bottom row's titles; savefig draws once or twice, so what it saved depended on that. Kept
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


def from_zero(ax: Axes, values: list[Any]) -> None:
    """The y axis from 0 to HEADROOM above the largest of `values`: autoscaling put the top right at the largest
    value, so where every value is about the same (all near 1) the lines and dots lay on the top spine."""
    finite = np.concatenate([np.asarray(v, dtype=float).ravel() for v in values])
    finite = finite[np.isfinite(finite)]
    top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    ax.set_ylim(0.0, top * (1.0 + HEADROOM))


class Undrawable(AttnprobeError):
    """A figure whose data hold no value (a score column all NaN): `plot` skips it with a warning."""


def check_has_values(heads: pd.DataFrame, column: str) -> None:
    """Refuse (Undrawable) to draw a score of which heads.csv holds no value."""
    if column in heads.columns and not heads[column].notna().any():
        raise Undrawable(f"heads.csv's {column} holds no value (all NaN)")
