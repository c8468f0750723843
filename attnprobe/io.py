"""The only module that touches the results folder: checks, atomic writes, validated reads."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe.errors import AttnprobeError, plain
from attnprobe.pids import alive

HEADS_FILE = "heads.csv"
LAYERS_FILE = "layers.csv"
RUN_FILE = "run.json"
EXAMPLE_FILE = "example_attention.npz"
EXAMPLES_FILE = "examples.npz"  # up to MAX_EXAMPLES example sentences' maps, for report.html (examples_writer)
MAX_EXAMPLES = 8
REPORT_FILE = "report.html"  # report: the run as one self-contained page
TYPES_FILE = "head_types.csv"
CATEGORIES_FILE = "categories.csv"
PROBE_FILE = "probe.csv"
PROBE_RUN_FILE = "probe.json"
PROBE_FIGURE = "probe_heatmap.png"
PROBE_FOLDER = "probe"  # probe's default --out is outputs/probe, beside analyze's outputs/
POSITIONS_FILE = "positions.csv"
TOP_TOKENS_FILE = "top_tokens.csv"  # analyze: per head, the key tokens with the highest lift
CHECKPOINT_FILE = "checkpoint.npz"  # a long run's progress; removed once it completes
SENTENCES_FILE = "sentences.parquet"  # analyze --per-sentence
KV_CACHE_FILE = "kv_cache.json"
RESAMPLES_FILE = "resamples.npz"  # per score, the bootstrap's resampled head means [resample, layer, head]
IMPORTANCE_FILE = "importance.csv"  # ablate: per head, what ablating it changes, and its gradient importance
LAYER_IMPORTANCE_FILE = "layer_importance.csv"  # ablate --layers: per layer, every head ablated at once
PRUNING_FILE = "pruning.csv"  # ablate: heads removed cumulatively, per order and percent
ABLATE_RUN_FILE = "ablate.json"  # ablate: provenance, settings, Spearman correlation
IMPORTANCE_FIGURE = "importance.png"
IMPORTANCE_TYPE_FIGURE = "importance_vs_type.png"
COMPARE_HEADS_FILE = "compare_heads.csv"  # compare: B - A per head (same shape only)
COMPARE_LAYERS_FILE = "compare_layers.csv"  # compare: per layer, or per point of relative depth
COMPARE_TYPES_FILE = "compare_types.csv"  # compare: head-type counts and fractions of both runs
COMPARE_RUN_FILE = "compare.json"  # compare: both runs' provenance, pairing and why, the top changes
COMPARE_FIGURE = "compare.png"
ROLLOUT_FILE = "rollout.npz"  # rollout: per example sentence, tokens, rollout and head-averaged maps
ROLLOUT_FIGURE = "rollout.png"
SIMILARITY_FILE = "head_similarity.npz"  # related: JS divergence of every pair of heads on a sample of sentences
SIMILARITY_FIGURE = "head_similarity.png"  # plot: that matrix, reordered by hierarchical clustering
HEAD_MAP_FIGURE = "head_map.png"  # plot: the heads in 2-D by classical multidimensional scaling
COMPARE_FOLDER = "compare"  # where `compare A OUT` writes by default
RETRIEVAL_FILE = "retrieval_heads.csv"  # retrieval: per query head, the mean retrieval score and its interval
RETRIEVAL_SCORES_FILE = "head_score.json"  # retrieval: Wu et al.'s {"L-H": [score per trial]}
RETRIEVAL_RUN_FILE = "retrieval.json"  # retrieval: provenance, settings, every trial and whether it copied
STREAMING_FILE = "streaming.csv"  # ablate --method streaming: the chosen heads and the curve over shares streaming
STREAMING_RUN_FILE = "streaming.json"  # ablate --method streaming: provenance, settings, the chosen heads' result
STREAMING_FIGURE = "streaming.png"
# `plot`'s figures, in any of FIGURE_FORMATS (importance.png is ablate's, drawn from importance.csv alone)
PLOT_FIGURES = ("entropy_heatmap", "layer_gradient", "head_patterns", "head_patterns_selected", "position_profile",
                "importance_vs_type", "head_similarity", "head_map")
# `plot`'s figures of ablate's pruning.csv and layer_importance.csv (an ablate run that remakes those removes them)
ABLATE_PLOT_FIGURES = ("pruning", "layer_importance")

TEXT_COLUMNS = ("head_type", "category")  # every other column a reader asks for must hold numbers

Writer = Callable[[Path], None]  # writes one file at the given (temporary) path


def check_out_dir(out: str | Path, option: str = "--out") -> Path:
    """Fail early if results could not be written to `out` (the folder of `option`, named in the message);
    creates nothing."""
    out = Path(out)
    _check_links(out, option)
    if out.exists() and not out.is_dir():
        raise AttnprobeError(f"{option} {out} is a file: pass a folder (it is created if missing)")
    if out.is_dir():
        _check_writable(out, option)
        return out
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AttnprobeError(f"{option} {out} cannot be created: {parent} is a file; pass another folder")
    _check_writable(parent, option)
    return out


def _check_links(out: Path, option: str = "--out") -> None:
    """Refuse an --out that is (or lies under) a symlink pointing nowhere or at itself: the folder could not be
    created, and only after the whole run."""
    path = out
    while True:
        try:
            path.stat()
            return  # exists (through any links): the first existing ancestor is reached
        except FileNotFoundError:
            pass
        except OSError as err:  # ELOOP: a symlink loop; ENOTDIR: a file in the path
            if err.errno == errno.ELOOP:
                raise AttnprobeError(f"{option} {out}: {path} is a symlink loop: remove it or pass another "
                                     "folder") from None
            return  # check_out_dir says what else is wrong
        if path.is_symlink():
            raise AttnprobeError(f"{option} {out}: {path} is a symlink to {os.readlink(path)}, which does not exist: "
                                 "remove the link, create its target, or pass another folder")
        if path.parent == path:
            return
        path = path.parent


def is_result_name(name: str) -> bool:
    """Whether attnprobe writes or removes a file of this name (relative to a results folder) in some command."""
    fixed = {HEADS_FILE, LAYERS_FILE, RUN_FILE, EXAMPLE_FILE, EXAMPLES_FILE, REPORT_FILE, TYPES_FILE, CATEGORIES_FILE,
             PROBE_FILE, PROBE_RUN_FILE, PROBE_FIGURE, POSITIONS_FILE, SENTENCES_FILE, KV_CACHE_FILE, RESAMPLES_FILE,
             IMPORTANCE_FILE, LAYER_IMPORTANCE_FILE, PRUNING_FILE, ABLATE_RUN_FILE, IMPORTANCE_FIGURE,
             IMPORTANCE_TYPE_FIGURE, ROLLOUT_FILE, ROLLOUT_FIGURE, TOP_TOKENS_FILE, RETRIEVAL_FILE,
             RETRIEVAL_SCORES_FILE, RETRIEVAL_RUN_FILE, STREAMING_FILE, STREAMING_RUN_FILE, STREAMING_FIGURE}
    fixed |= {f"{stem}.{suffix}" for stem in (*PLOT_FIGURES, *ABLATE_PLOT_FIGURES) for suffix in FIGURE_FORMATS}
    fixed |= {f"{PROBE_FOLDER}/{name}" for name in _PROBE_FILES}
    fixed |= {f"{COMPARE_FOLDER}/{name}" for name in (COMPARE_HEADS_FILE, COMPARE_LAYERS_FILE, COMPARE_TYPES_FILE,
                                                       COMPARE_RUN_FILE, COMPARE_FIGURE)}
    return name in fixed or bool(_CHECKPOINT_NAME.fullmatch(name))


# write_files' and SentenceWriter's: mkstemp's name after temp_prefix (the writer's pid), mkstemp's 8 characters
# (lowercase letters, digits, _) and .tmp. A name without the pid (as older versions wrote) is not taken for ours:
# it may be anybody's file, even the run's own corpus
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-[a-z0-9_]{8}\.tmp")
_PART_NAME = re.compile(r"\.sentences\.parquet\.rank\d+\.part")  # sentence_part's


def remove_stale_temps(out: str | Path, before: float, keep: Iterable[str | Path | None] = ()) -> list[str]:
    """Remove what a killed run of attnprobe left in `out`: temporary files of its own names, as write_files and
    SentenceWriter name them (`.heads.csv.1234-abc123_x.tmp`: a result file's name, the writer's pid, mkstemp's 8
    characters), and torchrun's sentence parts. A temporary file goes only when its writer's process is gone
    (another command may be writing it now, however long ago it began), or, when the writer was this process (or
    for a part), when it was last written before `before` (a time.time(): a file of a run going on now is newer).
    Nobody else's files: only names attnprobe itself makes (a name without the writer's pid, such as
    `.heads.csv.abcd1234.tmp`, is kept), and never a path of `keep` (the run's inputs: a corpus, a model file).
    Returns the names removed."""
    folder = Path(out)
    if not folder.is_dir():
        return []
    inputs = [Path(p) for p in keep if p is not None and str(p) and Path(p).exists()]
    removed = []
    for path in folder.iterdir():
        temp = _TEMP_NAME.fullmatch(path.name)
        ours = bool(temp and is_result_name(temp["name"])) or bool(_PART_NAME.fullmatch(path.name))
        pid = int(temp["pid"]) if temp else None
        try:
            if not ours or not path.is_file() or path.is_symlink() or any(_same_file(path, p) for p in inputs):
                continue
            if pid is not None and pid != os.getpid():
                stale = not alive(pid)
            else:
                stale = path.stat().st_mtime < before
            if stale:
                path.unlink()
                removed.append(path.name)
        except OSError:
            continue  # gone already, or not ours to remove
    return sorted(removed)


def _same_file(path: Path, other: Path) -> bool:
    try:
        return path.samefile(other)
    except OSError:
        return False


def temp_prefix(name: str) -> str:
    """The prefix of a temporary file that will be renamed to `name`: with this process's pid, so that a cleanup
    removes it only once its writer is gone (remove_stale_temps)."""
    return f".{name}.{os.getpid()}-"


def check_inputs_apart(out: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """Refuse a run whose results folder holds one of its inputs (option -> path) under a name attnprobe writes
    or removes there: the results would replace it. Checked as given and through symlinks."""
    folders = {Path(os.path.abspath(out)), Path(out).resolve()}
    for option, given in inputs.items():
        if given is None or not str(given) or not Path(given).exists():
            continue
        for path in {Path(os.path.abspath(given)), Path(given).resolve()}:
            for folder in folders:
                if path.is_relative_to(folder) and is_result_name(path.relative_to(folder).as_posix()):
                    raise AttnprobeError(
                        f"{option} {given} would be overwritten: it is in --out {out} under the name of a result "
                        f"file ({path.relative_to(folder).as_posix()}); move it, or pass another --out"
                    )


def write_files(out: str | Path, writers: dict[str, Writer], remove: Iterable[str] = (),
                last: tuple[str, Callable[[dict[str, str]], Writer]] | None = None,
                option: str = "--out") -> list[Path]:
    """Write every file to a temporary name, then rename them all into place.

    `remove` names files left by an earlier run that would now be wrong; they go once the rest is in place.
    `last`: (name, make_writer) of a file written after the others, from their sha256 by name (computed from the
    temporary files, before any rename: see `write_run`); it is renamed into place last. `option`: the option
    that named `out`, for the messages.
    """
    out = check_out_dir(out, option)
    staged: list[tuple[Path, Path]] = []
    current = out
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            current = out / name
            _stage(staged, current, write)
        if last is not None:
            hashes = {name: hash_file(tmp) for name, (tmp, _) in zip(writers, staged)}
            current = out / last[0]
            _stage(staged, current, last[1](hashes))
        mode = 0o666 & ~_umask()
        for tmp, final in staged:
            current = final
            os.chmod(tmp, mode)  # mkstemp makes 0600 files; results should read like any other file
            os.replace(tmp, final)
    except BaseException as err:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise write_error(current, err, option) from err
        raise
    for name in remove:
        (out / name).unlink(missing_ok=True)
    return [final for _, final in staged]


def _stage(staged: list[tuple[Path, Path]], final: Path, write: Writer) -> None:
    """Write one file of write_files under a temporary name beside `final` (appended to `staged` first, so that a
    failure removes it)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=temp_prefix(final.name), suffix=".tmp")
    os.close(fd)
    staged.append((Path(tmp), final))
    write(Path(tmp))


