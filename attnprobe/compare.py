"""Compare two results folders: B - A of every score, with 95% intervals from the runs' bootstrap resamples.

Same shape (layers x heads): head L{l}H{h} of A is matched with L{l}H{h} of B, and every score is
compared per head and per layer. Different shapes: heads cannot be matched one to one, so the layer
curves are compared at the same relative depth (layer / (layers - 1), interpolated onto a common
grid), and the head-type fractions side by side.

Intervals. Each run saved its R Poisson-bootstrap resamples (resamples.npz): the statistic recomputed
under R random reweightings of the sentences. A sentence's weights depend only on (seed, its index in
the corpus), so two runs over the same corpus (sha256 and sentence count) with the same seed and R
drew *the same* resamples, and B_r - A_r is the paired bootstrap of the difference: its percentiles
are the interval (`paired`). Otherwise the two samples of sentences are independent, and the
difference's bootstrap distribution is that of B* - A* with B* and A* drawn independently: resample r
of A is matched with a random resample of B (a fixed-seed permutation of each run's resamples,
`UNPAIRED_SEED`) (`unpaired`). Matching resample r with resample r would not do: with equal seeds, both
runs give sentence index i the same weights, a correlation that means nothing across different corpora.
An unpaired interval over the same sentences ignores that they are the same: where the two runs' values
rise and fall together from sentence to sentence (two runs of one model), it is far wider than the paired one.

A run of fewer than 10 sequences resampled blocks of query rows within each sequence instead (the block
bootstrap, bootstrap.py). Its block starts depend on (seed, the sequence's index, its rows), so two such runs
drew the same rows when they also tokenized every sequence to the same number of rows (`sequence_rows`):
then they pair; their intervals, and those of the differences, are over those rows, not over sentences.

Pure: reads through attnprobe.io, returns frames and plain data; writes nothing.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import io, limits
from attnprobe.bootstrap import BLOCK, CONFIDENCE, interval
from attnprobe.classify import EXTENDED_TYPES, HEAD_TYPES, KV_TYPES
from attnprobe.classify import classify as default_classify
from attnprobe.defaults import FEW_SENTENCES
from attnprobe.errors import AttnprobeError
from attnprobe.naming import head_name

PAIRED, UNPAIRED = "paired", "unpaired"
UNPAIRED_SEED = 0  # the random matching of A's and B's resamples when they are independent: fixed, reproducible
TOP_HEADS = 10
FOLD_EXTENDED = {"previous": "local", "sink": "copy", "dormant": "copy"}  # extended types inside the default ones


@dataclass
class Run:
    """One results folder, as `compare` needs it."""

    path: Path
    info: dict[str, Any]  # run.json
    heads: pd.DataFrame  # heads.csv sorted by (layer, head)
    resamples: dict[str, np.ndarray]  # per score [resample, layer, head]
    types: pd.DataFrame | None  # head_types.csv, or None when classify has not run

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.info["model"]["layers"]), int(self.info["model"]["heads"])

    @property
    def label(self) -> str:
        return self.named(self.path.name)

    def named(self, name: str) -> str:
        """The run as the printout and the figure name it: `name` (its folder), the model and the dtype."""
        return f"{name} ({self.info['model']['spec']}, {self.info.get('dtype', 'float32')})"


def apart(a: Path, b: Path) -> tuple[str, str]:
    """The two folders' names, each the fewest last parts of its full path that tell them apart (`runs/a/out` and
    `runs/b/out`: `a/out`, `b/out`); the full paths where one is the other's end (or both are the same folder)."""
    parts_a, parts_b = Path(a).resolve().parts, Path(b).resolve().parts
    for count in range(1, min(len(parts_a), len(parts_b)) + 1):
        if parts_a[-count:] != parts_b[-count:]:
            return str(Path(*parts_a[-count:])), str(Path(*parts_b[-count:]))
    return str(Path(a).resolve()), str(Path(b).resolve())


@dataclass
class Comparison:
    heads: pd.DataFrame | None  # per head (same shape only): layer, head, <score>_a/_b/_diff/_diff_ci_low/_high
    layers: pd.DataFrame  # per layer (same shape) or per relative depth: depth, <score>_a (+ ci), _b (+ ci), _diff
    types: pd.DataFrame | None  # head_type, count_a, fraction_a, count_b, fraction_b, fraction_diff
    info: dict[str, Any]  # compare.json: both runs' provenance, pairing and why, overall and top changes


