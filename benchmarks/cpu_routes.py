"""Routes to the statistics on a CPU, timed on one layer's attention alone: what a different kernel would give.

Run:  .venv/bin/python benchmarks/cpu_routes.py                      (n = 4096 and 8192, --threads 1,2)
      .venv/bin/python benchmarks/cpu_routes.py --lengths 4096 --threads 1 --reps 3 --json routes.json

The shape is SmolLM2-135M's attention (the 8.4k-token document of the long-document benchmark): queries [1, 9, n, 64],
keys and values [1, 3, n, 64] (grouped-query, 3 KV heads), float32, causal, random inputs. Each route is warmed once at
the same shape (torch.compile's compilation included there, and reported as `first_s`), then timed --reps times: the
median. Every thread count of --threads runs all routes (equal threads), and `default` (torch's own choice on this
machine) runs them again where it differs from those. The load average is printed before and after: the machine is
shared, so compare routes within one thread count and one run, not across runs.

Routes:
  sdpa          - F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True): the output only, the floor;
  fused         - attnprobe's fused path (kernel.fused_attend), what `analyze` runs on a CPU by default, with its
                  default statistics on one document: a special token first, the token classes (punctuation,
                  same-token keys), the received mass read (top_tokens.csv), rows kept for the block bootstrap;
  fused+vw      - the same with the value-weighted scores (analyze's default: every statistic it writes);
  flex-eager    - torch.nn.attention.flex_attention without compiling, the statistics as extra value columns (a value
                  of STATS_WIDTH columns, see below) and return_lse=True (up to --eager-max tokens: eager
                  FlexAttention builds the [head, n, n] scores);
  flex-64       - flex_attention under torch.compile (inductor's C++ template for CPUs), the output only: the compiled
                  template's own floor against aten's SDPA;
  flex-stats    - the same compiled call with every row statistic of the map and of its value-weighted map as extra
                  value columns (STATS_WIDTH in all, per query head): the values, the centred keys (the entropy, via
                  q . sum_j p_ij k_j), the position (mean distance), first key, sink keys, special and punctuation
                  flags, and for the value-weighted map w_j = |f_h(x_j)| times each of those plus w_j ln w_j.
                  Compiled FlexAttention on a CPU does not return the logsumexp in torch 2.13 (inductor's CPU lowering
                  refuses return_lse), so the call carries a sentinel key: its score is set to 0 by a score_mod and its
                  own value column is 1, so that the row's normaliser Z_i = 1 / c_i - 1 and lse_i = ln Z_i (exact while
                  the row's largest score stays under ~87, where exp(-max) underflows float32);
  flex-received - the mass each key receives (top_tokens.csv): a second compiled call with queries and keys swapped
                  and the rows' lse subtracted by a score_mod, whose sentinel gives sum_i p_ij the same way.
A route that reaches analyze's defaults through FlexAttention needs flex-stats + flex-received, plus what neither
carries (previous, self and the +-2 diagonal from the lse, the recent window's band, the same-token keys): the sum of
the two is printed as `flex route (lower bound)`.

Before timing, the flex-stats call's lse, entropy, first-key mass, mean distance and the value-weighted entropy are
checked against a float64 map at 256 tokens (the route is only worth timing if it is right); the largest error is
printed, and a float32 error above CHECK_TOLERANCE stops the script.

Each route's time is also put on the whole model: `rest` times the rest of one SmolLM2 layer at n tokens (the
q/k/v/o projections, the MLP, the norms), and a route's whole-forward ratio is (rest + route) / (rest + sdpa): the
target of 1.5x for the document needs a route whose attention costs at most sdpa + 0.5 (rest + sdpa).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, DIM, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536  # SmolLM2-135M
SINK, WINDOW = 4, 256  # attnprobe's defaults
CHECK_N, CHECK_TOLERANCE = 256, 2e-3  # the float64 check: tokens, largest error allowed (float32 sums of n terms)
STATS_WIDTH = 208  # the flex-stats value: 64 values + 64 keys + 6 flags + 5 weighted flags + 64 weighted keys +
# sentinel, rounded up to a multiple of 16


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def inputs(n: int, seed: int = 0) -> dict:
    """Random q [1, 9, n, 64], k, v [1, 3, n, 64] with logits of a few units, special flags (a BOS), punctuation
    (one id in ten), token ids of a 500-word vocabulary (same-token keys), and each head's value weights
    w [1, 9, n] = |f_h(v_j)| from a random output projection."""
    from attnprobe import values

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, n, DIM, generator=generator)  # [1, head, n, dim]
    k = torch.randn(1, KV_HEADS, n, DIM, generator=generator) + 0.2  # [1, kv head, n, dim]
    v = torch.randn(1, KV_HEADS, n, DIM, generator=generator)  # [1, kv head, n, dim]
    ids = torch.randint(3, 500, (1, n), generator=generator)  # [1, n]
    special = torch.zeros(1, n, dtype=torch.bool)  # [1, n]
    special[:, 0] = True
    punctuation = (ids % 10 == 0) & ~special  # [1, n]
    projection = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False)
    torch.nn.init.normal_(projection.weight, std=0.05, generator=generator)
    factors = values.head_factors(projection, HEADS)  # [head, k, dim]
    w = values.key_norms(v, factors)  # [1, head, n]
    return {"q": q, "k": k, "v": v, "ids": ids, "special": special, "punctuation": punctuation, "factors": factors,
            "w": w}


# ---- the routes -----------------------------------------------------------------------------------------------------


def sdpa(x: dict) -> None:
    F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)


def fused(x: dict, weighted: bool) -> None:
    """attnprobe's fused path on one layer, as analyze calls it on one document (its public kernel entry)."""
    from attnprobe import kernel
    from attnprobe.metrics import TokenClasses, bin_count

    n = x["q"].shape[2]
    info = kernel.Batch(layers={}, last_layer=1, special=x["special"], sink=SINK, window=WINDOW, bins=bin_count(n),
                        budget_bytes=kernel.DEFAULT_BUDGET_MIB * 2**20, block_rows=None, example=None,
                        on_layer=lambda *_: None, keep_rows=True, tokens=TokenClasses(x["ids"], x["punctuation"]))
    sums, _, _ = kernel.fused_attend(x["q"], x["k"], x["v"], None, None, True, info, need_output=True,
                                     factors=x["factors"] if weighted else None)
    _ = sums.received, sums.stacked_means(), sums.stacked_bin_means()  # what analyze reads


