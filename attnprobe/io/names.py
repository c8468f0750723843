"""The names of the files in a results folder, and which names are attnprobe's (pure: touches no file)."""

from __future__ import annotations

import re

HEADS_FILE = "heads.csv"
LAYERS_FILE = "layers.csv"
RUN_FILE = "run.json"
EXAMPLE_FILE = "example_attention.npz"
EXAMPLES_FILE = "examples.npz"  # up to MAX_EXAMPLES example sentences' maps, for report.html (examples_writer)
MAX_EXAMPLES = 8
HEAD_EXAMPLES_FILE = "head_examples.npz"  # analyze: each head's top, bottom and decile examples with their top keys
REPORT_FILE = "report.html"  # report: the run as one self-contained page
TYPES_FILE = "head_types.csv"
# Head types renamed after results folders were written with them: old label -> today's. Until 2026-11-29 classify
# --scheme kv called its non-streaming heads `retrieval`; the word now names only `attnprobe retrieval`'s score.
RENAMED_TYPES = {"retrieval": "full-cache"}
CATEGORIES_FILE = "categories.csv"
PROBE_FILE = "probe.csv"
PROBE_RUN_FILE = "probe.json"
PROBE_FIGURE = "probe_heatmap.png"
PROBE_FOLDER = "probe"  # probe's default --out is outputs/probe, beside analyze's outputs/
POSITIONS_FILE = "positions.csv"
TOP_TOKENS_FILE = "top_tokens.csv"  # analyze: per head, the key tokens with the highest lift
CHECKPOINT_FILE = "checkpoint.npz"  # a long run's progress; removed once it completes
SENTENCES_FILE = "sentences.parquet"  # analyze --per-sentence
KV_CACHE_FILE = "kv_cache.json"
RESAMPLES_FILE = "resamples.npz"  # per score, the bootstrap's resampled head means [resample, layer, head]
IMPORTANCE_FILE = "importance.csv"  # ablate: per head, what ablating it changes, and its gradient importance
LAYER_IMPORTANCE_FILE = "layer_importance.csv"  # ablate --layers: per layer, every head ablated at once
PRUNING_FILE = "pruning.csv"  # ablate: heads removed cumulatively, per order and percent
ABLATE_RUN_FILE = "ablate.json"  # ablate: provenance, settings, Spearman correlation
IMPORTANCE_FIGURE = "importance.png"
IMPORTANCE_TYPE_FIGURE = "importance_vs_type.png"
COMPARE_HEADS_FILE = "compare_heads.csv"  # compare: B - A per head (same shape only)
COMPARE_LAYERS_FILE = "compare_layers.csv"  # compare: per layer, or per point of relative depth
COMPARE_TYPES_FILE = "compare_types.csv"  # compare: head-type counts and fractions of both runs
COMPARE_RUN_FILE = "compare.json"  # compare: both runs' provenance, pairing and why, the top changes
COMPARE_FIGURE = "compare.png"
ROLLOUT_FILE = "rollout.npz"  # rollout: per example sentence, tokens, rollout and head-averaged maps
ROLLOUT_FIGURE = "rollout.png"
SIMILARITY_FILE = "head_similarity.npz"  # related: JS divergence of every pair of heads on a sample of sentences
SIMILARITY_FIGURE = "head_similarity.png"  # plot: that matrix, reordered by hierarchical clustering
HEAD_MAP_FIGURE = "head_map.png"  # plot: the heads in 2-D by classical multidimensional scaling
COMPARE_FOLDER = "compare"  # where `compare A OUT` writes by default
RETRIEVAL_FILE = "retrieval_heads.csv"  # retrieval: per query head, the mean retrieval score and its interval
RETRIEVAL_SCORES_FILE = "head_score.json"  # retrieval: Wu et al.'s {"L-H": [score per trial]}
RETRIEVAL_RUN_FILE = "retrieval.json"  # retrieval: provenance, settings, every trial and whether it copied
STREAMING_FILE = "streaming.csv"  # ablate --method streaming: the chosen heads and the curve over shares streaming
STREAMING_RUN_FILE = "streaming.json"  # ablate --method streaming: provenance, settings, the chosen heads' result
STREAMING_FIGURE = "streaming.png"
TRAINED_GATES_FILE = "gates.csv"  # train-pattern: layer, kv_head, gate, trained (what `attnprobe export` reads)
TRAINED_LOG_FILE = "training.csv"  # train-pattern: per step, the loss and the gates
TRAINED_FIGURE = "training.png"
TRAINED_RUN_FILE = "train_pattern.json"  # train-pattern: its record (settings, model, versions, the files' sha256)
TRAINED_CHECKPOINT_FILE = "train_checkpoint.npz"  # train-pattern's (never analyze's checkpoint.npz)
PATCHING_FILE = "patching.csv"  # patch: per head (and position), the patching effect, its interval, the metric
PATCH_RUN_FILE = "patch.json"  # patch: the pairs' sha256, metric, direction, LD clean and corrupt, settings, model
PATCHING_FIGURE = "patching.png"
PATCH_FILES = (PATCHING_FILE, PATCH_RUN_FILE, PATCHING_FIGURE)
CIRCUIT_EDGES_FILE = "edges.csv"  # circuit: every edge (sender, receiver, input), its score, whether in the circuit
CIRCUIT_RUN_FILE = "circuit.json"  # circuit: the circuit, settings, faithfulness curve, CPR/CMD, random baseline
CIRCUIT_IMPORTANCES_FILE = "importances.json"  # circuit: MIB's submission layout (EAP-IG's Graph.to_json)
CIRCUIT_FIGURE = "circuit.png"  # circuit: the circuit's nodes by layer, edges by score
FAITHFULNESS_FIGURE = "faithfulness.png"  # circuit: faithfulness over circuit size beside random circuits
CIRCUIT_FILES = (CIRCUIT_EDGES_FILE, CIRCUIT_RUN_FILE, CIRCUIT_IMPORTANCES_FILE, CIRCUIT_FIGURE, FAITHFULNESS_FIGURE)
COMPOSITION_FILE = "composition.csv"  # compose: Q-, K- and V-composition of every pair of heads in different layers
COMPOSITION_RUN_FILE = "composition.json"  # compose: provenance, folding, the random baseline, the strongest edges
COMPOSITION_FIGURE = "composition.png"  # compose: the strongest edges, one panel per mode
COMPOSITION_FILES = (COMPOSITION_FILE, COMPOSITION_RUN_FILE, COMPOSITION_FIGURE)
TRAINED_FILES = (TRAINED_GATES_FILE, TRAINED_LOG_FILE, TRAINED_FIGURE, TRAINED_RUN_FILE, TRAINED_CHECKPOINT_FILE)
# `plot`'s figures, in any of FIGURE_FORMATS (importance.png is ablate's, drawn from importance.csv alone)
PLOT_FIGURES = ("entropy_heatmap", "layer_gradient", "head_patterns", "head_patterns_selected", "position_profile",
                "importance_vs_type", "head_similarity", "head_map")
