"""The options several commands share, each defined once. A command that groups its --help under headings places
one in a panel with help_panels.in_panel (analyze does); the others use them as they are."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from attnprobe.errors import AttnprobeError
from attnprobe.threads import parse as parse_threads


def folder(text: str | Path) -> Path:
    """A folder option's value: an empty one would mean the current folder (and write results there), so it is
    refused."""
    if not str(text).strip():
        raise typer.BadParameter("is empty: name a folder, e.g. --out outputs")
    return Path(text)


OutOption = Annotated[
    Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder (created if missing).")
]
ModelOption = Annotated[str, typer.Option("--model", "-m", help="Hub id, folder, .gguf file or a short name.")]
CorpusOption = Annotated[
    Path, typer.Option("--corpus", "-c", help="UTF-8 text, one sentence per line ('#' lines skipped; a '# category: "
                       "NAME' line tags the lines below it), or a .jsonl / .parquet file: one row per sequence, a "
                       "'text' field and an optional 'category'.")
]


def thread_count(text: str) -> str:
    """A --threads value: `auto` or a whole number, 1 or more (anything else is a usage error)."""
    try:
        return str(parse_threads(text))
    except AttnprobeError as err:
        raise typer.BadParameter(str(err).removeprefix("--threads ")) from None


ThreadsOption = Annotated[
    str, typer.Option("--threads", parser=thread_count, metavar="N|auto",
                      help="CPU threads for torch; auto: one per core, less the cores other work keeps busy.")
]
ResultsOption = Annotated[
    Path, typer.Option("--out", parser=folder, metavar="PATH", help="Results folder written by `attnprobe analyze`.")
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", metavar="N", help="Use only the corpus's first N sequences (a quick look "
                             "at a large corpus); recorded in the results.")
]


class BosChoice(str, Enum):
    auto = "auto"
    always = "always"
    never = "never"


BOS_HELP = ("BOS token: auto does what the tokenizer does; always puts one first where the tokenizer adds none "
            "(as TransformerLens does by default); never removes the one the tokenizer adds.")
BosOption = Annotated[BosChoice, typer.Option("--bos", help=BOS_HELP)]
DEFAULT_OUT = Path("outputs")


class DTypeChoice(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DTYPE_HELP = "Model precision; auto: the checkpoint's own (bfloat16 stays bfloat16); statistics are kept in float32."
DTypeOption = Annotated[DTypeChoice, typer.Option("--dtype", help=DTYPE_HELP)]
DeviceMapOption = Annotated[
    str | None, typer.Option("--device-map", help="'auto': spread a large model over GPUs, CPU and disk.")
]
MaxMemoryOption = Annotated[
    str | None, typer.Option("--max-memory", help="With --device-map: limits per device, e.g. 0=20GiB,cpu=60GiB.")
]


class SplitChoice(str, Enum):
    lines = "lines"
    paragraphs = "paragraphs"
    file = "file"


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


DeviceOption = Annotated[DeviceChoice, typer.Option("--device", help="Where to run the model.")]
BatchSizeOption = Annotated[int, typer.Option("--batch-size", "-b", help="Sentences per forward pass.")]