def load_run(out: str | Path, which: str) -> Run:
    """Read and cross-check one folder; every problem is one line naming the file and the command that makes it."""
    path = Path(out)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise AttnprobeError(f"{which} {path} {what}: pass a folder written by `attnprobe analyze --out`")
    info = io.read_run(path)
    heads = io.read_table(path, io.HEADS_FILE, ["layer", "head", "entropy"], f"attnprobe analyze --out {path}")
    heads = heads.sort_values(["layer", "head"]).reset_index(drop=True)
    resamples = io.read_resamples(path)
    run = Run(path, info, heads, resamples, read_types(path, heads))
    check_run(run)
    return run


def read_types(path: Path, heads: pd.DataFrame) -> pd.DataFrame | None:
    if not (path / io.TYPES_FILE).is_file():
        return None
    types = io.read_table(path, io.TYPES_FILE, ["layer", "head", "head_type"], f"attnprobe classify --out {path}")
    io.check_same_heads(heads, types, io.TYPES_FILE, f"attnprobe classify --out {path}")
    return types.sort_values(["layer", "head"]).reset_index(drop=True)


def check_run(run: Run) -> None:
    """heads.csv and resamples.npz must hold the layers x heads of run.json (the same run)."""
    layers, heads = run.shape
    again = f"run `attnprobe analyze --out {run.path}` again"
    expected = pd.MultiIndex.from_product([range(layers), range(heads)])
    if not pd.MultiIndex.from_frame(run.heads[["layer", "head"]]).equals(expected):
        raise AttnprobeError(f"{run.path / io.HEADS_FILE} does not hold the {layers} x {heads} heads of run.json: "
                             f"{again}")
    resamples = run.info.get("bootstrap", {}).get("resamples")
    for name, values in run.resamples.items():
        if values.ndim != 3 or values.shape[1:] != (layers, heads) or values.shape[0] != resamples:
            raise AttnprobeError(f"{run.path / io.RESAMPLES_FILE} ({name} {values.shape}) does not match run.json "
                                 f"({resamples} resamples of {layers} x {heads} heads): {again}")
    # heads.csv's intervals are the percentiles of these resamples: a resamples.npz of another run (another
    # seed or corpus, the same shape) gives other ones
    for name, values in run.resamples.items():
        if f"{name}_ci_low" not in run.heads.columns or values.dtype.kind != "f":
            continue
        low, high = interval(values.astype(np.float64))  # [layer, head] each
        saved = run.heads[[f"{name}_ci_low", f"{name}_ci_high"]].to_numpy(dtype=float)  # [layer x head, 2]
        computed = np.stack([low.reshape(-1), high.reshape(-1)], axis=1)
        if not np.allclose(computed, saved, rtol=1e-4, atol=1e-5, equal_nan=True):
            raise AttnprobeError(f"{run.path / io.RESAMPLES_FILE} does not give the 95% intervals of "
                                 f"{io.HEADS_FILE} ({name}): it is from another run; {again}")


def scores_of(a: Run, b: Run) -> list[str]:
    """The scores both runs measured and resampled, in heads.csv's order."""
    return [c for c in a.heads.columns if c in a.resamples and c in b.resamples and c in b.heads.columns]


