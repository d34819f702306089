"""Run a plan's communication on gloo the way NCCL would: an executor mode for CPU tests.

gloo matches messages by tag and lets each progress on its own, so a plan that
would hang on a GPU cluster can run on gloo.  This transport gives gloo NCCL's
rules (the ones :mod:`plan.nccl` models in its ``"group"`` arrangement, which is
how :class:`runtime.transport.DirectTransport` drives NCCL):

* one worker thread per process group (one FIFO per rank and communicator)
  takes the rank's operations on that group in issue order; an entry (one
  operation, or one ``batch``) must finish before the next one starts, and the
  operations of a batch progress together;
* a send or receive first exchanges a small header with its peer, matched by
  its position among the operations between the two ranks (NCCL ignores tags),
  and moves data only once the peer's partner runs: the rendezvous a large
  NCCL transfer has.  A header naming another operation is reported at once as
  the pairing NCCL would silently make;
* a collective first all-gathers its members' tags: it runs only when every
  member reached it, and all members must be at the same one.

A plan or executor change that would hang on NCCL hangs here too, and the
plan's ``Wait`` then fails after the executor's timeout naming this rank, the
step and what holds its FIFO.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.distributed import groups
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import describe_fifo, process_group
from megatron_tawpipe.runtime.node_reduce import SHARDED_KINDS, alone, replicated_works
from megatron_tawpipe.runtime.transport import SLICE_KINDS, Op, slice_collective

_SEND, _RECV = 0, 1


class _Handle:
    def __init__(self, op: Op, worker: "_Worker"):
        self.op, self.worker = op, worker
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self.done.set()

    def wait(self, timeout: datetime.timedelta) -> None:
        if not self.done.wait(timeout.total_seconds()):
            raise RuntimeError(f"not complete after {int(timeout.total_seconds())} s under NCCL's "
                               f"ordering rules; {self.worker.status()}")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error


class _Worker:
    """One FIFO: the rank's operations on one process group, strictly in issue order."""

    def __init__(self, transport: "FaithfulTransport", key: tuple):
        self.transport, self.key = transport, key
        self.queue: "queue.Queue[Optional[List[_Handle]]]" = queue.Queue()
        self.head: Optional[List[_Handle]] = None
        self.broken: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"nccl-faithful {describe_fifo(key)}")
        self.thread.start()

    def status(self) -> str:
        head = self.head
        if not head:
            return f"the {describe_fifo(self.key)} FIFO of rank {self.transport.rank} is empty"
        ops = ", ".join(f"step {h.op.step} {A.describe(h.op.action)}" for h in head)
        return (f"rank {self.transport.rank}'s FIFO on the {describe_fifo(self.key)} is held by "
                f"{ops}, whose partner has not reached the head of its rank's FIFO")

    def _loop(self) -> None:
        while True:
            entry = self.queue.get()
            if entry is None:
                return
            self.head = entry
            if self.broken is not None:
                for h in entry:
                    h.finish(self.broken)
                continue
            if len(entry) == 1:
                self._run(entry[0])
            else:   # an NCCL group: its operations progress together
                threads = [threading.Thread(target=self._run, args=(h,), daemon=True) for h in entry]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            self.head = None

    def _run(self, handle: _Handle) -> None:
        try:
            self.transport.execute(handle.op)
        except BaseException as exc:  # noqa: BLE001 - reported through the handle
            self.broken = exc
            handle.finish(exc)
            return
        handle.finish()


