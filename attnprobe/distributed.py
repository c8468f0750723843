"""More than one process: torch.distributed under torchrun, one strided shard of the corpus per rank.

`torchrun --nproc-per-node N -m attnprobe analyze ...` starts N copies of the command. Each reads the
rank, world size and local rank that torchrun sets, joins the process group (NCCL on CUDA, gloo on
CPU), runs the sentences i with i % world_size == rank on its own device, and the per-sentence
results are merged with `all_reduce`: every sentence is measured by exactly one rank, and the others
contribute zeros, so the merged values are the single-process values exactly. Rank 0 writes the
results and prints; the other ranks stay silent. Nothing here is a launcher or a scheduler of ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from attnprobe.errors import AttnprobeError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, end: int, first: int = 0) -> list[int]:
        """This rank's items among first..end-1: those whose index % size == rank (a fixed, strided shard)."""
        return list(range(first + (self.rank - first) % self.size, end, self.size))

    def counts(self, n_items: int) -> list[int]:
        """How many items each rank measures, rank by rank."""
        return [len(range(r, n_items, self.size)) for r in range(self.size)]


def current() -> World:
    """The world torchrun describes in the environment (a single process when it does not)."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as err:
        raise AttnprobeError(f"WORLD_SIZE/RANK/LOCAL_RANK must be whole numbers ({err}): start with torchrun") from err
    if size < 1 or not 0 <= rank < size:
        raise AttnprobeError(f"RANK {rank} is outside WORLD_SIZE {size}: start with torchrun")
    return World(rank=rank, size=size, local_rank=local_rank)


def device_for(world: World, device: str) -> str:
    """Under torchrun with CUDA, each rank takes the GPU of its local rank."""
    if world.size > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{world.local_rank % torch.cuda.device_count()}"
    return device


def join(world: World, device: torch.device) -> None:
    """Join the process group once (NCCL for CUDA devices, gloo otherwise)."""
    import torch.distributed as dist

    if world.size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend=backend, rank=world.rank, world_size=world.size)
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AttnprobeError(f"cannot join the torchrun process group ({backend}): {first}") from err


def merge(world: World, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-item results from every rank, NaN where no rank has a value: each item comes from one rank."""
    if world.size == 1:
        return values
    import torch.distributed as dist

    merged = {}
    for name, value in values.items():
        present = ~value.isnan()  # the items (and defined values) this rank measured
        total = torch.where(present, value, 0.0)
        count = present.to(value.dtype)
        dist.all_reduce(total)
        dist.all_reduce(count)
        merged[name] = torch.where(count > 0, total, torch.nan)
    return merged


def barrier(world: World) -> None:
    """Wait until every rank gets here."""
    import torch.distributed as dist

    if world.size > 1 and dist.is_initialized():
        dist.barrier()


def leave(world: World) -> None:
    import torch.distributed as dist

    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def merge_sums(world: World, sums: dict, device: torch.device) -> dict:
    """Accumulator sums (numpy float64 arrays) added over every rank."""
    if world.size == 1:
        return sums
    import numpy as np
    import torch.distributed as dist

    merged = {}
    for key in sorted(sums):  # the same order on every rank
        tensor = torch.from_numpy(np.ascontiguousarray(sums[key])).to(device)
        dist.all_reduce(tensor)
        merged[key] = tensor.cpu().numpy()
    return merged
