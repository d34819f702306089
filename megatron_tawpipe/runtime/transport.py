"""How the executor's communication reaches torch.distributed.

The executor turns each start action (or each ``batch`` of them) into
:class:`Op` descriptions and hands them to a transport, which returns one
handle per operation; ``handle.wait(timeout)`` is what a plan ``Wait`` does.

* :class:`DirectTransport` issues the operations at once: ``isend``/``irecv``
  and asynchronous collectives on gloo; on NCCL every send/receive goes
  through ``batch_isend_irecv`` (a batch of one included), so it runs on the
  process group's communicator -- created up front by :class:`Communicators`
  -- and never creates a pair communicator in the middle of a plan.  On CUDA a
  wait orders the current stream after the communication and returns: the
  host does not block (dead or stalled peers are reported by the process
  group's timeout and watchdog, and by the progress board).
* :class:`runtime.nccl_faithful.FaithfulTransport` runs the same operations on
  gloo under NCCL's ordering rules (see there).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.distributed import groups
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import DIRECTIONS, process_group
from megatron_tawpipe.runtime.node_reduce import (SHARDED_KINDS, NodeReducer, SideStream, all_gather_into, alone,
                                                  reduce_scatter_from, replicated_works)


@dataclass
class Op:
    """One communication operation of one rank, ready to issue."""
    tag: int
    action: object
    step: int
    kind: str                     # "send", "recv", "broadcast", "reduce", "allreduce", "allgather", "reducescatter"
    tensors: List[torch.Tensor]   # allgather / reducescatter: [output, input]
    group: Optional[dist.ProcessGroup]
    peer: int = -1                # send/recv: the other rank; broadcast/reduce: the root
    ranks: Tuple[int, ...] = field(default_factory=tuple)
    header_tag: int = -1          # NCCL-faithful mode: position among the pair's operations
    subgroups: tuple = ()         # a replicated all-reduce through the nodes: (node group, cross group)


class Communicators:
    """Process groups a plan needs, created collectively and in the same order on every rank.

    One group per point-to-point channel (weights, gradients), one per
    (members, channel) of broadcasts and reductions (and of the holders'
    all-reduce of a replicated first shard), and one for the replicated
    all-reduce -- the arrangement :mod:`plan.nccl` models.  On NCCL
    every group's communicator is created here, by one small all-reduce per
    group in that order, so that no communicator is created lazily inside a
    plan (a first use blocks until all members make it).

    With tensor and/or context parallelism inside the weight pipeline (``stride``
    S = T x C > 1) the plan's ranks are *virtual* ranks, one per group of S
    consecutive GPUs (megatron-core's order: tensor-parallel rank t fastest, then
    context-parallel rank c): virtual rank ``v`` is the S global ranks ``v * S + j``.
    The GPU of index ``j = c * T + t`` talks only to index ``j`` of other virtual
    ranks, so every group above exists once per index ``j`` (its members
    ``v * S + j``), and each rank keeps the set of its own index: S independent
    copies of the plan's communication (each moves 1/T of every shard, and of that
    the context-parallel piece c: :mod:`runtime.context_parallel`)."""

    def __init__(self, plans, world_size: int, stride: int = 1, index: int = 0):
        plans = plans if isinstance(plans, (list, tuple)) else [plans]   # one plan, or each a run may switch to
        self.stride, self.index = stride, index
        everyone = tuple(range(world_size))
        members = {("p2p", channel, way): everyone for channel in ("weight", "grad") for way in DIRECTIONS}
        members.update({("collective", tuple(ranks), channel): tuple(ranks)
                        for plan in plans for ranks, channel in plan.communicators() if channel != "replicated"})
        members[("replicated", everyone)] = everyone
        for plan in plans:   # the groups of a replicated all-reduce through the nodes
            members.update({("replicated", ranks): ranks for ranks in node_reduce_groups(plan)})
        physical_world = world_size * stride
        self.groups: Dict[tuple, Optional[dist.ProcessGroup]] = {}
        mine: Dict[tuple, Tuple[int, ...]] = {}
        for j in range(stride):   # every rank creates every index's groups, in one order
            for key, ranks in members.items():
                physical = [v * stride + j for v in ranks]
                group = groups.new_group(physical) if physical_world > 1 else None
                if j == index:
                    self.groups[key], mine[key] = group, tuple(physical)
        if physical_world > 1 and dist.get_backend() == "nccl":
            self._create_nccl_communicators(mine)

    def physical(self, rank: int) -> int:
        """The global rank of virtual rank ``rank`` at this rank's index."""
        return rank * self.stride + self.index

    def _create_nccl_communicators(self, members: Dict[tuple, Tuple[int, ...]]) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        me = dist.get_rank()
        for key, group in self.groups.items():
            if me in members[key]:
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    def for_action(self, action, rank: int) -> Optional[dist.ProcessGroup]:
        """The process group of ``action`` of (plan) rank ``rank``."""
        return self.groups[process_group(action, rank)]

    def subgroups(self, action, rank: int) -> tuple:
        """A replicated all-reduce through the nodes: ``rank``'s node group and cross group; else ()."""
        size = getattr(action, "node_size", 0) if type(action) is A.ReplicatedAllReduceStart else 0
        if size <= 1:
            return ()
        i = action.ranks.index(rank)
        node = action.ranks[i - i % size:i - i % size + size]
        return self.groups[("replicated", node)], self.groups[("replicated", action.ranks[i % size::size])]


