"""`make figures` (figures/): the marked regions of the docs, the formatting of every figure, and the rule that no
measured number is typed by hand.

Every measured number of README.md and docs/ lives in a region `<!-- figure:NAME -->` ... `<!-- /figure -->`,
written by figure NAME of figures/ from figures/measured.json. These tests check that the markers are well formed
and name known figures, that the committed pages are exactly what measured.json renders to (so a hand edit inside a
region fails), that rendering is deterministic and idempotent, and that no decimal number, percentage or quantity
with a unit stands outside a region or a code span unless ALLOWED says why it is not a measurement. No model runs
here: the figures' renderers read only measured.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from figures import build, fmt, regions  # noqa: E402
from figures.registry import FIGURES  # noqa: E402
from figures.runs import RUNS  # noqa: E402

# A number outside the figures must be a definition, not a measurement. (page, phrase that holds it, why); "*" is
# every page. A phrase that no longer occurs fails test_every_allowed_phrase_is_still_used, so the list stays short.
ALLOWED: list[tuple[str, str, str]] = [
    ("*", "95%", "the confidence level of every interval (a setting)"),
    ("docs/guides/circuits.md", "0.1 by default", "--missed-p's default (a setting)"),
    ("docs/guides/circuits.md", "<= 5%", "the binomial rank's level: 95% confidence (a definition)"),
    ("*", "Python 3.10", "a version"),
    ("*", "1e-5", "float32's tolerance, a definition (tests/conftest.py FLOAT32_TOLERANCE)"),
    ("*", "1e-6", "a test's tolerance"),
    ("*", "1e-7", "a tolerance or float32's relative rounding"),
    ("docs/development.md", "torch 2.13.0's CPU build", "a version"),
    ("docs/development.md", "(2.15.0 when this was written)", "a version"),
    ("docs/development.md", "`pyproject.toml`: 2.11.0 and 5.17)", "versions"),
    ("docs/development.md", "- torch 2.13 (CPU) with", "a version"),
    ("docs/development.md", "torch 2.11 with transformers 5.17", "versions"),
    ("docs/development.md", "no CPU build of 2.11 or 2.15", "versions"),
    ("docs/development.md", "torch 2.12 and 2.14 lie between", "versions"),
    ("docs/development.md", "(2.11 so far", "a version"),
    ("docs/development.md", "transformers 5.17 and torch 2.11, the lowest", "versions"),
    ("docs/changelog.md", "still says 0.1.0", "the package's version"),
    ("docs/development.md", "`.ci/run` has 90 minutes; keep it under 60", "CI's limit and its target"),
    ("docs/development.md", "(3.2, 3.6 and 3.9 compile them)", "triton versions"),
    ("docs/performance.md", "for sm_90 with triton 3.6 and 3.9", "triton versions"),
    ("docs/guides/analyze.md", "a 0.1 s sample", "a setting (threads.SAMPLE_SECONDS)"),
    ("docs/performance.md", "(a 0.1 s sample", "a setting (threads.SAMPLE_SECONDS)"),
    ("docs/guides/related.md", "Up to 30 x 9 heads", "SmolLM2's shape"),
    ("docs/guides/compose.md", "TransformerLens 4.3", "a version"),
    ("docs/guides/compose.md", "That is 0.036 for GPT-2 small's d_model 768 and about 0.042 for SmolLM2's 576",
     "arithmetic: 1 / sqrt(768) and 1 / sqrt(576)"),
    ("docs/guides/related.md", "A 32 x 32 model (an 8B shape", "an 8B model's shape"),
    ("docs/large-corpora.md", "which is 256 MiB for the two", "arithmetic: 2^24 x 8 bytes x 2 sums"),
    ("docs/large-corpora.md", "A 32 x 32 model (an 8B shape)", "an 8B model's shape"),
    ("docs/guides/verify.md", "p (exp(2 x 12 u A) - 1)", "the bound's formula"),
    ("docs/guides/verify.md", "under transformers 5.24", "a version"),
    ("docs/kv-cache.md", "at least 0.5, as Wu", "a setting (Wu et al.'s threshold)"),
    ("*", "kvpress 0.5.5", "a version"),
    ("docs/kv-cache.md", "(pip picks transformers 5.2.0)", "a version"),
    ("*", "every 10 seconds", "a setting (layer_progress.LOG_EVERY_SECONDS)"),
    ("docs/kv-cache.md", "overlap the `real_needle`'s by more than 90%", "Wu et al.'s setting (find_needle_idx)"),
    ("docs/kv-cache.md", "`real_needle` above 50% | token-level ROUGE-1 recall on token ids of at least 0.5",
     "Wu et al.'s and attnprobe's settings (COPY_MIN_RECALL)"),
    ("docs/kv-cache.md", "smallest gap between distinct scores, 0.5)", "the tie-break (export.break_ties)"),
    ("docs/guides/report.md", '("0, 2, 4", "0.5, 1.0")', "examples of tick labels"),
    ("docs/models.md", "within 3 s, all told", "a setting (the hub check's time limit)"),
    ("docs/models.md", "would otherwise cost 20 s or more", "the resolver's and hub client's own waits"),
    ("docs/models.md", "fails within those 3 s", "a setting (the hub check's time limit)"),
    ("docs/kv-cache.md", "50, 75 and 100% of the KV heads", "the default --shares, a setting"),
    ("docs/guides/ablate.md", "`head_compression_ratio`) | 0.5 |", "the default --sparsity, a setting"),
    ("docs/guides/ablate.md", "| 0,0.25,0.5,0.75,1 |", "the default --shares, a setting"),
    ("docs/guides/analyze.md", "1e-9", "a test's tolerance"),
    ("docs/guides/analyze.md", "50 MB of text", "an example size"),
    ("docs/guides/verify.md", "1e-4", "a tolerance"),
    ("docs/guides/verify.md", "by about 5e-6", "arithmetic: 1e-7 relative of a logit near 50"),
    ("docs/guides/verify.md", "a scale off by 1.5", "a test's deliberate error"),
    ("docs/guides/verify.md", "1% off", "a test's deliberate error"),
    ("docs/classification.md", "default **0.8**", "a threshold's default"),
    ("docs/classification.md", "0.8 therefore", "the threshold's default"),
    ("docs/classification.md", "about 0.2 on a 15-token sentence", "arithmetic: 3 / 15"),
    ("docs/classification.md", "ln 2 = 0.693", "a threshold's default"),
    ("docs/classification.md", "default **0.7**", "a threshold's default"),
    ("docs/classification.md", "At 0.7", "the threshold's default"),
    ("docs/classification.md", "default **0.5**", "a threshold's default"),
    ("docs/classification.md", "is above 0.5", "the threshold's default"),
    ("docs/classification.md", "**0.5**), meaning", "a threshold's default"),
    ("docs/guides/classify.md", "default **0.95**", "a threshold's default"),
    ("docs/guides/related.md", "ln 2 = 0.693", "a closed form: JS of disjoint rows"),
    ("docs/guides/related.md", "at most 64 x 64", "the --max-tokens default"),
    ("docs/guides/classify.md", "default 0.5, of its layer's", "a threshold's default (--dormant-max-output-ratio)"),
    ("docs/guides/classify.md", "with 5% of its mass", "an example"),
    ("docs/guides/rollout.md", "A' = 0.5 A + 0.5 I", "the definition of rollout"),
    ("docs/guides/rollout.md", "default 0.5", "an option's default"),
    ("docs/guides/rollout.md", "at weight 0.5.** The 0.5 is", "the option's default"),
    ("docs/guides/ablate.md", "a gate of 1.0", "a definition"),
    ("docs/guides/ablate.md", "100% of the heads", "the pruning curve's percentages, a definition"),
    ("docs/guides/ablate.md", 'read "0.00"', "an example of a label"),
    ("docs/guides/ablate.md", "49,152 x 576", "SmolLM2's LM head shape"),
    ("docs/guides/compare.md", "2.5 and 97.5 percentiles", "the 95% interval's definition"),
    ("docs/guides/compare.md", "(30 x 9 against 6 x 12)", "the two models' shapes"),
    ("docs/models.md", "6 x 12 to 30 x 9", "the two models' shapes"),
    ("docs/performance.md", "(12 x 12, 768 wide", "GPT-2 small's shape"),
    ("docs/performance.md", "within 1.5x", "issue 29's time target for the fused path on a GPU, a definition"),
    ("docs/performance.md", "within +10%", "issue 29's memory target for the fused path on a GPU, a definition"),
    ("docs/output-files.md", "2.5/97.5 percentiles", "the 95% interval's definition"),
    ("docs/guides/plot.md", "matplotlib 3.10", "a version"),
    ("docs/long-documents.md", "transformers 5.25", "a version"),
    ("docs/long-documents.md", "GPT-J did too up to 5.23, Falcon up to 5.24", "versions"),
    ("docs/long-documents.md", "`AttentionInterface` from 5.25 on", "a version"),
    ("docs/long-documents.md", "architecture in 5.25", "a version"),
    ("docs/kv-cache.md", "`--min-kept` (default 0.1)", "an option's default"),
    ("docs/kv-cache.md", "`--compression-ratio` (default 0.5)", "an option's default"),
    ("docs/long-documents.md", "56 GiB (32,768^2 x 14 heads x 4 bytes)", "arithmetic, shown"),
    ("docs/long-documents.md", "default 64 MiB", "an option's default"),
    ("docs/long-documents.md", "x 13 scores x 4 bytes = 15 MB", "arithmetic on SmolLM2's shape, shown"),
    ("docs/metrics.md", "x 13 scores x 4 bytes = 15 MB", "arithmetic on SmolLM2's shape, shown"),
    ("docs/metrics.md", "49,152 x 30 x 9 x 8 bytes = 106 MB (about 118 MB in all",
     "arithmetic: float64 sums of SmolLM2's vocabulary x layers x heads, plus vocabulary x layers (U)"),
    ("docs/metrics.md", "2 MiB huge pages", "the size of a transparent huge page on x86, a constant"),
    ("docs/metrics.md", "float32's range (1e-38)", "float32's smallest normal number, a constant"),
    ("docs/metrics.md", "smallest normal number (1.2e-38;", "float32's smallest normal number, a constant"),
    ("docs/metrics.md", "by less than 1e-35 nats", "arithmetic: -w ln w < 88 w for a weight w below 1.2e-38"),
    ("docs/large-corpora.md", "up to 1 GiB", "a threshold of the code"),
    ("*", "within 3 s", "the hub's connection timeout, a constant of the code"),
    ("docs/errors.md", "(604,800 s)", "a limit of the code: a week"),
    ("docs/results.md", "about 1.42 nats", "quoted from the reference study, not measured here"),
    ("docs/results.md", "about 0.50 nats", "quoted from the reference study, not measured here"),
    ("docs/results.md", "**2.2** and **4.11**", "head names from the literature (layer.head)"),
    ("docs/results.md", "**0.1**, **0.10** and **3.0**", "head names from the literature (layer.head)"),
    ("docs/results.md", "**5.5**, **5.8**, **5.9** and **6.9**", "head names from the literature (layer.head)"),
]

# A decimal number, a number in scientific notation, a percentage, or a quantity with a unit of time, memory or
# ratio: what a measurement looks like. Whole numbers alone (counts, shapes, defaults) are not flagged.
NUMBER = re.compile(r"(?<![\w.^/-])(?:\d[\d,]*(?:\.\d+)?\s?(?:%|s\b|ms\b|us\b|MB\b|GB\b|MiB\b|GiB\b|KB\b|x\b|"
                    r"times\b|minutes?\b|min\b|seconds\b)|\d[\d,]*\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
GENERATED = {"docs/commands.md"}  # the CLI's --help (python -m attnprobe.cli_reference): defaults, not measurements


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def hand_written_numbers(page: Path) -> list[tuple[int, str, str]]:
    """(line, number, line's text) of every number outside the figures, code blocks, code spans and ALLOWED."""
    text = page.read_text(encoding="utf-8")
    name = relative(page)
    allowed_spans: list[tuple[int, int]] = []
    outside = regions.outside(text)
    for where, phrase, _ in ALLOWED:
        if where in ("*", name):
            allowed_spans += [(m.start(), m.end()) for m in re.finditer(re.escape(phrase), outside)]
    found, offset = [], 0
    for number, line in enumerate(outside.split("\n"), 1):
        clean = LINK_TARGET.sub(lambda m: " " * len(m.group()), INLINE_CODE.sub(lambda m: " " * len(m.group()), line))
        for match in NUMBER.finditer(clean):
            start, end = offset + match.start(), offset + match.end()
            if not any(a <= start and end <= b for a, b in allowed_spans):
                found.append((number, match.group(), line.strip()))
        offset += len(line) + 1
    return found


# ---- the pages ------------------------------------------------------------------------------------------------


def test_every_marker_pair_is_well_formed_and_names_a_known_figure():
    used = set()
    for page in build.pages():
        for region in regions.find(page.read_text(encoding="utf-8")):  # raises on a broken pair
            assert region.name in FIGURES, f"{relative(page)}: unknown figure {region.name!r}"
            used.add(region.name)
    assert set(FIGURES) <= used, f"figures with no region in the docs: {sorted(set(FIGURES) - used)}"


def test_the_docs_are_what_measured_json_renders_to():
    """A hand edit inside a region, or a renderer changed without `python -m figures --render`, fails here."""
    measured = build.load_measured()
    assert set(measured) <= set(FIGURES), sorted(set(measured) - set(FIGURES))
    changed = build.rewrite_pages(measured, check=True)
    assert not changed, f"run `python -m figures --render`: {[relative(p) for p in changed]} differ"


def test_every_figure_has_data_and_says_which_command_made_it():
    measured = build.load_measured()
    assert set(measured) == set(FIGURES), f"never collected: {sorted(set(FIGURES) - set(measured))}"
    for name, entry in measured.items():
        body = build.render(name, entry["data"])
        assert body == build.render(name, entry["data"]), name  # deterministic
        assert re.search(r"`(attnprobe|make |\.venv/bin/python|python -m)|benchmarks/", body), name
        assert entry["runs"] == list(FIGURES[name].runs), name
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\d", d) for d in entry["dates"]), name


def test_every_image_a_figure_copies_is_in_docs_images_and_used():
    texts = "\n".join(p.read_text(encoding="utf-8") for p in build.pages())
    for figure in FIGURES.values():
        for source, target in figure.images.items():
            assert source.split("/", 1)[0] in figure.runs, (figure.name, source)
            assert (ROOT / "docs" / "images" / target).is_file(), target
            assert f"images/{target}" in texts, f"{target} is copied by {figure.name} but no page shows it"


def test_every_image_in_docs_images_is_made_by_a_figure():
    made = {target for figure in FIGURES.values() for target in figure.images.values()}
    present = {p.name for p in (ROOT / "docs" / "images").iterdir()}
    assert present <= made, f"images no figure regenerates: {sorted(present - made)}"


@pytest.mark.parametrize("page", [p for p in build.pages() if relative(p) not in GENERATED], ids=relative)
def test_no_measured_number_is_typed_by_hand(page):
    found = hand_written_numbers(page)
    assert not found, (
        f"{relative(page)} has numbers outside the figures: put each in a figure (figures/, `make figures`), or, "
        "if it is a definition and not a measurement, add it to ALLOWED in tests/test_figures.py with the reason:\n"
        + "\n".join(f"  line {n}: {number!r} in: {line}" for n, number, line in found))


def test_every_allowed_phrase_is_still_used():
    pages = {relative(p): regions.outside(p.read_text(encoding="utf-8")) for p in build.pages()}
    for where, phrase, _ in ALLOWED:
        texts = pages.values() if where == "*" else [pages[where]]
        assert any(phrase in t for t in texts), f"ALLOWED entry no longer needed: {where} {phrase!r}"


def test_the_scan_flags_a_typed_measurement(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("It took 12.5 s and 1.2 GB, 30% faster, 2x, 1.5e-6 apart; 95% intervals; `--dpi 1.5`;\n"
                    "```\nrun 3.5 s\n```\n<!-- figure:headline -->\n0.861\n<!-- /figure -->\n", encoding="utf-8")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = [number for _, number, _ in hand_written_numbers(page)]
    finally:
        ROOT = saved
    assert found == ["12.5 s", "1.2 GB", "30%", "2x", "1.5e-6"]


# ---- regions ---------------------------------------------------------------------------------------------------

PAGE = """# A page

Some text with 1.5 s.

<!-- figure:alpha -->
old alpha
<!-- /figure -->

```
<!-- figure:not-a-region -->
```

<!-- figure:beta -->
old beta
<!-- /figure -->
"""


def test_regions_are_found_in_order_outside_code_blocks():
    found = regions.find(PAGE)
    assert [r.name for r in found] == ["alpha", "beta"]
    assert found[0].body == "old alpha"


def test_rewriting_replaces_only_the_named_bodies_and_twice_is_a_no_op():
    once = regions.rewrite(PAGE, {"alpha": "new alpha\n\nsecond paragraph"})
    assert "new alpha\n\nsecond paragraph" in once and "old beta" in once and "old alpha" not in once
    assert once.startswith("# A page\n\nSome text with 1.5 s.\n\n<!-- figure:alpha -->\n\nnew alpha")
    assert once.endswith("<!-- figure:beta -->\nold beta\n<!-- /figure -->\n")
    assert regions.rewrite(once, {"alpha": "new alpha\n\nsecond paragraph"}) == once
    assert regions.rewrite(PAGE, {}) == PAGE


def test_the_committed_pages_rewrite_to_themselves():
    measured = build.load_measured()
    bodies = {name: build.render(name, entry["data"]) for name, entry in measured.items()}
    for page in build.pages():
        text = page.read_text(encoding="utf-8")
        once = regions.rewrite(text, bodies)
        assert regions.rewrite(once, bodies) == once, relative(page)


@pytest.mark.parametrize("text", [
    "<!-- figure:a -->\nx\n",  # never closed
    "x\n<!-- /figure -->\n",  # closes nothing
    "<!-- figure:a -->\n<!-- figure:b -->\n<!-- /figure -->\n<!-- /figure -->\n",  # nested
    "  <!-- figure:a -->\nx\n<!-- /figure -->\n",  # indented
    "<!-- figure:a --> and text\nx\n<!-- /figure -->\n",  # not a line of its own
    "<!-- figure:A_b -->\nx\n<!-- /figure -->\n",  # not a figure name
])
def test_broken_markers_are_refused(text):
    with pytest.raises(regions.RegionError):
        regions.find(text)


def test_outside_blanks_regions_and_code_but_keeps_line_numbers():
    blanked = regions.outside(PAGE)
    assert "old alpha" not in blanked and "not-a-region" not in blanked and "1.5 s" in blanked
    assert blanked.count("\n") == PAGE.count("\n")


# ---- formatting --------------------------------------------------------------------------------------------------


def test_numbers_are_formatted_one_way():
    assert fmt.num(0.86133) == "0.861" and fmt.num(1.0, 2) == "1.00"
    assert fmt.signed(0.2474) == "+0.247" and fmt.signed(-0.0804) == "-0.080"
    assert fmt.ci(0.81249, 0.91664) == "[0.812, 0.917]"
    assert fmt.ci(0.2204, 0.2768, sign=True) == "[+0.220, +0.277]"
    assert fmt.vci(0.86133, 0.81249, 0.91664) == "0.861 [0.812, 0.917]"
    assert fmt.whole(1452) == "1,452" and fmt.whole(32767.6) == "32,768"
    assert fmt.sci(2.98e-07) == "3.0e-07" and fmt.sci(0.0) == "0" and fmt.sci(None) == "-"
    assert fmt.sig(36.2) == "36" and fmt.sig(5.77) == "5.8" and fmt.sig(0.0123) == "0.012"
    assert [fmt.seconds(x) for x in (0.1009, 8.19, 75.79, 1021.4)] == ["0.10 s", "8.2 s", "76 s", "1,021 s"]
    assert fmt.percent(76, 91) == "84%"
    assert fmt.span([0.30, 0.37, 0.33]) == "0.30-0.37" and fmt.span([0.5]) == "0.50"
    assert fmt.layers([17, 18, 17]) == "17-18" and fmt.layers([0, 1, 2, 5]) == "0-2 and 5"
    assert fmt.listing(["a"]) == "a" and fmt.listing(["a", "b", "c"]) == "a, b and c"
    assert fmt.head(17.0, 4) == "L17H4"


def test_tables_and_wrapping():
    assert fmt.table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    long_bullet = "- " + " ".join(["word"] * 40)
    wrapped = fmt.wrap(long_bullet, 40).split("\n")
    assert all(len(line) <= 40 for line in wrapped)
    assert wrapped[0].startswith("- word") and all(line.startswith("  word") for line in wrapped[1:])
    table = "| " + " | ".join(["cell"] * 40) + " |"
    code = "```\n" + "x " * 80 + "\n```"
    assert fmt.wrap(table, 40) == table and fmt.wrap(code, 40) == code
    indented = "    " + " ".join(["w"] * 60)
    assert all(line.startswith("    w") for line in fmt.wrap(indented, 30).split("\n"))


def test_a_figure_renders_small_fixed_inputs():
    """The headline table from two made-up models: formatting of given inputs, nothing else."""
    model = {"model": "m", "layers": 2, "heads": 3, "sentences": 4, "tokens": 1234, "early_layers": [0, 0],
             "late_layers": [1, 1], "early": [1.0, 0.9, 1.1], "late": [0.5, 0.4, 0.6], "difference": [0.5, 0.3, 0.7],
             "types": {"copy": 4, "mixed": 2}}
    body = build.render("headline", {"models": [model, {**model, "model": "n", "tokens": 5}]})
    assert "| m | 2 x 3 | 1,234 | 0: 1.000 [0.900, 1.100] | 1: 0.500 [0.400, 0.600] | +0.500 [+0.300, +0.700] | " \
           "0 / 4 / 0 / 2 |" in body
    assert "| n | 2 x 3 | 5 |" in body and "`make demo`" in body
    data = json.loads(json.dumps({"log": ["Converted x in 21 s: 542 MB in /root/.cache/attnprobe/gguf/x"],
                                  "seconds": 21, "megabytes": 542, "process_seconds": 25.1, "peak_rss_mib": 1521,
                                  "load": 3.14, "date": "2026-11-23"}))
    body = build.render("conversion", data)
    assert "542 MB (517 MiB)" in body and "took 21 s here" in body and "\n```\nConverted x in 21 s" in body


def test_the_figures_own_rules_on_small_inputs():
    from figures import ablation, benchmarks, results

    assert ablation.lowest_kl_sentence(["sink", "sink", "mixed", "sink", "broad", "sink"]) == \
        "The 4 heads with the smallest KL are 3 sinks and one mixed head."
    assert ablation.lowest_kl_sentence(["sink", "sink"]) == "The heads with the smallest KL are all sinks."
    top = {"induction": [{"head": "L5H1", "layer": 5, "above": True}, {"head": "L6H0", "layer": 6, "above": True}],
           "duplicate": [{"head": "L2H0", "layer": 2}], "previous": [{"head": "L3H3", "layer": 3}]}
    assert results.circuit({"top": top}) == ("The top induction heads sit in layers 5-6, after the duplicate-token "
                                             "head L2H0 and the previous-token head L3H3, which is the circuit "
                                             "Olsson et al. describe.")
    top["previous"] = [{"head": "L9H3", "layer": 9}]
    assert "circuit" not in results.circuit({"top": top})
    assert benchmarks.first_token_split({"last_first_token": [0.0, 0.3, 0.01, 0.2, 0.5]}) == 3
    machine = {"cores": 2, "cpu": "C", "torch": "2.13.0+cpu"}
    assert fmt.machine(machine, 1.04) == "2 cores (C), torch 2.13.0+cpu, load average 1.0"
    assert fmt.machine(machine, 4.8).endswith("load average 4.8 (busy: other jobs shared the cores)")
    busy = {"machine": machine, "load": 3.0}
    assert benchmarks.seconds_of({"seconds": 9.0, "cpu_seconds": 5.0}, benchmarks.is_busy(busy)) == 5.0
    assert benchmarks.seconds_of({"seconds": 9.0, "cpu_seconds": 5.0}, False) == 9.0


def test_the_moves_figures_own_rules_on_small_inputs():
    from figures import moves

    assert moves.ceil_sig(0.0013) == pytest.approx(0.002) and moves.ceil_sig(0.002) == pytest.approx(0.002)
    assert moves.ceil_sig(0.0000) == 0.0 and moves.ceil_sig(0.031) == pytest.approx(0.04)
    loud = {"loudest": [{"head": "L24H8", "layer": 24, "type": "sink", "ratio": 5.71},
                        {"head": "L24H6", "layer": 24, "type": "dormant", "ratio": 5.38},
                        {"head": "L3H1", "layer": 3, "type": "mixed", "ratio": 3.4}]}
    assert moves.loud_sentence(loud) == ("SmolLM2's loudest heads are L24H6 and L24H8 (sinks of layer 24), writing "
                                         "5.4 to 5.7 times their layer's median; the next, L3H1 (mixed), 3.4")
    loud["loudest"][1].update(layer=5, head="L5H6", type="broad")
    assert moves.loud_sentence(loud) == ("SmolLM2's loudest heads are L5H6 and L24H8, writing 5.4 to 5.7 times their "
                                         "layer's median; the next, L3H1 (mixed), 3.4")
    quiet = {"loudest": [{"head": "L1H1", "layer": 1, "type": "mixed", "ratio": 1.5}]}
    assert moves.loud_sentence(quiet) == ("SmolLM2's loudest head is L1H1 (of layer 1), writing 1.5 times its "
                                          "layer's median")
    assert moves.below_default({"others_below_default": []}) == "no other head"
    assert moves.below_default({"others_below_default": [{"head": "L2H2", "type": "mixed", "ratio": 0.4833}]}) == \
        "a single other head (a mixed one, at 0.483)"


# ---- the runner's choices ----------------------------------------------------------------------------------------


def test_parts_and_names_select_runs_and_figures(tmp_path):
    runs, figures = build.select(["results"], [])
    assert "demo" in runs and "bench-ablate" not in runs and "headline" in figures and "bench-ablate" not in figures
    runs, figures = build.select([], ["headline"])
    assert runs == ["demo", "demo-minilm"] and figures == ["headline"]
    runs, figures = build.select([], ["sink-groups"])
    assert runs == ["sink-groups"] and set(figures) == {"ablate-sink-groups", "readme-ablate"}
    assert build.with_needs(["demo-extended"], tmp_path) == ["demo", "demo-extended"]  # demo has no output yet
    (tmp_path / "_runs").mkdir()
    (tmp_path / "_runs" / "demo.json").write_text("{}")
    assert build.with_needs(["demo-extended"], tmp_path) == ["demo-extended"]
    with pytest.raises(SystemExit):
        build.select([], ["no-such-figure"])
    with pytest.raises(SystemExit):
        build.select(["fast"], [])


def test_every_figure_reads_known_runs_and_every_run_has_a_part():
    assert all(r.part in ("results", "bench", "slow", "gpu") for r in RUNS.values())
    for figure in FIGURES.values():
        assert figure.runs and set(figure.runs) <= set(RUNS) and figure.render is not None, figure.name
    assert all(need in RUNS and list(RUNS).index(need) < list(RUNS).index(r.name)
               for r in RUNS.values() for need in r.needs)


def test_a_refresh_keeps_the_figures_another_run_saved_meanwhile(tmp_path):
    """Two `python -m figures` side by side each read measured.json at their start: the one that saves last must not
    write back the other's figures as they were before it."""
    path = tmp_path / "measured.json"
    build.save_measured({"a": {"data": 1}, "b": {"data": 1}}, path)
    build.save_measured({**build.load_measured(path), "a": {"data": 2}}, path)  # the other run, saved first
    merged = build.merge_measured({"b": {"data": 3}}, path)  # this run refreshed b only
    assert merged == build.load_measured(path) == {"a": {"data": 2}, "b": {"data": 3}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".measured.json.lock", "measured.json"]  # no temp left
