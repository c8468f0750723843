"""report.html: one self-contained page to explore a results folder, made from its files without a model.

Everything the page needs is inline: the data as JSON (attention maps as base64 uint8 fixed point), the
script and the style, from the files in `report_assets/`. The page makes no network request: its
Content-Security-Policy allows nothing but inline script, inline style and data: images.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnprobe import io
from attnprobe.bootstrap import BLOCK, FEW_SEQUENCES, interval_basis, over_sentences
from attnprobe.errors import AttnprobeError
from attnprobe.naming import sequence_noun, visible
from attnprobe.scores import POSITION_METRICS, VALUE_WEIGHTED, VW, VW_POSITION_METRICS

MAP_LEVELS = 255  # a weight p is stored as round(p * 255) in one byte: at most 1/510 off
SENTENCE_CHARS = 240  # an example's text is cut to this many characters (as report.js's SENTENCE_CHARS)
MAP_BUDGET = 20_000_000  # base64 characters of maps at most: a large model keeps fewer examples (with a note)
HEAD_PAGE_BUDGET = 40_000_000  # base64 characters of the head pages' top keys at most (else left out, with a note)
# Scores shown in the grid, in this order when present: (label, what it measures).
_MAP_SCORES: dict[str, tuple[str, str]] = {
    "entropy": ("entropy (nats)", "mean row entropy: low = sharp, high = diffuse"),
    "entropy_norm": ("normalized entropy", "entropy / ln(number of keys), 0..1"),
    "diagonal": ("diagonal", "attention within ±2 tokens of the query"),
    "first_token": ("first token", "attention on the first token (the sink)"),
    "previous_token": ("previous token", "attention on token i-1"),
    "sink_window": ("sink + window", "attention on the first S and the W most recent keys (rows i >= S + W)"),
    "self": ("self", "attention on the query's own token"),
    "distance": ("distance (tokens)", "mean attention distance |i - j|"),
    "diagonal_excess": ("diagonal excess", "diagonal minus what a uniform row scores; 0 = chance"),
    "special_tokens": ("special tokens", "attention on the special tokens the tokenizer adds"),
    "entropy_unforced": ("entropy, unforced", "entropy over rows with 2+ keys (the rule reads it)"),
    "diagonal_unforced": ("diagonal, unforced", "diagonal over rows with keys outside ±2"),
    "first_token_unforced": ("first token, unforced", "first-token mass over rows with 2+ keys"),
}
HEAD_SCORES: dict[str, tuple[str, str]] = {  # then what the head writes, and the value-weighted scores
    **_MAP_SCORES,
    "output_norm": ("output norm", "mean size of what the head writes, |sum_j a_ij W_O v_j|"),
    "punctuation": ("punctuation", "attention on punctuation tokens"),
    "duplicate_token": ("duplicate token", "attention on earlier copies of the query's token (rows that have one)"),
    **{key + VW: (f"{label}, value-weighted", f"{meaning}; each key weighted by |W_O v_j| (value-weighted)")
       for key, (label, meaning) in _MAP_SCORES.items() if key in VALUE_WEIGHTED},
}
IMPORTANCE_SCORES: dict[str, tuple[str, str]] = {
    "loss_change": ("importance: loss change", "ablate: loss change when the head is ablated (nats per token)"),
    "kl": ("importance: KL", "ablate: KL divergence of the next-token distribution when the head is ablated"),
    "embedding_change": ("importance: embedding change", "ablate: change of the sentence embedding"),
    "gradient_importance": ("importance: gradient", "ablate: gradient estimate of the head's importance"),
}
PATCHING_SCORES: dict[str, tuple[str, str]] = {
    "effect": ("patching effect", "patch: share of the clean-corrupt metric gap the head's output carries "
               "(activation patching; 1 = all of it)"),
    "attribution": ("patching: attribution", "patch: attribution patching's first-order estimate of that effect"),
}
PROBE_SCORES: dict[str, tuple[str, str]] = {
    "induction": ("probe: induction", "probe: attention to the token after the earlier copy (r r sequences)"),
    "duplicate": ("probe: duplicate", "probe: attention to the earlier copy of the token"),
    "previous": ("probe: previous", "probe: attention to the previous token on random sequences"),
}
RETRIEVAL_SCORES: dict[str, tuple[str, str]] = {  # retrieval_heads.csv's mean, under a name of its own
    "retrieval_score": ("retrieval: needle copying", "attnprobe retrieval: share of the needle's tokens the head "
                        "copied with its top-1 key (Wu et al. 2024), mean over trials"),
}
POSITION_SCORES = (*POSITION_METRICS, *VW_POSITION_METRICS)
TYPE_LETTERS = {"local": "L", "copy": "C", "broad": "B", "mixed": "M", "previous": "P", "sink": "S", "dormant": "D",
                "streaming": "S", "full-cache": "F"}
TYPE_MEANING = {
    "local": "most attention within ±2 tokens", "copy": "locks onto one or two tokens",
    "broad": "spreads widely", "mixed": "none of the above", "previous": "a local head on token i-1",
    "sink": "a copy head on the first token", "dormant": "a sink that writes little (small output_norm)",
    "streaming": "fits a sink + recent-window KV cache",
    "full-cache": "needs keys outside the sinks and the window (the whole KV cache)",
}
_PLACEHOLDER = re.compile(r"/\*@(TITLE|CSS|JS|DATA|HEADER|SECTIONS|PROVENANCE)@\*/")


@dataclass
class Section:
    """An extra section of the page (e.g. a comparison): `html` is trusted markup made by attnprobe itself.

    It must be self-contained too: inline SVG or data: images, no external src or href.
    """

    id: str
    title: str
    html: str


def image_section(id: str, title: str, png: bytes, text: str = "", alt: str = "") -> Section:
    """A Section showing a PNG (inline, as a data: URI) under an optional paragraph of plain `text`."""
    source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    paragraph = f"<p>{html.escape(text)}</p>" if text else ""
    return Section(id, title, f'{paragraph}<img src="{source}" alt="{html.escape(alt or title)}">')


@dataclass
class Report:
    html: str
    notes: list[str] = field(default_factory=list)  # what was left out, and why
    examples: int = 0


def build_report(out: str | Path, sections: list[Section] | tuple[Section, ...] = ()) -> Report:
    """The page for the results folder `out`: heads.csv, layers.csv and run.json are needed, the rest is used
    when present (head_types.csv, categories.csv, positions.csv, examples.npz or example_attention.npz,
    importance.csv, probe.csv, retrieval_heads.csv, patching.csv, head_similarity.npz, a comparison `attnprobe
    compare` wrote into `out` or `out/compare`, and a circuit: edges.csv with circuit.json)."""
    data, notes = report_data(out)
    sections = [*sections, *compare_sections(Path(out)), *circuit_sections(Path(out))]
    return Report(render(data, sections), notes, len(data["examples"]))


COMPARE_FOLDER = "compare"  # where `attnprobe compare A B` writes by default: B/compare


def compare_sections(out: Path) -> list[Section]:
    """A section per comparison written into `out` itself or into `out/compare`."""
    return [compare_section(folder) for folder in (out, out / COMPARE_FOLDER)
            if (folder / io.COMPARE_RUN_FILE).is_file()]


def compare_section(folder: Path) -> Section:
    """The comparison in `folder`: what was compared and how, the heads that changed most, compare.png."""
    info = io.read_json(folder, io.COMPARE_RUN_FILE, "attnprobe compare OUT_A OUT_B")
    score = info.get("score", "entropy")
    lines = [visible(f"B - A, A = {info['a']['label']}, B = {info['b']['label']}."), info.get("matching", ""),
             f"{info.get('pairing', '')}: {info.get('pairing_reason', '')}."]
    rows = "".join(_change_row(change) for change in info.get("top") or [])
    table = (f"<table><caption>Largest changes of {html.escape(score)} whose 95% interval excludes 0</caption>"
             "<tr><th>head / depth</th><th>A</th><th>B</th><th>B - A</th><th>95% interval</th></tr>"
             f"{rows}</table>") if rows else f"<p>No {html.escape(score)} change has an interval that excludes 0.</p>"
    figure = folder / io.COMPARE_FIGURE
    image = ""
    if figure.is_file():
        source = "data:image/png;base64," + base64.b64encode(figure.read_bytes()).decode("ascii")
        image = f'<img src="{source}" alt="comparison figure: {html.escape(score)}, B - A">'
    text = "".join(f"<p>{html.escape(line)}</p>" for line in lines if line.strip(" .:"))
    return Section(f"compare-{folder.name}", f"Comparison ({folder.name})", text + table + image)


def _change_row(change: dict[str, Any]) -> str:
    """One changed head (or relative depth, for runs of different shapes) as a table row."""
    where = change["name"] if "name" in change else f"depth {_fmt(change.get('depth'))[:4]}"
    low, high = change.get("ci") or (None, None)
    cells = [html.escape(str(where)), _fmt(change.get("a")), _fmt(change.get("b")), _fmt(change.get("diff"), True),
             f"[{_fmt(low, True)}, {_fmt(high, True)}]"]
    return "<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"


def _fmt(value: Any, sign: bool = False) -> str:
    if not isinstance(value, (int, float)) or value != value:  # None, text, NaN
        return "-"
    return f"{value:+.4f}" if sign else f"{value:.4f}"


# ---- the circuit section: `attnprobe circuit`'s files -------------------------------------------------------

CIRCUIT_EDGES, CIRCUIT_RECORD = io.CIRCUIT_EDGES_FILE, io.CIRCUIT_RUN_FILE  # the circuit command's edges and record
CIRCUIT_TOP = 20  # edges in the section's table, strongest |score| first
CIRCUIT_FALLBACK = 50  # edges drawn when edges.csv marks no circuit (no in_circuit column): the strongest


def circuit_sections(out: Path) -> list[Section]:
    """The Circuit section, when `out` holds the circuit command's edges.csv and circuit.json."""
    present = all((out / name).is_file() for name in (CIRCUIT_EDGES, CIRCUIT_RECORD))
    return [circuit_section(out)] if present else []


