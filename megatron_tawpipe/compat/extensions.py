"""megatron-core's warnings about missing optional extensions (Transformer Engine, Apex), once per job.

megatron-core warns at import and at model build when Transformer Engine or Apex is missing (falling back
to torch's optimizers, norms and multi-tensor kernels: the CPU path, and a supported GPU path). Every rank
and every module would print its own copy; this shows each distinct message once, on the first rank.
"""

from __future__ import annotations

import os
import warnings

MISSING_EXTENSION = r"(Transformer Engine and Apex are|Transformer Engine is|Apex is) not installed"


def missing_extension_warnings_once(rank: int = None) -> None:
    """Show each missing-Transformer-Engine/Apex warning once on rank 0 (``RANK``), none on other ranks.
    Call before megatron-core is imported."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    warnings.filterwarnings("once" if rank == 0 else "ignore", message=MISSING_EXTENSION, category=UserWarning)


def ignore_missing_extension_warnings() -> None:
    """For tools that use neither (data preparation): no such warning at all."""
    warnings.filterwarnings("ignore", message=MISSING_EXTENSION, category=UserWarning)
