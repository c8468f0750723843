"""`attnprobe compose`: Q-, K- and V-composition scores between every pair of heads, from the weights alone."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from attnprobe.commands.common import err_console, friendly_errors, load, out_console, say_written
from attnprobe.commands.options import DEFAULT_OUT, DTypeChoice, ModelOption, OutOption, ThreadsOption
from attnprobe.defaults import COMPOSE_SAMPLES as SAMPLES
from attnprobe.defaults import COMPOSE_SEED as SEED
from attnprobe.defaults import COMPOSE_TOP as TOP
from attnprobe.naming import head_name
from attnprobe.threads import apply as apply_threads

SHOWN = 5  # edges per mode in the printed table


@friendly_errors
def compose(
    model: ModelOption,
    out: OutOption = DEFAULT_OUT,
    top: Annotated[
        int, typer.Option("--top", metavar="N", help="Draw the N strongest edges of each mode in composition.png.")
    ] = TOP,
    samples: Annotated[
        int, typer.Option("--samples", metavar="N", help="Pairs of random matrices for the baseline's mean and "
                          "spread.")
    ] = SAMPLES,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the baseline's random matrices.")] = SEED,
    dtype: Annotated[
        DTypeChoice, typer.Option("--dtype", help="Precision the weights are loaded in (auto: the checkpoint's "
                                  "own); the scores are computed in float64 whatever it is.")
    ] = DTypeChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Q-, K- and V-composition (Elhage et al. 2021, as TransformerLens computes it) between every pair of heads
    in different layers, from the weights alone, with a baseline of random matrices; write composition.csv,
    composition.json and composition.png."""
    from attnprobe import io, plotting
    from attnprobe.commands.folder import ResultsFolder
    from attnprobe.composition import check_settings, compose_loaded, composition_record

    started = time.monotonic()
    check_settings(samples, top, seed)
    folder = ResultsFolder(out, "compose", {"--model": model})
    folder.check()
    folder.take()  # the lock until the command ends, and what a killed run left swept
    threads_used = apply_threads(threads)
    loaded = load(model, "cpu", dtype.value)
    with err_console.status(f"Scoring the pairs of {loaded.num_layers} x {loaded.num_heads} heads"):
        result = compose_loaded(loaded, samples=samples, seed=seed)
    table = result.table()
    record = composition_record(loaded, result, table, top=top, seconds=time.monotonic() - started)
    record["threads"] = threads_used["threads"]
    figure = plotting.composition_figure(table, result.info["layers"], result.info["heads"],
                                         result.baseline["mean"], result.baseline["sd"], model, top=top)
    written = io.write_composition(out, table, record, figure)
    folder.sweep()
    out_console.print(strongest_table(table, result.baseline), soft_wrap=True)
    out_console.print(f"{result.info['folded']}.", markup=False, highlight=False, soft_wrap=True)
    if result.info["gqa"]:
        out_console.print(f"Grouped-query attention: {result.info['gqa']}.", markup=False, highlight=False,
                          soft_wrap=True)
    say_written(written)


def strongest_table(table, baseline: dict) -> Table:
    """The strongest SHOWN edges of each mode, with their multiple of the random baseline."""
    shown = Table(title=f"Strongest composition (random matrices: {baseline['mean']:.3f} ± {baseline['sd']:.3f})")
    for column in ("mode", "sender", "receiver", "score", "x baseline"):
        shown.add_column(column, justify="right" if column in ("score", "x baseline") else "left")
    for mode, rows in table.groupby("mode", sort=False):
        for row in rows.nlargest(SHOWN, "score").itertuples():
            shown.add_row(mode, head_name(row.sender_layer, row.sender_head),
                          head_name(row.receiver_layer, row.receiver_head), f"{row.score:.3f}",
                          f"{row.score / baseline['mean']:.1f}")
    return shown
