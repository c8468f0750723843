"""`attnprobe export`: the heads that need a full KV cache, in the files KV-cache compression tools load."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from attnprobe.commands.common import friendly_errors, out_console, say_written
from attnprobe.commands.options import DEFAULT_OUT, folder
from attnprobe.defaults import BUDGET_MIN_KEPT as DEFAULT_MIN_KEPT
from attnprobe.defaults import BUDGET_RATIO as DEFAULT_RATIO
from attnprobe.errors import AttnprobeError


class ExportFormat(str, Enum):
    duo_attention = "duo-attention"
    retrieval_head = "retrieval-head"
    head_scores = "head-scores"
    layer_budgets = "layer-budgets"


class ExportScores(str, Enum):
    auto = "auto"
    retrieval = "retrieval"
    kv = "kv"
    trained = "trained"


@friendly_errors
def export(
    to: Annotated[
        Path, typer.Option("--to", parser=folder, metavar="PATH", help="Folder to write the exported files into "
                           "(created if missing).")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder to read the scores "
                                  "from: `attnprobe retrieval`'s, `attnprobe analyze`'s and `attnprobe "
                                  "train-pattern`'s (see --scores).  [default: outputs]", show_default=False)
    ] = None,
    source_file: Annotated[
        Path | None, typer.Option("--from", metavar="FILE", help="Read the scores from a head_scores.parquet "
                                  "(`--format head-scores`) instead of a results folder: every format comes out as "
                                  "from the folder it was written from.", show_default=False)
    ] = None,
    format: Annotated[
        ExportFormat, typer.Option("--format", help="duo-attention: full_attention_heads.tsv [layer, KV head] and "
                                   "config.json, as DuoAttention and kvpress's DuoAttentionPress load them; "
                                   "retrieval-head: Wu et al.'s {\"L-H\": [scores]} JSON (HeadKV reads it too); "
                                   "head-scores: head_scores.parquet, every head score of the run, one row per layer "
                                   "and head, to publish beside the model; layer-budgets: layer_budgets.json, the "
                                   "fraction of the cache each layer keeps, from analyze's entropy, for kvpress's "
                                   "PerLayerCompressionPress.")
    ] = ExportFormat.duo_attention,
    scores: Annotated[
        ExportScores, typer.Option("--scores", help="Per-head scores: retrieval (from `attnprobe retrieval`), kv "
                                   "(the far share (1 - sink_window) / (1 - first_token) from `attnprobe analyze`), "
                                   "trained (the gates of `attnprobe train-pattern`, one per KV head), or auto: "
                                   "trained where train-pattern ran into --out, else retrieval where it ran "
                                   "there, else kv.")
    ] = ExportScores.auto,
    sink_size: Annotated[
        int | None, typer.Option("--sink-size", metavar="S", help="config.json's sink_size, 0 to 10,000,000 "
                                 "(default: run.json's --sink-tokens; without run.json analyze's default 4).")
    ] = None,
    recent_size: Annotated[
        int | None, typer.Option("--recent-size", metavar="W", help="config.json's recent_size, 1 to 10,000,000 "
                                 "(default: run.json's --window; without run.json analyze's default 256).")
    ] = None,
    compression_ratio: Annotated[
        float | None, typer.Option("--compression-ratio", metavar="R", help="--format layer-budgets: the fraction "
                                   "of the context's KV entries removed over all layers, kvpress's meaning "
                                   f"(0 to 1 - --min-kept).  [default: {DEFAULT_RATIO:g}]", show_default=False)
    ] = None,
    min_kept: Annotated[
        float | None, typer.Option("--min-kept", metavar="F", help="--format layer-budgets: the least fraction of "
                                   f"its entries any layer keeps (above 0, up to 1).  [default: {DEFAULT_MIN_KEPT:g}]",
                                   show_default=False)
    ] = None,
) -> None:
    """Write the heads that need a full KV cache in the files KV-cache compression tools load, every head score of a
    run in one parquet file, or per-layer cache budgets."""
    from attnprobe import export as exporting
    from attnprobe import headscores

    check_options(format, scores, sink_size, recent_size, compression_ratio, min_kept)
    if source_file is not None and out is not None:
        raise AttnprobeError("--from and --out both name the scores to read: pass one of them")
    files = headscores.read_score_file(source_file) if source_file is not None else \
        exporting.as_files(DEFAULT_OUT if out is None else out)
    if format is ExportFormat.head_scores:
        return export_head_scores(to, files)
    if format is ExportFormat.layer_budgets:
        return export_budgets(to, files, DEFAULT_RATIO if compression_ratio is None else compression_ratio,
                              DEFAULT_MIN_KEPT if min_kept is None else min_kept)
    head_scores = exporting.load_scores(files, scores.value, sink_size, recent_size)
    written = exporting.write_export(to, head_scores, format.value)
    model = head_scores.model
    what = exporting.source_words(head_scores)
    sizes = f"; sink {head_scores.sink}, recent {head_scores.recent} (from {head_scores.sizes_from})" \
        if format is ExportFormat.duo_attention else ""
    out_console.print(f"{model['spec']}: {model['layers']} layers x {model['kv_heads']} KV heads "
                      f"({model['heads']} query heads) from {what}{sizes}", markup=False, highlight=False,
                      soft_wrap=True)
    say_written(written)


def check_options(format: ExportFormat, scores: ExportScores, sink_size: int | None, recent_size: int | None,
                  compression_ratio: float | None, min_kept: float | None) -> None:
    """Refuse an option the chosen format does not use, in one line."""
    per_head = format in (ExportFormat.duo_attention, ExportFormat.retrieval_head)
    given = {"--scores": scores is not ExportScores.auto, "--sink-size": sink_size is not None,
             "--recent-size": recent_size is not None}
    unused = [name for name, set_ in given.items() if set_ and not per_head]
    unused += [name for name, value in (("--compression-ratio", compression_ratio), ("--min-kept", min_kept))
               if value is not None and format is not ExportFormat.layer_budgets]
    if unused:
        raise AttnprobeError(f"{unused[0]} does nothing with --format {format.value}: drop it, or pick the format it "
                             "applies to (see `attnprobe export --help`)")


def export_head_scores(to: Path, files) -> None:
    """--format head-scores: write head_scores.parquet and say what it holds."""
    from attnprobe import export as exporting

    written, record = exporting.write_head_scores(to, files)
    model = record["model"]
    out_console.print(f"{model['spec']}: {model['layers']} layers x {model['heads']} heads, the scores of "
                      f"{', '.join(f'`{part}`' for part in record['parts'])} in one file", markup=False,
                      highlight=False, soft_wrap=True)
    say_written(written)


def export_budgets(to: Path, files, ratio: float, min_kept: float) -> None:
    """--format layer-budgets: write layer_budgets.json and say the range of the budgets."""
    from attnprobe import export as exporting

    written, record = exporting.write_budgets(to, files, ratio, min_kept)
    kept = record["kept"]
    out_console.print(f"{record['model']['spec']}: {len(kept)} layers keep {min(kept):.3f} to {max(kept):.3f} of "
                      f"their KV entries (mean {record['mean_kept']:.3f}: compression ratio {ratio:g}), from "
                      "analyze's entropy, for kvpress's PerLayerCompressionPress", markup=False, highlight=False,
                      soft_wrap=True)
    say_written(written)
