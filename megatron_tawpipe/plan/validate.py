"""Prove a plan sound before anyone runs it.

Two passes.  The static pass matches communication: every send has exactly
one receive with the same tag and fields, every collective has all its members
with the same fields, matched operations are posted in the same order on every
(src, dst, channel) and on every communicator, every wait belongs to an
earlier start on the same rank, buffer names stay within the plan's bounds.

The dynamic pass executes all ranks symbolically under conservative blocking
semantics: starts never block; a wait completes only when every participant
of the operation has posted its start (a send needs its receive posted, a
collective all members).  If no rank can move while some are unfinished, the
plan deadlocks.  Along the way it tracks which shard each weight buffer holds,
which (stream, micro-batch) contributions each gradient buffer holds (as a bit
set, following them through sends, reductions and accumulation), the order of
forward/backward work of every micro-batch, and buffer hazards (a buffer with
a transfer in flight may not be written, and one being received into may not
be read).  At the end every owner's gradient must hold each of the
``streams * N`` contributions exactly once.

A third pass runs the plan's communication under NCCL's ordering rules
(:mod:`plan.nccl`): per-communicator FIFOs in issue order, NCCL groups
(``batch``), sends that finish only when their receive runs, in both of
ProcessGroupNCCL's arrangements (a communicator per rank pair, or one per
process group).  gloo would run a plan that fails it; a GPU cluster would hang.
With context parallelism it runs the per-GPU plan too: every virtual rank's
members as lanes of the plan, their collectives at the member points
(:mod:`plan.context_parallel`).

Errors are ``PlanError`` with ``rank``, ``step`` and ``action`` set where one
place is to blame.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict

from megatron_tawpipe.common.layer_split import check_layer_split
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.connect import check_nccl_order
from megatron_tawpipe.plan.context_parallel import lanes
from megatron_tawpipe.plan.nccl import MODES
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.symbolic import SymbolicExecutor


@dataclass
class ValidationReport:
    actions: int
    transfers: int
    collectives: int
    weight_buffers: int
    grad_buffers: int
    contributions: int


def validate_plan(plan: Plan, nccl_modes=MODES, context_parallel: int = 1) -> ValidationReport:
    """Raise ``PlanError`` unless ``plan`` is sound, on gloo and under NCCL's
    ordering rules in each of ``nccl_modes`` (``()`` skips that pass); return
    a few counts. ``context_parallel`` > 1: the plan's ranks are virtual ranks of
    that many context-parallel members, and the per-GPU plan with their
    collectives (:func:`plan.context_parallel.lanes`) must pass NCCL's rules too."""
    _check_meta(plan)
    starts = _check_static(plan)
    SymbolicExecutor(plan, starts).run()
    check_nccl_order(plan, nccl_modes)
    if context_parallel > 1:
        check_nccl_order(lanes(plan, context_parallel), nccl_modes)
    p2p = sum(1 for v in starts.values() if isinstance(v[0][2], A.P2P))
    return ValidationReport(actions=plan.num_actions(), transfers=p2p,
                            collectives=len(starts) - p2p,
                            weight_buffers=plan.max_weight_buffers,
                            grad_buffers=plan.max_grad_buffers,
                            contributions=plan.num_streams * plan.num_microbatches *
                            plan.num_shards)


