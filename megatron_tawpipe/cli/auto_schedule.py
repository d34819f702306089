"""``pretrain_llama.py --pipeline-schedule auto``: the run picks the fastest exact strategy for its cluster, says
which and why, and runs it.

Collective: every rank calls :func:`choose_schedule` with the same command line. The process group is created
(the run keeps it), the node link and the link inside a node are measured (:mod:`megatron_tawpipe.distributed.
link_probe`; ``--tawpipe-link-bandwidth`` gives the node link instead), the device's memory read (the smallest
over ranks), and rank 0 ranks the candidates (:func:`megatron_tawpipe.sim.schedule_choice.rank_schedules`) at the
command's micro-batch size, global batch, recomputation and tensor x context parallelism (every candidate
over the same virtual ranks, priced per GPU), on its compute times (``--tawpipe-compute-times``,
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
# TawPipe's layout flags (a TawPipe candidate decides its layout; the others do not take them), and the weight
# pipeline's own options (the native candidates do not take them: recomputation and overlap change no math)
LAYOUT_FLAGS = {"--tawpipe-ownership": 1, "--tawpipe-shards-per-rank": 1, "--tawpipe-cache": 1,
                "--tawpipe-microbatches-per-visit": 1, "--tawpipe-replicated-reduce": 1,
                "--tawpipe-replicate-first-shard": 0, "--no-tawpipe-replicate-first-shard": 0}
WEIGHT_PASSING_FLAGS = {"--tawpipe-no-recompute": 0, "--tawpipe-recompute": 1, "--tawpipe-no-overlap": 0, "--tawpipe-nccl-faithful": 0,
                        "--weipipe-zero-bubble": 1, "--timeline-file": 1, "--record-plan-memory": 0}


def with_schedule(argv: List[str], flags: List[str]) -> List[str]:
    """``argv`` with ``--pipeline-schedule auto`` replaced by ``flags``, without what the candidate does not take:
    ``--tawpipe-num-groups`` (the weight-passing candidates' flags carry it), TawPipe's layout flags but for a
    TawPipe candidate, the weight pipeline's options for a native one."""
    schedule = flags[flags.index(SCHEDULE_FLAG) + 1] if SCHEDULE_FLAG in flags else None
    drop = {SCHEDULE_FLAG: 1, GROUPS_FLAG: 1}
    if schedule != "tawpipe":
        drop.update(LAYOUT_FLAGS)
    if schedule not in ("tawpipe", "weipipe"):
        drop.update(WEIGHT_PASSING_FLAGS)
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = drop[name] if "=" not in a else 0
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

