"""The action set of a pipeline plan.

A plan gives every rank an ordered list of actions.  A rank executes its list
strictly in order; the only asynchronous things are communication operations,
which have an explicit start action and a later ``Wait(tag)``.  Everything an
executor needs is in the action itself: peers are global ranks, buffers are
named slots on the executing rank, ``size`` is in *units* (one shard's weights
or gradient for ``kind`` weight/grad, one micro-batch boundary activation for
``kind`` act/actgrad) and ``link`` says whether the transfer stays inside a
group (node) or crosses groups.

Buffers
-------
* weight buffers (``w0``, ``w1``, ...) hold a compute-dtype copy of one shard;
* gradient buffers (``g0``, ...) hold a partial gradient of one shard;
* ``main`` is the owner's own gradient accumulator of the shard named by the
  action (never used by communication actions).

Micro-batch numbers are local to the rank's data stream: in weight-passing
plans every rank is a data-parallel rank with its own micro-batches
``0..N-1``; in activation-passing plans all ranks share one stream.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

# Communication kinds and the channel (communicator) each travels on.  Weight
# and gradient traffic use separate channels so that one can overlap the other.
KINDS = ("weight", "grad", "act", "actgrad")
CHANNEL = {"weight": "weight", "grad": "grad", "act": "act", "actgrad": "actgrad"}
#: Channels whose point-to-point process groups are one per direction (plan/nccl_terms.py).
DIRECTED_CHANNELS = ("weight", "grad")
LINKS = ("intra", "inter")
MAIN = "main"
REPLICATED_PARTS = ("all", "head", "embedding")
#: ``ReplicatedAllReduceStart.mode``: the gradients' all-reduce, or the sharded optimizer's two halves.
REPLICATED_MODES = ("sum", "scatter", "gather")


@dataclass(frozen=True, slots=True)
class Forward:
    """Run shard ``shard`` forward on micro-batch ``mb`` with the weights in
    ``wbuf``.  Input is the boundary activation of (mb, shard) (the embedding
    output when shard == 0); the output boundary is kept for the next shard.
    The last shard also runs the replicated head (final norm, output layer,
    loss)."""
    mb: int
    shard: int
    wbuf: str


@dataclass(frozen=True, slots=True)
class Backward:
    """Recompute (if configured) and back-propagate (mb, shard) using the
    weights in ``wbuf``; *add* the weight gradient into ``gbuf`` and keep the
    input gradient for shard-1 (shard 0 also back-propagates the embedding)."""
    mb: int
    shard: int
    wbuf: str
    gbuf: str


@dataclass(frozen=True, slots=True)
class BackwardInput:
    """First half of a split backward: input gradient only."""
    mb: int
    shard: int
    wbuf: str


@dataclass(frozen=True, slots=True)
class BackwardWeight:
    """Second half of a split backward: add the weight gradient into ``gbuf``."""
    mb: int
    shard: int
    wbuf: str
    gbuf: str


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Copy the rank's own master weights of ``shard`` (cast to the compute
    dtype) into weight buffer ``buf``.  Only the owner may load a shard."""
    shard: int
    buf: str


@dataclass(frozen=True, slots=True)
class ZeroGrad:
    """Make gradient buffer ``buf`` an empty (zero) partial gradient of ``shard``."""
    shard: int
    buf: str


@dataclass(frozen=True, slots=True)
class AccumulateToOwner:
    """Owner adds partial gradient ``buf`` of ``shard`` into its ``main``
    gradient; ``buf`` is free afterwards."""
    shard: int
    buf: str


@dataclass(frozen=True, slots=True)
class SendStart:
    """Start sending buffer ``buf`` (holding ``shard``) to global rank ``peer``.
    The matching ``RecvStart`` on ``peer`` carries the same ``tag``; on each
    (src, dst, channel) sends and receives are posted in the same order.  The
    buffer must not be written until ``Wait(tag)``; a sent gradient buffer is
    empty after the wait (its contributions moved to the receiver).

    ``batch``: starts of one rank that carry the same integer are issued
    together as one NCCL group (``batch_isend_irecv``); they must be adjacent
    in the rank's list and use one communicator.  ``None``: issued alone."""
    tag: int
    peer: int
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0
    mb: int = -1
    batch: Optional[int] = None


@dataclass(frozen=True, slots=True)
class RecvStart:
    """Start receiving into ``buf`` from global rank ``peer`` (see SendStart).
    ``buf`` must not be touched until ``Wait(tag)``."""
    tag: int
    peer: int
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0
    mb: int = -1
    batch: Optional[int] = None


@dataclass(frozen=True, slots=True)
class BroadcastStart:
    """Collective over ``ranks`` (sorted global ranks, same tag on all): the
    root's ``buf`` is copied into every member's ``buf``."""
    tag: int
    root: int
    ranks: Tuple[int, ...]
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0