def pairing_obstacles(a: Run, b: Run) -> list[str]:
    """Why resample r of A and resample r of B did not draw the same sentences (empty: they did)."""
    ca, cb = a.info["corpus"].get("sha256"), b.info["corpus"].get("sha256")
    ba, bb = a.info.get("bootstrap", {}), b.info.get("bootstrap", {})
    found = []
    if ca != cb or ca is None:
        found.append(f"the corpora differ (sha256 {str(ca)[:12]} vs {str(cb)[:12]})")
    elif a.info.get("sentences") != b.info.get("sentences"):
        found.append(f"the same file was split into {a.info.get('sentences')} vs {b.info.get('sentences')} sentences")
    elif a.info["corpus"].get("split", "lines") != b.info["corpus"].get("split", "lines"):
        found.append(f"the same file was split by {a.info['corpus'].get('split', 'lines')} vs "
                     f"{b.info['corpus'].get('split', 'lines')}")
    for key, what in (("method", "bootstrap methods"), ("seed", "bootstrap seeds"), ("resamples", "resample counts")):
        if ba.get(key) != bb.get(key) or ba.get(key) is None:
            found.append(f"the {what} differ ({ba.get(key)} vs {bb.get(key)})")
    if BLOCK == ba.get("method") == bb.get("method") and not found:  # blocks of rows: the same rows?
        for key, what in (("sequence_rows", "sequences' query rows"), ("block_lengths", "block lengths")):
            if ba.get(key) != bb.get(key) or ba.get(key) is None:
                found.append(f"the {what} differ ({ba.get(key)} vs {bb.get(key)}): other tokenizers draw other rows")
                break
    return found


def resampled_units(a: Run, b: Run) -> str:
    """What the two runs' resamples drew: `sentences`, `query rows` (both block bootstraps) or both, in words."""
    units = ["query rows" if run.info.get("bootstrap", {}).get("method") == BLOCK else "sentences" for run in (a, b)]
    return units[0] if units[0] == units[1] else f"{units[0]} (A), {units[1]} (B)"


def few_note(which: str, run: Run) -> str | None:
    """The warning for a run of fewer than FEW_SENTENCES sequences, else None."""
    n = run.info.get("sentences") or 0
    if n >= FEW_SENTENCES:
        return None
    if run.info.get("bootstrap", {}).get("method") == BLOCK:
        return (f"{which} has only {n} sequence{'' if n == 1 else 's'}: its intervals, and those of the differences, "
                "come from a block bootstrap over query rows within them: they say nothing about other sentences")
    return f"{which} has only {n} sentence{'' if n == 1 else 's'}: its intervals mean little, and so do those of the " \
        "differences"


def choose_pairing(a: Run, b: Run, paired: bool | None) -> tuple[str, str]:
    """`paired` or `unpaired`, and why. paired=True insists (refused when impossible), False declines."""
    obstacles = pairing_obstacles(a, b)
    if paired and obstacles:
        raise AttnprobeError(f"--paired needs both runs on the same corpus with the same bootstrap, but "
                             f"{'; '.join(obstacles)}: drop --paired for an unpaired comparison")
    if paired is False:
        return UNPAIRED, "--unpaired was asked for: resamples matched at random, as if the samples were independent"
    if obstacles:
        return UNPAIRED, (f"{'; '.join(obstacles)}: resamples matched at random (independent samples of "
                          f"{resampled_units(a, b)})")
    boot = a.info["bootstrap"]
    drawn = "query rows (block bootstrap)" if boot.get("method") == BLOCK else "sentences"
    return PAIRED, (f"same corpus (sha256 {a.info['corpus']['sha256'][:12]}, {a.info['sentences']} sentences) and "
                    f"bootstrap (seed {boot['seed']}, {boot['resamples']} resamples): resample r drew the same "
                    f"{drawn} in both runs, so the interval is over B_r - A_r")


def draws(a: Run, b: Run, pairing: str) -> tuple[np.ndarray, np.ndarray]:
    """Which resample of A and of B make each bootstrap draw of the difference: indices [draw] each."""
    ra, rb = len(next(iter(a.resamples.values()))), len(next(iter(b.resamples.values())))
    if pairing == PAIRED:
        return np.arange(ra), np.arange(rb)
    n = max(ra, rb)
    rng = np.random.default_rng(UNPAIRED_SEED)
    return rng.permutation(n) % ra, rng.permutation(n) % rb  # every resample of each run used (about) equally


