"""The replicated gradients' all-reduce through the nodes (``ReplicatedAllReduceStart.node_size`` > 1).

Each tensor, viewed flat and zero-padded to a multiple of the node size G, is reduce-scattered inside the node
(member j keeps the node's sum of part j), part j is all-reduced over the j-th members of every node, and the
node all-gathers the parts back into the tensor. A node's link then carries 2(D-1)/D of the gradients over D
nodes, the least any all-reduce moves; a ring over every rank carries 2(P-1)/P.

The three stages of a tensor follow each other. On CUDA each stage's stream waits for the one before and the
host goes on; on a host-blocking backend (gloo) one thread per transport runs the stages, the operations in
the order they were issued, so every rank's node and cross groups see the same sequence.
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
        handle = _Pending(describe)
        self._queue.put((handle, tensors, node_group, cross_group, node_size))
        return handle

    def _loop(self) -> None:
        broken: Optional[BaseException] = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, tensors, node_group, cross_group, node_size = item
            if broken is None:
                try:
                    for work in reduce_through_nodes(tensors, node_group, cross_group, node_size,
                                                     lambda work: work.wait()):
                        work.wait()   # the last stage's all-gathers: done before the handle says so
                except BaseException as exc:  # noqa: BLE001 - reported through the handle
                    broken = exc
            handle.error = broken
            handle.done.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread once what was queued ran (a reduction stuck on a dead peer is left to the process
        group's timeout: the thread is a daemon)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
