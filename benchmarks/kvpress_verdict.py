"""The verdict of `make kvpress-check`: does every export attnprobe writes by default, and the pattern `train-pattern`
trains where the bench measured one, keep the held-out needle better than random heads, at every ratio, inside
kvpress? Exit 1 if not (CI runs it after the bench).

    python benchmarks/kvpress_verdict.py outputs/kvpress/kvpress-smollm2.json

Reads only the bench's JSON (no attnprobe, no kvpress), prints each default export's needle and continuation NLL
beside the mean of the random patterns, and fails where a default export's needle NLL is not below that mean. The
continuation is printed, not required (the target is the needle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_EXPORTS = ("analyze", "retrieval")  # what `attnprobe export` writes by default from each kind of run
TRAINED = ("trained",)  # `train-pattern`'s export: judged the same way where the bench measured it


def nll(summary: list[dict], task: str, method: str, ratio: float) -> float | None:
    found = [r["nll"] for r in summary
             if r["task"] == task and r["method"] == method and abs(r["ratio"] - ratio) < 1e-9]
    return found[0] if found else None


def verdict(results: dict) -> list[str]:
    """The failures: (export, ratio) where the needle NLL is not below the random mean (or is missing)."""
    summary, failures = results["summary"], []
    for task in dict.fromkeys(r["task"] for r in summary):
        for ratio in results["settings"]["ratios"]:
            random = nll(summary, task, "random", ratio)
            judged = DEFAULT_EXPORTS + tuple(m for m in TRAINED if any(r["method"] == m for r in summary))
            for method in judged:
                mine = nll(summary, task, method, ratio)
                ok = mine is not None and random is not None and mine < random
                print(f"{task:12s} {method:9s} ratio {ratio:.2f}: {mine if mine is None else round(mine, 3)} vs "
                      f"random mean {random if random is None else round(random, 3)} {'ok' if ok else 'NOT BELOW'}")
                if task == "needle" and not ok:
                    failures.append(f"{method} at ratio {ratio:g}")
    return failures


def main(path: str) -> int:
    failures = verdict(json.loads(Path(path).read_text(encoding="utf-8")))
    if failures:
        print(f"kvpress-check: a default export keeps the needle no better than random heads: {', '.join(failures)}")
        return 1
    print("kvpress-check: every default export keeps the needle better than random heads at every ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
