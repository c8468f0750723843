"""`attnprobe related`: Jensen-Shannon divergence between every pair of heads' attention (head_similarity.npz)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from attnprobe.commands.common import (
    check_placement,
    err_console,
    friendly_errors,
    load,
    out_console,
    release_offload,
    set_bos,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BatchSizeOption,
    BosChoice,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    MaxMemoryOption,
    ResultsOption,
    ThreadsOption,
)
from attnprobe.errors import AttnprobeError
from attnprobe.naming import counted, head_name
from attnprobe.threads import apply as apply_threads

DTYPE_NAMES = tuple(choice.value for choice in DTypeChoice)  # --dtype's values: run.json's dtype is reused if one


@friendly_errors
def related(
    out: ResultsOption = DEFAULT_OUT,
    sentences: Annotated[
        int, typer.Option("--sentences", "-n", metavar="N", help="Sample at most N sentences of the run's corpus, "
                          "spread evenly over it.")
    ] = 200,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", metavar="N", help="Cut each sampled sentence to its first N tokens.")
    ] = 64,
    heads_option: Annotated[
        str | None, typer.Option("--heads", metavar="L17H4,L18H6", help="Also print these heads' 5 nearest heads.")
    ] = None,
    pair_rows: Annotated[
        int, typer.Option("--pair-rows", metavar="N", help="Sample fewer sentences when pairs of heads x query rows "
                          "would pass N, so a model of many heads finishes in minutes (0: no limit).")
    ] = 10**9,
    batch_size: BatchSizeOption = 8,
    device: DeviceOption = DeviceChoice.auto,
    bos: Annotated[
        BosChoice | None, typer.Option("--bos", help="BOS token, as for analyze (default: the run's, from run.json).")
    ] = None,
    dtype: Annotated[
        DTypeChoice | None, typer.Option("--dtype", help="Model precision (default: the dtype the run's run.json "
                                         "records as having run); auto: the checkpoint's own.")
    ] = None,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    threads: ThreadsOption = "auto",
) -> None:
    """Jensen-Shannon divergence between every pair of heads' attention on a sample of the run's corpus; write
    head_similarity.npz (plot draws it, report lists each head's nearest heads)."""
    from attnprobe import io, naming
    from attnprobe.similarity import NEAREST, check_same_weights, check_settings, head_similarity, run_corpus, run_model

    started = time.monotonic()
    check_settings(sentences, max_tokens, batch_size, pair_rows)
    check_placement(device_map, max_memory)
    chosen = naming.parse_heads(heads_option) if heads_option is not None else []
    run = io.read_run(out)
    naming.check_heads_exist(chosen, run["model"]["layers"], run["model"]["heads"])
    corpus = run_corpus(run, out)
    spec = run_model(run)
    threads_used = apply_threads(threads)
    ran = run.get("dtype", "float32")  # before --dtype auto, runs were float32 unless asked otherwise
    loaded = load(spec, device.value, dtype.value if dtype else ran if ran in DTYPE_NAMES else "auto", device_map,
                  max_memory)
    set_bos(loaded, bos.value if bos is not None else run_bos(run))
    if (loaded.num_layers, loaded.num_heads) != (run["model"]["layers"], run["model"]["heads"]):
        raise AttnprobeError(f"{spec} has {loaded.num_layers} x {loaded.num_heads} heads, but run.json in {out} "
                             f"records {run['model']['layers']} x {run['model']['heads']}: run `attnprobe analyze "
                             f"--out {out}` again")
    try:
        check_same_weights(run, loaded, out)
        with err_console.status(f"Comparing {loaded.num_layers * loaded.num_heads} heads"):
            result = head_similarity(loaded, corpus, sentences=sentences, max_tokens=max_tokens,
                                     batch_size=batch_size, pair_rows=pair_rows)
    finally:
        release_offload(loaded)
    result.info["model"] = run["model"]["spec"]  # as run.json names it, whatever path loaded it
    result.info["threads"] = threads_used["threads"]
    written = io.write_similarity(out, result)
    seconds = time.monotonic() - started
    out_console.print(similarity_table(result), soft_wrap=True)
    for layer, head in chosen:
        nearest = ", ".join(f"{head_name(other, index)} {value:.4f}"
                            for other, index, value in result.nearest(layer, head, NEAREST))
        out_console.print(f"{head_name(layer, head)}: nearest {nearest}", markup=False, highlight=False,
                          soft_wrap=True)
    cut = f", {result.cut} cut to {result.max_tokens} tokens" if result.cut else ""
    if len(result.indices) < min(sentences, len(corpus)):
        cut += (f" (not {sentences}: {result.js.shape[0]} heads keep pairs of heads x query rows within "
                f"--pair-rows {pair_rows})")
    out_console.print(f"{counted(result.sentences, 'sentence')}{cut}, {counted(result.rows, 'query row')}, "
                      f"{seconds:.1f} s", markup=False, highlight=False)
    out_console.print(f"Wrote {', '.join(str(p) for p in written)}", markup=False, highlight=False, soft_wrap=True)


def run_bos(run: dict) -> str:
    """The --bos a run.json records (auto for a run made before --bos existed)."""
    from attnprobe.tokens import BOS_POLICIES

    bos = run.get("bos", "auto")
    if bos not in BOS_POLICIES:
        raise AttnprobeError(f"run.json holds bos {bos!r}, not one of {', '.join(BOS_POLICIES)}: run `attnprobe "
                             "analyze` again, or pass --bos")
    return bos


def similarity_table(result) -> Table:
    """The ten most alike pairs of different heads, and the mean over all pairs."""
    import numpy as np

    js = result.js
    upper = np.triu_indices(js.shape[0], k=1)
    order = np.argsort(js[upper], kind="stable")[:10]
    mean = float(js[upper].mean()) if len(upper[0]) else float("nan")
    table = Table(title="Most alike heads (Jensen-Shannon divergence, nats; 0 = same attention, ln 2 = 0.693 = "
                  "disjoint)", caption=f"mean over all {len(upper[0])} pairs: {mean:.4f}")
    for column in ("head", "head", "JS"):
        table.add_column(column, justify="right")
    for k in order:
        a, b = upper[0][k], upper[1][k]
        table.add_row(head_name(result.layer[a], result.head[a]), head_name(result.layer[b], result.head[b]),
                      f"{js[a, b]:.4f}")
    return table
