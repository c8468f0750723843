"""What heads attend to by token: which tokens are punctuation, and the top_tokens.csv table; `encode`, the
tokenizer call every command makes, with the --bos policy; and `token_labels`, each token's text for plots and
reports, as `encode` gave the tokens.

`punctuation` and `duplicate` are row scores (metrics.row_special, metrics.row_duplicate); this module decides
which token ids are punctuation, and turns the corpus sums of the mass each token's key positions received
(accumulate.Accumulator's `tokmass/`, `tokuniform`, `tokcount`) into each head's top tokens by lift.
"""

from __future__ import annotations

import unicodedata
import weakref
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError

MARKERS = ("Ġ", "▁", "Ċ", "##")  # word and line markers of byte-level BPE, SentencePiece and WordPiece
TOP_TOKENS = 10  # top_tokens.csv: tokens per head
MIN_OCCURRENCES = 5  # ... among the tokens that occur at least this often as keys (--top-tokens-min)

BOS_POLICIES = ("auto", "always", "never")  # --bos


def bos_id(tokenizer: Any, config: Any = None) -> int | None:
    """The BOS token id: the tokenizer's, else the model config's (None when neither names one)."""
    token = getattr(tokenizer, "bos_token_id", None)
    if token is None:
        token = getattr(config, "bos_token_id", None)
    return int(token) if isinstance(token, int) and not isinstance(token, bool) and token >= 0 else None


def set_bos(loaded: Any, policy: str) -> None:
    """Set the --bos policy of `loaded` (every `encode` of it follows it); refuse `always` without a BOS token."""
    if policy not in BOS_POLICIES:
        raise AttnprobeError(f"--bos {policy!r}: use one of {', '.join(BOS_POLICIES)}")
    if policy == "always" and bos_id(loaded.tokenizer, loaded.model.config) is None:
        raise AttnprobeError(f"--bos always: the tokenizer of {loaded.spec} names no BOS token (nor does its "
                             "config): use --bos auto or never")
    loaded.bos = policy


def encode(loaded: Any, texts: str | list[str], **kwargs: Any) -> dict[str, Any]:
    """`loaded.tokenizer(texts, add_special_tokens=True, **kwargs)` under the --bos policy (`loaded.bos`):

    - `auto`: what the tokenizer does (GPT-2's adds no BOS, Llama's adds `<s>`, SmolLM2's adds none);
    - `always`: a BOS token first, prepended where the tokenizer did not add one (TransformerLens's
      `prepend_bos=True` default); a truncated sequence stays within `max_length` (its last token goes);
    - `never`: a leading BOS token the tokenizer added is removed (one the text itself spells stays).

    Returns a dict of lists: input_ids, and special_tokens_mask / offset_mapping when asked for, kept aligned (a
    prepended BOS is special, at offsets (0, 0)). A single text gives flat lists, as the tokenizer does."""
    policy = getattr(loaded, "bos", "auto")
    if policy not in BOS_POLICIES:
        raise AttnprobeError(f"--bos {policy!r}: use one of {', '.join(BOS_POLICIES)}")
    asked_mask = kwargs.pop("return_special_tokens_mask", False)
    encoded = loaded.tokenizer(texts, add_special_tokens=True, return_special_tokens_mask=True, **kwargs)
    single = isinstance(texts, str)
    keys = ["input_ids", "special_tokens_mask"] + (["offset_mapping"] if "offset_mapping" in encoded else [])
    rows = {key: [encoded[key]] if single else list(encoded[key]) for key in keys}
    if policy != "auto":
        token = bos_id(loaded.tokenizer, loaded.model.config)
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        for k, ids in enumerate(rows["input_ids"]):
            ids = list(ids)
            added = bool(ids) and token is not None and ids[0] == token and rows["special_tokens_mask"][k][0] == 1
            fix = {key: list(rows[key][k]) for key in keys}
            if policy == "never" and added:
                fix = {key: values[1:] for key, values in fix.items()}
            elif policy == "always" and not added:
                first = {"input_ids": token, "special_tokens_mask": 1, "offset_mapping": (0, 0)}
                fix = {key: [first[key], *values] for key, values in fix.items()}
                if limit is not None and len(fix["input_ids"]) > limit:
                    fix = {key: values[:limit] for key, values in fix.items()}
            for key in keys:
                rows[key][k] = fix[key]
    if not asked_mask:
        keys.remove("special_tokens_mask")
    return {key: rows[key][0] if single else rows[key] for key in keys}


