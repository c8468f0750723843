"""Prompt-pair tasks for circuit discovery, generated offline and tokenizer-aware, and the metric that scores them.

A task pair is a clean and a corrupt prompt of one length (under the model's tokenizer and --bos policy) and two
disjoint sets of token ids read at the last position: `good` (what the clean prompt should make likely) and `bad`
(what it should not). Both runs of a pair are scored with the clean pair's sets.

- `ioi` (Wang et al. 2022): ioi.ioi_pairs with the ABC corruption; good = the indirect object's name, bad = the
  subject's; logit difference.
- `greater-than` (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17", the noun and the century
  (11..17) varied; the corrupt prompt's first year ends in 01 ("1701"). The metric is a difference of probability
  mass, p(later) - p(not later), over the token that comes next, read from how the tokenizer splits years:
    - two-digit year tokens (GPT-2: " 1732" -> " 17", "32"): the next token is the year's last two digits; good =
      the tokens "YY+1".."99", bad = "00".."YY" (the paper's metric);
    - one token per digit (SmolLM2, Llama 3: " 1732" -> " ", "1", "7", "3", "2"): the next token is the tens digit
      D of the year; good = the digits above D (the year is later whatever follows), bad = the digits below D (it is
      earlier); D itself decides nothing yet and is in neither set. YY is drawn from 10..89 so that both sets hold
      a digit.
  A tokenizer that splits years in neither way is refused.
- `arithmetic`: "12+35=" or "47-15=" (two-digit operands, a positive result) after three solved problems of the
  same kind ("61+20=81, 75-33=42, 18+40=58, 12+35="), which show a small model the format (without them SmolLM2-135M
  hardly tells the answers apart); the corrupt prompt changes one operand of the last problem to another of the
  same token length; good = the first token of the clean answer as it follows "=", bad = the first token of the
  corrupt prompt's answer; only pairs whose two tokens differ; logit difference.
- `multiple-choice`: "Question: What is the capital of France?\\nA. Berlin\\nB. Paris\\nC. Rome\\nD. Madrid\\nAnswer:"
  from a small built-in list of capitals, colours and opposites; the corrupt prompt holds the same options in an
  order where the right one has another letter; good = the right letter (" B"), bad = the three others (their mean
  logit). It needs a model that ties an answer to its letter: SmolLM2-135M scores the clean and the corrupt
  prompts alike.

Every word a template fills in is kept only where it is one token after a space (as ioi.single_tokens), every
answer token is the one the tokenizer gives it after its prompt, and a candidate pair whose prompts tokenize to
different lengths is skipped: a tokenizer that leaves too few is refused in one line naming --pairs FILE.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnprobe import ioi
from attnprobe.errors import AttnprobeError
from attnprobe.patching import first_token, read_pairs, tokenize_pairs
from attnprobe.tokens import encode

TASKS = ("ioi", "greater-than", "arithmetic", "multiple-choice")
METRIC = {"ioi": "logit-diff", "greater-than": "prob-diff", "arithmetic": "logit-diff",
          "multiple-choice": "logit-diff"}
KINDS = ("logit-diff", "prob-diff")
FILE_METRIC = "logit-diff"  # --pairs FILE: the answer's first token against the wrong one's
TRIES = 50  # candidates drawn per pair asked for before a task gives up

# Hanna et al. 2023's nouns (a subset) and centuries
NOUNS = ("war", "dynasty", "siege", "reign", "rule", "expedition", "journey", "pilgrimage", "campaign", "conflict",
         "occupation", "rebellion", "trial", "voyage", "alliance", "treaty", "plague", "project", "marriage", "tour",
         "study", "strike", "quest", "riot", "invasion", "kingdom", "relationship", "program", "friendship", "process")
CENTURIES = tuple(range(11, 18))
GREATER_THAN = "The {noun} lasted from the year {century}{year} to the year {century}"
CORRUPT_YEAR = 1  # the paper's corruption: 17YY -> 1701

OPERATIONS = ("+", "-")
OPERANDS = range(10, 100)
SHOTS, SHOT_SEPARATOR = 3, ", "  # solved problems before the question: "12+35=47, 63-15=48, 20+31=51, 44+12="

LETTERS = ("A", "B", "C", "D")
QUESTIONS = (  # (question, [(subject, answer)]): a subject's distractors are the other subjects' answers
    ("What is the capital of {}?", [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"),
                                    ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Russia", "Moscow"),
                                    ("Egypt", "Cairo"), ("England", "London"), ("Greece", "Athens"),
                                    ("China", "Beijing"), ("Canada", "Ottawa"), ("Austria", "Vienna")]),
    ("What colour is {}?", [("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
                            ("blood", "red"), ("a banana", "yellow")]),
    ("What is the opposite of {}?", [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"),
                                     ("happy", "sad"), ("light", "dark"), ("early", "late"), ("full", "empty")]),
)
CHOICE = "Question: {question}\n{options}\nAnswer:"


@dataclass(frozen=True)
class TaskPair:
    """One pair: the clean and corrupt prompts (one length in tokens) and the token ids read at the last position,
    `good` (the clean prompt's answer) and `bad` (what it is compared with), disjoint and not empty."""

    clean: str
    corrupt: str
    good: tuple[int, ...]
    bad: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("good", "bad"):  # ids as a tuple of ints (hashable: metric_value keeps one index per list)
            object.__setattr__(self, name, tuple(int(token) for token in getattr(self, name)))
        if not self.good or not self.bad or set(self.good) & set(self.bad):
            raise AttnprobeError(f"the pair {self.clean!r}: good tokens {self.good} and bad tokens {self.bad} must "
                                 "both be given and share none")


# ---- the tasks -------------------------------------------------------------------------------------------


def task_pairs(loaded: Any, task: str, n: int, seed: int = 0) -> list[TaskPair]:
    """`n` pairs of `task` for the model's tokenizer, drawn at random (the same seed gives the same pairs); score
    them with metric_value(..., METRIC[task])."""
    if task not in TASKS:
        raise AttnprobeError(f"--task {task!r}: use one of {', '.join(TASKS)} (or --pairs FILE)")
    if n < 1:
        raise AttnprobeError(f"--n {n}: give at least 1 pair")
    return MAKERS[task](loaded, n, seed)


def file_pairs(loaded: Any, path: str | Path) -> list[TaskPair]:
    """The pairs of a --pairs file (patch's JSON lines: clean, corrupt, answer, wrong), checked as patch checks them;
    good = the answer's first token, bad = the wrong answer's (score them with FILE_METRIC)."""
    pairs = read_pairs(path)
    prompts = tokenize_pairs(loaded, pairs)
    return [TaskPair(p.clean, p.corrupt, (good,), (bad,))
            for p, good, bad in zip(pairs, prompts.answer.tolist(), prompts.wrong.tolist())]


def ioi_task(loaded: Any, n: int, seed: int) -> list[TaskPair]:
    """IOI pairs (ABC corruption): good = the indirect object's name, bad = the subject's."""
    pairs = ioi.ioi_pairs(loaded, n, "abc", seed)
    return [TaskPair(p.clean, p.corrupt, (first_token(loaded, p.answer, "the IOI answer"),),
                     (first_token(loaded, p.wrong, "the IOI subject"),)) for p in pairs]


def greater_than_task(loaded: Any, n: int, seed: int) -> list[TaskPair]:
    """Greater-than pairs (module docstring): two-digit year tokens or one token per digit, as the tokenizer has."""
    nouns = ioi.single_tokens(loaded, NOUNS)
    split = year_split(loaded)
    years = [(c, y) for c in CENTURIES for y in split.years if year_fits(loaded, split, c, y)]
    if not nouns or not years:
        raise AttnprobeError(f"the tokenizer of {loaded.spec} makes no greater-than prompt ({len(nouns)} nouns as "
                             f"single tokens, {len(years)} years split as the task needs): give your own prompt "
                             "pairs with --pairs FILE")
    rng = random.Random(seed)

    def draw() -> TaskPair | None:
        noun = rng.choice(nouns)
        century, year = rng.choice(years)
        clean = GREATER_THAN.format(noun=noun, century=century, year=f"{year:02d}")
        corrupt = GREATER_THAN.format(noun=noun, century=century, year=f"{CORRUPT_YEAR:02d}")
        good, bad = split.later(year), split.earlier(year)
        return TaskPair(clean, corrupt, good, bad) if same_length(loaded, clean, corrupt) else None

    return drawn(loaded, "greater-than", n, draw)


def arithmetic_task(loaded: Any, n: int, seed: int) -> list[TaskPair]:
    """Two-operand addition and subtraction pairs after SHOTS solved problems (the same in both prompts), whose
    clean and corrupt answers start with different tokens."""
    rng = random.Random(seed)

    def draw() -> TaskPair | None:
        shots = "".join(f"{p}{solve(p)}{SHOT_SEPARATOR}" for p in (problem(rng)[0] for _ in range(SHOTS)))
        task, a, op, b = problem(rng)
        which = rng.randrange(2)  # the operand the corrupt prompt changes: 0 the first, 1 the second
        others = [x for x in OPERANDS if x not in (a, b) and (op == "+" or (x < a if which else x > b))]
        if not others:
            return None
        c = rng.choice(others)
        clean, corrupt = shots + task, shots + (f"{a}{op}{c}=" if which else f"{c}{op}{b}=")
        good = next_token(loaded, clean, str(solve(clean)))
        bad = next_token(loaded, clean, str(solve(corrupt)))
        if good is None or bad is None or good == bad or not same_length(loaded, clean, corrupt):
            return None
        return TaskPair(clean, corrupt, (good,), (bad,))

    return drawn(loaded, "arithmetic", n, draw)


def problem(rng: random.Random) -> tuple[str, int, str, int]:
    """A random problem "a+b=" or "a-b=" (a > b) of two-digit operands: (text, a, operation, b)."""
    op = rng.choice(OPERATIONS)
    a, b = rng.sample(OPERANDS, 2)
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)  # a - b > 0
    return f"{a}{op}{b}=", a, op, b


