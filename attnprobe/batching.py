"""The corpus in windows and batches: tokenizing under the model's context (`Tokens`), the counting pass that
finds the longest sequence and the example sentences (`Scan`), windows of WINDOW_SENTENCES sentences, batches of
similar length, padding, and how many batches each rank runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from attnprobe import distributed
from attnprobe import tokens as token_classes
from attnprobe.bootstrap import FEW_SEQUENCES
from attnprobe.corpus import Corpus, Sentence, clip_text
from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel, quiet_transformers
from attnprobe.resume import Stopped

EXAMPLE_TARGET_TOKENS = 12  # the example sentence for `plot` is the one closest to this length
EXAMPLES = 8  # examples.npz: the example, one sentence per category, then sentences near these lengths
EXAMPLE_LENGTHS = (6, 20, 30, 9, 16, 40, 3)


@dataclass
class Tokens:
    ids: list[np.ndarray]  # per sentence, int32, truncated to the model's context
    special: list[np.ndarray]  # per sentence, 1 where the tokenizer added a special token ([CLS], [SEP], BOS)
    # (line, tokens beyond the context, whether the line was clipped before tokenizing so the count is a lower bound)
    cut: list[tuple[int, int, bool]] = field(default_factory=list)

    @property
    def truncated(self) -> int:
        """How many sentences were longer than the context."""
        return len(self.cut)

    def take(self, positions: list[int]) -> Tokens:
        """The sentences at these positions (without the record of truncation)."""
        return Tokens([self.ids[k] for k in positions], [self.special[k] for k in positions])


TOKENIZE_CHUNK = 1024  # sentences per tokenizer call: its per-sentence encodings are large, so keep few alive
WINDOW_SENTENCES = 4096  # sentences tokenized, sorted by length and batched together: all a run holds of the corpus


def windows(sentences: Iterable[Sentence], size: int) -> Iterator[tuple[int, list[Sentence]]]:
    """(index of the first, sentences) for consecutive windows of `size` sentences."""
    first, window = 0, []
    for sentence in sentences:
        window.append(sentence)
        if len(window) == size:
            yield first, window
            first, window = first + size, []
    if window:
        yield first, window


def window_batches(sentences: int, batch_size: int, world: distributed.World) -> Iterator[tuple[int, list[int]]]:
    """For each window of a corpus of `sentences`, in order: the corpus index after it, and the sizes of this rank's
    batches in it (its shard cut into batches of `batch_size`, the last one shorter, as length_batches cuts them),
    so that counting batches needs no tokenizing."""
    for first in range(0, sentences, WINDOW_SENTENCES):
        end = min(first + WINDOW_SENTENCES, sentences)
        mine = len(world.shard(end, first))
        yield end, [min(batch_size, mine - k) for k in range(0, mine, batch_size)]


def batch_count(sentences: int, batch_size: int, world: distributed.World) -> int:
    """How many batches this rank runs over a corpus of `sentences`: windows are batched separately."""
    return sum(len(sizes) for _, sizes in window_batches(sentences, batch_size, world))


def batch_sizes(sentences: int, batch_size: int, world: distributed.World, batches: int) -> tuple[list[int], int]:
    """The sizes of this rank's first `batches` batches, in the order they run, and the corpus index after the
    window the last of them is in (window_batches)."""
    sizes: list[int] = []
    end = 0
    for after, window in window_batches(sentences, batch_size, world):
        if len(sizes) >= batches:
            break
        end = after
        sizes += window[: batches - len(sizes)]
    return sizes, end


def tokenize(loaded: LoadedModel, corpus: Corpus) -> Tokens:
    """Token ids of every sentence (int32 arrays), truncated to the model's context; and how many were truncated."""
    return tokenize_sentences(loaded, list(corpus.stream()))


