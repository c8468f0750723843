"""attnprobe: measure what the attention heads of a transformer actually do."""

from attnprobe.errors import AttnprobeError

__version__ = "0.1.0"

__all__ = ["AttnprobeError", "__version__"]
