"""Every head score of a run in one parquet file, to publish beside a model, and the results folder read the same way.

`attnprobe export --format head-scores` writes `head_scores.parquet`: one row per layer and query head (`layer`,
`head`, `kv_head`: the KV head it reads), with the scores of each command that ran into the results folder:

- `analyze`: every column of heads.csv under its own name (entropy, first_token, sink_window, ...);
- `retrieval`: retrieval_heads.csv's columns as `retrieval_<name>` (retrieval_mean, retrieval_needle_mass, ...) and
  `retrieval_trials`, the head's score in every trial (head_score.json's list);
- `train-pattern`: gates.csv's columns as `trained_<name>` (trained_gate: the gate of the KV head the query head
  reads, repeated over the query heads of that KV head).

The file's key-value metadata: `attnprobe` (JSON: the format and its version, attnprobe's version, the model, and per
command its record, run.json / retrieval.json / train_pattern.json as written, and the columns that hold its
scores), and, for readers that do not parse it, `attnprobe.version`, `attnprobe.format_version`, `model.name`,
`model.source`, `model.revision` and `model.weights`.

`attnprobe export --from FILE` reads it back (`read_score_file`) into a ScoreFile, which answers export's questions
(`has`, `read_run`, `read_json`, `read_table`) as a results folder does (FolderFiles): every format is computed from
the same tables, so an export from the file equals the export from the folder it was written from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import io
from attnprobe.errors import AttnprobeError

FILE_NAME = "head_scores.parquet"
FORMAT = "attnprobe head scores"
FORMAT_VERSION = 1
METADATA_KEY = "attnprobe"
TRAINED_RUN_FILE, TRAINED_GATES_FILE = io.TRAINED_RUN_FILE, io.TRAINED_GATES_FILE
KEYS = ("layer", "head", "kv_head")  # every row's
# per command: (its record, its per-head table, what makes it, the prefix of its columns in the file)
PARTS = {
    "analyze": (io.RUN_FILE, io.HEADS_FILE, "attnprobe analyze", ""),
    "retrieval": (io.RETRIEVAL_RUN_FILE, io.RETRIEVAL_FILE, "attnprobe retrieval", "retrieval_"),
    "train-pattern": (TRAINED_RUN_FILE, TRAINED_GATES_FILE, "attnprobe train-pattern", "trained_"),
}
TRIALS_COLUMN = "retrieval_trials"


class FolderFiles:
    """A results folder as export reads it: the files of each command, through attnprobe.io's checked readers."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        if not self.out.is_dir():
            raise AttnprobeError(f"--out {out} is not a results folder: run `attnprobe analyze` or `attnprobe "
                                 "retrieval` with --out first")
        self.where = str(out)

    def has(self, name: str) -> bool:
        return (self.out / name).is_file()

    def path(self, name: str) -> str:
        """`name` as the messages say it."""
        return str(self.out / name)

    def lacking(self, name: str, made_by: str) -> str:
        """The message for a file this folder lacks."""
        return f"no {name} in {self.out}: run `{made_by} --out {self.out}` first"

    def read_run(self) -> dict[str, Any]:
        return io.read_run(self.out)

    def read_json(self, name: str, made_by: str) -> Any:
        return io.read_json(self.out, name, made_by)

    def read_table(self, name: str, columns: list[str], made_by: str) -> pd.DataFrame:
        return io.read_table(self.out, name, columns, made_by)

    def recorded(self, record: dict[str, Any], name: str) -> bool:
        """Whether `name` is the file whose sha256 `record` (a run's record of its files) lists, where it lists any."""
        files = record.get(io.RUN_FILES_KEY)
        if not isinstance(files, dict) or not self.has(name):
            return True
        try:
            return files.get(name) == io.hash_file(self.out / name)
        except OSError:
            return False


