"""The launcher's environment (torchrun's variables): rank, local rank, world size, ranks per node.

One fallback for every variable: unset (or empty) reads as one process started by hand, or ranks all on
this node: ``RANK`` and ``LOCAL_RANK`` 0, ``WORLD_SIZE`` 1, ``LOCAL_WORLD_SIZE`` the world size. A value
that is not a whole number is a ValueError naming the variable.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional


def _read(name: str, fallback: int, environ: Optional[Mapping[str, str]]) -> int:
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return fallback
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: must be a whole number (the launcher, e.g. torchrun, sets it)") from None


def rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's global rank (``RANK``; 0 when unset)."""
    return _read("RANK", 0, environ)


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 when unset)."""
    return _read("LOCAL_RANK", 0, environ)


def world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Ranks in the job (``WORLD_SIZE``; 1 when unset)."""
    return _read("WORLD_SIZE", 1, environ)


def local_world_size(world: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE``); when unset, every rank of the job (``world``, default
    :func:`world_size`): ranks started without torchrun share one host."""
    return _read("LOCAL_WORLD_SIZE", world_size(environ) if world is None else world, environ)