def solve(prompt: str) -> int:
    """The result of an arithmetic prompt's last problem, "a+b=" or "a-b=" (after any solved ones)."""
    body = prompt.rpartition(SHOT_SEPARATOR)[2].rstrip("=")
    op = "+" if "+" in body else "-"
    a, b = (int(x) for x in body.split(op))
    return a + b if op == "+" else a - b


def multiple_choice_task(loaded: Any, n: int, seed: int) -> list[TaskPair]:
    """Four-option questions; the corrupt prompt moves the right option to another letter."""
    letters = [next_token(loaded, CHOICE.format(question="?", options=""), " " + letter) for letter in LETTERS]
    if None in letters or len(set(letters)) < len(LETTERS):
        raise AttnprobeError(f"the tokenizer of {loaded.spec} does not give the letters {', '.join(LETTERS)} one "
                             "token each after 'Answer:': give your own prompt pairs with --pairs FILE")
    rng = random.Random(seed)

    def draw() -> TaskPair | None:
        question, facts = rng.choice(QUESTIONS)
        subject, answer = rng.choice(facts)
        options = [answer, *rng.sample([a for _, a in facts if a != answer], len(LETTERS) - 1)]
        rng.shuffle(options)
        right = options.index(answer)
        moved = rng.choice([k for k in range(len(LETTERS)) if k != right])
        shuffled = list(options)
        shuffled[right], shuffled[moved] = shuffled[moved], shuffled[right]
        clean, corrupt = (choice_prompt(question.format(subject), o) for o in (options, shuffled))
        here = [next_token(loaded, clean, " " + letter) for letter in LETTERS]
        if here != letters or not same_length(loaded, clean, corrupt):
            return None
        return TaskPair(clean, corrupt, (letters[right],), tuple(t for k, t in enumerate(letters) if k != right))

    return drawn(loaded, "multiple-choice", n, draw)


