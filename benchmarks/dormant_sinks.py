"""Are the dormant sinks the sinks a model needs least? Checks the extended scheme's dormant rule against `ablate`.

Run:  .venv/bin/python benchmarks/dormant_sinks.py                 (~10 min on 2 busy cores; ablate is most of it)
      .venv/bin/python benchmarks/dormant_sinks.py --reuse         (only the tables, from the files already there)

Runs, as a user would, `attnprobe analyze`, `attnprobe classify --scheme extended` and `attnprobe ablate
--no-pruning` (zero ablation of every head) on smollm2-135m over corpora/sentences.txt, into --out. Then prints:
  1. how output_norm_ratio (a head's output_norm over its layer's median) is spread among sinks and among the
     other heads: the threshold --dormant-max-output-ratio is chosen from this;
  2. for a few thresholds, how many sinks are dormant, how many other heads fall below it too, and the median
     ablation loss_change of dormant sinks against the other sinks;
  3. the dormant sinks at the default threshold, each with its first-token mass, raw and value-weighted, its
     output_norm_ratio, its loss_change and its kl;
  4. the value-weighted scores against the raw ones: means over heads and over sinks, and the loudest heads.
docs/classification.md and docs/metrics.md quote this script's output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7)


def attnprobe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "attnprobe", *args], check=True, cwd=ROOT)


def main() -> None:
    from attnprobe import defaults

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default=str(ROOT / "corpora" / "sentences.txt"))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "dormant-smollm2")
    parser.add_argument("--reuse", action="store_true", help="use the analyze and ablate results already in --out")
    args = parser.parse_args()
    out = str(args.out)
    if not (args.reuse and (args.out / "heads.csv").is_file()):
        attnprobe("analyze", "--model", args.model, "--corpus", args.corpus, "--out", out)
    attnprobe("classify", "--out", out, "--scheme", "extended")
    if not (args.reuse and (args.out / "importance.csv").is_file()):
        attnprobe("ablate", "--model", args.model, "--corpus", args.corpus, "--out", out, "--no-pruning")
    report(args.out, defaults.DORMANT_MAX_OUTPUT_RATIO)


def report(out: Path, default: float) -> None:
    import numpy as np
    import pandas as pd

    heads = pd.read_csv(out / "heads.csv")
    types = pd.read_csv(out / "head_types.csv")
    importance = pd.read_csv(out / "importance.csv")[["layer", "head", "loss_change", "kl"]]
    table = types.merge(heads[["layer", "head", "first_token_unforced_vw"]], on=["layer", "head"])
    table = table.merge(importance, on=["layer", "head"])
    if "output_norm_ratio" not in table:
        raise SystemExit(f"{out / 'heads.csv'} has no output_norm: run analyze with its value-weighted scores")
    table["ratio"] = table["output_norm_ratio"]
    sinks = table[table["head_type"].isin(["sink", "dormant"])]
    others = table[~table["head_type"].isin(["sink", "dormant"])]
    quantiles = (0.0, 0.01, 0.05, 0.25, 0.5)
    print(f"{len(table)} heads, {len(sinks)} sinks (extended scheme; dormant included)\n")
    print("output_norm_ratio quantiles " + " ".join(f"{q:>6}" for q in quantiles))
    for name, group in (("sinks", sinks), ("other heads", others)):
        print(f"{name:<27} " + " ".join(f"{v:>6.3f}" for v in np.quantile(group["ratio"], quantiles)))
    print(f"\n{'':>32} {'median loss_change':>24} {'median kl':>22}")
    print(f"{'threshold':>9} {'dormant':>8} {'others below':>13} {'dormant':>11} {'other sinks':>12} {'dormant':>10} "
          f"{'other sinks':>11}")
    for threshold in THRESHOLDS:
        quiet = sinks["ratio"] < threshold
        print(f"{threshold:>9} {int(quiet.sum()):>8} {int((others['ratio'] < threshold).sum()):>13} "
              f"{sinks.loc[quiet, 'loss_change'].median():>11.4f} {sinks.loc[~quiet, 'loss_change'].median():>12.4f} "
              f"{sinks.loc[quiet, 'kl'].median():>10.4f} {sinks.loc[~quiet, 'kl'].median():>11.4f}")
    dormant = sinks[sinks["ratio"] < default].sort_values("ratio")
    print(f"\ndormant sinks at --dormant-max-output-ratio {default} (loss_change: nats per token, zero ablation)")
    print(dormant[["layer", "head", "first_token_unforced", "first_token_unforced_vw", "ratio", "loss_change",
                   "kl"]].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    rest = sinks[sinks["ratio"] >= default]
    for measure in ("loss_change", "kl"):
        print(f"median {measure}: dormant sinks {dormant[measure].median():.4f} ({len(dormant)}), other sinks "
              f"{rest[measure].median():.4f} ({len(rest)}), other heads {others[measure].median():.4f} "
              f"({len(others)})")
    weighted(heads, table)


def weighted(heads, table) -> None:
    """The value-weighted scores against the raw ones."""
    every = heads.set_index(["layer", "head"])
    sinks = every.loc[table[table["head_type"].isin(["sink", "dormant"])].set_index(["layer", "head"]).index]
    print("\nmean over heads                raw   value-weighted")
    for name in ("entropy", "first_token_unforced", "previous_token", "distance"):
        print(f"{name + ' (all)':<30} {every[name].mean():.4f} {every[name + '_vw'].mean():.4f}")
    print(f"{'first_token_unforced (sinks)':<30} {sinks['first_token_unforced'].mean():.4f} "
          f"{sinks['first_token_unforced_vw'].mean():.4f}")
    lowest = sinks["first_token_unforced_vw"].idxmin()
    print(f"lowest first_token_unforced_vw of a sink: L{lowest[0]}H{lowest[1]} "
          f"{sinks.loc[lowest, 'first_token_unforced_vw']:.4f} (raw {sinks.loc[lowest, 'first_token_unforced']:.4f})")
    loud = table.sort_values("ratio", ascending=False).head(4)
    print("\nloudest heads (output_norm_ratio)")
    print(loud[["layer", "head", "head_type", "output_norm", "ratio"]].to_string(
        index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
