"""DuoAttention's training samples: several passkeys hidden in a haystack, then a question for each, answered.

`attnprobe train-pattern` trains on what DuoAttention trains on (mit-han-lab/duo-attention, duo_attn/data.py,
`MultiplePasskeyRetrievalDataset`): a long text (the haystack) with `passkeys` needles put in at random depths, each
"Remember this sequence of words, it's the {ordinal} passkey to the vault: " and a passkey of `words` random words
of the NATO alphabet, then, after the text, for each passkey in turn the question "Based on the content of the book,
what is the {ordinal} passkey to the vault?\\nPasskey: " and the passkey itself. The supervised span (DuoAttention's
`labels`, where the distillation loss is taken) is that whole block of questions and answers.

Laid out as data.py lays it out:

    [BOS] "This is a very long story book: <book> " haystack-with-needles " </book>.\\n\\n" questions-and-answers

each needle between two "\\n\\n" separators at token position int(len(haystack) x depth), the depths drawn without
replacement from `depth_points` evenly spaced depths in [min_depth, max_depth] and sorted; the haystack is the
haystack text's first tokens (data.py's `haystack_tokens[:context_length]`: every sample reads the same text, only
its needles, their depths and the length change). Where attnprobe differs, and why (docs/kv-cache.md, "Train a
pattern"): a sample's length is its whole length in tokens (DuoAttention's `context_length` counts the haystack's
tokens alone, its needles and questions come on top); the passkey is tokenized after a space, as a word following
"vault:" is; the prompt does not begin with the literal text `<|im_start|>` (a chat token of none of the models
DuoAttention trained); "Remeber" is spelt "Remember"; no padding to a multiple of 16 (its block-sparse kernel's).

Every sample is a function of (seed, step) alone (`sample_at`), so a resumed run draws the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnprobe.errors import AttnprobeError

ALPHABET = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
            "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
            "whiskey", "xray", "yankee", "zulu")  # data.py's PASSKEY_ALPHABET
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
            "nineteenth", "twentieth")  # data.py's ORDINAL_NUMBERS: at most 20 passkeys
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault:"
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey:"
OPENING = "This is a very long story book: <book> "
CLOSING = " </book>.\n\n"
SEPARATOR = "\n\n"
MIN_DEPTH, MAX_DEPTH = 0.05, 0.95  # scripts/train.sh's --min/max_needle_depth_ratio
DEPTH_POINTS = 1000  # scripts/train.sh's --depth_ratio_num_intervals


@dataclass(frozen=True)
class Pieces:
    """The token pieces every sample is built of."""

    prefix: list[int]  # BOS (under --bos) and the opening
    closing: list[int]
    separator: list[int]
    needles: list[list[int]]  # per ordinal: the needle's words before the passkey
    questions: list[list[int]]  # per ordinal: the question before the passkey
    words: list[list[int]]  # per word of ALPHABET: its tokens after a space
    haystack: list[int]  # the haystack's first tokens


@dataclass(frozen=True)
class Sample:
    ids: np.ndarray  # [n] token ids
    span: np.ndarray  # [n] bool: the questions and answers (where the loss is taken)
    depths: tuple[float, ...]  # where the needles went (share of the haystack before each)
    passkeys: tuple[tuple[int, ...], ...]  # per needle, the words drawn (indices into ALPHABET)


def pieces(tokenizer, prefix: list[int], haystack: str, longest: int, passkeys: int) -> Pieces:
    """Tokenize the fixed parts and enough of the haystack for samples of `longest` tokens. `prefix`: the BOS
    token(s) the model's BOS policy puts first (retrieval.prompt_parts' `prefix`)."""
    from attnprobe.model import quiet_transformers

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    with quiet_transformers():
        hay = encode(haystack[: longest * 16])  # at most 16 characters a token, as retrieval reads a haystack
        return Pieces(prefix + encode(OPENING), encode(CLOSING), encode(SEPARATOR),
                      [encode(NEEDLE.format(ordinal=o)) for o in ORDINALS[:passkeys]],
                      [encode(QUESTION.format(ordinal=o)) for o in ORDINALS[:passkeys]],
                      [encode(" " + word) for word in ALPHABET], hay)


def longest_overhead(parts: Pieces, words: int) -> int:
    """The most tokens a sample can take beyond its haystack (every passkey of the longest words)."""
    word = max(len(w) for w in parts.words)
    per_key = 2 * len(parts.separator) + word * words * 2 + len(parts.separator)
    return (len(parts.prefix) + len(parts.closing) + sum(len(n) for n in parts.needles)
            + sum(len(q) for q in parts.questions) + per_key * len(parts.needles))


def check_lengths(parts: Pieces, lengths: tuple[int, ...], words: int, haystack_name: str) -> None:
    """Every length leaves room for some haystack, and the haystack has enough tokens for the longest."""
    from attnprobe.naming import counted

    overhead = longest_overhead(parts, words)
    short = [n for n in lengths if n - overhead < 1]
    if short:
        keys = f"{counted(len(parts.needles), 'passkey')} of {counted(words, 'word')}"
        raise AttnprobeError(f"--lengths {short[0]} leaves no room for the haystack: {keys} with their questions "
                             f"take up to {overhead} tokens; use longer --lengths, or fewer --passkeys or "
                             "--passkey-words")
    needed = max(lengths) - len(parts.prefix) - len(parts.closing)
    if len(parts.haystack) < needed:
        raise AttnprobeError(f"the haystack {haystack_name} has {len(parts.haystack)} tokens, too short for --lengths "
                             f"{max(lengths)} (up to {needed} needed): pass a longer --haystack FILE, or shorter "
                             "--lengths")


def length_at(lengths: tuple[int, ...], seed: int, step: int) -> int:
    """The length of step `step` (0-based): the lengths in a new random order each pass over them, as DuoAttention's
    DataLoader(shuffle=True) visits its context lengths."""
    epoch, within = divmod(step, len(lengths))
    order = np.random.default_rng([seed, 1, epoch]).permutation(len(lengths))
    return int(lengths[int(order[within])])


def sample_at(parts: Pieces, lengths: tuple[int, ...], words: int, seed: int, step: int,
              min_depth: float = MIN_DEPTH, max_depth: float = MAX_DEPTH, depth_points: int = DEPTH_POINTS) -> Sample:
    """The sample of step `step`: its length, depths and passkeys drawn from (seed, step) alone."""
    length = length_at(lengths, seed, step)
    rng = np.random.default_rng([seed, 2, step])
    count = len(parts.needles)
    grid = np.linspace(min_depth, max_depth, depth_points)
    depths = np.sort(grid[rng.permutation(depth_points)[:count]])  # data.py: randperm, first count, sorted
    keys = [tuple(int(w) for w in rng.integers(0, len(ALPHABET), words)) for _ in range(count)]
    answers = [[t for w in key for t in parts.words[w]] for key in keys]
    questions = [t for q, a in zip(parts.questions, answers) for t in q + a + parts.separator]
    inserted = [t for k in range(count) for t in parts.separator + parts.needles[k] + answers[k] + parts.separator]
    room = length - len(parts.prefix) - len(parts.closing) - len(questions) - len(inserted)
    if room < 1 or room > len(parts.haystack):
        raise ValueError(f"a sample of {length} tokens has room for {room} haystack tokens of "
                         f"{len(parts.haystack)}: check_lengths first")
    hay = parts.haystack[:room]
    context: list[int] = []
    last = 0
    for k, depth in enumerate(depths):  # data.py's _insert_needle
        point = int(len(hay) * depth)
        context += hay[last:point] + parts.separator + parts.needles[k] + answers[k] + parts.separator
        last = point
    context += hay[last:]
    head = parts.prefix + context + parts.closing
    ids = np.asarray(head + questions, dtype=np.int64)  # [n]
    span = np.zeros(len(ids), dtype=bool)  # [n]
    span[len(head):] = True
    return Sample(ids, span, tuple(float(d) for d in depths), tuple(keys))


def default_haystack() -> tuple[str, str]:
    """The haystack when --haystack is not given: the Python language reference's topics that every CPython ships
    for `help()` (pydoc_data.topics, PSF licence; ~465,000 characters in Python 3.11), in the order of their names;
    and its name in words. Not a licence text: kvpress-check holds the MPL-2.0 out as its haystack."""
    import sys

    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise AttnprobeError("this Python has no pydoc_data (the documentation help() reads), the default "
                             "haystack: pass --haystack FILE (a long text)") from None
    text = "\n\n".join(topics[name].strip() for name in sorted(topics))
    version = ".".join(str(v) for v in sys.version_info[:3])
    return text, f"pydoc_data.topics (the Python {version} language reference)"


def read_haystack(path: Path | None) -> tuple[str, str]:
    """--haystack's text and name, or the default haystack's."""
    if path is None:
        return default_haystack()
    from attnprobe import retrieval

    return retrieval.read_haystack(path), str(path)
