"""Retrieval heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

A needle sentence is put into a long haystack at several depths of contexts of several lengths, and a question after
it asks for the needle. While the answer is decoded one token at a time, a query head scores 1/len(needle) at a step
when its top-1 attended key lies in the needle's span and that key's token is the token generated at this step: the
head copied it from the needle. A trial's score is the sum over the steps, in [0, 1]. Under greedy decoding only the
trials where the model copied the needle count (ROUGE-1 recall of the answer's tokens against the needle's of at least
COPY_MIN_RECALL, as Wu et al. keep only runs scoring above 50); `forced` decoding feeds the needle's own tokens as the
answer, which needs no model that can copy and is deterministic.

The prompt, up to its last token, is prefilled once through the model's SDPA attention where the architecture allows
it (no n x n map; eager otherwise) into the model's KV cache. Then each step runs one token with eager attention,
whose single new row [heads, keys] per layer gives each head's top-1 key. The prompt's last token is a decoding
step, so the first answer token is scored too and a head that copies the whole needle scores 1 (as in Wu et al.'s
code, which prefills `input_ids[:, :-1]`). Where the protocol differs from their code (the needle's exact span, the
whole needle, the stop, token-level recall): docs/kv-cache.md, "Against Wu et al.'s code"."""

from __future__ import annotations

import hashlib
import inspect
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from attnprobe import __version__
from attnprobe.bootstrap import DEFAULT_RESAMPLES, interval, poisson_weights, resampled_means
from attnprobe.corpus import read_text_file
from attnprobe.errors import AttnprobeError
from attnprobe.layer_progress import OnLayer, reporter, watching
from attnprobe.model import LoadedModel, quiet_transformers
from attnprobe.naming import counted

DEFAULT_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
DEFAULT_QUESTION = "What is the best thing to do in San Francisco?"
PROMPT_TAIL = "\n\nQuestion: {question}\nAnswer:"  # after the context
DEFAULT_LENGTHS = (1000, 2000, 4000, 8000)  # prompt tokens; those past the model's context are left out
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)  # percent of the context before the needle
DECODES = ("greedy", "forced")
COPY_MIN_RECALL = 0.5  # a greedy answer copied the needle when it holds at least half the needle's tokens
HAYSTACK_CHARS_PER_TOKEN = 16  # read at most this many characters of the haystack per token needed


@dataclass
class Trial:
    """One prompt: its ids, the needle's span, the answer decoded after it and each head's score."""

    length: int  # prompt tokens
    depth: float  # percent of the context before the needle
    ids: list[int]  # the prompt
    start: int  # needle span: ids[start:end]
    end: int
    answer: list[int]  # the decoded (or forced) answer tokens, one per step
    predicted: list[int]  # the model's greedy token at each step (= answer under greedy decoding)
    hits: np.ndarray  # [layer, head]: steps at which the head's top-1 key was a needle token equal to the answer's
    recall: float  # ROUGE-1 recall of the answer's tokens (greedy) or the share of steps predicted (forced)
    copied: bool
    mass: np.ndarray | None = None  # [layer, head]: mean over the steps of the row's weights summed over the needle

    @property
    def scores(self) -> np.ndarray:
        """[layer, head]: hits / needle length, Wu et al.'s per-trial retrieval score."""
        return self.hits / (self.end - self.start)


@dataclass
class Retrieval:
    heads: pd.DataFrame  # layer, head, kv_head, mean, ci_low, ci_high, trials (empty when no trial counts)
    per_trial: dict[str, list[float]]  # {"L-H": [score per counted trial]}, Wu et al.'s head_score JSON
    info: dict[str, Any]
    trials: list[Trial] = field(default_factory=list)


def top1_hits(rows: Tensor, ids: Tensor, start: int, end: int, token: int) -> Tensor:
    """[layer, head] bool: the head's top-1 key lies in [start, end) and holds `token`.

    `rows` [layer, head, keys]: each head's attention row of one query; `ids` [keys]: the token at each key. A tie goes
    to the first key (torch.argmax), as Wu et al.'s `topk(1)`."""
    top = rows.argmax(dim=-1)  # [layer, head]
    return (top >= start) & (top < end) & (ids[top] == token)


def needle_mass(rows: Tensor, start: int, end: int) -> Tensor:
    """[layer, head] float64: each head's attention weight summed over the needle's keys [start, end) (keys a
    sliding-window layer no longer holds, -1 in `rows`, count 0)."""
    return rows[..., start:end].clamp(min=0).sum(dim=-1).double()