# analyze's result files: run.json's `files` records the sha256 of each it wrote, and the readers check it
RUN_FILES = (HEADS_FILE, LAYERS_FILE, EXAMPLE_FILE, EXAMPLES_FILE, RESAMPLES_FILE, POSITIONS_FILE, CATEGORIES_FILE,
             TOP_TOKENS_FILE, SENTENCES_FILE)
RUN_FILES_KEY = "files"


def write_run(out: str | Path, writers: dict[str, Writer], run: dict[str, Any], remove: Iterable[str] = (),
              written: Iterable[Path] = ()) -> list[Path]:
    """analyze's results (`writers`) and, last, run.json: `run` with `files`, the sha256 of every file of this run
    by name (those of `writers`, from their temporary files, and those already `written` in `out`, such as
    sentences.parquet). One write_files: all temporary files, then all renames, run.json's the last."""
    from attnprobe.sources import file_sha256

    before = {Path(path).name: file_sha256(Path(path)) for path in written}

    def stamped(hashes: dict[str, str]) -> Writer:
        return json_writer({**run, RUN_FILES_KEY: {**hashes, **before}})

    return write_files(out, writers, remove, last=(RUN_FILE, stamped))


def hash_file(path: Path) -> str:
    """The sha256 of a file, read afresh and not remembered: a temporary file about to be renamed into place (its
    name will not be read again), or a small file whose every edit must show (export's records). Large files in place
    go through sources.file_sha256, which remembers them across commands."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_files(out: str | Path) -> dict[str, str] | None:
    """run.json's `files` record in `out` (name -> sha256), or None where there is none (no run.json, or one
    written before attnprobe recorded them); a run.json that cannot be read gives None too: read_run says why."""
    path = Path(out) / RUN_FILE
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
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
    return record


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


def write_error(path: Path, err: OSError, option: str = "--out") -> AttnprobeError:
    """One line for a file that could not be written (a full disk, a quota, a read-only folder)."""
    reason = err.strerror or (str(err).splitlines()[0] if str(err).strip() else type(err).__name__)
    return AttnprobeError(f"cannot write {path} ({reason}); no half-written file is left: free some space or pass "
                          f"another {option}, and run again")


class SentenceWriter:
    """sentences.parquet, streamed: one row per (sentence, layer, head), row groups as batches finish.

    Written under a temporary name and renamed by `commit`; `discard` (or an exception inside the
    `with`) removes it, so an interrupted run leaves no half-written file.
    """

    ROWS_PER_GROUP = 65_536

    def __init__(self, out: str | Path, names: Iterable[str], tagged: bool = False, part: int | None = None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.out = check_out_dir(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.names, self.tagged = list(names), tagged  # tagged: a sentence without a category is "untagged"
        self.part = part  # under torchrun, this rank's number: commit() leaves a part for join_sentence_parts
        fields = [("sentence", pa.int64()), ("line", pa.int64()), ("category", pa.string()), ("layer", pa.int32()),
                  ("head", pa.int32())] + [(name, pa.float64()) for name in self.names]
        self.schema = pa.schema(fields)
        self.final = self.out / (SENTENCES_FILE if part is None else sentence_part(part))
        self.tmp: Path | None = None
        self.writer = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.out, prefix=temp_prefix(SENTENCES_FILE), suffix=".tmp")
            os.close(fd)
            self.tmp = Path(tmp)
            self.writer = pq.ParquetWriter(self.tmp, self.schema)
        except OSError as err:
            self.discard()
            raise write_error(self.final, err) from err
        self.pending: list[Any] = []
        self.pending_rows = 0

    def write(self, indices: list[int], values: dict[str, np.ndarray], sentences: list[Any]) -> None:
        """One batch: `values` per score [sentence, layer, head] for `sentences`, at these corpus `indices`."""
        import pyarrow as pa

        some = values[self.names[0]]
        n, layers, heads = some.shape
        sentence = np.repeat(np.asarray(indices, dtype=np.int64), layers * heads)
        labels = [s.category or "untagged" if self.tagged else s.category for s in sentences]
        columns = {
            "sentence": sentence,
            "line": np.repeat(np.asarray([s.line for s in sentences], dtype=np.int64), layers * heads),
            "category": [label for label in labels for _ in range(layers * heads)],
            "layer": np.tile(np.repeat(np.arange(layers, dtype=np.int32), heads), n),
            "head": np.tile(np.arange(heads, dtype=np.int32), n * layers),
        }
        missing = np.full(len(sentence), np.nan)  # a score this corpus has none of (special_tokens)
        columns.update({name: values[name].reshape(-1) if name in values else missing for name in self.names})
        self.pending.append(pa.table(columns, schema=self.schema))
        self.pending_rows += len(sentence)
        if self.pending_rows >= self.ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        try:
            if self.pending:
                self.writer.write_table(pa.concat_tables(self.pending))
        except OSError as err:
            self.discard()
            raise write_error(self.final, err) from err
        self.pending, self.pending_rows = [], 0

    def commit(self) -> Path:
        self._flush()
        try:
            self.writer.close()
            os.chmod(self.tmp, 0o666 & ~_umask())
            os.replace(self.tmp, self.final)
        except OSError as err:
            self.discard()
            raise write_error(self.final, err) from err
        return self.final

    def discard(self) -> None:
        """Close and remove the temporary file (once; a full disk failing the close again is no matter)."""
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                pass
            self.writer = None
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> SentenceWriter:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.discard()


def sentence_part(rank: int) -> str:
    """One rank's rows of sentences.parquet under torchrun, before rank 0 joins them."""
    return f".{SENTENCES_FILE}.rank{rank}.part"


