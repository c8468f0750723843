"""Checks of a results folder's records: that a file was written by the run that wrote run.json (its `files`
record), that derived tables are of the same run as heads.csv, which commands' results name another model, and the
checkpoints a stopped run left (which, and nothing but files under their names)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError
from attnprobe.io.names import (
    MODEL_OUTPUTS,
    RUN_FILE,
    RUN_FILES,
    RUN_FILES_KEY,
    checkpoint_name,
    is_checkpoint_name,
)


def recorded_files(out: str | Path) -> dict[str, str] | None:
    """run.json's `files` record in `out` (name -> sha256), or None where there is none (no run.json, or one
    written before attnprobe recorded them); a run.json that cannot be read gives None too: read_run says why."""
    path = Path(out) / RUN_FILE
    try:
        run = _parsed(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(run, dict) or RUN_FILES_KEY not in run:
        return None
    record = run[RUN_FILES_KEY]
    good = isinstance(record, dict) and all(
        isinstance(name, str) and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)
        for name, digest in record.items())
    if not good:
        raise AttnprobeError(f"{path} holds a `{RUN_FILES_KEY}` record that is not a file name -> sha256 object: "
                             f"run `attnprobe analyze --out {out}` again")
    return dict(record)  # a copy: the parsed run.json is remembered


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> Any:
    """run.json parsed, remembered by its text: a command checks every file it reads against the record, and parses
    it once. The file is read afresh each time, so a changed run.json is never answered from memory."""
    return json.loads(text)


def readable_record(out: str | Path) -> dict[str, str] | None:
    """recorded_files, or None where the record cannot be read either (analyze, about to replace it, compares the
    record before and after: identical results keep what was made from them)."""
    try:
        return recorded_files(out)
    except AttnprobeError:
        return None


def check_written_by_run(out: str | Path, name: str) -> None:
    """Refuse `name` (one of analyze's RUN_FILES) in `out` when run.json records the files of its run and this is
    not one of them: its sha256 differs (a copy from another run, even of a model of the same shape), or the run
    wrote none (a leftover). Without a record (an older run), nothing is checked. Call it after the file's own
    checks, so that a damaged file is named as damaged."""
    path = Path(out) / name
    if name not in RUN_FILES or not path.is_file():
        return
    record = recorded_files(out)
    if record is None:
        return
    if name not in record:
        raise AttnprobeError(f"{name} in {out} was not written by the run that wrote {RUN_FILE} (the run wrote no "
                             f"{name}): remove it, or run `attnprobe analyze --out {out}` again")
    from attnprobe.sources import file_sha256

    try:
        digest = file_sha256(path)  # remembered on disk under path, size, inode and mtime (git's index does the same)
    except OSError as err:
        raise AttnprobeError(f"{path} is unreadable ({err.strerror}); run `attnprobe analyze` again") from err
    if digest != record[name]:
        raise AttnprobeError(f"{name} in {out} was not written by the run that wrote {RUN_FILE} (its sha256 differs "
                             f"from the one {RUN_FILE} records): run `attnprobe analyze --out {out}` again, or copy "
                             "the whole folder")


def check_fits_heads(heads: pd.DataFrame, other: pd.DataFrame, name: str, made_by: str) -> None:
    """Refuse a table of `analyze` (layers.csv, positions.csv, categories.csv) from another run than heads.csv:
    its layers (and heads, when it has them) must be heads.csv's."""
    key = ["layer", "head"] if "head" in other.columns else ["layer"]
    theirs = set(map(tuple, other[key].drop_duplicates().to_numpy().tolist()))
    ours = set(map(tuple, heads[key].drop_duplicates().to_numpy().tolist()))
    if theirs != ours:
        what = "layers and heads" if len(key) == 2 else "layers"
        raise AttnprobeError(f"{name} does not hold the {what} of heads.csv (it is from another run): run "
                             f"`{made_by}` again")


def check_same_heads(heads: pd.DataFrame, other: pd.DataFrame, name: str, made_by: str) -> None:
    """Refuse a derived table that was made from another heads.csv (another model or run)."""
    key = ["layer", "head"]
    shared = [c for c in ("entropy_unforced", "entropy_norm", "diagonal_unforced", "sink_window") if c in other.columns]
    left = heads[key + shared].sort_values(key).reset_index(drop=True)
    right = other[key + shared].sort_values(key).reset_index(drop=True)
    same_heads = left[key].equals(right[key])
    close = same_heads and np.allclose(left[shared], right[shared], rtol=0, atol=1e-4, equal_nan=True)
    if not close:
        raise AttnprobeError(f"{name} does not match heads.csv (made from another run): run `{made_by}` again")


def other_model_files(out: str | Path, model: dict[str, Any]) -> list[tuple[str, list[str], str]]:
    """(command, its files, its model) for each of ablate, probe (in `out` or `out/probe`) and rollout whose
    results are of another model than `model` (run.json's "model"): they are not this run's; `analyze` says so."""
    found = []
    for command, record, names in MODEL_OUTPUTS:
        present = [name for name in names if (Path(out) / name).is_file()]
        if not present:
            continue
        theirs = _recorded_model(Path(out) / record)
        if theirs is None or theirs not in {model.get("spec"), model.get("source")}:
            found.append((command, present, theirs or "an unknown model"))
    return found


def _recorded_model(path: Path) -> str | None:
    """The model a probe.json / ablate.json (its model's source, else spec) or rollout.npz / head_similarity.npz (its
    spec) names."""
    import zipfile

    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return str(data["model"]) if "model" in data.files else None
        model = json.loads(path.read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError, KeyError, AttributeError, RecursionError, zipfile.BadZipFile):
        return None
    if isinstance(model, dict):
        return model.get("source") or model.get("spec")
    return model if isinstance(model, str) else None


def checkpoint_files(out: str | Path) -> list[str]:
    """Every checkpoint in `out`, of one process or of every rank, of a stopped run or of one that replaces it
    (files only: check_checkpoint_slots refuses anything else under such a name)."""
    folder = Path(out)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob("checkpoint*.npz")
                  if is_checkpoint_name(p.name) and p.is_file())


def check_checkpoint_slots(out: str | Path) -> None:
    """Refuse a folder (or anything but a file) under a checkpoint's name in `out`: analyze saves there."""
    folder = Path(out)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("checkpoint*.npz")):
        if is_checkpoint_name(path.name) and not path.is_file():
            what = "a folder" if path.is_dir() else "not a file"
            raise AttnprobeError(f"{path} is {what}, not a checkpoint: move or rename it (analyze keeps a stopped "
                                 "run's progress under that name), then run again")


def resumed_name(out: str | Path, rank: int = 0, size: int = 1) -> str:
    """The checkpoint --resume continues: the run that was replacing a stopped one (`checkpoint_name(...,
    replacing=True)`) where it left one, as it is the later; else the stopped run's."""
    replacing = checkpoint_name(rank, size, replacing=True)
    return replacing if (Path(out) / replacing).is_file() else checkpoint_name(rank, size)
