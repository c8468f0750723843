"""Indirect-object-identification (IOI) prompt pairs for patching, after Wang et al. 2022.

A clean prompt names two people, then one of them (the subject, S) gives something to the other (the indirect
object, IO): "When Mary and John went to the store, John gave a drink to" -> " Mary" (answer) vs " John" (wrong).
The corrupt prompt of a pair has the same template and length:

- `abc` (the default, Wang et al.'s "ABC" distribution): the three names replaced by three other names, so the
  corrupt prompt says nothing about which of the clean prompt's names is the answer;
- `s2`: the second mention of the subject replaced by the indirect object (ABB -> ABA), which flips the answer.

Names, places and objects are kept only where each is one token for the model's tokenizer (with its leading
space), so a clean and a corrupt prompt always tokenize to the same length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from attnprobe.errors import AttnprobeError

CORRUPTIONS = ("abc", "s2")
DEFAULT_PAIRS = 64
NAMES = ("Mary", "John", "Tom", "James", "Anna", "Paul", "Sarah", "Mark", "Kate", "David", "Lisa", "Peter", "Emma",
         "Jack", "Laura", "Mike", "Alice", "Bob", "Daniel", "Rose", "Adam", "Grace", "Sam", "Helen", "Steve", "Amy",
         "Robert", "Jane", "Chris", "Lucy", "George", "Sophie", "Frank", "Julia", "Henry", "Ben", "Kelly", "Eric")
PLACES = ("store", "park", "school", "office", "garden", "station", "restaurant", "hospital", "house", "beach")
OBJECTS = ("drink", "book", "ring", "letter", "ball", "gift", "key", "bag", "pen", "card")
# {A}: the indirect object, {B}: the subject (named twice), {place}, {object}; the answer follows the last word
TEMPLATES = (
    "When {A} and {B} went to the {place}, {B} gave a {object} to",
    "When {B} and {A} went to the {place}, {B} gave a {object} to",
    "Then, {A} and {B} had a long day at the {place}. {B} gave a {object} to",
    "Then, {B} and {A} were working at the {place}. {B} decided to give a {object} to",
    "After {A} and {B} went to the {place}, {B} handed a {object} to",
    "While {B} and {A} were at the {place}, {B} passed a {object} to",
)


@dataclass(frozen=True)
class Pair:
    """One prompt pair: the clean and corrupt prompts, the clean run's answer and the wrong name (their first
    tokens are compared at the prompt's last position)."""

    clean: str
    corrupt: str
    answer: str
    wrong: str


def single_tokens(loaded: Any, words: tuple[str, ...]) -> list[str]:
    """The words that are one token for the model's tokenizer when they follow a space (as they do in a prompt)."""
    return [word for word in words if len(loaded.tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1]


def ioi_pairs(loaded: Any, n: int = DEFAULT_PAIRS, corruption: str = "abc", seed: int = 0) -> list[Pair]:
    """`n` IOI pairs for the model's tokenizer, each template in turn, names drawn at random (seeded)."""
    if corruption not in CORRUPTIONS:
        raise AttnprobeError(f"--corruption {corruption!r}: use one of {', '.join(CORRUPTIONS)}")
    if n < 1:
        raise AttnprobeError(f"--n {n}: give at least 1 pair")
    names = single_tokens(loaded, NAMES)
    places, objects = single_tokens(loaded, PLACES), single_tokens(loaded, OBJECTS)
    if len(names) < 5 or not places or not objects:
        raise AttnprobeError(f"the tokenizer of {loaded.spec} has too few of the IOI task's names, places and objects "
                             f"as single tokens ({len(names)} names, {len(places)} places, {len(objects)} objects): "
                             "give your own prompt pairs with --pairs FILE")
    rng = random.Random(seed)
    pairs = []
    for k in range(n):
        template = TEMPLATES[k % len(TEMPLATES)]
        a, b, c, d, e = rng.sample(names, 5)
        fill = {"place": rng.choice(places), "object": rng.choice(objects)}
        clean = template.format(A=a, B=b, **fill)
        corrupt = (abc_prompt(template, (a, b), (c, d, e), fill) if corruption == "abc"
                   else s2_prompt(template, a, b, fill))
        pairs.append(Pair(clean, corrupt, " " + a, " " + b))
    return pairs


def abc_prompt(template: str, clean: tuple[str, str], fresh: tuple[str, str, str], fill: dict[str, str]) -> str:
    """The template with its three name slots (A, B, then B again) filled by three names the clean prompt lacks."""
    marker = template.replace("{A}", "\0A").replace("{B}", "\0B")
    parts = marker.split("\0")
    names = iter(fresh)
    out = [parts[0]]
    for part in parts[1:]:
        out.append(next(names) + part[1:])
    return "".join(out).format(**fill)


def s2_prompt(template: str, a: str, b: str, fill: dict[str, str]) -> str:
    """The template with the subject's second mention replaced by the indirect object (ABB -> ABA)."""
    first, _, rest = template.rpartition("{B}")
    return (first + a + rest).format(A=a, B=b, **fill)
