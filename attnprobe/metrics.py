"""Attention statistics as pure functions on tensors.

Conventions: `p` is a block of one layer's attention, [batch, head, rows, keys]: the query rows
q0 .. q0 + rows - 1 against keys k0 .. k0 + keys - 1 (a whole map is the block with q0 = k0 = 0). Sequences
are right-padded; real query rows sum to 1 over their valid keys and put exactly 0 elsewhere (the
model's own mask does this; `attnprobe verify` checks it). `lengths` [batch] holds the number of
real tokens of each sequence; padded rows may hold anything and never count. A causal block needs
only the keys up to its last row. Nothing here edits its inputs, and no temporary is larger than
the block, so the statistics of a block cost about one extra block of memory.

A layer may attend within a window (`span`): a causal row i sees keys i - span < j <= i (Mistral's sliding
window), an encoder's row |i - j| <= span (ModernBERT's local layers); None is full attention. The counts of
keys a row may see (entropy_norm's ln k, the chance level of diagonal_excess, which rows are forced) follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnprobe import defaults
from attnprobe.scores import POSITION_METRICS, VALUE_WEIGHTED, VW, VW_POSITION_METRICS

DIAGONAL_WINDOW = 2  # keys j with |i - j| <= 2 count as "near the diagonal"
SINK_TOKENS = defaults.SINK_TOKENS  # sink_window: the first S keys ...
RECENT_WINDOW = defaults.WINDOW  # ... plus the W most recent keys j > i - W

METRICS = (
    "entropy", "entropy_norm", "diagonal", "first_token", "previous_token", "self", "distance", "diagonal_excess",
    "sink_window", "entropy_unforced", "diagonal_unforced", "first_token_unforced",
)
# The classification rules read these: the same scores over the rows the mask leaves a choice (a row
# with one valid key has entropy 0 and first-token mass 1; a row whose +-2 window holds every valid
# key has diagonal 1, whatever the head does).
UNFORCED = ("entropy_unforced", "diagonal_unforced", "first_token_unforced")
SPECIAL = "special_tokens"  # reported only when the inputs contain special tokens
PUNCTUATION = "punctuation"  # mass on punctuation keys (tokens.py decides which tokens are punctuation)
DUPLICATE = "duplicate_token"  # mass on the other keys whose token equals the query's, over rows that have one
TOKEN_METRICS = (PUNCTUATION, DUPLICATE)  # what heads attend to by token; raw maps only (no _vw)
BINNED = (*POSITION_METRICS, *VW_POSITION_METRICS)  # the scores SentenceSums keeps per position bin


def valid_keys(attention_mask: Tensor, causal: bool, span: int | None = None) -> Tensor:
    """Keys each query may attend to: real tokens, for causal models j <= i, and within the window `span`."""
    real = attention_mask.bool()  # [batch, key]
    keys = real[:, None, :] & real[:, :, None]  # [batch, query, key]
    n = attention_mask.shape[-1]
    i = torch.arange(n, device=attention_mask.device)  # [n]
    offset = i[None, :] - i[:, None]  # [query, key]: j - i
    if causal:
        keys = keys & (offset <= 0)  # [batch, query, key]
    if span is not None:
        keys = keys & ((offset > -span) if causal else (offset.abs() <= span))  # [batch, query, key]
    return keys


def positions(q0: int, rows: int, device: torch.device) -> Tensor:
    """The query positions of a block."""
    return torch.arange(q0, q0 + rows, device=device)  # [rows]


def key_range(i: Tensor, lengths: Tensor, causal: bool, span: int | None = None) -> tuple[Tensor, Tensor]:
    """The first and last key each query may see, [batch, rows] each: real keys, j <= i when causal, and
    within the window `span` (causal: i - span < j; encoder: |i - j| <= span)."""
    last = (lengths[:, None] - 1).expand(-1, i.shape[0])  # [batch, rows]
    if causal:
        last = torch.minimum(last, i[None, :])  # [batch, rows]
    elif span is not None:
        last = torch.minimum(last, i[None, :] + span)  # [batch, rows]
    reach = 0 if span is None else (span - 1 if causal else span)  # keys before i that a row sees
    first = (i - reach).clamp(min=0)[None, :].expand_as(last) if span is not None else torch.zeros_like(last)
    return first, last  # [batch, rows] each


def key_counts(i: Tensor, lengths: Tensor, causal: bool, span: int | None = None) -> Tensor:
    """How many keys each query may see: i + 1 (causal) or the sequence length (encoder), within the window."""
    first, last = key_range(i, lengths, causal, span)  # [batch, rows] each
    return (last - first + 1).clamp(min=0)  # [batch, rows]


def window_key_counts(
    i: Tensor, lengths: Tensor, causal: bool, window: int = DIAGONAL_WINDOW, span: int | None = None
) -> Tensor:
    """How many keys the query may see lie within `window` of it."""
    first, last = key_range(i, lengths, causal, span)  # [batch, rows] each
    lo, hi = torch.maximum(first, i[None, :] - window), torch.minimum(last, i[None, :] + window)  # [batch, rows]
    return (hi - lo + 1).clamp(min=0)  # [batch, rows]


def row_entropy(p: Tensor) -> Tensor:
    """Shannon entropy of each row in nats, with 0 ln 0 = 0."""
    return torch.special.entr(p).sum(dim=-1)  # [batch, head, rows]


def row_offset(p: Tensor, offset: int, q0: int = 0, k0: int = 0) -> Tensor:
    """p[i, i + offset] for every query i = q0 + row, and 0 where that key is not in the block."""
    rows, keys = p.shape[-2:]
    d = q0 + offset - k0  # the diagonal, in block coordinates, that holds key i + offset
    out = torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)  # [batch, head, rows]
    if d >= keys or d <= -rows:
        return out
    band = p.diagonal(offset=d, dim1=-2, dim2=-1)  # [batch, head, m]
    start = max(0, -d)  # the first row that has the key
    out[..., start : start + band.shape[-1]] = band
    return out


def row_diagonal(p: Tensor, q0: int = 0, window: int = DIAGONAL_WINDOW, k0: int = 0) -> Tensor:
    """Attention mass on keys within `window` positions of the query, read off the diagonals."""
    return sum(row_offset(p, offset, q0, k0) for offset in range(-window, window + 1))  # [batch, head, rows]


def row_distance(p: Tensor, q0: int = 0, k0: int = 0) -> Tensor:
    """Mean attention distance sum_j p_ij |i - j|, in tokens.

    Keys before and after the block's own positions are weighed by a matrix product (their distances
    split into a per-key and a per-row part, all terms >= 0, so nothing cancels); only the square of
    keys inside the block is multiplied element by element.
    """
    rows, keys = p.shape[-2:]
    q1 = q0 + rows
    i = positions(q0, rows, p.device).to(p.dtype)  # [rows]
    lo, hi = min(max(q0 - k0, 0), keys), min(max(q1 - k0, 0), keys)  # the keys at the rows' own positions
    j = torch.arange(k0 + lo, k0 + hi, device=p.device, dtype=p.dtype)  # [strip]
    out = (p[..., lo:hi] * (i[:, None] - j[None, :]).abs()).sum(dim=-1)  # [batch, head, rows]
    if lo > 0:  # keys before the block: |i - j| = (q0 - j) + (i - q0)
        out = out + _split_distance(p[..., :lo], q0 - k0 - torch.arange(lo, device=p.device), i - q0)
    if keys > hi:  # keys after it (encoders): |i - j| = (j - q1) + (q1 - i)
        out = out + _split_distance(p[..., hi:], torch.arange(hi, keys, device=p.device) + (k0 - q1), q1 - i)
    return out


def _split_distance(p: Tensor, per_key: Tensor, per_row: Tensor) -> Tensor:
    """sum_j p_ij (per_key_j + per_row_i), with one matrix product for both sums."""
    weights = torch.stack((per_key.to(p.dtype), torch.ones_like(per_key, dtype=p.dtype)), dim=-1)  # [keys, 2]
    both = p @ weights  # [batch, head, rows, 2]
    return both[..., 0] + per_row * both[..., 1]  # [batch, head, rows]


def row_entropy_norm(entropy: Tensor, n_keys: Tensor) -> Tensor:
    """Entropy over its maximum ln(k); NaN for rows with fewer than 2 valid keys."""
    k = n_keys[:, None, :].to(entropy.dtype)  # [batch, 1, rows]
    usable = k >= 2  # [batch, 1, rows]
    return torch.where(usable, entropy / torch.log(k.clamp(min=2)), torch.nan)  # [batch, head, rows]


def row_first_token(p: Tensor, k0: int = 0) -> Tensor:
    """Attention mass on the sequence's first token (the "sink"); 0 when the block's keys start after it."""
    return p[..., 0] if k0 == 0 else torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)  # [batch, head, rows]


def row_special(p: Tensor, special: Tensor, k0: int = 0) -> Tensor:
    """Attention mass on special-token keys ([CLS], [SEP], BOS, ...); `special` is [batch, all keys]."""
    flags = special[:, None, k0 : k0 + p.shape[-1], None].to(p.dtype)  # [batch, 1, keys, 1]
    return (p @ flags)[..., 0]  # [batch, head, rows]


def row_sink_window(
    p: Tensor, q0: int, causal: bool, sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, k0: int = 0
) -> Tensor:
    """Mass on the first `sink` keys plus the `window` most recent ones (j > i - window).

    Defined for causal rows i >= sink + window, where those keys do not already cover every key; NaN
    elsewhere (and for encoders, which keep no KV cache). Only the strip of keys the block's windows
    touch is read, so this costs a fraction of a block.
    """
    rows, keys = p.shape[-2:]
    out = torch.full(p.shape[:-1], torch.nan, dtype=p.dtype, device=p.device)  # [batch, head, rows]
    first_row = max(0, sink + window - q0)  # the first row of the block that qualifies
    if not causal or first_row >= rows:
        return out
    i = positions(q0 + first_row, rows - first_row, p.device)  # [m]
    lo = max(int(i[0]) - window + 1, k0)  # keys before lo are outside every window of these rows (lo >= sink)
    strip = p[..., first_row:, lo - k0 : keys]  # [batch, head, m, strip]
    j = torch.arange(lo, k0 + keys, device=p.device)  # [strip]
    recent = (j[None, :] > i[:, None] - window) & (j[None, :] <= i[:, None])  # [m, strip]
    sinks = p[..., first_row:, : max(0, sink - k0)].sum(dim=-1)  # [batch, head, m]: the first keys, if in the block
    out[..., first_row:] = sinks + torch.where(recent, strip, 0.0).sum(dim=-1)
    return out


def block_row_stats(
    p: Tensor, q0: int, lengths: Tensor, causal: bool, special: Tensor | None = None,
    sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, entropy: Tensor | None = None, k0: int = 0,
    span: int | None = None, tokens: TokenClasses | None = None, geometry: RowGeometry | None = None,
    pairs: TokenPairs | None = None,
) -> dict[str, Tensor]:
    """Every row statistic of a block of query rows, [batch, head, rows] each (padded rows included).

    The block's keys start at position `k0`; the layer attends within the window `span` (None: every key).
    `entropy`, when the caller already has it (the blocked attention gets it from the softmax), is used
    instead of computing it from p. `tokens`: the batch's token ids and punctuation flags, for `punctuation`
    and `duplicate`. `geometry` (row_geometry) and `pairs` (token_pairs), when the caller keeps them for the
    block, save computing them again.
    """
    p = p.float()  # [batch, head, rows, keys]; no copy when the model runs in float32
    near = {offset: row_offset(p, offset, q0, k0) for offset in range(-DIAGONAL_WINDOW, DIAGONAL_WINDOW + 1)}
    masses = RowMasses(
        entropy=row_entropy(p) if entropy is None else entropy,
        diagonal=sum(near.values()),  # row_diagonal's sum, in its order
        first=row_first_token(p, k0),
        previous=near[-1],
        self=near[0],
        distance=row_distance(p, q0, k0),
        sink_window=row_sink_window(p, q0, causal, sink, window, k0),
        special=None if special is None else row_special(p, special, k0),
    )
    if tokens is not None:
        add_token_masses(masses, p, tokens, q0, lengths, causal, k0, span, pairs)
    return row_stats(masses, q0, lengths, causal, span, geometry)


def add_token_masses(masses: RowMasses, p: Tensor, tokens: TokenClasses, q0: int, lengths: Tensor, causal: bool,
                     k0: int = 0, span: int | None = None, pairs: TokenPairs | None = None) -> RowMasses:
    """Set the punctuation and duplicate masses of a block of p (see block_row_stats)."""
    masses.punctuation = row_special(p, tokens.punctuation, k0)
    masses.duplicate, masses.has_duplicate = row_duplicate(p, tokens.ids, q0, lengths, causal, k0, span, pairs)
    return masses


@dataclass
class TokenClasses:
    """Per key of a batch, what `punctuation` and `duplicate` read: [batch, seq] each."""

    ids: Tensor  # token ids (long)
    punctuation: Tensor  # bool: the token is punctuation (tokens.punctuation_table), never a special token


def same_token(ids: Tensor, q0: int, rows: int, k0: int, keys: int, lengths: Tensor, causal: bool,
               span: int | None = None) -> tuple[Tensor, Tensor]:
    """Which keys of a block hold the query's token, j != i, among the keys the row may see: [batch, rows, keys]
    bool; and whether the row has one, [batch, rows]."""
    i = positions(q0, rows, ids.device)  # [rows]
    j = torch.arange(k0, k0 + keys, device=ids.device)  # [keys]
    first, last = key_range(i, lengths, causal, span)  # [batch, rows] each
    seen = (j[None, None, :] >= first[..., None]) & (j[None, None, :] <= last[..., None])  # [batch, rows, keys]
    same = (ids[:, q0 : q0 + rows, None] == ids[:, None, k0 : k0 + keys]) & seen  # [batch, rows, keys]
    same &= i[:, None] != j[None, :]  # [batch, rows, keys]: not the query itself
    return same, same.any(dim=-1)


def row_duplicate(p: Tensor, ids: Tensor, q0: int, lengths: Tensor, causal: bool, k0: int = 0,
                  span: int | None = None, pairs: TokenPairs | None = None) -> tuple[Tensor, Tensor]:
    """Attention mass on the other keys whose token id equals the query's (natural-text duplicates), [batch, head,
    rows]; and whether the row has such a key, [batch, 1, rows] (the score is defined only there). `pairs`: the
    block's token_pairs, when the caller keeps them."""
    rows, keys = p.shape[-2:]
    pairs = pairs or token_pairs(ids, q0, rows, k0, keys, lengths, causal, span)
    if not pairs.some:
        return torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device), pairs.has
    mass = torch.where(pairs.same[:, None], p, 0.0).sum(dim=-1)  # [batch, head, rows]
    return mass, pairs.has


