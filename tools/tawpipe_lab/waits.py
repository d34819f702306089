"""Host time of the plan executor's ``Wait``.

On NCCL, ``work.wait()`` only makes the current CUDA stream wait for a
transfer; ``work.wait(timeout=...)`` blocks the host until it is done. Which of
the two a plan ``Wait`` amounts to decides whether the host can queue the next
shard's kernels while a transfer runs. Measurements, none of which edits the
executor:

* :class:`WaitTimer` wraps ``PlanExecutor._wait`` while it is active and
  records the host seconds of every call (executors built inside the block
  dispatch to the wrapper); around a one-rank training run it gives the host
  time per plan ``Wait``;
* :func:`probe_wait_behind_compute` puts a ``Wait`` behind a known amount of
  queued GPU work (square matmuls, timed with CUDA events), twice:
  through the executor — a four-action plan (load, a ``Forward`` that queues
  the work, a weight ``BroadcastStart``, its ``Wait``) — and on a bare c10d
  all-reduce of the one-rank process group, waited with ``work.wait()`` and
  with ``work.wait(timeout=...)``. A host-blocking wait lasts about as long as
  the queued work; a stream-ordered one returns at once. On one rank the
  executor may issue no transfer at all (a one-rank communicator has nothing
  to move): the probe says so instead of reporting a wait that never waited.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_tawpipe.bench.calibrate import uses_cuda_events


@dataclass
class WaitSample:
    host_s: float
    what: str                      # the transfer, as the executor describes it
    issued: bool                   # the executor's handle held a c10d work (one-rank groups issue none)
    pending: Optional[bool]        # CUDA only: that work had not finished when its Wait began


@dataclass
class WaitStats:
    count: int
    mean_s: float
    median_s: float
    max_s: float
    total_s: float

    @classmethod
    def of(cls, samples: List[WaitSample]) -> Optional["WaitStats"]:
        if not samples:
            return None
        times = [s.host_s for s in samples]
        return cls(len(times), statistics.fmean(times), statistics.median(times), max(times), sum(times))

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _c10d_works(handle) -> list:
    """The c10d work objects inside an executor's handle (the handle itself, or its ``works``)."""
    import torch.distributed as dist

    if isinstance(handle, dist.Work):
        return [handle]
    return [w for w in getattr(handle, "works", None) or [] if isinstance(w, dist.Work)]


def _pending(works: list, on_cuda: bool) -> Optional[bool]:
    """Whether any of ``works`` is still running (CUDA only: gloo reports False until waited)."""
    if not on_cuda or not works:
        return None
    return any(not work.is_completed() for work in works)


class WaitTimer:
    """Context manager: times every plan ``Wait`` of every executor while it is active
    (:meth:`PlanExecutor.observing_waits`)."""

    def __init__(self, on_cuda: bool = False):
        self.on_cuda = on_cuda
        self.samples: List[WaitSample] = []
        self._observing = None

    def _timed_wait(self, executor, action, wait) -> None:
        op = executor.in_flight.get(action.tag)
        what = getattr(op, "what", f"transfer {action.tag}")
        works = _c10d_works(getattr(op, "work", None))
        pending = _pending(works, self.on_cuda)
        start = time.perf_counter()
        try:
            wait()
        finally:
            self.samples.append(WaitSample(time.perf_counter() - start, what, bool(works), pending))

    def __enter__(self) -> "WaitTimer":
        from megatron_tawpipe.runtime.executor import PlanExecutor

        self._observing = PlanExecutor.observing_waits(self._timed_wait)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._observing.__exit__(*exc)

    def stats(self) -> Optional[WaitStats]:
        return WaitStats.of(self.samples)


# ---- the probe ---------------------------------------------------------------------------


