"""The circuit tasks (attnprobe.tasks): each task on SmolLM2's real tokenizer (one token per digit) and on a GPT-2-style
byte-level BPE built here (two-digit number tokens), checked against what the prompts say; metric_value against
closed forms; --pairs files read back as the same pairs."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tokenizer

from attnprobe import ioi, tasks
from attnprobe.errors import AttnprobeError
from attnprobe.tokens import encode

WORDS = (*ioi.NAMES, *ioi.PLACES, *ioi.OBJECTS, *tasks.NOUNS, *tasks.LETTERS, "the", "year", "to", "from",
         "lasted", "and", "went", "gave", "a", "What", "is", "capital", "of", "colour", "opposite",
         *(word for _, facts in tasks.QUESTIONS for fact in facts for word in " ".join(fact).split()))


def bpe_tokenizer(folder):
    """A GPT-2-style tokenizer: byte-level BPE with GPT-2's pre-tokenizer, every word of WORDS one token after a
    space (merged letter by letter), every two-digit number one token (numbers starting with 1 merged first, so that
    " 1732" splits as " 17", "32" as in GPT-2), " 11".." 19" one token; <|endoftext|> its BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: k for k, token in enumerate(["<|endoftext|>", *sorted(alphabet)])}
    merges = []

    def add(left: str, right: str) -> None:
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)

    for word in sorted(set(WORDS)):
        for k in range(1, len(word) + 1):
            add("Ġ" + word[: k - 1], word[k - 1]) if k > 1 else add("Ġ", word[0])
    for number in sorted(range(100), key=lambda x: (f"{x:02d}"[0] != "1", x)):
        add(*f"{number:02d}")
    for century in range(11, 20):
        add("Ġ", str(century))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def loaded_of(tokenizer, spec: str, bos: str = "auto"):
    """What the tasks read of a LoadedModel: the tokenizer, its name, the --bos policy, the context and device."""
    return SimpleNamespace(tokenizer=tokenizer, spec=spec, bos=bos, max_length=4096, device=torch.device("cpu"),
                           model=SimpleNamespace(config=None))


@pytest.fixture(scope="module")
def gpt2_bpe(tmp_path_factory):
    return loaded_of(bpe_tokenizer(tmp_path_factory.mktemp("bpe")), "bpe")


@pytest.fixture(scope="module")
def smollm2_tokens():
    """SmolLM2-135M's tokenizer alone: from the suite's converted GGUF folder when another test made it (fast), else
    read from the GGUF file (about 12 s)."""
    from transformers import AutoTokenizer

    from attnprobe.sources import ALIASES, cache_dir, file_sha256, packaged_path

    path = packaged_path(ALIASES["smollm2-135m"])
    folder = cache_dir() / "gguf" / f"{path.stem}-{file_sha256(path)[:16]}"
    if (folder / "tokenizer_config.json").is_file():
        return loaded_of(AutoTokenizer.from_pretrained(folder), "smollm2-135m")
    return loaded_of(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), "smollm2-135m")


@pytest.fixture(params=["gpt2_bpe", "smollm2_tokens"])
def loaded(request):
    return request.getfixturevalue(request.param)


def texts(loaded, ids) -> list[str]:
    return [loaded.tokenizer.decode([i]) for i in ids]


def test_the_bpe_tokenizer_is_gpt2_like(gpt2_bpe):
    """The test's tokenizer splits years and sums as GPT-2 does (else the two-digit branch would go untested)."""
    assert texts(gpt2_bpe, tasks.token_ids(gpt2_bpe, " 1732")) == [" 17", "32"]
    assert texts(gpt2_bpe, tasks.token_ids(gpt2_bpe, "12+35=")) == ["12", "+", "35", "="]
    assert texts(gpt2_bpe, tasks.token_ids(gpt2_bpe, "The war lasted")) == ["T", "h", "e", " war", " lasted"]


@pytest.mark.parametrize("task", tasks.TASKS)
def test_pairs_are_one_length_and_disjoint(loaded, task):
    pairs = tasks.task_pairs(loaded, task, 24, seed=1)
    assert len(pairs) == 24 and len(set(pairs)) > 12
    for bos in ("auto", "always"):
        policy = SimpleNamespace(**{**vars(loaded), "bos": bos})
        for pair in pairs:
            assert len(encode(policy, pair.clean)["input_ids"]) == len(encode(policy, pair.corrupt)["input_ids"])
    for pair in pairs:
        assert pair.clean != pair.corrupt and pair.good and pair.bad and not set(pair.good) & set(pair.bad)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_seeds_reproduce(loaded, task):
    assert tasks.task_pairs(loaded, task, 8, seed=3) == tasks.task_pairs(loaded, task, 8, seed=3)
    assert tasks.task_pairs(loaded, task, 8, seed=3) != tasks.task_pairs(loaded, task, 8, seed=4)