def token_labels(loaded: Any, ids: Any, text: str | None = None) -> list[str]:
    """A label per token id: its span of `text`, so any script reads right. `loaded`: what `encode` takes (a
    LoadedModel, or anything with a `tokenizer`, and a `bos` policy where not auto), whose `encode` gave `ids`.

    With a fast tokenizer and the text the ids came from, token i is labelled with the text from the end of
    the token before it to its own end (a leading space stays with its word, as in GPT-2's `Ġworld`). A
    character that byte-level BPE splits into several tokens (Cyrillic, CJK, emoji) goes to the first of
    them and the others get "" - so the labels of a sentence's tokens join back into the sentence. A special
    token added by the tokenizer, or by the --bos policy, keeps its own name (`<s>`, `[CLS]`). Without offsets
    (a slow tokenizer, no `text`, or ids that `text` does not give) the ids are decoded together, each label
    being what its token adds, never a lone `\ufffd`.
    """
    ids = [int(t) for t in ids]
    spans = _offset_labels(loaded, ids, text) if text is not None else None
    return spans if spans is not None else _decoded_labels(loaded.tokenizer, ids)


def _offset_labels(loaded: Any, ids: list[int], text: str) -> list[str] | None:
    """Labels from the fast tokenizer's character offsets, as `encode` gives them under the --bos policy, or None
    when it has none or they do not fit `ids`."""
    from attnprobe.model import quiet_transformers

    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        with quiet_transformers():
            encoded = encode(loaded, text, return_offsets_mapping=True, return_special_tokens_mask=True)
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return None
    if list(encoded["input_ids"][: len(ids)]) != ids:  # ids of another text
        return None
    labels, done = [], 0  # done: where the text labelled so far ends
    for token, (start, end), special in zip(ids, encoded["offset_mapping"], encoded["special_tokens_mask"]):
        if special and start == end:  # added by the tokenizer or the --bos policy, not in the text
            labels.append(str(tokenizer.convert_ids_to_tokens(token)))
        elif end > done:
            labels.append(text[done:end])
            done = end
        else:  # another piece of a character already labelled
            labels.append("")
    return labels


def _decoded_labels(tokenizer: Any, ids: list[int]) -> list[str]:
    """What each token adds to the decoded text; the pieces of one character label its first token."""
    labels: list[str] = []
    done, pending = "", None  # the text decoded so far; the first token of an unfinished character
    for k, token in enumerate(ids):
        decoded = tokenizer.decode(ids[: k + 1], clean_up_tokenization_spaces=False)
        if decoded.endswith("\ufffd") and k + 1 < len(ids):  # a character split over tokens, not yet whole
            pending = k if pending is None else pending
            labels.append("")
            continue
        added = decoded[len(done):] if decoded.startswith(done) else tokenizer.decode([token])
        if pending is not None:
            labels[pending], added = added, ""
            pending = None
        labels.append(added)
        done = decoded
    return labels


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> punctuation table


def is_punctuation(text: str) -> bool:
    """A token text, once the tokenizer's word markers and spaces are stripped, that is non-empty and all Unicode
    punctuation (categories P*): "," "." "?!" "--" "»"; not "$", "+" (symbols) nor "a," (mixed)."""
    for marker in MARKERS:
        text = text.replace(marker, "")
    text = text.strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def punctuation_table(tokenizer: Any, vocab: int) -> np.ndarray:
    """[vocab] bool: which ids are punctuation (is_punctuation of the id decoded alone); special tokens never are.
    Computed once per tokenizer."""
    cached = _TABLES.get(tokenizer) if _weakable(tokenizer) else None
    if cached is not None and len(cached) >= vocab:
        return cached[:vocab]
    known = size(tokenizer)  # ids past the tokenizer's (padded embeddings) are not punctuation
    texts = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=False)
    table = np.zeros(max(vocab, known), dtype=bool)  # [vocab]
    table[:known] = [is_punctuation(t) for t in texts]
    special = [i for i in getattr(tokenizer, "all_special_ids", ()) if 0 <= i < len(table)]
    table[special] = False
    if _weakable(tokenizer):
        _TABLES[tokenizer] = table
    return table[:vocab]


_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (decided [vocab], table [vocab])


