"""Checkpoints of a long `analyze` run, and resuming from one (pure: io.py writes and reads the file).

A checkpoint holds the accumulator's sums, how many batches were done, the example maps, and a
fingerprint of everything that decides the results (model, corpus hash, batch size, resamples,
seed, attention options, dtype). Batches run in a fixed order and the sums are added in that order,
so a resumed run gives results identical to an uninterrupted one. A checkpoint whose fingerprint
differs from the run being started is refused, naming what differs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnprobe.errors import AttnprobeError

DEFAULT_EVERY_SECONDS = 300.0  # a checkpoint every five minutes


@dataclass
class State:
    fingerprint: dict[str, Any]
    batches_done: int
    sums: dict[str, np.ndarray]
    example_maps: np.ndarray | None  # [layer, head, query, key], once the example's batch has run

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {f"sum:{key}": value for key, value in self.sums.items()}
        arrays["meta"] = np.array(json.dumps({"fingerprint": self.fingerprint, "batches_done": self.batches_done}))
        if self.example_maps is not None:
            arrays["example_maps"] = self.example_maps
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> State:
        meta = json.loads(str(arrays["meta"]))
        sums = {key[4:]: value for key, value in arrays.items() if key.startswith("sum:")}
        return cls(meta["fingerprint"], int(meta["batches_done"]), sums, arrays.get("example_maps"))


@dataclass
class Checkpointing:
    """How `analyze` saves and resumes: `save` writes a State (io.py), every `every_seconds`."""

    save: Callable[[State], None]
    resume_from: State | None = None
    every_seconds: float = DEFAULT_EVERY_SECONDS
    should_stop: Callable[[], bool] = lambda: False  # e.g. set by a SIGINT/SIGTERM handler
    last_saved: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        return time.monotonic() - self.last_saved >= self.every_seconds


class Stopped(AttnprobeError):
    """The run was asked to stop (Ctrl-C, SIGTERM); a checkpoint with every finished batch was saved."""


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint made with another model, corpus or settings."""
    differs = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if "model_sha256" in differs and "model" not in differs:
        raise AttnprobeError(
            f"the model's weights at {current.get('model')} changed since the checkpoint was made (their fingerprint "
            "differs): resume with the weights it was made with, or run without --resume to start again"
        )
    if differs:
        key = differs[0]
        raise AttnprobeError(
            f"the checkpoint was made with {key} = {saved.get(key)!r}, this run has {current.get(key)!r}: "
            "run with the same model, corpus and settings, or without --resume to start again"
        )