@dataclass
class TokenPairs:
    """Which keys of a block hold the query's token (same_token): the same for every layer of a batch."""

    same: Tensor  # [batch, rows, keys] bool
    has: Tensor  # [batch, 1, rows] bool: the row has such a key
    some: bool  # whether any row has one


def token_pairs(ids: Tensor, q0: int, rows: int, k0: int, keys: int, lengths: Tensor, causal: bool,
                span: int | None = None) -> TokenPairs:
    """same_token of a block, kept for its layers."""
    same, has = same_token(ids, q0, rows, k0, keys, lengths, causal, span)  # [b, r, k], [b, r]
    return TokenPairs(same, has[:, None, :], bool(has.any()))


def received(p: Tensor, q0: int, lengths: Tensor) -> Tensor:
    """The mass each key of a block receives from the block's real query rows, [batch, head, keys]."""
    rows = p.shape[-2]
    real = (positions(q0, rows, p.device)[None, :] < lengths[:, None]).to(p.dtype)  # [batch, rows]
    return (real[:, None, None, :] @ p)[..., 0, :]  # [batch, head, keys]


def uniform_received(lengths: Tensor, n: int, causal: bool, span: int | None = None) -> Tensor:
    """The mass each key would receive if every real row spread its attention evenly over the keys it may see,
    [batch, key] float64: sum over the rows i that see j of 1 / (keys i sees), by a difference array (O(n))."""
    i = torch.arange(n, device=lengths.device)  # [n]
    first, last = key_range(i, lengths, causal, span)  # [batch, n] each
    real = i[None, :] < lengths[:, None]  # [batch, n]
    share = torch.where(real, 1.0 / (last - first + 1).clamp(min=1).double(), 0.0)  # [batch, n]
    steps = torch.zeros(lengths.shape[0], n + 1, dtype=torch.float64, device=lengths.device)  # [batch, n + 1]
    steps.scatter_add_(1, first.clamp(0, n), share).scatter_add_(1, (last + 1).clamp(0, n), -share)
    return steps.cumsum(dim=1)[:, :n] * (i[None, :] < lengths[:, None])  # [batch, key]