class FaithfulTransport:
    """Issue operations on gloo under NCCL's ordering rules (see the module docstring)."""

    def __init__(self, rank: int, communicators, timeout: datetime.timedelta, plan_rank: Optional[int] = None):
        self.rank, self.comms, self.timeout = rank, communicators, timeout
        self.plan_rank = rank if plan_rank is None else plan_rank   # the rank the plan's actions name
        self.workers: Dict[tuple, _Worker] = {}
        self.sequence: Dict[Tuple[tuple, int, int], int] = {}
        # Headers travel on groups of their own, so their tags never meet the data's.
        self.control = {key: groups.new_group() for key in communicators.groups if key[0] == "p2p"} \
            if dist.get_world_size() > 1 else {}

    def issue(self, ops: List[Op]) -> Dict[int, _Handle]:
        key = process_group(ops[0].action, self.plan_rank)
        worker = self.workers.get(key)
        if worker is None:
            worker = self.workers[key] = _Worker(self, key)
        handles = []
        for op in ops:
            if op.kind in ("send", "recv"):
                src, dst = (self.rank, op.peer) if op.kind == "send" else (op.peer, self.rank)
                k = self.sequence.get((key, src, dst), 0)
                self.sequence[(key, src, dst)] = k + 1
                op.header_tag = 2 * k + (0 if src < dst else 1)
            handles.append(_Handle(op, worker))
        worker.queue.put(handles)
        return {h.op.tag: h for h in handles}

    # ---- one operation, on its worker thread --------------------------------------------

    def execute(self, op: Op) -> None:
        if op.kind in ("send", "recv"):
            self._point_to_point(op)
        else:
            self._collective(op)

    def _wait(self, work) -> None:
        work.wait(timeout=self.timeout)

    def _point_to_point(self, op: Op) -> None:
        key = process_group(op.action, self.plan_rank)
        count = op.tensors[0].numel()
        mine = torch.tensor([op.tag, _SEND if op.kind == "send" else _RECV, op.step, count], dtype=torch.int64)
        theirs = torch.empty(4, dtype=torch.int64)
        control = self.control[key]
        out = dist.isend(mine, op.peer, group=control, tag=op.header_tag)
        got = dist.irecv(theirs, op.peer, group=control, tag=op.header_tag)
        self._wait(out)
        self._wait(got)
        tag, kind, step, their_count = (int(x) for x in theirs)
        if tag != op.tag or kind == int(mine[1]):
            raise RuntimeError(
                f"NCCL would pair rank {self.rank} step {op.step} ({A.describe(op.action)}) with rank "
                f"{op.peer} step {step} (tag {tag}, a {'send' if kind == _SEND else 'receive'}): they "
                f"are at the same position between these ranks on the {describe_fifo(key)}")
        if their_count != count:
            raise RuntimeError(
                f"rank {self.rank} step {op.step} ({A.describe(op.action)}) has {count} elements and its partner "
                f"on rank {op.peer} (step {step}) {their_count}: NCCL would hang or truncate")
        fn = dist.isend if op.kind == "send" else dist.irecv
        self._wait(fn(op.tensors[0], op.peer, group=op.group, tag=op.tag))

    def _collective(self, op: Op) -> None:
        if op.group is None or len(op.ranks) <= 1:
            if op.kind in SLICE_KINDS:   # one holder: its slice is the whole
                op.tensors[0].copy_(op.tensors[1])
            alone(op.kind, op.tensors)
            return
        count = sum(t.numel() for t in op.tensors)
        mine = torch.tensor([op.tag, op.step, count], dtype=torch.int64)
        every = [torch.empty(3, dtype=torch.int64) for _ in op.ranks]
        self._wait(dist.all_gather(every, mine, group=op.group, async_op=True))
        for member, header in zip(op.ranks, every):
            if int(header[0]) != op.tag:
                raise RuntimeError(
                    f"collective order differs: rank {self.rank} step {op.step} runs "
                    f"{A.describe(op.action)} while rank {member} runs tag {int(header[0])} "
                    f"(its step {int(header[1])}) on the {describe_fifo(process_group(op.action, self.plan_rank))}")
            if int(header[2]) != count:
                raise RuntimeError(
                    f"rank {self.rank} step {op.step} ({A.describe(op.action)}) has {count} elements and rank "
                    f"{member} {int(header[2])}: NCCL would hang or truncate")
        if op.subgroups or op.kind in SHARDED_KINDS.values():   # the replicated collectives, their stages in order
            for work in replicated_works(op.kind, op.tensors, op.group, op.subgroups, op.action.node_size, self._wait):
                self._wait(work)
        elif op.kind in SLICE_KINDS:
            self._wait(slice_collective(op))
        elif op.kind == "broadcast":
            self._wait(dist.broadcast(op.tensors[0], src=op.peer, group=op.group, async_op=True))
        elif op.kind == "reduce":
            self._wait(dist.reduce(op.tensors[0], dst=op.peer, op=dist.ReduceOp.SUM, group=op.group,
                                   async_op=True))
        else:
            for t in op.tensors:
                self._wait(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=op.group, async_op=True))

    def close(self) -> None:
        for worker in self.workers.values():
            worker.queue.put(None)
