"""Checkpoints of a long `analyze` run, and resuming from one (pure: attnprobe.io writes and reads the file).

A checkpoint holds the accumulator's sums, how many batches were done, the example maps (the plot's example
and the other examples captured from their batches), the torch threads it ran with, and a
fingerprint of everything that decides the results (model, tokenizer, corpus hash, batch size, resamples,
seed, attention options, dtype). Batches run in a fixed order and the sums are added in that order,
so a resumed run gives results identical to an uninterrupted one. A checkpoint whose fingerprint
differs from the run being started is refused, naming what differs.

Nothing in the file is trusted: every field is checked against the others and against the run being
resumed (`check_fits`, one function per check), and a checkpoint that fails one is refused in one line
that names the value, before anything is measured or written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnprobe.accumulate import TOKEN_SUMS
from attnprobe.errors import AttnprobeError, plain
from attnprobe.mapcheck import map_fault
from attnprobe.threads import recorded_threads

DEFAULT_EVERY_SECONDS = 300.0  # a checkpoint every five minutes
FIX = "delete it and run without --resume"  # what to do with a checkpoint that cannot be resumed

# sums that count something (sentences, rows, resample draws, tokens): whole numbers of 0 or more
COUNT_PREFIXES = ("count/", "bincount/", "wcount/", "catcount/", "catn/", "catwn/")
COUNT_KEYS = ("rows", "tokcount", "pending/fill", "pending/index", "pending/category", "pending/present")
# (sum, its count): a sum over no sentence is 0
SUM_COUNTS = (("sum/", "count/"), ("sumsq/", "count/"), ("wsum/", "wcount/"), ("binsum/", "bincount/"),
              ("catsum/", "catn/"), ("catwsum/", "catwn/"))
SCALARS = (str, int, float, bool, type(None))  # what a fingerprint's values are (run_fingerprint)
# the sums indexed by token id ([vocab, ...], accumulate.TOKEN_SUMS): a checkpoint keeps only the rows of the token
# ids the run has met (those tokcount counts, met_ids), with their ids in TOKEN_ROWS, so it grows with the corpus's
# vocabulary, not the model's
TOKEN_ROWS = "tokrows"
# the other example sentences' maps captured from their batches (analysis.more_examples), one array per sentence:
# "example_maps:<corpus index>"; without them a resumed run would measure those sentences alone, which rounds
# differently from their batch (examples.npz would differ from an uninterrupted run's in the last bits)
OTHER_MAPS = "example_maps:"


def met_ids(sums: dict[str, np.ndarray]) -> np.ndarray:
    """The token ids the run has met: those tokcount counts ([met], increasing)."""
    return np.flatnonzero(sums["tokcount"])  # [met]


def met_rows(sums: dict[str, np.ndarray], met: np.ndarray) -> dict[str, np.ndarray]:
    """The TOKEN_SUMS sums cut to the rows of the token ids `met` (copies of those rows only)."""
    return {key: sums[key][met] for key in TOKEN_SUMS}  # each [met, ...]


@dataclass
class State:
    fingerprint: dict[str, Any]
    batches_done: int
    sums: dict[str, np.ndarray]
    example_maps: np.ndarray | None  # [layer, head, query, key], once the example's batch has run
    path: str | None = None  # the file it was read from, named when it cannot be resumed
    # the token ids whose rows the TOKEN_SUMS sums hold ([met], increasing); None: those sums are whole [vocab, ...]
    # (the live accumulator's, or an older checkpoint that saved them whole)
    token_rows: np.ndarray | None = None
    threads: int = 0  # the torch threads the run used (threads.resumed_threads); 0: not recorded (an older one)
    other_maps: dict[int, np.ndarray] = field(default_factory=dict)  # corpus index -> [layer, head, query, key]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays of checkpoint.npz: every sum, the TOKEN_SUMS ones as the rows of the token ids met."""
        arrays = {f"sum:{key}": value for key, value in self.sums.items()}
        if "tokcount" in self.sums:
            rows = self.token_rows
            if rows is None:
                rows = met_ids(self.sums)  # [met]
                arrays.update({f"sum:{key}": value for key, value in met_rows(self.sums, rows).items()})
            arrays[TOKEN_ROWS] = rows.astype(np.int64)
        arrays["meta"] = np.array(json.dumps({"fingerprint": self.fingerprint, "batches_done": self.batches_done,
                                              "threads": self.threads}))
        if self.example_maps is not None:
            arrays["example_maps"] = self.example_maps
        arrays.update({f"{OTHER_MAPS}{index}": maps for index, maps in sorted(self.other_maps.items())})
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], path: str | None = None) -> State:
        """The state saved by `to_arrays`; ValueError naming the first field that is missing or not as saved."""
        if "meta" not in arrays or arrays["meta"].shape != () or arrays["meta"].dtype.kind != "U":
            raise ValueError("no meta record")
        try:
            meta = json.loads(str(arrays["meta"]))
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; a deeply nested record recurses
            raise ValueError("its meta record is not the JSON attnprobe writes") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), dict):
            raise ValueError("its meta record holds no fingerprint")
        if not all(isinstance(value, SCALARS) for value in meta["fingerprint"].values()):
            raise ValueError("its fingerprint holds a value that is not a number or a text")
        done = meta.get("batches_done")
        if not isinstance(done, int) or isinstance(done, bool) or done < 1:
            raise ValueError(f"batches_done = {plain(done)} is not a whole number of at least 1")
        threads = recorded_threads(meta)
        sums = {key[4:]: value for key, value in arrays.items() if key.startswith("sum:")}
        if not sums:
            raise ValueError("it holds no sums")
        for key, value in sums.items():
            if value.dtype.kind != "f" or not np.isfinite(value).all():
                raise ValueError(f"sum {key} holds values that are not finite numbers")
        maps = arrays.get("example_maps")
        if maps is not None and (maps.dtype.kind != "f" or maps.ndim != 4):
            raise ValueError("example_maps is not a [layer, head, query, key] array of numbers")
        rows = arrays.get(TOKEN_ROWS)
        if rows is not None and (rows.dtype.kind not in "iu" or rows.ndim != 1):
            raise ValueError(f"{TOKEN_ROWS} is not a list of token ids")
        others = {int(index): value for key, value in arrays.items() if key.startswith(OTHER_MAPS)
                  and (index := key.removeprefix(OTHER_MAPS)).isdigit() and index.isascii()}
        for index, value in others.items():
            if value.dtype.kind != "f" or value.ndim != 4:
                raise ValueError(f"{OTHER_MAPS}{index} is not a [layer, head, query, key] array of numbers")
        unknown = sorted(set(arrays) - {"meta", "example_maps", TOKEN_ROWS} - {f"sum:{key}" for key in sums}
                         - {f"{OTHER_MAPS}{index}" for index in others})
        if unknown:
            raise ValueError(f"it holds an unknown array {unknown[0]}")
        return cls(meta["fingerprint"], done, sums, maps, path, None if rows is None else rows.astype(np.int64),
                   threads, others)

    @property
    def where(self) -> str:
        return self.path or "the checkpoint"

    def refuse(self, problem: str) -> AttnprobeError:
        """The one line for a checkpoint that cannot be resumed: where, what, and the fix."""
        return AttnprobeError(f"{self.where}: {problem}: {FIX}")

    def check_fits(self, sums: dict[str, np.ndarray], expected: Expected) -> None:
        """Refuse a state whose fields disagree with each other or with this run (`sums`: a fresh accumulator's,
        of the right keys, shapes and dtypes; `expected`: what the run's own batches say the state must hold)."""
        check_keys(self, sums)
        check_dtypes(self, sums)
        check_batches_done(self, expected)
        check_whole_counts(self)
        check_token_rows(self)
        check_sentences(self, expected)
        check_empty_sums(self)
        check_pending(self, expected)


