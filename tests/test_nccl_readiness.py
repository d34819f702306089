"""What the first GPU run needs, checked on CPU: every process group with the run's timeout, gloo
refused where a GPU is visible, no device-wide synchronisation while a plan runs (CUDA faked),
CUDA-event stamps for transfers in timelines, and the launch-order refusal."""

import datetime
import types

import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import tiny_args, train_rank

from megatron_tawpipe.common.errors import DistributedSetupError
from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.runtime import timing
from megatron_tawpipe.runtime.warmup import launch_order_problem


# ---- timeouts -------------------------------------------------------------------------------------

def _train_recording_group_timeouts(rank, argv):
    import torch.distributed as dist

    seen = []
    original = dist.new_group

    def recording(*args, **kwargs):
        import traceback

        ours = "megatron_tawpipe" in traceback.extract_stack()[-2].filename   # the caller
        # megatron-core 0.16 creates its (unused here) expert-data-parallel gloo group without a timeout.
        if ours or kwargs.get("backend") != "gloo":
            seen.append(kwargs.get("timeout"))
        return original(*args, **kwargs)

    dist.new_group = recording
    try:
        train_rank(rank, argv)
    finally:
        dist.new_group = original
    return [None if t is None else t.total_seconds() for t in seen]


def test_every_process_group_gets_the_run_timeout():
    """Ours (weight pipeline groups, the executor's communicators, the NCCL-faithful transport's control groups)
    and megatron-core's (passed --distributed-timeout-minutes) alike: none falls back to the
    backend's default."""
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--distributed-timeout-minutes", "7",
                     "--tawpipe-num-groups", "2", "--tawpipe-nccl-faithful", train_iters=2, global_batch=4)
    results = run_ranks(_train_recording_group_timeouts, 2, argv, timeout=240)
    for seen in results:
        assert len(seen) >= 5, seen
        assert set(seen) == {7 * 60.0}, seen


# ---- gloo where a GPU is visible ------------------------------------------------------------------

def test_gloo_is_refused_where_a_gpu_is_visible(monkeypatch):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.distributed import initialize

    initialize.check_backend_for_device("gloo", cuda=False)
    initialize.check_backend_for_device("nccl", cuda=True)
    with pytest.raises(DistributedSetupError, match="nccl needs CUDA"):
        initialize.check_backend_for_device("nccl", cuda=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    called = []
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda *a, **k: called.append(1))
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    with pytest.raises(DistributedSetupError) as info:
        initialize.initialize_distributed(parse_args(["--train-iters", "1", "--distributed-backend", "gloo"]))
    text = str(info.value)
    assert "--distributed-backend gloo" in text and "CUDA_VISIBLE_DEVICES=" in text
    assert "--tawpipe-nccl-faithful" in text and "\n" not in text
    assert not called   # refused before any process group


# ---- no synchronisation inside a plan ---------------------------------------------------------------

class _FakeEvent:
    """A CUDA event on a fake clock: record() reads it, elapsed_time() subtracts (ms)."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock[0] += 0.25
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        _FakeCuda.syncs.append("event")

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


class _FakeCuda:
    syncs = []


@pytest.fixture
def fake_cuda(monkeypatch):
    _FakeCuda.syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: _FakeCuda.syncs.append("device"))
    return _FakeCuda


def test_timer_never_synchronises_the_device_while_a_plan_runs(fake_cuda):
    timer = timing.ComputeTimer(torch.device("cuda"))
    assert fake_cuda.syncs == ["device", "event"]       # once, when created, before any plan
    for _ in range(3):                                   # three iterations
        fake_cuda.syncs.clear()
        timer.reset()
        for _ in range(4):
            with timer.span():
                pass
            timer.stamp(0.0)
        assert fake_cuda.syncs == []                     # nothing while the plan runs
        assert timer.total() == pytest.approx(4 * 0.25)  # after the plan: waits for the last span only
        assert fake_cuda.syncs == ["event"]


def test_transfer_stamps_are_stream_times_on_cuda(fake_cuda):
    timer = timing.ComputeTimer(torch.device("cuda"))
    posted, ended = timer.stamp(100.0), timer.stamp(100.0)
    assert callable(posted) and callable(ended)
    assert ended() - posted() == pytest.approx(0.25)     # the events' distance, not the host's times
    cpu = timing.ComputeTimer(torch.device("cpu"))
    assert cpu.stamp(12.5) == 12.5


def test_executor_resolves_cuda_stamps_of_transfers_after_the_plan(fake_cuda):
    from megatron_tawpipe.plan import actions as A
    from megatron_tawpipe.runtime.executor import PlanExecutor
    from megatron_tawpipe.runtime.trace import resolve_times

    plan = build_plan("tawpipe", num_ranks=2, num_groups=2, num_microbatches=1)
    ex = types.SimpleNamespace(trace={"rank": 0, "spans": [], "transfers": [], "actions": []}, _posted={}, rank=0,
                               plan=plan, timer=timing.ComputeTimer(torch.device("cuda")), _step=0, _after_s=0.0)
    send = next(a for a in plan.actions[0] if isinstance(a, A.SendStart))
    PlanExecutor._record(ex, send, ex.timer.stamp(1.0), ex.timer.stamp(1.0), 1.0, 1.5)
    PlanExecutor._record(ex, A.Wait(send.tag), ex.timer.stamp(1.0), ex.timer.stamp(1.0), 2.0, 2.5)
    transfer = ex.trace["transfers"][0]
    assert callable(transfer.posted) and callable(transfer.end)
    resolve_times(ex.trace)
    transfer = ex.trace["transfers"][0]
    assert isinstance(transfer.posted, float) and transfer.end > transfer.posted
    assert [(record.host_start, record.host_end) for record in ex.trace["actions"]] == [(1.0, 1.5), (2.0, 2.5)]


# ---- several communicators on one GPU --------------------------------------------------------------

def test_launch_order_implicit_is_refused_for_plans_that_need_concurrent_communicators():
    weipipe = build_plan("weipipe", num_ranks=4, num_groups=1, num_microbatches=2)
    text = launch_order_problem([weipipe], {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"})
    assert text and "NCCL_LAUNCH_ORDER_IMPLICIT" in text and "weipipe" in text
    assert launch_order_problem([weipipe], {}) is None
    assert launch_order_problem([weipipe], {"NCCL_LAUNCH_ORDER_IMPLICIT": "0"}) is None
    flat = build_plan("tawpipe-flat", num_ranks=4, num_groups=2, num_microbatches=2)
    assert launch_order_problem([flat], {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"}) is None