def rouge1_recall(answer: list[int], needle: list[int]) -> float:
    """Share of the needle's tokens (with repeats) that the answer holds: ROUGE-1 recall on token ids."""
    overlap = Counter(answer) & Counter(needle)
    return sum(overlap.values()) / max(len(needle), 1)


@dataclass(frozen=True)
class PromptParts:
    """The token pieces of a needle prompt: the BOS token (under --bos), the needle, the question tail, and the
    tokens that end a sentence (where the needle may go)."""

    prefix: list[int]
    needle: list[int]
    tail: list[int]
    periods: set[int]


def prompt_parts(loaded: LoadedModel, needle: str, question: str) -> PromptParts:
    from attnprobe.probe import special_frame

    prefix, _ = special_frame(loaded)  # the BOS token, under --bos
    with quiet_transformers():
        needle_ids = list(loaded.tokenizer(needle, add_special_tokens=False)["input_ids"])
        tail_ids = list(loaded.tokenizer(PROMPT_TAIL.format(question=question), add_special_tokens=False)["input_ids"])
        periods = set(loaded.tokenizer(".", add_special_tokens=False)["input_ids"])
    if not needle_ids:
        raise AttnprobeError(f"--needle {needle!r} gives no tokens: pass a sentence")
    return PromptParts(prefix, needle_ids, tail_ids, periods)


def haystack_ids(loaded: LoadedModel, haystack: str, longest: int) -> list[int]:
    """The haystack's first tokens, enough for a context of `longest` tokens (build_prompt repeats them if short)."""
    with quiet_transformers():
        ids = list(loaded.tokenizer(haystack[: longest * HAYSTACK_CHARS_PER_TOKEN], add_special_tokens=False)
                   ["input_ids"])
    if not ids:
        raise AttnprobeError("--haystack gives no tokens: pass a long text")
    return ids


