"""The replicated gradients' all-reduce through the nodes (``ReplicatedAllReduceStart.node_size`` > 1), and the
collectives of a sharded replicated optimizer (:func:`replicated_works`).

Each tensor, viewed flat and zero-padded to a multiple of the node size G, is reduce-scattered inside the node
(member j keeps the node's sum of part j), part j is all-reduced over the j-th members of every node, and the
node all-gathers the parts back into the tensor. A node's link then carries 2(D-1)/D of the gradients over D
nodes, the least any all-reduce moves; a ring over every rank carries 2(P-1)/P.

The three stages of a tensor follow each other. On CUDA (:class:`SideStream`) they are issued on a stream of
their own, which first waits for the compute stream (the gradients are written) and then for each stage before
the next; the compute stream waits only where the plan waits for the collective, so compute between the start
and that wait runs while the slow cross-node stage is on the link, and the host goes on throughout. On a
host-blocking backend (gloo) one thread per transport runs the stages, the operations in the order they were
issued, so every rank's node and cross groups see the same sequence.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

def all_gather_into(output: torch.Tensor, source: torch.Tensor, **kwargs):
    """torch.distributed's all-gather into one tensor (``all_gather_single`` from torch 2.13, whose older name
    warns there; ``all_gather_into_tensor`` before), looked up at each call as the byte counter wraps it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, source, **kwargs)


