"""``pretrain_llama.py --pipeline-schedule auto``: the run picks the fastest exact strategy for its cluster, says
which and why, and runs it.

Collective: every rank calls :func:`choose_schedule` with the same command line. The process group is created
(the run keeps it), the node link and the link inside a node are measured (:mod:`megatron_tawpipe.distributed.
link_probe`; ``--tawpipe-link-bandwidth`` gives the node link instead), the device's memory read (the smallest
over ranks), and rank 0 ranks the candidates (:func:`megatron_tawpipe.sim.schedule_choice.rank_schedules`) at the
command's micro-batch size, global batch and recomputation, on its compute times (``--tawpipe-compute-times``,
``--emulated-compute-times``, or the device's peak at a stated efficiency), each candidate's command checked by
the run's own validation. Rank 0 prints the top three with their margins and the flags that pin the winner; every
rank gets the winner's flags and runs the command with them in place of ``--pipeline-schedule auto``.
"""

from __future__ import annotations

import contextlib
import io
from typing import List

from megatron_tawpipe.common import launcher
from megatron_tawpipe.common.errors import ArgumentError

SCHEDULE_FLAG = "--pipeline-schedule"


GROUPS_FLAG = "--tawpipe-num-groups"   # the groups (nodes): the weight-passing candidates' flags carry it


def with_schedule(argv: List[str], flags: List[str]) -> List[str]:
    """``argv`` with ``--pipeline-schedule auto`` (and ``--tawpipe-num-groups``, which the weight-passing
    candidates' flags carry) replaced by ``flags``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in (SCHEDULE_FLAG, GROUPS_FLAG):
            skip = True
            continue
        if a.startswith((SCHEDULE_FLAG + "=", GROUPS_FLAG + "=")):
            continue
        out.append(a)
    return out + list(flags)


def _value(argv: List[str], flag: str):
    """The value ``argv`` gives ``flag`` (the last), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def refusal(argv: List[str], world_size: int) -> str:
    """Why ``pretrain_llama.py`` refuses ``argv`` on ``world_size`` ranks ("" when it accepts it), quietly."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            validate_args(parse_args(argv), world_size=world_size)
    except (ArgumentError, ValueError, SystemExit) as exc:
        return str(exc) or "refused by the parser"
    return ""


def choose_schedule(argv: List[str]) -> List[str]:
    """The command line to run in place of ``argv`` (which has ``--pipeline-schedule auto``); see the module
    docstring. Raises :class:`ArgumentError` when no candidate runs."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    world = launcher.world_size()
    base = None
    reasons = []
    groups = _value(argv, GROUPS_FLAG)
    for schedule in ("tawpipe", "1f1b"):   # the model and cluster flags, validated as one candidate takes them
        flags = [SCHEDULE_FLAG, schedule] + ([GROUPS_FLAG, groups] if groups and schedule == "tawpipe" else [])
        why = refusal(with_schedule(argv, flags), world)
        if not why:
            with contextlib.redirect_stdout(io.StringIO()):
                base = validate_args(parse_args(with_schedule(argv, flags)), world_size=world)
            break
        reasons.append(f"{schedule}: {why}")
    if base is None:
        raise ArgumentError("--pipeline-schedule auto: the command runs under no schedule (" + "; ".join(reasons) + ")")
    from megatron_tawpipe.training.schedule_decision import decide_schedule

    flags = decide_schedule(base, world, lambda candidate: refusal(with_schedule(argv, candidate), world))
    return with_schedule(argv, flags)
