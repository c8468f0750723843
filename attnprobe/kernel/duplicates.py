"""The fused path's `duplicate` statistic: the mass on earlier keys holding the row's own token, from tiles of the
positions sorted by token (never an [n, n] mask)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

TILE_ROWS = 64  # rows of a duplicate tile (positions in token order): tiles pack whole groups up to this many rows
TILE_KEYS = 2048  # keys of a duplicate tile, at most (a token that repeats more often is cut into several)


@dataclass(frozen=True)
class _SameToken:
    """Where one sentence's pairs of positions holding the same token lie: its positions sorted by token (stable, so
    by position within a token), those of tokens that occur once left out, cut into tiles of rows x keys of that
    order. A tile holds some whole groups of one token each (rows and keys the same span) or part of one large
    group; within it the pairs are those of the same group, key before row (causal) or any other key."""

    order: Tensor  # [m] positions in token order, only of tokens that occur more than once
    group: Tensor  # [m] which token (a group number) each holds
    tiles: tuple[tuple[int, int, int, int], ...]  # (row start, row end, key start, key end) in `order`
    has: Tensor  # [length] bool: the position has such a key (causal: not its token's first occurrence)


def _same_token(ids: Tensor, causal: bool) -> _SameToken:
    """The pairs plan of one sentence's ids [length] (see _SameToken): the same in every layer."""
    order = ids.argsort(stable=True)  # [length]: positions grouped by id
    _, counts = torch.unique_consecutive(ids[order], return_counts=True)  # [groups]
    repeated = counts.repeat_interleave(counts) > 1  # [length]: in token order
    order, counts = order[repeated], counts[counts > 1]  # [m], [groups of 2 or more]
    group = torch.arange(len(counts), device=ids.device).repeat_interleave(counts)  # [m]
    has = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)  # [length]
    first = counts.cumsum(0) - counts  # [groups]: where each group starts in `order`
    has[order] = True
    if causal:
        has[order[first]] = False  # a token's first occurrence has no earlier key holding it
    tiles, pack, begin = [], 0, 0
    for end in counts.cumsum(0).tolist():  # group [begin, end) of `order`
        if end - begin > TILE_ROWS:  # a large group: rows by TILE_ROWS, keys up to the row (causal) by TILE_KEYS
            tiles += [(pack, begin, pack, begin)] if pack < begin else []
            for r0 in range(begin, end, TILE_ROWS):
                r1 = min(end, r0 + TILE_ROWS)
                tiles += [(r0, r1, c0, min(c0 + TILE_KEYS, r1 if causal else end))
                          for c0 in range(begin, r1 if causal else end, TILE_KEYS)]
            pack = end
        elif end - pack > TILE_ROWS:  # the pack is full: close it before this group
            tiles.append((pack, begin, pack, begin))
            pack = begin
        begin = end
    tiles += [(pack, begin, pack, begin)] if pack < begin else []
    return _SameToken(order, group, tuple(tiles), has)


def _fused_duplicate(q: Tensor, keys: Tensor, lse: Tensor, ids: Tensor, lengths: Tensor, causal: bool,
                     scale: float, cache: dict[Any, Any] | None = None) -> tuple[Tensor, Tensor]:
    """row_duplicate from the fused kernel's logsumexp: exp(s_ij - lse_i) summed over the pairs of positions that
    hold the same token, and whether each row has such a key, [batch, 1, q]. The positions are sorted by token
    (_same_token, never an [n, n] mask): a tile of that order is one product of the rows' queries and the keys.
    `cache`: the pairs plan is kept there for the batch's other layers."""
    batch, heads, n, _ = q.shape
    mass = torch.zeros(batch, heads, n, device=q.device)  # [batch, head, q]
    has = torch.zeros(batch, 1, n, dtype=torch.bool, device=q.device)  # [batch, 1, q]
    for b in range(batch):
        length = int(lengths[b])
        key = ("same token", b, length, causal)
        plan = None if cache is None else cache.get(key)
        if plan is None:
            plan = _same_token(ids[b, :length], causal)
            if cache is not None:
                cache[key] = plan
        has[b, 0, :length] = plan.has
        if not plan.tiles:
            continue
        order = plan.order
        rows_q, rows_k, rows_lse = (x[b].index_select(1, order) for x in (q, keys, lse))  # [head, m, (dim)]
        found = torch.zeros(heads, len(order), device=q.device)  # [head, m]
        sorted_at = torch.arange(len(order), device=q.device)  # [m]
        for r0, r1, c0, c1 in plan.tiles:
            logits = (rows_q[:, r0:r1] @ rows_k[:, c0:c1].transpose(-1, -2)).mul_(scale)  # [head, r, c]
            same = plan.group[r0:r1, None] == plan.group[None, c0:c1]  # [r, c]
            i, j = sorted_at[r0:r1, None], sorted_at[None, c0:c1]  # [r, 1], [1, c]
            same &= (j < i) if causal else (j != i)  # within a group token order is position order
            logits.sub_(rows_lse[:, r0:r1, None]).masked_fill_(~same, float("-inf"))
            found[:, r0:r1] += logits.exp_().sum(dim=-1)  # [head, r]
        mass[b].index_copy_(1, order, found)  # [head, q]
    return mass, has
