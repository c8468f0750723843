"""attnprobe: measure what the attention heads of a transformer actually do.

From Python (a notebook)::

    import attnprobe

    model = attnprobe.load_model("minilm-l6", device="cpu")
    result = attnprobe.analyze(model, ["The cat sat on the mat.", "Rain fell."])
    types = attnprobe.classify(result.heads)
    maps, tokens = attnprobe.attention_maps(model, "The cat sat on the mat.")

`import attnprobe` stays light (the CLI starts without torch): each function loads its module on first
use. `classify`, `probe`, `verify`, `compare`, `ablate` and `rollout` are the submodules of those names,
made callable: `attnprobe.probe(...)` calls `attnprobe.probe.probe(...)`. (Python binds a package's
attribute to its submodule once the submodule is imported, so a plain function could not keep the name.)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from attnprobe.errors import AttnprobeError

__version__ = "0.1.0"

# function name -> the module (in this package) that defines it
_FUNCTIONS = {
    "analyze": "analysis",
    "load_model": "model",
    "from_transformers": "model",
    "attention_maps": "maps",
    "read_corpus": "corpus",
    "build_report": "report",
    "entropy_heatmap_figure": "plotting",
    "layer_gradient_figure": "plotting",
    "head_patterns_figure": "plotting",
    "position_profile_figure": "plotting",
    "probe_heatmap_figure": "plotting",
    "compare_figure": "plotting",
    "importance_heatmap_figure": "plotting",
    "rollout_figure": "plotting",
    "head_similarity": "similarity",
    "head_similarity_figure": "plotting",
    "head_map_figure": "plotting",
    "compose": "composition",
    "composition_figure": "plotting",
}
# submodules that are also their namesake function
_CALLABLE_MODULES = ("classify", "probe", "verify", "compare", "ablate", "rollout")

__all__ = [  # spelled out for linters and type checkers; the tests check it against the two tables above
    "AttnprobeError", "__version__", "analyze", "load_model", "from_transformers", "attention_maps", "read_corpus",
    "build_report", "entropy_heatmap_figure", "layer_gradient_figure", "head_patterns_figure",
    "position_profile_figure", "probe_heatmap_figure", "compare_figure", "importance_heatmap_figure",
    "rollout_figure", "head_similarity", "head_similarity_figure", "head_map_figure", "compose",
    "composition_figure", "classify", "probe", "verify",
    "compare", "ablate", "rollout",
]

if TYPE_CHECKING:
    from attnprobe.analysis import analyze
    from attnprobe.composition import compose
    from attnprobe.corpus import read_corpus
    from attnprobe.maps import attention_maps
    from attnprobe.model import from_transformers, load_model
    from attnprobe.plotting import (
        compare_figure,
        composition_figure,
        entropy_heatmap_figure,
        head_map_figure,
        head_patterns_figure,
        head_similarity_figure,
        importance_heatmap_figure,
        layer_gradient_figure,
        position_profile_figure,
        probe_heatmap_figure,
        rollout_figure,
    )
    from attnprobe.report import build_report
    from attnprobe.similarity import head_similarity


class _CallableModule(types.ModuleType):
    """A submodule that can be called as its namesake function: `attnprobe.probe(...)`."""

    @property
    def _main(self) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._main(*args, **kwargs)

    @property
    def __signature__(self) -> Any:  # what inspect.signature, help() and a notebook's `?` show
        import inspect

        return inspect.signature(self._main)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # the import system sets `attnprobe.<name>` to each submodule it imports: make those callable
        if name in _CALLABLE_MODULES and type(value) is types.ModuleType and value.__name__ == f"{__name__}.{name}":
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name in _CALLABLE_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


sys.modules[__name__].__class__ = _Package