class ScoreFile:
    """head_scores.parquet (checked by read_score_file) answering as FolderFiles does."""

    def __init__(self, path: Path, frame: pd.DataFrame, record: dict[str, Any]) -> None:
        self.file, self.frame, self.record = path, frame, record
        self.where = str(path)
        self.parts = record["parts"]

    def _part(self, name: str) -> tuple[str, dict[str, Any]] | None:
        for part, (run_file, table_file, _, _) in PARTS.items():
            if part in self.parts and name in (run_file, table_file):
                return part, self.parts[part]
        if name == io.RETRIEVAL_SCORES_FILE and self.parts.get("retrieval", {}).get("trials"):
            return "retrieval", self.parts["retrieval"]
        return None

    def has(self, name: str) -> bool:
        found = self._part(name)
        if found is None:
            return False
        part, entry = found
        return name in (PARTS[part][0], io.RETRIEVAL_SCORES_FILE) or bool(entry["columns"])

    def path(self, name: str) -> str:
        return f"{self.file} ({name})"

    def lacking(self, name: str, made_by: str) -> str:
        return (f"{self.file} holds no scores of `{made_by}` ({name}): export them from a results folder where "
                f"`{made_by}` ran")

    def read_run(self) -> dict[str, Any]:
        """analyze's run.json as written, with the settings export reads checked as io.read_run checks them."""
        run = self.read_json(io.RUN_FILE, "attnprobe analyze")
        model, attention = run.get("model"), run.get("attention")
        numbers = [model.get(k) for k in ("layers", "heads", "kv_heads")] if isinstance(model, dict) else [None]
        numbers += [attention.get(k) for k in ("sink_tokens", "window")] if isinstance(attention, dict) else [None]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
            raise AttnprobeError(f"--from {self.file} holds a record of `attnprobe analyze` without its model's shape "
                                 "or its sink and window: the file was edited; export it again")
        return run

    def read_json(self, name: str, made_by: str) -> Any:
        if not self.has(name):
            raise AttnprobeError(self.lacking(name, made_by))
        _, entry = self._part(name)
        if name == io.RETRIEVAL_SCORES_FILE:
            return {f"{row.layer}-{row.head}": [float(v) for v in row.trials]
                    for row in self.frame[["layer", "head", TRIALS_COLUMN]].rename(
                        columns={TRIALS_COLUMN: "trials"}).itertuples()}
        return entry["record"]

    def read_table(self, name: str, columns: list[str], made_by: str) -> pd.DataFrame:
        if not self.has(name):
            raise AttnprobeError(self.lacking(name, made_by))
        part, entry = self._part(name)
        prefix = PARTS[part][3]
        keys = ["layer", "kv_head"] if part == "train-pattern" else ["layer", "head", "kv_head"]
        own = {prefix + c: c for c in entry["columns"]}
        frame = self.frame[keys + list(own)].rename(columns=own)
        if part == "train-pattern":  # one row per KV head, as gates.csv
            frame = frame.drop_duplicates(subset=["layer", "kv_head"]).reset_index(drop=True)
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise AttnprobeError(f"{self.file} lacks {made_by}'s column(s) {', '.join(missing)}: export it again from "
                                 "the results folder")
        return frame

    def recorded(self, record: dict[str, Any], name: str) -> bool:
        return True  # the file was checked whole when it was written and when it was read


def gather(files: FolderFiles | ScoreFile) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Every head score `files` holds, one row per layer and query head, and the metadata record (see the module's
    docstring). Refused in one line where the commands' records disagree on the model or a table is damaged."""
    from attnprobe import __version__

    parts: dict[str, dict[str, Any]] = {}
    tables: dict[str, pd.DataFrame] = {}
    model = None
    for part, (run_file, table_file, made_by, _) in PARTS.items():
        if not files.has(run_file):
            continue
        record = files.read_run() if part == "analyze" else files.read_json(run_file, made_by)
        if not isinstance(record.get("model"), dict):
            raise AttnprobeError(f"{files.path(run_file)} lacks its model: run `{made_by}` again")
        model = _same_model(model, record["model"], files.path(run_file))
        entry: dict[str, Any] = {"record": record, "columns": []}
        if files.has(table_file):
            if not files.recorded(record, table_file):
                raise AttnprobeError(f"{files.path(table_file)} was not written by the run that wrote {run_file} (its "
                                     f"sha256 differs from the one recorded): run `{made_by}` again")
            table = files.read_table(table_file, ["gate"] if part == "train-pattern" else ["layer", "head"], made_by)
            if part == "train-pattern":
                table = _kv_keys(table, files.path(table_file))
            entry["columns"] = [c for c in table.columns if c not in KEYS]
            tables[part] = table
        if part == "retrieval" and files.has(io.RETRIEVAL_SCORES_FILE):
            entry["trials"] = True
            tables["trials"] = _trials_frame(files.read_json(io.RETRIEVAL_SCORES_FILE, made_by),
                                             files.path(io.RETRIEVAL_SCORES_FILE))
        parts[part] = entry
    if model is None:
        raise AttnprobeError(f"{files.where} holds no run of `attnprobe analyze`, `retrieval` or `train-pattern`: "
                             "run one with --out first")
    frame = _rows(model, tables, files)
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, "written_by": "attnprobe export",
              "attnprobe_version": __version__, "model": model, "parts": parts}
    return frame, record