class _QueuedWork:
    """The executor's compute side for the probe: a ``Forward`` queues square matmuls.

    On CUDA the matmuls are bracketed by events, so their GPU time is known afterwards.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, matmul_size: int, matmuls: int):
        self.device, self.compute_dtype = device, dtype
        self.shard_numel = 1024
        self._master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self._grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        generator = torch.Generator().manual_seed(0)
        self._a = torch.randn(matmul_size, matmul_size, generator=generator).to(device, dtype) / matmul_size ** 0.5
        self._out = torch.empty_like(self._a)
        self.matmuls = matmuls
        self.events: List[tuple] = []
        self.host_seconds: List[float] = []

    def run_matmuls(self) -> None:
        for _ in range(self.matmuls):
            torch.matmul(self._a, self._a, out=self._out)

    def queue(self) -> None:
        """Queue the matmuls (CUDA: between two events), remembering how long they take."""
        start = time.perf_counter()
        if uses_cuda_events(self.device):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.run_matmuls()
            end.record()
            self.events.append((begin, end))
        else:
            self.run_matmuls()
        self.host_seconds.append(time.perf_counter() - start)

    def queued_seconds(self) -> List[float]:
        """GPU seconds of each queue() (CUDA), else its host seconds."""
        if not self.events:
            return list(self.host_seconds)
        torch.cuda.synchronize(self.device)
        return [begin.elapsed_time(end) / 1000.0 for begin, end in self.events]

    # ---- what the executor calls ----

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        self.queue()

    def backward(self, mb, shard, weights, grad) -> None:
        self.queue()

    def master(self, shard: int) -> torch.Tensor:
        return self._master

    def main_grad(self, shard: int) -> torch.Tensor:
        return self._grad

    def replicated_grads(self, part: str = "all") -> list:
        return []

    def optimizer_step(self) -> None:
        pass


def probe_plan():
    """One rank: load weights, a Forward (the queued work), a weight broadcast, its Wait."""
    from megatron_tawpipe.plan import actions as A
    from megatron_tawpipe.plan.plan import Plan

    actions = [A.LoadWeights(shard=0, buf="w0"),
               A.Forward(mb=0, shard=0, wbuf="w0"),
               A.BroadcastStart(tag=1, root=0, ranks=(0,), buf="w0", kind="weight", shard=0, link="intra"),
               A.Wait(tag=1)]
    return Plan(schedule="wait-probe", family="weight", num_ranks=1, num_groups=1, num_layers=1,
                num_microbatches=1, owners=(0,), streams=(0,), max_weight_buffers=1, max_grad_buffers=0,
                actions=[actions])


def _blocking_verdict(wait_s: float, queued_s: float) -> str:
    return "blocks the host" if wait_s >= 0.5 * queued_s else "returns at once (stream-ordered)"


@dataclass
class WaitProbe:
    queued_compute_s: List[float]            # per probe, GPU time of the queued work (CPU: host time)
    executor_wait_s: List[float]             # host time of the executor's Wait
    executor_issued: bool                    # the executor's handle held a c10d work
    executor_pending: List[Optional[bool]]   # that work was still running when the Wait began
    c10d_wait_s: List[float]                 # work.wait() behind the queued work
    c10d_wait_timeout_s: List[float]         # work.wait(timeout=...) behind the queued work
    c10d_pending: List[Optional[bool]]
    on_cuda: bool = False

    @staticmethod
    def _median(values: List[float]) -> float:
        return statistics.median(values) if values else float("nan")

    @property
    def median_queued_s(self) -> float:
        return self._median(self.queued_compute_s)

    def verdict(self) -> str:
        if not self.on_cuda:
            return "not applicable on the CPU: compute is synchronous, nothing is queued behind a Wait"
        queued = self.median_queued_s
        if not self.executor_issued:
            executor = "executor: no transfer on a one-rank communicator (nothing to wait for)"
        elif not any(self.executor_pending):
            executor = "executor: inconclusive (the broadcast had completed before its Wait)"
        else:
            executor = "executor Wait " + _blocking_verdict(self._median(self.executor_wait_s), queued)
        if not any(self.c10d_pending):
            c10d = "c10d: inconclusive (the all-reduce had completed before its wait)"
        else:
            c10d = (f"c10d work.wait() {_blocking_verdict(self._median(self.c10d_wait_s), queued)}, "
                    f"work.wait(timeout) {_blocking_verdict(self._median(self.c10d_wait_timeout_s), queued)}")
        return f"{executor}; {c10d}"

    def summary(self) -> str:
        ms = lambda values: f"{self._median(values) * 1e3:.3f} ms"  # noqa: E731
        return (f"behind {self.median_queued_s * 1e3:.1f} ms of queued compute: executor Wait "
                f"{ms(self.executor_wait_s)}, c10d wait() {ms(self.c10d_wait_s)}, wait(timeout) "
                f"{ms(self.c10d_wait_timeout_s)} -> {self.verdict()}")

    def to_json(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items()}, "median_queued_compute_s": self.median_queued_s,
                "verdict": self.verdict()}


def _matmuls_for(device: torch.device, dtype: torch.dtype, size: int, target_s: float) -> int:
    """How many ``size``-square matmuls take about ``target_s`` on ``device``."""
    from megatron_tawpipe.bench.calibrate import fastest_time

    work = _QueuedWork(device, dtype, size, 4)
    one = fastest_time(work.run_matmuls, repeats=3, warmup=1, device=device) / 4
    return max(1, int(round(target_s / max(one, 1e-9))))


def _executor_probe(work: _QueuedWork, repeats: int, on_cuda: bool):
    """Host seconds of the probe plan's Wait, whether a c10d work was behind it, and whether it was pending."""
    from megatron_tawpipe.runtime.executor import Communicators, PlanExecutor

    plan = probe_plan()
    with WaitTimer(on_cuda=on_cuda) as timer:
        executor = PlanExecutor(plan, 0, work, Communicators(plan, 1))
        for _ in range(repeats):
            executor.run(plan.actions[0])
        if on_cuda:
            torch.cuda.synchronize(work.device)
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    if len(timer.samples) != repeats:
        raise RuntimeError(f"{len(timer.samples)} Wait calls recorded for {repeats} runs of the probe plan: "
                           "the executor no longer dispatches Wait through PlanExecutor._wait")
    samples = timer.samples
    return [s.host_s for s in samples], all(s.issued for s in samples), [s.pending for s in samples]


