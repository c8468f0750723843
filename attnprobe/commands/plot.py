"""`attnprobe plot`: the figures of a results folder (and of what ablate and related wrote into it)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from attnprobe.commands.common import err_console, friendly_errors, out_console, say_written
from attnprobe.commands.options import DEFAULT_OUT, ResultsOption
from attnprobe.errors import AttnprobeError

POSITION_FIGURE = "position_profile.png"


class FormatChoice(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


MAX_PATTERN_HEADS = 12  # panels of head_patterns_selected, chosen with --heads
SELECTED_PATTERNS = "head_patterns_selected"  # plot --heads: the chosen heads' figure, beside head_patterns


@friendly_errors
def plot(
    out: ResultsOption = DEFAULT_OUT,
    example: Annotated[
        str | None, typer.Option("--example", metavar="N|TEXT", help="The sentence of head_patterns: the number "
                                 "(0-7) or text of one of the example sentences analyze kept (default: 0).")
    ] = None,
    heads_option: Annotated[
        str | None, typer.Option("--heads", metavar="L17H4,L18H6", help="Also draw these heads (at most "
                                 f"{MAX_PATTERN_HEADS}) on the example sentence, in head_patterns_selected "
                                 "(head_patterns, one head of each type, is drawn as ever).")
    ] = None,
    figure_format: Annotated[
        FormatChoice, typer.Option("--format", help="File format of the figures.")
    ] = FormatChoice.png,
    dpi: Annotated[float, typer.Option("--dpi", help="Pixels per inch of png figures (and of images in svg/pdf).")] = (
        120.0),
) -> None:
    """Draw entropy_heatmap, layer_gradient, head_patterns, position_profile (and importance, head_similarity and
    head_map) figures."""
    from attnprobe import io, naming, plotting
    from attnprobe.classify import RULE_COLUMNS
    from attnprobe.classify import classify as run_classify

    if not 10 <= dpi <= 1200:
        raise AttnprobeError(f"--dpi {dpi:g} is outside 10-1200: use e.g. 120 (screen) or 300 (print)")
    chosen = naming.parse_heads(heads_option) if heads_option is not None else None
    if chosen is not None and len(chosen) > MAX_PATTERN_HEADS:
        raise AttnprobeError(f"--heads names {len(chosen)} heads: head_patterns draws at most {MAX_PATTERN_HEADS}")

    heads = io.read_table(out, io.HEADS_FILE, ["layer", "head", "entropy", *RULE_COLUMNS], "attnprobe analyze")
    layers = io.read_table(out, io.LAYERS_FILE, ["layer", "entropy", "entropy_head_std"], "attnprobe analyze")
    io.check_fits_heads(heads, layers, io.LAYERS_FILE, f"attnprobe analyze --out {out}")
    if (Path(out) / io.TYPES_FILE).exists():
        kv = "kv_head" in io.read_columns(out, io.TYPES_FILE)  # the kv scheme labels streaming / retrieval
        rule = ["sink_window"] if kv else list(RULE_COLUMNS)
        types = io.read_table(out, io.TYPES_FILE, ["layer", "head", "head_type", *rule], "attnprobe classify")
        io.check_same_heads(heads, types, io.TYPES_FILE, f"attnprobe classify --out {out}")
    else:
        types = run_classify(heads)
        err_console.print("No head_types.csv: using the default classification thresholds.", markup=False)
    categories = None
    if (Path(out) / io.CATEGORIES_FILE).exists():
        categories = io.read_table(out, io.CATEGORIES_FILE, ["category", "layer", "entropy"], "attnprobe analyze")
        io.check_fits_heads(heads, categories, io.CATEGORIES_FILE, f"attnprobe analyze --out {out}")
    examples = io.read_examples(out)
    if not examples:
        raise AttnprobeError(f"no {io.EXAMPLE_FILE} in {out}: run `attnprobe analyze --out {out}` first")
    shape = (heads["layer"].nunique(), heads["head"].nunique())
    if any(e["maps"].shape[:2] != shape for e in examples):
        raise AttnprobeError(f"{io.EXAMPLE_FILE} does not match heads.csv: run `attnprobe analyze --out {out}` again")
    picked = plotting.choose_example(examples, example)
    if chosen is not None:
        naming.check_heads_exist(chosen, *shape)
    skipped: list[str] = []
    figures = drawable({
        "entropy_heatmap": lambda: plotting.entropy_heatmap_figure(
            heads, run_title(out, "Mean attention entropy per head")),
        "layer_gradient": lambda: plotting.layer_gradient_figure(heads, layers, types, categories,
                                                                 run_title(out, "Entropy by depth and head types")),
        "head_patterns": lambda: plotting.head_patterns_figure(picked, types, heads, None,
                                                               run_title(out, "Attention patterns")),
    }, skipped, out)
    if chosen is not None:  # its own file: the by-type head_patterns stays as it is
        figures[SELECTED_PATTERNS] = plotting.head_patterns_figure(picked, types, heads, chosen,
                                                                   run_title(out, "Attention patterns"))
    if (Path(out) / io.POSITIONS_FILE).exists():
        positions = io.read_table(
            out, io.POSITIONS_FILE, ["layer", "head", "bin", "position_min", "position_max", "entropy", "first_token"],
            "attnprobe analyze",
        )
        io.check_fits_heads(heads, positions, io.POSITIONS_FILE, f"attnprobe analyze --out {out}")
        title = run_title(out, "Attention by query position")
        figures[Path(POSITION_FIGURE).stem] = plotting.position_profile_figure(positions, title)
    figures.update({Path(name).stem: f for name, f in importance_figures(out, heads, types).items()})
    figures.update(similarity_figures(out, heads, types, chosen))
    suffix = figure_format.value
    position = f"{Path(POSITION_FIGURE).stem}.{suffix}"
    files = {f"{stem}.{suffix}": io.figure_writer(f, suffix, dpi) for stem, f in figures.items()}
    stale = [name for name in (position, *(f"{stem}.{suffix}" for stem in io.ABLATE_PLOT_FIGURES))
             if name not in files]  # from an earlier run
    stale += [name for name in (f"{stem}.{suffix}" for stem in SIMILARITY_FIGURES) if name not in files]
    stale += [f"{stem}.{suffix}" for stem in skipped]  # an earlier run's figure would pass for this one's
    written = io.write_files(out, files, remove=stale)
    say_written(written)
    if chosen is not None:
        out_console.print(f"The heads chosen with --heads are in {SELECTED_PATTERNS}.{suffix}; head_patterns.{suffix} "
                          "shows one head of each type.", markup=False, highlight=False)


def importance_figures(out: Path, heads, types) -> dict:
    """importance.png and importance_vs_type.png for `plot`, when `attnprobe ablate` wrote importance.csv to `out`;
    pruning.png and layer_importance.png when it wrote pruning.csv and layer_importance.csv."""
    from attnprobe import io, plotting

    figures = {}
    for name, stem, key, draw in ((io.PRUNING_FILE, "pruning", "percent", plotting.pruning_figure),
                                  (io.LAYER_IMPORTANCE_FILE, "layer_importance", "layer",
                                   plotting.layer_importance_figure)):
        if (Path(out) / name).exists():
            measures = [c for c in io.read_columns(out, name)
                        if c.removesuffix("_ci_low").removesuffix("_ci_high") in plotting.PRUNING_LABELS]
            frame = io.read_table(out, name, [key, *measures], "attnprobe ablate")
            figures[f"{stem}.png"] = draw(frame, run_title(out, "Head ablation"))
    if not (Path(out) / io.IMPORTANCE_FILE).exists():
        return figures
    measure = "loss_change" if "loss_change" in io.read_columns(out, io.IMPORTANCE_FILE) else "embedding_change"
    columns = ["layer", "head", measure, f"{measure}_ci_low", f"{measure}_ci_high"]
    importance = io.read_table(out, io.IMPORTANCE_FILE, columns, "attnprobe ablate")
    if not set(zip(importance["layer"], importance["head"])) <= set(zip(heads["layer"], heads["head"])):
        raise AttnprobeError(f"{io.IMPORTANCE_FILE} does not match heads.csv (another model): run `attnprobe ablate "
                             f"--out {out}` again")
    title = run_title(out, "Head ablation")
    shape = (int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1)
    return {**figures, io.IMPORTANCE_FIGURE: plotting.importance_heatmap_figure(importance, title, shape),
            io.IMPORTANCE_TYPE_FIGURE: plotting.importance_vs_type_figure(importance, heads, types, title)}


def drawable(builds: dict, skipped: list[str], out: Path) -> dict:
    """The figures (name -> Figure) of `builds` (name -> function drawing it) whose data hold values; a figure
    whose scores are all NaN (plotting.Undrawable) is skipped with a warning line and its name added to
    `skipped`; when none can be drawn, one error line."""
    from attnprobe import plotting

    figures, reasons = {}, []
    for name, build in builds.items():
        try:
            figures[name] = build()
        except plotting.Undrawable as err:
            skipped.append(name)
            reasons.append(str(err))
            err_console.print(f"Warning: {name} not drawn: {err}; run `attnprobe analyze --out {out}` again to "
                              "draw it", markup=False, highlight=False, soft_wrap=True)
    if not figures:
        raise AttnprobeError(f"nothing to draw in {out}: {'; '.join(dict.fromkeys(reasons))}: run `attnprobe "
                             f"analyze --out {out}` again")
    return figures


SIMILARITY_FIGURES = ("head_similarity", "head_map")  # plot's figures of `related`'s head_similarity.npz


def similarity_figures(out: Path, heads, types, chosen: list[tuple[int, int]] | None) -> dict:
    """head_similarity and head_map for `plot`, when `attnprobe related` wrote head_similarity.npz to `out`: the
    heads named in them are the --heads ones, else one head of each type (those of head_patterns)."""
    from attnprobe import io, plotting

    similarity = io.read_similarity(out)
    if similarity is None:
        return {}
    pairs = set(zip(similarity["layer"].tolist(), similarity["head"].tolist()))
    recorded = run_model_spec(out)
    if pairs != set(zip(heads["layer"], heads["head"])) or recorded not in (None, similarity["model"]):
        raise AttnprobeError(f"{io.SIMILARITY_FILE} does not match heads.csv (another model): run `attnprobe related "
                             f"--out {out}` again")
    labelled = list(chosen) if chosen else list(plotting.representatives(types, heads).values())
    title = run_title(out, "Related heads")
    arrays = (similarity["js"], similarity["layer"], similarity["head"])
    return {"head_similarity": plotting.head_similarity_figure(*arrays, types, labelled, title),
            "head_map": plotting.head_map_figure(*arrays, types, labelled, title)}


def run_model_spec(out: Path) -> str | None:
    """The model run.json in `out` names (its spec), or None when it cannot be read."""
    import json

    try:
        return str(json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))["model"]["spec"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def run_title(out: Path, what: str) -> str:
    """`what: model on corpus`, from run.json when it can be read."""
    import json

    try:
        run = json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))
        return f"{what}: {run['model']['spec']} on {Path(run['corpus']['path']).name}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return what
