"""`attnprobe rollout`: attention rollout (Abnar & Zuidema 2020) of example sentences."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from attnprobe.commands.common import (
    check_placement,
    friendly_errors,
    load,
    out_console,
    release_offload,
    say_written,
    set_bos,
)
from attnprobe.commands.options import (
    DEFAULT_OUT,
    BosChoice,
    BosOption,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    MaxMemoryOption,
    ModelOption,
    OutOption,
    ThreadsOption,
)
from attnprobe.errors import AttnprobeError
from attnprobe.naming import visible
from attnprobe.threads import apply as apply_threads


@friendly_errors
def rollout(
    model: ModelOption,
    corpus: Annotated[
        Path | None, typer.Option("--corpus", "-c", help="Corpus whose example sentence (the one analyze keeps) "
                                  "is rolled out; optional with --example.")
    ] = None,
    out: OutOption = DEFAULT_OUT,
    example: Annotated[
        list[str] | None,
        typer.Option("--example", metavar="TEXT", help="A sentence to roll out instead; repeat for several."),
    ] = None,
    index: Annotated[
        list[int] | None,
        typer.Option("--index", metavar="N", help="Roll out the corpus's sentence N (0-based); repeatable."),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Keep each sentence's first N tokens (default 40).")
    ] = None,
    residual: Annotated[
        float, typer.Option("--residual", help="Weight of the identity (residual stream): (1-r) A + r I.")
    ] = 0.5,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="Treat the corpus as its first N sentences: the "
                                 "example and --index are chosen among them.")
    ] = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Attention rollout (Abnar & Zuidema 2020) of example sentences; write rollout.npz and rollout.png."""
    from attnprobe import io, plotting
    from attnprobe.corpus import read_corpus
    from attnprobe.rollout import check_choice, check_residual, choose_sentences, first_token_share, rollout_loaded

    check_residual(residual)
    check_placement(device_map, max_memory)
    if max_tokens is not None and max_tokens < 1:
        raise AttnprobeError(f"--max-tokens {max_tokens} is below 1: use 1 or more (default 40)")
    io.check_out_dir(out)
    io.check_inputs_apart(out, {"--corpus": corpus, "--model": model})
    if limit is not None and corpus is None:
        raise AttnprobeError("--limit picks the first sentences of the corpus: pass --corpus too")
    sentences = read_corpus(corpus).head(limit) if corpus is not None else None
    check_choice(sentences, index, example)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        texts, indices = choose_sentences(loaded, sentences, index, example)
        result = rollout_loaded(loaded, texts, indices, max_tokens=max_tokens, residual=residual)
    finally:
        release_offload(loaded)
    result.info["limit"] = limit
    result.info["threads"] = threads_used["threads"]
    source = Path(corpus).name if corpus is not None and not example else None
    written = io.write_rollout(out, result, plotting.rollout_figure(result, model, source))
    heading = f"{model}: attention rollout, {result.info['layers']} layers, residual {residual:g}"
    table = Table(title=Text(visible(heading)),
                  caption="mean share of the rows after the first on token 0 (a sink draws rollout to itself)")
    for column in ("sentence", "tokens", "rollout -> first token", "last layer -> first token"):
        table.add_column(column, justify="right" if column != "sentence" else "left")
    for s, text in enumerate(result.sentences):
        table.add_row(Text(visible(text if len(text) <= 50 else text[:47] + "...")), str(len(result.tokens[s])),
                      f"{first_token_share(result.rollout[s][-1]):.3f}", f"{first_token_share(result.raw[s]):.3f}")
    out_console.print(table)
    say_written(written)
