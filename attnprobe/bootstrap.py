"""Bootstrap confidence intervals: the Poisson bootstrap over sentences, and for runs of few sequences a
circular moving-block bootstrap over the query rows of each sequence (numpy; torch's sparse product for
the block sums).

Each sentence gets, for each of the R resamples, an independent Poisson(1) weight: how often it is
drawn into that resample (Hanley & MacGibbon 2006; Chamandy et al. 2012). The weights come from
(seed, the sentence's index in the corpus) alone, so they, and the intervals, do not depend on
batch size, batch order or how many processes share the corpus, and a resample's weighted sums
can be accumulated as sentences stream past. Every statistic uses the same weights, so the
intervals of heads, layers, categories and the early-vs-late gradient all describe the same
"another sample of sentences".

Below FEW_SEQUENCES sequences (one long document under `--split file`, say) a bootstrap over sentences
says nothing: one sequence gives zero-width intervals. Such runs resample the query rows of each
sequence instead, in blocks of consecutive rows, since neighbouring rows are not independent (Kunsch
1989; the circular version of Politis & Romano 1992): each resample of a sequence of n rows strings
together ceil(n / L) blocks of L = `block_length(n)` consecutive rows (the last block shorter, so that
the resample has n rows again), each starting at a row drawn uniformly from all n and wrapping past
the last row to the first. Wrapping gives every row the same chance to be drawn, so the resampled means
centre on the sample's mean. The starts come from (seed, the sequence's index) alone, so every head,
layer and score uses the same resampled rows, as with the Poisson weights. A score defined on some
rows only (`sink_window`, the `_unforced` scores) averages over exactly its rows in each resample.
These intervals describe how the mean would vary over another stretch of similar text, under the
assumption that rows more than a block apart are nearly independent; they are not intervals over
another sample of sentences or documents.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np

from attnprobe.defaults import FEW_SENTENCES

CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000
FEW_SEQUENCES = FEW_SENTENCES  # below this many sequences, the block bootstrap over query rows replaces the Poisson one
POISSON, BLOCK = "poisson", "block"  # run.json's bootstrap.method
BLOCK_STREAM = 1  # the block starts' random stream: apart from the Poisson weights' (seed, index)


def poisson_weights(indices: Iterable[int], resamples: int, seed: int) -> np.ndarray:
    """Poisson(1) weights [resample, item] for the items with these corpus indices.

    Column k depends only on (seed, indices[k]): the same sentence gets the same weights whatever
    else is in the batch or the shard.
    """
    columns = [np.random.default_rng([seed, int(i)]).poisson(1.0, resamples) for i in indices]
    return np.array(columns, dtype=np.float64).reshape(-1, resamples).T  # [resample, item]


def resampled_means(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Weighted means of `values` [item, ...] under each resample's weights [resample, item], skipping NaN.

    A resample whose items with a value all have weight 0 gives NaN, which `interval` skips.
    """
    flat = values.reshape(values.shape[0], -1)  # [item, k]
    present = ~np.isnan(flat)  # [item, k]
    totals = counts @ np.where(present, flat, 0.0)  # [resample, k]
    weights = counts @ present  # [resample, k]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = totals / weights  # NaN where a resample drew no item with a value
    return means.reshape((counts.shape[0], *values.shape[1:]))