def circuit_section(folder: Path) -> Section:
    """The circuit in `folder`: its CPR and CMD, the settings, the graph and the faithfulness curve as images
    (drawn here from the files), and the strongest edges as a table. circuit.json may hold cpr, cmd and curve at its
    top or under "faithfulness", and its settings under "settings" or as the circuit command's own keys."""
    made_by = "attnprobe circuit"
    info = io.read_json(folder, CIRCUIT_RECORD, made_by)
    edges = io.read_table(folder, CIRCUIT_EDGES, ["score"], made_by)
    missing = [c for c in ("sender", "receiver", "input") if c not in edges.columns]
    if missing:
        raise AttnprobeError(f"{folder / CIRCUIT_EDGES} lacks column(s) {', '.join(missing)}: run `{made_by}` again")
    edges = edges.assign(input=edges["input"].fillna("").astype(str))
    faith = _part(info, "faithfulness") or info
    parts = [f"<p>{html.escape(_circuit_scores(faith))}</p>"]
    notes = [visible(str(note)) for note in info.get("notes") or [] if note]
    if notes:
        parts.append('<ul class="run-notes">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    if "in_circuit" not in edges.columns:
        strongest = edges["score"].abs().rank(ascending=False, method="first") <= CIRCUIT_FALLBACK
        edges = edges.assign(in_circuit=strongest)
        parts.append(f"<p>{CIRCUIT_EDGES} marks no circuit (no in_circuit column): the {CIRCUIT_FALLBACK} "
                     "strongest edges are drawn.</p>")
    settings = _circuit_settings(info)
    parts.append(_settings_table(settings))
    layers = next((v for v in (settings.get("layers"), _part(info, "graph").get("layers"))
                   if isinstance(v, int) and not isinstance(v, bool)), None)
    parts.append(_circuit_images(edges, faith.get("curve"), layers))
    parts.append(_edges_table(edges))
    return Section("circuit", "Circuit", "".join(parts))


def _part(info: dict[str, Any], key: str) -> dict[str, Any]:
    """info[key] where it is an object, else {}."""
    value = info.get(key)
    return value if isinstance(value, dict) else {}


def _circuit_scores(faith: dict[str, Any]) -> str:
    """CPR and CMD as MIB defines them (and random circuits' CPR, the clean and corrupt metric where given)."""
    text = (f"CPR {_fmt(faith.get('cpr'))} (the area under the faithfulness curve over circuit size: higher is "
            f"better); CMD {_fmt(faith.get('cmd'))} (the area between that curve and 1: lower is better)")
    if isinstance(faith.get("random_cpr"), (int, float)):
        text += f"; random circuits of the same sizes: CPR {_fmt(faith['random_cpr'])}"
    if isinstance(faith.get("clean"), (int, float)) and isinstance(faith.get("corrupt"), (int, float)):
        text += f". The metric: clean {_fmt(faith['clean'], True)}, corrupt {_fmt(faith['corrupt'], True)}"
    return text + "."


def _circuit_settings(info: dict[str, Any]) -> dict[str, Any]:
    """circuit.json's "settings", else the circuit command's own keys (model, pairs, method, circuit, graph)."""
    if isinstance(info.get("settings"), dict):
        return info["settings"]
    pairs, circuit, graph = _part(info, "pairs"), _part(info, "circuit"), _part(info, "graph")
    chosen = circuit.get("edges")
    return {"model": _part(info, "model").get("spec"), "pairs": pairs.get("count"), "pairs from": pairs.get("from"),
            "method": info.get("method"), "steps": info.get("steps"), "metric": info.get("metric"),
            "circuit chosen by": circuit.get("chosen_by"), "top": circuit.get("top"),
            "threshold": circuit.get("threshold"), "edges in the circuit": len(chosen) if isinstance(chosen, list)
            else None, "edges in the graph": graph.get("edges"), "layers": graph.get("layers"),
            "heads": graph.get("heads"), "ablation": _part(info, "faithfulness").get("ablation")}


def _settings_table(settings: dict[str, Any]) -> str:
    """The settings with a plain value (text, number, true/false) as label/value rows."""
    rows = "".join(f'<tr><th scope="row">{html.escape(visible(str(key)))}</th>'
                   f"<td>{html.escape(visible(str(value)))}</td></tr>"
                   for key, value in settings.items() if isinstance(value, (str, int, float, bool)))
    return f'<table class="provenance"><caption>Settings</caption><tbody>{rows}</tbody></table>' if rows else ""


def _circuit_images(edges: pd.DataFrame, curve: Any, layers: int | None) -> str:
    """The graph of the circuit (`layers` rows, else as many as the edges name) and, where a curve is given, its
    faithfulness, as inline PNG images."""
    from io import BytesIO

    from attnprobe import plotting
    from attnprobe.plotting.circuit import CURVE_COLUMNS

    def png(figure: Any) -> str:
        buffer = BytesIO()
        figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

    if layers is None:
        named = pd.concat([edges["sender"], edges["receiver"]]).astype(str).str.extract(r"^[am](\d+)")[0].dropna()
        layers = int(named.astype(int).max()) + 1 if len(named) else 1
    chosen = int(edges["in_circuit"].astype(bool).sum())
    images = [f'<img src="{png(plotting.circuit_figure(edges, layers))}" alt="the circuit: {chosen} of '
              f'{len(edges)} edges, by layer">']
    table = pd.DataFrame(curve if isinstance(curve, list) else [])
    if all(c in table.columns for c in CURVE_COLUMNS) and len(table):
        images.append(f'<img src="{png(plotting.faithfulness_figure(table))}" alt="faithfulness over circuit '
                      'size, beside random circuits">')
    else:
        images.append(f"<p>{CIRCUIT_RECORD} holds no faithfulness curve.</p>")
    return "".join(images)


def _edges_table(edges: pd.DataFrame) -> str:
    """The CIRCUIT_TOP edges of largest |score|, with whether each is in the circuit."""
    top = edges.assign(size=edges["score"].abs()).nlargest(CIRCUIT_TOP, "size")
    rows = "".join(
        "<tr>" + "".join(f"<td>{cell}</td>" for cell in (
            rank, html.escape(visible(str(row.sender))), html.escape(visible(str(row.receiver))),
            html.escape(visible(str(row.input))) or "-", f"{row.score:+.4g}", "yes" if row.in_circuit else "no"))
        + "</tr>" for rank, row in enumerate(top.itertuples(index=False), start=1))
    return (f'<table class="types"><caption>The {len(top)} strongest edges of {len(edges)}</caption>'
            "<tr><th>#</th><th>sender</th><th>receiver</th><th>input</th><th>score</th><th>in circuit</th></tr>"
            f"{rows}</table>")


def report_data(out: str | Path) -> tuple[dict[str, Any], list[str]]:
    """Everything the page shows, as plain JSON-ready data, and notes on what was left out."""
    out = Path(out)
    if not out.is_dir():
        raise AttnprobeError(f"--out {out} is not a results folder: run `attnprobe analyze --out {out}` first")
    made_by = f"attnprobe analyze --out {out}"
    heads = io.read_table(out, io.HEADS_FILE, ["layer", "head", "entropy"], "attnprobe analyze")
    run = io.read_run(out)
    layers_table = io.read_table(out, io.LAYERS_FILE, ["layer", "entropy"], "attnprobe analyze")
    io.check_fits_heads(heads, layers_table, io.LAYERS_FILE, made_by)
    n_layers, n_heads = int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1
    if len(heads) != n_layers * n_heads or (run["model"]["layers"], run["model"]["heads"]) != (n_layers, n_heads):
        raise AttnprobeError(f"{io.HEADS_FILE} does not hold every head of the {run['model']['layers']} x "
                             f"{run['model']['heads']} model in {io.RUN_FILE}: run `{made_by}` again")
    heads = heads.sort_values(["layer", "head"]).reset_index(drop=True)
    notes: list[str] = []
    scores, values, low, high = [], {}, {}, {}

    def add(frame: pd.DataFrame, catalogue: dict[str, tuple[str, str]], source: str) -> None:
        for key, (label, meaning) in catalogue.items():
            if key not in frame.columns or key in values:
                continue
            column = pd.to_numeric(frame[key], errors="coerce")
            if column.isna().all():  # e.g. sink_window when no sequence is longer than S + W
                continue
            scores.append({"key": key, "label": label, "meaning": meaning, "source": source})
            values[key] = _numbers(column)
            if f"{key}_ci_low" in frame.columns and f"{key}_ci_high" in frame.columns:
                # 4 significant digits: the page prints intervals to 3 decimals, and a 30 x 9 model's page must stay
                # under 5 MB with every score's interval in it
                low[key], high[key] = _numbers(frame[f"{key}_ci_low"], 4), _numbers(frame[f"{key}_ci_high"], 4)

    add(heads, HEAD_SCORES, io.HEADS_FILE)
    for name, catalogue, made in ((io.IMPORTANCE_FILE, IMPORTANCE_SCORES, "ablate"),
                                  (io.PROBE_FILE, PROBE_SCORES, "probe"), (io.PATCHING_FILE, PATCHING_SCORES, "patch")):
        folder = out / io.PROBE_FOLDER if made == "probe" and not (out / name).is_file() else out  # its default
        extra = _optional_grid(folder, name, catalogue, heads, run, made, notes)
        if extra is not None:
            add(extra, catalogue, name)
    retrieval = _retrieval_grid(out, heads, run, notes)
    if retrieval is not None:
        add(retrieval, RETRIEVAL_SCORES, io.RETRIEVAL_FILE)
    types, scheme = _types(out, heads, notes)
    examples, stored = [], 0
    found = io.read_examples(out)[:io.MAX_EXAMPLES]
    for i, example in enumerate(found):
        if example["maps"].shape[:2] != (n_layers, n_heads):
            raise AttnprobeError(f"example {i} of {out} has maps for {example['maps'].shape[:2]} heads, not "
                                 f"{n_layers} x {n_heads} as in {io.HEADS_FILE}: run `{made_by}` again")
        encoded, triangular = encode_maps(example["maps"])
        stored += len(encoded)
        if examples and stored > MAP_BUDGET:
            notes.append(f"only {len(examples)} of {len(found)} example sentences are shown: the maps of this "
                         f"{n_layers} x {n_heads} model would make the page too large")
            break
        # corpus text reaches the page only through `visible`: a NUL or a bidi override shows as its escape
        examples.append({"sentence": visible(short_sentence(example["sentence"]), keep=LAYOUT),
                         "tokens": [visible(str(t), keep=LAYOUT) for t in example["tokens"]],
                         "total": example["total_tokens"], "category": visible(example["category"]) or None,
                         "tri": triangular, "maps": encoded})
    if not examples:
        notes.append(f"no {io.EXAMPLES_FILE} or {io.EXAMPLE_FILE}: no attention patterns to show")
    data = {
        "layers": n_layers, "heads": n_heads, "model": visible(str(run["model"]["spec"])),
        "causal": run["model"].get("causal"),
        "scores": scores, "values": values, "low": low, "high": high,
        "types": types, "scheme": scheme,
        "typeLetters": TYPE_LETTERS, "typeMeaning": TYPE_MEANING,
        "layerScores": _layer_scores(layers_table, n_layers),
        "categories": _categories(out, n_layers),
        "positions": _positions(out, heads, n_layers, n_heads),
        "examples": examples, "levels": MAP_LEVELS,
        "initial": _initial_head(heads),
        "related": _related(out, run, n_layers, n_heads, notes),
        "headPages": head_pages(out, n_layers, n_heads, notes),
        "summary": summary_sentence(run),
        "runNotes": [visible(str(note)) for note in run.get("notes") or []],  # run.json's warnings, shown as such
        "intervalsOver": "blocks of query rows" if (run.get("bootstrap") or {}).get("method") == BLOCK else "sentences",
        "typesSummary": types_sentence(types, scheme),
        "provenance": provenance(run, out),
        "notes": [visible(str(note)) for note in notes],
    }
    return data, notes


LAYOUT = "\n\t"  # kept by `visible` in sentences and tokens: the page shows them as the text's layout (⏎, ⇥)


def short_sentence(text: str, limit: int = SENTENCE_CHARS) -> str:
    """An example's text as its panel heads it: cut to `limit` characters with an ellipsis (one long document
    would otherwise print its whole text; the panel gives the token count)."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def encode_maps(maps: np.ndarray) -> tuple[str, bool]:
    """[layer, head, query, key] weights as base64 bytes of round(p * 255): row by row, only the keys up to the
    query (a lower triangle) when nothing lies above the diagonal (a causal model), else every key."""
    weights = np.clip(np.nan_to_num(np.asarray(maps, dtype=np.float32), nan=0.0), 0.0, 1.0)
    n = weights.shape[-1]
    quantized = np.rint(weights * MAP_LEVELS).astype(np.uint8)
    triangular = bool(n > 1 and not np.any(np.triu(quantized, 1)))
    if triangular:
        rows, cols = np.tril_indices(n)
        quantized = quantized[..., rows, cols]  # [layer, head, n(n+1)/2]: row i starts at i(i+1)/2
    return base64.b64encode(np.ascontiguousarray(quantized).tobytes()).decode("ascii"), triangular


def decode_maps(encoded: str, triangular: bool, layers: int, heads: int, n: int) -> np.ndarray:
    """The inverse of encode_maps (for tests and Python readers): [layer, head, query, key] float32."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype=np.uint8).astype(np.float32) / MAP_LEVELS
    if not triangular:
        return raw.reshape(layers, heads, n, n)
    maps = np.zeros((layers, heads, n, n), dtype=np.float32)
    rows, cols = np.tril_indices(n)
    maps[..., rows, cols] = raw.reshape(layers, heads, -1)
    return maps


def summary_sentence(run: dict[str, Any]) -> str:
    """The run's early-vs-late entropy summary, as one sentence."""
    s = run.get("summary") or {}
    try:
        early, late, diff = s["early_entropy"], s["late_entropy"], s["difference"]
        (e0, e1), (l0, l1) = s["early_layers"], s["late_layers"]
    except (KeyError, TypeError, ValueError):
        return "run.json holds no early/late summary."

    def ci(key: str, sign: str = "") -> str:
        bounds = s.get(f"{key}_ci")
        if not bounds or any(b is None for b in bounds):
            return ""
        return f" [{bounds[0]:{sign}.3f}, {bounds[1]:{sign}.3f}]"

    verb = "falls" if late < early else "rises" if late > early else "stays"

    def span(a: int, b: int) -> str:
        return f"layer {a}" if a == b else f"layers {a}-{b}"

    return (f"Mean attention entropy {verb} from {early:.3f}{ci('early_entropy')} nats in {span(e0, e1)} "
            f"to {late:.3f}{ci('late_entropy')} in {span(l0, l1)}; early - late = {diff:+.3f}"
            f"{ci('difference', '+')} (95% intervals: {interval_basis(run)}){gradient_verdict(run)}.")


def gradient_verdict(run: dict[str, Any]) -> str:
    """What the difference's interval says, as far as the bootstrap behind it can: only a bootstrap over enough
    sentences speaks of another sample of sentences."""
    bounds = run["summary"].get("difference_ci") or [None, None]
    if None in bounds:
        return ""
    if not (bounds[0] > 0 or bounds[1] < 0):
        return ": the interval includes 0, so this sample does not show a gradient"
    if over_sentences(run):
        return ": the interval excludes 0, so the gradient would survive another sample of sentences"
    if (run.get("bootstrap") or {}).get("method") == BLOCK:
        return (": the interval excludes 0, so the gradient holds along these sequences' rows; whether other text "
                f"shows it takes {FEW_SEQUENCES} or more sequences")
    return f": the interval excludes 0, but an interval over fewer than {FEW_SEQUENCES} sentences means little"


def types_sentence(types: list[str | None], scheme: str | None) -> str:
    counts = pd.Series([t for t in types if t]).value_counts()
    if counts.empty:
        return ""
    parts = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return f"Head types ({scheme} scheme): {parts} of {len(types)} heads."


def provenance(run: dict[str, Any], out: Path) -> list[list[str]]:
    """(label, value) rows: model, corpus, settings, versions."""
    model, corpus = run.get("model", {}), run.get("corpus", {})
    attention, boot, versions = run.get("attention", {}), run.get("bootstrap", {}), run.get("versions", {})
    shape = f"{model.get('layers')} layers x {model.get('heads')} heads"
    if model.get("kv_heads") not in (None, model.get("heads")):
        shape += f" ({model['kv_heads']} KV heads)"
    shape += f", head_dim {model.get('head_dim')}, " + ("causal (decoder)" if model.get("causal", True) else "encoder")
    rows = [
        ("model", model.get("spec")), ("architecture", model.get("architecture")), ("shape", shape),
        ("source", model.get("source")), ("package", model.get("package")),
        ("GGUF sha256", model.get("gguf_sha256")), ("revision", model.get("revision")),
        ("corpus", corpus.get("path")), ("corpus sha256", corpus.get("sha256")),
        (f"{sequence_noun(corpus.get('split'))}s / tokens",
         f"{run.get('sentences')} / {run.get('tokens')} (longest {run.get('longest_sequence')}, truncated "
         f"{run.get('truncated_sentences', 0)})"),
        ("device / dtype / batch size", f"{run.get('device')} / {run.get('dtype')} / {run.get('batch_size')}"),
        ("attention", f"{attention_ran(attention)}, sink_window S = {attention.get('sink_tokens')}, W = "
                      f"{attention.get('window')}"),
        ("bootstrap", f"{boot.get('resamples')} resamples, {interval_basis(run)}, seed {boot.get('seed')}, "
                      f"{boot.get('confidence', 0.95):.0%} intervals"),
        ("processes", (run.get("distributed") or {}).get("world_size")),
        ("versions", ", ".join([f"attnprobe {run.get('attnprobe_version', '?')}",
                                *(f"{k} {v}" for k, v in versions.items())])),
        ("created", run.get("created")),
        ("wall time", f"{run['wall_seconds']:.1f} s" if "wall_seconds" in run else None),
        ("results folder", str(out.resolve())),
    ]
    return [[label, visible(str(value))] for label, value in rows if value not in (None, "")]


def attention_ran(attention: dict[str, Any]) -> str:
    """What measured the sequences, from run.json's `attention`: its `sequences` count per kernel where it has them
    (not "fused (asked: auto)" where every sequence was shorter than fused_min_tokens and ran blocked), then the
    path chosen and what was asked."""
    from attnprobe.naming import counted

    ran = attention.get("sequences") or {}
    counts = {name: n for name, n in ran.items() if isinstance(n, int) and n > 0}
    path, asked = attention.get("path"), attention.get("requested")
    if not counts:
        return f"{path} (asked: {asked})"
    chosen = f"asked: {asked}"
    if path == "fused" and attention.get("fused_min_tokens"):
        chosen += f"; fused runs batches of {attention['fused_min_tokens']}+ tokens, blocked the shorter ones"
    elif set(counts) - {"from_checkpoint"} != {path}:
        chosen += f"; path {path}"
    measured = ", ".join(f"{name} for {counted(n, 'sequence')}" if name != "from_checkpoint" else
                         f"{counted(n, 'sequence')} from a checkpoint" for name, n in counts.items())
    return f"{measured} ({chosen})"


def render(data: dict[str, Any], sections: list[Section] | tuple[Section, ...] = ()) -> str:
    assets = resources.files("attnprobe") / "report_assets"
    template = (assets / "template.html").read_text(encoding="utf-8")
    title = f"attnprobe report: {data['model']}"
    parts = {
        "TITLE": html.escape(title),
        "CSS": _unindented((assets / "report.css").read_text(encoding="utf-8")),
        "JS": _unindented((assets / "report.js").read_text(encoding="utf-8")),
        "DATA": _script_json(data),
        "HEADER": _header(title, data),
        "SECTIONS": "".join(f'<section id="{html.escape(s.id)}" class="extra"><h2>{html.escape(s.title)}</h2>'
                            f"{s.html}</section>" for s in sections),
        "PROVENANCE": "".join(f"<tr><th scope=\"row\">{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                              for k, v in data["provenance"]),
    }
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], template)