@dataclass(frozen=True)
class Expected:
    """What the run being resumed says the checkpoint must hold, from its own batch plan, not from the file."""

    batches: int  # this process's batches in the whole run
    sentences: int  # sentences in its first `batches_done` batches
    pending: int  # of those, how many wait in the accumulator's buffer (accumulate.pending_after; 0: none kept)
    corpus: int  # sentences in the corpus
    reached: int  # the corpus index after the last window the first `batches_done` batches reach into
    rank: int = 0  # this process's shard: the corpus indices i with i % size == rank
    size: int = 1


def _first(bad: np.ndarray, values: np.ndarray) -> str:
    """The first offending value of `values` where `bad`, written plainly."""
    return plain(values[bad].ravel()[0])


def check_keys(state: State, sums: dict[str, np.ndarray]) -> None:
    """The same sums as this run's accumulator, of the same shapes (the TOKEN_SUMS sums: one row per token id of
    TOKEN_ROWS, where the checkpoint has that list)."""
    if set(state.sums) != set(sums):
        missing = sorted(set(sums) - set(state.sums)) or sorted(set(state.sums) - set(sums))
        raise state.refuse(f"its sums do not fit this run ({missing[0]})")
    if state.token_rows is not None and "tokcount" not in sums:
        raise state.refuse(f"it holds {TOKEN_ROWS}, but this run keeps no top-token sums")
    for key, value in sums.items():
        shape = value.shape
        if key in TOKEN_SUMS and state.token_rows is not None:
            shape = (len(state.token_rows), *value.shape[1:])  # [met, ...]
        if state.sums[key].shape != shape:
            raise state.refuse(f"sum {key} has shape {plain(state.sums[key].shape)}, this run {plain(shape)}")


