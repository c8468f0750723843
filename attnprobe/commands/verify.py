"""`attnprobe verify`: check that the maps attnprobe reads are the model's true attention."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from attnprobe import limits
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
    BosChoice,
    BosOption,
    DeviceChoice,
    DeviceMapOption,
    DeviceOption,
    DTypeChoice,
    DTypeOption,
    MaxMemoryOption,
    ModelOption,
    ThreadsOption,
)
from attnprobe.errors import AttnprobeError
from attnprobe.naming import counted, visible
from attnprobe.threads import apply as apply_threads


@friendly_errors
def verify(
    model: ModelOption,
    corpus: Annotated[
        Path | None, typer.Option("--corpus", "-c", help="Take the sentences from this file (default: 4 built in).")
    ] = None,
    sentences: Annotated[int, typer.Option("--sentences", "-n", help="How many sentences to use (first n).")] = 4,
    device: DeviceOption = DeviceChoice.auto,
    bos: BosOption = BosChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    threads: ThreadsOption = "auto",
) -> None:
    """Check that the maps attnprobe reads are the model's true attention; exit 1 if any check fails."""
    from attnprobe.corpus import read_corpus
    from attnprobe.verify import DEFAULT_SENTENCES
    from attnprobe.verify import verify as run_verify

    if sentences < 1:
        raise AttnprobeError(f"--sentences {sentences} is below 1: use 1 or more (default 4)")
    limits.check_whole("--sentences", sentences, 1, limits.MAX_SENTENCES, 4)
    check_placement(device_map, max_memory)
    if corpus:
        texts = [s.text for s in itertools.islice(read_corpus(corpus).stream(), sentences)]
    else:
        texts = list(DEFAULT_SENTENCES)[:sentences]
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        checks = run_verify(loaded, texts)
    finally:
        release_offload(loaded)
    shape = f"{loaded.num_layers} layers x {loaded.num_heads} heads"
    table = Table(title=Text(visible(f"verify {model}: {counted(len(texts), 'sentence')}, {shape}, "
                                     f"{dtype_label(loaded)}, {threads_used['threads']} torch thread(s)")))
    table.add_column("check", no_wrap=True)
    table.add_column("diff at tightest", justify="right")  # the difference where it is nearest its tolerance
    table.add_column("tolerance", justify="right")
    table.add_column("result")
    table.add_column("note")
    for check in checks:
        diff = "-" if check.skipped else f"{check.max_abs_diff:.3g}"
        result = "skipped" if check.skipped else ("pass" if check.passed else "FAIL")
        table.add_row(check.name, diff, f"{check.tolerance:.3g}", result, check.note)
    out_console.print(table)
    failed = [c.name for c in checks if not c.passed]
    if failed:
        err_console.print(f"Error: {len(failed)} check(s) failed: {'; '.join(failed)}", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1)


def dtype_label(loaded) -> str:
    """'bfloat16' or, where --dtype auto chose it, 'bfloat16 (auto)': what ran, for the tables' titles."""
    return loaded.dtype if loaded.dtype_requested != "auto" else f"{loaded.dtype} (auto)"
