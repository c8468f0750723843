"""Figures from result tables. Each `draw_*` fills the Axes it is given; nothing here writes files.

One module per figure or family of figures, over `style` (what they share: colours, fonts, literal text, layout,
the layers x heads grid, `Undrawable`): `entropy` (entropy_heatmap, layer_gradient), `patterns` (head_patterns),
`positions` (position_profile), `probes`, `comparison`, `ablation` (importance, pruning, layer_importance,
importance_vs_type), `streaming`, `patching`, `rollout`, `related` (head_similarity, head_map), `composition`
and `circuit` (the circuit graph, faithfulness).
The names callers use are here; the others are read from their module.
"""

from attnprobe.plotting.ablation import (
    PRUNING_LABELS,
    importance_heatmap_figure,
    importance_vs_type_figure,
    layer_importance_figure,
    pruning_figure,
)
from attnprobe.plotting.circuit import circuit_figure, draw_circuit, draw_faithfulness, faithfulness_figure
from attnprobe.plotting.comparison import compare_figure
from attnprobe.plotting.composition import composition_figure
from attnprobe.plotting.entropy import entropy_heatmap_figure, layer_gradient_figure
from attnprobe.plotting.patching import patching_figure
from attnprobe.plotting.patterns import (
    MIN_LABEL_PT,
    PANEL_TITLE_PT,
    choose_example,
    draw_pattern,
    example_caption,
    fit_lines,
    head_patterns_figure,
    head_scores,
    pattern_label_size,
    pattern_side,
    representatives,
    text_inches,
)
from attnprobe.plotting.positions import (
    DEPTH_DARK,
    DEPTH_LIGHT,
    POSITION_CMAP,
    draw_position_profile,
    position_profile_figure,
)
from attnprobe.plotting.probes import probe_heatmap_figure
from attnprobe.plotting.related import (
    CLUSTERS,
    MAX_NAMED,
    head_map_figure,
    head_similarity_figure,
    label_rises,
    names_caption,
)
from attnprobe.plotting.rollout import rollout_figure
from attnprobe.plotting.streaming import STREAMING_LABELS, streaming_figure
from attnprobe.plotting.style import (
    CONTINUATION,
    HEADROOM,
    LABEL_MAX_CHARS,
    TYPE_COLORS,
    Undrawable,
    any_script,
    from_zero,
    grid,
    installed_fallback_fonts,
    plain_text,
    token_label,
)

__all__ = [
    "CLUSTERS",
    "CONTINUATION",
    "DEPTH_DARK",
    "DEPTH_LIGHT",
    "HEADROOM",
    "LABEL_MAX_CHARS",
    "MAX_NAMED",
    "MIN_LABEL_PT",
    "PANEL_TITLE_PT",
    "POSITION_CMAP",
    "PRUNING_LABELS",
    "STREAMING_LABELS",
    "TYPE_COLORS",
    "Undrawable",
    "any_script",
    "choose_example",
    "circuit_figure",
    "compare_figure",
    "composition_figure",
    "draw_circuit",
    "draw_faithfulness",
    "draw_pattern",
    "draw_position_profile",
    "entropy_heatmap_figure",
    "example_caption",
    "faithfulness_figure",
    "fit_lines",
    "from_zero",
    "grid",
    "head_map_figure",
    "head_patterns_figure",
    "head_scores",
    "head_similarity_figure",
    "importance_heatmap_figure",
    "importance_vs_type_figure",
    "installed_fallback_fonts",
    "label_rises",
    "layer_gradient_figure",
    "layer_importance_figure",
    "names_caption",
    "pattern_label_size",
    "pattern_side",
    "plain_text",
    "position_profile_figure",
    "probe_heatmap_figure",
    "pruning_figure",
    "representatives",
    "patching_figure",
    "rollout_figure",
    "streaming_figure",
    "text_inches",
    "token_label",
]