def build_prompt(haystack: list[int], needle: list[int], tail: list[int], prefix: list[int], length: int,
                 depth: float, periods: set[int]) -> tuple[list[int], int, int]:
    """prefix + context with the needle inserted at `depth` percent + tail, `length` tokens in all; returns (ids,
    needle start, needle end). The context is the haystack's first tokens (repeated if it is short); the needle goes
    after the last sentence end (a token in `periods`) at or before the depth, as Wu et al. insert it, or at the
    depth itself when the context before it holds none."""
    budget = length - len(prefix) - len(needle) - len(tail)
    if budget < 1:
        raise AttnprobeError(f"--lengths {length} leaves no room for the haystack beside the needle and question "
                             f"({len(prefix) + len(needle) + len(tail)} tokens): use longer lengths")
    context = (haystack * (budget // len(haystack) + 1))[:budget]
    point = int(round(budget * depth / 100))
    cut = point
    while cut > 0 and context[cut - 1] not in periods:
        cut -= 1
    point = cut if cut > 0 else point
    ids = prefix + context[:point] + needle + context[point:] + tail
    start = len(prefix) + point
    return ids, start, start + len(needle)


def _cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes the KV cache by (`cache` from transformers 5.24, `past_key_values`)."""
    parameters = inspect.signature(inspect.unwrap(type(model).forward)).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    """The KV cache a forward returned: `cache` from transformers 5.24 (reading `past_key_values` there logs a
    deprecation), `past_key_values` before."""
    return output["cache"] if "cache" in output else output.past_key_values


def prefill(loaded: LoadedModel, ids: list[int], on_layer: OnLayer | None = None) -> tuple[Any, str]:
    """The KV cache of `ids`, computed with SDPA where the model allows it (no n x n map), else eager; returns
    (cache, the attention that ran). `on_layer`: told each layer done, for a prompt of more than LONG_TOKENS."""
    model = loaded.model
    before = model.config._attn_implementation
    path = "sdpa"
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError, NotImplementedError):
        path = "eager"
    try:
        input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)  # [1, n]
        with warnings.catch_warnings(), quiet_transformers():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renames past_key_values
            with watching(model, len(ids), on_layer):
                out = model(input_ids=input_ids, use_cache=True)
    finally:
        model.set_attn_implementation(before)
    return _cache_of(out), path


def decode_step(loaded: LoadedModel, cache: Any, token: int, keys: int) -> tuple[Tensor, Tensor, Any]:
    """One token through the model with eager attention and the cache, `keys` tokens in all with it.

    Returns the rows [layer, head, keys] of its attention over every position (-1 at the keys a sliding-window
    cache no longer holds), its last hidden state [hidden] and the cache."""
    model = loaded.model
    input_ids = torch.tensor([[token]], dtype=torch.long, device=loaded.device)  # [1, 1]
    with warnings.catch_warnings(), quiet_transformers():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(input_ids=input_ids, use_cache=True, output_attentions=True, **{_cache_argument(model): cache})
    if not out.attentions or any(a is None for a in out.attentions):
        raise AttnprobeError(f"{loaded.spec} returns no attention weights on a decoding step: it cannot be scored")
    rows = out.attentions[0].new_full((len(out.attentions), out.attentions[0].shape[1], keys), -1.0,
                                      dtype=torch.float32)  # [layer, head, keys]: -1 where a layer kept no key
    for layer, weights in enumerate(out.attentions):
        rows[layer, :, keys - weights.shape[-1]:] = weights[0, :, -1, :].float()  # its cache holds the last keys
    return rows, out.last_hidden_state[0, -1], _cache_of(out)


@torch.inference_mode()
def run_trial(loaded: LoadedModel, ids: list[int], start: int, end: int, decode: str, length: int = 0,
              depth: float = 0.0, on_layer: OnLayer | None = None) -> tuple[Trial, str]:
    """Prefill ids[:-1], then decode len(needle) steps from the prompt's last token; returns the trial and the
    prefill's attention."""
    needle = ids[start:end]
    cache, path = prefill(loaded, ids[:-1], on_layer) if len(ids) > 1 else (None, "none")
    sequence = torch.tensor(ids, dtype=torch.long, device=loaded.device)  # [keys], grows by one per step
    eos = _eos_ids(loaded)
    token = ids[-1]
    hits = torch.zeros(loaded.num_layers, loaded.num_heads, dtype=torch.long, device=loaded.device)  # [layer, head]
    mass = torch.zeros(loaded.num_layers, loaded.num_heads, dtype=torch.float64, device=loaded.device)
    answer: list[int] = []
    predicted: list[int] = []
    for step in range(len(needle)):
        rows, hidden, cache = decode_step(loaded, cache, token, len(sequence))
        guess = int(loaded.lm_head(hidden).argmax()) if loaded.lm_head is not None else -1
        token = needle[step] if decode == "forced" else guess
        predicted.append(guess)
        answer.append(token)
        hits += top1_hits(rows, sequence, start, end, token).long()
        mass += needle_mass(rows, start, end)
        sequence = torch.cat([sequence, sequence.new_tensor([token])])
        if decode == "greedy" and token in eos:
            break
    if decode == "forced":
        recall = float(np.mean([g == t for g, t in zip(predicted, answer)])) if loaded.lm_head is not None else 0.0
    else:
        recall = rouge1_recall(answer, needle)
    trial = Trial(length, depth, list(ids), start, end, answer, predicted, hits.cpu().numpy(), recall,
                  recall >= COPY_MIN_RECALL, (mass / max(len(answer), 1)).cpu().numpy())
    return trial, path


def _eos_ids(loaded: LoadedModel) -> set[int]:
    found = {getattr(loaded.tokenizer, "eos_token_id", None), getattr(loaded.model.config, "eos_token_id", None)}
    flat: set[int] = set()
    for value in found:
        flat.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(v) for v in flat if isinstance(v, int)}


def check_text(option: str, value: str | None) -> None:
    """A --needle or --question: None takes the default; an empty or blank text is refused (it would hide, or ask
    for, nothing)."""
    if value is not None and not value.strip():
        raise AttnprobeError(f"{option} {value!r} is {'empty' if not value else 'blank'}: pass a sentence, or leave "
                             f"{option} out for the default")


def check_settings(lengths: list[int], depths: list[float], decode: str, resamples: int) -> None:
    if decode not in DECODES:
        raise AttnprobeError(f"--decode {decode!r}: use greedy or forced")
    if not lengths or any(n < 2 for n in lengths):
        raise AttnprobeError(f"--lengths {','.join(map(str, lengths))}: give whole numbers of 2 tokens or more")
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise AttnprobeError(f"--depths {','.join(f'{d:g}' for d in depths)}: give percents between 0 and 100")
    if resamples < 1:
        raise AttnprobeError(f"--resamples {resamples} is below 1: use 1 or more (default {DEFAULT_RESAMPLES})")


def distinct(values: list | tuple | None, option: str) -> tuple[list | None, list[str]]:
    """`values` with each repeat dropped (the first kept, in order; None stays None), and a note naming the repeats.
    A repeated length or depth is the same prompt again, one trial copied: counted as another trial it would narrow
    the intervals, which resample the trials, by copies of one."""
    if values is None:
        return None, []
    kept = list(dict.fromkeys(values))
    if len(kept) == len(values):
        return kept, []
    repeated = [v for v in kept if list(values).count(v) > 1]
    return kept, [f"{option} {','.join(f'{v:g}' for v in values)} repeats {', '.join(f'{v:g}' for v in repeated)}: "
                  "each is run once (a repeat is the same trial again, and the intervals would resample copies of "
                  "it)"]


def read_haystack(path: str | Path) -> str:
    """The haystack file's text (UTF-8, not empty), read as analyze reads a corpus (one line where it cannot be)."""
    return read_text_file(path, "--haystack")


def fitting_lengths(loaded: LoadedModel, lengths: list[int] | None, steps: int,
                    defaults: tuple[int, ...] = DEFAULT_LENGTHS) -> list[int]:
    """The lengths asked for (default: those of `defaults` that fit), each with room for the `steps` answer tokens
    in the model's context."""
    room = loaded.max_length - steps
    if lengths is None:
        fit = [n for n in defaults if n <= room]
        if not fit:
            raise AttnprobeError(f"{loaded.spec} takes {loaded.max_length} tokens, too few for the default lengths "
                                 f"with a {steps}-token answer: pass --lengths up to {max(room, 0)}")
        return fit
    too_long = [n for n in lengths if n > room]
    if too_long:
        raise AttnprobeError(f"--lengths {too_long[0]} does not fit {loaded.spec}'s {loaded.max_length} tokens with a "
                             f"{steps}-token answer: use lengths up to {max(room, 0)}")
    return list(lengths)


def retrieval(
    loaded: LoadedModel, haystack: str, *, lengths: list[int] | None = None, depths: list[float] = DEFAULT_DEPTHS,
    needle: str = DEFAULT_NEEDLE, question: str = DEFAULT_QUESTION, decode: str = "greedy",
    resamples: int = DEFAULT_RESAMPLES, seed: int = 0, haystack_name: str | None = None, progress: Any = None,
) -> Retrieval:
    """Every (length, depth) trial of Wu et al.'s protocol on `loaded` (a decoder, loaded with its LM head for greedy
    decoding); per query head the mean score over the counted trials with a 95% Poisson-bootstrap interval.
    `progress(trials done, trials)` after each trial; one that takes a `within` keyword is also told each layer of a
    prompt's prefill (layer_progress.Within) while it runs, for prompts of more than layer_progress.LONG_TOKENS."""
    started = time.perf_counter()
    if not loaded.causal:
        raise AttnprobeError(f"{loaded.spec} is an encoder: it decodes nothing, so it has no retrieval heads")
    if decode == "greedy" and loaded.lm_head is None:
        raise AttnprobeError("greedy decoding needs the LM head: load the model with load_model(..., lm_head=True)")
    check_settings(list(lengths or DEFAULT_LENGTHS), list(depths), decode, resamples)
    lengths, merged = distinct(lengths, "--lengths")
    depths, merged_depths = distinct(depths, "--depths")
    check_text("--needle", needle)
    check_text("--question", question)
    parts = prompt_parts(loaded, needle, question)
    needle_ids = parts.needle
    lengths = fitting_lengths(loaded, lengths, len(needle_ids))
    hay_ids = haystack_ids(loaded, haystack, max(lengths))
    trials, paths = [], set()
    for length in lengths:
        for depth in depths:
            ids, start, end = build_prompt(hay_ids, needle_ids, parts.tail, parts.prefix, length, depth, parts.periods)
            trial, path = run_trial(loaded, ids, start, end, decode, length, depth,
                                    reporter(progress, len(trials), len(lengths) * len(depths)))
            trials.append(trial)
            paths.add(path)
            if progress is not None:
                progress(len(trials), len(lengths) * len(depths))
    counted = [t for t in trials if decode == "forced" or t.copied]
    heads, per_trial = tabulate(counted, loaded.num_kv_heads, resamples, seed)
    info = {
        "attnprobe_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": _model_record(loaded),
        "bos": loaded.bos,
        "haystack": {"path": haystack_name, "sha256": hashlib.sha256(haystack.encode("utf-8")).hexdigest(),
                     "tokens_read": len(hay_ids)},
        "needle": needle, "question": question, "needle_tokens": len(needle_ids), "decode": decode,
        "lengths": lengths, "depths": [float(d) for d in depths],
        "prefill": sorted(paths), "resamples": resamples, "seed": seed,
        "copy_min_recall": COPY_MIN_RECALL,
        "trials_total": len(trials), "trials_copied": sum(t.copied for t in trials), "trials_scored": len(counted),
        "trials": [_trial_record(loaded, t) for t in trials],
        "device": str(loaded.device), "dtype": loaded.dtype,
        "wall_seconds": round(time.perf_counter() - started, 3),
    }
    info["notes"] = merged + merged_depths + notes(info)
    return Retrieval(heads, per_trial, info, trials)


def tabulate(trials: list[Trial], kv_heads: int, resamples: int, seed: int) -> tuple[pd.DataFrame, dict]:
    """retrieval_heads.csv and the {"L-H": [scores]} JSON from the counted trials (empty without any).
    `needle_mass`: each head's attention mass on the needle while the answer is decoded, the mean over the counted
    trials of each trial's mean over its steps (the tie-break of `attnprobe export`)."""
    columns = ["layer", "head", "kv_head", "mean", "ci_low", "ci_high", "trials", "needle_mass"]
    if not trials:
        return pd.DataFrame(columns=columns), {}
    scores = np.stack([t.scores for t in trials])  # [trial, layer, head]
    _, layers, heads = scores.shape
    resampled = resampled_means(scores, poisson_weights(range(len(trials)), resamples, seed))  # [resample, l*h]
    low, high = interval(resampled)
    layer, head = np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij")
    frame = pd.DataFrame({
        "layer": layer.ravel(), "head": head.ravel(), "kv_head": head.ravel() // (heads // kv_heads),
        "mean": scores.mean(axis=0).ravel(), "ci_low": np.asarray(low).ravel(), "ci_high": np.asarray(high).ravel(),
        "trials": len(trials),
        "needle_mass": np.stack([t.mass for t in trials]).mean(axis=0).ravel() if all(t.mass is not None
                                                                                      for t in trials) else np.nan,
    })
    per_trial = {f"{la}-{h}": [float(v) for v in scores[:, la, h]] for la in range(layers) for h in range(heads)}
    return frame, per_trial


def notes(info: dict[str, Any]) -> list[str]:
    """What a reader must know before reading the table as findings."""
    found = []
    if info["decode"] == "greedy" and info["trials_scored"] == 0:
        found.append(f"the model copied the needle in none of the {info['trials_total']} trials (ROUGE-1 recall below "
                     f"{COPY_MIN_RECALL:g}): no retrieval scores; a model this small may not copy at all, so run "
                     "again with --decode forced (the needle fed as the answer) or with a larger model")
    elif info["decode"] == "greedy" and info["trials_scored"] < info["trials_total"]:
        found.append(f"the scores count the {info['trials_scored']} of {info['trials_total']} trials in which the "
                     "model copied the needle, as Wu et al. do")
    if info["trials_scored"] and info["trials_scored"] < 10:
        found.append(f"only {counted(info['trials_scored'], 'trial')}: the 95% intervals are rough; add --lengths or "
                     "--depths")
    return found


def _model_record(loaded: LoadedModel) -> dict[str, Any]:
    """analyze's model record, with the weights fingerprint that run.json has too (`ablate --pattern` and export's
    attnprobe.json check the model by it)."""
    from attnprobe.records import model_record, model_weights

    return {**model_record(loaded), "weights": model_weights(loaded)}


def _trial_record(loaded: LoadedModel, trial: Trial) -> dict[str, Any]:
    return {"length": trial.length, "depth": trial.depth, "tokens": len(trial.ids), "needle_start": trial.start,
            "needle_end": trial.end, "answer": loaded.tokenizer.decode(trial.answer), "recall": round(trial.recall, 6),
            "copied": bool(trial.copied)}
