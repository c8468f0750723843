"""The `duplicate` statistic of the fused and Triton paths: the mass on the other keys holding the row's own token,
from tiles of the positions sorted by token (never an [n, n] mask): `_fused_duplicate` (the fused path, in torch,
over `same_token_plans`) and `token_tiles` (the Triton path's plan for every sentence of a batch at once, which
kernel/triton_kernels.py's duplicate_pass reads)."""

from __future__ import annotations

from dataclasses import dataclass

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


def same_token_plans(ids: Tensor, lengths: Tensor, causal: bool) -> list[_SameToken]:
    """The pairs plan (_same_token) of each sentence of a batch, ids [batch, n] under `lengths` [batch]: one host
    sync (the lengths), made once per batch (Batch.shared) and read by every layer."""
    return [_same_token(ids[b, :length], causal) for b, length in enumerate(lengths.tolist())]


def _fused_duplicate(q: Tensor, keys: Tensor, lse: Tensor, plans: list[_SameToken], causal: bool,
                     scale: float) -> tuple[Tensor, Tensor]:
    """row_duplicate from the fused kernel's logsumexp: exp(s_ij - lse_i) summed over the pairs of positions that
    hold the same token, and whether each row has such a key, [batch, 1, q]. The positions are sorted by token
    (`plans`, same_token_plans: never an [n, n] mask): a tile of that order is one product of the rows' queries and
    the keys. No host sync."""
    batch, heads, n, _ = q.shape
    mass = torch.zeros(batch, heads, n, device=q.device)  # [batch, head, q]
    has = torch.zeros(batch, 1, n, dtype=torch.bool, device=q.device)  # [batch, 1, q]
    for b, plan in enumerate(plans):
        has[b, 0, : len(plan.has)] = plan.has  # the sentence's length
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


@dataclass(frozen=True)
class TokenTiles:
    """The Triton path's plan of the pairs of positions holding the same token, for every sentence of a batch at
    once (the same in every layer and head): the real positions of tokens that occur more than once in their
    sentence, sorted by sentence, then token, then position, cut into tiles as _SameToken cuts them (rows of at most
    `rows`; the keys of a large group looped over by the kernel, not cut)."""

    positions: Tensor  # [m] int32: the position in its sentence
    group: Tensor  # [m] int32: which (sentence, token) group each holds
    tiles: Tensor  # [tiles, 5] int32: (sentence, row start, row end, key start, key end) in `positions`
    previous: Tensor  # [batch, n] int64: the nearest earlier position with the same token, -n - 1 where none
    following: Tensor  # [batch, n] int64: the nearest later one, 2 n + 1 where none


def token_tiles(ids: Tensor, lengths: Tensor, causal: bool, rows: int) -> TokenTiles:
    """The TokenTiles of token `ids` [batch, n] under `lengths` [batch]; one host sync (the groups' sizes)."""
    batch, n = ids.shape
    device = ids.device
    real = (torch.arange(n, device=device)[None, :] < lengths[:, None]).flatten()  # [batch * n]
    flat = real.nonzero()[:, 0]  # [r] flat positions b * n + i of the real tokens
    ids64 = ids.flatten().long()[flat]  # [r]
    key = (flat // n) * (int(ids64.max()) + 1 if len(flat) else 1) + ids64  # [r]: sentence, then token
    order = flat[key.argsort(stable=True)]  # [r]: grouped, by position within a group
    _, counts = torch.unique_consecutive(key.sort(stable=True).values, return_counts=True)  # [groups]
    repeated = counts.repeat_interleave(counts) > 1  # [r]
    order, counts = order[repeated], counts[counts > 1]  # [m], [groups of 2 or more]
    group = torch.arange(len(counts), device=device).repeat_interleave(counts)  # [m]
    same_before = torch.zeros(len(order), dtype=torch.bool, device=device)  # [m]: the entry before is its group's
    same_before[1:] = group[1:] == group[:-1]
    previous = torch.full((batch * n,), -n - 1, dtype=torch.long, device=device)  # [batch * n]
    following = torch.full((batch * n,), 2 * n + 1, dtype=torch.long, device=device)  # [batch * n]
    previous[order[1:][same_before[1:]]] = order[:-1][same_before[1:]] % n
    following[order[:-1][same_before[1:]]] = order[1:][same_before[1:]] % n
    starts = (counts.cumsum(0) - counts).tolist()  # one host sync per batch
    sentences = (order[counts.cumsum(0) - counts] // n).tolist() if len(counts) else []
    tiles = _tiles(starts, counts.tolist(), sentences, causal, rows)
    return TokenTiles((order % n).to(torch.int32), group.to(torch.int32),
                      torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 5),
                      previous.view(batch, n), following.view(batch, n))


def _tiles(starts: list[int], counts: list[int], sentences: list[int], causal: bool,
           rows: int) -> list[tuple[int, int, int, int, int]]:
    """(sentence, row start, row end, key start, key end) of each tile: whole groups of one sentence packed up to
    `rows` rows (keys: the same span), a larger group cut into `rows` rows against its keys up to the last row
    (causal) or all of them."""
    tiles, pack, sentence = [], None, None
    for begin, count, owner in zip(starts, counts, sentences):
        end = begin + count
        if pack is not None and (owner != sentence or end - pack > rows or count > rows):
            tiles.append((sentence, pack, begin, pack, begin))
            pack = None
        if count > rows:
            tiles += [(owner, r0, min(end, r0 + rows), begin, min(end, r0 + rows) if causal else end)
                      for r0 in range(begin, end, rows)]
            continue
        pack, sentence = (begin if pack is None else pack), owner
    if pack is not None:
        tiles.append((sentence, pack, starts[-1] + counts[-1], pack, starts[-1] + counts[-1]))
    return tiles


def has_duplicate(plan: TokenTiles, causal: bool, span: int | None) -> Tensor:
    """Whether each position has a key holding its token that the layer's mask allows, j != i: [batch, 1, n]."""
    i = torch.arange(plan.previous.shape[1], device=plan.previous.device)  # [n]
    before = i[None, :] - plan.previous  # [batch, n]: distance to the previous occurrence
    after = plan.following - i[None, :]  # [batch, n]
    if causal:
        has = before <= (plan.previous.shape[1] if span is None else span - 1)
    else:
        reach = plan.previous.shape[1] if span is None else span
        has = (before <= reach) | (after <= reach)
    return has[:, None, :]  # [batch, 1, n]
