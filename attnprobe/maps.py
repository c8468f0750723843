"""One text's attention maps, every layer and head, with a label per token, and a figure of one head: for a notebook.

It runs the model and draws (plotting), so nothing below the commands imports it; the check of stored maps lives in
mapcheck.py (its names stay importable from here)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnprobe.errors import AttnprobeError
from attnprobe.mapcheck import MapFault, map_fault, map_problem  # noqa: F401 (API: as before)


class AttentionMaps(NamedTuple):
    """`maps` [layer, head, query, key] (float32, rows sum to 1) and `tokens`, a label per token.

    Unpacks as `maps, tokens = attention_maps(model, text)`.
    """

    maps: np.ndarray
    tokens: list[str]

    def figure(self, layer: int, head: int, title: str | None = None) -> Any:
        """A matplotlib Figure of one head's map: rows are queries, columns the keys they attend to."""
        from matplotlib.figure import Figure

        from attnprobe.naming import head_name
        from attnprobe.plotting import any_script, draw_pattern

        layers, heads = self.maps.shape[:2]
        if not (0 <= layer < layers and 0 <= head < heads):
            raise AttnprobeError(f"no head {head_name(layer, head)}: this model has layers 0-{layers - 1} and heads "
                                 f"0-{heads - 1}")
        with any_script():  # fonts for any script's tokens, and no warning for a missing glyph
            figure = Figure(figsize=(6, 5.5), layout="constrained")
            ax = figure.add_subplot()
            image = draw_pattern(ax, self.maps[layer, head], self.tokens, title or head_name(layer, head))
            figure.colorbar(image, ax=ax, label="attention weight")
        return figure


def attention_maps(model: Any, text: str, *, device: str = "auto", dtype: str = "auto",
                   max_tokens: int | None = None) -> AttentionMaps:
    """Every layer's and head's attention on `text`, as the model computes it with eager attention.

    `model`: a LoadedModel, a name or path (loaded on `device` in `dtype`), or a (transformers model, tokenizer)
    pair.
    The text is cut to the model's context, or to its first `max_tokens` tokens (a decoder's maps of a
    prefix equal the full maps cropped; an encoder sees only the tokens kept).
    """
    from attnprobe.corpus import clip_text
    from attnprobe.model import as_loaded, quiet_transformers, stream_attention
    from attnprobe.tokens import encode, token_labels

    if not isinstance(text, str) or not text.strip():
        raise AttnprobeError(f"text: expected a non-empty string; got {type(text).__name__ if text else repr(text)}")
    if max_tokens is not None and max_tokens < 1:
        raise AttnprobeError(f"max_tokens {max_tokens} is below 1: use 1 or more, or None for the whole text")
    loaded = as_loaded(model, device, dtype)
    import torch

    text = clip_text(text, loaded.max_length)  # a huge text: only what the model keeps
    with quiet_transformers():
        ids = list(encode(loaded, text)["input_ids"])
    if not ids:
        raise AttnprobeError(f"text {text[:40]!r} gives no tokens: pass another one")
    ids = ids[: min(loaded.max_length, max_tokens or loaded.max_length)]
    input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)  # [1, seq]
    layers: list[np.ndarray] = []  # each [head, query, key]
    stream_attention(loaded, input_ids, torch.ones_like(input_ids),
                     lambda _layer, p: layers.append(p[0].float().cpu().numpy()))
    return AttentionMaps(maps=np.stack(layers), tokens=token_labels(loaded, ids, text))