def join_sentence_parts(out: str | Path, ranks: int) -> Path:
    """sentences.parquet from every rank's part, a row group at a time (temp + rename); the parts go."""
    import pyarrow.parquet as pq

    out = Path(out)
    parts = [out / sentence_part(rank) for rank in range(ranks)]
    schema = pq.read_schema(parts[0])

    def write(path: Path) -> None:
        with pq.ParquetWriter(path, schema) as writer:
            for part in parts:
                with pq.ParquetFile(part) as table:
                    for group in range(table.num_row_groups):
                        writer.write_table(table.read_row_group(group))

    written = write_files(out, {SENTENCES_FILE: write})
    for part in parts:
        part.unlink(missing_ok=True)
    return written[0]


def read_sentences(out: str | Path) -> Any:
    """sentences.parquet as a lazy pyarrow ParquetFile (`.iter_batches()`, `.read().to_pandas()`)."""
    import pyarrow.parquet as pq

    path = Path(out) / SENTENCES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {SENTENCES_FILE} in {out}: run `attnprobe analyze --per-sentence --out {out}`")
    check_written_by_run(out, SENTENCES_FILE)
    return pq.ParquetFile(path)


def csv_writer(frame: pd.DataFrame) -> Writer:
    return lambda path: frame.to_csv(path, index=False, float_format="%.8g")


