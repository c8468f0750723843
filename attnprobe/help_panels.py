"""Options grouped under headings in a command's plain `--help`, by Typer's own `rich_help_panel`.

The CLI renders click's plain help (`rich_markup_mode=None`: stable text for pipes and for docs/commands.md), and
plain help ignores `rich_help_panel`: a command with two dozen options lists them as one block. `PanelCommand` writes
one section per panel instead (`Input:`, `Scores:`, ...), in the command's `panel_order`, each option where its
parameter sits in the signature; options without a panel (`--help`) come last under `Options:`. A command with no
panels prints exactly what click would.
"""

from __future__ import annotations

import copy
import typing

import typer
from typer.core import TyperCommand

DEFAULT_PANEL = "Options"


def in_panel(alias, panel: str):
    """A copy of an `Annotated[type, typer.Option(...)]` alias with its option in `panel`: a shared option (--model,
    --threads) keeps one definition, and the command that groups its help places it."""
    base, info, *rest = typing.get_args(alias)
    info = copy.copy(info)  # the alias's own OptionInfo is shared by every command that uses it
    info.rich_help_panel = panel
    return typing.Annotated[(base, info, *rest)]


def panels_of(command: TyperCommand, ctx: typer.Context) -> dict[str, list[tuple[str, str]]]:
    """Each panel's help records (option names, help text), panels in the command's `panel_order` and then in
    order of appearance, options without a panel last; arguments are not grouped (the CLI has none)."""
    order = getattr(command, "panel_order", ())
    found: dict[str, list[tuple[str, str]]] = {name: [] for name in order}
    loose = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        panel = getattr(param, "rich_help_panel", None)
        if panel:
            found.setdefault(panel, []).append(record)
        else:
            loose.append(record)
    if loose:
        found.setdefault(DEFAULT_PANEL, []).extend(loose)
    return {name: records for name, records in found.items() if records}


class PanelCommand(TyperCommand):
    """A Typer command whose plain help lists its options under their `rich_help_panel` headings."""

    panel_order: tuple[str, ...] = ()

    def format_options(self, ctx: typer.Context, formatter) -> None:  # formatter: click's HelpFormatter
        for name, records in panels_of(self, ctx).items():
            with formatter.section(name):
                formatter.write_dl(records)


def panel_command(*order: str) -> type[PanelCommand]:
    """A PanelCommand class (for `@app.command(cls=...)`) whose panels come in this order."""
    return type("PanelCommand", (PanelCommand,), {"panel_order": tuple(order)})
