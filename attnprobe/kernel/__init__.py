"""attnprobe's own attention function: the exact eager result, in blocks of query rows, with statistics.

It is registered with transformers' `AttentionInterface` (and a mask function with
`AttentionMaskInterface`) under the name `attnprobe_stats`. Per layer it receives query, key, value
and the padding mask, and for each block of query rows computes the scores against the keys the
block may see, masks them, takes the softmax in float32, folds the block's row statistics into
per-sentence sums, and multiplies the block by the values. No [n, n] map exists anywhere: peak extra
memory is one block, sized from a memory budget.

The function grows by features, never by model names. It implements grouped- and multi-query heads,
the model's own `scaling`, sliding-window (local) attention, causal or bidirectional (a windowed block
computes only the keys inside its window), attention-logit soft-capping (`softcap`) and learned
attention sinks (`s_aux`). The mask is read from the mask function transformers hands over: it is
evaluated on probe positions and must be causal, bidirectional, or either within a window, or it is
refused. Every other argument a model passes is refused by name when it is set, with one line, never
approximated; `discover` runs a two-token pass to learn each layer's features before a run.

The package, one module per concern: `attention` (the registered function, which sends each layer down the Triton,
fused or blocked path, `run_batch`, `statistics_attention`, `discover`), `features` (what a layer's call asks for, and
what is refused), `masks` (the mask function and the masking of a block's scores), `batch` (what a batch's layers
share), `blocked` (the blocked path), `fused` (the fused path; `devices`: each device's fused kernel behind `flash`,
`window`: the recent window's banded sums, `duplicates`: the same-token tiles), `triton_path` (the Triton path:
every statistic inside one Triton attention kernel, `triton_kernels` holding the kernels). The names callers use
are here; a tuning constant (`duplicates.TILE_ROWS`, ...) and a private helper are read from, and patched in, their
module.
"""

from attnprobe.kernel.attention import (
    DEFAULT_BUDGET_MIB,
    FUSED_MIN_TOKENS,
    NAME,
    Discovery,
    discover,
    run_batch,
    statistics_attention,
    stats_attention,
    unsupported,
)
from attnprobe.kernel.batch import Batch, Block, LayerSums
from attnprobe.kernel.blocked import TEMPORARIES, attend, block_size, softmax_with_entropy, weighted_block
from attnprobe.kernel.devices import BIAS_ALIGNMENT, KERNELS, FusedKernel, efficient_kernel, flash, one_head_size
from attnprobe.kernel.features import (
    HARMLESS_KWARGS,
    IMPLEMENTED_KWARGS,
    REFUSED_CONFIG,
    LayerFeatures,
    Unsupported,
    config_reason,
    fusable,
    layer_features,
)
from attnprobe.kernel.fused import ReceivedOnRead, fused_attend
from attnprobe.kernel.masks import (
    MaskPlan,
    apply_mask,
    block_keys,
    mask_block,
    mask_plan,
    probe_mask,
    stats_mask,
    window_reach,
)

__all__ = [
    "BIAS_ALIGNMENT",
    "Batch",
    "Block",
    "DEFAULT_BUDGET_MIB",
    "Discovery",
    "FUSED_MIN_TOKENS",
    "FusedKernel",
    "HARMLESS_KWARGS",
    "IMPLEMENTED_KWARGS",
    "KERNELS",
    "LayerFeatures",
    "LayerSums",
    "MaskPlan",
    "NAME",
    "REFUSED_CONFIG",
    "ReceivedOnRead",
    "TEMPORARIES",
    "Unsupported",
    "apply_mask",
    "attend",
    "block_keys",
    "block_size",
    "config_reason",
    "discover",
    "efficient_kernel",
    "flash",
    "fusable",
    "fused_attend",
    "layer_features",
    "mask_block",
    "mask_plan",
    "one_head_size",
    "probe_mask",
    "run_batch",
    "softmax_with_entropy",
    "statistics_attention",
    "stats_attention",
    "stats_mask",
    "unsupported",
    "weighted_block",
    "window_reach",
]
