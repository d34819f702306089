"""Process groups created with the run's timeout.

``torch.distributed.new_group`` does not inherit the default group's timeout:
without one it takes the backend's default (10 minutes for NCCL), so a stalled
peer would be ended by NCCL's watchdog before ``--distributed-timeout-minutes``
and the progress board could say who stalled.  Every group of this package is
created here, with the timeout :func:`set_timeout` recorded from the flag.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

_TIMEOUT: Optional[datetime.timedelta] = None


def set_timeout(minutes: float) -> None:
    global _TIMEOUT
    _TIMEOUT = datetime.timedelta(minutes=minutes)


def timeout() -> Optional[datetime.timedelta]:
    """The run's timeout (``--distributed-timeout-minutes``), or None before it is known."""
    return _TIMEOUT


def new_group(ranks: Optional[Sequence[int]] = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the run's timeout (collective over the default group)."""
    return dist.new_group(list(ranks) if ranks is not None else None, timeout=_TIMEOUT)
