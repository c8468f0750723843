"""The `duplicate` statistic of the fused and Triton paths: the mass on the other keys holding the row's own token,
from tiles of the positions sorted by token (never an [n, n] mask). One plan for every sentence of a batch at once,
`token_tiles`, serves both: the fused path's `_fused_duplicate` (in torch) and kernel/triton_kernels.py's
duplicate_pass read its tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnprobe.kernel.batch import Batch

TILE_ROWS = 64  # the fused path's rows of a duplicate tile (positions in token order): whole groups packed up to this
TILE_KEYS = 2048  # the fused path's keys of one product, at most (a token that repeats more often takes several)


@dataclass(frozen=True)
class TokenTiles:
    """The fused and Triton paths' plan of the pairs of positions holding the same token, for every sentence of a
    batch at once (the same in every layer and head): the real positions of tokens that occur more than once in their
    sentence, sorted by sentence, then token, then position, cut into tiles: some whole groups of one sentence (rows
    and keys the same span, at most `rows`), or `rows` rows of one larger group against its keys (up to the last row
    when causal), which the kernels loop over. Within a tile the pairs are those of the same group, key before row
    (causal) or any other key."""

    positions: Tensor  # [m] int32: the position in its sentence
    sentence: Tensor  # [m] int32: the sentence it lies in
    group: Tensor  # [m] int32: which (sentence, token) group each holds
    tiles: Tensor  # [tiles, 5] int32: (sentence, row start, row end, key start, key end) in `positions`
    spans: tuple[tuple[int, int, int, int, int], ...]  # the same on the host (the fused path loops over them)
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
    return TokenTiles((order % n).to(torch.int32), (order // n).to(torch.int32), group.to(torch.int32),
                      torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 5), tuple(tiles),
                      previous.view(batch, n), following.view(batch, n))


def batch_plan(info: Batch, lengths: Tensor, n: int, causal: bool, rows: int,
               span: int | None) -> tuple[TokenTiles, Tensor]:
    """The batch's TokenTiles (tiles of at most `rows` rows) and has_duplicate under the layer's mask [batch, 1, n]:
    made by the first layer that asks (one host sync), kept for the others."""
    plan = info.shared("token tiles", lengths, lambda: token_tiles(info.tokens.ids[:, :n], lengths, causal, rows),
                       n, causal, rows)
    return plan, info.shared("has duplicate", lengths, lambda: has_duplicate(plan, causal, span), n, causal, span)


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


def _fused_duplicate(q: Tensor, keys: Tensor, lse: Tensor, plan: TokenTiles, causal: bool, scale: float) -> Tensor:
    """row_duplicate from the fused kernel's logsumexp [batch, head, q]: exp(s_ij - lse_i) summed over the pairs of
    positions that hold the same token. The positions are sorted by token (the
    batch's TokenTiles, token_tiles: never an [n, n] mask): a tile of that order is one product of the rows' queries
    and the keys, those of a large group TILE_KEYS at a time. No host sync."""
    batch, heads, n, _ = q.shape
    mass = torch.zeros(batch, heads, n, device=q.device)  # [batch, head, q]: rows of no tile stay 0
    if plan.spans:
        sentence, at = plan.sentence.long(), plan.positions.long()  # [m], [m]
        rows_q, rows_k = (x[sentence, :, at].transpose(0, 1).contiguous() for x in (q, keys))  # [head, m, dim]
        rows_lse = lse[sentence, :, at].t()  # [head, m]
        found = torch.zeros(heads, len(at), device=q.device)  # [head, m]
        sorted_at = torch.arange(len(at), device=q.device)  # [m]: within a group token order is position order
        for _, r0, r1, k0, k1 in plan.spans:
            for c0 in range(k0, k1, TILE_KEYS):
                c1 = min(k1, c0 + TILE_KEYS)
                logits = (rows_q[:, r0:r1] @ rows_k[:, c0:c1].transpose(-1, -2)).mul_(scale)  # [head, r, c]
                same = plan.group[r0:r1, None] == plan.group[None, c0:c1]  # [r, c]
                i, j = sorted_at[r0:r1, None], sorted_at[None, c0:c1]  # [r, 1], [1, c]
                same &= (j < i) if causal else (j != i)
                logits.sub_(rows_lse[:, r0:r1, None]).masked_fill_(~same, float("-inf"))
                found[:, r0:r1] += logits.exp_().sum(dim=-1)  # [head, r]
        mass[sentence, :, at] = found.transpose(0, 1)  # [m, head]
    return mass
