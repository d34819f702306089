"""Run one rank's list of plan actions on torch.distributed.

The executor knows nothing about schedules: it interprets the actions of
:mod:`megatron_tawpipe.plan.actions` in order. Communication is asynchronous
and goes through a transport (:mod:`runtime.transport`): the starts of one
``batch`` are issued together as one NCCL group, and every handle is waited
on by the plan's ``Wait`` before its buffer is read or reused (the validator
proves that; the executor also refuses to touch a buffer that is still in
flight). Weight and gradient traffic use separate communicators, so that on
NCCL they do not serialise behind each other. ``nccl_faithful=True`` runs the
communication on gloo under NCCL's ordering rules (:mod:`runtime.nccl_faithful`).

Weight and gradient buffers are allocated once, from the plan's bounds.
Compute time (the busy fraction, timelines) is measured with CUDA events on
CUDA, where kernels are asynchronous, and with the wall clock on CPU.

Bytes are counted per link class as :func:`megatron_tawpipe.plan.traffic.link_bytes` counts them (sends,
non-root broadcast copies and reduction inputs, real tensor sizes).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_tawpipe.monitor import progress
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import entries_of
from megatron_tawpipe.plan.traffic import ring_share
from megatron_tawpipe.runtime.shard_slices import ShardSlice, holder_slice
from megatron_tawpipe.runtime.node_reduce import SHARDED_KINDS
from megatron_tawpipe.runtime.timing import ComputeTimer
from megatron_tawpipe.plan.timeline import (COMPUTE, ISSUE, SPAN_LABELS, ActionRecord, SpanRecord, TransferRecord,
                                            action_label, wait_label)
from megatron_tawpipe.runtime.trace import PlanPosition, arrives_here, resolve_times
from megatron_tawpipe.runtime.transport import Communicators, DirectTransport, Op, describe_op
from megatron_tawpipe.runtime.warmup import connect
from megatron_tawpipe.common.errors import ExecutionError, PeerFailure, first_line

__all__ = ["Communicators", "ExecutionError", "PeerFailure", "PlanExecutor", "first_line"]


@dataclass
class _InFlight:
    work: object
    after: Callable[[], None]
    buf: str
    reads_only: bool
    what: str           # e.g. "receive of weight shard 3 from rank 2", for error messages


def _needed_for_forward(action, in_flight) -> bool:
    if isinstance(action, (A.Forward, A.LoadWeights)):
        return True
    if isinstance(action, A.ReplicatedAllReduceStart):   # a sharded replicated optimizer's weights, stepped
        return action.mode == "gather"
    if isinstance(action, A.Wait):
        return action.tag in in_flight
    return isinstance(action, (A.SendStart, A.RecvStart, A.BroadcastStart, A.AllGatherStart)) and action.kind == "weight"


class PlanExecutor:
    """Holds one rank's buffers and runs its action list once per iteration.

    ``compute`` is the object that does forward/backward work and owns the
    master weights and gradients (see :class:`runtime.trainer.WeightPassingTrainer`):
    it provides ``forward(mb, shard, weights)``, ``backward(mb, shard, weights, grad)`` (and for split
    backwards ``backward_input(mb, shard, weights)``, ``backward_weight(mb, shard, weights, grad)``),
    ``master(shard)``, ``main_grad(shard)``, ``replicated_grads(part="all")`` (a sharded replicated optimizer:
    ``replicated_slices``), ``optimizer_step()`` and ``shard_numel`` (the largest shard's elements: a buffer's),
    ``compute_dtype``, ``device`` (and ``grad_dtype``, the gradient buffers' dtype, where not fp32). With shards of
    different sizes every action on shard ``s`` uses the first ``shard_numel * shard_layers[s] /
    max_layers_per_shard`` elements of its buffer.

    ``rank`` is the plan's rank; with tensor parallelism inside the weight pipeline that is
    a virtual rank, and ``communicators`` maps it and its peers to global ranks.
    """

    def __init__(self, plan, rank: int, compute, communicators: Communicators,
                 timeout: Optional[datetime.timedelta] = None, nccl_faithful: bool = False, transport=None):
        self.plan = plan
        # Bounded waits: a dead or stalled peer becomes an error, never a silent hang.
        self.timeout = timeout or datetime.timedelta(minutes=10)
        self.rank = rank
        # Errors name global ranks (with tensor parallelism the plan's ranks are virtual).
        self.name = (f"rank {communicators.physical(rank)}" if communicators.stride == 1 else
                     f"rank {communicators.physical(rank)} (plan rank {rank})")
        self.compute = compute
        self.comms = communicators
        self.nccl_faithful = nccl_faithful
        if transport is not None:   # another plan's, taken over (its groups and sequence numbers go on)
            self.transport = transport
        elif nccl_faithful:
            from megatron_tawpipe.runtime.nccl_faithful import FaithfulTransport

            self.transport = FaithfulTransport(communicators.physical(rank), communicators, self.timeout,
                                               plan_rank=rank)
        else:
            self.transport = DirectTransport(compute.device)
        self.timer = ComputeTimer(compute.device)
        per_layer, rest = divmod(compute.shard_numel, plan.max_layers_per_shard)
        if rest:
            raise ExecutionError(f"{compute.shard_numel} elements per buffer are not {plan.max_layers_per_shard} layers")
        self._numel = [per_layer * n for n in plan.shard_layers]   # each shard's elements
        # A shard kept in slices (spread layout) is gathered and reduce-scattered as D equal slices over its
        # holders (this rank's among them): its buffers hold the padded length.
        self._slices: Dict[int, ShardSlice] = {
            s: holder_slice(plan, s, rank, self._numel[s]) for s in range(plan.num_shards)
            if plan.spread and rank in plan.holders(s)}
        # With context parallelism (``compute.context_parallel``, :mod:`runtime.context_parallel`) this GPU moves
        # its piece of every transfer: its buffers hold C equal pieces.
        self.cp = getattr(compute, "context_parallel", None)
        if self.cp is not None and self._slices:
            raise ExecutionError("the spread layout (slice holders) does not run with context parallelism")
        whole = self.cp.padded(compute.shard_numel) if self.cp is not None else compute.shard_numel
        self._buffer_numel = max([whole] + [p.members * p.length for p in self._slices.values()])
        self.weight_buffers, self.grad_buffers = self._allocate_buffers(plan.actions[rank])
        self.in_flight: Dict[int, _InFlight] = {}
        self._entries_cache: Optional[Tuple[list, dict]] = None
        self._members: Dict[Tuple[int, str], list] = {}   # the member points of the list running, by (step, when)
        self.trace: Optional[dict] = None   # {"spans": [...], "transfers": [...]} when recording a timeline
        self._posted: Dict[int, Tuple[float, object]] = {}
        # --record-plan-memory: bytes held after each compute action (a callable returning them), the most seen
        self.memory_probe: Optional[Callable[[], Optional[int]]] = None
        self.memory_peak: Optional[int] = None
        self.reset_counters()
        self._handlers = {
            A.Forward: self._forward,
            A.Backward: self._backward,
            A.BackwardInput: self._backward_input,
            A.BackwardWeight: self._backward_weight,
            A.LoadWeights: self._load_weights,
            A.ZeroGrad: self._zero_grad,
            A.AccumulateToOwner: self._accumulate,
            A.SendStart: self._send,
            A.RecvStart: self._recv,
            A.BroadcastStart: self._broadcast,
            A.ReduceStart: self._reduce,
            A.AllReduceStart: self._all_reduce,
            A.AllGatherStart: self._all_gather,
            A.ReduceScatterStart: self._reduce_scatter,
            A.ReplicatedAllReduceStart: self._replicated_all_reduce,
            A.Wait: self._wait,
            A.OptimizerStep: self._optimizer_step,
        }

    # ---- buffers -----------------------------------------------------------------------

    def _allocate_buffers(self, actions) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """Every weight and gradient buffer this rank's list names, allocated once (the plan bounds their number)."""
        names = {"weight": set(), "grad": set()}
        for a in actions:
            for field_name, role in A.buffer_roles(a):
                name = getattr(a, field_name)
                if name != A.MAIN:
                    names[role].add(name)
        c = self.compute
        weights = {n: torch.empty(self._buffer_numel, dtype=c.compute_dtype, device=c.device)
                   for n in sorted(names["weight"])}
        grad_dtype = getattr(c, "grad_dtype", torch.float32)   # the main gradients' (--main-grads-dtype)
        grads = {n: torch.zeros(self._buffer_numel, dtype=grad_dtype, device=c.device) for n in sorted(names["grad"])}
        return weights, grads

    def shard_elements(self, shard: int) -> int:
        """Elements of shard ``shard`` (a prefix of every buffer)."""
        return self._numel[shard]

    def slice_geometry(self, shard: int) -> Tuple[int, int]:
        """``(holders, slice length)`` of ``shard``: (1, its elements) for a shard kept whole."""
        piece = self._slices.get(shard)
        return (1, self._numel[shard]) if piece is None else (piece.members, piece.length)

    def connect(self) -> int:
        """Make every connection the plan uses before its first iteration (:mod:`runtime.warmup`)."""
        return connect(self)

    def _weights(self, name: str, shard: int, write: bool = False) -> torch.Tensor:
        """Weight buffer ``name`` as shard ``shard``'s: its first ``shard``-sized part."""
        self._check_not_in_flight(name, write)
        return self.weight_buffers[name][:self._numel[shard]]

    def _grads(self, name: str, shard: int, write: bool = True) -> torch.Tensor:
        if name == A.MAIN:
            return self.compute.main_grad(shard)
        self._check_not_in_flight(name, write)
        return self.grad_buffers[name][:self._numel[shard]]

    def _buffer(self, name: str, kind: str, shard: int, write: bool) -> torch.Tensor:
        return self._weights(name, shard, write) if kind == "weight" else self._grads(name, shard, write)

    def _check_not_in_flight(self, name: str, write: bool) -> None:
        """Outgoing transfers only read their buffer; anything else in flight forbids all access."""
        for tag, op in self.in_flight.items():
            if op.buf == name and (write or not op.reads_only):
                raise ExecutionError(f"buffer {name} is used while transfer {tag} is in flight")

    def reset_counters(self) -> None:
        self.bytes_sent = {"intra": 0, "inter": 0}
        self.timer.reset()

    @property
    def compute_seconds(self) -> float:
        """Time inside Forward/Backward actions this iteration (busy fraction); on CUDA
        this synchronises once to read the events."""
        return self.timer.total()

    # ---- running ------------------------------------------------------------------------

    def run(self, actions: List[object], forward_only: bool = False) -> None:
        """Execute ``actions``; ``forward_only`` keeps forwards and weight traffic only (evaluation)."""
        self._forward_only = forward_only
        self._entries = self._entries_by_step(actions)
        self._members = self.cp.points(actions, self.rank) if self.cp is not None else {}   # context parallelism's
        board = progress.board()
        for step, action in enumerate(actions):
            if forward_only and not _needed_for_forward(action, self.in_flight):
                continue
            board.at(PlanPosition(step, len(actions), action))
            self._step = step
            if self.trace is not None:
                host = time.time()
                started = self.timer.stamp(host)
            try:
                self._meet(step, "before")
                self._handlers[type(action)](action)
                self._meet(step, "after")
                if self.trace is not None:
                    ended = time.time()
                    self._record(action, started, self.timer.stamp(ended), host, ended)
                if self.memory_probe is not None and type(action) in COMPUTE:
                    held = self.memory_probe()
                    if held is not None:
                        self.memory_peak = held if self.memory_peak is None else max(self.memory_peak, held)
            except PeerFailure as exc:
                raise PeerFailure(f"{self.name}, step {step} of {len(actions)}, {action}: {exc}") from exc
            except ExecutionError as exc:
                raise ExecutionError(f"{self.name}, step {step}, {action}: {exc}") from exc
            except RuntimeError as exc:
                if isinstance(action, A.STARTS):
                    raise PeerFailure(
                        f"{self.name}, step {step} of {len(actions)}, {action}: could not start "
                        f"({describe_op(action, self.rank, self.comms.physical)}): {first_line(exc)}") from exc
                raise
        if self.in_flight:
            raise ExecutionError(f"{self.name}: plan ended with transfers in flight: {sorted(self.in_flight)}")
        if self.trace is not None:
            resolve_times(self.trace)

    def close(self) -> None:
        self.transport.close()

    # ---- timeline ---------------------------------------------------------------------

    def start_trace(self) -> None:
        """Record this rank's actions with wall-clock times (``tools/plot_schedule.py --timeline``)."""
        self.trace = {"rank": self.rank, "spans": [], "transfers": [], "actions": []}
        self._posted = {}
        self._after_s = 0.0

    def _record(self, action, start, end, host_start: float, host_end: float) -> None:
        """``start``/``end``: seconds, or on CUDA stamps of the stream (resolved after the plan);
        ``host_start``/``host_end``: the host's clock around the action (``trace["actions"]``: every
        action's :class:`~megatron_tawpipe.plan.timeline.ActionRecord`, what
        ``tools/tawpipe_lab/idle_breakdown.py`` splits)."""
        label = SPAN_LABELS.get(type(action))
        detail = 0.0
        if label is not None:
            if type(action) in COMPUTE:   # device time
                start, end = self.timer.last_span()
                detail = [start, end]      # the compute span inside the action
            self.trace["spans"].append(SpanRecord(self.rank, start, end, label, getattr(action, "mb", -1),
                                                  getattr(action, "shard", -1)))
        elif isinstance(action, A.STARTS):
            self._posted[action.tag] = (start, action)
            label = ISSUE
        elif isinstance(action, A.Wait) and action.tag in self._posted:
            posted, started = self._posted.pop(action.tag)
            waited = wait_label(self.plan, self.rank, started)
            label, detail = str(waited), self._after_s
            self.trace["transfers"].append(TransferRecord(
                self.rank, "in" if arrives_here(started, self.rank) else "out",
                getattr(started, "kind", "allreduce"), waited.link, posted, end))
        else:
            label = action_label(action)
        self.trace["actions"].append(ActionRecord(self._step, label, host_start, host_end, detail))

    def _start(self, action, work, buf: str, after: Callable[[], None] = lambda: None,
               reads_only: bool = False) -> None:
        self.in_flight[action.tag] = _InFlight(work, after, buf, reads_only,
                                               describe_op(action, self.rank, self.comms.physical))

    def _count(self, link: str, tensor: torch.Tensor, share: float = 1.0) -> None:
        self.bytes_sent[link] += round(share * tensor.numel() * tensor.element_size())

    # ---- compute ------------------------------------------------------------------------

    def _forward(self, a: A.Forward) -> None:
        weights = self._weights(a.wbuf, a.shard)  # reads only
        with self.timer.span():
            self.compute.forward(a.mb, a.shard, weights)

    def _backward(self, a: A.Backward) -> None:
        weights, grads = self._weights(a.wbuf, a.shard), self._grads(a.gbuf, a.shard)
        with self.timer.span():
            self.compute.backward(a.mb, a.shard, weights, grads)

    def _backward_input(self, a: A.BackwardInput) -> None:
        weights = self._weights(a.wbuf, a.shard)
        with self.timer.span():
            self.compute.backward_input(a.mb, a.shard, weights)

    def _backward_weight(self, a: A.BackwardWeight) -> None:
        weights, grads = self._weights(a.wbuf, a.shard), self._grads(a.gbuf, a.shard)
        with self.timer.span():
            self.compute.backward_weight(a.mb, a.shard, weights, grads)

    def _load_weights(self, a: A.LoadWeights) -> None:
        self._weights(a.buf, a.shard, write=True).copy_(self.compute.master(a.shard))

    def _zero_grad(self, a: A.ZeroGrad) -> None:
        self._grads(a.buf, a.shard).zero_()

    def _accumulate(self, a: A.AccumulateToOwner) -> None:
        main = self.compute.main_grad(a.shard)
        piece = self._slices.get(a.shard)
        if piece is None:
            main.add_(self._grads(a.buf, a.shard, write=False))
            return
        # a reduce-scatter's result: this holder's slice of the sum, where the plan's holders put slice k
        self._check_not_in_flight(a.buf, False)
        main.add_(self.grad_buffers[a.buf][piece.start:piece.start + piece.length])

    def _optimizer_step(self, a: A.OptimizerStep) -> None:
        self.compute.optimizer_step()

    # ---- communication ------------------------------------------------------------------

    def _entries_by_step(self, actions) -> Dict[int, List[Tuple[int, object]]]:
        """The starts issued together (one ``batch``, or one alone) by the step of the first: :mod:`plan.nccl`'s entries."""
        cached = self._entries_cache
        if cached is None or cached[0] is not actions:
            entries = {ops[0][0]: ops for _, ops in entries_of(actions, self.rank, "group")}
            self._entries_cache = cached = (actions, entries)
        return cached[1]

    def _meet(self, step: int, when: str) -> None:
        """The context-parallel members' collectives at ``step`` (``when``: before or after its action)."""
        for point in self._members.get((step, when), ()):
            x, buffer, numel = point.action, None, 0
            if point.op != "replicated":   # an arrived weight's or a leaving gradient's buffer
                self._check_not_in_flight(x.buf, True)
                buffer = (self.weight_buffers if point.op == "gather" else self.grad_buffers)[x.buf]
                numel = self._numel[x.shard]
            self.cp.meet(point, buffer, numel, self.compute.replicated_grads)

    def _issue_p2p(self, a) -> None:
        """Issue ``a`` with the rest of its batch; a later member was issued with the first."""
        members = self._entries.get(self._step)
        if members is None:
            return
        ops, starts = [], []
        for step, x in members:
            send = type(x) is A.SendStart
            tensor = self._piece_of(x, self._buffer(x.buf, x.kind, x.shard, write=not send), leaving=send)
            ops.append(Op(x.tag, x, step, "send" if send else "recv", [tensor], self.comms.for_action(x, self.rank),
                          peer=self.comms.physical(x.peer)))
            starts.append((x, tensor, send))
        works = self.transport.issue(ops)
        for x, tensor, send in starts:
            if send:
                self._count(x.link, tensor)
                # A sent gradient has moved to the receiver: the buffer is empty afterwards.
                after = (lambda t=tensor: t.zero_()) if x.kind == "grad" else (lambda: None)
                self._start(x, works[x.tag], x.buf, after, reads_only=x.kind == "weight")
            else:
                self._start(x, works[x.tag], x.buf)

    def _piece_of(self, a, tensor: torch.Tensor, leaving: bool) -> torch.Tensor:
        """What ``a`` moves of ``tensor`` (a shard's prefix of ``a.buf``): all of it, or with context parallelism
        this member's piece (an arriving gradient's buffer zeroed around it: :mod:`runtime.context_parallel`)."""
        if self.cp is not None and a.kind == "grad" and not leaving:
            tensor.zero_()
        return tensor if self.cp is None else self.cp.piece(tensor)

    def _send(self, a: A.SendStart) -> None:
        self._issue_p2p(a)

    def _recv(self, a: A.RecvStart) -> None:
        self._issue_p2p(a)

    def _collective(self, a, kind: str, tensors, peer: int):
        physical = self.comms.physical
        op = Op(a.tag, a, self._step, kind, tensors, self.comms.for_action(a, self.rank),
                peer=physical(peer) if peer >= 0 else peer, ranks=tuple(physical(r) for r in a.ranks),
                subgroups=self.comms.subgroups(a, self.rank))
        return self.transport.issue([op])[a.tag]

    def _broadcast(self, a: A.BroadcastStart) -> None:
        is_root = self.rank == a.root
        tensor = self._piece_of(a, self._buffer(a.buf, a.kind, a.shard, write=not is_root), leaving=is_root)
        work = self._collective(a, "broadcast", [tensor], a.root)
        if not is_root:
            self._count(self.plan.link_between(self.rank, a.root), tensor)
        self._start(a, work, a.buf, reads_only=is_root)

    def _reduce(self, a: A.ReduceStart) -> None:
        tensor = self._piece_of(a, self._buffer(a.buf, a.kind, a.shard, write=True), leaving=True)
        work = self._collective(a, "reduce", [tensor], a.root)
        after = lambda: None  # noqa: E731
        if self.rank != a.root:
            self._count(self.plan.link_between(self.rank, a.root), tensor)
            after = lambda: tensor.zero_()  # noqa: E731 - contributions moved to the root
        self._start(a, work, a.buf, after)

    def _all_reduce(self, a: A.AllReduceStart) -> None:
        tensor = self._piece_of(a, self._buffer(a.buf, a.kind, a.shard, write=True), leaving=True)
        work = self._collective(a, "allreduce", [tensor], -1)
        successor, share = ring_share(a.ranks, self.rank)   # what a ring all-reduce sends
        self._count(self.plan.link_between(self.rank, successor), tensor, share)
        self._start(a, work, a.buf)

    def _all_gather(self, a: A.AllGatherStart) -> None:
        """Every holder's master slice, in the compute dtype, into the whole (padded) buffer."""
        piece = self._slices[a.shard]
        self._check_not_in_flight(a.buf, True)
        whole = self.weight_buffers[a.buf][:piece.members * piece.length]
        local = self.compute.master(a.shard).to(self.compute.compute_dtype)   # (a copy unless already that dtype)
        work = self._collective(a, "allgather", [whole, local], -1)
        successor, share = ring_share(a.ranks, self.rank, half=True)
        self._count(self.plan.link_between(self.rank, successor), whole[:self._numel[a.shard]], share)
        self._start(a, work, a.buf, after=lambda keep=local: None)   # (the slice lives until the wait)

    def _reduce_scatter(self, a: A.ReduceScatterStart) -> None:
        """The holders' partial gradients summed; this holder's slice of the sum ends at its slice's place."""
        piece = self._slices[a.shard]
        self._check_not_in_flight(a.buf, True)
        numel, start, length = piece.numel, piece.start, piece.length
        whole = self.grad_buffers[a.buf][:piece.members * length]
        whole[numel:].zero_()   # the padding: nothing of another (larger) shard's
        mine = torch.empty(length, dtype=whole.dtype, device=whole.device)
        work = self._collective(a, "reducescatter", [mine, whole], -1)
        successor, share = ring_share(a.ranks, self.rank, half=True)
        self._count(self.plan.link_between(self.rank, successor), whole[:numel], share)
        self._start(a, work, a.buf, after=lambda: whole[start:start + length].copy_(mine))

    def _replicated_all_reduce(self, a: A.ReplicatedAllReduceStart) -> None:
        if a.mode != "sum":   # a sharded replicated optimizer: its gradients' reduce-scatter or weights' all-gather
            tensors = self.compute.replicated_slices.tensors(a.mode, a.part)
            return self._start(a, self._collective(a, SHARDED_KINDS[a.mode], tensors, -1), "<replicated>")
        # One all-reduce per gradient tensor, in place: no concatenated copy of them all.
        grads = [g for g in self.compute.replicated_grads(a.part) if g.numel()]
        if self.cp is not None:   # reduce-scattered over the members at the point before: piece c of each travels
            grads = [piece for piece in (self.cp.piece(g.view(-1)) for g in grads) if piece.numel()]
        work = self._collective(a, "allreduce", grads, -1)
        self._start(a, work, "<replicated>")

    # Measurement hook: ``observer(executor, action, wait)`` runs every plan Wait while set (:meth:`observing_waits`).
    wait_observer: Optional[Callable[["PlanExecutor", A.Wait, Callable[[], None]], None]] = None

    @classmethod
    @contextlib.contextmanager
    def observing_waits(cls, observer: Callable[["PlanExecutor", A.Wait, Callable[[], None]], None]):
        """While the block runs, every executor's plan ``Wait`` goes through ``observer(executor, action, wait)``,
        which must call ``wait()`` once (the transfer is still in ``executor.in_flight`` until then)."""
        previous, cls.wait_observer = cls.wait_observer, observer
        try:
            yield
        finally:
            cls.wait_observer = previous

    def _wait(self, a: A.Wait) -> None:
        observer = PlanExecutor.wait_observer
        if observer is None:
            self._finish_wait(a)
        else:
            observer(self, a, lambda: self._finish_wait(a))

    def _finish_wait(self, a: A.Wait) -> None:
        if a.tag not in self.in_flight:
            raise ExecutionError(f"wait for transfer {a.tag}, which was not started")
        op = self.in_flight.pop(a.tag)
        if op.work is not None:
            try:
                with progress.board().waiting(op.what):
                    op.work.wait(self.timeout)
            except RuntimeError as exc:
                seconds = int(self.timeout.total_seconds())
                raise PeerFailure(f"{op.what} failed or did not complete within {seconds} s "
                                  f"(--distributed-timeout-minutes): {first_line(exc)}") from exc
        if self.trace is None:
            op.after()
            return
        begun = time.time()   # a timeline splits a wait's own work (zeroing a sent gradient) from its waiting
        op.after()
        self._after_s = time.time() - begun