def nanmean(values: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a score undefined everywhere stays NaN
        return np.nanmean(values, axis=axis)


def head_grid(run: Run, score: str) -> np.ndarray:
    return run.heads[score].to_numpy(dtype=float).reshape(run.shape)  # [layer, head]


def resampled(run: Run, score: str, index: np.ndarray) -> np.ndarray:
    return run.resamples[score][index].astype(np.float64)  # [draw, layer, head]


def head_differences(a: Run, b: Run, scores: list[str], ia: np.ndarray, ib: np.ndarray) -> pd.DataFrame:
    """Per head and score: A, B, B - A and the difference's interval."""
    columns = {"layer": a.heads["layer"].to_numpy(), "head": a.heads["head"].to_numpy()}
    for score in scores:
        diff = resampled(b, score, ib) - resampled(a, score, ia)  # [draw, layer, head]
        low, high = interval(diff)  # [layer, head] each
        va, vb = head_grid(a, score), head_grid(b, score)  # [layer, head]
        columns.update({f"{score}_a": va.ravel(), f"{score}_b": vb.ravel(), f"{score}_diff": (vb - va).ravel(),
                        f"{score}_diff_ci_low": low.ravel(), f"{score}_diff_ci_high": high.ravel()})
    return pd.DataFrame(columns)


def layer_curve(run: Run, score: str, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean over heads per layer: the point [layer] and the resampled curves [draw, layer]."""
    return nanmean(head_grid(run, score), 1), nanmean(resampled(run, score, index), 2)


def depth_grid(layers_a: int, layers_b: int) -> int:
    """Points of the common relative-depth grid: the deeper model's layers."""
    return max(layers_a, layers_b)


def interpolate(values: np.ndarray, points: int) -> np.ndarray:
    """values [..., layer] at depths layer / (layers - 1), linearly interpolated at k / (points - 1): [..., point].

    A model with as many layers as points is returned as it is (no rounding); one layer is a constant.
    """
    layers = values.shape[-1]
    if layers == points:
        return values
    if layers == 1 or points == 1:
        return np.repeat(values[..., :1], points, axis=-1)
    position = np.arange(points) * (layers - 1) / (points - 1)  # [point], in layers
    low = np.minimum(np.floor(position).astype(int), layers - 2)  # [point]
    frac = position - low  # [point], 0..1
    blend = values[..., low] * (1 - frac) + values[..., low + 1] * frac  # [..., point]
    return np.where(frac == 0, values[..., low], blend)  # an exact layer keeps its value, NaN neighbour or not


def layer_differences(a: Run, b: Run, scores: list[str], ia: np.ndarray, ib: np.ndarray) -> pd.DataFrame:
    """Per layer (same shape) or per point of relative depth: both runs with their intervals, and B - A."""
    (la, _), (lb, _) = a.shape, b.shape
    points = la if a.shape == b.shape else depth_grid(la, lb)
    columns = {"layer": np.arange(points)} if a.shape == b.shape else {}
    columns["depth"] = np.arange(points) / max(points - 1, 1)
    for score in scores:
        (pa, ra), (pb, rb) = layer_curve(a, score, ia), layer_curve(b, score, ib)
        pa, ra, pb, rb = (interpolate(v, points) for v in (pa, ra, pb, rb))  # [point], [draw, point]
        for side, point, curves in (("a", pa, ra), ("b", pb, rb)):
            low, high = interval(curves)  # [point] each
            columns.update({f"{score}_{side}": point, f"{score}_{side}_ci_low": low, f"{score}_{side}_ci_high": high})
        low, high = interval(rb - ra)  # [point] each
        columns.update({f"{score}_diff": pb - pa, f"{score}_diff_ci_low": low, f"{score}_diff_ci_high": high})
    return pd.DataFrame(columns)


def overall(a: Run, b: Run, scores: list[str], ia: np.ndarray, ib: np.ndarray) -> dict[str, Any]:
    """Per score, the mean over every head of each run and B - A with its interval (any shapes)."""
    result = {}
    for score in scores:
        va, vb = nanmean(head_grid(a, score), (0, 1)), nanmean(head_grid(b, score), (0, 1))
        diff = nanmean(resampled(b, score, ib), (1, 2)) - nanmean(resampled(a, score, ia), (1, 2))  # [draw]
        low, high = interval(diff)
        result[score] = {"a": number(va), "b": number(vb), "diff": number(vb - va), "ci": [number(low), number(high)]}
    return result


def scheme_of(types: pd.DataFrame) -> str:
    if "kv_head" in types.columns or types["head_type"].isin(KV_TYPES).any():
        return "kv"
    return "extended" if "previous_token" in types.columns else "default"


def run_types(run: Run) -> tuple[pd.DataFrame, str, str | None]:
    """The run's head types, their scheme, and a note when they had to be made here."""
    if run.types is not None:
        return run.types, scheme_of(run.types), None
    note = f"{run.path} has no {io.TYPES_FILE}: its heads were classified here with the default thresholds"
    return default_classify(run.heads), "default", note


def type_distribution(a: Run, b: Run) -> tuple[pd.DataFrame | None, pd.Series | None, pd.Series | None, list[str]]:
    """Head-type counts and fractions of both runs, in one scheme; and each run's per-head types.

    An extended run compared with a default one is folded (previous -> local, sink -> copy); kv types
    are not comparable with the others, and give no table.
    """
    (ta, sa, na), (tb, sb, nb) = run_types(a), run_types(b)
    notes = [n for n in (na, nb) if n]
    if (sa == "kv") != (sb == "kv"):
        notes.append(f"head types not compared: A's use the {sa} scheme and B's the {sb} one; run `attnprobe "
                     "classify` with the same --scheme on both")
        return None, None, None, notes
    labels_a, labels_b = ta["head_type"].astype(str), tb["head_type"].astype(str)
    if sa != sb:
        labels_a, labels_b = labels_a.replace(FOLD_EXTENDED), labels_b.replace(FOLD_EXTENDED)
        notes.append("one run has extended head types and the other default ones: previous counted as local, "
                     "sink as copy")
    order = KV_TYPES if sa == "kv" else (EXTENDED_TYPES if sa == sb == "extended" else HEAD_TYPES)
    counts_a = labels_a.value_counts().reindex(order, fill_value=0)
    counts_b = labels_b.value_counts().reindex(order, fill_value=0)
    table = pd.DataFrame({"head_type": list(order), "count_a": counts_a.to_numpy(), "count_b": counts_b.to_numpy()})
    table["fraction_a"] = table["count_a"] / len(labels_a)
    table["fraction_b"] = table["count_b"] / len(labels_b)
    table["fraction_diff"] = table["fraction_b"] - table["fraction_a"]
    return table, labels_a, labels_b, notes


def excludes_zero(frame: pd.DataFrame, score: str) -> pd.Series:
    return (frame[f"{score}_diff_ci_low"] > 0) | (frame[f"{score}_diff_ci_high"] < 0)


def top_changes(frame: pd.DataFrame, score: str, n: int = TOP_HEADS) -> pd.DataFrame:
    """The rows (heads or depths) whose interval for B - A excludes 0, largest |B - A| first."""
    changed = frame[excludes_zero(frame, score)]
    order = changed[f"{score}_diff"].abs().sort_values(ascending=False, kind="stable").index
    return changed.loc[order[:n]]


def number(value: Any) -> float | None:
    """A float for JSON; NaN becomes None."""
    value = float(value)
    return None if math.isnan(value) else value


def provenance(run: Run, name: str | None = None) -> dict[str, Any]:
    """compare.json's record of one run; `name`: its folder as the label says it (`apart`), else its last part."""
    model = run.info["model"]
    keep = ("spec", "source", "architecture", "layers", "heads", "kv_heads", "causal", "gguf_sha256")
    label = run.label if name is None else run.named(name)
    return {
        "path": str(run.path.resolve()), "label": label, "model": {k: model[k] for k in keep if k in model},
        "corpus": run.info.get("corpus"), "sentences": run.info.get("sentences"), "tokens": run.info.get("tokens"),
        "dtype": run.info.get("dtype"), "bootstrap": run.info.get("bootstrap"),
        "attnprobe_version": run.info.get("attnprobe_version"), "created": run.info.get("created"),
    }


def change_records(frame: pd.DataFrame, score: str, by_head: bool) -> list[dict[str, Any]]:
    records = []
    for _, row in frame.iterrows():
        where = {"name": head_name(row["layer"], row["head"]), "layer": int(row["layer"]), "head": int(row["head"])} \
            if by_head else {"depth": float(row["depth"])}
        records.append({**where, "a": number(row[f"{score}_a"]), "b": number(row[f"{score}_b"]),
                        "diff": number(row[f"{score}_diff"]),
                        "ci": [number(row[f"{score}_diff_ci_low"]), number(row[f"{score}_diff_ci_high"])]})
    return records


def matching_note(a: Run, b: Run) -> str:
    (la, ha), (lb, hb) = a.shape, b.shape
    if a.shape != b.shape:
        return (f"heads cannot be matched one to one (A {la} x {ha}, B {lb} x {hb}): compared by relative depth "
                "(layer / (layers - 1)) and by head-type fractions")
    if a.info["model"].get("source") != b.info["model"].get("source"):
        return (f"heads matched by position (L0H0 of A with L0H0 of B, ...), but the models differ "
                f"({a.info['model']['spec']} vs {b.info['model']['spec']}): a matched pair need not do the same job")
    return "heads matched one to one by position: the same model in both runs"


def compare(
    out_a: str | Path, out_b: str | Path, *, score: str = "entropy", paired: bool | None = None, top: int = TOP_HEADS,
) -> Comparison:
    """B - A of every score of two results folders. `paired`: None chooses, True insists, False declines."""
    a, b = load_run(out_a, "OUT_A"), load_run(out_b, "OUT_B")
    names = apart(a.path, b.path)
    scores = scores_of(a, b)
    if score not in scores:
        raise AttnprobeError(f"--score {score!r} is not in both runs: use one of {', '.join(scores)}")
    if top < 1:
        raise AttnprobeError(f"--top {top} is below 1: use 1 or more (default {TOP_HEADS})")
    limits.check_whole("--top", top, 1, limits.MAX_TOP, TOP_HEADS)
    pairing, why = choose_pairing(a, b, paired)
    ia, ib = draws(a, b, pairing)
    same = a.shape == b.shape
    heads = head_differences(a, b, scores, ia, ib) if same else None
    layers = layer_differences(a, b, scores, ia, ib)
    types, labels_a, labels_b, notes = type_distribution(a, b)
    few = [note for note in (few_note("A", a), few_note("B", b)) if note]
    notes = [*few, *notes]
    if heads is not None and labels_a is not None:
        heads.insert(2, "head_type_a", labels_a.to_numpy())
        heads.insert(3, "head_type_b", labels_b.to_numpy())
    changed = top_changes(heads if same else layers, score, top)
    info = {
        "a": provenance(a, names[0]), "b": provenance(b, names[1]), "difference": "B - A", "same_shape": same,
        "heads_matched": same, "matching": matching_note(a, b), "pairing": pairing, "pairing_reason": why,
        "bootstrap_over": resampled_units(a, b),
        "draws": len(ia), "confidence": CONFIDENCE, "scores": scores, "score": score,
        "overall": overall(a, b, scores, ia, ib),
        "changed": {s: int(excludes_zero(heads if same else layers, s).sum()) for s in scores},
        "changed_of": len(heads) if same else len(layers), "changed_unit": "heads" if same else "depth points",
        "top": change_records(changed, score, same), "notes": notes,
    }
    if heads is not None and "head_type_a" in heads.columns:
        moved = heads[heads["head_type_a"] != heads["head_type_b"]]
        info["type_changes"] = [{"name": head_name(r.layer, r.head), "a": r.head_type_a, "b": r.head_type_b}
                                for r in moved.itertuples()]
    if pairing == UNPAIRED:
        info["unpaired_seed"] = UNPAIRED_SEED
    return Comparison(heads, layers, types, info)


def comparison_data(comparison: Comparison) -> dict[str, Any]:
    """The comparison as plain JSON-ready data (NaN -> None), e.g. for a report: info and the tables as records."""

    def records(frame: pd.DataFrame | None) -> list[dict[str, Any]] | None:
        if frame is None:
            return None
        return [{k: (number(v) if isinstance(v, float) else v) for k, v in row.items()}
                for row in frame.astype(object).to_dict("records")]

    return {"info": comparison.info, "heads": records(comparison.heads), "layers": records(comparison.layers),
            "types": records(comparison.types)}


def load_comparison(folder: str | Path) -> Comparison:
    """A comparison `attnprobe compare` wrote into `folder` (compare.json and its tables)."""
    info, heads, layers, types = io.read_compare(folder)
    return Comparison(heads, layers, types, info)
