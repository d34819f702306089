"""``--logging-level``: the root logger's level, as Megatron-LM sets it.

The flag wins over the environment variable ``MEGATRON_LOGGING_LEVEL``; with neither, Python's logging is
left as it is. Levels are integers (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

ENV = "MEGATRON_LOGGING_LEVEL"


def logging_level(args) -> Optional[int]:
    """The level to set: ``--logging-level``, else ``MEGATRON_LOGGING_LEVEL``, else None (ValueError if the
    variable is not an integer)."""
    if args.logging_level is not None:
        return int(args.logging_level)
    text = os.environ.get(ENV)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r} must be an integer logging level (10 DEBUG, 20 INFO, 30 WARNING, ...)") \
            from None


def set_logging_level(args) -> None:
    level = logging_level(args)
    if level is not None:
        logging.getLogger().setLevel(level)
