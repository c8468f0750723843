"""`attnprobe export`: the heads that need a full KV cache, in the files KV-cache compression tools load."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from attnprobe.commands.common import friendly_errors, out_console, say_written
from attnprobe.commands.options import DEFAULT_OUT, folder


class ExportFormat(str, Enum):
    duo_attention = "duo-attention"
    retrieval_head = "retrieval-head"


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
        Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder to read the scores from: "
                           "`attnprobe retrieval`'s and `attnprobe analyze`'s (see --scores).")
    ] = DEFAULT_OUT,
    format: Annotated[
        ExportFormat, typer.Option("--format", help="duo-attention: full_attention_heads.tsv [layer, KV head] and "
                                   "config.json, as DuoAttention and kvpress's DuoAttentionPress load them; "
                                   "retrieval-head: Wu et al.'s {\"L-H\": [scores]} JSON (HeadKV reads it too).")
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
) -> None:
    """Write the heads that need a full KV cache in the files KV-cache compression tools load."""
    from attnprobe import export as exporting

    head_scores = exporting.load_scores(out, scores.value, sink_size, recent_size)
    written = exporting.write_export(to, head_scores, format.value)
    model = head_scores.model
    what = exporting.source_words(head_scores)
    sizes = f"; sink {head_scores.sink}, recent {head_scores.recent} (from {head_scores.sizes_from})" \
        if format is ExportFormat.duo_attention else ""
    out_console.print(f"{model['spec']}: {model['layers']} layers x {model['kv_heads']} KV heads "
                      f"({model['heads']} query heads) from {what}{sizes}", markup=False, highlight=False,
                      soft_wrap=True)
    say_written(written)