def stats_value(x: dict) -> torch.Tensor:
    """flex-stats' value [1, 9, n + 1, STATS_WIDTH] (per query head: the weights differ by head), the sentinel key
    last: columns 0-63 values, 64-127 centred keys, 128 position, 129 first, 130 sink, 131 special, 132 punctuation,
    133 w, 134 w position, 135 w first, 136 w sink, 137 w ln w, 138-201 w keys, 202 the sentinel."""
    q, k, v, w = x["q"], x["k"], x["v"], x["w"]
    n = q.shape[2]
    groups = HEADS // KV_HEADS
    keys = centred(k).repeat_interleave(groups, 1)  # [1, head, n, dim]
    position = torch.arange(n, dtype=torch.float32)  # [n]
    flags = torch.stack([position, (position == 0).float(), (position < SINK).float(), x["special"][0].float(),
                         x["punctuation"][0].float()], dim=-1).expand(1, HEADS, n, 5)  # [1, head, n, 5]
    w1 = w[..., None]  # [1, head, n, 1]
    weighted = torch.cat([w1, w1 * flags[..., :3], torch.xlogy(w1, w1), w1 * keys], dim=-1)  # [1, h, n, 69]
    value = torch.cat([v.repeat_interleave(groups, 1), keys, flags, weighted], dim=-1)  # [1, head, n, 202]
    value = F.pad(value, (0, STATS_WIDTH - value.shape[-1]))  # [1, head, n, STATS_WIDTH]
    sentinel = torch.zeros(1, HEADS, 1, STATS_WIDTH)  # [1, head, 1, width]
    sentinel[..., 202] = 1.0
    return torch.cat([value, sentinel], dim=2)  # [1, head, n + 1, width]