@dataclass(frozen=True, slots=True)
class ReduceStart:
    """Collective over ``ranks``: the root's ``buf`` becomes the sum of all
    members' ``buf`` (root included).  Non-root buffers are empty afterwards."""
    tag: int
    root: int
    ranks: Tuple[int, ...]
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0


@dataclass(frozen=True, slots=True)
class AllReduceStart:
    """Collective over ``ranks``: every member's ``buf`` becomes the sum of all
    members' ``buf``.  Used for a shard held by one rank per group (its
    ``Plan.replicas``): each holder's buffer carries its group's gradient and
    ends with every group's, which each holder then accumulates into ``main``."""
    tag: int
    ranks: Tuple[int, ...]
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0


@dataclass(frozen=True, slots=True)
class AllGatherStart:
    """Collective over ``ranks``, the holders of a shard kept in slices (``Plan.ownership`` "spread"):
    every member's ``buf`` becomes the whole shard in the compute dtype, gathered from every member's
    master slice (member k of the sorted ``ranks`` holds slice k)."""
    tag: int
    ranks: Tuple[int, ...]
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0


@dataclass(frozen=True, slots=True)
class ReduceScatterStart:
    """Collective over ``ranks``, the holders of a shard kept in slices: the members' ``buf`` (partial
    gradients of the whole shard) are summed and each member's ``buf`` ends holding its own slice of the
    sum (member k: slice k), which ``AccumulateToOwner`` then adds into its slice of ``main``; nothing
    else may use that buffer before it is zeroed again."""
    tag: int
    ranks: Tuple[int, ...]
    buf: str
    kind: str
    shard: int
    link: str
    size: float = 1.0


@dataclass(frozen=True, slots=True)
class ReplicatedAllReduceStart:
    """All-reduce (sum) of the replicated parameters' gradients over ``ranks`` (``mode`` "sum"), or one half of it
    where the replicated parts' optimizer is sharded over the ranks (``mode`` "scatter": their gradients
    reduce-scattered, each rank keeping its slice of the sum, which it steps; ``mode`` "gather": at the next
    iteration's start, the weights all-gathered in the compute dtype from every rank's stepped slice, before the
    first compute that reads them).

    ``part``: ``"all"`` (embedding, final norm, output layer); ``"head"`` -- what
    only the last shard's backward writes (final norm, untied output layer), final
    once the rank's last backward of the last shard ran; ``"embedding"`` -- what
    shard 0's backward writes (embedding, and a tied output layer, which is the
    embedding's weight), final after the rank's last backward of shard 0.  A plan
    all-reduces either ``"all"`` or both other parts before its step.

    ``node_size``: 0 for one all-reduce over ``ranks``; G > 1 for a hierarchical one over nodes of G
    consecutive members: a reduce-scatter inside each node, an all-reduce of member j's 1/G over the
    j-th members of every node, an all-gather inside the node -- each node's link then carries
    2(D-1)/D of the gradients (D nodes) instead of a ring's 2(P-1)/P. With ``mode`` "scatter" the first two
    stages are reduce-scatters (inside the node, then over the j-th members), with "gather" the two all-gathers
    in the reverse order; rank r = n G + j (node n, member j) then holds slice j D + n of the P slices."""
    tag: int
    ranks: Tuple[int, ...]
    part: str = "all"
    node_size: int = 0
    mode: str = "sum"


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until the operation started with ``tag`` on this rank completed."""
    tag: int


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """One optimizer step on the rank's owned shard(s) and replicated parts."""


@dataclass(frozen=True, slots=True)
class MemberCollectiveStart:
    """A collective of the context-parallel members of one virtual rank (``ranks``: their GPUs in a per-GPU plan,
    :func:`megatron_tawpipe.plan.context_parallel.lanes`): ``op`` (a member point's: compute, gather, scatter,
    replicated, sum) for ``shard`` (-1: none), always followed by its ``Wait`` (the runtime issues these
    synchronously). Only per-GPU plans hold it, which only the NCCL model runs: not among
    :data:`ACTION_TYPES`."""
    tag: int
    ranks: Tuple[int, ...]
    op: str
    shard: int = -1


# Buffer fields with a fixed role, per action type; communication actions take
# the role from their kind (``COMM_BUFFER``).
BUFFER_ROLES = {
    Forward: (("wbuf", "weight"),), BackwardInput: (("wbuf", "weight"),),
    Backward: (("wbuf", "weight"), ("gbuf", "grad")),
    BackwardWeight: (("wbuf", "weight"), ("gbuf", "grad")),
    LoadWeights: (("buf", "weight"),), ZeroGrad: (("buf", "grad"),),
    AccumulateToOwner: (("buf", "grad"),),
}
COMM_BUFFER = (SendStart, RecvStart, BroadcastStart, ReduceStart, AllReduceStart, AllGatherStart,
               ReduceScatterStart)