def test_ioi_answers_are_the_names(loaded):
    """good = the name said once (the indirect object), bad = the name said twice (the subject)."""
    for pair in tasks.task_pairs(loaded, "ioi", 12):
        (good,), (bad,) = texts(loaded, pair.good), texts(loaded, pair.bad)
        assert pair.clean.count(good.strip()) == 1 and pair.clean.count(bad.strip()) == 2


def test_greater_than_sets_are_the_later_years(loaded):
    """Two-digit tokens: good = "YY+1".."99", bad = "00".."YY"; one token per digit: good = the digits above YY's
    tens digit, bad = those below it. The corrupt prompt's first year is the century then 01."""
    two_digit = loaded.spec == "bpe"
    for pair in tasks.task_pairs(loaded, "greater-than", 16):
        first, century = re.fullmatch(r"The \w+ lasted from the year (\d{4}) to the year (\d\d)", pair.clean).groups()
        assert first[:2] == century and pair.corrupt == pair.clean.replace(first, century + "01")
        year = int(first[2:])
        if two_digit:
            later, earlier = {f"{y:02d}" for y in range(year + 1, 100)}, {f"{y:02d}" for y in range(year + 1)}
        else:
            later, earlier = {str(d) for d in range(year // 10 + 1, 10)}, {str(d) for d in range(year // 10)}
        assert set(texts(loaded, pair.good)) == later and set(texts(loaded, pair.bad)) == earlier


def calculated(a: str, op: str, b: str) -> int:
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_arithmetic_answers_are_the_results(loaded):
    """Three solved problems (right, the same in both prompts), then the question; good = the first token of the
    clean result, bad = that of the corrupt result, as they follow "="; one operand changed, of the same token
    length."""
    problem = r"(\d\d)([+-])(\d\d)="
    for pair in tasks.task_pairs(loaded, "arithmetic", 16):
        *shots, last = pair.clean.split(", ")
        assert len(shots) == tasks.SHOTS and pair.corrupt.startswith(", ".join(shots) + ", ")
        for shot in shots:
            a, op, b, result = re.fullmatch(problem + r"(\d+)", shot).groups()
            assert calculated(a, op, b) == int(result) > 0
        a, op, b = re.fullmatch(problem, last).groups()
        c, op2, d = re.fullmatch(problem, pair.corrupt.rpartition(", ")[2]).groups()
        assert op == op2 and (a == c) != (b == d)
        clean, corrupt = calculated(a, op, b), calculated(c, op, d)
        assert clean > 0 and corrupt > 0
        (good,), (bad,) = texts(loaded, pair.good), texts(loaded, pair.bad)
        assert str(clean).startswith(good) and str(corrupt).startswith(bad) and good != bad
        assert len(tasks.token_ids(loaded, c if a != c else d)) == len(tasks.token_ids(loaded, a if a != c else b))


def test_multiple_choice_answers_are_the_right_letters(loaded):
    """good = the letter of the option the built-in facts make right; the corrupt prompt holds the same options
    with the right one under another letter; bad = the three other letters."""
    answers = {question.format(subject): answer for question, facts in tasks.QUESTIONS for subject, answer in facts}

    def right_letter(prompt: str) -> str:
        question = prompt.splitlines()[0].removeprefix("Question: ")
        options = dict(re.findall(r"^([A-D])\. (.+)$", prompt, re.M))
        assert len(options) == 4
        return next(letter for letter, option in options.items() if option == answers[question])

    for pair in tasks.task_pairs(loaded, "multiple-choice", 16):
        assert sorted(line[3:] for line in pair.clean.splitlines()[1:5]) == sorted(
            line[3:] for line in pair.corrupt.splitlines()[1:5])
        letter = right_letter(pair.clean)
        assert right_letter(pair.corrupt) != letter
        assert texts(loaded, pair.good) == [" " + letter]
        assert sorted(texts(loaded, pair.bad)) == [" " + x for x in tasks.LETTERS if x != letter]


def test_file_pairs_read_back_the_ioi_task(gpt2_bpe, tmp_path):
    """IOI pairs written as a --pairs file (patch's format) read back as task_pairs' IOI pairs."""
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(vars(p)) for p in ioi.ioi_pairs(gpt2_bpe, 6, "abc", seed=2)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert tasks.file_pairs(gpt2_bpe, path) == tasks.task_pairs(gpt2_bpe, "ioi", 6, seed=2)
    path.write_text(json.dumps({"clean": "a b", "corrupt": "a b c", "answer": " Mary", "wrong": " John"}) + "\n")
    with pytest.raises(AttnprobeError, match="pair 1: the clean prompt is"):
        tasks.file_pairs(gpt2_bpe, path)


def test_refusals(gpt2_bpe, tmp_path):
    """An unknown task, no pairs, a tokenizer without digit or two-digit tokens, overlapping sets: one line each."""
    with pytest.raises(AttnprobeError, match="--task 'sorting': use one of ioi, greater-than"):
        tasks.task_pairs(gpt2_bpe, "sorting", 4)
    with pytest.raises(AttnprobeError, match="--n 0: give at least 1 pair"):
        tasks.task_pairs(gpt2_bpe, "arithmetic", 0)
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path, ["The war lasted from the year to the year ."])  # no number, no letter A-D
    words = loaded_of(AutoTokenizer.from_pretrained(tmp_path), "words")
    with pytest.raises(AttnprobeError, match="neither a token for every two-digit number nor one for every digit"):
        tasks.task_pairs(words, "greater-than", 4)
    with pytest.raises(AttnprobeError, match="does not give the letters A, B, C, D one token each after 'Answer:'"):
        tasks.task_pairs(words, "multiple-choice", 4)
    with pytest.raises(AttnprobeError, match=r"made only 0 of 4 arithmetic pairs in 200 tries .* --pairs FILE"):
        tasks.task_pairs(words, "arithmetic", 4)
    with pytest.raises(AttnprobeError, match="share none"):
        tasks.TaskPair("a", "b", (1, 2), (2,))
    assert tasks.TaskPair("a", "b", [1, torch.tensor(2)], range(3, 5)) == tasks.TaskPair("a", "b", (1, 2), (3, 4))
    with pytest.raises(AttnprobeError, match="metric 'logprob': use one of"):
        tasks.metric_value(torch.zeros(1, 3), [tasks.TaskPair("a", "b", (1,), (2,))], "logprob")


LOG_P = [0.1, 0.2, 0.3, 0.4]  # one pair's probabilities over a vocabulary of 4: its logits are their logarithms


def test_metric_value_closed_form():
    """logit-diff = mean logit of good - mean of bad; prob-diff = p(good) - p(bad); padding adds nothing (even
    beside a logit of -inf at index 0); copies of the pairs keep their leading dimension; the gradient of the
    logit difference is +1/|good| on good and -1/|bad| on bad."""
    pairs = [tasks.TaskPair("x", "y", (1,), (2, 3)), tasks.TaskPair("x", "z", (3, 2), (0,))]
    logits = torch.tensor([[-math.inf, 1.0, 2.0, 4.0], [math.log(p) for p in LOG_P]], requires_grad=True)
    ld = tasks.metric_value(logits, pairs, "logit-diff")
    want = [1.0 - (2.0 + 4.0) / 2, (math.log(0.4) + math.log(0.3)) / 2 - math.log(0.1)]
    torch.testing.assert_close(ld, torch.tensor(want), rtol=0, atol=1e-6)  # float32: a few ulp of numbers near 3
    pd = tasks.metric_value(logits, pairs, "prob-diff")
    e = [0.0, math.e, math.e ** 2, math.e ** 4]
    first = (e[1] - e[2] - e[3]) / sum(e)
    torch.testing.assert_close(pd, torch.tensor([first, 0.4 + 0.3 - 0.1]), rtol=0, atol=1e-6)
    ld.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[0, 1, -0.5, -0.5], [-1, 0, 0.5, 0.5]]))
    copies = tasks.metric_value(torch.stack([logits.detach(), logits.detach() * 2]), pairs, "logit-diff")
    assert copies.shape == (2, 2)
    torch.testing.assert_close(copies[1, 0], torch.tensor(2 * want[0]))
    with pytest.raises(AttnprobeError, match="logits for 2 pairs, but 1 pairs given"):
        tasks.metric_value(logits, pairs[:1], "logit-diff")


def test_metric_value_on_real_task_pairs(gpt2_bpe):
    """Greater-than's prob-diff over its hundred year tokens equals a sum written out per pair."""
    pairs = tasks.task_pairs(gpt2_bpe, "greater-than", 5)
    logits = torch.randn(5, len(gpt2_bpe.tokenizer), generator=torch.Generator().manual_seed(0))  # [pairs, vocab]
    probs = logits.double().softmax(-1)  # [pairs, vocab]
    want = [float(probs[k, list(p.good)].sum() - probs[k, list(p.bad)].sum()) for k, p in enumerate(pairs)]
    got = tasks.metric_value(logits, pairs, "prob-diff").double()  # [pairs]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