def choice_prompt(question: str, options: list[str]) -> str:
    """The multiple-choice prompt: the question, one lettered option a line, then "Answer:"."""
    lines = "\n".join(f"{letter}. {option}" for letter, option in zip(LETTERS, options))
    return CHOICE.format(question=question, options=lines)


MAKERS = {"ioi": ioi_task, "greater-than": greater_than_task, "arithmetic": arithmetic_task,
          "multiple-choice": multiple_choice_task}


# ---- the tokenizer ---------------------------------------------------------------------------------------


def token_ids(loaded: Any, text: str) -> list[int]:
    """The text's token ids without special tokens (a piece of a prompt)."""
    return list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def next_token(loaded: Any, prompt: str, answer: str) -> int | None:
    """The token that follows the prompt's tokens when prompt + answer is tokenized whole (the answer's first token
    as the model would read it there); None where the answer changes how the prompt itself tokenizes."""
    head, whole = token_ids(loaded, prompt), token_ids(loaded, prompt + answer)
    return whole[len(head)] if len(whole) > len(head) and whole[: len(head)] == head else None


def same_length(loaded: Any, clean: str, corrupt: str) -> bool:
    """Whether the two prompts are one length under the tokenizer and the --bos policy (tokens.encode)."""
    return len(encode(loaded, clean)["input_ids"]) == len(encode(loaded, corrupt)["input_ids"])


def drawn(loaded: Any, task: str, n: int, draw: Any) -> list[TaskPair]:
    """`n` pairs from `draw` (a candidate, or None when it does not fit the tokenizer), up to TRIES per pair."""
    pairs: list[TaskPair] = []
    for _ in range(TRIES * n):
        pair = draw()
        if pair is not None:
            pairs.append(pair)
            if len(pairs) == n:
                return pairs
    raise AttnprobeError(f"the tokenizer of {loaded.spec} made only {len(pairs)} of {n} {task} pairs in "
                         f"{TRIES * n} tries (prompts of unequal length or answers it splits differently): give "
                         "your own prompt pairs with --pairs FILE")