def tokenize_sentences(loaded: LoadedModel, sentences: list[Sentence]) -> Tokens:
    """`tokenize` for a list of sentences, in chunks of TOKENIZE_CHUNK."""
    ids: list[np.ndarray] = []
    special: list[np.ndarray] = []
    cut: list[tuple[int, int]] = []
    for start in range(0, len(sentences), TOKENIZE_CHUNK):
        chunk = sentences[start : start + TOKENIZE_CHUNK]
        texts = [clip_text(s.text, loaded.max_length) for s in chunk]  # a huge line: only what can be kept
        with quiet_transformers():  # it warns about over-long inputs that we truncate anyway
            kept = token_classes.encode(loaded, texts, truncation=True, max_length=loaded.max_length,
                                        return_special_tokens_mask=True)
            # only a sentence that reaches the limit can have been cut: count its full length
            long = [k for k, tokens in enumerate(kept["input_ids"]) if len(tokens) >= loaded.max_length]
            full = dict(zip(long, token_classes.encode(loaded, [texts[k] for k in long],
                                                       truncation=False)["input_ids"])) if long else {}
        for k, (tokens, flags) in enumerate(zip(kept["input_ids"], kept["special_tokens_mask"])):
            if not tokens:
                raise AttnprobeError(f"corpus line {chunk[k].line} gives no tokens: remove or fix it")
            beyond = len(full[k]) - len(tokens) if k in full else 0  # tokens of the (clipped) text past the limit
            if texts[k] is not chunk[k].text:  # clipped before tokenizing: the line has more than `beyond`
                cut.append((chunk[k].line, max(0, beyond), True))
            elif beyond > 0:
                cut.append((chunk[k].line, beyond, False))
            ids.append(np.asarray(tokens, dtype=np.int32))
            special.append(np.asarray(flags, dtype=np.int8))
    return Tokens(ids, special, cut)


@dataclass
class Scan:
    """What a tokenizing pass over the whole corpus tells before the measuring pass; nothing per sentence."""

    sentences: int = 0
    tokens: int = 0
    longest: int = 0
    special: bool = False  # whether the tokenizer adds special tokens
    truncated: int = 0
    cut: list[tuple[int, int, bool]] = field(default_factory=list)  # Tokens.cut of the first truncated ones
    lengths: list[int] = field(default_factory=list)  # tokens of the first FEW_SEQUENCES sequences (block bootstrap)
    example_index: int = -1  # the example sentence for `plot`: the first closest to EXAMPLE_TARGET_TOKENS
    example: Sentence | None = None
    example_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    first_window: Tokens | None = None  # the ids of the first WINDOW_SENTENCES sentences, when asked to keep them
    # candidates for more examples: per category and per target length, the first closest sentence
    candidates: dict[tuple[str, Any], tuple[int, Sentence, np.ndarray]] = field(default_factory=dict)

    def offer(self, index: int, sentence: Sentence, ids: np.ndarray) -> None:
        """Keep `sentence` if it is the closest yet to its category's target or to a target length."""
        keys = [(("length", t), t) for t in EXAMPLE_LENGTHS]
        if sentence.category is not None and (("category", sentence.category) in self.candidates
                                              or len(self.categories) < EXAMPLES):
            keys.append((("category", sentence.category), EXAMPLE_TARGET_TOKENS))
        for key, target in keys:
            best = self.candidates.get(key)
            if best is None or abs(len(ids) - target) < abs(len(best[2]) - target):
                self.candidates[key] = (index, sentence, ids)

    @property
    def categories(self) -> list[str]:
        return [key[1] for key in self.candidates if key[0] == "category"]

    @property
    def others(self) -> list[tuple[int, Sentence, np.ndarray]]:
        """Up to EXAMPLES - 1 sentences besides the example: one per category first, then spread over lengths."""
        chosen = {self.example_index}
        picked = []
        for key in [k for k in self.candidates if k[0] == "category"] + [("length", t) for t in EXAMPLE_LENGTHS]:
            index, sentence, ids = self.candidates.get(key, (None, None, None))
            if index is not None and index not in chosen and len(picked) < EXAMPLES - 1:
                chosen.add(index)
                picked.append((index, sentence, ids))
        return picked