def json_writer(data: dict[str, Any]) -> Writer:
    """Valid JSON always: a NaN or infinite number (a value that is undefined, such as an interval of too
    few sentences) is written as null; `allow_nan=False` makes sure no bare NaN slips through."""
    return lambda path: path.write_text(json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n",
                                        encoding="utf-8")


def finite_json(value: Any) -> Any:
    """`value` with every float that is NaN or infinite replaced by None (dicts, lists and tuples walked)."""
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    return value


def compact_json_writer(data: dict[str, Any]) -> Writer:
    """One line of JSON, as Wu et al.'s retrieval_head_detection.py writes its head scores (NaN refused)."""
    return lambda path: path.write_text(json.dumps(data, allow_nan=False) + "\n", encoding="utf-8")


def tsv_writer(table: np.ndarray) -> Writer:
    """A 2-D array as tab-separated numbers, one row per line, read back with np.loadtxt(..., delimiter="\t"):
    DuoAttention's full_attention_heads.tsv. Each number is Python's shortest repr of the float64, which reads back
    to the same float: export's tie-breaking steps (far below 8 digits on a large model) survive the round trip."""
    def write(path: Path) -> None:
        rows = np.atleast_2d(np.asarray(table, dtype=np.float64))
        path.write_text("".join("\t".join(repr(float(v)) for v in row) + "\n" for row in rows), encoding="utf-8")

    return write


def npz_writer(compress: bool = True, **arrays: np.ndarray) -> Writer:
    """`compress=False` for arrays zip cannot shrink much (bootstrap resamples: 27% smaller for 50x the time)."""
    def write(path: Path) -> None:
        with open(path, "wb") as handle:
            (np.savez_compressed if compress else np.savez)(handle, **arrays)

    return write


FIGURE_FORMATS = ("png", "svg", "pdf")


def figure_writer(figure: Any, format: str = "png", dpi: float = 120) -> Writer:
    """Save a matplotlib figure as png, svg or pdf (`dpi`: pixels per inch of a png and of images inside
    svg/pdf). A glyph no installed font has (matplotlib < 3.10 has no Last Resort font) warns nobody."""
    if format not in FIGURE_FORMATS:
        raise AttnprobeError(f"--format {format!r}: use one of {', '.join(FIGURE_FORMATS)}")

    def write(path: Path) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from", category=UserWarning)
            figure.savefig(path, format=format, dpi=dpi, bbox_inches="tight")

    return write


def read_table(out: str | Path, name: str, columns: Iterable[str], made_by: str) -> pd.DataFrame:
    """Read a results CSV, requiring `columns`; say which command makes it if it is missing."""
    path = Path(out) / name
    if not path.is_file():
        raise AttnprobeError(f"no {name} in {out}: run `{made_by} --out {out}` first")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise AttnprobeError(f"{path} is not a readable CSV ({err}); run `{made_by}` again") from err
    columns = list(columns)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise AttnprobeError(
            f"{path} lacks column(s) {', '.join(missing)}: it was not made by `{made_by}`; run it again"
        )
    if frame.empty:
        raise AttnprobeError(f"{path} has no rows: run `{made_by}` again")
    not_numbers = [c for c in columns if c not in TEXT_COLUMNS and not pd.api.types.is_numeric_dtype(frame[c])]
    if not_numbers:
        raise AttnprobeError(
            f"{path} has values that are not numbers in {', '.join(not_numbers)}: run `{made_by}` again"
        )
    for column in ("layer", "head", "bin"):
        if column in columns:
            values = frame[column].to_numpy(dtype=float)
            bad = ~(np.isfinite(values) & (values >= 0) & (values == np.round(values)))
            if bad.any():
                raise AttnprobeError(f"{path} has a {column} that is not a whole number of 0 or more "
                                     f"({plain(frame[column].iloc[int(np.argmax(bad))])}): run `{made_by}` again")
            frame[column] = frame[column].astype(np.int64)
    key = [c for c in ("category", "layer", "head", "bin") if c in columns]
    if key and frame.duplicated(key).any():
        raise AttnprobeError(f"{path} repeats a ({', '.join(key)}) row: run `{made_by}` again")
    check_written_by_run(out, name)  # last: a damaged file is named as damaged
    return frame