def reduce_scatter_from(output: torch.Tensor, source: torch.Tensor, **kwargs):
    """The reduce-scatter from one tensor (``reduce_scatter_single`` / ``reduce_scatter_tensor``), the same way."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, source, **kwargs)


def reduce_through_nodes(tensors: List[torch.Tensor], node_group, cross_group, node_size: int,
                         wait: Callable[[object], None]) -> list:
    """Sum ``tensors`` over every rank through the nodes, in place. ``wait(work)`` orders what follows after
    ``work`` (blocking the host or a stream); returns the works of the last stage not yet waited for."""
    pending = []
    for tensor in tensors:
        flat = tensor.view(-1)
        numel = flat.numel()
        part_numel = -(-numel // node_size)
        padded = part_numel * node_size != numel
        whole = torch.cat([flat, flat.new_zeros(part_numel * node_size - numel)]) if padded else flat
        part = flat.new_empty(part_numel)
        wait(reduce_scatter_from(part, whole, op=dist.ReduceOp.SUM, group=node_group, async_op=True))
        wait(dist.all_reduce(part, op=dist.ReduceOp.SUM, group=cross_group, async_op=True))
        work = all_gather_into(whole, part, group=node_group, async_op=True)
        if padded:
            wait(work)
            flat.copy_(whole[:numel])
        else:
            pending.append(work)
    return pending


#: The transport's kinds of the replicated collectives besides the all-reduce ("allreduce"): a sharded replicated
#: optimizer's halves (``ReplicatedAllReduceStart.mode`` "scatter" and "gather"); their tensors are pairs,
#: ``[output, input, output, input, ...]``.
SHARDED_KINDS = {"scatter": "replicated-scatter", "gather": "replicated-gather"}


def scatter_through_nodes(pairs, node_group, cross_group, node_size: int, wait: Callable[[object], None]) -> list:
    """Reduce-scatter each ``(slice, whole)`` pair through the nodes: inside the node (member j keeps chunk j of the
    node's sum), then over the j-th members (node n keeps piece n of it)."""
    pending = []
    for out, whole in pairs:
        part = whole.new_empty(whole.numel() // node_size)
        wait(reduce_scatter_from(part, whole, op=dist.ReduceOp.SUM, group=node_group, async_op=True))
        pending.append(reduce_scatter_from(out, part, op=dist.ReduceOp.SUM, group=cross_group, async_op=True))
    return pending


def gather_through_nodes(pairs, node_group, cross_group, node_size: int, wait: Callable[[object], None]) -> list:
    """All-gather each ``(whole, slice)`` pair through the nodes: over the j-th members, then inside the node (the
    reverse of :func:`scatter_through_nodes`, so every rank's slice lands where that function took it from)."""
    pending = []
    for whole, mine in pairs:
        part = whole.new_empty(whole.numel() // node_size)
        wait(all_gather_into(part, mine, group=cross_group, async_op=True))
        pending.append(all_gather_into(whole, part, group=node_group, async_op=True))
    return pending


def replicated_works(kind: str, tensors: List[torch.Tensor], group, subgroups: tuple, node_size: int,
                     wait: Callable[[object], None]) -> list:
    """Start one of the replicated collectives (``kind``: "allreduce" or one of :data:`SHARDED_KINDS`), through
    the nodes where ``subgroups`` (node group, cross group) are given; returns the works not yet waited for."""
    if kind == "allreduce":
        if subgroups:
            return reduce_through_nodes(tensors, *subgroups, node_size, wait)
        return [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in tensors]
    pairs = list(zip(tensors[::2], tensors[1::2]))
    if kind == SHARDED_KINDS["scatter"]:
        if subgroups:
            return scatter_through_nodes(pairs, *subgroups, node_size, wait)
        return [reduce_scatter_from(out, whole, op=dist.ReduceOp.SUM, group=group, async_op=True)
                for out, whole in pairs]
    if subgroups:
        return gather_through_nodes(pairs, *subgroups, node_size, wait)
    return [all_gather_into(whole, mine, group=group, async_op=True) for whole, mine in pairs]


def alone(kind: str, tensors: List[torch.Tensor]) -> None:
    """A replicated collective over one rank: a sharded optimizer's slice is the whole."""
    if kind in SHARDED_KINDS.values():
        for output, source in zip(tensors[::2], tensors[1::2]):
            output.copy_(source)


class SideStream:
    """The CUDA stream the stages of a collective through the nodes are issued on (one per transport, made on
    first use), so that waiting for one stage before issuing the next orders that stream, not the compute
    stream: were the stages issued on the compute stream, every kernel after the start would wait for the
    cross-node stage."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = None

    def run(self, start: Callable[[Callable[[object], None]], list], tensors=()) -> list:
        """``start(wait)`` issued on the side stream after it waits for the compute stream; returns one handle
        whose ``wait()`` makes the (then) current stream wait for every stage and for the copies between them
        (it keeps ``tensors``, the collective's, referenced until then: the side stream reads and writes them)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for work in start(lambda work: work.wait()):   # wait(): the side stream waits, the host goes on
                work.wait()
            done = torch.cuda.Event()
            done.record(side)
        return [_StreamDone(done, self.device, tensors)]


class _StreamDone:
    """The end of what a :class:`SideStream` issued: ``wait()`` orders the current stream after it."""

    def __init__(self, event, device: torch.device, tensors=()):
        self.event, self.device, self.tensors = event, device, list(tensors)

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        self.tensors = []
        return True


class _Pending:
    """Handle of one reduction queued on a :class:`NodeReducer`."""

    def __init__(self, describe: str):
        self.describe = describe
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self, timeout: datetime.timedelta) -> None:
        if not self.done.wait(timeout.total_seconds()):
            raise RuntimeError(f"{self.describe}: not complete after {int(timeout.total_seconds())} s")
        if self.error is not None:
            raise RuntimeError(f"{self.describe}: {self.error}") from self.error


class NodeReducer:
    """One thread that runs hierarchical reductions one after another on a host-blocking backend."""

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="replicated reduction")
        self._thread.start()

    def submit(self, tensors, node_group, cross_group, node_size: int, describe: str) -> _Pending:
        """The all-reduce of ``tensors`` through the nodes."""
        return self.submit_call(lambda wait: reduce_through_nodes(tensors, node_group, cross_group, node_size, wait),
                                describe)

    def submit_call(self, start: Callable[[Callable[[object], None]], list], describe: str) -> _Pending:
        """Queue ``start(wait)``, which issues a collective's stages (``wait(work)`` between them) and returns the
        works of its last stage: the handle is done once those are."""
        handle = _Pending(describe)
        self._queue.put((handle, start))
        return handle

    def _loop(self) -> None:
        broken: Optional[BaseException] = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, start = item
            if broken is None:
                try:
                    for work in start(lambda work: work.wait()):
                        work.wait()   # the last stage's: done before the handle says so
                except BaseException as exc:  # noqa: BLE001 - reported through the handle
                    broken = exc
            handle.error = broken
            handle.done.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread once what was queued ran (a reduction stuck on a dead peer is left to the process
        group's timeout: the thread is a daemon)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
