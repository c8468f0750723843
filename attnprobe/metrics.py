"""Attention statistics as pure functions on tensors.

Conventions: `p` is one layer's attention, [batch, head, query, key], rows summing to 1
over the valid keys. `keys` is a bool mask [batch, query, key] of the keys each query may
see (padding removed; future keys removed for causal models); `rows` is a bool mask
[batch, query] of the real (non-padding) query positions. Nothing here edits its inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIAGONAL_WINDOW = 2  # keys j with |i - j| <= 2 count as "near the diagonal"

METRICS = ("entropy", "entropy_norm", "diagonal", "first_token")
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


def row_diagonal(p: Tensor, window: int = DIAGONAL_WINDOW) -> Tensor:
    """Attention mass on keys within `window` positions of the query."""
    n_q, n_k = p.shape[-2:]
    i = torch.arange(n_q, device=p.device)[:, None]  # [query, 1]
    j = torch.arange(n_k, device=p.device)[None, :]  # [1, key]
    band = (i - j).abs() <= window  # [query, key]
    return torch.where(band, p, 0.0).sum(dim=-1)  # [batch, head, query]


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
    p = p.float()  # [batch, head, query, key]
    keys = valid_keys(attention_mask, causal)  # [batch, query, key]
    p = torch.where(keys[:, None], p, 0.0)  # [batch, head, query, key]
    rows = attention_mask.bool()  # [batch, query]
    entropy = row_entropy(p)  # [batch, head, query]
    per_row = {
        "entropy": entropy,
        "entropy_norm": row_entropy_norm(entropy, keys.sum(dim=-1)),
        "diagonal": row_diagonal(p),
        "first_token": row_first_token(p),
    }
    if special is not None:
        per_row[SPECIAL] = row_special(p, special)
    return {name: masked_row_mean(v, rows) for name, v in per_row.items()}  # each [batch, head]
