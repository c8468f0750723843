"""`attnprobe compare`: B - A of every score of two results folders, with 95% intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from attnprobe.commands.common import decimal, err_console, friendly_errors, interval, out_console, say_written
from attnprobe.commands.options import folder
from attnprobe.errors import AttnprobeError
from attnprobe.naming import visible


@friendly_errors
def compare(
    out_a: Annotated[
        Path, typer.Argument(parser=folder, metavar="OUT_A",
                             help="Results folder A, the baseline (written by `attnprobe analyze`).")
    ],
    out_b: Annotated[
        Path, typer.Argument(parser=folder, metavar="OUT_B", help="Results folder B: every difference is B - A.")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", parser=folder, metavar="PATH",
                                  help="Where compare_*.csv, compare.json and compare.png go "
                                  "(default: OUT_B/compare).")
    ] = None,
    score: Annotated[str, typer.Option("--score", help="The score printed and drawn (every score is written).")] = (
        "entropy"),
    paired_flag: Annotated[
        bool, typer.Option("--paired", help="Insist on the paired bootstrap (refused unless the corpus and "
                           "bootstrap match); default: paired when they match.")
    ] = False,
    unpaired_flag: Annotated[
        bool, typer.Option("--unpaired", help="Decline the paired bootstrap: resample each run on its own.")
    ] = False,
    top: Annotated[int, typer.Option("--top", help="How many of the most changed heads to print.")] = 10,
) -> None:
    """B - A of every score of two runs, with 95% intervals: per head, or by relative depth when shapes differ."""
    from attnprobe import io, plotting
    from attnprobe.compare import compare as run_compare

    if paired_flag and unpaired_flag:
        raise AttnprobeError("--paired and --unpaired contradict each other: pass one (or neither, to pair "
                             "when the corpus and bootstrap match)")
    paired = True if paired_flag else False if unpaired_flag else None
    result = run_compare(out_a, out_b, score=score, paired=paired, top=top)
    target = out if out is not None else Path(out_b) / "compare"
    io.check_out_dir(target)
    files = {io.COMPARE_LAYERS_FILE: io.csv_writer(result.layers), io.COMPARE_RUN_FILE: io.json_writer(result.info)}
    if result.heads is not None:
        files[io.COMPARE_HEADS_FILE] = io.csv_writer(result.heads)
    if result.types is not None:
        files[io.COMPARE_TYPES_FILE] = io.csv_writer(result.types)
    figure = plotting.compare_figure(result.layers, result.info, result.heads, result.types)
    files[io.COMPARE_FIGURE] = io.figure_writer(figure)
    stale = [name for name in (io.COMPARE_HEADS_FILE, io.COMPARE_TYPES_FILE) if name not in files]
    written = io.write_files(target, files, remove=stale)
    for note in result.info["notes"]:
        err_console.print(f"Note: {note}", markup=False, soft_wrap=True)
    print_comparison(result.info, result.types)
    written += refresh_reports(target)
    say_written(written)


def refresh_reports(target: Path) -> list[Path]:
    """Rebuild the report.html of the results folder the comparison went into (`target` or its parent,
    for the default OUT_B/compare), so the page gains its comparison section."""
    from attnprobe import io
    from attnprobe.report import COMPARE_FOLDER, build_report

    folders = [target, target.parent] if target.name == COMPARE_FOLDER else [target]
    return [io.write_report(folder, build_report(folder).html) for folder in folders
            if (folder / io.REPORT_FILE).is_file() and (folder / io.HEADS_FILE).is_file()]


def print_comparison(info: dict, types) -> None:
    """The pairing and why, the overall difference, and the heads (or depths) that changed most."""
    score, a, b = info["score"], info["a"], info["b"]
    out_console.print(visible(f"A = {a['label']}, B = {b['label']}"), markup=False, highlight=False)
    out_console.print(f"{info['pairing']}: {info['pairing_reason']}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(info["matching"], markup=False, highlight=False, soft_wrap=True)
    whole = info["overall"][score]
    out_console.print(f"mean {score} over all heads: A {decimal(whole['a'])}, B {decimal(whole['b'])}, B - A "
                      f"{decimal(whole['diff'], '+')} {interval(whole['ci'])}", markup=False, highlight=False,
                      soft_wrap=True)
    unit = info["changed_unit"]
    changed = info["changed"][score]
    if not info["top"]:
        out_console.print(f"No {unit[:-1]}'s {score} changed: every 95% interval of B - A includes 0 "
                          f"({info['changed_of']} {unit}).", markup=False, highlight=False)
    else:
        by_head = info["same_shape"]
        table = Table(title=f"{score}: most changed {unit}", caption=f"the 95% interval of B - A excludes 0 "
                      f"for {changed} of {info['changed_of']} {unit}")
        for column in ("head" if by_head else "relative depth", "A", "B", "B - A", "95% interval"):
            table.add_column(column, justify="right")
        for row in info["top"]:
            where = row["name"] if by_head else f"{row['depth']:.3f}"
            table.add_row(where, decimal(row["a"]), decimal(row["b"]), decimal(row["diff"], "+"), interval(row["ci"]))
        out_console.print(table)
    moved = info.get("type_changes", [])
    if moved:
        shown = ", ".join(f"{m['name']} {m['a']} -> {m['b']}" for m in moved[:10])
        more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
        out_console.print(f"{len(moved)} head(s) changed type: {shown}{more}", markup=False, highlight=False,
                          soft_wrap=True)
    if types is not None:
        table = Table(title="Head types (share of all heads)")
        for column in ("type", "A", "B", "B - A"):
            table.add_column(column, justify="right")
        for _, row in types.iterrows():
            table.add_row(row["head_type"], f"{row['fraction_a']:.3f} ({int(row['count_a'])})",
                          f"{row['fraction_b']:.3f} ({int(row['count_b'])})", f"{row['fraction_diff']:+.3f}")
        out_console.print(table)
