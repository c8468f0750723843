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
    path: str | None = None  # the file it was read from, named when it cannot be resumed

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {f"sum:{key}": value for key, value in self.sums.items()}
        arrays["meta"] = np.array(json.dumps({"fingerprint": self.fingerprint, "batches_done": self.batches_done}))
        if self.example_maps is not None:
            arrays["example_maps"] = self.example_maps
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], path: str | None = None) -> State:
        """The state saved by `to_arrays`; ValueError naming the first field that is missing or not as saved."""
        if "meta" not in arrays or arrays["meta"].shape != () or arrays["meta"].dtype.kind != "U":
            raise ValueError("no meta record")
        try:
            meta = json.loads(str(arrays["meta"]))
        except json.JSONDecodeError:
            raise ValueError("its meta record is not JSON") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), dict):
            raise ValueError("its meta record holds no fingerprint")
        done = meta.get("batches_done")
        if not isinstance(done, int) or isinstance(done, bool) or done < 1:
            raise ValueError(f"batches_done = {done!r} is not a whole number of at least 1")
        sums = {key[4:]: value for key, value in arrays.items() if key.startswith("sum:")}
        if not sums:
            raise ValueError("it holds no sums")
        for key, value in sums.items():
            if value.dtype.kind != "f" or not np.isfinite(value).all():
                raise ValueError(f"sum {key} holds values that are not finite numbers")
        maps = arrays.get("example_maps")
        if maps is not None and (maps.dtype.kind != "f" or maps.ndim != 4 or np.isinf(maps).any()):
            raise ValueError("example_maps is not a [layer, head, query, key] array of numbers")
        unknown = sorted(set(arrays) - {"meta", "example_maps"} - {f"sum:{key}" for key in sums})
        if unknown:
            raise ValueError(f"it holds an unknown array {unknown[0]!r}")
        return cls(meta["fingerprint"], done, sums, maps, path)

    def check_fits(self, sums: dict[str, np.ndarray], batches: int, example_shape: tuple[int, ...]) -> None:
        """Refuse a state whose sums, batch count or example maps do not fit this run (`sums`: a fresh
        accumulator's, of the right keys and shapes; `batches`: the run's batch count)."""
        where = self.path or "the checkpoint"
        problem = None
        if set(self.sums) != set(sums):
            missing = sorted(set(sums) - set(self.sums)) or sorted(set(self.sums) - set(sums))
            problem = f"its sums do not fit this run ({missing[0]})"
        elif any(self.sums[key].shape != value.shape for key, value in sums.items()):
            key = next(key for key, value in sums.items() if self.sums[key].shape != value.shape)
            problem = f"sum {key} has shape {self.sums[key].shape}, this run {sums[key].shape}"
        elif self.batches_done > batches:
            problem = f"batches_done = {self.batches_done}, but the run has {batches} batches"
        elif self.example_maps is not None and self.example_maps.shape != tuple(example_shape):
            problem = f"example_maps has shape {self.example_maps.shape}, this run {tuple(example_shape)}"
        if problem:
            raise AttnprobeError(f"{where} is damaged ({problem}): delete it and run without --resume")


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