def _unindented(text: str) -> str:
    """report.js or report.css without the indentation of its lines, which neither language reads (no template
    literal or continued string spans lines there): 4 kB less of a page that must stay small."""
    return "\n".join(line.strip() for line in text.splitlines())


def _header(title: str, data: dict[str, Any]) -> str:
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data["notes"])
    warnings = "".join(f"<li>{html.escape(n)}</li>" for n in data.get("runNotes", []))
    return (f"<h1>{html.escape(title)}</h1><p class=\"summary\" id=\"summary\">{html.escape(data['summary'])}</p>"
            + (f"<ul class=\"run-notes\" id=\"run-notes\">{warnings}</ul>" if warnings else "")
            + f"<p class=\"summary\">{html.escape(data['typesSummary'])}</p>"
            + (f"<details class=\"notes\"><summary>Notes</summary><ul>{notes}</ul></details>" if notes else ""))


def _script_json(data: dict[str, Any]) -> str:
    """JSON that is safe inside <script type="application/json">: no `<`, `>` or `&` as such."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _numbers(column: pd.Series, digits: int = 5) -> list[float | None]:
    """Floats rounded to `digits` significant digits; NaN as None (JSON has no NaN)."""
    result: list[float | None] = []
    for value in pd.to_numeric(column, errors="coerce").to_numpy(dtype=float):
        result.append(None if not math.isfinite(value) else float(f"{value:.{digits}g}"))
    return result


def _optional_grid(out: Path, name: str, catalogue: dict[str, tuple[str, str]], heads: pd.DataFrame,
                   run: dict[str, Any], made: str, notes: list[str]) -> pd.DataFrame | None:
    """importance.csv or probe.csv aligned to heads.csv's rows, or None (absent, or from another model: noted)."""
    if not (out / name).is_file():
        return None
    present = [c for c in catalogue if c in io.read_columns(out, name)]
    if not present:
        notes.append(f"{name} holds none of {', '.join(catalogue)}: not shown")
        return None
    columns = io.read_columns(out, name)
    if "position" in columns or "receivers" in columns:
        notes.append(f"{name} holds path patching or one row per head and position: not shown")
        return None
    frame = io.read_table(out, name, ["layer", "head", *present], f"attnprobe {made}")
    info_file = {"ablate": io.ABLATE_RUN_FILE, "probe": io.PROBE_RUN_FILE, "patch": io.PATCH_RUN_FILE}[made]
    try:
        spec = json.loads((out / info_file).read_text(encoding="utf-8"))["model"]["spec"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        spec = None
    if spec is not None and spec != run["model"]["spec"]:
        notes.append(f"{name} is from another model ({spec}, not {run['model']['spec']}): not shown")
        return None
    if not set(zip(frame["layer"], frame["head"])) <= set(zip(heads["layer"], heads["head"])):
        notes.append(f"{name} does not fit this model's heads: not shown")
        return None
    return heads[["layer", "head"]].merge(frame, on=["layer", "head"], how="left")


def _retrieval_grid(out: Path, heads: pd.DataFrame, run: dict[str, Any], notes: list[str]) -> pd.DataFrame | None:
    """retrieval_heads.csv's mean and interval as retrieval_score (and _ci_low, _ci_high), aligned to heads.csv's
    rows, or None (absent, or from another model or shape: noted)."""
    if not (out / io.RETRIEVAL_FILE).is_file():
        return None
    frame = io.read_table(out, io.RETRIEVAL_FILE, ["layer", "head", "mean", "ci_low", "ci_high"], "attnprobe retrieval")
    try:
        spec = json.loads((out / io.RETRIEVAL_RUN_FILE).read_text(encoding="utf-8"))["model"]["spec"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        spec = None
    if spec is not None and spec != run["model"]["spec"]:
        notes.append(f"{io.RETRIEVAL_FILE} is from another model ({spec}, not {run['model']['spec']}): not shown")
        return None
    if not set(zip(frame["layer"], frame["head"])) <= set(zip(heads["layer"], heads["head"])):
        notes.append(f"{io.RETRIEVAL_FILE} does not fit this model's heads: not shown")
        return None
    key = next(iter(RETRIEVAL_SCORES))
    frame = frame.rename(columns={"mean": key, "ci_low": f"{key}_ci_low", "ci_high": f"{key}_ci_high"})
    return heads[["layer", "head"]].merge(frame[["layer", "head", key, f"{key}_ci_low", f"{key}_ci_high"]],
                                          on=["layer", "head"], how="left")


def _types(out: Path, heads: pd.DataFrame, notes: list[str]) -> tuple[list[str | None], str]:
    from attnprobe.classify import RULE_COLUMNS, classify

    if (out / io.TYPES_FILE).is_file():
        columns = io.read_columns(out, io.TYPES_FILE)
        types = io.read_table(out, io.TYPES_FILE, ["layer", "head", "head_type"], "attnprobe classify")
        io.check_same_heads(heads, types, io.TYPES_FILE, f"attnprobe classify --out {out}")
        scheme = "kv" if "kv_head" in columns else "extended" if "previous_token" in columns else "default"
    elif all(c in heads.columns for c in RULE_COLUMNS):
        types, scheme = classify(heads), "default"
        notes.append("no head_types.csv: head types from the default thresholds (run `attnprobe classify`)")
    else:
        return [None] * len(heads), "none"
    merged = heads[["layer", "head"]].merge(types[["layer", "head", "head_type"]], on=["layer", "head"], how="left")
    return [t if isinstance(t, str) else None for t in merged["head_type"]], scheme


def _layer_scores(layers: pd.DataFrame, n_layers: int) -> dict[str, dict[str, list[float | None]]]:
    layers = layers.set_index("layer").reindex(range(n_layers))
    result = {}
    for key in [*HEAD_SCORES, *[c for c in layers.columns if c.startswith("entropy_head_")]]:
        if key in layers.columns and not layers[key].isna().all():
            entry = {"mean": _numbers(layers[key])}
            if f"{key}_ci_low" in layers.columns:
                entry["low"], entry["high"] = _numbers(layers[f"{key}_ci_low"]), _numbers(layers[f"{key}_ci_high"])
            result[key] = entry
    return result


def _categories(out: Path, n_layers: int) -> dict[str, Any] | None:
    if not (out / io.CATEGORIES_FILE).is_file():
        return None
    frame = io.read_table(out, io.CATEGORIES_FILE, ["category", "layer", "entropy"], "attnprobe analyze")
    io.check_fits_heads(pd.DataFrame({"layer": range(n_layers)}), frame, io.CATEGORIES_FILE,
                        f"attnprobe analyze --out {out}")
    # normalized entropy where categories.csv has it, as plot's layer_gradient.png: raw entropy grows with the
    # number of keys, so the category of the longest sentences would sit highest by length alone
    score = "entropy_norm" if "entropy_norm" in frame.columns and frame["entropy_norm"].notna().any() else "entropy"
    lines = []
    for name, group in frame.groupby("category", sort=False):
        group = group.set_index("layer").reindex(range(n_layers))
        line = {"name": visible(str(name)), "mean": _numbers(group[score])}  # a corpus's category name
        if f"{score}_ci_low" in group.columns:
            line["low"], line["high"] = _numbers(group[f"{score}_ci_low"]), _numbers(group[f"{score}_ci_high"])
        if "sentences" in group.columns and group["sentences"].notna().any():
            line["sentences"] = int(group["sentences"].max())
        lines.append(line)
    if score == "entropy_norm":
        label, caption = "normalized entropy H / ln(keys)", ("Mean normalized entropy per category (entropy / "
                                                              "ln(keys): sentence length cancels out)")
    else:
        label, caption = "entropy (nats)", "Mean entropy per category (nats; raw: longer sentences sit higher)"
    return {"score": score, "label": label, "caption": caption, "lines": lines}


def _positions(out: Path, heads: pd.DataFrame, n_layers: int, n_heads: int) -> dict[str, Any] | None:
    """Per score, [layer * heads + head][bin] means, and the bins' position ranges."""
    if not (out / io.POSITIONS_FILE).is_file():
        return None
    frame = io.read_table(out, io.POSITIONS_FILE, ["layer", "head", "bin", "position_min", "position_max"],
                          "attnprobe analyze")
    io.check_fits_heads(heads, frame, io.POSITIONS_FILE, f"attnprobe analyze --out {out}")
    bins = frame.drop_duplicates("bin").sort_values("bin")
    labels = [f"{int(a)}" if a == b else f"{int(a)}-{int(b)}" for a, b in zip(bins["position_min"],
                                                                              bins["position_max"])]
    index = pd.MultiIndex.from_product([range(n_layers), range(n_heads), bins["bin"].tolist()])
    frame = frame.set_index(["layer", "head", "bin"]).reindex(index)
    values = {}
    for key in POSITION_SCORES:
        if key in frame.columns and not frame[key].isna().all():
            flat = _numbers(frame[key], 4)
            values[key] = [flat[i:i + len(labels)] for i in range(0, len(flat), len(labels))]
    return {"bins": labels, "values": values} if values else None


def _related(out: Path, run: dict[str, Any], n_layers: int, n_heads: int, notes: list[str]) -> dict[str, Any] | None:
    """Per head (layer * heads + head), its NEAREST heads by JS divergence and the divergences, from
    head_similarity.npz when `attnprobe related` wrote one for this model (else None, with a note)."""
    from attnprobe.headspace import NEAREST, nearest_heads

    similarity = io.read_similarity(out)
    if similarity is None:
        return None
    if similarity["model"] != run["model"]["spec"]:
        notes.append(f"{io.SIMILARITY_FILE} is from another model ({visible(similarity['model'])}, not "
                     f"{visible(str(run['model']['spec']))}): nearest heads not shown")
        return None
    index = similarity["layer"] * n_heads + similarity["head"]  # [row]: the page's head index of each row
    if sorted(index.tolist()) != list(range(n_layers * n_heads)) or similarity["layer"].max() >= n_layers \
            or similarity["head"].max() >= n_heads:
        notes.append(f"{io.SIMILARITY_FILE} does not fit this model's heads: nearest heads not shown")
        return None
    js = np.empty_like(similarity["js"])
    js[np.ix_(index, index)] = similarity["js"]  # [head, head] in the page's order
    layers, heads = np.divmod(np.arange(len(js)), n_heads)  # [head] each, the page's order
    nearest, values = [], []
    for layer, head in zip(layers, heads):
        found = nearest_heads(js, layers, heads, int(layer), int(head), NEAREST)
        nearest.append([a * n_heads + b for a, b, _ in found])
        values.append([float(f"{value:.5g}") for *_, value in found])
    return {"nearest": nearest, "js": values, "sentences": int(similarity["sentences"]),
            "rows": int(similarity["rows"])}


def head_pages(out: Path, n_layers: int, n_heads: int, notes: list[str]) -> dict[str, Any] | None:
    """The head pages from head_examples.npz (analyze), or None (absent, or too large: noted): its statistics, its
    segments (the window's tokens and the far keys' labels), per entry its segment and the offset of its rows, the
    top keys of every row as base64 indices into the segment's labels (uint8, or uint16 where a segment keeps more
    than 255 labels; the largest value: no key) and their weights as base64 bytes round(w * 255), and per head its
    picks by statistic [entry, value, decile, extreme]."""
    found = io.read_head_examples(out)
    if found is None:
        notes.append(f"no {io.HEAD_EXAMPLES_FILE}: no head pages (`attnprobe analyze --head-examples --out {out}` "
                     "writes it)")
        return None
    layer, head = found["entry_layer"], found["entry_head"]
    if len(layer) and (layer.max() >= n_layers or head.max() >= n_heads or min(layer.min(), head.min()) < 0):
        notes.append(f"{io.HEAD_EXAMPLES_FILE} does not fit this model's heads: head pages not shown")
        return None
    offsets, positions = found["label_offsets"], found["label_positions"]
    widest = int(np.diff(offsets).max()) if len(offsets) > 1 else 0
    dtype, none = (np.uint8, 255) if widest < 255 else (np.uint16, 65535)
    if widest >= 65535:
        notes.append(f"{io.HEAD_EXAMPLES_FILE} keeps more labels per window than the page holds: head pages not shown")
        return None
    rows_segment = np.repeat(found["entry_segment"], np.diff(found["row_offsets"]))  # [row]
    keys = found["keys"]  # [row, k]
    # (segment, position) as one sorted int64 key: every row's keys found among its own segment's labels at once
    flat = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)) * 2**32 + positions  # [label] ascending
    wanted = rows_segment[:, None] * 2**32 + keys  # [row, k]
    at = np.minimum(np.searchsorted(flat, wanted), max(len(flat) - 1, 0))  # [row, k]
    ok = (keys >= 0) & (flat[at] == wanted) if len(flat) else np.zeros(keys.shape, dtype=bool)
    index = np.where(ok, at - offsets[:-1][rows_segment][:, None], none)  # [row, k]: into the segment's labels
    weights = np.rint(np.clip(found["weights"], 0, 1) * MAP_LEVELS).astype(np.uint8)  # [row, k]
    packed = [base64.b64encode(np.ascontiguousarray(index.astype(dtype)).tobytes()).decode("ascii"),
              base64.b64encode(np.ascontiguousarray(weights).tobytes()).decode("ascii")]
    if sum(map(len, packed)) > HEAD_PAGE_BUDGET:
        notes.append(f"the top keys in {io.HEAD_EXAMPLES_FILE} would make the page too large: head pages not shown")
        return None
    segments = []
    for k in range(len(offsets) - 1):
        segments.append({
            "line": int(found["segment_line"][k]), "start": int(found["segment_start"][k]),
            "stop": int(found["segment_stop"][k]), "total": int(found["segment_tokens"][k]),
            "text": visible(short_sentence(str(found["segment_text"][k])), keep=LAYOUT),
            "category": visible(str(found["segment_category"][k])) or None,
            "pos": positions[offsets[k]:offsets[k + 1]].tolist(),
            "labels": [visible(str(t), keep=LAYOUT) for t in found["labels"][offsets[k]:offsets[k + 1]]],
        })
    picks: dict[str, dict[str, list[list[Any]]]] = {}
    entry_head = layer * n_heads + head  # [entry]
    names = [str(name) for name in found["scores"]]
    for score, entry, value, decile, extreme in zip(found["pick_score"], found["pick_entry"], found["pick_value"],
                                                    found["pick_decile"], found["pick_extreme"]):
        at = picks.setdefault(str(int(entry_head[entry])), {}).setdefault(names[score], [])
        at.append([int(entry), float(f"{value:.5g}"), int(decile), int(extreme)])
    return {"scores": names, "k": int(found["top_keys"]), "wide": dtype is np.uint16, "none": none,
            "segments": segments, "entrySegment": found["entry_segment"].tolist(),
            "rowOffsets": found["row_offsets"].tolist(), "keys": packed[0], "weights": packed[1], "picks": picks}


def _initial_head(heads: pd.DataFrame) -> list[int]:
    """The head selected when the page opens: the clearest previous-token head, else the sharpest head."""
    if "previous_token" in heads.columns and heads["previous_token"].notna().any():
        row = heads.loc[heads["previous_token"].idxmax()]
    else:
        row = heads.loc[heads["entropy"].idxmin()]
    return [int(row["layer"]), int(row["head"])]