def _c10d_probe(work: _QueuedWork, repeats: int, with_timeout: bool, on_cuda: bool):
    """Host seconds of a one-rank all-reduce's wait behind the queued work, and whether it was pending."""
    import datetime

    import torch.distributed as dist

    tensor = torch.zeros(1024, dtype=torch.float32, device=work.device)
    seconds, pending = [], []
    for _ in range(repeats):
        work.queue()
        handle = dist.all_reduce(tensor, async_op=True)
        pending.append(not handle.is_completed() if on_cuda else None)
        start = time.perf_counter()
        if with_timeout:
            handle.wait(timeout=datetime.timedelta(minutes=1))
        else:
            handle.wait()
        seconds.append(time.perf_counter() - start)
        if on_cuda:
            torch.cuda.synchronize(work.device)
    return seconds, pending


def probe_wait_behind_compute(device: torch.device, dtype: torch.dtype, matmul_size: int,
                              target_compute_s: float, repeats: int) -> WaitProbe:
    """Waits behind ``target_compute_s`` of queued matmuls, on the current one-rank process group."""
    on_cuda = uses_cuda_events(device)
    work = _QueuedWork(device, dtype, matmul_size, _matmuls_for(device, dtype, matmul_size, target_compute_s))
    executor_s, issued, executor_pending = _executor_probe(work, repeats, on_cuda)
    c10d_s, c10d_pending = _c10d_probe(work, repeats, with_timeout=False, on_cuda=on_cuda)
    c10d_timeout_s, _ = _c10d_probe(work, repeats, with_timeout=True, on_cuda=on_cuda)
    queued = work.queued_seconds()
    return WaitProbe(queued_compute_s=queued, executor_wait_s=executor_s, executor_issued=issued,
                     executor_pending=executor_pending, c10d_wait_s=c10d_s, c10d_wait_timeout_s=c10d_timeout_s,
                     c10d_pending=c10d_pending, on_cuda=on_cuda)