@dataclass
class RowMasses:
    """What each row's statistics are made of, [batch, head, rows] each: however the caller got them (from a
    block of p, or from a fused kernel's logsumexp and value sums)."""

    entropy: Tensor  # -sum p ln p
    diagonal: Tensor  # mass on keys within DIAGONAL_WINDOW of the query
    first: Tensor  # mass on key 0
    previous: Tensor  # p[i, i - 1] (0 where that key is not there)
    self: Tensor  # p[i, i]
    distance: Tensor  # sum_j p_ij |i - j|
    sink_window: Tensor  # row_sink_window's value (NaN where undefined)
    special: Tensor | None = None  # mass on special-token keys
    punctuation: Tensor | None = None  # mass on punctuation keys
    duplicate: Tensor | None = None  # mass on the other keys holding the query's token
    has_duplicate: Tensor | None = None  # [batch, 1 or head, rows] bool: the row has such a key


def token_stats(p: Tensor, tokens: TokenClasses, q0: int, lengths: Tensor, causal: bool, k0: int = 0,
                span: int | None = None, pairs: TokenPairs | None = None) -> dict[str, Tensor]:
    """punctuation and duplicate alone, [batch, head, rows] each (for a block whose other statistics come from
    elsewhere, as the blocked path's value-weighted stack), as row_stats gives them."""
    duplicate, has = row_duplicate(p, tokens.ids, q0, lengths, causal, k0, span, pairs)  # [b, h, r], [b, 1, r]
    return {PUNCTUATION: row_special(p, tokens.punctuation, k0), DUPLICATE: torch.where(has, duplicate, torch.nan)}