def check_dtypes(state: State, sums: dict[str, np.ndarray]) -> None:
    """The dtypes the run writes (float64 sums): a float16 copy would shift the results by its rounding."""
    for key, value in sums.items():
        if state.sums[key].dtype != value.dtype:
            raise state.refuse(f"sum {key} is {state.sums[key].dtype}, but attnprobe writes {value.dtype}")
    if state.example_maps is not None and state.example_maps.dtype != np.float32:
        raise state.refuse(f"example_maps is {state.example_maps.dtype}, but attnprobe writes float32")


def check_batches_done(state: State, expected: Expected) -> None:
    """No more batches done than the run has."""
    if state.batches_done > expected.batches:
        raise state.refuse(f"batches_done = {state.batches_done}, but the run has {expected.batches} batches")


def check_whole_counts(state: State) -> None:
    """Every count (sentences, rows, resample draws, tokens, the buffer's fill, index and flags) a whole number
    of 0 or more: a negative or fractional count makes means and intervals of nothing."""
    for key, value in state.sums.items():
        if not (key.startswith(COUNT_PREFIXES) or key in COUNT_KEYS):
            continue
        bad = (value < 0) | (value != np.round(value))
        if bad.any():
            raise state.refuse(f"{key} holds {_first(bad, value)}, but a count is a whole number of 0 or more")
    present = state.sums.get("pending/present")
    if present is not None and (present > 1).any():
        raise state.refuse(f"pending/present holds {_first(present > 1, present)}, but it is 0 or 1")


def check_token_rows(state: State) -> None:
    """The top-token sums hold the rows of exactly the token ids tokcount counts (those the run has met), in
    increasing order. A checkpoint that saved them whole ([vocab, ...], attnprobe before TOKEN_ROWS) must be zero
    at every other token id; it is cut to the rows met here, so a resumed run maps in only those."""
    if "tokcount" not in state.sums:
        return
    met = met_ids(state.sums)  # [met]: checked whole counts, so nonzero is positive
    rows = state.token_rows
    if rows is None:
        for key in TOKEN_SUMS:
            outside = np.ones(len(state.sums[key]), dtype=bool)
            outside[met] = False
            nonzero = outside & (state.sums[key].reshape(len(outside), -1) != 0).any(axis=1)  # [vocab]
            if nonzero.any():
                token = int(np.flatnonzero(nonzero)[0])
                raise state.refuse(f"{key} holds mass at token id {token}, which tokcount counts no key position of")
        state.sums.update(met_rows(state.sums, met))  # [met, ...]
        state.token_rows = met
        return
    if len(rows) != len(met) or (rows != met).any():
        differs = np.setxor1d(rows, met)
        token = plain(differs[0]) if len(differs) else plain(rows[np.flatnonzero(rows != met)[0]])
        raise state.refuse(f"{TOKEN_ROWS} lists {len(rows)} token ids, tokcount counts {len(met)} (first that differs: "
                           f"{token})")