def buffer_roles(action):
    """``(field, role)`` pairs of ``action``'s buffers; role is "weight" or "grad"
    (communication of activations has no buffer)."""
    roles = BUFFER_ROLES.get(type(action))
    if roles is None and type(action) in COMM_BUFFER and action.kind in ("weight", "grad"):
        roles = (("buf", action.kind),)
    return roles or ()


ACTION_TYPES = (Forward, Backward, BackwardInput, BackwardWeight, LoadWeights, ZeroGrad,
                AccumulateToOwner, SendStart, RecvStart, BroadcastStart, ReduceStart,
                AllReduceStart, AllGatherStart, ReduceScatterStart, ReplicatedAllReduceStart, Wait,
                OptimizerStep)
BY_NAME = {cls.__name__: cls for cls in ACTION_TYPES}
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
P2P = (SendStart, RecvStart)
COLLECTIVE = (BroadcastStart, ReduceStart, AllReduceStart, AllGatherStart, ReduceScatterStart,
              ReplicatedAllReduceStart)
#: Collectives over the holders of a shard kept in slices (``Plan.ownership`` "spread"): rings without a root.
SLICE_COLLECTIVES = (AllGatherStart, ReduceScatterStart)
STARTS = P2P + COLLECTIVE
FIELD_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in ACTION_TYPES}


def action_to_dict(action) -> dict:
    d = {"op": type(action).__name__}
    for name in FIELD_NAMES[type(action)]:
        value = getattr(action, name)
        d[name] = list(value) if isinstance(value, tuple) else value
    return d


def action_from_dict(d: dict):
    """Inverse of ``action_to_dict``; also accepts the all-string values of a
    CSV row (empty cells of non-text fields count as absent)."""
    try:
        cls = BY_NAME[d["op"]]
    except KeyError:
        raise ValueError(f"unknown action {d.get('op')!r}") from None
    kwargs = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        value = d[f.name]
        if f.type == "str":
            kwargs[f.name] = "" if value is None else str(value)
            continue
        if value is None or value == "":
            continue
        if f.name == "ranks":
            value = tuple(int(x) for x in (value.split() if isinstance(value, str) else value))
        elif f.type == "float":
            value = float(value)
        elif f.type in ("int", "Optional[int]"):
            value = int(value)
        kwargs[f.name] = value
    return cls(**kwargs)


_KIND_LETTER = {"weight": "w", "grad": "g", "act": "a", "actgrad": "d"}


def short(action, starts=None) -> str:
    """A compact code for grids: F3.1 = forward mb 3 shard 1, sw5>2 = send
    weights of shard 5 to rank 2, ... ``starts`` maps tags to start actions so
    that waits can say what they wait for."""
    t = type(action)
    if t is Forward:
        return f"F{action.mb}.{action.shard}"
    if t is Backward:
        return f"B{action.mb}.{action.shard}"
    if t is BackwardInput:
        return f"Bi{action.mb}.{action.shard}"
    if t is BackwardWeight:
        return f"Bw{action.mb}.{action.shard}"
    if t is LoadWeights:
        return f"ld{action.shard}"
    if t is ZeroGrad:
        return f"z{action.shard}"
    if t is AccumulateToOwner:
        return f"acc{action.shard}"
    if t is SendStart:
        return f"s{_KIND_LETTER[action.kind]}{action.shard}>{action.peer}"
    if t is RecvStart:
        return f"r{_KIND_LETTER[action.kind]}{action.shard}<{action.peer}"
    if t is BroadcastStart:
        return f"bc{action.shard}@{action.root}"
    if t is ReduceStart:
        return f"rd{action.shard}@{action.root}"
    if t is AllReduceStart:
        return f"ar{action.shard}"
    if t is AllGatherStart:
        return f"ag{action.shard}"
    if t is ReduceScatterStart:
        return f"rs{action.shard}"
    if t is ReplicatedAllReduceStart:
        code = {"sum": "ar", "scatter": "rs", "gather": "ag"}.get(action.mode, action.mode)
        return code if action.part == "all" else f"{code}:{action.part}"
    if t is Wait:
        if starts is not None and action.tag in starts:
            return "w(" + short(starts[action.tag]) + ")"
        return f"w#{action.tag}"
    if t is OptimizerStep:
        return "opt"
    return t.__name__


def describe(action) -> str:
    """Full, unambiguous text of an action, used in error messages."""
    t = type(action)
    names = FIELD_NAMES.get(t) or tuple(f.name for f in fields(t))   # (an action of a derived plan too)
    args = ", ".join(f"{n}={getattr(action, n)!r}" for n in names)
    return f"{t.__name__}({args})"