@dataclass
class RowGeometry:
    """What the statistics of a block of query rows know besides the attention: where the rows are and which keys
    each may see, [batch, 1, rows] each unless noted. It depends on the block, the lengths and the window only, so
    every layer of a batch shares it (the blocked path makes it once per batch and block, not per layer)."""

    i: Tensor  # [rows]: the query positions
    real: Tensor  # bool: a real row, not padding
    n_keys: Tensor  # how many keys the row may see (key_counts)
    several: Tensor  # bool: two keys or more
    log_keys: Tensor  # float32: ln of n_keys, at least ln 2 (entropy_norm's maximum)
    chance: Tensor  # the share of its keys within DIAGONAL_WINDOW of it (diagonal_excess)
    has_previous: Tensor  # bool: it may see key i - 1 and another
    window_open: Tensor  # bool: some key it sees lies outside the +-DIAGONAL_WINDOW window
    bins: tuple[int, Tensor] | None = None  # (bins kept, each row's bin [rows]), once `position_bins` is asked

    def position_bins(self, bins: int) -> Tensor:
        """Each row's position bin, the last of `bins` taking the rows beyond it, [rows]."""
        if self.bins is None or self.bins[0] != bins:
            self.bins = (bins, position_bin(self.i).clamp(max=bins - 1))
        return self.bins[1]


