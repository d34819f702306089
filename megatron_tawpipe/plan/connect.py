"""The connection warm-up: a pass that connects, before the first iteration,
everything a plan's communication will use.

NCCL connects a communicator's channels lazily, inside the first call that
needs them, and that call blocks its host until the peers involved make
theirs (:mod:`plan.nccl`, ``lazy=True``).  A first use in the middle of a plan
can therefore hang a plan that is safe once everything is connected: a rank
blocked in its first send to a peer stops issuing the operations its other
peers wait for.  A tiny all-reduce per communicator does not help: NCCL picks
its algorithm (ring, tree, NVLS) by size, and each is connected on its first
use.

:func:`connection_warmup` returns, for every rank, the actions that make each
connection once, in stages every rank takes in the same order:

* one stage per point-to-point process group: every rank that has peers on it
  issues one batch (one NCCL group) with a send to each peer it sends to in
  the plan and a receive from each peer it receives from, then waits for them;
* one stage per (collective process group, operation, size): its members
  issue a copy of the plan's first such operation and wait for it.

Stages are ordered the same on every rank and each involves only the ranks
that share it, so the warm-up cannot deadlock; the validator runs it before
the plan under the lazy rule.  The executor runs these actions on scratch
buffers of the same sizes (:meth:`runtime.executor.PlanExecutor.connect`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import MODES, NcclModel, communicator_of, process_group, transfer_elements
from megatron_tawpipe.plan.nccl_terms import START_TYPES
from megatron_tawpipe.plan.plan import Plan

#: Batch id of the warm-up's first point-to-point stage, counting down (the planners' batch ids are >= 0).
_FIRST_BATCH = -1


def connection_warmup(plan: Plan) -> List[List[object]]:
    """Per rank, the warm-up actions (start actions and their waits) for ``plan``."""
    P = plan.num_ranks
    next_tag = 1 + max((getattr(a, "tag", 0) for acts in plan.actions for a in acts), default=0)
    pairs: Dict[tuple, Dict[Tuple[int, int], object]] = {}      # p2p group -> {(src, dst): first send}
    collectives: Dict[tuple, object] = {}                         # (group, op, size) -> first action
    for r in range(P):
        for a in plan.actions[r]:
            t = type(a)
            if t is A.SendStart:
                pairs.setdefault(process_group(a, r), {}).setdefault((r, a.peer), a)
            elif t is A.RecvStart:
                pairs.setdefault(process_group(a, r), {})
            elif t in A.COLLECTIVE:
                collectives.setdefault((process_group(a, r), t.__name__, transfer_elements(plan, a)), a)
    out: List[List[object]] = [[] for _ in range(P)]
    batch = _FIRST_BATCH
    for group in sorted(pairs, key=repr):
        sends: Dict[int, list] = {r: [] for r in range(P)}
        recvs: Dict[int, list] = {r: [] for r in range(P)}
        for (src, dst), first in sorted(pairs[group].items()):
            sends[src].append(A.SendStart(next_tag, dst, first.buf, first.kind, first.shard, first.link,
                                          first.size, batch=batch))
            recvs[dst].append(A.RecvStart(next_tag, src, first.buf, first.kind, first.shard, first.link,
                                          first.size, batch=batch))
            next_tag += 1
        for r in range(P):
            ops = sorted(sends[r] + recvs[r], key=lambda a: (a.peer, type(a) is A.RecvStart))
            out[r] += ops + [A.Wait(a.tag) for a in ops]
        batch -= 1
    for key in sorted(collectives, key=repr):
        first = collectives[key]
        copy = dataclasses.replace(first, tag=next_tag)
        next_tag += 1
        for r in first.ranks:
            out[r] += [copy, A.Wait(copy.tag)]
    return out


def check_nccl_order(plan: Plan, modes=MODES, lazy: bool = True) -> None:
    """Raise ``PlanError`` unless ``plan`` runs to completion under NCCL's rules in every mode of
    ``modes``: with every connection made up front, and (``lazy``) under lazy connection after
    :func:`connection_warmup`.

    The lazy check is cut short where it can be: a rank leaves the warm-up only once each of its own
    connections is made (it waits for every warm-up operation), so if the warm-up alone runs under
    the lazy rule and makes every connection the plan uses, the plan after it meets no first use and
    runs as it does with everything connected -- which the first pass proved. Otherwise (say, a
    hand-written plan whose unbatched transfers use pair communicators the warm-up does not touch)
    the warm-up and the plan run together under the rule."""
    connected = {mode: NcclModel(plan, mode) for mode in modes}
    for model in connected.values():
        model.run()
    if not (lazy and modes):
        return
    warmup = connection_warmup(plan)
    alone = dataclasses.replace(plan, actions=warmup)
    for mode, model in connected.items():
        made = NcclModel(alone, mode, lazy=True)
        made.run()
        if connection_keys(model) <= connection_keys(made):
            continue
        NcclModel(plan, mode, lazy=True, prologue=warmup).run()


def connection_keys(model: NcclModel) -> set:
    """Every connection the operations of ``model``'s ranks use."""
    return {key for r, entries in enumerate(model.entries) for e in entries for key in model.connections(r, e)}


def communicators_in_flight(plan: Plan) -> int:
    """The most communicators one rank has operations in flight on at once (group mode): the NCCL
    kernels that must be able to run side by side on one GPU."""
    most = 0
    for r, acts in enumerate(plan.actions):
        live: Dict[int, tuple] = {}
        for a in acts:
            if type(a) is A.Wait:
                live.pop(a.tag, None)
            elif type(a) in START_TYPES:
                live[a.tag] = communicator_of(r, a, "group")
                most = max(most, len(set(live.values())))
    return most
