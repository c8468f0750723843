"""`make figures`: rerun the commands the docs quote and rewrite every measured number, table and image in them.

- figures/runs.py: the commands (grouped into runs, each run in its own folder under outputs/figures/);
- figures/steps.py: helpers those runs call between commands (screenshot, verify as JSON, timings);
- figures/registry.py: a figure = the runs it reads, `collect` (outputs -> JSON data), `render` (data -> markdown);
- figures/results.py, ablation.py, patching.py, benchmarks.py, moves.py, gpu.py, training.py, composition.py: the
  figures, by topic;
- figures/fmt.py: how a number is written; figures/regions.py: the `<!-- figure:NAME -->` markers;
- figures/build.py: `python -m figures` (run, collect into figures/measured.json, render into the docs).
"""

from figures import ablation, benchmarks, circuits, composition, gpu, moves, patching, related, results, training  # noqa: F401,E501  (each registers its figures)
