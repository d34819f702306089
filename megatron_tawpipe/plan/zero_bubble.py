"""Deferred weight passes: a lowering pass from a plan to a plan with split backwards.

``defer_weight_passes(plan, choose)`` splits every ``Backward`` into ``BackwardInput`` and
``BackwardWeight`` (:func:`split_backward`) and then moves weight passes
later on their rank, each *block* as a whole: the weight passes adding into one gradient buffer between
two other uses of it, together with the buffer's next user when that is what sends it on (the
``SendStart`` / ``ReduceStart`` of the gradient, or ``AccumulateToOwner``). A block may move to any
position before the first of

* another use of its gradient buffer (``ZeroGrad``, a transfer, an accumulation, a plain ``Backward``);
* a transfer or load into the weight buffer of one of its passes (the executor reads the weights);
* the ``Wait`` of its own consumer, and any other gradient-channel start when the consumer is one (the
  order of a rank's starts on each communicator stays as it was: NCCL's ordering rules);
* the all-reduce of the replicated parts a pass writes (shard 0: embedding, last shard: head);
* the optimizer step.

Nothing else changes: the starts keep their order, every gradient contribution still reaches its
buffer before the buffer moves, every weight pass still follows its input pass on the same rank.
``choose(rank, actions, block, candidates)`` picks the insertion index among ``candidates`` (indices of
``actions`` before which the block may go, the current position first); ``"latest"`` (the default)
takes the last one, ``"weight-waits"`` the last ``Wait`` for a fetched or broadcast shard (staying put
without one). ``megatron_tawpipe.sim.split`` chooses by the simulator's timeline: where the rank
idles.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple, Union

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan

Choose = Callable[[int, Sequence[object], Tuple[int, ...], List[int]], int]
_CONSUMERS = (A.SendStart, A.ReduceStart, A.AllReduceStart, A.ReduceScatterStart, A.AccumulateToOwner)
_WEIGHT_WRITERS = (A.LoadWeights, A.RecvStart, A.BroadcastStart, A.AllGatherStart)


def _grad_buf(a) -> Optional[str]:
    """The gradient buffer ``a`` uses (reads, writes or moves), None if none."""
    t = type(a)
    if t in (A.Backward, A.BackwardWeight):
        return a.gbuf
    if t in (A.ZeroGrad, A.AccumulateToOwner):
        return a.buf
    if t in A.COMM_BUFFER and a.kind == "grad":
        return a.buf
    return None


def _writes_weights(a, bufs, rank: int) -> bool:
    """Whether ``a`` (on ``rank``) writes one of the weight buffers ``bufs`` (a broadcast's root only reads)."""
    return type(a) in _WEIGHT_WRITERS and a.buf in bufs and not (type(a) is A.BroadcastStart and a.root == rank)


def _replicated_parts(shard: int, last: int) -> set:
    parts = {"all"}
    if shard == 0:
        parts.add("embedding")
    if shard == last:
        parts.add("head")
    return parts


def blocks(acts: Sequence[object]) -> List[Tuple[int, ...]]:
    """The movable blocks of one rank's list: indices of the weight passes into one gradient buffer
    between two other uses of it, plus the consumer's index when that use sends or accumulates it."""
    out, open_blocks = [], {}
    for i, a in enumerate(acts):
        g = _grad_buf(a)
        if g is None:
            continue
        if type(a) is A.BackwardWeight:
            open_blocks.setdefault(g, []).append(i)
            continue
        block = open_blocks.pop(g, None)
        if block is None:
            continue
        consumer = type(a) in _CONSUMERS and getattr(a, "batch", None) is None and g != A.MAIN
        out.append(tuple(block) + ((i,) if consumer else ()))
    out += [tuple(b) for b in open_blocks.values()]
    return sorted(out)


def candidates(acts: Sequence[object], block: Tuple[int, ...], last_shard: int, rank: int) -> List[int]:
    """Indices of ``acts`` before which ``block`` may go (its members removed first), in order; the first
    is where its last member is now."""
    members = [acts[i] for i in block]
    passes = [a for a in members if type(a) is A.BackwardWeight]
    g = passes[0].gbuf
    wbufs = {a.wbuf for a in passes}
    consumer = members[-1] if type(members[-1]) is not A.BackwardWeight else None
    parts = set().union(*(_replicated_parts(a.shard, last_shard) for a in passes))
    waited = getattr(consumer, "tag", None)
    out = [block[-1] + 1]

    def barrier(a) -> bool:     # what no weight pass of the block may pass
        t = type(a)
        return (_writes_weights(a, wbufs, rank) or t is A.OptimizerStep
                or (t is A.ReplicatedAllReduceStart and a.part in parts))

    if any(barrier(acts[j]) for j in range(block[0], block[-1]) if j not in block):
        return out              # its passes already sit as late as they may (before their consumer)
    for j in range(block[-1] + 1, len(acts)):
        a = acts[j]
        t = type(a)
        if (_grad_buf(a) == g or barrier(a) or (t is A.Wait and a.tag == waited)
                or (consumer is not None and t in A.STARTS and t is not A.ReplicatedAllReduceStart
                    and getattr(a, "kind", None) == "grad")):
            break
        batch = getattr(a, "batch", None)
        if batch is None or j + 1 == len(acts) or getattr(acts[j + 1], "batch", None) != batch:
            out.append(j + 1)       # not inside a batch: its starts are issued at once
    return out


def _latest(rank, acts, block, cands):
    return cands[-1]


class _WeightWaits:
    """The last ``Wait`` for weights (a fetched or broadcast shard) in the window, else stay. The tags of a
    rank's weight transfers are found once per rank: moving blocks reorders a rank's actions, never changes
    them (one instance per :func:`defer_weight_passes` call)."""

    def __init__(self) -> None:
        self._tags = {}

    def __call__(self, rank, acts, block, cands):
        tags = self._tags.get(rank)
        if tags is None:
            tags = self._tags[rank] = {a.tag for a in acts if type(a) in A.COMM_BUFFER and a.kind == "weight"
                                       and type(a) is not A.SendStart}
        waits = [c for c in cands[1:] if c < len(acts) and type(acts[c]) is A.Wait and acts[c].tag in tags]
        return waits[-1] if waits else cands[0]


POLICIES = {"latest": lambda: _latest, "weight-waits": _WeightWaits}   # a fresh chooser per call


def defer_weight_passes(plan: Plan, choose: Union[str, Choose] = "latest", name: Optional[str] = None) -> Plan:
    """``plan`` with split backwards whose weight-pass blocks are moved by ``choose`` (see the module)."""

    if isinstance(choose, str):
        if choose not in POLICIES:
            raise ValueError(f"choose must be one of {', '.join(POLICIES)} or a function, not {choose!r}")
        choose = POLICIES[choose]()
    if plan.family != "weight":
        raise ValueError("defer_weight_passes takes a weight-passing plan")
    split = plan if plan.options.get("split_backward") else split_backward(plan)
    last = split.num_shards - 1
    lists = []
    for r, acts in enumerate(split.actions):
        acts = list(acts)
        # Later blocks first, each found again by its members' identity after every move.
        order = [[id(acts[i]) for i in block] for block in blocks(acts)]
        where = {id(a): i for i, a in enumerate(acts)}
        for ids in reversed(order):
            block = tuple(where[x] for x in ids)
            cands = candidates(acts, block, last, r)
            at = choose(r, acts, block, cands)
            if at not in cands:
                raise ValueError(f"rank {r}: insertion index {at} is not one of {cands}")
            if at == cands[0]:
                continue
            members = set(block)
            moved = [acts[i] for i in block]
            if max(block) >= at:
                raise ValueError(f"rank {r}: a block moves later only; insertion index {at} is not after {block}")
            acts = [a for i, a in enumerate(acts[:at]) if i not in members] + moved + acts[at:]
            for i in range(min(block), at):   # only these moved: the rest keep their positions
                where[id(acts[i])] = i
        lists.append(acts)
    options = dict(split.options, split_backward=True, deferred_weight_passes=True)
    return dataclasses.replace(split, actions=lists, options=options,
                               schedule=name or split.schedule + "-zb")


def split_backward(plan: Plan) -> Plan:
    """The same plan with every Backward split into BackwardInput followed by
    BackwardWeight (a starting point for zero-bubble reordering)."""
    lists = []
    for acts in plan.actions:
        out = []
        for a in acts:
            if type(a) is A.Backward:
                out.append(A.BackwardInput(a.mb, a.shard, a.wbuf))
                out.append(A.BackwardWeight(a.mb, a.shard, a.wbuf, a.gbuf))
            else:
                out.append(a)
        lists.append(out)
    options = dict(plan.options, split_backward=True)
    return dataclasses.replace(plan, actions=lists, options=options)