def check_sentences(state: State, expected: Expected) -> None:
    """The sentences the sums hold agree with batches_done: every sentence has one query row at position 0
    (`rows`' first bin), no head counts more sentences than that, and every sentence has one category."""
    held = state.sums["rows"][0]  # the position-0 bin: one row per sentence
    if held != expected.sentences:
        raise state.refuse(f"batches_done = {state.batches_done} (in this run {expected.sentences} sentences), but "
                           f"its sums hold {plain(held)} sentences")
    for key, value in state.sums.items():
        if key.startswith(("count/", "bincount/")) and (value > held).any():
            raise state.refuse(f"{key} counts {_first(value > held, value)} sentences, but its sums hold "
                               f"{plain(held)}")
    categories = [value for key, value in state.sums.items() if key.startswith("catcount/")]
    if categories and not (sum(categories) == held).all():
        raise state.refuse(f"its categories count {plain(sum(categories).min())} sentences, but its sums hold "
                           f"{plain(held)}")
    if "tokcount" in state.sums and state.sums["tokcount"].sum() != state.sums["rows"].sum():
        raise state.refuse(f"tokcount counts {plain(state.sums['tokcount'].sum())} tokens, but rows "
                           f"{plain(state.sums['rows'].sum())}")


def check_empty_sums(state: State) -> None:
    """A sum over no sentence is 0: a value where its count is 0 was not added by attnprobe."""
    for total_prefix, count_prefix in SUM_COUNTS:
        for key, total in state.sums.items():
            if not key.startswith(total_prefix):
                continue
            count = state.sums[count_prefix + key[len(total_prefix):]]
            bad = (count == 0) & (total != 0)
            if bad.any():
                raise state.refuse(f"{key} holds {_first(bad, total)} where {count_prefix + key[len(total_prefix):]} "
                                   "counts no sentence")


def check_pending(state: State, expected: Expected) -> None:
    """The buffer of sentences waiting to be folded in: as many as the run's batches leave there, each a sentence
    of this process's shard in the part of the corpus done, none twice; the empty slots all zero."""
    if "pending/fill" not in state.sums:
        return
    s = state.sums
    fill = s["pending/fill"][0]
    if fill != expected.pending:
        raise state.refuse(f"pending/fill = {plain(fill)}, but after {state.batches_done} batches this run leaves "
                           f"{expected.pending} sentences waiting")
    n = int(fill)
    index = s["pending/index"][:n]
    outside = (index >= expected.reached) | (index % expected.size != expected.rank)
    if outside.any():
        raise state.refuse(f"pending/index holds {_first(outside, index)}, not a sentence of the "
                           f"{expected.reached} this process had reached (of {expected.corpus})")
    if len(np.unique(index)) != n:
        raise state.refuse("pending/index holds a sentence twice")
    for key in ("pending/index", "pending/category", "pending/values", "pending/present"):
        rest = s[key][n:]
        if (rest != 0).any():
            raise state.refuse(f"{key} holds {_first(rest != 0, rest)} past pending/fill = {n}")
    categories = len([key for key in s if key.startswith("catcount/")])
    category = s["pending/category"][:n]
    wrong = (category > categories) | ((category == 0) if categories else (category != 0))
    if wrong.any():
        raise state.refuse(f"pending/category holds {_first(wrong, category)}, but the run has {categories} "
                           "categories")
    absent = (s["pending/present"][:n] == 0) & (s["pending/values"][:n] != 0)
    if absent.any():
        raise state.refuse(f"pending/values holds {_first(absent, s['pending/values'][:n])} where pending/present "
                           "says there is no value")


def row_tolerance(eps: float, keys: int) -> float:
    """How far a row of attention maps may sum from 1: each probability rounded once to the model's dtype
    (relative error eps / 2, so at most eps / 2 over a row summing to 1), plus the float32 rounding of the
    softmax's sum over `keys` terms and of exp(score - logsumexp) (a few float32 epsilons per term)."""
    return eps / 2 + 4 * keys * float(np.finfo(np.float32).eps)


def check_example_maps(state: State, done: bool, shape: tuple[int, ...], eps: float, whole_rows: bool) -> None:
    """The example sentence's maps: present (and probabilities) exactly when its batch is among those done.
    `eps`: the model dtype's epsilon; `whole_rows`: every key of the sentence is kept (a causal model, or a
    sentence no longer than the maps), so each row sums to 1; else (an encoder's cut rows) to at most 1."""
    maps = state.example_maps
    if not done:
        if maps is not None:
            raise state.refuse(f"it holds example_maps, but batches_done = {state.batches_done} does not reach the "
                               "example sentence's batch")
        return
    if maps is None:
        raise state.refuse(f"batches_done = {state.batches_done} covers the example sentence's batch, but it holds "
                           "no example_maps")
    check_maps(state, "example_maps", maps, tuple(shape), eps, whole_rows)


