"""Attention statistics as pure functions on tensors.

Conventions: `p` is one layer's attention, [batch, head, query, key], right-padded, with
real query rows summing to 1 over their valid keys and putting exactly 0 elsewhere (the
model's own mask does this; `attnprobe verify` checks it). `rows` is a bool mask
[batch, query] of the real (non-padding) query positions; padded rows may hold anything and
never count. Nothing here edits its inputs, and nothing but `row_entropy` makes a temporary
as large as `p`, so a layer's statistics cost one extra map at most.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIAGONAL_WINDOW = 2  # keys j with |i - j| <= 2 count as "near the diagonal"

METRICS = (
    "entropy", "entropy_norm", "diagonal", "first_token", "previous_token", "self", "distance", "diagonal_excess",
)
SPECIAL = "special_tokens"  # reported only when the inputs contain special tokens


def valid_keys(attention_mask: Tensor, causal: bool) -> Tensor:
    """Keys each query may attend to: real tokens, and for causal models j <= i."""
    real = attention_mask.bool()  # [batch, key]
    keys = real[:, None, :] & real[:, :, None]  # [batch, query, key]
    if causal:
        n = attention_mask.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=attention_mask.device).tril()  # [query, key]
        keys = keys & lower  # [batch, query, key]
    return keys


def row_entropy(p: Tensor) -> Tensor:
    """Shannon entropy of each row in nats, with 0 ln 0 = 0."""
    return torch.special.entr(p).sum(dim=-1)  # [batch, head, query]


def valid_key_counts(attention_mask: Tensor, causal: bool) -> Tensor:
    """How many keys each query may see: i + 1 (causal) or the sentence length (encoder)."""
    length = attention_mask.sum(dim=-1, keepdim=True)  # [batch, 1]
    if not causal:
        return length.expand(attention_mask.shape)  # [batch, query]
    i = torch.arange(1, attention_mask.shape[-1] + 1, device=attention_mask.device)  # [query]
    return torch.minimum(i[None, :], length)  # [batch, query]


def row_offset(p: Tensor, offset: int) -> Tensor:
    """p[i, i + offset] for every query i, and 0 where that key does not exist."""
    n = p.shape[-1]
    out = torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)  # [batch, head, query]
    if abs(offset) >= n:
        return out
    band = p.diagonal(offset=offset, dim1=-2, dim2=-1)  # [batch, head, n - |offset|]
    if offset >= 0:
        out[..., : n - offset] = band
    else:
        out[..., -offset:] = band
    return out


def row_diagonal(p: Tensor, window: int = DIAGONAL_WINDOW) -> Tensor:
    """Attention mass on keys within `window` positions of the query, read off the diagonals."""
    return sum(row_offset(p, offset) for offset in range(-window, window + 1))  # [batch, head, query]


def row_distance(p: Tensor) -> Tensor:
    """Mean attention distance sum_j p_ij |i - j|, in tokens."""
    n = p.shape[-1]
    i = torch.arange(n, device=p.device, dtype=p.dtype)
    return (p * (i[:, None] - i[None, :]).abs()).sum(dim=-1)  # [batch, head, query]


def window_key_counts(attention_mask: Tensor, causal: bool, window: int = DIAGONAL_WINDOW) -> Tensor:
    """How many valid keys lie within `window` of each query."""
    length = attention_mask.sum(dim=-1, keepdim=True)  # [batch, 1]
    i = torch.arange(attention_mask.shape[-1], device=attention_mask.device)[None, :]  # [1, query]
    before = i.clamp(max=window)  # [1, query]
    after = (length - 1 - i).clamp(min=0, max=window)  # [batch, query]
    return before + 1 + (0 if causal else after)  # [batch, query]


def row_entropy_norm(entropy: Tensor, n_keys: Tensor) -> Tensor:
    """Entropy over its maximum ln(k); NaN for rows with fewer than 2 valid keys."""
    k = n_keys[:, None, :].to(entropy.dtype)  # [batch, 1, query]
    usable = k >= 2  # [batch, 1, query]
    return torch.where(usable, entropy / torch.log(k.clamp(min=2)), torch.nan)  # [batch, head, query]


def row_first_token(p: Tensor) -> Tensor:
    """Attention mass on the sequence's first token (the "sink")."""
    return p[..., 0]  # [batch, head, query]


def row_special(p: Tensor, special: Tensor) -> Tensor:
    """Attention mass on special-token keys ([CLS], [SEP], BOS, ...)."""
    return torch.where(special[:, None, None, :], p, 0.0).sum(dim=-1)  # [batch, head, query]


def masked_row_mean(values: Tensor, rows: Tensor) -> Tensor:
    """Mean over the selected query rows that are not NaN; NaN where none are left."""
    keep = rows[:, None, :] & ~values.isnan()  # [batch, head, query]
    total = torch.where(keep, values, 0.0).sum(dim=-1)  # [batch, head]
    count = keep.sum(dim=-1)  # [batch, head]
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)  # [batch, head]


def sentence_stats(
    p: Tensor, attention_mask: Tensor, causal: bool, special: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-sentence, per-head means of every row statistic, over the real query rows.

    `special`, a bool mask [batch, key] of special-token positions, adds `special_tokens`.
    """
    p = p.float()  # [batch, head, query, key]; no copy when the model runs in float32
    rows = attention_mask.bool()  # [batch, query]
    n_keys = valid_key_counts(attention_mask, causal)[:, None, :]  # [batch, 1, query]
    first = torch.arange(p.shape[-1], device=p.device) == 0  # [query]
    entropy = row_entropy(p)  # [batch, head, query]
    diagonal = row_diagonal(p)  # [batch, head, query]
    chance = window_key_counts(attention_mask, causal)[:, None, :] / n_keys.clamp(min=1)  # [batch, 1, query]
    per_row = {
        "entropy": entropy,
        "entropy_norm": row_entropy_norm(entropy, n_keys[:, 0]),
        "diagonal": diagonal,
        "first_token": row_first_token(p),
        "previous_token": torch.where((n_keys >= 2) & ~first, row_offset(p, -1), torch.nan),
        "self": torch.where(n_keys >= 2, row_offset(p, 0), torch.nan),
        "distance": row_distance(p),
        "diagonal_excess": diagonal - chance,
    }
    if special is not None:
        per_row[SPECIAL] = row_special(p, special)
    return {name: masked_row_mean(v, rows) for name, v in per_row.items()}  # each [batch, head]