def read_columns(out: str | Path, name: str) -> list[str]:
    """The header of a results CSV (empty when it cannot be read; read_table then says why)."""
    try:
        return list(pd.read_csv(Path(out) / name, nrows=0).columns)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
        return []


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


def derived_files(out: str | Path) -> list[str]:
    """Files in `out` that classify, plot, report and compare made from the `analyze` run there (compare's in
    `out/compare`): a new analysis into `out` makes them wrong, so `analyze` removes them. Only those present."""
    names = [TYPES_FILE, KV_CACHE_FILE, REPORT_FILE,
             *(f"{stem}.{suffix}" for stem in PLOT_FIGURES for suffix in FIGURE_FORMATS),
             *(f"{COMPARE_FOLDER}/{name}" for name in
               (COMPARE_HEADS_FILE, COMPARE_LAYERS_FILE, COMPARE_TYPES_FILE, COMPARE_RUN_FILE, COMPARE_FIGURE))]
    return [name for name in names if (Path(out) / name).is_file()]


def remove_files(out: str | Path, names: Iterable[str]) -> None:
    """Remove these files of `out` (missing ones are fine), and `out/compare` once it is empty."""
    out = Path(out)
    for name in names:
        (out / name).unlink(missing_ok=True)
    folder = out / COMPARE_FOLDER
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


# what the commands that run a model themselves write, and the file that names their model
_PROBE_FILES = (PROBE_FILE, PROBE_RUN_FILE, PROBE_FIGURE)
MODEL_OUTPUTS = (
    ("ablate", ABLATE_RUN_FILE, (IMPORTANCE_FILE, LAYER_IMPORTANCE_FILE, PRUNING_FILE, ABLATE_RUN_FILE,
                                 IMPORTANCE_FIGURE)),
    ("probe", PROBE_RUN_FILE, _PROBE_FILES),
    ("probe", f"{PROBE_FOLDER}/{PROBE_RUN_FILE}", tuple(f"{PROBE_FOLDER}/{name}" for name in _PROBE_FILES)),
    ("rollout", ROLLOUT_FILE, (ROLLOUT_FILE, ROLLOUT_FIGURE)),
    ("related", SIMILARITY_FILE, (SIMILARITY_FILE,)),
    ("retrieval", RETRIEVAL_RUN_FILE, (RETRIEVAL_FILE, RETRIEVAL_SCORES_FILE, RETRIEVAL_RUN_FILE)),
    ("ablate --method streaming", STREAMING_RUN_FILE, (STREAMING_FILE, STREAMING_RUN_FILE, STREAMING_FIGURE)),
)


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


def read_json(out: str | Path, name: str, made_by: str) -> Any:
    """The JSON file `name` of `out`; say which command makes it when it is missing or unreadable."""
    path = Path(out) / name
    if not path.is_file():
        raise AttnprobeError(f"no {name} in {out}: run `{made_by} --out {out}` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `{made_by}` again") from err
    except RecursionError:
        raise AttnprobeError(f"{path} is unreadable (nested too deeply); run `{made_by}` again") from None
    if not isinstance(data, dict):
        raise AttnprobeError(f"{path} is not a JSON object ({type(data).__name__}): it was not made by `{made_by}`; "
                             "run it again")
    return data


def read_run(out: str | Path) -> dict[str, Any]:
    """run.json as `analyze` wrote it."""
    path = Path(out) / RUN_FILE
    run = read_json(out, RUN_FILE, "attnprobe analyze")
    needed = {"model": ("spec", "layers", "heads", "kv_heads", "head_dim"), "attention": ("sink_tokens", "window")}
    for section, keys in needed.items():
        if not isinstance(run.get(section), dict) or any(k not in run[section] for k in keys):
            raise AttnprobeError(f"{path} lacks {section} settings (made by an older attnprobe): run `attnprobe "
                                 "analyze` again")
    for section in ("summary", "bootstrap", "corpus"):
        if section in run and not isinstance(run[section], dict):
            raise AttnprobeError(f"{path} holds a {section} that is not an object: run `attnprobe analyze` again")
    numbers = [run["model"][k] for k in ("layers", "heads", "kv_heads", "head_dim")]
    numbers += [run["attention"][k] for k in ("sink_tokens", "window")] + [run.get("longest_sequence", 1)]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise AttnprobeError(f"{path} holds a model or attention setting that is not a whole number: run "
                             "`attnprobe analyze` again")
    if "longest_sequence" not in run:
        raise AttnprobeError(f"{path} lacks longest_sequence (made by an older attnprobe): run `attnprobe analyze` "
                             "again")
    return run


def checkpoint_name(rank: int = 0, size: int = 1, replacing: bool = False) -> str:
    """A process's checkpoint: checkpoint.npz, or under torchrun one per rank (checkpoint-rank1-of-2.npz).

    `replacing`: the name of a run started with --overwrite (checkpoint-overwrite.npz, ...-of-2-overwrite.npz):
    the stopped run's checkpoint it replaces stays in place until this run completes, so a kill before then
    loses neither."""
    name = "checkpoint" if size == 1 else f"checkpoint-rank{rank}-of-{size}"
    return f"{name}{REPLACING_SUFFIX if replacing else ''}.npz"