# `plot`'s figures of ablate's pruning.csv and layer_importance.csv (an ablate run that remakes those removes them)
ABLATE_PLOT_FIGURES = ("pruning", "layer_importance")
FIGURE_FORMATS = ("png", "svg", "pdf")


# analyze's result files: run.json's `files` records the sha256 of each it wrote, and the readers check it
RUN_FILES = (HEADS_FILE, LAYERS_FILE, EXAMPLE_FILE, EXAMPLES_FILE, RESAMPLES_FILE, POSITIONS_FILE, CATEGORIES_FILE,
             TOP_TOKENS_FILE, SENTENCES_FILE, HEAD_EXAMPLES_FILE)
RUN_FILES_KEY = "files"


# what the commands that run a model themselves write, and the file that names their model
_PROBE_FILES = (PROBE_FILE, PROBE_RUN_FILE, PROBE_FIGURE)
MODEL_OUTPUTS = (
    ("ablate", ABLATE_RUN_FILE, (IMPORTANCE_FILE, LAYER_IMPORTANCE_FILE, PRUNING_FILE, ABLATE_RUN_FILE,
                                 IMPORTANCE_FIGURE)),
    ("probe", PROBE_RUN_FILE, _PROBE_FILES),
    ("probe", f"{PROBE_FOLDER}/{PROBE_RUN_FILE}", tuple(f"{PROBE_FOLDER}/{name}" for name in _PROBE_FILES)),
    ("rollout", ROLLOUT_FILE, (ROLLOUT_FILE, ROLLOUT_FIGURE)),
    ("related", SIMILARITY_FILE, (SIMILARITY_FILE,)),
    ("retrieval", RETRIEVAL_RUN_FILE, (RETRIEVAL_FILE, RETRIEVAL_SCORES_FILE, RETRIEVAL_RUN_FILE)),
    ("ablate --method streaming", STREAMING_RUN_FILE, (STREAMING_FILE, STREAMING_RUN_FILE, STREAMING_FIGURE)),
    ("patch", PATCH_RUN_FILE, PATCH_FILES),
    ("compose", COMPOSITION_RUN_FILE, COMPOSITION_FILES),
    ("circuit", CIRCUIT_RUN_FILE, CIRCUIT_FILES),
)