def row_geometry(q0: int, rows: int, lengths: Tensor, causal: bool, span: int | None = None) -> RowGeometry:
    """The RowGeometry of the query rows q0 .. q0 + rows - 1, attending within the window `span`."""
    i = positions(q0, rows, lengths.device)  # [rows]
    first_key = key_range(i, lengths, causal, span)[0][:, None, :]  # [batch, 1, rows]
    n_keys = key_counts(i, lengths, causal, span)[:, None, :]  # [batch, 1, rows]
    in_window = window_key_counts(i, lengths, causal, span=span)[:, None, :]  # [batch, 1, rows]
    several = n_keys >= 2  # [batch, 1, rows]
    return RowGeometry(
        i=i, real=(i[None, :] < lengths[:, None])[:, None, :], n_keys=n_keys, several=several,
        log_keys=torch.log(n_keys.float().clamp(min=2)), chance=in_window / n_keys.clamp(min=1),
        has_previous=several & (i[None, None, :] - 1 >= first_key), window_open=in_window < n_keys,
    )


def row_stats(masses: RowMasses, q0: int, lengths: Tensor, causal: bool, span: int | None = None,
              geometry: RowGeometry | None = None) -> dict[str, Tensor]:
    """The row statistics of METRICS (and special_tokens) from a block's masses: the scores that count a row's
    keys (entropy_norm, diagonal_excess, the forced rows of the _unforced scores) follow the window `span`.
    `geometry`: the block's row_geometry, when the caller keeps it."""
    entropy, diagonal, first = masses.entropy, masses.diagonal, masses.first  # [batch, head, rows] each
    g = geometry or row_geometry(q0, entropy.shape[-1], lengths, causal, span)
    several = g.several  # [batch, 1, rows]
    entropy_norm = torch.where(several, entropy / g.log_keys, torch.nan) if entropy.dtype == torch.float32 \
        else row_entropy_norm(entropy, g.n_keys[:, 0])  # [batch, head, rows]
    per_row = {
        "entropy": entropy,
        "entropy_norm": entropy_norm,
        "diagonal": diagonal,
        "first_token": first,
        "previous_token": torch.where(g.has_previous, masses.previous, torch.nan),
        "self": torch.where(several, masses.self, torch.nan),
        "distance": masses.distance,
        "diagonal_excess": diagonal - g.chance,
        "sink_window": masses.sink_window,
        "entropy_unforced": torch.where(several, entropy, torch.nan),
        "diagonal_unforced": torch.where(g.window_open, diagonal, torch.nan),
        "first_token_unforced": torch.where(several, first, torch.nan),
    }
    if masses.special is not None:
        per_row[SPECIAL] = masses.special
    if masses.punctuation is not None:
        per_row[PUNCTUATION] = masses.punctuation
    if masses.duplicate is not None:
        per_row[DUPLICATE] = torch.where(masses.has_duplicate, masses.duplicate, torch.nan)
    return per_row


