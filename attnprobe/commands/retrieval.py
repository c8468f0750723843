"""`attnprobe retrieval`: Wu et al.'s retrieval heads, found with needles hidden in a long context."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from attnprobe.commands.common import (
    check_placement,
    err_console,
    friendly_errors,
    load,
    number_list,
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
from attnprobe.naming import counted, head_name
from attnprobe.threads import apply as apply_threads


class DecodeChoice(str, Enum):
    greedy = "greedy"
    forced = "forced"


@friendly_errors
def retrieval(
    model: ModelOption,
    haystack: Annotated[
        Path, typer.Option("--haystack", metavar="FILE", help="Long UTF-8 text the needle is hidden in (repeated "
                           "when shorter than a context).")
    ],
    out: OutOption = DEFAULT_OUT,
    lengths: Annotated[
        str | None, typer.Option("--lengths", metavar="N,N", help="Prompt lengths in tokens (a repeat runs once) "
                                 "[default: 1000,2000,4000,8000, those that fit the model's context].",
                                 show_default=False)
    ] = None,
    depths: Annotated[
        str, typer.Option("--depths", metavar="P,P", help="Where the needle goes: percent of the context before "
                           "it (a repeat runs once).")
    ] = "0,25,50,75,100",
    needle: Annotated[
        str | None, typer.Option("--needle", metavar="TEXT", help="The sentence hidden in the haystack [default: "
                                 "Wu et al.'s San Francisco sentence].", show_default=False)
    ] = None,
    question: Annotated[
        str | None, typer.Option("--question", metavar="TEXT", help="The question asked after the context [default: "
                                 "What is the best thing to do in San Francisco?].", show_default=False)
    ] = None,
    decode: Annotated[
        DecodeChoice, typer.Option("--decode", help="greedy: the model's own answer, trials that copy the needle "
                                   "count (Wu et al.); forced: the needle's tokens fed as the answer, every trial "
                                   "counts (deterministic; for models too small to copy).")
    ] = DecodeChoice.greedy,
    device: DeviceOption = DeviceChoice.auto,
    dtype: DTypeOption = DTypeChoice.auto,
    device_map: DeviceMapOption = None,
    max_memory: MaxMemoryOption = None,
    resamples: Annotated[int, typer.Option("--resamples", help="Bootstrap resamples of the trials.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap.")] = 0,
    bos: BosOption = BosChoice.auto,
    threads: ThreadsOption = "auto",
) -> None:
    """Find retrieval heads, the heads that copy a needle from a long context; write retrieval_heads.csv,
    head_score.json and retrieval.json. The method of Wu et al. 2024."""
    from attnprobe import io
    from attnprobe import retrieval as finding
    from attnprobe.commands.folder import ResultsFolder

    length_list = number_list(lengths, int, "--lengths") if lengths is not None else None
    depth_list = number_list(depths, float, "--depths")
    finding.check_settings(length_list or list(finding.DEFAULT_LENGTHS), depth_list, decode.value, resamples)
    finding.check_text("--needle", needle)
    finding.check_text("--question", question)
    text = finding.read_haystack(haystack)
    folder = ResultsFolder(out, "retrieval", {"--haystack": haystack, "--model": model})
    folder.check()
    check_placement(device_map, max_memory)
    folder.take()  # the lock until the command ends, and what a killed run left swept
    threads_used = apply_threads(threads)
    loaded = load(model, device.value, dtype.value, device_map, max_memory, lm_head=True)
    set_bos(loaded, bos.value)
    try:
        with stage_progress("trials") as progress:
            result = finding.retrieval(
                loaded, text, lengths=length_list, depths=depth_list, needle=needle or finding.DEFAULT_NEEDLE,
                question=question or finding.DEFAULT_QUESTION, decode=decode.value, resamples=resamples, seed=seed,
                haystack_name=str(haystack),
                progress=lambda done, total, within=None: progress("retrieval", done, total, within))
    finally:
        release_offload(loaded)
    result.info["threads"] = threads_used["threads"]
    result.info.setdefault("dtype", loaded.dtype)
    result.info.setdefault("dtype_requested", loaded.dtype_requested)
    written = io.write_retrieval(out, result)
    folder.sweep()
    info = result.info
    out_console.print(f"{model}: {counted(info['trials_total'], 'trial')} ({decode.value}), {copy_words(info)}",
                      markup=False, highlight=False, soft_wrap=True)
    if not result.heads.empty:
        top = result.heads.sort_values("mean", ascending=False, kind="stable").head(10)
        table = Table(title="Top retrieval heads (mean score over the scored trials)")
        for column in ("head", "kv head", "mean", "95% interval"):
            table.add_column(column, justify="right")
        for row in top.itertuples():
            table.add_row(head_name(int(row.layer), int(row.head)), str(int(row.kv_head)), f"{row.mean:.3f}",
                          f"[{row.ci_low:.3f}, {row.ci_high:.3f}]")
        out_console.print(table)
    for note in info["notes"]:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    say_written(written)


def copy_words(info: dict) -> str:
    """What the summary counts, in words: greedy decoding copied the needle (its answer holds at least half the
    needle's tokens, ROUGE-1 recall) and only those trials are scored; forced decoding feeds the needle, so every trial
    is scored, and the count is of the trials where the model's own next-token guesses matched at least half of it."""
    from attnprobe.retrieval import COPY_MIN_RECALL

    share = f"{COPY_MIN_RECALL:.0%}"
    if info["decode"] == "forced":
        return (f"every trial scored (the needle fed as the answer); the model's own guesses matched at least {share} "
                f"of the needle's tokens in {info['trials_copied']}")
    return (f"the needle copied (at least {share} of its tokens in the answer) in {info['trials_copied']}; "
            f"{info['trials_scored']} scored")

