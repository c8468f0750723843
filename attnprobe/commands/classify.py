"""`attnprobe classify`: label each head from heads.csv (head_types.csv; the kv scheme's KV-cache estimate)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from attnprobe import defaults
from attnprobe.commands.common import err_console, friendly_errors, out_console, say_written
from attnprobe.commands.options import DEFAULT_OUT, ResultsOption
from attnprobe.errors import AttnprobeError


class SchemeChoice(str, Enum):
    default = "default"
    extended = "extended"
    kv = "kv"


@friendly_errors
def classify(
    out: ResultsOption = DEFAULT_OUT,
    scheme: Annotated[
        SchemeChoice, typer.Option(help="default: local/copy/broad/mixed; extended adds previous, sink and dormant; "
                                   "kv: streaming/full-cache from sink_window, with a KV-cache estimate.")
    ] = SchemeChoice.default,
    local_min_diagonal: Annotated[
        float, typer.Option(help="Local if at least this share of attention is within +-2 tokens "
                            "(over rows with keys outside the window).")
    ] = defaults.LOCAL_MIN_DIAGONAL,
    copy_max_entropy: Annotated[
        float, typer.Option(help="Copy if mean entropy (over rows with 2+ keys) is at most this (nats); "
                            "ln 2 = an even split over 2 tokens.  [default: ln 2 = 0.693]", show_default=False)
    ] = defaults.COPY_MAX_ENTROPY,
    broad_min_entropy_norm: Annotated[
        float, typer.Option(help="Broad if normalized entropy H/ln(k) is at least this.")
    ] = defaults.BROAD_MIN_ENTROPY_NORM,
    sink_min_first_token: Annotated[
        float, typer.Option(help="Extended: a copy head is a sink if more than this share goes to the first token "
                            "(over rows with 2+ keys).")
    ] = defaults.SINK_MIN_FIRST_TOKEN,
    previous_min_previous_token: Annotated[
        float, typer.Option(help="Extended: a local head is previous if at least this share goes to token i-1.")
    ] = defaults.PREVIOUS_MIN_PREVIOUS_TOKEN,
    streaming_min_sink_window: Annotated[
        float, typer.Option(help="kv: a head is streaming if at least this share sits on the sinks + recent window.")
    ] = defaults.STREAMING_MIN_SINK_WINDOW,
    dormant_max_output_ratio: Annotated[
        float, typer.Option(help="Extended: a sink is dormant if its output_norm is below this share of its layer's "
                            "median output_norm (where heads.csv has output_norm).")
    ] = defaults.DORMANT_MAX_OUTPUT_RATIO,
) -> None:
    """Label each head (local, copy, broad, mixed; extended; or kv) from heads.csv; write head_types.csv."""
    from attnprobe import io
    from attnprobe.classify import Thresholds, counts_per_layer, has_output_norm, required_columns
    from attnprobe.classify import classify as run_classify

    thresholds = Thresholds(
        local_min_diagonal, copy_max_entropy, broad_min_entropy_norm, sink_min_first_token, previous_min_previous_token,
        streaming_min_sink_window, dormant_max_output_ratio,
    )
    heads = io.read_table(out, io.HEADS_FILE, required_columns(scheme.value), "attnprobe analyze")
    if scheme is SchemeChoice.kv:
        types, estimate = classify_kv(out, heads, thresholds)
        files = {io.TYPES_FILE: io.csv_writer(types), io.KV_CACHE_FILE: io.json_writer(estimate)}
    else:
        types = run_classify(heads, thresholds, scheme.value)
        files = {io.TYPES_FILE: io.csv_writer(types)}
    stale = [] if scheme is SchemeChoice.kv else [io.KV_CACHE_FILE]  # from an earlier kv run
    written = io.write_files(out, files, remove=stale)
    counts = counts_per_layer(types)
    table = Table(title=f"Head types per layer ({scheme.value} scheme)")
    table.add_column("layer", justify="right")
    for kind in counts.columns:
        table.add_column(kind, justify="right")
    for layer, row in counts.iterrows():
        table.add_row(str(layer), *(str(int(v)) for v in row))
    table.add_row("all", *(str(int(v)) for v in counts.sum()), style="bold")
    out_console.print(table)
    if scheme is SchemeChoice.kv:
        out_console.print(kv_table(estimate))
    say_written(written)
    if scheme is SchemeChoice.extended and not has_output_norm(heads):
        err_console.print(f"Note: {io.HEADS_FILE} has no output_norm, so no sink is told apart as dormant: run "
                          "`attnprobe analyze` again (its value-weighted scores need the model's output projection; "
                          "run.json's value_weighted says why they are missing)", markup=False, highlight=False,
                          soft_wrap=True)


def classify_kv(out: Path, heads, thresholds) -> tuple:
    """The kv scheme needs the model's KV shape and the run's sink/window, from run.json."""
    from attnprobe import io
    from attnprobe.classify import classify as run_classify
    from attnprobe.classify import kv_cache_estimate

    run = io.read_run(out)
    model, attention = run["model"], run["attention"]
    if not model.get("causal", True):
        raise AttnprobeError(f"{model['spec']} is an encoder: it keeps no KV cache, so --scheme kv does not apply")
    types = run_classify(heads, thresholds, "kv", kv_heads=int(model["kv_heads"]))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(run.get("dtype", "float32"), 4)
    lengths = {"longest_sequence": int(run["longest_sequence"]), "32k": 32_768, "128k": 131_072}
    estimate = kv_cache_estimate(
        types, layers=int(model["layers"]), kv_heads=int(model["kv_heads"]), head_dim=int(model["head_dim"]),
        dtype_bytes=dtype_bytes, sink=int(attention["sink_tokens"]), window=int(attention["window"]),
        lengths=lengths,
    )
    estimate["model"] = model["spec"]
    estimate["threshold"] = {"streaming_min_sink_window": thresholds.streaming_min_sink_window}
    return types, estimate


def kv_table(estimate: dict) -> Table:
    counts, a = estimate["counts"], estimate["assumptions"]
    query_heads = counts["query_heads_streaming"] + counts["query_heads_full_cache"]
    table = Table(
        title=f"KV cache if streaming KV heads keep only {a['sink']} sink + {a['window']} recent tokens",
        caption=f"{counts['query_heads_streaming']} of {query_heads} query heads streaming; "
        f"{counts['kv_heads_streaming']} of {counts['kv_heads_total']} KV heads usable "
        "(all their query heads streaming). Attention mass, not accuracy.",
    )
    for column in ("sequence", "tokens", "full cache", "sink+window cache", "ratio"):
        table.add_column(column, justify="right")
    for name, row in estimate["lengths"].items():
        table.add_row(name, f"{row['tokens']:,}", _mib(row["full_bytes"]), _mib(row["streaming_bytes"]),
                      f"{row['ratio']:.3f}")
    return table


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
