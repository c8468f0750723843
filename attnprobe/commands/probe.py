"""`attnprobe probe`: induction, duplicate-token and previous-token scores on repeated random tokens."""

from __future__ import annotations

from enum import Enum
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
from attnprobe.naming import head_name
from attnprobe.threads import apply as apply_threads

DEFAULT_PROBE_OUT = DEFAULT_OUT / "probe"  # its own folder: a probe's files never mix with an analysis's


class KindChoice(str, Enum):
    induction = "induction"
    duplicate = "duplicate"
    previous = "previous"


@friendly_errors
def probe(
    model: ModelOption,
    kind: Annotated[
        list[KindChoice] | None, typer.Option("--kind", "-k", help="Probe to run; repeat for several (default: all).")
    ] = None,
    out: OutOption = DEFAULT_PROBE_OUT,
    lengths: Annotated[str, typer.Option(help="Lengths of the random half, comma-separated.")] = "10,20,40",
    sequences: Annotated[int, typer.Option(help="Random sequences per length.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the random tokens and of the bootstrap.")] = 0,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples of the sequences.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sequences per forward pass.")] = 8,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="Score only the first N of each length's --sequences "
                                 "(the same random tokens as without it); recorded in probe.json.")
    ] = None,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Score induction, duplicate-token and previous-token heads on repeated random tokens."""
    from attnprobe import io, plotting
    from attnprobe.probe import KINDS, check_numbers, top_heads
    from attnprobe.probe import probe as run_probe

    try:
        length_list = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        raise AttnprobeError(f"--lengths {lengths!r}: give whole numbers separated by commas, e.g. 10,20,40") from None
    kinds = tuple(k.value for k in kind) if kind else KINDS
    check_numbers(length_list, sequences, resamples, batch_size, seed)
    check_placement(device_map, max_memory)
    if limit is not None:
        from attnprobe.corpus import check_limit

        check_limit(limit)
    io.check_out_dir(out)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory)
    set_bos(loaded, bos.value)
    try:
        with err_console.status("Probing"):
            result = run_probe(loaded, kinds=kinds, lengths=length_list, sequences=sequences, seed=seed,
                               resamples=resamples, batch_size=batch_size, limit=limit)
    finally:
        release_offload(loaded)
    kinds = tuple(result.info["kinds"])  # each asked kind once, as the probe ran them
    result.info["threads"] = threads_used
    written = io.write_files(out, {
        io.PROBE_FILE: io.csv_writer(result.scores),
        io.PROBE_RUN_FILE: io.json_writer(result.info),
        io.PROBE_FIGURE: io.figure_writer(plotting.probe_heatmap_figure(result.scores, list(kinds), model,
                                                                            result.info["chance"])),
    })
    for note in result.info.get("notes", []):  # after writing: a failed write stays one line
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    for k in kinds:
        chance, above = result.info["chance"][k], result.info["above_chance"][k]
        table = Table(title=f"Top {k} heads (uniform attention would score {chance:.3f})",
                      caption=f"above chance: 95% interval above {chance:.3f} ({above} of {len(result.scores)} heads)")
        for column in ("head", "score", "95% interval", "above chance"):
            table.add_column(column, justify="right")
        for _, row in top_heads(result.scores, k).iterrows():
            table.add_row(head_name(row["layer"], row["head"]), f"{row[k]:.3f}",
                          f"[{row[f'{k}_ci_low']:.3f}, {row[f'{k}_ci_high']:.3f}]",
                          "yes" if row[f"{k}_above_chance"] else "no")
        out_console.print(table)
        if not above:
            out_console.print(f"No head scores above chance on {k}: every head's 95% interval reaches down to "
                              f"{chance:.3f} or below, so these top heads are no {k} heads.", markup=False,
                              highlight=False, soft_wrap=True)
    say_written(written)