def _same_model(model: dict[str, Any] | None, other: dict[str, Any], where: str) -> dict[str, Any]:
    """The model of the first record, checked against each other's: the same shape and a name in common."""
    shape = ("layers", "heads", "kv_heads")
    kept = {k: other.get(k) for k in ("spec", "source", "revision", "weights", "architecture", *shape)}
    if not all(isinstance(kept[k], int) and not isinstance(kept[k], bool) and kept[k] >= 1 for k in shape) \
            or kept["heads"] % kept["kv_heads"]:
        raise AttnprobeError(f"{where} holds a model shape that is not whole numbers with kv_heads dividing heads: "
                             "run the command that made it again")
    if model is None:
        return kept
    same_name = {model["spec"], model.get("source")} & {kept["spec"], kept.get("source")} - {None}
    if [model[k] for k in shape] != [kept[k] for k in shape] or not same_name:
        raise AttnprobeError(f"{where} is of {kept['spec']}, the folder's other results of {model['spec']}: one "
                             "file holds one model's heads; move the other model's results away")
    return model | {k: v for k, v in kept.items() if model.get(k) is None}


def _kv_keys(table: pd.DataFrame, where: str) -> pd.DataFrame:
    """gates.csv with its layer and kv_head checked as whole numbers of 0 or more (io.read_table keys a table by
    layer and head, which gates.csv does not have)."""
    for column in ("layer", "kv_head"):
        values = pd.to_numeric(table[column], errors="coerce") if column in table.columns else None
        if values is None or not (np.isfinite(values) & (values >= 0) & (values == np.round(values))).all():
            raise AttnprobeError(f"{where} has no {column} column or one that is not whole numbers of 0 or more: run "
                                 "`attnprobe train-pattern` again")
    return table.astype({"layer": np.int64, "kv_head": np.int64})


def _trials_frame(trials: Any, where: str) -> pd.DataFrame:
    """head_score.json's {"L-H": [scores]} as rows (layer, head, trials)."""
    if not isinstance(trials, dict):
        raise AttnprobeError(f"{where} is not retrieval's per-trial scores: run `attnprobe retrieval` again")
    rows = []
    for name, values in trials.items():
        layer, _, head = str(name).partition("-")
        if not (layer.isdigit() and head.isdigit()) or not isinstance(values, list) \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise AttnprobeError(f"{where} holds {name!r}, not \"layer-head\" with a list of numbers: run "
                                 "`attnprobe retrieval` again")
        rows.append({"layer": int(layer), "head": int(head), TRIALS_COLUMN: [float(v) for v in values]})
    return pd.DataFrame(rows, columns=["layer", "head", TRIALS_COLUMN])


def _rows(model: dict[str, Any], tables: dict[str, pd.DataFrame], files: Any) -> pd.DataFrame:
    """One row per (layer, query head) of the model, each table's columns joined on (its prefix added)."""
    layers, heads, kv_heads = model["layers"], model["heads"], model["kv_heads"]
    frame = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers)})
    frame["kv_head"] = frame["head"] // (heads // kv_heads)
    for part, table in tables.items():
        keys = ["layer", "kv_head"] if part == "train-pattern" else ["layer", "head"]
        prefix = "" if part == "trials" else PARTS[part][3]
        expected = layers * (kv_heads if part == "train-pattern" else heads)
        name = files.path(io.RETRIEVAL_SCORES_FILE if part == "trials" else PARTS[part][1])
        inside = table[keys[1]].lt(kv_heads if part == "train-pattern" else heads) & table["layer"].lt(layers)
        if len(table) != expected or not inside.all() or table.duplicated(keys).any():
            raise AttnprobeError(f"{name} holds {len(table)} rows, not one for each of the model's {expected} "
                                 f"{'KV ' if part == 'train-pattern' else ''}heads (it is from another run): run "
                                 f"`{PARTS['retrieval' if part == 'trials' else part][2]}` again")
        own = table.drop(columns=[c for c in KEYS if c in table.columns and c not in keys])
        own = own.rename(columns={c: prefix + c for c in own.columns if c not in keys})
        frame = frame.merge(own, on=keys, how="left", validate="many_to_one")
    return frame


