"""Other analyze-only head scores, written as DuoAttention folders for `bench_kvpress.py` to compare with the default.

Run:  .venv/bin/python benchmarks/kvpress_candidates.py --out outputs/kvpress/analyze --to outputs/kvpress/candidates
      (make kvpress-check runs it)

Each score comes from one `attnprobe analyze` results folder's heads.csv, per query head, pooled per KV head as
`attnprobe export` pools (the largest score of the query heads reading a KV head), and goes into its own folder
`--to/<name>/` (full_attention_heads.tsv, config.json with run.json's sink and window), so kvpress loads each the way
it loads an export. Higher keeps the full cache:

  sink_window      1 - sink_window: the share of attention a sink + window cache drops (the default until 2026-11-27)
  sink_window_vw   1 - sink_window_vw: the same, value-weighted
  first_token      first_token: attention mass on the first token
  distance         distance / the largest distance of the model's heads: mean |i - j| of the attended keys
  duplicate_token  duplicate_token: attention to earlier copies of the query's token
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def candidates(heads: pd.DataFrame) -> dict[str, pd.Series]:
    """Per query head (heads.csv's rows), each candidate score in [0, 1]; NaN (undefined) keeps the full cache."""
    return {"sink_window": 1 - heads["sink_window"], "sink_window_vw": 1 - heads["sink_window_vw"],
            "first_token": heads["first_token"], "distance": heads["distance"] / heads["distance"].max(),
            "duplicate_token": heads["duplicate_token"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="an `attnprobe analyze` results folder")
    parser.add_argument("--to", type=Path, required=True, help="one folder per candidate is written inside")
    args = parser.parse_args()

    from attnprobe.export import pool_kv_heads

    run = json.loads((args.out / "run.json").read_text())
    heads = pd.read_csv(args.out / "heads.csv")
    layers, per_layer, kv_heads = (run["model"][k] for k in ("layers", "heads", "kv_heads"))
    config = {"sink_size": int(run["attention"]["sink_tokens"]), "recent_size": int(run["attention"]["window"])}
    for name, score in candidates(heads).items():
        grid = np.full((layers, per_layer), np.nan)  # [layer, head]
        grid[heads["layer"].to_numpy(), heads["head"].to_numpy()] = score.to_numpy(dtype=float)
        table = pool_kv_heads(np.clip(np.nan_to_num(grid, nan=1.0), 0, 1), kv_heads)  # [layer, kv head]
        folder = args.to / name
        folder.mkdir(parents=True, exist_ok=True)
        np.savetxt(folder / "full_attention_heads.tsv", table, delimiter="\t")
        (folder / "config.json").write_text(json.dumps(config) + "\n")
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
