"""What the attention function needs for the batch being run (`Batch`), and what the blocks of query rows share
across its layers (`Block`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnprobe.kernel.features import LayerFeatures
from attnprobe.kernel.masks import MaskPlan, _right_padded, mask_plan
from attnprobe.metrics import RowGeometry, SentenceSums, TokenClasses, TokenPairs, row_geometry, token_pairs

LayerSums = Callable[[int, SentenceSums, Tensor | None], None]  # layer, sums, example maps [head, q, k] or None


@dataclass
class Batch:
    """What the attention function needs for the batch being run, and where its results go."""

    layers: dict[int, int]  # id(attention module) -> layer index
    last_layer: int
    special: Tensor | None  # [batch, seq] bool: special-token positions
    sink: int
    window: int
    bins: int  # position bins to keep
    budget_bytes: int
    block_rows: int | None  # fixed block size, overriding the budget (tests)
    example: tuple[int, int] | None  # (row in the batch, tokens kept) whose maps to hand back
    on_layer: LayerSums
    features: dict[int, LayerFeatures] = field(default_factory=dict)  # filled as the layers run
    discovering: list[str] | None = None  # discover(): collect what is not implemented instead of refusing
    fused: int | None = None  # through the fused kernel: layers it computes exactly, in batches this long or longer
    triton: bool = False  # through the Triton kernel: every layer it covers (triton_path.reason), before fused
    triton_fallback: bool = False  # --attention auto: a Triton kernel that fails to compile or launch falls back
    projections: list[nn.Module] | None = None  # per layer, the output projection: also the value-weighted scores
    keep_rows: bool = False  # hand every row's values back too (SentenceSums.rows), for the block bootstrap
    tokens: TokenClasses | None = None  # token ids and punctuation: punctuation, duplicate and the mass received
    kept: dict[tuple, Any] = field(default_factory=dict)  # what every layer shares: `padding`, `block`
    ran: set[str] = field(default_factory=set)  # the kernels the layers ran: "triton", "fused", "blocked"

    def padding(self, padding: Tensor | None, batch: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The checked right-padded mask [batch, key] and the lengths [batch] of a layer's padding mask: checked
        and counted by the first layer that gets this mask, the others reuse them."""
        found = self.kept.get(("padding", id(padding), batch, n))
        if found is None or found[0] is not padding:  # the mask itself is kept, so its id is not reused
            real = _right_padded(padding, batch, n, device)  # [batch, key]
            found = self.kept["padding", id(padding), batch, n] = (padding, real, real.sum(dim=-1))
        return found[1], found[2]

    def shared(self, name: str, anchor: Tensor, make: Callable[[], Any], *key: Any) -> Any:
        """What every layer of the batch computes alike from `anchor` (a tensor the batch keeps, such as `padding`'s
        lengths) and `key`: made by the first layer that asks, the others reuse it. Kept with its anchor, so that
        another tensor that reuses the anchor's id never matches."""
        full = (name, id(anchor), *key)
        found = self.kept.get(full)
        if found is None or found[0] is not anchor:
            found = self.kept[full] = (anchor, make())
        return found[1]

    def hidden_keys(self, real: Tensor) -> Tensor | None:
        """The padded keys [batch, 1, 1, key] bool of `real` (one of `padding`'s masks), None when every key is real:
        found once per batch (one host sync), the fused path's layers reuse it. Read only (the layers share it)."""
        return self.shared("hidden keys", real, lambda: None if bool(real.all()) else ~real[:, None, None, :])

    def geometry(self, lengths: Tensor, n: int, causal: bool, span: int | None) -> RowGeometry:
        """The RowGeometry of all n rows under `lengths` (one of `padding`'s), made once per batch: no [n, n] mask
        (the Triton and fused paths, whose kernels mask for themselves), and its position bins computed once."""
        return self.shared("geometry", lengths, lambda: row_geometry(0, n, lengths, causal, span), n, causal, span)

    def block(self, real: Tensor, lengths: Tensor, q0: int, q1: int, k0: int, k1: int, causal: bool,
              span: int | None) -> Block:
        """The Block of query rows q0 .. q1 - 1 and keys k0 .. k1 - 1 under the mask `real` (one of `padding`'s).

        Kept for the other layers only when the block is the whole sequence (short sentences, where making it costs
        as much as using it): a long sequence's blocks together would hold [rows, keys] masks of every block."""
        key = ("block", id(real), q0, q1, k0, k1, causal, span)
        found = self.kept.get(key)
        if found is None:
            pairs = None if self.tokens is None else token_pairs(self.tokens.ids, q0, q1 - q0, k0, k1 - k0, lengths,
                                                                  causal, span)
            found = Block(row_geometry(q0, q1 - q0, lengths, causal, span),
                          mask_plan(real, q0, q1 - q0, k1 - k0, causal, k0, span), pairs)
            if q0 == 0 and q1 == real.shape[-1]:
                self.kept[key] = found
        return found


@dataclass
class Block:
    """What the statistics of a block of query rows share across the layers of a batch (Batch.block): their
    geometry, the mask of the block's scores and the keys that hold each row's token."""

    rows: RowGeometry
    mask: MaskPlan
    pairs: TokenPairs | None  # None without token classes
