"""The bounds of the numeric options: a value outside them is refused in one line before any work.

The upper bounds are far above any useful value; they are there so that a typo (an extra three zeros,
`inf`, `nan`) fails at once instead of filling memory or running for days. README (Errors) lists them.
"""

from __future__ import annotations

import math

from attnprobe.errors import AttnprobeError

MAX_BATCH_SIZE = 4096  # sentences (or sequences) per forward pass
MAX_RESAMPLES = 100_000  # bootstrap resamples: the sums keep [resample, layer, head] in float64
MAX_SEED = 2**32 - 1  # numpy's seeds
MAX_BLOCK_MIB = 1_048_576.0  # 1 TiB for one block of attention rows
MAX_POSITIONS = 10_000_000  # --sink-tokens and --window, in tokens
MAX_CHECKPOINT_SECONDS = 7 * 24 * 3600.0  # a week between checkpoints
MAX_SEQUENCES = 100_000  # probe: random sequences per length
MAX_SENTENCES = 100_000  # verify: sentences checked
MAX_TOP = 10_000  # compare: changed heads printed
MAX_BASELINE_SAMPLES = 100_000  # compose: pairs of random matrices, [sample, 4, d_model, head size] float64
MAX_ENTROPY_NATS = 100.0  # classify --copy-max-entropy (ln of the largest vocabulary is about 13)


def check_whole(option: str, value: int, low: int, high: int, default: object = None) -> None:
    """A whole-number option within [low, high]."""
    if not low <= value <= high:
        hint = f" (default {default})" if default is not None else ""
        raise AttnprobeError(f"{option} {value} is outside {low:,}-{high:,}: use a value in that range{hint}")


def check_real(option: str, value: float, low: float, high: float, default: object = None,
               low_open: bool = False) -> None:
    """A finite number within [low, high] (or (low, high] with `low_open`)."""
    hint = f" (default {default})" if default is not None else ""
    span = f"above {_number(low)} and up to {_number(high)}" if low_open else f"from {_number(low)} to {_number(high)}"
    if not math.isfinite(value):
        raise AttnprobeError(f"{option} {value} is not a finite number: use a number {span}{hint}")
    if value > high or value < low or (low_open and value == low):
        raise AttnprobeError(f"{option} {value:g} is out of range: use a number {span}{hint}")


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"
