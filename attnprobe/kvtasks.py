"""What a KV-cache compressor must keep: the sequences `ablate --method streaming` scores, per task and client.

Two tasks, each a list of token sequences with, per sequence, the first token scored and (for kvpress) where the
context ends:

- `text`: the documents of the corpus. Under the `duo-attention` client (streaming heads restricted at every
  position, as DuoAttention's own inference runs) every next token is scored. Under `kvpress` (the context prefilled
  with full attention, then compressed) what changes is what comes *after* the context, so each document is split:
  its last `continuation` tokens are scored and the context ends one token before them (that token is fed as the
  first of the continuation, as kvpress's pipeline feeds a question; every scored token is then predicted by a query
  after the context).
- `needle`: `attnprobe retrieval`'s prompts (the needle hidden at each depth of a haystack context of each length,
  then the question), followed by the needle itself as the answer; the answer's tokens are scored (teacher-forced).
  For kvpress the context ends where the question begins, as a kvpress user passes context and question apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnprobe.errors import AttnprobeError
from attnprobe.model import LoadedModel

CLIENTS = ("kvpress", "duo-attention")  # whose streaming heads `ablate --method streaming` models
KVPRESS_VERSION = "0.5.5"  # the kvpress release whose DuoAttentionPress semantics the kvpress client follows
TASKS = ("both", "text", "needle")
CONTINUATION = 64  # kvpress text task: the tokens scored after each document's context
NEEDLE_LENGTHS = (1000, 2000)  # needle task: prompt tokens (those that fit the model)


@dataclass
class Sequences:
    """The sequences of every task, measured together; per sequence its task, first scored token and context."""

    ids: list[np.ndarray] = field(default_factory=list)
    task: list[str] = field(default_factory=list)
    first: list[int] = field(default_factory=list)  # the first token scored (1: every next token)
    context: list[int | None] = field(default_factory=list)  # kvpress: the context's length; None: every position
    trials: list[dict[str, Any]] = field(default_factory=list)  # the needle prompts: length, depth, needle span
    skipped: dict[str, int] = field(default_factory=dict)  # per task, sequences too short to score

    def add(self, ids: Any, task: str, first: int, context: int | None) -> None:
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.task.append(task)
        self.first.append(int(first))
        self.context.append(None if context is None else int(context))

    def of(self, task: str) -> list[int]:
        return [k for k, t in enumerate(self.task) if t == task]


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise AttnprobeError(f"{option} {value!r}: use one of {', '.join(choices)}")


def tasks_of(task: str) -> tuple[str, ...]:
    """The tasks `--task` names, in the order they are measured and reported."""
    check_choice("--task", task, TASKS)
    return ("text", "needle") if task == "both" else (task,)


def check_continuation(continuation: int) -> None:
    from attnprobe import limits

    limits.check_whole("--continuation", continuation, 1, limits.MAX_POSITIONS, CONTINUATION)


def add_text(found: Sequences, ids: list[Any], client: str, continuation: int) -> None:
    """The corpus's documents as the text task: every next token (duo-attention), or the last `continuation`
    tokens after a context (kvpress); a document too short for that is skipped and counted."""
    for tokens in ids:
        n = len(tokens)
        if client == "duo-attention":
            if n >= 2:
                found.add(tokens, "text", 1, None)
            continue
        if n < continuation + 2:  # a context of at least one token, then the fed token, then the scored ones
            found.skipped["text"] = found.skipped.get("text", 0) + 1
            continue
        context = n - continuation - 1
        found.add(tokens, "text", context + 1, context)


def add_needle(found: Sequences, loaded: LoadedModel, haystack: str, client: str, *, lengths: list[int] | None,
               depths: list[float], needle: str, question: str) -> None:
    """`attnprobe retrieval`'s prompt at every length and depth, then the needle as the answer (scored)."""
    from attnprobe import retrieval as rt

    parts = rt.prompt_parts(loaded, needle, question)
    answer = answer_ids(loaded, needle)
    lengths = rt.fitting_lengths(loaded, None if lengths is None else list(lengths), len(answer), NEEDLE_LENGTHS)
    hay = rt.haystack_ids(loaded, haystack, max(lengths))
    for length in lengths:
        for depth in depths:
            prompt, start, end = rt.build_prompt(hay, parts.needle, parts.tail, parts.prefix, length, depth,
                                                 parts.periods)
            context = len(prompt) - len(parts.tail)  # the question begins here
            found.add(prompt + answer, "needle", len(prompt), context if client == "kvpress" else None)
            found.trials.append({"length": length, "depth": float(depth), "needle_start": start, "needle_end": end,
                                 "context_tokens": context, "answer_tokens": len(answer)})


def answer_ids(loaded: LoadedModel, needle: str) -> list[int]:
    """The answer scored after the question: the needle's sentence, after a space (as "Answer: The best ...")."""
    from attnprobe.model import quiet_transformers

    with quiet_transformers():
        ids = list(loaded.tokenizer(" " + needle.strip(), add_special_tokens=False)["input_ids"])
    if not ids:
        raise AttnprobeError(f"--needle {needle!r} gives no tokens: pass a sentence")
    return ids


def read_haystack(haystack: str | Path | None, corpus: str | Path | None) -> tuple[str, str | None]:
    """The needle task's haystack text and its name: --haystack, else the corpus file."""
    from attnprobe import retrieval as rt

    source = haystack if haystack is not None else corpus
    if source is None:
        raise AttnprobeError("the needle task needs a haystack: pass --haystack FILE (a long text)")
    return rt.read_haystack(source), str(source)
