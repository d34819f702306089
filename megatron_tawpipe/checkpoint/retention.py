"""``--save-retain-interval N`` (Megatron-LM's): keep the checkpoints whose iteration is a multiple of N, and the
latest one; the others go once a newer checkpoint is complete.

As in Megatron-LM, the check happens when a save is finalized: the checkpoint the tracker named before this
save (the previous latest) is deleted if its iteration is not a multiple of N. It runs on rank 0 after the new
checkpoint's directory is in place and ``latest_checkpointed_iteration.txt`` names it, so a run killed at any
point still has a complete checkpoint under the tracker. Never deleted: the checkpoint the tracker names, a
directory that is a symbolic link (as Megatron-LM), anything that is not ``iter_NNNNNNN``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import Optional

logger = logging.getLogger(__name__)


def expendable(previous: Optional[int], iteration: int, interval: Optional[int]) -> bool:
    """Whether the checkpoint of iteration ``previous`` (the latest before ``iteration`` was saved) is deleted."""
    return (interval is not None and previous is not None and previous > 0 and previous != iteration
            and previous % interval != 0)


def delete_checkpoint(root: str, iteration: int, latest: int) -> Optional[str]:
    """Delete ``root/iter_<iteration>`` (rank 0; never the one the tracker names, ``latest``); the path deleted,
    or None when there was nothing to delete. The directory is renamed first, so that no reader sees it half gone."""
    if iteration == latest:
        raise ValueError(f"refusing to delete iteration {iteration}: the tracker names it")
    path = os.path.join(root, f"iter_{iteration:07d}")
    if os.path.islink(path):
        logger.info("--save-retain-interval: keeping %s (a symbolic link)", path)
        return None
    if not os.path.isdir(path):
        return None
    doomed = path + ".deleting"
    if os.path.lexists(doomed):   # left by a run killed while deleting: never a checkpoint, never read
        _remove(doomed)
    os.replace(path, doomed)
    _remove(doomed)
    return path


def _remove(path: str) -> None:
    """Remove a renamed-away checkpoint; what cannot be removed (permissions, a busy file system) is said once
    per path and left: the run goes on, the tracker still names a complete checkpoint."""
    failures = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _function, name, exc: failures.append((name, exc)))
    else:
        shutil.rmtree(path, onerror=lambda _function, name, info: failures.append((name, info[1])))
    if failures:
        name, exc = failures[0]
        logger.warning("--save-retain-interval: %s could not be removed (%d entr%s, first %s: %s); remove it by "
                       "hand, it is never loaded", path, len(failures), "y" if len(failures) == 1 else "ies",
                       name, exc)