CUT_SHOWN = 5  # truncated sentences named in the warning
STOP_CHECK_SECONDS = 0.5  # how often the counting pass asks whether the run should stop


def scan(loaded: LoadedModel, corpus: Corpus, keep_first_window: bool = False,
         should_stop: Callable[[], bool] | None = None) -> Scan:
    """Tokenize the corpus once, chunk by chunk, keeping only totals, the longest and the example sentence.

    `keep_first_window`: also keep the ids of the first WINDOW_SENTENCES sentences (`Scan.first_window`), so
    that the measuring pass need not tokenize them again: a corpus of one window is tokenized once. At most
    one window is kept, whatever the corpus's size. `should_stop` (Ctrl-C, SIGTERM) is asked between chunks of
    TOKENIZE_CHUNK sentences, every STOP_CHECK_SECONDS: a stop raises Stopped within about that time, not after
    counting a large corpus whole (a corpus of one chunk is not asked: it is counted in a moment).
    """
    result = Scan()
    window = Tokens([], []) if keep_first_window else None
    asked = time.monotonic()
    for first, whole in windows(corpus.stream(), TOKENIZE_CHUNK):
        if should_stop is not None and first > 0 and time.monotonic() - asked >= STOP_CHECK_SECONDS:
            asked = time.monotonic()
            if should_stop():
                raise Stopped(f"stopped while counting the corpus ({first} sentences counted), before any batch "
                              "was measured")
        tokens = tokenize_sentences(loaded, whole)  # clips each text itself, and so knows which it clipped
        chunk = [clipped(s, loaded.max_length) for s in whole]  # an example keeps the cut text, not 50 MB
        del whole
        if window is not None and first < WINDOW_SENTENCES:
            window.ids.extend(tokens.ids[: WINDOW_SENTENCES - first])
            window.special.extend(tokens.special[: WINDOW_SENTENCES - first])
        result.sentences += len(chunk)
        result.truncated += tokens.truncated
        result.cut.extend(tokens.cut[: CUT_SHOWN - len(result.cut)])
        for k, (ids, flags) in enumerate(zip(tokens.ids, tokens.special)):
            if first + k < FEW_SEQUENCES:
                result.lengths.append(len(ids))
            result.tokens += len(ids)
            result.longest = max(result.longest, len(ids))
            result.special = result.special or bool(flags.any())
            if result.example is None or _closer(len(ids), len(result.example_ids)):
                result.example_index, result.example, result.example_ids = first + k, chunk[k], ids
            result.offer(first + k, chunk[k], ids)
    result.first_window = window
    return result


def clipped(sentence: Sentence, max_tokens: int) -> Sentence:
    """`sentence` with its text cut by `clip_text` (the same object when it is short enough)."""
    text = clip_text(sentence.text, max_tokens)
    return sentence if text is sentence.text else replace(sentence, text=text)


def _closer(length: int, best: int) -> bool:
    """Whether a sentence of `length` tokens is a better example than the best so far (earlier wins ties)."""
    return abs(length - EXAMPLE_TARGET_TOKENS) < abs(best - EXAMPLE_TARGET_TOKENS)


def length_batches(ids: list[list[int]], batch_size: int, indices: list[int] | None = None) -> list[list[int]]:
    """Sentence indices (all, or the given ones) grouped into batches of similar length (least padding)."""
    chosen = range(len(ids)) if indices is None else indices
    order = sorted(chosen, key=lambda i: (len(ids[i]), i))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def pad_batch(batch: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sentence; padded ids are 0 and are masked out everywhere."""
    n = max(len(t) for t in batch)
    input_ids = torch.zeros(len(batch), n, dtype=torch.long)  # [batch, seq]
    mask = torch.zeros(len(batch), n, dtype=torch.long)  # [batch, seq]
    for row, tokens in enumerate(batch):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return input_ids.to(device), mask.to(device)