def writer(frame: pd.DataFrame, record: dict[str, Any]) -> io.Writer:
    """A Writer (io.write_files) of head_scores.parquet: the table with its metadata."""

    def write(path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(frame, preserve_index=False)
        model = record["model"]
        flat = {METADATA_KEY: json.dumps(record, allow_nan=True), "attnprobe.version": record["attnprobe_version"],
                "attnprobe.format_version": str(FORMAT_VERSION),
                **{f"model.{key}": "" if model.get(field) is None else str(model[field])
                   for key, field in (("name", "spec"), ("source", "source"), ("revision", "revision"),
                                      ("weights", "weights"))}}
        metadata = {**(table.schema.metadata or {}), **{k.encode(): v.encode() for k, v in flat.items()}}
        pq.write_table(table.replace_schema_metadata(metadata), path)

    return write


def read_score_file(path: str | Path) -> ScoreFile:
    """head_scores.parquet, checked: a parquet file with attnprobe's metadata of this format version, every column
    its record names, one row per layer and query head of its model. Anything else is one line naming --from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    again = f"pass a {FILE_NAME} that `attnprobe export --format head-scores` wrote"
    if not path.is_file():
        raise AttnprobeError(f"--from {path} is not a file: {again}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise AttnprobeError(f"--from {path} is not a parquet file ({str(err).splitlines()[0] if str(err) else err}): "
                             f"{again}") from None
    raw = (table.schema.metadata or {}).get(METADATA_KEY.encode())
    try:
        record = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise AttnprobeError(f"--from {path} is a parquet file but not attnprobe's head scores (no `{METADATA_KEY}` "
                             f"metadata of this format): {again}")
    version = record.get("format_version")
    if version != FORMAT_VERSION:
        raise AttnprobeError(f"--from {path} is attnprobe head scores of format version {version!r}, written by "
                             f"attnprobe {record.get('attnprobe_version')}; this attnprobe reads version "
                             f"{FORMAT_VERSION}: export it again with this attnprobe, or read it with the one that "
                             "wrote it")
    model, parts = record.get("model"), record.get("parts")
    if not isinstance(model, dict) or not isinstance(parts, dict) or not parts \
            or not all(p in PARTS and isinstance(e, dict) and isinstance(e.get("record"), dict)
                       and isinstance(e.get("columns"), list) for p, e in parts.items()):
        raise AttnprobeError(f"--from {path} holds attnprobe metadata without its model or its commands' records: "
                             "the file was edited; export it again")
    model = _same_model(None, model, f"--from {path}")
    frame = table.to_pandas()
    needed = list(KEYS) + [PARTS[p][3] + c for p, e in parts.items() for c in e["columns"]]
    needed += [TRIALS_COLUMN] if parts.get("retrieval", {}).get("trials") else []
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise AttnprobeError(f"--from {path} lacks column(s) {', '.join(missing[:5])}: the file was edited; export "
                             "it again")
    _check_rows(frame, model, path)
    return ScoreFile(path, frame, record)


def _check_rows(frame: pd.DataFrame, model: dict[str, Any], path: Path) -> None:
    """One row per (layer, query head) of the model, kv_head the one it reads."""
    layers, heads, kv_heads = model["layers"], model["heads"], model["kv_heads"]
    for column in KEYS:
        values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float)
        if not (np.isfinite(values) & (values >= 0) & (values == np.round(values))).all():
            raise AttnprobeError(f"--from {path} has a {column} that is not a whole number of 0 or more: the file was "
                                 "edited; export it again")
        frame[column] = values.astype(np.int64)
    expected = set(zip(np.repeat(np.arange(layers), heads).tolist(), np.tile(np.arange(heads), layers).tolist()))
    found = list(zip(frame["layer"].tolist(), frame["head"].tolist()))
    if len(found) != len(expected) or set(found) != expected \
            or not (frame["kv_head"] == frame["head"] // (heads // kv_heads)).all():
        raise AttnprobeError(f"--from {path} does not hold one row for each of its model's {layers} x {heads} heads "
                             "with the KV head each reads: the file was edited; export it again")