def value_weighted(per_row: dict[str, Tensor]) -> dict[str, Tensor]:
    """The row statistics of a value-weighted map, renamed `<score>_vw` (those of VALUE_WEIGHTED only)."""
    return {name + VW: per_row[name] for name in VALUE_WEIGHTED}


def split_stacked(per_row: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    """The statistics of a block of the map and its value-weighted map stacked on the head axis
    ([batch, 2 x head, rows] each): the raw scores from the first `heads`, the `_vw` ones from the rest."""
    raw = {name: values[:, :heads] for name, values in per_row.items()}  # [batch, head, rows] each
    return {**raw, **value_weighted({name: per_row[name][:, heads:] for name in VALUE_WEIGHTED})}


def position_bin(i: Tensor) -> Tensor:
    """Bins of query positions: 0, 1, 2-3, 4-7, 8-15, ... (bin b >= 1 holds 2^(b-1) .. 2^b - 1)."""
    exponent = torch.frexp(i.cpu().to(torch.float64)).exponent  # [rows]: exact for integers; frexp(0) = 0
    return exponent.long().to(i.device)  # computed on the CPU: MPS has no float64


def bin_count(longest: int) -> int:
    """How many bins the positions 0 .. longest - 1 fall into."""
    return int(position_bin(torch.tensor([max(longest, 1) - 1]))[0]) + 1


def bin_range(b: int) -> tuple[int, int]:
    """The first and last query position of bin b."""
    return (0, 0) if b == 0 else (2 ** (b - 1), 2**b - 1)


@dataclass
class SentenceSums:
    """Per-sentence sums and counts of row statistics, filled block by block.

    A sentence's value is sum / count over its real rows where the statistic is defined; the same
    per bin of query positions for BINNED. Every score sits in one stacked tensor, in the order of
    `names` (one operation for all the scores of a block, not one per score).
    """

    names: tuple[str, ...] = ()  # the scores, in the order of the first axis of `total` and `count`
    total: Tensor | None = None  # [score, batch, head]
    count: Tensor | None = None  # [score, batch, head]
    binned: tuple[str, ...] = ()  # the scores of `names` kept per bin (BINNED), in the order of `bin_total`
    bin_total: Tensor | None = None  # [binned score, batch, head, bin]
    bin_count: Tensor | None = None  # [binned score, batch, head, bin]
    # every row's value [batch, head, query] (NaN where none), only when asked for (`rows={}`): the block
    # bootstrap of a run of few sequences resamples them; O(sequence length) per layer, dropped with it
    rows: dict[str, Tensor] | None = None
    received: Tensor | None = None  # [batch, head, key]: mass each key received from the real rows (top_tokens)

    def add(self, per_row: dict[str, Tensor], q0: int, lengths: Tensor, bins: int,
            geometry: RowGeometry | None = None) -> None:
        """Fold a block's row statistics in; `bins` is the number of position bins to keep. `geometry`: the
        block's row_geometry, when the caller keeps it."""
        if self.total is not None and tuple(per_row) != self.names:
            per_row = {name: per_row[name] for name in self.names}  # every block has the same scores
        self.names = tuple(per_row)
        values = torch.stack(list(per_row.values()))  # [score, batch, head, rows]
        i = geometry.i if geometry is not None else positions(q0, values.shape[-1], values.device)  # [rows]
        real = geometry.real if geometry is not None else (i[None, :] < lengths[:, None])[:, None, :]  # [b, 1, rows]
        if self.rows is not None:
            self.keep_rows(per_row, q0, real, lengths)
        keep = real & ~values.isnan()  # [score, batch, head, rows]
        kept = torch.where(keep, values, 0.0)  # [score, batch, head, rows]
        self.total = _plus(self.total, kept.sum(dim=-1))  # [score, batch, head]
        self.count = _plus(self.count, keep.sum(dim=-1).to(values.dtype))  # [score, batch, head]
        self.binned = tuple(name for name in self.names if name in BINNED)
        if not self.binned:
            return
        where = geometry.position_bins(bins) if geometry is not None else position_bin(i).clamp(max=bins - 1)
        pick = [k for k, name in enumerate(self.names) if name in BINNED]
        shape = (len(pick), *values.shape[1:-1], bins)  # [binned score, batch, head, bin]
        zeros = torch.zeros(shape, dtype=values.dtype, device=values.device)
        self.bin_total = _plus(self.bin_total, zeros.index_add(-1, where, kept[pick]))
        self.bin_count = _plus(self.bin_count, zeros.index_add(-1, where, keep[pick].to(values.dtype)))

    def keep_rows(self, per_row: dict[str, Tensor], q0: int, real: Tensor, lengths: Tensor) -> None:
        """Copy a block's row values into `rows` (padded rows NaN); `real` [batch, 1, rows] marks the real ones."""
        for name, values in per_row.items():  # [batch, head, rows]
            if name not in self.rows:
                n = int(lengths.max())
                self.rows[name] = torch.full((*values.shape[:-1], n), torch.nan, dtype=values.dtype,
                                             device=values.device)  # [batch, head, query]
            end = min(q0 + values.shape[-1], self.rows[name].shape[-1])
            self.rows[name][..., q0:end] = torch.where(real, values, torch.nan)[..., : end - q0]

    @property
    def sums(self) -> dict[str, Tensor]:
        """Per score, the sums over rows [batch, head] (views of `total`)."""
        return {} if self.total is None else dict(zip(self.names, self.total))

    @property
    def counts(self) -> dict[str, Tensor]:
        """Per score, the rows with a value [batch, head] (views of `count`)."""
        return {} if self.count is None else dict(zip(self.names, self.count))

    def stacked_means(self) -> Tensor | None:
        """Per score, sentence and head, the mean over rows, [score, batch, head] in the order of `names`; NaN where
        no row had a value."""
        return None if self.total is None else _ratio(self.total, self.count)

    def stacked_bin_means(self) -> Tensor | None:
        """The same per bin, [binned score, batch, head, bin] in the order of `binned`."""
        return None if self.bin_total is None else _ratio(self.bin_total, self.bin_count)

    def means(self) -> dict[str, Tensor]:
        """Per sentence and head, the mean over rows; NaN where no row had a value."""
        means = self.stacked_means()
        return {} if means is None else dict(zip(self.names, means))  # [batch, head] each

    def bin_means(self) -> dict[str, Tensor]:
        means = self.stacked_bin_means()
        return {} if means is None else dict(zip(self.binned, means))  # [batch, head, bin] each


def _plus(total: Tensor | None, value: Tensor) -> Tensor:
    return value if total is None else total + value


def _ratio(total: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def sentence_sums(
    p: Tensor, attention_mask: Tensor, causal: bool, special: Tensor | None = None,
    sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, bins: int | None = None, span: int | None = None,
    keep_rows: bool = False, tokens: TokenClasses | None = None,
) -> SentenceSums:
    """The sums of a whole map [batch, head, query, key]: one block at q0 = 0; `span` is the layer's window;
    `keep_rows`: keep every row's values too (`SentenceSums.rows`)."""
    lengths = attention_mask.sum(dim=-1)  # [batch]
    bins = bins or bin_count(p.shape[-2])
    sums = SentenceSums(rows={} if keep_rows else None)
    sums.add(block_row_stats(p, 0, lengths, causal, special, sink, window, span=span, tokens=tokens), 0, lengths,
             bins)
    if tokens is not None:
        sums.received = received(p.float(), 0, lengths)  # [batch, head, key]
    return sums


def sentence_stats(
    p: Tensor, attention_mask: Tensor, causal: bool, special: Tensor | None = None,
    sink: int = SINK_TOKENS, window: int = RECENT_WINDOW, span: int | None = None,
    tokens: TokenClasses | None = None,
) -> dict[str, Tensor]:
    """Per-sentence, per-head means of every row statistic, over the real query rows.

    `special`, a bool mask [batch, key] of special-token positions, adds `special_tokens`; `tokens` adds
    `punctuation` and `duplicate`.
    """
    return sentence_sums(p, attention_mask, causal, special, sink, window, span=span,
                         tokens=tokens).means()  # each [batch, head]
