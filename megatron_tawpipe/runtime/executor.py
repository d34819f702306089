"""Run one rank's list of plan actions on torch.distributed.

The executor knows nothing about schedules: it interprets the actions of
:mod:`megatron_tawpipe.plan.actions` in order. Communication is asynchronous
(``isend/irecv``, ``broadcast/reduce(async_op=True)``) and every handle is
waited on by the plan's ``Wait`` before its buffer is read or reused (the
validator proves that; the executor also refuses to touch a buffer that is
still in flight). Weight and gradient traffic use separate communicators, so
that on NCCL they do not serialise behind each other.

Bytes are counted per link class the way :func:`plan.simulate.link_bytes`
does: each send, each non-root broadcast copy and each non-root reduction
input, with the real tensor sizes.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe import progress
from megatron_tawpipe.plan import actions as A


class ExecutionError(RuntimeError):
    """A plan action could not run on this rank; names rank, step and action."""


class PeerFailure(ExecutionError):
    """A transfer failed or timed out: a peer stopped, stalled or is unreachable."""


@dataclass
class _InFlight:
    work: object
    after: Callable[[], None]
    buf: str
    reads_only: bool
    what: str           # e.g. "receive of weight shard 3 from rank 2", for error messages


class Communicators:
    """Process groups a plan needs, created collectively and in the same order on every rank."""

    def __init__(self, plan, world_size: int):
        everyone = tuple(range(world_size))
        self.channel: Dict[str, Optional[dist.ProcessGroup]] = {}
        for channel in ("weight", "grad"):
            # One communicator per traffic class (NCCL ops on one communicator serialise).
            self.channel[channel] = dist.new_group(list(everyone)) if world_size > 1 else None
        self.groups: Dict[Tuple[Tuple[int, ...], str], Optional[dist.ProcessGroup]] = {}
        for ranks, channel in plan.communicators():
            self.groups[(tuple(ranks), channel)] = dist.new_group(list(ranks))
        self.replicated = None  # the default group: the replicated all-reduce spans every rank

    def for_collective(self, ranks, kind: str):
        return self.groups[(tuple(ranks), A.CHANNEL[kind])]

    def for_p2p(self, kind: str):
        return self.channel[A.CHANNEL[kind]]


def _needed_for_forward(action, in_flight) -> bool:
    if isinstance(action, (A.Forward, A.LoadWeights)):
        return True
    if isinstance(action, A.Wait):
        return action.tag in in_flight
    return isinstance(action, (A.SendStart, A.RecvStart, A.BroadcastStart)) and action.kind == "weight"


class PlanExecutor:
    """Holds one rank's buffers and runs its action list once per iteration.

    ``compute`` is the object that does forward/backward work and owns the
    master weights and gradients (see :class:`runtime.trainer.WeightPassingTrainer`):
    it provides ``forward(mb, shard, weights)``, ``backward(mb, shard, weights, grad)``,
    ``master(shard)``, ``main_grad(shard)``, ``replicated_grads()``,
    ``optimizer_step()`` and ``shard_numel``/``compute_dtype``/``device``.
    """

    def __init__(self, plan, rank: int, compute, communicators: Communicators,
                 timeout: Optional[datetime.timedelta] = None):
        self.plan = plan
        # Bounded waits: a dead or stalled peer becomes an error, never a silent hang.
        self.timeout = timeout or datetime.timedelta(minutes=10)
        self.rank = rank
        self.compute = compute
        self.comms = communicators
        self.weight_buffers: Dict[str, torch.Tensor] = {}
        self.grad_buffers: Dict[str, torch.Tensor] = {}
        self.in_flight: Dict[int, _InFlight] = {}
        self.trace: Optional[dict] = None   # {"spans": [...], "transfers": [...]} when recording a timeline
        self._posted: Dict[int, Tuple[float, object]] = {}
        self.reset_counters()
        self._handlers = {
            A.Forward: self._forward,
            A.Backward: self._backward,
            A.LoadWeights: self._load_weights,
            A.ZeroGrad: self._zero_grad,
            A.AccumulateToOwner: self._accumulate,
            A.SendStart: self._send,
            A.RecvStart: self._recv,
            A.BroadcastStart: self._broadcast,
            A.ReduceStart: self._reduce,
            A.ReplicatedAllReduceStart: self._replicated_all_reduce,
            A.Wait: self._wait,
            A.OptimizerStep: self._optimizer_step,
        }

    # ---- buffers -----------------------------------------------------------------------

    def _weights(self, name: str, write: bool = False) -> torch.Tensor:
        self._check_not_in_flight(name, write)
        if name not in self.weight_buffers:
            self.weight_buffers[name] = torch.empty(
                self.compute.shard_numel, dtype=self.compute.compute_dtype, device=self.compute.device)
        return self.weight_buffers[name]

    def _grads(self, name: str, shard: int, write: bool = True) -> torch.Tensor:
        if name == A.MAIN:
            return self.compute.main_grad(shard)
        self._check_not_in_flight(name, write)
        if name not in self.grad_buffers:
            self.grad_buffers[name] = torch.zeros(
                self.compute.shard_numel, dtype=torch.float32, device=self.compute.device)
        return self.grad_buffers[name]

    def _buffer(self, name: str, kind: str, shard: int, write: bool) -> torch.Tensor:
        return self._weights(name, write) if kind == "weight" else self._grads(name, shard, write)

    def _check_not_in_flight(self, name: str, write: bool) -> None:
        """Outgoing transfers only read their buffer; anything else in flight forbids all access."""
        for tag, op in self.in_flight.items():
            if op.buf == name and (write or not op.reads_only):
                raise ExecutionError(f"buffer {name} is used while transfer {tag} is in flight")

    def reset_counters(self) -> None:
        self.bytes_sent = {"intra": 0, "inter": 0}
        self.compute_seconds = 0.0   # time inside Forward/Backward actions (busy fraction)

    # ---- running ------------------------------------------------------------------------

    def run(self, actions: List[object], forward_only: bool = False) -> None:
        """Execute ``actions``; ``forward_only`` keeps forwards and weight traffic only (evaluation)."""
        self._forward_only = forward_only
        board = progress.board()
        for step, action in enumerate(actions):
            if forward_only and not _needed_for_forward(action, self.in_flight):
                continue
            board.at(_PlanPosition(step, len(actions), action))
            started = time.time() if self.trace is not None else 0.0
            try:
                self._handlers[type(action)](action)
                if self.trace is not None:
                    self._record(action, started, time.time())
            except PeerFailure as exc:
                raise PeerFailure(f"rank {self.rank}, step {step} of {len(actions)}, {action}: {exc}") from exc
            except ExecutionError as exc:
                raise ExecutionError(f"rank {self.rank}, step {step}, {action}: {exc}") from exc
            except RuntimeError as exc:
                if isinstance(action, A.STARTS):
                    raise PeerFailure(
                        f"rank {self.rank}, step {step} of {len(actions)}, {action}: could not start "
                        f"({_describe(action, self.rank)}): {first_line(exc)}") from exc
                raise
        if self.in_flight:
            raise ExecutionError(f"rank {self.rank}: plan ended with transfers in flight: {sorted(self.in_flight)}")

    # ---- timeline ---------------------------------------------------------------------

    def start_trace(self) -> None:
        """Record this rank's actions with wall-clock times (``tools/plot_schedule.py --timeline``)."""
        self.trace = {"rank": self.rank, "spans": [], "transfers": []}
        self._posted = {}

    def _record(self, action, start: float, end: float) -> None:
        kind = _SPAN_KINDS.get(type(action))
        if kind is not None:
            self.trace["spans"].append([self.rank, start, end, kind, getattr(action, "mb", -1),
                                        getattr(action, "shard", -1)])
        elif isinstance(action, A.STARTS):
            self._posted[action.tag] = (start, action)
        elif isinstance(action, A.Wait) and action.tag in self._posted:
            posted, started = self._posted.pop(action.tag)
            link = getattr(started, "link", None)
            if link is None:
                root = getattr(started, "root", None)
                link = self.plan.link_between(self.rank, root) if root is not None else "inter"
            self.trace["transfers"].append([self.rank, "in" if _arrives_here(started, self.rank) else "out",
                                            getattr(started, "kind", "allreduce"), link, posted, end])

    def _start(self, action, work, buf: str, after: Callable[[], None] = lambda: None,
               reads_only: bool = False) -> None:
        self.in_flight[action.tag] = _InFlight(work, after, buf, reads_only, _describe(action, self.rank))

    def _count(self, link: str, tensor: torch.Tensor) -> None:
        self.bytes_sent[link] += tensor.numel() * tensor.element_size()

    # ---- compute ------------------------------------------------------------------------

    def _forward(self, a: A.Forward) -> None:
        start = time.perf_counter()
        self.compute.forward(a.mb, a.shard, self._weights(a.wbuf))  # reads only
        self.compute_seconds += time.perf_counter() - start

    def _backward(self, a: A.Backward) -> None:
        start = time.perf_counter()
        self.compute.backward(a.mb, a.shard, self._weights(a.wbuf), self._grads(a.gbuf, a.shard))
        self.compute_seconds += time.perf_counter() - start

    def _load_weights(self, a: A.LoadWeights) -> None:
        self._weights(a.buf, write=True).copy_(self.compute.master(a.shard))

    def _zero_grad(self, a: A.ZeroGrad) -> None:
        self._grads(a.buf, a.shard).zero_()

    def _accumulate(self, a: A.AccumulateToOwner) -> None:
        self.compute.main_grad(a.shard).add_(self._grads(a.buf, a.shard, write=False))

    def _optimizer_step(self, a: A.OptimizerStep) -> None:
        self.compute.optimizer_step()

    # ---- communication ------------------------------------------------------------------

    def _send(self, a: A.SendStart) -> None:
        tensor = self._buffer(a.buf, a.kind, a.shard, write=False)
        work = dist.isend(tensor, dst=a.peer, group=self.comms.for_p2p(a.kind), tag=a.tag)
        self._count(a.link, tensor)
        # A sent gradient has moved to the receiver: the buffer is empty afterwards.
        after = (lambda: tensor.zero_()) if a.kind == "grad" else (lambda: None)
        self._start(a, work, a.buf, after, reads_only=a.kind == "weight")

    def _recv(self, a: A.RecvStart) -> None:
        tensor = self._buffer(a.buf, a.kind, a.shard, write=True)
        work = dist.irecv(tensor, src=a.peer, group=self.comms.for_p2p(a.kind), tag=a.tag)
        self._start(a, work, a.buf)

    def _broadcast(self, a: A.BroadcastStart) -> None:
        is_root = self.rank == a.root
        tensor = self._buffer(a.buf, a.kind, a.shard, write=not is_root)
        work = dist.broadcast(tensor, src=a.root, group=self.comms.for_collective(a.ranks, a.kind), async_op=True)
        if not is_root:
            self._count(self.plan.link_between(self.rank, a.root), tensor)
        self._start(a, work, a.buf, reads_only=is_root)

    def _reduce(self, a: A.ReduceStart) -> None:
        tensor = self._buffer(a.buf, a.kind, a.shard, write=True)
        work = dist.reduce(tensor, dst=a.root, op=dist.ReduceOp.SUM,
                           group=self.comms.for_collective(a.ranks, a.kind), async_op=True)
        after = lambda: None  # noqa: E731
        if self.rank != a.root:
            self._count(self.plan.link_between(self.rank, a.root), tensor)
            after = lambda: tensor.zero_()  # noqa: E731 - contributions moved to the root
        self._start(a, work, a.buf, after)

    def _replicated_all_reduce(self, a: A.ReplicatedAllReduceStart) -> None:
        grads = self.compute.replicated_grads()
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True) if len(a.ranks) > 1 else None

        def unflatten():
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

        self._start(a, work, "<replicated>", unflatten)

    def _wait(self, a: A.Wait) -> None:
        if a.tag not in self.in_flight:
            raise ExecutionError(f"wait for transfer {a.tag}, which was not started")
        op = self.in_flight.pop(a.tag)
        if op.work is not None:
            try:
                with progress.board().waiting(op.what):
                    op.work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                seconds = int(self.timeout.total_seconds())
                raise PeerFailure(f"{op.what} failed or did not complete within {seconds} s "
                                  f"(--distributed-timeout-minutes): {first_line(exc)}") from exc
        op.after()


