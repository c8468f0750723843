"""Writing into a results folder: the checks before (the folder, the run's inputs), every file under a temporary
name and then renamed into place (write_files; sentences.parquet streamed by SentenceWriter), what each command
writes, and the cleanup of what a killed run or an earlier analysis left.

The format writers are reached through the package (io.csv_writer, ...), as every caller reaches them: one replaced
there (a test's full disk) writes every file of every command."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from attnprobe.errors import AttnprobeError
from attnprobe.io.names import (
    ABLATE_PLOT_FIGURES,
    ABLATE_RUN_FILE,
    COMPARE_FIGURE,
    COMPARE_FOLDER,
    COMPARE_HEADS_FILE,
    COMPARE_LAYERS_FILE,
    COMPARE_RUN_FILE,
    COMPARE_TYPES_FILE,
    COMPOSITION_FIGURE,
    COMPOSITION_FILE,
    COMPOSITION_RUN_FILE,
    FIGURE_FORMATS,
    IMPORTANCE_FILE,
    KV_CACHE_FILE,
    LAYER_IMPORTANCE_FILE,
    PATCH_RUN_FILE,
    PATCHING_FIGURE,
    PATCHING_FILE,
    PLOT_FIGURES,
    PRUNING_FILE,
    REPORT_FILE,
    RETRIEVAL_FILE,
    RETRIEVAL_RUN_FILE,
    RETRIEVAL_SCORES_FILE,
    ROLLOUT_FIGURE,
    ROLLOUT_FILE,
    RUN_FILE,
    RUN_FILES_KEY,
    SENTENCES_FILE,
    SIMILARITY_FILE,
    STREAMING_FIGURE,
    STREAMING_FILE,
    STREAMING_RUN_FILE,
    TYPES_FILE,
    is_result_name,
)
from attnprobe.io.writers import Writer
from attnprobe.pids import alive


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


def _check_writable(folder: Path, option: str = "--out") -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise AttnprobeError(f"{option} {folder} is not writable ({err.strerror}): pass another folder") from err


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


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


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


def write_run(out: str | Path, writers: dict[str, Writer], run: dict[str, Any], remove: Iterable[str] = (),
              written: Iterable[Path] = ()) -> list[Path]:
    """analyze's results (`writers`) and, last, run.json: `run` with `files`, the sha256 of every file of this run
    by name (those of `writers`, from their temporary files, and those already `written` in `out`, such as
    sentences.parquet). One write_files: all temporary files, then all renames, run.json's the last."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)
    from attnprobe.sources import file_sha256

    before = {Path(path).name: file_sha256(Path(path)) for path in written}

    def stamped(hashes: dict[str, str]) -> Writer:
        return io.json_writer({**run, RUN_FILES_KEY: {**hashes, **before}})

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


def write_report(out: str | Path, html: str) -> Path:
    """report.html (temporary name, then renamed)."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    return write_files(out, {REPORT_FILE: io.text_writer(html)})[0]


def write_ablation(out: str | Path, ablation: Any, figures: dict[str, Any]) -> list[Path]:
    """What `attnprobe ablate` writes (an ablate.Ablation and its figures), each to a temporary name, then renamed.

    A layer_importance.csv or pruning.csv of an earlier run that this one did not make is removed, and so are
    the figures `plot` drew of them (pruning.png, layer_importance.png in any format): they show the earlier run.
    """
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    files: dict[str, Writer] = {IMPORTANCE_FILE: io.csv_writer(ablation.heads),
                                ABLATE_RUN_FILE: io.json_writer(ablation.run)}
    stale = [name for name in (f"{stem}.{suffix}" for stem in ABLATE_PLOT_FIGURES for suffix in FIGURE_FORMATS)
             if (Path(out) / name).is_file()]
    for name, frame in ((LAYER_IMPORTANCE_FILE, ablation.layers), (PRUNING_FILE, ablation.pruning)):
        if frame is None:
            stale.append(name)
        else:
            files[name] = io.csv_writer(frame)
    files.update({name: io.figure_writer(figure) for name, figure in figures.items()})
    return write_files(out, files, remove=stale)


def write_streaming(out: str | Path, ablation: Any, figure: Any) -> list[Path]:
    """streaming.csv, streaming.json and streaming.png for `attnprobe ablate --method streaming` (a
    streamheads.StreamingAblation and its figure), each to a temporary name, then renamed."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    return write_files(out, {STREAMING_FILE: io.csv_writer(ablation.curve),
                             STREAMING_RUN_FILE: io.json_writer(ablation.run),
                             STREAMING_FIGURE: io.figure_writer(figure)})