def node_reduce_groups(plan) -> List[Tuple[int, ...]]:
    """The node groups and cross groups of ``plan``'s replicated all-reduces through the nodes."""
    out: Dict[Tuple[int, ...], None] = {}
    for a in plan.actions[0] if plan.actions else ():
        if type(a) is A.ReplicatedAllReduceStart and a.node_size > 1:
            size = a.node_size
            out.update({a.ranks[i:i + size]: None for i in range(0, len(a.ranks), size)})
            out.update({a.ranks[j::size]: None for j in range(size)})
    return list(out)


class _Done:
    """Handle of an operation with nothing to wait for (one-rank groups)."""

    def wait(self, timeout: datetime.timedelta) -> None:
        return None


class _Works:
    """Handle over one or more torch work objects."""

    def __init__(self, works, host_blocking: bool):
        self.works = [w for w in works if w is not None]
        self.host_blocking = host_blocking

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self.works:
            if self.host_blocking:
                work.wait(timeout=timeout)
            else:
                work.wait()   # CUDA: the current stream waits, the host goes on


class DirectTransport:
    """Issue operations at once on the backend (gloo, or NCCL with batched P2P)."""

    def __init__(self, device: torch.device):
        self.nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self.host_blocking = device.type != "cuda"
        self._node_reducer: Optional[NodeReducer] = None   # host-blocking: the stages run on its thread
        # CUDA: the stages are issued on it (its stream made at the first such collective)
        self._side_stream = None if self.host_blocking else SideStream(device)

    def issue(self, ops: List[Op]) -> Dict[int, object]:
        handles: Dict[int, object] = {}
        p2p = [op for op in ops if op.kind in ("send", "recv")]
        if p2p and self.nccl:
            p2p_ops = [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensors[0],
                                  op.peer, group=op.group, tag=op.tag) for op in p2p]
            works = dist.batch_isend_irecv(p2p_ops)
            # One work for the whole group, or one per op, depending on the torch version.
            for op in p2p:
                handles[op.tag] = _Works(works, self.host_blocking)
        else:
            for op in p2p:
                fn = dist.isend if op.kind == "send" else dist.irecv
                work = fn(op.tensors[0], op.peer, group=op.group, tag=op.tag)
                handles[op.tag] = _Works([work], self.host_blocking)
        for op in ops:
            if op.kind in ("send", "recv"):
                continue
            handles[op.tag] = self._collective(op)
        return handles

    def _collective(self, op: Op):
        if op.group is None or len(op.ranks) <= 1:
            if op.kind in SLICE_KINDS:   # one holder: its slice is the whole
                op.tensors[0].copy_(op.tensors[1])
            alone(op.kind, op.tensors)
            return _Done()
        if op.subgroups:
            def start(wait, op=op):
                return replicated_works(op.kind, op.tensors, op.group, op.subgroups, op.action.node_size, wait)
            if not self.host_blocking:   # CUDA: the stages ordered on a stream of their own
                return _Works(self._side_stream.run(start, op.tensors), False)
            if self._node_reducer is None:
                self._node_reducer = NodeReducer()
            return self._node_reducer.submit_call(start, describe_op(op.action, -1))
        if op.kind in SHARDED_KINDS.values():
            works = replicated_works(op.kind, op.tensors, op.group, (), 0, None)
        elif op.kind in SLICE_KINDS:
            works = [slice_collective(op)]
        elif op.kind == "broadcast":
            works = [dist.broadcast(op.tensors[0], src=op.peer, group=op.group, async_op=True)]
        elif op.kind == "reduce":
            works = [dist.reduce(op.tensors[0], dst=op.peer, op=dist.ReduceOp.SUM, group=op.group,
                                 async_op=True)]
        else:  # replicated all-reduce: one per gradient tensor, no concatenated copy
            works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=op.group, async_op=True)
                     for t in op.tensors]
        return _Works(works, self.host_blocking)

    def close(self) -> None:
        if self._node_reducer is not None:
            self._node_reducer.close()


