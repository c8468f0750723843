"""`attnprobe ablate --method streaming`: streaming.csv, streaming.json and streaming.png."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table
from rich.text import Text

from attnprobe.commands.common import (
    check_placement,
    err_console,
    interval,
    load,
    number_list,
    out_console,
    release_offload,
    say_written,
    set_bos,
    stage_progress,
)
from attnprobe.errors import AttnprobeError
from attnprobe.threads import apply as apply_threads


@dataclass(frozen=True)
class StreamingOptions:
    """The options of `ablate` that apply to --method streaming only, as given (None: not given)."""

    pattern: Path | None = None
    sparsity: float | None = None
    sink: int | None = None
    recent: int | None = None
    shares: str | None = None
    client: str | None = None
    task: str | None = None
    continuation: int | None = None
    random_orders: int | None = None
    haystack: Path | None = None
    needle: str | None = None
    question: str | None = None
    lengths: str | None = None
    depths: str | None = None


def ablate_streaming(model: str, corpus: Path, out: Path, options: StreamingOptions, *, heads: str, curve: bool,
                     layers: bool, split: str, batch_size: int, device: str, dtype: str, device_map: str | None,
                     max_memory: str | None, resamples: int, seed: int, limit: int | None, bos: str,
                     threads: str) -> None:
    from attnprobe import io, kvtasks, naming, plotting, streamheads
    from attnprobe import retrieval as rt
    from attnprobe.commands.folder import ResultsFolder
    from attnprobe.corpus import read_corpus
    from attnprobe.planning import check_options

    o = options
    if layers:
        raise AttnprobeError("--layers ablates whole layers, not streaming heads: drop --layers with --method "
                             "streaming")
    check_options(batch_size, resamples, seed)
    check_placement(device_map, max_memory)
    chosen = None if heads.strip().lower() == "all" else naming.parse_heads(heads)
    if o.pattern is not None and chosen is not None:
        raise AttnprobeError("--pattern and --heads both choose the streaming heads: pass one of them")
    if o.pattern is None and chosen is None:
        raise AttnprobeError("--method streaming needs the heads to make streaming: --pattern DIR (an `attnprobe "
                             "export --format duo-attention` folder) or --heads L0H1,... (KV heads)")
    if o.sparsity is not None and o.pattern is None:
        raise AttnprobeError("--sparsity picks the lowest-scoring share of a --pattern's KV heads: add --pattern DIR, "
                             "or drop --sparsity")
    idle = [name for name, value in (("--shares", o.shares), ("--random-orders", o.random_orders)) if value is not None]
    if idle and not curve:
        raise AttnprobeError(f"{idle[0]} sets the curve that --no-pruning leaves out: drop {idle[0]}, or drop "
                             "--no-pruning")
    share_list = streamheads.SHARES if o.shares is None else tuple(number_list(o.shares, float, "--shares"))
    if not share_list:
        raise AttnprobeError("--shares names no share: give e.g. 0,0.25,0.5,0.75,1")
    for name, value in (("--sparsity", o.sparsity), *(("--shares", s) for s in share_list)):
        if value is not None:
            streamheads.check_fraction(name, value)
    if o.sink is not None or o.recent is not None:
        of_pattern = "from the --pattern" if o.pattern is not None else None
        streamheads.check_sizes(streamheads.DUO_SINK if o.sink is None else o.sink,
                                streamheads.DUO_RECENT if o.recent is None else o.recent,
                                of_pattern or streamheads.DUO_SINK, of_pattern or streamheads.DUO_RECENT)
    client = o.client or "kvpress"
    kvtasks.check_choice("--client", client, kvtasks.CLIENTS)
    wanted = kvtasks.tasks_of(o.task or "both")
    continuation = kvtasks.CONTINUATION if o.continuation is None else o.continuation
    kvtasks.check_continuation(continuation)
    random_orders = streamheads.RANDOM_ORDERS if o.random_orders is None else o.random_orders
    streamheads.check_random_orders(random_orders)
    needle_options = {"--haystack": o.haystack, "--needle": o.needle, "--question": o.question,
                      "--lengths": o.lengths, "--depths": o.depths}
    if "needle" not in wanted:
        misplaced = [name for name, value in needle_options.items() if value is not None]
        if misplaced:
            raise AttnprobeError(f"{misplaced[0]} sets the needle task: add --task needle (or both), or drop "
                                 f"{misplaced[0]}")
    if o.continuation is not None and (client != "kvpress" or "text" not in wanted):
        raise AttnprobeError("--continuation applies to the text task of --client kvpress: drop it, or use "
                             "--client kvpress --task text (or both)")
    rt.check_text("--needle", o.needle)
    rt.check_text("--question", o.question)
    length_list = None if o.lengths is None else tuple(number_list(o.lengths, int, "--lengths"))
    depth_list = rt.DEFAULT_DEPTHS if o.depths is None else tuple(number_list(o.depths, float, "--depths"))
    rt.check_settings(list(length_list or kvtasks.NEEDLE_LENGTHS), list(depth_list), "forced", resamples)
    inputs = {"--corpus": corpus, "--model": model} | ({"--haystack": o.haystack} if o.haystack else {})
    folder = ResultsFolder(out, "ablate", inputs)
    folder.check()
    documents = read_corpus(corpus, split=split).head(limit)
    needle = None
    if "needle" in wanted:
        text, name = kvtasks.read_haystack(o.haystack, corpus)
        needle = streamheads.Needle(text, name, o.needle or rt.DEFAULT_NEEDLE, o.question or rt.DEFAULT_QUESTION,
                                    length_list, depth_list)
    folder.take()  # the lock until the command ends, and what a killed run left swept
    threads_used = apply_threads(threads)
    loaded = load(model, device, dtype, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos)
    try:  # a pattern of another model fails at once: streaming_ablate_loaded checks it before any measuring
        with stage_progress("sequences") as progress:
            result = streamheads.streaming_ablate_loaded(
                loaded, documents, pattern=o.pattern, heads=chosen,
                sparsity=streamheads.DEFAULT_SPARSITY if o.sparsity is None else o.sparsity, sink=o.sink,
                recent=o.recent, shares=share_list, curve=curve, batch_size=batch_size, resamples=resamples,
                seed=seed, progress=progress, client=client, task=o.task or "both", needle=needle,
                continuation=continuation, random_orders=random_orders)
    finally:
        release_offload(loaded)
    result.run["threads"] = threads_used
    run = result.run
    title = (f"{model}, {client} client: streaming heads keep {run['sink_size']} sink + {run['recent_size']} "
             "recent keys")
    written = io.write_streaming(out, result, plotting.streaming_figure(result.curve, title))
    folder.sweep()
    for note in run.get("notes", []):
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    for name in run["tasks"]:
        out_console.print(streaming_table(result.curve, run, name))
    say_written(written)


def streaming_table(curve, run: dict, task: str) -> Table:
    """One task's chosen heads, then its curve: loss change, KL and accuracy with their 95% intervals."""
    from attnprobe.naming import counted, visible

    rows = curve[curve["task"] == task]
    record = run["tasks"][task]
    what = "needle trial" if task == "needle" else "sequence"
    heading = (f"{run['model']['spec']}, {task} task, {run['client']} client: {run['kv_heads_streaming']} of "
               f"{run['kv_heads']} KV heads streaming (sink {run['sink_size']} + recent {run['recent_size']}), "
               f"{counted(record['sequences'], what)}, {counted(record['scored_tokens'], 'token')} scored")
    result = run["result"][task]
    table = Table(title=Text(visible(heading)), caption="per scored token, against no head streaming; the full "
                  f"cache's loss {result['loss'] - result['loss_change']:.4f} nats")
    for column in ("order", "KV heads streaming", "loss change", "95% interval", "KL", "95% interval", "accuracy"):
        table.add_column(column, justify="right")
    for _, row in rows.iterrows():
        table.add_row(str(row["order"]), f"{int(row['kv_heads_streaming'])} ({100 * row['share']:.0f}%)",
                      f"{row['loss_change']:+.4f}", interval((row["loss_change_ci_low"], row["loss_change_ci_high"])),
                      f"{row['kl']:.4f}", f"[{row['kl_ci_low']:.4f}, {row['kl_ci_high']:.4f}]",
                      f"{row['accuracy']:.3f}")
    return table
