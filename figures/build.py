"""Run the commands, collect the figures' data, render it into the docs.

`python -m figures` (`make figures`) is this module's `main`; see docs/development.md#figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from figures import fmt, regions
from figures.registry import FIGURES, Figure, Outputs
from figures.runs import HERE, PARTS, ROOT, RUNS, execute, record

MEASURED = ROOT / "figures" / "measured.json"
IMAGES = ROOT / "docs" / "images"
DEFAULT_PARTS = ("results", "bench")
DEFAULT_WORK = ROOT / "outputs" / "figures"


def pages(root: Path = ROOT) -> list[Path]:
    """The markdown files that can hold figures: README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def load_measured(path: Path = MEASURED) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def save_measured(measured: dict, path: Path = MEASURED) -> None:
    # One line per figure, by name (inside a figure, the order collect gave): a diff shows which figures changed,
    # and figures added on two branches merge line by line. Written to a temporary name and renamed: a reader (or a
    # kill) never sees half a file.
    lines = [f"{json.dumps(name)}: {json.dumps(entry, separators=(',', ':'))}"
             for name, entry in sorted(measured.items())]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    os.replace(temporary, path)


def merge_measured(refreshed: dict, path: Path = MEASURED) -> dict:
    """Put the figures this process collected (`refreshed`) into measured.json as it is now, under a lock: another
    `python -m figures` that ran beside this one and saved first keeps its figures (each reads the file at its
    start and would otherwise write back what it read there). Returns the file's figures."""
    import fcntl

    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        measured = {**load_measured(path), **refreshed}
        save_measured(measured, path)
    return measured


def render(name: str, data: dict) -> str:
    """Figure `name`'s markdown from its data, as read back from JSON (so a fresh collection renders exactly as
    the committed measured.json does)."""
    figure = FIGURES[name]
    if figure.render is None:
        raise ValueError(f"figure {name!r} has no renderer")
    return fmt.wrap(figure.render(json.loads(json.dumps(data))))


def rewrite_pages(measured: dict, root: Path = ROOT, check: bool = False) -> list[Path]:
    """Render every figure of `measured` into its regions; the pages that changed (with check: would change)."""
    bodies = {name: render(name, entry["data"]) for name, entry in measured.items() if name in FIGURES}
    changed = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        for region in regions.find(text):
            if region.name not in FIGURES:
                raise regions.RegionError(f"{page}: figure {region.name!r} is not defined in figures/")
        new = regions.rewrite(text, bodies)
        if new != text:
            changed.append(page)
            if not check:
                page.write_text(new, encoding="utf-8")
    return changed


def select(parts: list[str], only: list[str]) -> tuple[list[str], list[str]]:
    """The runs to execute and the figures to collect, for --part and --only."""
    if only:
        unknown = [n for n in only if n not in FIGURES and n not in RUNS]
        if unknown:
            raise SystemExit(f"unknown figure or run: {', '.join(unknown)} (python -m figures --list shows them)")
        chosen_runs = {r for n in only for r in (FIGURES[n].runs if n in FIGURES else (n,))}
        figures = [n for n in only if n in FIGURES] + [f.name for f in FIGURES.values()
                                                        if any(n in f.runs for n in only if n in RUNS)]
    else:
        wanted = set(HERE) if "all" in parts else set(parts)  # all: every part that runs here, not `gpu`
        bad = wanted - set(PARTS)
        if bad:
            raise SystemExit(f"unknown part: {', '.join(sorted(bad))} (parts: {', '.join(PARTS)}, all)")
        chosen_runs = {r.name for r in RUNS.values() if r.part in wanted}
        figures = [f.name for f in FIGURES.values() if chosen_runs & set(f.runs)]
    return [r for r in RUNS if r in chosen_runs], list(dict.fromkeys(figures))


