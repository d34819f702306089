"""Every error this package raises on purpose, in one place.

Each is a :class:`MegatronTawpipeError` and keeps the built-in base its callers catch (``ValueError``
for bad flags, ``RuntimeError`` for the rest). The command line turns them into one-line messages and
exit statuses (:mod:`megatron_tawpipe.cli.pretrain`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


class MegatronTawpipeError(Exception):
    """Base of this package's errors."""


# ---- input -------------------------------------------------------------------------------------------------
class ArgumentError(MegatronTawpipeError, ValueError):
    """A bad flag or flag combination; the message names the flag."""


# ---- plans -------------------------------------------------------------------------------------------------
def _describe(action) -> str:
    """Full, unambiguous text of a plan action (a dataclass): its type and every field."""
    fields = ", ".join(f"{f.name}={getattr(action, f.name)!r}" for f in dataclasses.fields(action))
    return f"{type(action).__name__}({fields})"


class PlanError(MegatronTawpipeError):
    """A plan is unsound.  ``rank``, ``step`` and ``action`` name the place to
    blame when there is one; the message then starts ``rank R, step S, Action(...)``."""

    def __init__(self, message: str, rank: Optional[int] = None, step: Optional[int] = None,
                 action=None):
        self.rank, self.step, self.action = rank, step, action
        if rank is not None:
            where = f"rank {rank}, step {step}"
            if action is not None:
                where += f", {_describe(action)}"
            message = f"{where}: {message}"
        super().__init__(message)


# ---- setup -------------------------------------------------------------------------------------------------
class PatchError(MegatronTawpipeError, RuntimeError):
    """A run-time patch (:mod:`megatron_tawpipe.compat.patches`) does not fit the installed megatron-core or
    torch; the message names the patch, its target and the installed versions."""


class CpuCompatError(PatchError):
    """The CPU compatibility layer does not fit the installed megatron-core."""


class DistributedSetupError(MegatronTawpipeError, RuntimeError):
    """The process group cannot be set up (master address unresolvable or unreachable)."""


# ---- running -----------------------------------------------------------------------------------------------
class ExecutionError(MegatronTawpipeError, RuntimeError):
    """A plan action could not run on this rank; names rank, step and action."""


class PeerFailure(ExecutionError):
    """A transfer failed or timed out: a peer stopped, stalled or is unreachable."""


class NonFiniteGradientError(MegatronTawpipeError, RuntimeError):
    """A NaN/Inf gradient; ``where`` names the shards (or replicated parts) it was found in."""

    def __init__(self, where: str):
        super().__init__(f"NaN/Inf gradient in {where}")
        self.where = where


class TrainingError(MegatronTawpipeError, RuntimeError):
    """Training cannot go on (non-finite loss, unsupported schedule, ...)."""


# ---- checkpoints -------------------------------------------------------------------------------------------
class CheckpointError(MegatronTawpipeError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class CheckpointSetupError(CheckpointError):
    """The flags do not fit the checkpoint (retrying the same command cannot help: exit status 2)."""


# ---- benchmarks --------------------------------------------------------------------------------------------
class BenchmarkError(MegatronTawpipeError, RuntimeError):
    """A benchmark could not be set up or run."""


class ClusterError(MegatronTawpipeError, RuntimeError):
    """The emulated cluster could not be created or used."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