#: The collectives over a shard's slice holders: output and input tensors of different lengths.
SLICE_KINDS = ("allgather", "reducescatter")


def slice_collective(op: Op):
    """Start ``op``, an all-gather (each member's slice, ``tensors[1]``, into the whole ``tensors[0]``) or a
    reduce-scatter (the sum of the members' whole ``tensors[1]``, member k keeping slice k in ``tensors[0]``)."""
    output, source = op.tensors
    if op.kind == "allgather":
        return all_gather_into(output, source, group=op.group, async_op=True)
    return reduce_scatter_from(output, source, op=dist.ReduceOp.SUM, group=op.group, async_op=True)


def describe_op(action, rank: int, physical=lambda r: r) -> str:
    """What a communication action waits for, naming the peer ranks it depends on (as global ranks:
    ``physical`` maps a plan's virtual rank to this tensor-parallel index's global rank)."""
    what = f"{getattr(action, 'kind', '')} shard {getattr(action, 'shard', '')}".strip()
    if isinstance(action, A.SendStart):
        peer = physical(action.peer)
        return f"send of {what} to rank {peer} (rank {peer} stopped, stalled or is unreachable)"
    if isinstance(action, A.RecvStart):
        peer = physical(action.peer)
        return f"receive of {what} from rank {peer} (rank {peer} stopped, stalled or is unreachable)"
    ranks = [physical(r) for r in getattr(action, "ranks", ())]
    if isinstance(action, A.BroadcastStart):
        return f"broadcast of {what} from rank {physical(action.root)} over ranks {ranks}"
    if isinstance(action, A.ReduceStart):
        return f"reduce of {what} to rank {physical(action.root)} over ranks {ranks}"
    if isinstance(action, A.AllReduceStart):
        return f"all-reduce of {what} over its holders, ranks {ranks}"
    if isinstance(action, A.ReplicatedAllReduceStart):
        what = {"scatter": "reduce-scatter of the replicated gradients",
                "gather": "all-gather of the replicated weights"}.get(action.mode, "all-reduce of the replicated gradients")
        return f"{what} over ranks {ranks}"
    if isinstance(action, A.AllGatherStart):
        return f"all-gather of {what} from its slice holders, ranks {ranks}"
    if isinstance(action, A.ReduceScatterStart):
        return f"reduce-scatter of {what} to its slice holders, ranks {ranks}"
    return type(action).__name__
