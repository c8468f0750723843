"""The circuit graph at head granularity: senders, receivers and which sender feeds which receiver."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Graph:
    """The nodes and edges of a model's computational graph at head granularity (see the module's docstring)."""

    layers: int
    heads: int
    kv_heads: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def per_layer(self) -> int:
        """Receivers in one layer: the query heads, the key heads, the value heads, the MLP."""
        return self.heads + 2 * self.kv_heads + 1

    @cached_property
    def senders(self) -> list[str]:
        names = ["input"]
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}" for h in range(self.heads)] + [f"m{layer}"]
        return names

    def kv_name(self, layer: int, group: int) -> str:
        return f"a{layer}.h{group}" if self.group == 1 else f"a{layer}.kv{group}"

    @cached_property
    def receivers(self) -> list[tuple[str, str]]:
        """(node, input) per receiver, in the order the model reads them."""
        out: list[tuple[str, str]] = []
        for layer in range(self.layers):
            out += [(f"a{layer}.h{h}", "q") for h in range(self.heads)]
            out += [(self.kv_name(layer, g), kind) for kind in "kv" for g in range(self.kv_heads)]
            out.append((f"m{layer}", ""))
        return out + [("logits", "")]

    def sender_index(self, layer: int, head: int | None = None) -> int:
        """A head's (or, head None, the MLP's) index among the senders."""
        return 1 + layer * (self.heads + 1) + (self.heads if head is None else head)

    def receiver_layer(self, r: int) -> int:
        return min(r // self.per_layer, self.layers)

    def prefix(self, r: int) -> int:
        """Receiver r reads the senders [0, prefix): everything before its layer, and its layer's heads for an MLP."""
        if r == len(self.receivers) - 1:
            return len(self.senders)
        layer, j = divmod(r, self.per_layer)
        return 1 + layer * (self.heads + 1) + (self.heads if j == self.per_layer - 1 else 0)

    @cached_property
    def mask(self) -> np.ndarray:
        """[senders, receivers] bool: the real edges."""
        prefixes = np.array([self.prefix(r) for r in range(len(self.receivers))])  # [receivers]
        return np.arange(len(self.senders))[:, None] < prefixes[None, :]

    @property
    def edge_count(self) -> int:
        return int(self.mask.sum())

    def serves(self, node: str) -> list[str]:
        """The query heads a key/value head serves (a query head: itself)."""
        layer, _, rest = node[1:].partition(".")
        if rest.startswith("kv"):
            g = int(rest[2:])
            return [f"a{layer}.h{h}" for h in range(g * self.group, (g + 1) * self.group)]
        return [node]

    def groups(self) -> dict[str, list[str]]:
        """Each grouped key/value receiver with the query heads it serves (empty without grouping)."""
        if self.group == 1:
            return {}
        return {self.kv_name(layer, g): self.serves(self.kv_name(layer, g)) for layer in range(self.layers)
                for g in range(self.kv_heads)}
