"""`attnprobe patch`: which heads carry a behaviour, by activation, attribution or path patching over prompt pairs."""

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
    hold_out,
    load,
    out_console,
    release_offload,
    say_written,
    set_bos,
    stage_progress,
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
from attnprobe.naming import head_name, visible
from attnprobe.threads import apply as apply_threads


class MethodChoice(str, Enum):
    activation = "activation"
    attribution = "attribution"
    both = "both"
    path = "path"


class DirectionChoice(str, Enum):
    denoise = "denoise"
    noise = "noise"


class PositionsChoice(str, Enum):
    all = "all"
    last = "last"
    each = "each"


class MetricChoice(str, Enum):
    logit_diff = "logit-diff"
    logprob = "logprob"


class TaskChoice(str, Enum):
    ioi = "ioi"


class CorruptionChoice(str, Enum):
    abc = "abc"
    s2 = "s2"


class ViaChoice(str, Enum):
    q = "q"
    k = "k"
    v = "v"
    out = "out"


@friendly_errors
def patch(
    model: ModelOption,
    pairs: Annotated[
        Path | None, typer.Option("--pairs", metavar="FILE", help="Prompt pairs, JSON lines: clean, corrupt, answer, "
                                  "wrong (strings); clean and corrupt must tokenize to one length.")
    ] = None,
    task: Annotated[
        TaskChoice | None, typer.Option("--task", help="Generate the pairs instead: ioi = indirect-object "
                                        "identification (Wang et al. 2022), names and places that are one token for "
                                        "the model's tokenizer.")
    ] = None,
    n: Annotated[int, typer.Option("--n", help="--task: how many pairs.")] = 64,
    corruption: Annotated[
        CorruptionChoice, typer.Option("--corruption", help="--task ioi: abc = the three names replaced by three "
                                       "others (Wang et al.'s ABC); s2 = the subject's second mention replaced by "
                                       "the indirect object (ABB -> ABA, flips the answer).")
    ] = CorruptionChoice.abc,
    out: OutOption = DEFAULT_OUT,
    method: Annotated[
        MethodChoice, typer.Option("--method", help="activation: patch each head's output; attribution: its "
                                   "first-order estimate (3 passes); both: side by side, with their rank "
                                   "correlation; path: --senders' paths to --receivers.")
    ] = MethodChoice.activation,
    direction: Annotated[
        DirectionChoice, typer.Option("--direction", help="denoise: the corrupt run with the head from the clean run; "
                                      "noise: the clean run with the head from the corrupt run.")
    ] = DirectionChoice.denoise,
    positions: Annotated[
        PositionsChoice, typer.Option("--positions", help="Patch a head at every position, at the last one, or at "
                                      "each position in turn (a layer x head x position table).")
    ] = PositionsChoice.all,
    metric: Annotated[
        MetricChoice, typer.Option("--metric", help="logit-diff: logit(answer) - logit(wrong) at the last position; "
                                   "logprob: log p(answer).")
    ] = MetricChoice.logit_diff,
    heads: Annotated[str, typer.Option("--heads", help="all, or the heads to patch, e.g. L17H4,L20H0.")] = "all",
    senders: Annotated[
        str | None, typer.Option("--senders", metavar="L.H,...", help="--method path: the sender heads, each "
                                 "patched on its own, e.g. L9H6,L10H0 (or 9.6,10.0).")
    ] = None,
    receivers: Annotated[
        str | None, typer.Option("--receivers", metavar="L.H,...|all", help="--method path: the receiver heads "
                                 "(all: every head of a later layer than the sender).")
    ] = None,
    via: Annotated[
        ViaChoice | None, typer.Option("--via", help="--method path: the receivers' input the sender reaches them "
                                       "through: q, k, v (a key or value: its KV head's), or out (their whole "
                                       "output).  [default: out]", show_default=False)
    ] = None,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    resamples: Annotated[int, typer.Option("--resamples", help="Bootstrap resamples of the pairs.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap and of --task's names.")] = 0,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Which heads carry a behaviour: patch each head's output between clean and corrupt prompts and measure the
    logit difference; write patching.csv, patch.json and patching.png."""
    from attnprobe import io, plotting
    from attnprobe import patching as patcher
    from attnprobe.naming import parse_heads

    check_inputs(pairs, task, method, senders, receivers, via)
    check_unused(pairs, method, n, corruption, heads, positions)
    chosen = None if heads.strip().lower() == "all" else parse_heads(heads)
    sent = parse_heads(senders, "--senders") if senders else None
    received = None if receivers is None or receivers.strip().lower() == "all" else parse_heads(receivers,
                                                                                                  "--receivers")
    patcher.check_settings(method.value, direction.value, positions.value, metric.value,
                           via.value if via else None, resamples)
    read = patcher.read_pairs(pairs) if pairs is not None else None
    io.check_out_dir(out)
    io.check_inputs_apart(out, {"--pairs": pairs, "--model": model})
    check_placement(device_map, max_memory)
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    hold_out(out, "patch")  # a second run into this folder is refused
    try:
        if read is None:
            from attnprobe.ioi import ioi_pairs

            read = ioi_pairs(loaded, n, corruption.value, seed)
            source = {"from": "task ioi", "corruption": corruption.value, "seed": seed}
        else:
            source = {"from": str(pairs)}
        with stage_progress("patches") as progress:
            result = patcher.patch(loaded, read, method=method.value, direction=direction.value,
                                   positions=positions.value, kind=metric.value, heads=chosen, senders=sent,
                                   receivers=received, via=(via.value if via else "out") if sent else None,
                                   resamples=resamples, seed=seed, source=source, progress=progress)
    finally:
        release_offload(loaded)
    result.run["threads"] = threads_used
    title = f"{model}: {len(read)} pairs, {direction.value}, {metric.value}"
    written = io.write_patching(out, result, plotting.patching_figure(result.table, (loaded.num_layers,
                                                                                     loaded.num_heads), title,
                                                                      direction.value))
    for note in result.run["notes"]:
        err_console.print(f"Warning: {note}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(patch_table(result.table, result.run))
    say_written(written)


def check_inputs(pairs, task, method, senders, receivers, via) -> None:
    """One of --pairs and --task; --senders, --receivers and --via with --method path only, and path needs both."""
    if (pairs is None) == (task is None):
        raise AttnprobeError("give the prompt pairs: --pairs FILE (JSON lines) or --task ioi, one of them")
    given = {"--senders": senders, "--receivers": receivers, "--via": via}
    if method is not MethodChoice.path:
        misplaced = [name for name, value in given.items() if value is not None]
        if misplaced:
            raise AttnprobeError(f"{misplaced[0]} applies to --method path only: add --method path, or drop "
                                 f"{misplaced[0]}")
    elif senders is None or receivers is None:
        raise AttnprobeError("--method path needs --senders and --receivers, e.g. --senders L9H6 --receivers all")


def check_unused(pairs, method, n, corruption, heads, positions) -> None:
    """Options this run would not use are refused, never silently dropped from what the record says: --n and
    --corruption build --task's pairs (not --pairs'), --heads and --positions choose what --method path does not."""
    unused = []
    if pairs is not None:
        unused += [name for name, moved in (("--n", n != 64), ("--corruption", corruption is not CorruptionChoice.abc))
                   if moved]
    if method is MethodChoice.path:
        unused += [name for name, moved in (("--heads", heads != "all"),
                                            ("--positions", positions is not PositionsChoice.all)) if moved]
    if unused:
        what = "--task" if unused[0] in ("--n", "--corruption") else "--method activation, attribution or both"
        raise AttnprobeError(f"{unused[0]} does nothing here: it applies to {what}; drop it")


def patch_table(frame, run: dict) -> Table:
    """The ten heads (or positions) with the largest effect, and the clean and corrupt metric."""
    column = "effect" if "effect" in frame.columns else "attribution"
    shown = frame.reindex(frame[column].abs().sort_values(ascending=False, kind="stable").index).head(10)
    ld = f"clean {run['ld_clean']['mean']:+.3f}, corrupt {run['ld_corrupt']['mean']:+.3f}"
    heading = f"{run['model']['spec']}: {run['method']} patching ({run['direction']}), {run['pairs']['count']} pairs"
    caption = f"{run['metric']}: {ld}; effect 1 = the clean behaviour restored (denoise) or destroyed (noise)"
    if run.get("spearman") is not None:
        caption += f"; Spearman(attribution, activation) = {run['spearman']:.3f}"
    table = Table(title=Text(visible(heading)), caption=caption)
    extra = [c for c in ("position", "receivers") if c in frame.columns]
    for name in ("head", *extra, column, "95% interval", *(["attribution"] if column == "effect" and
                                                             "attribution" in frame.columns else [])):
        table.add_column(name, justify="right")
    for _, row in shown.iterrows():
        cells = [head_name(int(row["layer"]), int(row["head"])), *(cell(row[c]) for c in extra), f"{row[column]:+.3f}",
                 f"[{row[f'{column}_lo']:+.3f}, {row[f'{column}_hi']:+.3f}]"]
        if column == "effect" and "attribution" in frame.columns:
            cells.append(f"{row['attribution']:+.3f}")
        table.add_row(*cells)
    return table


def cell(value) -> str:
    """A position as a whole number; a long list of receivers as its count."""
    if isinstance(value, str):
        names = value.split()
        return value if len(names) <= 4 else f"{len(names)} heads"
    return str(int(value))