REPLACING_SUFFIX = "-overwrite"
_CHECKPOINT_NAME = re.compile(r"checkpoint(-rank\d+-of-\d+)?(-overwrite)?\.npz")  # checkpoint_name's only


def checkpoint_files(out: str | Path) -> list[str]:
    """Every checkpoint in `out`, of one process or of every rank, of a stopped run or of one that replaces it
    (files only: check_checkpoint_slots refuses anything else under such a name)."""
    folder = Path(out)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob("checkpoint*.npz")
                  if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_file())


def check_checkpoint_slots(out: str | Path) -> None:
    """Refuse a folder (or anything but a file) under a checkpoint's name in `out`: analyze saves there."""
    folder = Path(out)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("checkpoint*.npz")):
        if _CHECKPOINT_NAME.fullmatch(path.name) and not path.is_file():
            raise _not_a_checkpoint_file(path)


def _not_a_checkpoint_file(path: Path) -> AttnprobeError:
    what = "a folder" if path.is_dir() else "not a file"
    return AttnprobeError(f"{path} is {what}, not a checkpoint: move or rename it (analyze keeps a stopped run's "
                          "progress under that name), then run again")


def resumed_name(out: str | Path, rank: int = 0, size: int = 1) -> str:
    """The checkpoint --resume continues: the run that was replacing a stopped one (`checkpoint_name(...,
    replacing=True)`) where it left one, as it is the later; else the stopped run's."""
    replacing = checkpoint_name(rank, size, replacing=True)
    return replacing if (Path(out) / replacing).is_file() else checkpoint_name(rank, size)


def read_checkpoint(out: str | Path, name: str = CHECKPOINT_FILE) -> Any:
    """The checkpoint `analyze` left in `out` (this rank's `name` under torchrun), as a resume.State."""
    from attnprobe.resume import State

    path = Path(out) / name
    if path.exists() and not path.is_file():
        raise _not_a_checkpoint_file(path)
    if not path.is_file():
        others = checkpoint_files(out)
        if others:
            raise AttnprobeError(f"no {name} in {out}, but {', '.join(others)}: resume with as many processes as "
                                 "the stopped run (checkpoint.npz: one; checkpoint-rankR-of-N.npz: torchrun N)")
        raise AttnprobeError(f"no {name} in {out}: nothing to resume; run without --resume")
    import zipfile

    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with data:
            return State.from_arrays({key: data[key] for key in data.files}, str(path))
    except (OSError, EOFError, KeyError, ValueError, RecursionError, zipfile.BadZipFile) as err:
        reason = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise AttnprobeError(f"{path} is unreadable or damaged ({reason}): delete it and run without --resume") \
            from err


def read_example(out: str | Path) -> dict[str, Any] | None:
    """The example attention maps saved by `analyze`, or None when there are none."""
    path = Path(out) / EXAMPLE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens = [str(t) for t in data["tokens"]]
            total = int(data["total_tokens"]) if "total_tokens" in data else len(tokens)
            _check_maps(data["maps"], "maps")
            found = {"maps": data["maps"], "tokens": tokens, "sentence": str(data["sentence"]), "total_tokens": total}
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, EXAMPLE_FILE)
    return found


def _check_maps(maps: np.ndarray, name: str) -> None:
    """ValueError when the stored `maps` are not attention maps (maps.map_problem): never drawn as if they were."""
    from attnprobe.maps import map_problem

    problem = map_problem(maps)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


def examples_writer(examples: list[dict[str, Any]]) -> Writer:
    """examples.npz: several example sentences' maps, each with the layout of example_attention.npz.

    Each example is a dict with `maps` [layer, head, query, key] (float32 or float16; n x n for its first
    n tokens), `tokens` (n strings), `sentence`, and optionally `total_tokens` (before the cut; default n),
    `category` ("" for none), `index` (0-based in the corpus) and `line` (-1: unknown). The file holds
    `count` and, per example i, `maps_{i}`, `tokens_{i}`, `sentence_{i}`, `total_tokens_{i}`, `category_{i}`,
    `index_{i}` and `line_{i}`: no pickles, so `np.load(..., allow_pickle=False)` reads it.
    """
    if not 1 <= len(examples) <= MAX_EXAMPLES:
        raise ValueError(f"examples.npz holds 1 to {MAX_EXAMPLES} examples, not {len(examples)}")
    arrays: dict[str, np.ndarray] = {"count": np.asarray(len(examples), dtype=np.int64)}
    for i, example in enumerate(examples):
        maps, tokens = np.asarray(example["maps"]), [str(t) for t in example["tokens"]]
        n = len(tokens)
        if maps.ndim != 4 or maps.shape[2:] != (n, n):
            raise ValueError(f"example {i}: maps {maps.shape} is not [layer, head, {n}, {n}] for {n} tokens")
        arrays[f"maps_{i}"] = maps if maps.dtype in (np.float16, np.float32) else maps.astype(np.float32)
        arrays[f"tokens_{i}"] = np.asarray(tokens, dtype=str)
        arrays[f"sentence_{i}"] = np.asarray(str(example["sentence"]))
        arrays[f"total_tokens_{i}"] = np.asarray(int(example.get("total_tokens", n)), dtype=np.int64)
        arrays[f"category_{i}"] = np.asarray(str(example.get("category") or ""))
        arrays[f"index_{i}"] = np.asarray(int(example.get("index", -1)), dtype=np.int64)
        arrays[f"line_{i}"] = np.asarray(int(example.get("line", -1)), dtype=np.int64)
    return npz_writer(**arrays)