def centred(k: torch.Tensor) -> torch.Tensor:
    """The keys less their mean key [1, kv head, n, dim]: every row's softmax unchanged, its scores and lse smaller
    (as the fused path centres them)."""
    return k - k.mean(dim=2, keepdim=True)


def with_sentinel_key(k: torch.Tensor) -> torch.Tensor:
    return torch.cat([k, torch.zeros(*k.shape[:2], 1, k.shape[-1])], dim=2)  # [1, kv head, n + 1, dim]


def causal_or_sentinel(n: int):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx == n)

    return mask


def sentinel_zero(n: int):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == n, torch.zeros_like(score), score)

    return score_mod


class Flex:
    """The compiled (or eager) FlexAttention calls of the routes, with their block masks built once per length."""

    def __init__(self, compiled: bool):
        from torch.nn.attention.flex_attention import flex_attention

        self.call = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        if compiled:  # each length and each of the three calls is a compilation of flex_attention: past dynamo's
            torch._dynamo.config.recompile_limit = 64  # limit of 8 it would fall back to eager without saying so
        self.masks: dict = {}

    def mask(self, name: str, n: int, m: int, fn):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (name, n, m)
        if key not in self.masks:
            self.masks[key] = create_block_mask(fn, 1, None, n, m, device="cpu")
        return self.masks[key]

    def plain(self, x: dict) -> torch.Tensor:
        n = x["q"].shape[2]
        mask = self.mask("causal", n, n, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        return self.call(x["q"], x["k"], x["v"], block_mask=mask, enable_gqa=True)

    def stats(self, x: dict, value: torch.Tensor, return_lse: bool = False):
        """[1, 9, n, STATS_WIDTH] normalised over the keys and the sentinel (and the lse, eager only)."""
        n = x["q"].shape[2]
        key = with_sentinel_key(centred(x["k"])).repeat_interleave(HEADS // KV_HEADS, 1)  # [1, head, n + 1, dim]
        mask = self.mask("stats", n, n + 1, causal_or_sentinel(n))
        return self.call(x["q"], key, value, score_mod=sentinel_zero(n), block_mask=mask, return_lse=return_lse)

    def received(self, x: dict, lse: torch.Tensor) -> torch.Tensor:
        """sum_i p_ij for every key j [1, 9, n]: queries and keys swapped, lse_i subtracted, a sentinel for the
        normaliser."""
        q, n = x["q"], x["q"].shape[2]
        keys = centred(x["k"]).repeat_interleave(HEADS // KV_HEADS, 1)  # [1, head, n, dim]: the swapped call's queries
        rows = with_sentinel_key(q)  # [1, head, n + 1, dim]: its keys
        ones = torch.zeros(1, HEADS, n + 1, 16)  # [1, head, n + 1, 16]
        ones[:, :, n, 0] = 1.0
        shift = F.pad(lse, (0, 1))  # [1, head, n + 1]

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx == n, torch.zeros_like(score), score - shift[b, h, kv_idx])

        mask = self.mask("received", n, n + 1, lambda b, h, q_idx, kv_idx: (kv_idx >= q_idx) | (kv_idx == n))
        out = self.call(keys, rows, ones, score_mod=score_mod, block_mask=mask)  # [1, head, n, 16]
        c = out[..., 0]
        return (1 - c) / c  # [1, head, n]: Z'_j = sum_i exp(s_ij - lse_i)


def from_stats(out: torch.Tensor, q: torch.Tensor, scale: float) -> dict:
    """The statistics from flex-stats' output [1, 9, n, width] (module docstring's columns)."""
    c = out[..., 202]  # [1, head, n]: 1 / (Z + 1)
    z = (1 - c) / c  # [1, head, n]
    true = out / (1 - c)[..., None]  # [1, head, n, width]: normalised over the real keys
    plogit = scale * (q * true[..., 64:128]).sum(-1)  # [1, head, n]: sum_j p_ij s'_ij
    lse = z.log()  # [1, head, n], of the centred scores
    position = torch.arange(q.shape[2], dtype=torch.float32)  # [n]
    total_w = true[..., 133]  # [1, head, n]: sum_j p_ij w_j
    wlogit = scale * (q * true[..., 138:202]).sum(-1) / total_w  # [1, head, n]: sum_j q_ij s'_ij
    return {"lse": lse, "entropy": lse - plogit, "first": true[..., 129], "distance": position - true[..., 128],
            "vw_entropy": lse + total_w.log() - wlogit - true[..., 137] / total_w, "vw_first": true[..., 135] / total_w}


def oracle(x: dict) -> dict:
    """The same statistics from the float64 map (of the centred keys: the lse is the centred one)."""
    q, k, w = x["q"].double(), x["k"].double(), x["w"].double()
    n = q.shape[2]
    keys = centred(k).repeat_interleave(HEADS // KV_HEADS, 1)  # [1, head, n, dim]
    scores = (q @ keys.transpose(-1, -2)) * DIM**-0.5  # [1, head, n, n]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)  # [1, head, n]
    p = (scores - lse[..., None]).exp()  # [1, head, n, n]
    pw = p * w[:, :, None, :]  # [1, head, n, n]
    qw = pw / pw.sum(-1, keepdim=True)  # [1, head, n, n]
    position = torch.arange(n, dtype=torch.float64)  # [n]
    return {"lse": lse, "entropy": -torch.xlogy(p, p).sum(-1), "first": p[..., 0], "distance": position - p @ position,
            "vw_entropy": -torch.xlogy(qw, qw).sum(-1), "vw_first": qw[..., 0]}


def check(flex: Flex) -> dict:
    """The flex-stats route against the float64 map at CHECK_N tokens: the largest error of each statistic."""
    x = inputs(CHECK_N, seed=1)
    with torch.inference_mode():  # as the timed calls run (another dispatch key set would be another compilation)
        got = from_stats(flex.stats(x, stats_value(x)), x["q"], DIM**-0.5)
    want = oracle(x)
    errors = {name: float((got[name].double() - want[name]).abs().max()) for name in want}
    scale = {"distance": CHECK_N}  # the mean distance is in tokens: its float32 error grows with n
    worst = max(errors[name] / scale.get(name, 1) for name in errors)
    if not worst <= CHECK_TOLERANCE:
        raise SystemExit(f"cpu_routes: the flex-stats route is wrong at {CHECK_N} tokens: {errors}")
    return errors


# ---- timing ---------------------------------------------------------------------------------------------------------


def timed(fn, reps: int) -> dict:
    started = time.perf_counter()
    fn()
    first = time.perf_counter() - started
    runs = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return {"seconds": round(statistics.median(runs), 4), "runs": [round(r, 4) for r in runs],
            "first_s": round(first, 2)}


def rest_of_layer(n: int):
    """One SmolLM2 layer without its attention: the norms, the q/k/v/o projections and the MLP at n tokens."""
    hidden = torch.randn(n, HIDDEN)
    linears = [torch.nn.Linear(HIDDEN, out, bias=False) for out in (HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM)]
    o_proj = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False)
    gate, up = (torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False) for _ in range(2))
    down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
    norm = torch.nn.RMSNorm(HIDDEN)

    def run() -> None:
        with torch.inference_mode():
            normed = norm(hidden)  # [n, hidden]
            q = linears[0](normed)  # [n, heads x dim]
            _ = linears[1](normed), linears[2](normed)
            h = hidden + o_proj(q)  # [n, hidden]
            m = norm(h)  # [n, hidden]
            _ = h + down(F.silu(gate(m)) * up(m))

    return run


def routes(n: int, reps: int, eager_max: int, flex: Flex, eager: Flex) -> dict:
    x = inputs(n)
    value = stats_value(x)
    found: dict = {}
    with torch.inference_mode():
        found["sdpa"] = timed(lambda: sdpa(x), reps)
        found["fused"] = timed(lambda: fused(x, False), reps)
        found["fused+vw"] = timed(lambda: fused(x, True), reps)
        if n <= eager_max:
            found["flex-eager"] = timed(lambda: eager.stats(x, value, return_lse=True), reps)
        found["flex-64"] = timed(lambda: flex.plain(x), reps)
        found["flex-stats"] = timed(lambda: flex.stats(x, value), reps)
        lse = from_stats(flex.stats(x, value), x["q"], DIM**-0.5)["lse"]
        found["flex-received"] = timed(lambda: flex.received(x, lse), reps)
        found["rest"] = timed(rest_of_layer(n), reps)
    floor, rest = found["sdpa"]["seconds"], found["rest"]["seconds"]
    found["flex route (lower bound)"] = {"seconds": round(found["flex-stats"]["seconds"]
                                                          + found["flex-received"]["seconds"], 4)}
    for name, run in found.items():
        if name != "rest":
            run["attention_ratio"] = round(run["seconds"] / floor, 2)
            run["layer_ratio"] = round((rest + run["seconds"]) / (rest + floor), 2)
    found["needed_for_1.5x"] = round(floor + 0.5 * (rest + floor), 4)  # the most a route's attention may cost
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192", help="tokens, comma-separated")
    parser.add_argument("--threads", default="1,2", help="torch threads, comma-separated; `default` is added")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per route (the median is its time)")
    parser.add_argument("--eager-max", type=int, default=4096, help="the longest length eager FlexAttention runs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    threads = [int(t) for t in args.threads.split(",") if t]
    threads += [] if default_threads in threads else [default_threads]
    result = {"torch": torch.__version__, "cpus": os.cpu_count(), "default_threads": default_threads,
              "load_average_before": load_average(), "shape": f"[1, {HEADS}, n, {DIM}], {KV_HEADS} KV heads, float32, "
                                                            "causal", "runs": {}}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch's default threads {default_threads}; load average "
          f"{result['load_average_before']} (1, 5, 15 min)", flush=True)
    flex, eager = Flex(compiled=True), Flex(compiled=False)
    torch.set_num_threads(threads[0])
    for name, way in (("eager", eager), ("compiled", flex)):
        result[f"check_{name}"] = check(way)
        print(f"flex-stats ({name}) against a float64 map at {CHECK_N} tokens: largest errors "
              f"{ {k: f'{v:.1e}' for k, v in result[f'check_{name}'].items()} }", flush=True)
    for count in threads:
        torch.set_num_threads(count)
        for n in (int(t) for t in args.lengths.split(",") if t):
            found = routes(n, args.reps, args.eager_max, flex, eager)
            result["runs"][f"{n} tokens, {count} thread{'s' if count > 1 else ''}"] = found
            print(f"\n{n} tokens, {count} thread(s){' (torch default)' if count == default_threads else ''}, "
                  f"load average {load_average()}; one layer's attention, median of {args.reps}:", flush=True)
            for name, run in found.items():
                if isinstance(run, dict) and name != "rest":
                    print(f"  {name:<26} {run['seconds']:>8.3f} s  {run['attention_ratio']:>5.2f}x sdpa  "
                          f"layer {run['layer_ratio']:.2f}x" + (f"  (first {run['first_s']:.1f} s)"
                                                               if "first_s" in run else ""), flush=True)
            print(f"  {'rest of the layer':<26} {found['rest']['seconds']:>8.3f} s; a route reaches 1.5x of the "
                  f"layer with attention of at most {found['needed_for_1.5x']:.3f} s "
                  f"({found['needed_for_1.5x'] / found['sdpa']['seconds']:.2f}x sdpa)", flush=True)
    result["load_average_after"] = load_average()
    print(f"\nload average after: {result['load_average_after']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
