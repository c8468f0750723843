"""`rollout`'s rollout.png: each example sentence's rollout beside the last layer's raw map."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from attnprobe.plotting.patterns import draw_pattern, label_room, pattern_side
from attnprobe.plotting.style import any_script_figure, one_line, plain_text, short_text


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