def read_examples(out: str | Path) -> list[dict[str, Any]]:
    """The example sentences' maps: examples.npz when `analyze` wrote one, else example_attention.npz's one
    example, else []. Each is a dict as `examples_writer` takes (maps as float32)."""
    path = Path(out) / EXAMPLES_FILE
    if not path.is_file():
        one = read_example(out)
        if one is None:
            return []
        return [{**one, "maps": np.asarray(one["maps"], dtype=np.float32), "category": "", "index": -1, "line": -1}]
    try:
        with np.load(path, allow_pickle=False) as data:
            examples = []
            for i in range(int(data["count"])):
                tokens = [str(t) for t in data[f"tokens_{i}"]]
                maps = np.asarray(data[f"maps_{i}"], dtype=np.float32)
                if maps.ndim != 4 or maps.shape[2:] != (len(tokens), len(tokens)):
                    raise ValueError(f"maps_{i} {maps.shape} does not fit its {len(tokens)} tokens")
                _check_maps(maps, f"maps_{i}")
                optional = {key: data[f"{key}_{i}"] for key in ("total_tokens", "category", "index", "line")
                            if f"{key}_{i}" in data}
                examples.append({
                    "maps": maps, "tokens": tokens, "sentence": str(data[f"sentence_{i}"]),
                    "total_tokens": int(optional.get("total_tokens", len(tokens))),
                    "category": str(optional.get("category", "")), "index": int(optional.get("index", -1)),
                    "line": int(optional.get("line", -1)),
                })
    except (OSError, KeyError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, EXAMPLES_FILE)
    return examples


def text_writer(text: str) -> Writer:
    return lambda path: path.write_text(text, encoding="utf-8")


def write_report(out: str | Path, html: str) -> Path:
    """report.html (temporary name, then renamed)."""
    return write_files(out, {REPORT_FILE: text_writer(html)})[0]


def read_resamples(out: str | Path) -> dict[str, np.ndarray]:
    """The bootstrap's resampled head means `analyze` saved: per score [resample, layer, head]."""
    path = Path(out) / RESAMPLES_FILE
    if not path.is_file():
        raise AttnprobeError(f"no {RESAMPLES_FILE} in {out}: run `attnprobe analyze --out {out}` again")
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {key: data[key] for key in data.files}
    except (OSError, ValueError) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `attnprobe analyze` again") from err
    check_written_by_run(out, RESAMPLES_FILE)
    return found


def read_compare(out: str | Path) -> tuple[dict[str, Any], pd.DataFrame | None, pd.DataFrame, pd.DataFrame | None]:
    """What `attnprobe compare` wrote into `out`: compare.json, and the heads (or None), layers and types tables."""
    path = Path(out) / COMPARE_RUN_FILE
    made_by = "attnprobe compare OUT_A OUT_B"
    info = read_json(out, COMPARE_RUN_FILE, made_by)
    if not isinstance(info, dict) or "pairing" not in info or "same_shape" not in info:
        raise AttnprobeError(f"{path} was not made by `{made_by}`: run it again")
    score = info.get("score", "entropy")
    heads = read_table(out, COMPARE_HEADS_FILE, ["layer", "head", f"{score}_diff"], made_by) \
        if info["same_shape"] else None
    layers = read_table(out, COMPARE_LAYERS_FILE, ["depth", f"{score}_diff"], made_by)
    types = read_table(out, COMPARE_TYPES_FILE, ["head_type", "fraction_a", "fraction_b"], made_by) \
        if (Path(out) / COMPARE_TYPES_FILE).is_file() else None
    return info, heads, layers, types


def write_ablation(out: str | Path, ablation: Any, figures: dict[str, Any]) -> list[Path]:
    """What `attnprobe ablate` writes (an ablate.Ablation and its figures), each to a temporary name, then renamed.

    A layer_importance.csv or pruning.csv of an earlier run that this one did not make is removed, and so are
    the figures `plot` drew of them (pruning.png, layer_importance.png in any format): they show the earlier run.
    """
    files: dict[str, Writer] = {IMPORTANCE_FILE: csv_writer(ablation.heads), ABLATE_RUN_FILE: json_writer(ablation.run)}
    stale = [name for name in (f"{stem}.{suffix}" for stem in ABLATE_PLOT_FIGURES for suffix in FIGURE_FORMATS)
             if (Path(out) / name).is_file()]
    for name, frame in ((LAYER_IMPORTANCE_FILE, ablation.layers), (PRUNING_FILE, ablation.pruning)):
        if frame is None:
            stale.append(name)
        else:
            files[name] = csv_writer(frame)
    files.update({name: figure_writer(figure) for name, figure in figures.items()})
    return write_files(out, files, remove=stale)


def write_streaming(out: str | Path, ablation: Any, figure: Any) -> list[Path]:
    """streaming.csv, streaming.json and streaming.png for `attnprobe ablate --method streaming` (a
    streamheads.StreamingAblation and its figure), each to a temporary name, then renamed."""
    return write_files(out, {STREAMING_FILE: csv_writer(ablation.curve), STREAMING_RUN_FILE: json_writer(ablation.run),
                             STREAMING_FIGURE: figure_writer(figure)})


def write_retrieval(out: str | Path, retrieval: Any) -> list[Path]:
    """retrieval.json, and where any trial counted retrieval_heads.csv and head_score.json (else those of an
    earlier run go: they are not this run's)."""
    files: dict[str, Writer] = {RETRIEVAL_RUN_FILE: json_writer(retrieval.info)}
    stale: list[str] = []
    if retrieval.per_trial:
        files[RETRIEVAL_FILE] = csv_writer(retrieval.heads)
        files[RETRIEVAL_SCORES_FILE] = compact_json_writer(retrieval.per_trial)
    else:
        stale = [RETRIEVAL_FILE, RETRIEVAL_SCORES_FILE]
    return write_files(out, files, remove=stale)