def with_needs(runs: list[str], work: Path) -> list[str]:
    """`runs`, plus the runs they read that have no output in `work` yet, in dependency order."""
    out: list[str] = []

    def add(name: str) -> None:
        for need in RUNS[name].needs:
            if need not in runs and need not in out and record(work, need) is None:
                add(need)
        if name not in out:
            out.append(name)

    for name in runs:
        add(name)
    return [r for r in RUNS if r in out]


def collect(figure: Figure, work: Path, root: Path = ROOT) -> dict:
    out = Outputs(work)
    data = figure.collect(out)
    for source, target in figure.images.items():
        run, name = source.split("/", 1)
        shutil.copyfile(out.path(run, name), root / "docs" / "images" / target)
    dates = sorted({out.record(r)["date"] for r in figure.runs})
    return {"data": data, "runs": list(figure.runs), "dates": dates}


def listing() -> str:
    lines = ["Runs (part, about how long on 2 shared cores):"]
    lines += [f"  {r.name:<16} {r.part:<8} ~{r.minutes:g} min  {r.about}" for r in RUNS.values()]
    lines += ["", "Figures (the runs they read):"]
    lines += [f"  {f.name:<22} {', '.join(f.runs)}" for f in FIGURES.values()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m figures", description=__doc__.splitlines()[0])
    parser.add_argument("--part", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated parts to run: {', '.join(PARTS)} or all (all but gpu; default: "
                        "results,bench)")
    parser.add_argument("--only", default="", help="comma-separated figures or runs (instead of --part)")
    parser.add_argument("--reuse", action="store_true", help="run nothing: collect from the outputs in --work")
    parser.add_argument("--render", action="store_true",
                        help="run and collect nothing: render figures/measured.json into the docs")
    parser.add_argument("--check", action="store_true", help="exit 1 if the docs differ from measured.json")
    parser.add_argument("--list", action="store_true", help="list the runs and the figures")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the runs write (outputs/figures)")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    measured = load_measured()
    if args.check:
        changed = rewrite_pages(measured, check=True)
        for page in changed:
            print(f"{page.relative_to(ROOT)} differs from figures/measured.json: run python -m figures --render")
        return 1 if changed else 0
    if not args.render:
        runs, figures = select([p for p in args.part.split(",") if p], [n for n in args.only.split(",") if n])
        args.work.mkdir(parents=True, exist_ok=True)
        if not args.reuse:
            runs = with_needs(runs, args.work)
            skipped = [r for r in RUNS.values() if r.name not in runs and record(args.work, r.name) is None]
            for r in skipped:
                print(f"skipping run {r.name} (part {r.part}, ~{r.minutes:g} min): `make figures PART={r.part}` or "
                      f"`python -m figures --only {r.name}` runs it", flush=True)
            for name in runs:
                started = time.perf_counter()
                execute(RUNS[name], args.work, log=lambda m: print(m, flush=True))
                print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
        failed: list[str] = []
        refreshed: dict = {}
        for name in figures:
            missing = [r for r in FIGURES[name].runs if record(args.work, r) is None]
            if missing:
                print(f"figure {name} not refreshed: run {', '.join(missing)} has no output in {args.work}",
                      flush=True)
                continue
            try:
                collected = collect(FIGURES[name], args.work)
                render(name, collected["data"])
                refreshed[name] = collected
            except Exception:  # one broken figure must not keep the others from being refreshed
                failed.append(name)
                print(f"figure {name} FAILED:\n{traceback.format_exc()}", flush=True)
                continue
            print(f"figure {name}: collected", flush=True)
        measured = merge_measured(refreshed)
    changed = rewrite_pages(measured)
    for page in changed:
        print(f"rewrote {page.relative_to(ROOT)}")
    undefined = [n for n in FIGURES if n not in measured]
    if undefined:
        print(f"figures never collected (their regions are left as they are): {', '.join(undefined)}")
    if not args.render:
        kept = [f"{n} ({', '.join(measured[n]['dates'])})" for n in FIGURES if n in measured and n not in figures]
        if kept:
            print(f"not refreshed this time, rendered from figures/measured.json as measured then: {', '.join(kept)}")
    if not args.render and failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