def punctuation_of(tokenizer: Any, ids: np.ndarray, vocab: int) -> np.ndarray:
    """Which of these token ids are punctuation, as `punctuation_table` says: bool, the shape of `ids`.

    Only ids not met before are decoded (a corpus of short sentences meets a small part of the vocabulary, and
    decoding all of a 50k vocabulary costs more than analysing a few hundred sentences); the whole table is used
    when it has been built."""
    whole = _TABLES.get(tokenizer) if _weakable(tokenizer) else None
    if whole is not None and len(whole) >= vocab:
        return whole[ids]
    seen = _SEEN.get(tokenizer) if _weakable(tokenizer) else None
    if seen is None or len(seen[0]) < vocab:
        seen = (np.zeros(vocab, dtype=bool), np.zeros(vocab, dtype=bool))  # decided, punctuation
        special = [i for i in getattr(tokenizer, "all_special_ids", ()) if 0 <= i < vocab]
        seen[0][special] = True  # special tokens never are punctuation
        if _weakable(tokenizer):
            _SEEN[tokenizer] = seen
    decided, table = seen
    new = np.unique(ids[~decided[ids]])  # [ids met for the first time]
    inside = new[new < size(tokenizer)].tolist() if len(new) else []  # ids past the tokenizer's never are
    if inside:
        texts = tokenizer.batch_decode([[i] for i in inside], skip_special_tokens=False)
        table[inside] = [is_punctuation(t) for t in texts]
    decided[new] = True
    return table[ids]


def size(tokenizer: Any) -> int:
    """len(tokenizer), also for a wrapper that hands its attributes through (__getattr__) but defines no __len__."""
    length = getattr(tokenizer, "__len__", None)
    return int(length()) if length is not None else int(getattr(tokenizer, "vocab_size", 0) or 0)


def _weakable(value: Any) -> bool:
    try:
        weakref.ref(value)
    except TypeError:
        return False
    return True


def top_tokens(mass: np.ndarray, uniform: np.ndarray, occurrences: np.ndarray, labels: Any,
               top: int = TOP_TOKENS, min_occurrences: int = MIN_OCCURRENCES) -> pd.DataFrame:
    """top_tokens.csv: per layer and head, the `top` tokens with the highest lift among those that occur at least
    `min_occurrences` times as keys.

    `mass` [vocab, layer, head]: the attention mass the token's key positions received, summed over every real
    query row of the corpus; `uniform` [vocab, layer]: the mass a uniform row over the same visible keys would
    have given them; `occurrences` [vocab]: key positions holding the token. lift = mass / uniform;
    mass_share = mass / the head's total mass. `labels(ids)` gives each token's readable text. Only the rows of
    ids that occur are read (the others are 0, and untouched pages stay unmapped).
    """
    _, layers, heads = mass.shape
    eligible = np.flatnonzero(occurrences >= max(min_occurrences, 1))  # [tokens]
    columns = ["layer", "head", "rank", "token_id", "token", "occurrences", "mass_share", "lift"]
    if not len(eligible):
        return pd.DataFrame(columns=columns)
    total = mass[np.flatnonzero(occurrences > 0)].sum(axis=0)  # [layer, head]: every id that received mass
    picked = np.moveaxis(mass[eligible], 0, -1)  # [layer, head, tokens]
    visible = uniform[eligible].T[:, None, :]  # [layer, 1, tokens]
    with np.errstate(invalid="ignore", divide="ignore"):
        lift = picked / visible  # [layer, head, tokens]
        share = picked / total[..., None]  # [layer, head, tokens]
    lift = np.where(visible > 0, lift, np.nan)
    k = min(top, len(eligible))
    order = np.argsort(-np.nan_to_num(lift, nan=-np.inf), axis=-1, kind="stable")[..., :k]  # [layer, head, k]
    chosen = eligible[order]  # [layer, head, k]: token ids
    layer, head, rank = np.meshgrid(np.arange(layers), np.arange(heads), np.arange(k), indexing="ij")
    ids = chosen.ravel()
    names = dict(zip(np.unique(ids).tolist(), labels(np.unique(ids).tolist())))
    return pd.DataFrame({
        "layer": layer.ravel(), "head": head.ravel(), "rank": rank.ravel() + 1, "token_id": ids,
        "token": [names[i] for i in ids.tolist()], "occurrences": occurrences[ids].astype(np.int64),
        "mass_share": np.take_along_axis(share, order, axis=-1).ravel(),
        "lift": np.take_along_axis(lift, order, axis=-1).ravel(),
    })


def readable(tokenizer: Any) -> Any:
    """labels(ids) for top_tokens: each id decoded alone, its spaces kept visible as they are ("␣" for a space)."""
    known = size(tokenizer)

    def labels(ids: list[int]) -> list[str]:
        texts = tokenizer.batch_decode([[i] for i in ids if i < known], skip_special_tokens=False)[::-1]
        return [texts.pop().replace(" ", "␣").replace("\n", "\\n") if i < known else f"<id {i}>" for i in ids]
    return labels
