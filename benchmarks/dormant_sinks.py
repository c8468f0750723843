"""Are the dormant sinks the sinks a model needs least? Checks the extended scheme's dormant rule against `ablate`.

Run:  .venv/bin/python benchmarks/dormant_sinks.py                 (~10 min on 2 busy cores; ablate is most of it)
      .venv/bin/python benchmarks/dormant_sinks.py --reuse         (only the tables, from the files already there)
      .venv/bin/python benchmarks/dormant_sinks.py --json x.json   (also write them as JSON, for `make figures`)

Runs, as a user would, `attnprobe analyze`, `attnprobe classify --scheme extended` and `attnprobe ablate
--no-pruning` (zero ablation of every head) on smollm2-135m over corpora/sentences.txt, into --out. Then prints:
  1. how output_norm_ratio (a head's output_norm over its layer's median) is spread among sinks and among the
     other heads: the threshold --dormant-max-output-ratio is chosen from this;
  2. for a few thresholds, how many sinks are dormant, how many other heads fall below it too, and the median
     ablation loss_change of dormant sinks against the other sinks;
  3. the dormant sinks at the default threshold, each with its first-token mass, raw and value-weighted, its
     output_norm_ratio, its loss_change and its kl;
  4. the value-weighted scores against the raw ones: means over heads and over sinks, and the loudest heads.
docs/classification.md and docs/metrics.md quote this script's output (`make figures`, figures/moves.py).
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--json", type=Path, help="also write what was measured to this file (for `make figures`)")
    args = parser.parse_args()
    out = str(args.out)
    if not (args.reuse and (args.out / "heads.csv").is_file()):
        attnprobe("analyze", "--model", args.model, "--corpus", args.corpus, "--out", out)
    attnprobe("classify", "--out", out, "--scheme", "extended")
    if not (args.reuse and (args.out / "importance.csv").is_file()):
        attnprobe("ablate", "--model", args.model, "--corpus", args.corpus, "--out", out, "--no-pruning")
    measured = measure(args.out, defaults.DORMANT_MAX_OUTPUT_RATIO)
    measured.update(model=args.model)
    report(measured)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured, indent=1), encoding="utf-8")


def median(values) -> float | None:
    """The median of a column, None when it is empty (JSON has no NaN)."""
    return float(values.median()) if len(values) else None


def name(row) -> str:
    return f"L{int(row.layer)}H{int(row.head)}"


def measure(out: Path, default: float) -> dict:
    """Everything the tables print, as plain data: the spread of output_norm_ratio, the thresholds, the dormant
    sinks at `default`, the medians of ablation, the value-weighted means and the loudest heads."""
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
    thresholds = []
    for threshold in THRESHOLDS:
        quiet = sinks["ratio"] < threshold
        thresholds.append({
            "threshold": threshold, "dormant": int(quiet.sum()),
            "others_below": int((others["ratio"] < threshold).sum()),
            "loss_change": [median(sinks.loc[quiet, "loss_change"]), median(sinks.loc[~quiet, "loss_change"])],
            "kl": [median(sinks.loc[quiet, "kl"]), median(sinks.loc[~quiet, "kl"])]})
    dormant = sinks[sinks["ratio"] < default].sort_values("ratio")
    rest = sinks[sinks["ratio"] >= default]
    below = others[others["ratio"] < default].sort_values("ratio")
    every = heads.set_index(["layer", "head"])
    sink_scores = every.loc[sinks.set_index(["layer", "head"]).index]
    lowest = sink_scores["first_token_unforced_vw"].idxmin()
    loud = table.sort_values("ratio", ascending=False).head(5)
    return {
        "default": default, "heads": int(len(table)), "sinks": int(len(sinks)), "others": int(len(others)),
        "quantiles": list(quantiles),
        "ratio_quantiles": {"sinks": [float(v) for v in np.quantile(sinks["ratio"], quantiles)],
                            "others": [float(v) for v in np.quantile(others["ratio"], quantiles)]},
        "ratio_max": {"sinks": float(sinks["ratio"].max()), "others": float(others["ratio"].max())},
        "thresholds": thresholds,
        "dormant_heads": [{"head": name(r), "first_token_unforced": float(r.first_token_unforced),
                           "first_token_unforced_vw": float(r.first_token_unforced_vw), "ratio": float(r.ratio),
                           "loss_change": float(r.loss_change), "kl": float(r.kl)} for r in dormant.itertuples()],
        "others_below_default": [{"head": name(r), "type": r.head_type, "ratio": float(r.ratio)}
                                 for r in below.itertuples()],
        "medians": {measure: {"dormant": median(dormant[measure]), "other_sinks": median(rest[measure]),
                              "others": median(others[measure])} for measure in ("loss_change", "kl")},
        "value_weighted": {
            "all": {score: [float(every[score].mean()), float(every[score + "_vw"].mean())]
                    for score in ("entropy", "first_token_unforced", "previous_token", "distance")},
            "sinks": {"first_token_unforced": [float(sink_scores["first_token_unforced"].mean()),
                                               float(sink_scores["first_token_unforced_vw"].mean())]},
            "lowest_sink": {"head": f"L{lowest[0]}H{lowest[1]}",
                            "first_token_unforced_vw": float(sink_scores.loc[lowest, "first_token_unforced_vw"]),
                            "first_token_unforced": float(sink_scores.loc[lowest, "first_token_unforced"])}},
        "loudest": [{"head": name(r), "layer": int(r.layer), "type": r.head_type, "output_norm": float(r.output_norm),
                     "ratio": float(r.ratio)} for r in loud.itertuples()],
    }


def number(v: float | None, spec: str) -> str:
    return format("-", spec.split(".")[0]) if v is None else format(v, spec)


def report(m: dict) -> None:
    print(f"{m['heads']} heads, {m['sinks']} sinks (extended scheme; dormant included)\n")
    print("output_norm_ratio quantiles " + " ".join(f"{q:>6}" for q in m["quantiles"]))
    for label, key in (("sinks", "sinks"), ("other heads", "others")):
        print(f"{label:<27} " + " ".join(f"{v:>6.3f}" for v in m["ratio_quantiles"][key]))
    print(f"\n{'':>32} {'median loss_change':>24} {'median kl':>22}")
    print(f"{'threshold':>9} {'dormant':>8} {'others below':>13} {'dormant':>11} {'other sinks':>12} {'dormant':>10} "
          f"{'other sinks':>11}")
    for t in m["thresholds"]:
        print(f"{t['threshold']:>9} {t['dormant']:>8} {t['others_below']:>13} {number(t['loss_change'][0], '>11.4f')} "
              f"{number(t['loss_change'][1], '>12.4f')} {number(t['kl'][0], '>10.4f')} {number(t['kl'][1], '>11.4f')}")
    print(f"\ndormant sinks at --dormant-max-output-ratio {m['default']} (loss_change: nats per token, zero ablation)")
    print(f"{'head':>7} {'first_token_unforced':>21} {'first_token_unforced_vw':>24} {'ratio':>7} {'loss_change':>12} "
          f"{'kl':>7}")
    for d in m["dormant_heads"]:
        print(f"{d['head']:>7} {d['first_token_unforced']:>21.4f} {d['first_token_unforced_vw']:>24.4f} "
              f"{d['ratio']:>7.4f} {d['loss_change']:>12.4f} {d['kl']:>7.4f}")
    counts = (len(m["dormant_heads"]), m["sinks"] - len(m["dormant_heads"]), m["others"])
    for measure, by in m["medians"].items():
        print(f"median {measure}: dormant sinks {number(by['dormant'], '.4f')} ({counts[0]}), other sinks "
              f"{number(by['other_sinks'], '.4f')} ({counts[1]}), other heads {number(by['others'], '.4f')} "
              f"({counts[2]})")
    print("other heads below the default: " + ", ".join(f"{o['head']} ({o['type']}, {o['ratio']:.3f})"
                                                      for o in m["others_below_default"]))
    vw = m["value_weighted"]
    print("\nmean over heads                raw   value-weighted")
    for score, (raw, weighted) in vw["all"].items():
        print(f"{score + ' (all)':<30} {raw:.4f} {weighted:.4f}")
    raw, weighted = vw["sinks"]["first_token_unforced"]
    print(f"{'first_token_unforced (sinks)':<30} {raw:.4f} {weighted:.4f}")
    low = vw["lowest_sink"]
    print(f"lowest first_token_unforced_vw of a sink: {low['head']} {low['first_token_unforced_vw']:.4f} "
          f"(raw {low['first_token_unforced']:.4f})")
    print("\nloudest heads (output_norm_ratio)")
    for h in m["loudest"]:
        print(f"{h['head']:>7} {h['type']:>8} {h['output_norm']:>8.3f} {h['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
