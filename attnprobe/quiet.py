"""Keeping the output attnprobe's own: transformers' and the hub client's logs and warnings held back while a
model loads or runs. Its own module, so that model.py and sources.py (which model.py imports) both use it without
importing each other."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager


@contextmanager
def quiet_transformers():
    """transformers logs load reports and warnings of its own, and the hub client logs every retry of a
    request; keep the CLI's output ours."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "accelerate")]  # accelerate: offload notes
    levels = [logger.level for logger in loggers]
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # torch's safe loader on a .bin of another pickle protocol: it loads, or attnprobe says why in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            yield
    finally:
        for logger, before in zip(loggers, levels):
            logger.setLevel(before)
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