def check_maps(state: State, name: str, maps: np.ndarray, shape: tuple[int, ...], eps: float,
               whole_rows: bool) -> None:
    """One array of example maps in a checkpoint (`name`): this run's `shape`, and attention maps: probabilities
    whose rows sum to 1 within the rounding of the model's dtype (`eps`), or to at most 1 without `whole_rows`."""
    if maps.shape != shape:
        raise state.refuse(f"{name} has shape {plain(maps.shape)}, this run {plain(shape)}")
    tolerance = row_tolerance(eps, maps.shape[-1])
    fault = map_fault(maps.astype(np.float64), 0.0, tolerance, whole_rows)  # rows summed in float64
    if fault is not None and not fault.in_rows:
        raise state.refuse(f"{name} holds {_first(fault.bad, maps)}, not a probability in [0, 1]")
    if fault is not None:
        raise state.refuse(f"a row of {name} sums to {_first(fault.bad, fault.values)}, not to 1 (within "
                           f"{tolerance:.1g})")


def check_other_maps(state: State, shapes: dict[int, tuple[int, ...]], eps: float, whole_rows: dict[int, bool]) -> None:
    """The other example sentences' maps: each of a sentence the run keeps maps of (`shapes`: corpus index -> the
    [layer, head, query, key] shape of its maps), of that shape, and attention maps (check_maps)."""
    for index, maps in sorted(state.other_maps.items()):
        name = f"{OTHER_MAPS}{index}"
        if index not in shapes:
            raise state.refuse(f"it holds {name}, but corpus sentence {index} is not one of the examples this "
                               "process keeps")
        check_maps(state, name, maps, shapes[index], eps, whole_rows[index])


def check_others_done(state: State, done: set[int]) -> None:
    """The other examples' maps are of sentences whose batches are among those done (`done`: their corpus indices)."""
    early = sorted(set(state.other_maps) - done)
    if early:
        raise state.refuse(f"it holds {OTHER_MAPS}{early[0]}, but batches_done = {state.batches_done} does not reach "
                           f"corpus sentence {early[0]}'s batch")


@dataclass
class Checkpointing:
    """How `analyze` saves and resumes: `save` writes a State (attnprobe.io), every `every_seconds`."""

    save: Callable[[State], None]
    resume_from: State | None = None
    every_seconds: float = DEFAULT_EVERY_SECONDS
    should_stop: Callable[[], bool] = lambda: False  # e.g. set by a SIGINT/SIGTERM handler
    last_saved: float = field(default_factory=time.monotonic)
    # told (batches done, batches) once `resume_from` has passed every check, before the next batch runs
    on_resumed: Callable[[int, int], None] | None = None

    def due(self) -> bool:
        return time.monotonic() - self.last_saved >= self.every_seconds


class Stopped(AttnprobeError):
    """The run was asked to stop (Ctrl-C, SIGTERM); a checkpoint with every finished batch was saved."""


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint made with another model, tokenizer, corpus or settings."""
    differs = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if "model_sha256" in differs and "model" not in differs:
        raise AttnprobeError(
            f"the model's weights at {current.get('model')} changed since the checkpoint was made (their fingerprint "
            "differs): resume with the weights it was made with, or run without --resume to start again"
        )
    if "tokenizer_sha256" in differs and "model" not in differs:
        raise AttnprobeError(
            f"the model's tokenizer at {current.get('model')} changed since the checkpoint was made (the fingerprint "
            "of its tokenizer files differs): resume with the tokenizer it was made with, or run without --resume "
            "to start again"
        )
    if differs:
        key = differs[0]
        raise AttnprobeError(
            f"the checkpoint was made with {key} = {_setting(saved.get(key))}, this run has "
            f"{_setting(current.get(key))}: run with the same model, corpus and settings, or without --resume to "
            "start again"
        )


def _setting(value: Any) -> str:
    """A fingerprint value for a message: a text quoted, a number plain, an absent one as `none`."""
    if value is None:
        return "none"
    return repr(value) if isinstance(value, str) else plain(value)
