"""Context parallelism in a weight-passing plan: where the members of a virtual rank meet, and the per-GPU plan
that carries those meetings as operations, which the NCCL model proves.

With ``--context-parallel-size C`` a plan's ranks are *virtual ranks*: C GPUs of one node (T x C with tensor
parallelism; the tensor-parallel ranks change nothing here) that run the same action list. Member c of virtual
rank v moves piece c of every weight and gradient transfer between virtual ranks, on communicators of its own
(``runtime.transport.Communicators``): as far as the plan's transfers go, the members are C copies of the plan,
*lanes*, one per member index. Between themselves, on the context-parallel process group, the members run
collectives at fixed points of the list, *member points* (:func:`member_points`), identically on every member:

* ``"compute"``, during every forward and backward action: the ring attention's key/value exchange (and, in the
  last shard's forward, the count of the micro-batch's loss tokens);
* ``"gather"``, after the ``Wait`` of an arriving weight (a receive, a broadcast to a non-root): the pieces
  all-gathered into the whole shard;
* ``"scatter"``, before a gradient leaves (a send, a reduction, an all-reduce, a broadcast's root): the members'
  gradients reduce-scattered into each member's piece -- before the first start of the NCCL group (``batch``)
  the send is issued with, since a group is issued at once;
* ``"replicated"``, before a replicated all-reduce: the replicated parameters' gradients reduce-scattered over the
  members, each keeping the sum of the piece its lane all-reduces over the virtual ranks;
* ``"sum"``, after the last action: every gradient summed over the members, each keeping its piece of the sum
  (a reduce-scatter before the optimizer step, but for the replicated parts a ``"replicated"`` point summed
  already; after the step the stepped masters' pieces are all-gathered, in the same order on every member,
  outside the list).

The executor (``runtime.executor``) runs the member points of the list it executes, from :func:`member_points`
and nowhere else. :func:`lanes` writes the per-GPU plan -- the C lanes of every virtual rank, each rank's member
points as synchronous collectives (:class:`MemberCollectiveStart` and its ``Wait``) over its virtual rank's
members -- and ``plan.connect.check_nccl_order`` runs it under NCCL's rules: a member collective completes only
when it heads the context-parallel communicator's queue on every member, so a point placed where one member
would block another (say, behind a receive in one issue order) shows up as a deadlock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.actions import MemberCollectiveStart
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.nccl_terms import entries_of
from megatron_tawpipe.plan.plan import Plan

#: What the members do at a point (see the module docstring), and when, relative to the action at its step.
OPERATIONS = ("compute", "gather", "scatter", "replicated", "sum")
WHEN = {"compute": "during", "gather": "after", "scatter": "before", "replicated": "before", "sum": "after"}
_LEAVING = (A.SendStart, A.ReduceStart, A.AllReduceStart)


@dataclass(frozen=True, slots=True)
class MemberPoint:
    """Member collective ``op`` at ``step`` of a rank's list (``when``: before, during or after that action);
    ``action``: the start it serves (the compute action for ``"compute"``; None for ``"sum"``)."""
    step: int
    op: str
    action: object

    @property
    def when(self) -> str:
        return WHEN[self.op]


def member_points(actions, rank: int, compute: bool = True) -> List[MemberPoint]:
    """The member points of ``rank``'s list ``actions``, in the order the members run them (``compute``: with
    the compute actions'; the executor leaves those to its compute). Raises ``PlanError`` for an action
    context parallelism does not run (the spread layout's slice collectives)."""
    points: List[Tuple[int, int, MemberPoint]] = []   # (step, order at the step, point)
    order = {"before": 0, "during": 1, "after": 2}
    # a send's group is issued at its first start, as the executor issues it (``runtime.executor._issue_p2p``)
    first = {step: ops[0][0] for _, ops in entries_of(actions, rank, "group") for step, _ in ops}
    starts: Dict[int, object] = {}
    for step, a in enumerate(actions):
        t = type(a)
        if t in A.SLICE_COLLECTIVES:
            raise PlanError("the spread layout (slice holders) does not run with context parallelism", rank, step, a)
        point = None
        if t in A.COMPUTE:
            point = MemberPoint(step, "compute", a) if compute else None
        elif t is A.Wait:
            start = starts.get(a.tag)
            arriving = (type(start) is A.RecvStart
                        or (type(start) is A.BroadcastStart and start.root != rank))
            if arriving and start.kind == "weight":
                point = MemberPoint(step, "gather", start)
        elif t is A.ReplicatedAllReduceStart:
            point = MemberPoint(step, "replicated", a)
        elif t in A.STARTS:
            leaving = t in _LEAVING or (t is A.BroadcastStart and a.root == rank)
            if leaving and a.kind == "grad":
                point = MemberPoint(first[step], "scatter", a)
        if t in A.STARTS:
            starts[a.tag] = a
        if point is not None:
            points.append((point.step, order[point.when], point))
    points.append((len(actions), 0, MemberPoint(len(actions), "sum", None)))
    points.sort(key=lambda x: (x[0], x[1]))   # stable: a group's scatters in issue order
    return [p for _, _, p in points]


def points_by_step(points: List[MemberPoint]) -> Dict[Tuple[int, str], List[MemberPoint]]:
    """``points`` by (step, when)."""
    out: Dict[Tuple[int, str], List[MemberPoint]] = {}
    for p in points:
        out.setdefault((p.step, p.when), []).append(p)
    return out


def _lane_action(a, c: int, size: int, low: int):
    """Action ``a`` of a virtual rank as lane ``c``'s: its tag (``low``: the plan's least) and the virtual ranks it
    names mapped."""
    def gpu(v: int) -> int:
        return v * size + c

    changes = {}
    if hasattr(a, "tag"):
        changes["tag"] = (a.tag - low) * size + c
    if hasattr(a, "peer"):
        changes["peer"] = gpu(a.peer)
    if hasattr(a, "root"):
        changes["root"] = gpu(a.root)
    if hasattr(a, "ranks"):
        changes["ranks"] = tuple(gpu(v) for v in a.ranks)
    return dataclasses.replace(a, **changes) if changes else a


def lanes(plan: Plan, size: int) -> Plan:
    """The per-GPU plan of ``plan``'s virtual ranks with ``size`` context-parallel members each: GPU
    ``v * size + c`` runs virtual rank v's list as lane c (transfers with lane c of the other virtual ranks, every
    tag ``t`` as ``(t - least tag) * size + c``) and, at each member point, a :class:`MemberCollectiveStart` over GPUs
    ``v * size .. v * size + size - 1`` and its ``Wait``. For ``plan.connect.check_nccl_order``."""
    if size < 1:
        raise ValueError(f"context-parallel size {size}: must be at least 1")
    if plan.family != "weight":
        raise PlanError(f"context parallelism inside the plan is for weight passing, not {plan.family} plans")
    tags = [a.tag for acts in plan.actions for a in acts if hasattr(a, "tag")]
    low = min(tags, default=0)
    next_tag = (max(tags, default=low - 1) - low + 1) * size
    out: List[List[object]] = [[] for _ in range(plan.num_ranks * size)]
    for v, acts in enumerate(plan.actions):
        members = tuple(range(v * size, (v + 1) * size))
        meetings: Dict[Tuple[int, str], List[Tuple[int, MemberPoint]]] = {}
        for p in member_points(acts, v):   # one tag each, in the order the members run them
            meetings.setdefault((p.step, p.when), []).append((next_tag, p))
            next_tag += 1
        for c in range(size):
            lane = out[v * size + c]

            def meet(step: int, when: str) -> None:
                for tag, p in meetings.get((step, when), ()):
                    lane.append(MemberCollectiveStart(tag, members, p.op, getattr(p.action, "shard", -1)))
                    lane.append(A.Wait(tag))

            for step, a in enumerate(acts):
                meet(step, "before")
                lane.append(_lane_action(a, c, size, low))
                meet(step, "during")
                meet(step, "after")
            meet(len(acts), "after")
    owners = tuple(o * size for o in plan.owners)
    replicas = {s: tuple(r * size for r in ranks) for s, ranks in plan.replicas.items()}
    return dataclasses.replace(plan, num_ranks=plan.num_ranks * size, owners=owners, replicas=replicas,
                               streams=tuple(s for s in plan.streams for _ in range(size)), actions=out,
                               options={**plan.options, "context_parallel_size": size})