_SPAN_KINDS = {A.Forward: "F", A.Backward: "B", A.LoadWeights: "load", A.AccumulateToOwner: "acc",
               A.ZeroGrad: "zero", A.OptimizerStep: "opt"}


def _arrives_here(action, rank: int) -> bool:
    """Whether a transfer brings data to ``rank`` (else it takes data away)."""
    if isinstance(action, A.RecvStart):
        return True
    if isinstance(action, A.BroadcastStart):
        return action.root != rank
    if isinstance(action, A.ReduceStart):
        return action.root == rank
    return False


class _PlanPosition:
    """A plan step as the progress board shows it; formatted only when posted."""

    __slots__ = ("step", "length", "action")

    def __init__(self, step: int, length: int, action) -> None:
        self.step, self.length, self.action = step, length, action

    def __str__(self) -> str:
        return f"plan step {self.step} of {self.length}, {self.action}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _describe(action, rank: int) -> str:
    """What a communication action waits for, naming the peer ranks it depends on."""
    what = f"{getattr(action, 'kind', '')} shard {getattr(action, 'shard', '')}".strip()
    if isinstance(action, A.SendStart):
        return f"send of {what} to rank {action.peer} (rank {action.peer} stopped, stalled or is unreachable)"
    if isinstance(action, A.RecvStart):
        return f"receive of {what} from rank {action.peer} (rank {action.peer} stopped, stalled or is unreachable)"
    if isinstance(action, A.BroadcastStart):
        return f"broadcast of {what} from rank {action.root} over ranks {list(action.ranks)}"
    if isinstance(action, A.ReduceStart):
        return f"reduce of {what} to rank {action.root} over ranks {list(action.ranks)}"
    if isinstance(action, A.ReplicatedAllReduceStart):
        return f"all-reduce of the replicated gradients over ranks {list(action.ranks)}"
    return type(action).__name__