def write_patching(out: str | Path, patching: Any, figure: Any) -> list[Path]:
    """patching.csv, patch.json and patching.png for `attnprobe patch` (a patching.Patching and its figure), each to
    a temporary name, then renamed: a run stopped before this point leaves the folder as it was."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    return write_files(out, {PATCHING_FILE: io.csv_writer(patching.table), PATCH_RUN_FILE: io.json_writer(patching.run),
                             PATCHING_FIGURE: io.figure_writer(figure)})


def write_retrieval(out: str | Path, retrieval: Any) -> list[Path]:
    """retrieval.json, and where any trial counted retrieval_heads.csv and head_score.json (else those of an
    earlier run go: they are not this run's)."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    files: dict[str, Writer] = {RETRIEVAL_RUN_FILE: io.json_writer(retrieval.info)}
    stale: list[str] = []
    if retrieval.per_trial:
        files[RETRIEVAL_FILE] = io.csv_writer(retrieval.heads)
        files[RETRIEVAL_SCORES_FILE] = io.compact_json_writer(retrieval.per_trial)
    else:
        stale = [RETRIEVAL_FILE, RETRIEVAL_SCORES_FILE]
    return write_files(out, files, remove=stale)


def write_rollout(out: str | Path, rollout: Any, figure: Any) -> list[Path]:
    """rollout.npz and rollout.png for `attnprobe rollout` (a rollout.Rollout), each to a temporary name, then renamed.

    Sentences differ in length, so every per-sentence array has a leading [sentence] axis and is
    padded to the longest: maps with NaN, tokens with "". `lengths` gives each sentence's tokens kept.
    """
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

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
        "bos": np.asarray(str(rollout.info.get("bos", ""))),  # --bos: auto, always or never ("": not recorded)
        "dtype": np.asarray(str(rollout.info.get("dtype", ""))),  # the dtype it ran in
    }
    return write_files(out, {ROLLOUT_FILE: io.npz_writer(**arrays), ROLLOUT_FIGURE: io.figure_writer(figure)})


def write_similarity(out: str | Path, similarity: Any) -> list[Path]:
    """head_similarity.npz for `attnprobe related` (a similarity.HeadSimilarity), to a temporary name, then renamed.

    Keys: `js` [head, head] float64 (nats), `layer` and `head` [head] int64 (the matrix's rows, layer-major),
    `sentences`, `rows`, `tokens`, `max_tokens`, `cut` (int64), `indices` [sentence] int64 (0-based corpus
    positions), `model` and `corpus_sha256` (strings), `causal` (bool), `threads` (int64, the torch threads it
    ran with), `sentences_asked` and `pair_rows` (int64: --sentences and the budget in head-pair rows that cut
    the sample to `sentences`; 0: no budget), `bos` and `dtype` (strings: the --bos and the dtype it ran with, which
    may differ from run.json's). No pickles: `np.load(path)` reads it.
    """
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

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
        "bos": np.asarray(str(info.get("bos", ""))),  # --bos it ran with ("": not recorded)
        "dtype": np.asarray(str(info.get("dtype", ""))),  # the dtype it ran in
    }
    return write_files(out, {SIMILARITY_FILE: io.npz_writer(**arrays)})


def write_composition(out: str | Path, table: Any, record: dict[str, Any], figure: Any) -> list[Path]:
    """composition.csv, composition.json and composition.png for `attnprobe compose`, each to a temporary name,
    then renamed."""
    from attnprobe import io  # the package: the writers are reached through it (tests patch them there)

    return write_files(out, {COMPOSITION_FILE: io.csv_writer(table), COMPOSITION_RUN_FILE: io.json_writer(record),
                             COMPOSITION_FIGURE: io.figure_writer(figure)})


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
