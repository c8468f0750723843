"""`attnprobe ablate`: each head's (and layer's) importance by ablation, gradient and pruning; --method streaming runs
commands/streaming.py."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from attnprobe.commands.common import (
    check_placement,
    err_console,
    friendly_errors,
    load,
    out_console,
    release_offload,
    say_written,
    set_bos,
    stage_progress,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BatchSizeOption,
    BosChoice,
    BosOption,
    CorpusOption,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    LimitOption,
    MaxMemoryOption,
    ModelOption,
    OutOption,
    SplitChoice,
    ThreadsOption,
    folder,
)
from attnprobe.errors import AttnprobeError
from attnprobe.naming import counted, head_name, visible
from attnprobe.threads import apply as apply_threads


class MethodChoice(str, Enum):
    zero = "zero"
    mean = "mean"
    streaming = "streaming"


STREAMING_ONLY = ("--pattern", "--sparsity", "--sink-size", "--recent-size", "--shares", "--client", "--task",
                  "--continuation", "--random-orders", "--haystack", "--needle", "--question", "--lengths",
                  "--depths")  # need --method streaming


@friendly_errors
def ablate(
    model: ModelOption,
    corpus: CorpusOption,
    out: OutOption = DEFAULT_OUT,
    method: Annotated[
        MethodChoice, typer.Option("--method", help="zero: an ablated head outputs 0; mean: its mean over the corpus; "
                                   "streaming: chosen KV heads see only the first --sink-size and last --recent-size "
                                   "keys (DuoAttention's streaming heads).")
    ] = MethodChoice.zero,
    heads: Annotated[str, typer.Option("--heads", help="all, or the heads to ablate, e.g. L0H1,L2H3 (or 0.1,2.3); "
                                       "with --method streaming, the KV heads to make streaming.")] = "all",
    layers: Annotated[bool, typer.Option("--layers", help="Also ablate each whole attention layer.")] = False,
    pruning: Annotated[
        bool, typer.Option("--pruning/--no-pruning", help="Also remove heads cumulatively (pruning.csv); with "
                           "--method streaming, the curve over --shares of KV heads streaming (--no-pruning: no "
                           "curve, so no --shares or --random-orders).")
    ] = True,
    pattern: Annotated[
        Path | None, typer.Option("--pattern", parser=folder, metavar="DIR", help="--method streaming: the heads' "
                                  "scores, an `attnprobe export --format duo-attention` folder (or an analyze --out "
                                  "folder); the lowest-scoring --sparsity share of KV heads become streaming.")
    ] = None,
    sparsity: Annotated[
        float | None, typer.Option("--sparsity", help="--method streaming with --pattern: the share of KV heads made "
                                   "streaming, lowest scores first (kvpress's head_compression_ratio).  [default: 0.5]",
                                   show_default=False)
    ] = None,
    sink_size: Annotated[
        int | None, typer.Option("--sink-size", metavar="S", help="--method streaming: the first keys a streaming "
                                 "head keeps (default: the pattern's config.json, else 128).")
    ] = None,
    recent_size: Annotated[
        int | None, typer.Option("--recent-size", metavar="W", help="--method streaming: the last keys a streaming "
                                 "head keeps, its own included (default: the pattern's config.json, else 256).")
    ] = None,
    shares: Annotated[
        str | None, typer.Option("--shares", help="--method streaming: the curve's shares of KV heads made "
                                 "streaming.  [default: 0,0.25,0.5,0.75,1]", show_default=False)
    ] = None,
    client: Annotated[
        str | None, typer.Option("--client", metavar="kvpress|duo-attention", help="--method streaming: whose "
                                 "streaming heads to model. kvpress (0.5.5's DuoAttentionPress): the context is "
                                 "prefilled in full, then what follows misses the context keys [S, L - W); "
                                 "duo-attention: sink + recent keys at every position.  [default: kvpress]",
                                 show_default=False)
    ] = None,
    task: Annotated[
        str | None, typer.Option("--task", metavar="both|text|needle", help="--method streaming: what to score. "
                                 "text: the corpus (kvpress: each document's last --continuation tokens after its "
                                 "context); needle: the needle answered after `retrieval`'s prompts.  [default: both]",
                                 show_default=False)
    ] = None,
    continuation: Annotated[
        int | None, typer.Option("--continuation", metavar="N", help="--method streaming --client kvpress: the "
                                 "tokens scored after each document's context.  [default: 64]", show_default=False)
    ] = None,
    random_orders: Annotated[
        int | None, typer.Option("--random-orders", metavar="N", help="--method streaming: random orders of the KV "
                                 "heads the curve compares with (their mean).  [default: 3]", show_default=False)
    ] = None,
    haystack: Annotated[
        Path | None, typer.Option("--haystack", metavar="FILE", help="--method streaming, needle task: the text the "
                                  "needle is hidden in [default: --corpus].", show_default=False)
    ] = None,
    needle: Annotated[
        str | None, typer.Option("--needle", metavar="TEXT", help="--method streaming, needle task: the sentence "
                                 "hidden and then scored as the answer [default: Wu et al.'s].", show_default=False)
    ] = None,
    question: Annotated[
        str | None, typer.Option("--question", metavar="TEXT", help="--method streaming, needle task: the question "
                                 "after the context [default: Wu et al.'s].", show_default=False)
    ] = None,
    lengths: Annotated[
        str | None, typer.Option("--lengths", metavar="N,N", help="--method streaming, needle task: prompt lengths "
                                 "in tokens (a repeat runs once).  [default: 1000,2000, those that fit]",
                                 show_default=False)
    ] = None,
    depths: Annotated[
        str | None, typer.Option("--depths", metavar="P,P", help="--method streaming, needle task: percent of the "
                                 "context before the needle (a repeat runs once).  [default: 0,25,50,75,100]",
                                 show_default=False)
    ] = None,
    split: Annotated[
        SplitChoice, typer.Option("--split", help="One sequence per line, per blank-line paragraph, or the whole file "
                                  "(long documents for --method streaming).")
    ] = SplitChoice.lines,
    batch_size: BatchSizeOption = 8,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    resamples: Annotated[
        int, typer.Option("--resamples", help="Bootstrap resamples of the sentences for the 95% intervals.")
    ] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap and the random pruning order.")] = 0,
    limit: LimitOption = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Ablate each head: loss change and KL (decoders) or embedding change (encoders), gradient importance, pruning;
    or make KV heads streaming (sink + recent keys only) and measure the loss change."""
    from attnprobe import io, plotting
    from attnprobe.ablate import ablate_loaded, check_settings, parse_heads
    from attnprobe.commands.folder import ResultsFolder
    from attnprobe.corpus import read_corpus

    streaming_options = (pattern, sparsity, sink_size, recent_size, shares, client, task, continuation,
                         random_orders, haystack, needle, question, lengths, depths)
    given = dict(zip(STREAMING_ONLY, streaming_options))
    if method is MethodChoice.streaming:
        from attnprobe.commands.streaming import StreamingOptions, ablate_streaming

        options = StreamingOptions(*streaming_options)
        return ablate_streaming(model, corpus, out, options, heads=heads, curve=pruning, layers=layers,
                                split=split.value, batch_size=batch_size, device=device.value, dtype=dtype.value,
                                device_map=device_map, max_memory=max_memory, resamples=resamples, seed=seed,
                                limit=limit, bos=bos.value, threads=threads)
    misplaced = [name for name, value in given.items() if value is not None]
    if misplaced:
        raise AttnprobeError(f"{misplaced[0]} applies to --method streaming only: add --method streaming, or drop "
                             f"{misplaced[0]}")
    check_settings(method.value, batch_size, resamples, seed)
    check_placement(device_map, max_memory)
    chosen = parse_heads(heads)
    folder = ResultsFolder(out, "ablate", {"--corpus": corpus, "--model": model})
    folder.check()
    sentences = read_corpus(corpus, split=split.value).head(limit)
    folder.take()  # the lock until the command ends, and what a killed run left swept
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    try:
        with stage_progress() as progress:
            result = ablate_loaded(loaded, sentences, method=method.value, heads=chosen, layers=layers,
                                   batch_size=batch_size, resamples=resamples, seed=seed, pruning=pruning,
                                   progress=progress)
    finally:
        release_offload(loaded)
    result.run["threads"] = threads_used
    title = f"{model} on {Path(corpus).name}, {method.value} ablation"
    shape = (result.run["model"]["layers"], result.run["model"]["heads"])  # the model's, whatever --heads chose
    written = io.write_ablation(out, result, {io.IMPORTANCE_FIGURE: plotting.importance_heatmap_figure(
        result.heads, title, shape)})
    folder.sweep()
    for note in result.run.get("notes", []):
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(importance_table(result.heads, result.run))
    say_written(written)


def importance_table(frame, run: dict) -> Table:
    """The five most and five least important heads, with the Spearman correlation of the gradient screen."""
    measure = run["measure"]
    ranked = frame.sort_values("rank")
    shown = ranked if len(ranked) <= 10 else ranked.iloc[list(range(5)) + list(range(len(ranked) - 5, len(ranked)))]
    rho = "n/a" if run["spearman"] is None else f"{run['spearman']:.3f}"
    heading = f"{run['model']['spec']}: {run['method']} ablation, {counted(run['sentences'], 'sentence')}"
    table = Table(title=Text(visible(heading)),
                  caption=f"rank 1 = most important; Spearman(gradient, {measure}) = {rho}")
    for column in ("rank", "head", measure, "95% interval", "gradient"):
        table.add_column(column, justify="right")
    for _, row in shown.iterrows():
        table.add_row(str(row["rank"]), head_name(row["layer"], row["head"]), f"{row[measure]:+.4f}",
                      f"[{row[f'{measure}_ci_low']:+.4f}, {row[f'{measure}_ci_high']:+.4f}]",
                      f"{row['gradient_importance']:.4f}")
    return table