@dataclass(frozen=True)
class YearSplit:
    """How the tokenizer continues " 17" into a year: `tokens[k]` is the token of k ("00".."99" when `digits` is 2,
    "0".."9" when it is 1) as it follows the century; `years`: the YY a clean prompt may take."""

    digits: int
    tokens: tuple[int, ...]
    years: range

    def next_of(self, year: int) -> int:
        """The value of the token that follows the century in year YY: YY itself, or its tens digit."""
        return year if self.digits == 2 else year // 10

    def later(self, year: int) -> tuple[int, ...]:
        """The next tokens that make the second year later than the first (YY)."""
        return self.tokens[self.next_of(year) + 1:]

    def earlier(self, year: int) -> tuple[int, ...]:
        """The next tokens that make it not later: "00".."YY" (two digits), the tens digits below YY's (one)."""
        cut = self.next_of(year) + 1 if self.digits == 2 else self.next_of(year)
        return self.tokens[:cut]


def year_split(loaded: Any) -> YearSplit:
    """Whether the tokenizer has a token for every two-digit number or for every digit (two-digit tokens first)."""
    for digits, years in ((2, range(2, 99)), (1, range(10, 90))):
        pieces = [token_ids(loaded, f"{k:0{digits}d}") for k in range(10 ** digits)]
        if all(len(p) == 1 for p in pieces) and len({p[0] for p in pieces}) == len(pieces):
            return YearSplit(digits, tuple(p[0] for p in pieces), years)
    raise AttnprobeError(f"the tokenizer of {loaded.spec} has neither a token for every two-digit number nor one "
                         "for every digit: greater-than cannot be scored on it; give your own prompt pairs with "
                         "--pairs FILE")


def year_fits(loaded: Any, split: YearSplit, century: int, year: int) -> bool:
    """Whether " {century}{year}" and " {century}01" both tokenize as " {century}" then the year's tokens of
    `split` (so that the token after the prompt's century is the one the metric reads)."""
    head = token_ids(loaded, f" {century}")
    for yy in (year, CORRUPT_YEAR):
        want = [split.tokens[yy]] if split.digits == 2 else [split.tokens[yy // 10], split.tokens[yy % 10]]
        if token_ids(loaded, f" {century}{yy:02d}") != head + want:
            return False
    return True


# ---- the metric ------------------------------------------------------------------------------------------


def metric_value(logits: Tensor, pairs: list[TaskPair], kind: str) -> Tensor:
    """The metric of each pair from the logits at its last position, [..., pairs, vocab] -> [..., pairs] float32,
    differentiable: `logit-diff` = mean logit over `good` - mean logit over `bad`; `prob-diff` = the softmax
    probability summed over `good` - summed over `bad`. Leading dimensions (copies of the pairs) are kept."""
    if kind not in KINDS:
        raise AttnprobeError(f"metric {kind!r}: use one of {', '.join(KINDS)}")
    if logits.shape[-2] != len(pairs):
        raise AttnprobeError(f"logits for {logits.shape[-2]} pairs, but {len(pairs)} pairs given")
    good, good_weight, bad, bad_weight = answer_index(tuple(pairs), logits.device)  # [pairs, width] each
    logits = logits.float()  # [..., pairs, vocab]
    scores = logits.log_softmax(-1) if kind == "prob-diff" else logits  # [..., pairs, vocab]

    def picked(index: Tensor, weight: Tensor) -> Tensor:  # index, weight [pairs, width] -> [..., pairs]
        values = scores.gather(-1, index.expand(*scores.shape[:-1], index.shape[-1]))  # [..., pairs, width]
        values = values.exp() if kind == "prob-diff" else values / weight.sum(-1, keepdim=True)  # means
        return torch.where(weight > 0, values, 0.0).sum(-1)  # [..., pairs]; padding adds 0, even beside -inf

    return picked(good, good_weight) - picked(bad, bad_weight)  # [..., pairs]


@functools.lru_cache(maxsize=16)
def answer_index(pairs: tuple[TaskPair, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pairs' good and bad token ids padded to one width (index 0 on padding) with a 1/0 weight on real
    entries: (good [pairs, width], weight [pairs, width], bad [pairs, width'], weight [pairs, width']), built once
    per list of pairs and device."""

    def padded(rows: list[tuple[int, ...]]) -> tuple[Tensor, Tensor]:
        width = max(len(r) for r in rows)
        index = torch.zeros(len(rows), width, dtype=torch.long)  # [pairs, width]
        weight = torch.zeros(len(rows), width)  # [pairs, width]
        for k, row in enumerate(rows):
            index[k, : len(row)] = torch.tensor(row, dtype=torch.long)
            weight[k, : len(row)] = 1.0
        return index.to(device), weight.to(device)

    return (*padded([p.good for p in pairs]), *padded([p.bad for p in pairs]))