# ---------------------------------------------------------------- metadata
def _check_meta(plan: Plan) -> None:
    P = plan.num_ranks
    if len(plan.actions) != P or len(plan.streams) != P:
        raise PlanError(f"plan has {len(plan.actions)} action lists and {len(plan.streams)} "
                        f"streams for {P} ranks")
    if plan.num_groups < 1 or P % plan.num_groups:
        raise PlanError(f"{plan.num_groups} groups do not divide {P} ranks")
    try:
        check_layer_split(plan.shard_layers, plan.num_layers, plan.num_shards)
    except ValueError as exc:
        raise PlanError(f"shard sizes: {exc}") from None
    if any(not 0 <= o < P for o in plan.owners):
        raise PlanError(f"shard owners {plan.owners} name ranks outside 0..{P - 1}")
    if plan.family == "weight" and sorted(plan.owners) != sorted(list(range(P)) * (len(plan.owners) // P)):
        raise PlanError("weight passing needs every rank to own the same number of shards, one or more "
                        f"(owners {plan.owners})")
    if plan.family not in ("weight", "activation"):
        raise PlanError(f"unknown plan family {plan.family!r}")
    if plan.ownership not in ("owner", "spread"):
        raise PlanError(f"unknown ownership {plan.ownership!r}; known: owner, spread")
    for shard, ranks in plan.replicas.items():
        if not 0 <= shard < plan.num_shards:
            raise PlanError(f"replicas name shard {shard}, outside 0..{plan.num_shards - 1}")
        holders = plan.holders(shard)
        if any(not 0 <= r < P for r in ranks) or len(set(holders)) != len(holders):
            raise PlanError(f"replicas {list(ranks)} of shard {shard} must be distinct ranks in 0..{P - 1} "
                            f"other than its owner {plan.owners[shard]}")


# ----------------------------------------------------------------- static
_KNOWN = frozenset(A.ACTION_TYPES)
_MAIN_OK = frozenset((A.Backward, A.BackwardWeight))


def _check_static(plan: Plan):
    P = plan.num_ranks
    G = plan.ranks_per_group
    starts: Dict[int, list] = defaultdict(list)         # tag -> [(rank, step, action)]
    p2p_order = defaultdict(list)                       # (src, dst, channel, side) -> [tag]
    comm_order = defaultdict(list)                      # (ranks, channel, rank) -> [tag]
    for r, acts in enumerate(plan.actions):
        open_tags = set()
        seen_tags = set()
        roles: Dict[str, str] = {}
        for i, a in enumerate(acts):
            t = type(a)
            if t is A.Wait:
                if a.tag not in open_tags:
                    raise PlanError(f"waits for tag {a.tag}, which this rank has not started "
                                    "(or already waited for)", r, i, a)
                open_tags.discard(a.tag)
                continue
            if t not in _KNOWN:
                raise PlanError("not a plan action", r, i, a)
            fields = A.buffer_roles(a)
            if fields:
                for f, role in fields:
                    name = getattr(a, f)
                    if name == A.MAIN:
                        if role != "grad" or t not in _MAIN_OK:
                            raise PlanError("'main' may only be the gradient target of a "
                                            "backward", r, i, a)
                        continue
                    if roles.setdefault(name, role) != role:
                        raise PlanError(f"buffer {name!r} is used both as {roles[name]} and "
                                        f"{role} buffer", r, i, a)
            if t in _STARTS:
                if a.tag in seen_tags:
                    raise PlanError(f"tag {a.tag} started twice on this rank", r, i, a)
                seen_tags.add(a.tag)
                open_tags.add(a.tag)
                starts[a.tag].append((r, i, a))
                if t in A.P2P:
                    if not 0 <= a.peer < P or a.peer == r:
                        raise PlanError(f"bad peer {a.peer}: the peer must be another rank, in 0..{P - 1}", r, i, a)
                    if a.kind not in A.KINDS:
                        raise PlanError(f"unknown kind {a.kind!r}; known: {', '.join(A.KINDS)}", r, i, a)
                    if a.link != ("intra" if r // G == a.peer // G else "inter"):
                        raise PlanError(f"link class should be {plan.link_between(r, a.peer)!r}",
                                        r, i, a)
                    key = (r, a.peer) if t is A.SendStart else (a.peer, r)
                    p2p_order[key + (A.CHANNEL[a.kind], t is A.SendStart)].append(a.tag)
                else:
                    if r not in a.ranks or tuple(sorted(set(a.ranks))) != a.ranks or \
                            any(not 0 <= x < P for x in a.ranks):
                        raise PlanError(f"member list {a.ranks} must be sorted, distinct and "
                                        "include this rank", r, i, a)
                    channel = "replicated"
                    if t is not A.ReplicatedAllReduceStart:
                        if t in _ROOTED and a.root not in a.ranks:
                            raise PlanError(f"root {a.root} is not a member", r, i, a)
                        if a.kind not in ("weight", "grad"):
                            raise PlanError(f"collectives move weights or grads, not {a.kind!r}",
                                            r, i, a)
                        want = "intra" if a.ranks[0] // G == a.ranks[-1] // G else "inter"
                        if a.link != want:
                            raise PlanError(f"link class should be {want!r}", r, i, a)
                        channel = A.CHANNEL[a.kind]
                    comm_order[(a.ranks, channel, r)].append(a.tag)
        if open_tags:
            tag = min(open_tags)
            rr, i, a = next(x for x in starts[tag] if x[0] == r)
            raise PlanError("started but never waited for", rr, i, a)
        for role, bound in (("weight", plan.max_weight_buffers), ("grad", plan.max_grad_buffers)):
            names = sorted(n for n, x in roles.items() if x == role)
            if len(names) > bound:
                raise PlanError(f"rank {r} uses {len(names)} {role} buffers {names}, more than "
                                f"the plan's bound {bound}")
    _check_matching(plan, starts)
    for (src, dst, channel, is_send), tags in p2p_order.items():
        if is_send:
            other = p2p_order.get((src, dst, channel, False), [])
            if tags != other:
                _order_error(plan, starts, tags, other, f"sends {src}->{dst} on channel "
                             f"{channel!r} and their receives are posted in different orders")
    by_comm = defaultdict(dict)
    for (ranks, channel, r), tags in comm_order.items():
        by_comm[(ranks, channel)][r] = tags
    for (ranks, channel), per_rank in by_comm.items():
        ref_rank = ranks[0]
        ref = per_rank.get(ref_rank, [])
        for r in ranks[1:]:
            if per_rank.get(r, []) != ref:
                _order_error(plan, starts, ref, per_rank.get(r, []),
                             f"collectives on communicator {ranks}/{channel} are issued in "
                             f"different orders on ranks {ref_rank} and {r}")
    return starts


def _order_error(plan, starts, a_tags, b_tags, what):
    for x, y in zip(a_tags, b_tags):
        if x != y:
            r, i, a = starts[y][-1]
            raise PlanError(f"{what}: expected tag {x} here", r, i, a)
    raise PlanError(what)


def _check_matching(plan: Plan, starts) -> None:
    for tag, posts in starts.items():
        r0, i0, a0 = posts[0]
        t = type(a0)
        if t in A.P2P:
            sends = [p for p in posts if type(p[2]) is A.SendStart]
            recvs = [p for p in posts if type(p[2]) is A.RecvStart]
            if len(posts) == 1 or not sends or not recvs:
                kind = "receive" if sends else "send"
                raise PlanError(f"has no matching {kind} (tag {tag})", r0, i0, a0)
            if len(posts) > 2 or len(sends) != 1:
                r, i, a = posts[2] if len(posts) > 2 else posts[1]
                raise PlanError(f"tag {tag} is used by more than one send/receive pair", r, i, a)
            (rs, i_s, s), (rr, i_r, rv) = sends[0], recvs[0]
            if s.peer != rr or rv.peer != rs:
                raise PlanError(f"send to rank {s.peer} is matched by a receive on rank {rr} "
                                f"from rank {rv.peer}; the send is on rank {rs}, step {i_s}", rr, i_r, rv)
            for f in ("kind", "shard", "size", "mb", "link"):
                if getattr(s, f) != getattr(rv, f):
                    raise PlanError(f"{f} differs from the matching send on rank {rs} step {i_s} "
                                    f"({A.describe(s)})", rr, i_r, rv)
        else:
            members = a0.ranks
            have = {p[0] for p in posts}
            missing = [m for m in members if m not in have]
            if missing:
                raise PlanError(f"collective tag {tag}: members {missing} never start it",
                                r0, i0, a0)
            ref = _fields_but_buf(a0)
            for r, i, a in posts:
                if type(a) is not t or _fields_but_buf(a) != ref:
                    raise PlanError(f"differs from the same collective on rank {r0} step {i0} "
                                    f"({A.describe(a0)})", r, i, a)
                if r not in members:
                    raise PlanError(f"rank {r} is not a member of collective tag {tag}", r, i, a)


def _fields_but_buf(a):
    """The fields that must agree across members (buffers are per rank)."""
    return tuple(getattr(a, f) for f in A.FIELD_NAMES[type(a)] if f != "buf")


_STARTS = frozenset(A.STARTS)
_ROOTED = (A.BroadcastStart, A.ReduceStart)