def checkpoint_name(rank: int = 0, size: int = 1, replacing: bool = False) -> str:
    """A process's checkpoint: checkpoint.npz, or under torchrun one per rank (checkpoint-rank1-of-2.npz).

    `replacing`: the name of a run started with --overwrite (checkpoint-overwrite.npz, ...-of-2-overwrite.npz):
    the stopped run's checkpoint it replaces stays in place until this run completes, so a kill before then
    loses neither."""
    name = "checkpoint" if size == 1 else f"checkpoint-rank{rank}-of-{size}"
    return f"{name}{REPLACING_SUFFIX if replacing else ''}.npz"


REPLACING_SUFFIX = "-overwrite"
_CHECKPOINT_NAME = re.compile(r"checkpoint(-rank\d+-of-\d+)?(-overwrite)?\.npz")  # checkpoint_name's only


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is one that checkpoint_name makes (of any rank, replacing or not)."""
    return bool(_CHECKPOINT_NAME.fullmatch(name))


def is_result_name(name: str) -> bool:
    """Whether attnprobe writes or removes a file of this name (relative to a results folder) in some command."""
    fixed = {HEADS_FILE, LAYERS_FILE, RUN_FILE, EXAMPLE_FILE, EXAMPLES_FILE, REPORT_FILE, TYPES_FILE, CATEGORIES_FILE,
             PROBE_FILE, PROBE_RUN_FILE, PROBE_FIGURE, POSITIONS_FILE, SENTENCES_FILE, KV_CACHE_FILE, RESAMPLES_FILE,
             IMPORTANCE_FILE, LAYER_IMPORTANCE_FILE, PRUNING_FILE, ABLATE_RUN_FILE, IMPORTANCE_FIGURE,
             IMPORTANCE_TYPE_FIGURE, ROLLOUT_FILE, ROLLOUT_FIGURE, TOP_TOKENS_FILE, RETRIEVAL_FILE,
             RETRIEVAL_SCORES_FILE, RETRIEVAL_RUN_FILE, STREAMING_FILE, STREAMING_RUN_FILE, STREAMING_FIGURE,
             HEAD_EXAMPLES_FILE, *TRAINED_FILES, *PATCH_FILES, *COMPOSITION_FILES, *CIRCUIT_FILES}
    fixed |= {f"{stem}.{suffix}" for stem in (*PLOT_FIGURES, *ABLATE_PLOT_FIGURES) for suffix in FIGURE_FORMATS}
    fixed |= {f"{PROBE_FOLDER}/{name}" for name in _PROBE_FILES}
    fixed |= {f"{COMPARE_FOLDER}/{name}" for name in (COMPARE_HEADS_FILE, COMPARE_LAYERS_FILE, COMPARE_TYPES_FILE,
                                                       COMPARE_RUN_FILE, COMPARE_FIGURE)}
    return name in fixed or is_checkpoint_name(name)
