"""megatron-core's warnings that every rank gives alike, once per job.

megatron-core warns at import and at model build when Transformer Engine or Apex is missing (falling back
to torch's optimizers, norms and multi-tensor kernels: the CPU path, and a supported GPU path), and every
``TransformerConfig`` built with its own default ``cuda_graph_scope="full"`` warns that "full scope is
deprecated" (megatron-core 0.16). Every rank and every module would print its own copy, several of them the
same text; this shows each distinct message of these once, on the first rank. Any other warning is left as
it is. (Python's own "once" action cannot: its registry is cleared whenever a library changes the warning
filters, which torch and megatron-core do while they import.)
"""

from __future__ import annotations

import os
import re
import warnings

from megatron_tawpipe.compat import patches

MISSING_EXTENSION = r"(Transformer Engine and Apex are|Transformer Engine is|Apex is) not installed"
# megatron-core's TransformerConfig warns about its own default cuda_graph_scope, on every rank alike.
FULL_SCOPE_DEPRECATED = r"full scope is deprecated"
SAME_ON_EVERY_RANK = (MISSING_EXTENSION, FULL_SCOPE_DEPRECATED)


def _is_same_on_every_rank(message, category) -> bool:
    return issubclass(category, UserWarning) and any(
        re.match(pattern, str(message), re.I) is not None for pattern in SAME_ON_EVERY_RANK)


def missing_extension_warnings_once(rank: int = None) -> None:
    """Show each distinct warning of :data:`SAME_ON_EVERY_RANK` (missing Transformer Engine / Apex, the
    deprecated "full" CUDA-graph scope) once on rank 0 (``RANK``), none on the other ranks. Call before
    megatron-core is imported; calling it again changes nothing."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        for pattern in SAME_ON_EVERY_RANK:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        return
    if getattr(warnings.showwarning, "shows_missing_extensions_once", False):
        return
    for pattern in SAME_ON_EVERY_RANK:
        warnings.filterwarnings("always", message=pattern, category=UserWarning)
    # Python documents warnings.showwarning as the hook for this (the registered patch rank0-warnings-once)
    patches.apply("rank0-warnings-once", wrap={"warnings:showwarning": _showing_once})


def _showing_once(show):
    """``show`` (Python's showwarning) with each distinct message of :data:`SAME_ON_EVERY_RANK` shown once."""
    shown = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        if _is_same_on_every_rank(message, category):
            if str(message) in shown:
                return
            shown.add(str(message))
        show(message, category, filename, lineno, file, line)

    show_once.shows_missing_extensions_once = True
    return show_once


def ignore_missing_extension_warnings() -> None:
    """For tools that use neither (data preparation): no such warning at all."""
    warnings.filterwarnings("ignore", message=MISSING_EXTENSION, category=UserWarning)