def interval(resampled: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the resample axis (axis 0)."""
    tail = (1.0 - confidence) / 2 * 100
    if not np.isnan(resampled).any():  # the same percentiles, without nanpercentile's NaN handling (2.5x faster)
        low, high = np.percentile(resampled, [tail, 100 - tail], axis=0)
        return low, high
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a score undefined everywhere stays NaN
        low, high = np.nanpercentile(resampled, [tail, 100 - tail], axis=0)
    return low, high


def bootstrap_method(sequences: int) -> str:
    """`block` (over query rows within each sequence) below FEW_SEQUENCES sequences, else `poisson` (over them)."""
    return BLOCK if sequences < FEW_SEQUENCES else POISSON


def block_length(rows: int) -> int:
    """Rows per block for a sequence of `rows` query rows: the whole number nearest to rows^(1/3), at least 1.

    n^(1/3) is the order of block length that minimises the error of a block bootstrap's variance (Hall,
    Horowitz & Jing 1995); 1,000 rows give blocks of 10, 32,768 rows blocks of 32.
    """
    return max(1, round(max(rows, 1) ** (1 / 3)))


def block_plan(rows: int) -> tuple[int, np.ndarray]:
    """(L, the length of each of a resample's ceil(rows / L) blocks [block]): all L but the last, which makes the
    resample `rows` long."""
    length = block_length(rows)
    count = -(-rows // length)
    sizes = np.full(count, length, dtype=np.int64)  # [block]
    sizes[-1] = rows - length * (count - 1)
    return length, sizes


def block_starts(index: int, rows: int, resamples: int, seed: int) -> np.ndarray:
    """The first row of each block of each resample [resample, block], uniform over 0 .. rows - 1.

    Depends only on (seed, the sequence's index in the corpus, rows): not on the batch, its order or the process.
    """
    count = len(block_plan(rows)[1])
    return np.random.default_rng([seed, int(index), BLOCK_STREAM]).integers(0, rows, size=(resamples, count))


class BlockResampler:
    """The circular block bootstrap of one sequence of `rows` query rows: `means` of any values over its rows.

    A resample takes, for each block b, the rows starts[r, b] .. starts[r, b] + size_b - 1 (modulo the rows;
    sizes from `block_plan`), and a score's resampled value is its mean over those rows, a row counted as
    often as it is drawn. Block sums are differences of prefix sums over the rows (wrapped once); a
    resample's sum of its full-length blocks is one sparse product with the counts of blocks starting at
    each row, built once per sequence and reused for every layer.
    """

    def __init__(self, starts: np.ndarray, rows: int) -> None:
        import torch  # here, not at the top: compare and report read intervals without torch

        self.rows = rows
        self.length, self.sizes = block_plan(rows)
        if starts.ndim != 2 or starts.shape[1] != len(self.sizes):
            raise ValueError(f"starts {starts.shape}: need [resample, {len(self.sizes)}] for {rows} rows")
        self.starts = starts  # [resample, block]
        resamples, full = starts.shape[0], starts.shape[1] - 1  # every block but the last has L rows
        keys = (np.arange(resamples)[:, None] * rows + starts[:, :full]).reshape(-1)  # [resample x full]
        keys, counts = np.unique(keys, return_counts=True)  # sorted (resample, row) pairs and their blocks
        index = torch.from_numpy(np.stack([keys // rows, keys % rows]))  # [2, pairs]
        with warnings.catch_warnings():  # torch 2.11 warns that invariant checks are off even when told so
            warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
            self.starting = torch.sparse_coo_tensor(  # [resample, row]: full-length blocks starting at each row
                index, torch.from_numpy(counts.astype(np.float64)), (resamples, rows), is_coalesced=True,
                check_invariants=False,
            )

    @classmethod
    def draw(cls, index: int, rows: int, resamples: int, seed: int) -> BlockResampler:
        """The resampler of the sequence at corpus `index` (`block_starts`)."""
        return cls(block_starts(index, rows, resamples, seed), rows)

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per resample, the sum of `values` [k, row] over the resample's rows: [resample, k]."""
        import torch

        if values.shape[-1] != self.rows:
            raise ValueError(f"values {values.shape}: need {self.rows} rows")
        k = values.shape[0]
        wrapped = np.concatenate([values, values[:, : self.length]], axis=1)  # [k, row + L]: blocks run past the end
        prefix = np.zeros((k, self.rows + self.length + 1))  # [k, row + L + 1]
        np.cumsum(wrapped, axis=1, out=prefix[:, 1:])
        first, size = self.starts[:, -1], int(self.sizes[-1])  # [resample]: the last block
        total = (prefix[:, first + size] - prefix[:, first]).T  # [resample, k]
        if self.starts.shape[1] > 1:  # numpy above (small, single-threaded); torch only for the sparse product
            length, rows = self.length, self.rows
            windows = np.ascontiguousarray((prefix[:, length : length + rows] - prefix[:, :rows]).T)  # [row, k]
            total = total + (self.starting @ torch.from_numpy(windows)).numpy()  # [resample, k]
        return total

    def means(self, values: np.ndarray) -> np.ndarray:
        """Per resample, the mean of `values` [k, row] over the resample's rows where they are not NaN: [resample, k];
        NaN where a resample drew no row with a value."""
        present = ~np.isnan(values)  # [k, row]
        masks, which = distinct_rows(present)  # [mask, row], [k]: the scores' masks are a few distinct ones
        k = values.shape[0]
        both = self.sums(np.concatenate([np.where(present, values, 0.0), masks]))  # [resample, k + mask]: one pass
        sums, counts = both[:, :k], both[:, k:][:, which]  # [resample, k] each
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.nan)


def distinct_rows(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a bool array [k, n] ([distinct, n]) and which of them each row is ([k])."""
    first: dict[bytes, int] = {}
    packed = np.packbits(flags, axis=1)  # [k, n / 8]
    which = np.array([first.setdefault(row.tobytes(), len(first)) for row in packed], dtype=np.int64)  # [k]
    kept = np.zeros(len(first), dtype=np.int64)
    kept[which] = np.arange(len(which))  # any row of each kind will do
    return flags[kept], which


def interval_basis(run: dict) -> str:
    """What a run's intervals resample, in words, from run.json (`bootstrap`, `sentences`): "bootstrap over 12
    sentences", or "block bootstrap over the query rows of 1 sequence, blocks of 19 rows"."""
    boot, n = run.get("bootstrap") or {}, run.get("sentences", "?")
    if boot.get("method") != BLOCK:
        return f"bootstrap over {n} sentence{'' if n == 1 else 's'}"
    sizes = sorted(set(boot.get("block_lengths") or []))
    blocks = "" if not sizes else f", blocks of {sizes[0]}{'' if len(sizes) == 1 else f'-{sizes[-1]}'} rows"
    return f"block bootstrap over the query rows of {n} sequence{'' if n == 1 else 's'}{blocks}"


def over_sentences(run: dict) -> bool:
    """Whether a run's intervals stand for another sample of sentences: a bootstrap over FEW_SEQUENCES or more of
    them (not the block bootstrap over query rows, nor an older run's bootstrap over fewer sentences)."""
    boot, n = run.get("bootstrap") or {}, run.get("sentences")
    return boot.get("method", POISSON) != BLOCK and isinstance(n, int) and n >= FEW_SEQUENCES


def few_items_note(count: int, unit: str) -> str | None:
    """The warning for a Poisson bootstrap over fewer than FEW_SEQUENCES `unit`s (probe's random sequences,
    ablate's sentences), else None."""
    if count >= FEW_SEQUENCES:
        return None
    return (f"only {count} {unit}{'' if count == 1 else 's'}: 95% intervals from a bootstrap over fewer than "
            f"{FEW_SEQUENCES} {unit}s mean little{' (with one they have zero width)' if count == 1 else ''}; use "
            f"{FEW_SEQUENCES} or more for intervals to trust")