def write_rollout(out: str | Path, rollout: Any, figure: Any) -> list[Path]:
    """rollout.npz and rollout.png for `attnprobe rollout` (a rollout.Rollout), each to a temporary name, then renamed.

    Sentences differ in length, so every per-sentence array has a leading [sentence] axis and is
    padded to the longest: maps with NaN, tokens with "". `lengths` gives each sentence's tokens kept.
    """
    lengths = [len(tokens) for tokens in rollout.tokens]
    n, layers = max(lengths), rollout.rollout[0].shape[0]
    padded = np.full((len(lengths), layers, n, n), np.nan, dtype=np.float32)  # [sentence, layer, query, key]
    cumulative, attention = padded.copy(), padded.copy()  # [sentence, layer, query, key] each
    tokens = np.full((len(lengths), n), "", dtype=object)  # [sentence, token]
    for s, size in enumerate(lengths):
        cumulative[s, :, :size, :size] = rollout.rollout[s]  # [layer, query, key]
        attention[s, :, :size, :size] = rollout.attention[s]  # [layer, query, key]
        tokens[s, :size] = rollout.tokens[s]
    arrays = {
        "rollout": cumulative, "attention": attention, "raw": attention[:, -1],  # raw: [sentence, query, key]
        "tokens": tokens.astype(str), "lengths": np.asarray(lengths, dtype=np.int64),
        "total_tokens": np.asarray(rollout.total_tokens, dtype=np.int64),
        "sentence": np.asarray(rollout.sentences, dtype=str), "index": np.asarray(rollout.indices, dtype=np.int64),
        "residual": np.float64(rollout.residual), "model": np.asarray(str(rollout.info.get("model", ""))),
        "limit": np.int64(rollout.info.get("limit") or 0),  # --limit N: chosen among the first N; 0: no limit
        "threads": np.int64(rollout.info.get("threads") or 0),  # torch threads it ran with; 0: not recorded
    }
    return write_files(out, {ROLLOUT_FILE: npz_writer(**arrays), ROLLOUT_FIGURE: figure_writer(figure)})


def write_similarity(out: str | Path, similarity: Any) -> list[Path]:
    """head_similarity.npz for `attnprobe related` (a similarity.HeadSimilarity), to a temporary name, then renamed.

    Keys: `js` [head, head] float64 (nats), `layer` and `head` [head] int64 (the matrix's rows, layer-major),
    `sentences`, `rows`, `tokens`, `max_tokens`, `cut` (int64), `indices` [sentence] int64 (0-based corpus
    positions), `model` and `corpus_sha256` (strings), `causal` (bool), `threads` (int64, the torch threads it
    ran with), `sentences_asked` and `pair_rows` (int64: --sentences and the budget in head-pair rows that cut
    the sample to `sentences`; 0: no budget). No pickles: `np.load(path)` reads it.
    """
    info = similarity.info
    arrays = {
        "js": np.asarray(similarity.js, dtype=np.float64), "layer": np.asarray(similarity.layer, dtype=np.int64),
        "head": np.asarray(similarity.head, dtype=np.int64), "sentences": np.int64(similarity.sentences),
        "rows": np.int64(similarity.rows), "tokens": np.int64(similarity.tokens),
        "max_tokens": np.int64(similarity.max_tokens), "cut": np.int64(similarity.cut),
        "indices": np.asarray(similarity.indices, dtype=np.int64), "model": np.asarray(str(info.get("model", ""))),
        "corpus_sha256": np.asarray(str(info.get("corpus_sha256", ""))),
        "causal": np.asarray(bool(info.get("causal", True))),
        "threads": np.int64(info.get("threads") or 0),  # torch threads it ran with; 0: not recorded
        "sentences_asked": np.int64(info.get("sentences_asked") or similarity.sentences),  # --sentences
        "pair_rows": np.int64(info.get("pair_rows") or 0),  # the budget in head-pair rows; 0: none
    }
    return write_files(out, {SIMILARITY_FILE: npz_writer(**arrays)})


def read_similarity(out: str | Path) -> dict[str, Any] | None:
    """head_similarity.npz as `write_similarity` wrote it (None when `out` has none), checked: a square,
    symmetric, finite `js` of values in [0, ln 2] with a layer and head per row."""
    import zipfile

    path = Path(out) / SIMILARITY_FILE
    if not path.is_file():
        return None
    made_by = f"attnprobe related --out {out}"
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise AttnprobeError(f"{path} is unreadable ({err}); run `{made_by}` again") from err
    missing = [key for key in ("js", "layer", "head", "sentences", "rows", "model") if key not in found]
    if missing:
        raise AttnprobeError(f"{path} lacks {', '.join(missing)}: it was not made by `{made_by}`; run it again")
    js, layer, head = found["js"], found["layer"], found["head"]
    n = layer.shape[0] if layer.ndim == 1 else -1
    good = (js.ndim == 2 and js.shape == (n, n) and head.shape == (n,) and n > 0 and js.dtype.kind == "f"
            and layer.dtype.kind in "iu" and head.dtype.kind in "iu")
    if not good or not np.all(np.isfinite(js)) or np.any(js < 0) or np.any(js > np.log(2) + 1e-6) \
            or not np.allclose(js, js.T, rtol=0, atol=1e-9) or not np.allclose(np.diag(js), 0.0, rtol=0, atol=1e-9):
        # the diagonal is a head's JS with itself: exactly 0 as `related` writes it
        raise AttnprobeError(f"{path} does not hold a symmetric [head, head] matrix of JS divergences with a layer "
                             f"and head per row and 0 on its diagonal: run `{made_by}` again")
    found["model"] = str(found["model"])
    return found


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _check_writable(folder: Path, option: str = "--out") -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise AttnprobeError(f"{option} {folder} is not writable ({err.strerror}): pass another folder") from err
