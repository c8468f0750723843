"""`attnprobe report`: report.html, one self-contained page of a results folder."""

from __future__ import annotations

from attnprobe.commands.common import err_console, friendly_errors, out_console
from attnprobe.commands.options import DEFAULT_OUT, ResultsOption


@friendly_errors
def report(out: ResultsOption = DEFAULT_OUT) -> None:
    """Write report.html: one self-contained page to explore every head, its attention on the example sentences,
    the layer charts and the run's provenance (no model, no network)."""
    from attnprobe import io
    from attnprobe.report import build_report

    page = build_report(out)
    path = io.write_report(out, page.html)
    for note in page.notes:
        err_console.print(f"Note: {note}", markup=False, highlight=False, soft_wrap=True)
    size = path.stat().st_size / 2**20
    out_console.print(f"Wrote {path} ({size:.1f} MiB, {page.examples} example sentence"
                      f"{'' if page.examples == 1 else 's'}); open it in a browser", markup=False, highlight=False,
                      soft_wrap=True)
