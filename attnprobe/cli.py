"""The `attnprobe` command line: the Typer app, its commands' registration, usage errors and the entry point `main`.

Each command (its options and its body) is a module of attnprobe/commands/; the options several commands share are
in commands/options.py, the helpers they share in commands/common.py. Heavy imports stay inside the commands."""

from __future__ import annotations

import gc
import re
import sys
from typing import Annotated

import typer

from attnprobe import __version__
from attnprobe.allocator import reuse_freed_memory
from attnprobe.commands import (
    ablate,
    analyze,
    circuit,
    classify,
    compare,
    compose,
    export,
    patch,
    plot,
    probe,
    related,
    report,
    retrieval,
    rollout,
    train_pattern,
    verify,
)
from attnprobe.commands.common import err_console, is_main_process
from attnprobe.threads import limit_numpy_threads

app = typer.Typer(
    help="Measure what the attention heads of a transformer do: entropy, locality, head types, plots.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
)


def version_callback(value: bool) -> None:
    if value:
        print(f"attnprobe {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """attnprobe: per-head attention entropy, diagonal score and head types, layer by layer."""


# each command's line in `attnprobe --help`: Click would cut the docstring's first sentence to the column left
# beside the names ("Run the model over the corpus; write heads.csv,..."); these fit whole at 80 columns
SHORT_HELP = {
    "analyze": "Measure every head on a corpus; write heads.csv, run.json",
    "classify": "Label each head's type from heads.csv (head_types.csv)",
    "plot": "Draw the figures of a results folder",
    "report": "Write report.html, one page to explore a results folder",
    "verify": "Check that the maps read are the model's true attention",
    "probe": "Score induction, duplicate- and previous-token heads",
    "compare": "B - A of every score of two runs, with 95% intervals",
    "ablate": "Ablate heads, or make KV heads streaming: loss change",
    "patch": "Which heads carry a prediction: activation/path patching",
    "circuit": "Which paths carry it: edge attribution, faithfulness",
    "rollout": "Attention rollout of example sentences (rollout.png)",
    "related": "How alike every pair of heads attends (Jensen-Shannon)",
    "compose": "Q-, K- and V-composition of head pairs, from the weights",
    "retrieval": "Find the heads that copy a needle from a long context",
    "export": "Write the KV heads to keep, for kvpress and DuoAttention",
    "train-pattern": "Train DuoAttention's gate per KV head (gates.csv)",
}

# the commands, in the order `attnprobe --help` lists them
app.command(cls=analyze.AnalyzeCommand, short_help=SHORT_HELP["analyze"])(analyze.analyze)
app.command(short_help=SHORT_HELP["classify"])(classify.classify)
app.command(short_help=SHORT_HELP["plot"])(plot.plot)
app.command(short_help=SHORT_HELP["report"])(report.report)
app.command(short_help=SHORT_HELP["verify"])(verify.verify)
app.command(short_help=SHORT_HELP["probe"])(probe.probe)
app.command(short_help=SHORT_HELP["compare"])(compare.compare)
app.command(short_help=SHORT_HELP["ablate"])(ablate.ablate)
app.command(short_help=SHORT_HELP["patch"])(patch.patch)
app.command(short_help=SHORT_HELP["circuit"])(circuit.circuit)
app.command(short_help=SHORT_HELP["rollout"])(rollout.rollout)
app.command(short_help=SHORT_HELP["related"])(related.related)
app.command(short_help=SHORT_HELP["compose"])(compose.compose)
app.command(short_help=SHORT_HELP["retrieval"])(retrieval.retrieval)
app.command(short_help=SHORT_HELP["export"])(export.export)
app.command("train-pattern", short_help=SHORT_HELP["train-pattern"])(train_pattern.train_pattern)


def is_usage_error(err: BaseException) -> bool:
    """Click's UsageError (bad option, value or command), whichever click typer bundles."""
    return any(cls.__name__ == "UsageError" for cls in type(err).__mro__) and hasattr(err, "format_message")


# typer checks values with pydantic: plain words for its messages
_CHOICE_ERROR = re.compile(r"(?:Value error, |: )(?P<value>'[^']*'|\"[^\"]*\") is not one of (?P<choices>'.*?)\.?$")
_PYDANTIC_WORDS = {
    "Value error, ": "",
    "Input should be a valid integer, unable to parse string as an integer": "not a whole number",
    "Input should be a valid number, unable to parse string as a number": "not a number",
}


def usage_message(err: BaseException) -> str:
    """The one line for a usage error: `--scheme 'extnded' is not one of default, extended, kv` for a misspelt
    choice, else click's message in plain words with a pointer to --help."""
    message = err.format_message()  # type: ignore[attr-defined]
    param = getattr(err, "param", None)
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    choice = _CHOICE_ERROR.search(message)
    if choice and opts:
        choices = ", ".join(c.strip().strip("'") for c in choice["choices"].split(","))
        return f"{opts[0]} {choice['value']} is not one of {choices}"
    for words, plain in _PYDANTIC_WORDS.items():
        message = message.replace(words, plain)
    ctx = getattr(err, "ctx", None)
    command = ctx.command_path if ctx is not None else "attnprobe"
    return f"{message} (see `{command} --help`)"


def main() -> None:
    """Run the CLI; a misspelt option or value is one `Error:` line too (exit 2), not a usage block."""
    limit_numpy_threads()
    reuse_freed_memory()
    freeze_at_exit()
    try:
        code = app(prog_name="attnprobe", standalone_mode=False)
    except typer.Abort:
        err_console.print("Aborted.", markup=False)
        sys.exit(1)
    except Exception as err:
        if not is_usage_error(err):
            raise
        if type(err).__name__ == "NoArgsIsHelpError":  # bare `attnprobe`: the help is the answer
            print(err.format_message())
            sys.exit(0)
        if is_main_process():
            err_console.print(f"Error: {usage_message(err)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def freeze_at_exit() -> None:
    """At exit, move every object still alive out of the garbage collector's reach (gc.freeze).

    The interpreter's shutdown runs full collections over every object torch, transformers and pandas made, to
    reclaim memory the process is about to hand back anyway: most of a second of CPU after a short `analyze` has
    written its results. Objects are still released as their modules are cleared and every other exit hook still
    runs; only reference cycles left at exit are not collected."""
    import atexit

    atexit.unregister(freeze)  # once, however often main() runs in one process
    atexit.register(freeze)


# Extension modules built with nanobind print a page of "leaked instance" warnings at shutdown for each of their
# objects still alive then; triton's (which torch imports with torch._dynamo where triton is installed, as in every
# CUDA build of torch) has objects that only the shutdown's own collections release, and a freeze keeps them alive.
NANOBIND_MODULES = ("triton._C.libtriton",)


def freeze() -> None:
    """gc.freeze at exit (freeze_at_exit), except where a nanobind module is loaded: there the shutdown keeps its
    collections (most of a second) rather than end the command with a page of leak warnings."""
    if not any(name in sys.modules for name in NANOBIND_MODULES):
        gc.freeze()


if __name__ == "__main__":
    main()
