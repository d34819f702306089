"""The plan executor on gloo, directly and in NCCL-faithful mode, with a small numeric compute.

The compute checks that every forward/backward gets the right shard's weights and
adds a known gradient per micro-batch, so after one plan every owner's gradient
must hold the sum over all ranks and micro-batches: a transfer that went to the
wrong buffer or peer, or was lost, changes it.
"""

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from distributed_harness import run_ranks
from megatron_tawpipe.plan import Plan, build_plan, validate_plan
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.connect import connection_warmup
from megatron_tawpipe.runtime.executor import Communicators, PeerFailure, PlanExecutor

DATA = os.path.join(os.path.dirname(__file__), "data")
NUMEL = 16   # elements per layer; a shard of n layers has n * NUMEL


def _numel(plan, shard):
    return NUMEL * plan.shard_layers[shard]


class _Compute:
    """Weights of shard s are all s + 1; backward of micro-batch m adds m + 1 to every element."""

    def __init__(self, plan, rank):
        self.plan = plan
        self.shard_numel, self.compute_dtype, self.device = NUMEL * plan.max_layers_per_shard, torch.float32, \
            torch.device("cpu")
        self.grads = {s: torch.zeros(_numel(plan, s)) for s in plan.shards_held_by(rank)}
        self.replicated = [torch.full((3,), float(rank + 1)), torch.full((2,), 1.0)]
        self.rank = rank

    def _check(self, shard, weights):
        if weights.numel() != _numel(self.plan, shard) or not torch.all(weights == shard + 1):
            raise AssertionError(f"rank {self.rank}: shard {shard} computed with {weights.numel()} weights "
                                 f"{weights[:3].tolist()}")

    def forward(self, mb, shard, weights):
        self._check(shard, weights)

    def backward(self, mb, shard, weights, grad):
        self._check(shard, weights)
        grad.add_(mb + 1)

    def master(self, shard):
        return torch.full((_numel(self.plan, shard),), float(shard + 1))

    def main_grad(self, shard):
        return self.grads[shard]

    def replicated_grads(self, part="all"):
        return {"all": self.replicated, "head": self.replicated[1:], "embedding": self.replicated[:1]}[part]

    def optimizer_step(self):
        pass


def _run_plan(rank, plan_json, faithful, timeout_s, connect=False):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    plan = Plan.from_json(plan_json)
    compute = _Compute(plan, rank)
    executor = PlanExecutor(plan, rank, compute, Communicators(plan, dist.get_world_size()),
                            timeout=datetime.timedelta(seconds=timeout_s), nccl_faithful=faithful)
    connected = 0
    try:
        if connect:   # the warm-up must leave every buffer, gradient and byte count as it found them
            connected = executor.connect()
            assert executor.bytes_sent == {"intra": 0, "inter": 0}, executor.bytes_sent
        executor.run(plan.actions[rank])
    except PeerFailure as exc:
        return {"failure": str(exc)}
    finally:
        executor.close()
    return {"grads": {s: g.tolist() for s, g in compute.grads.items()},
            "replicated": [t.tolist() for t in compute.replicated], "bytes": executor.bytes_sent,
            "connected": connected}


def _expect_sums(plan, results):
    P, N = plan.num_ranks, plan.num_microbatches
    want = P * N * (N + 1) / 2
    for rank, res in enumerate(results):
        assert "failure" not in res, res
        for shard, grad in res["grads"].items():
            assert grad == [want] * _numel(plan, int(shard)), (rank, shard, grad[:3])
        assert res["replicated"][0] == [P * (P + 1) / 2] * 3
        assert res["replicated"][1] == [float(P)] * 2


CASES = [
    ("tawpipe", 4, 2, 2, {}),
    ("tawpipe", 4, 4, 1, {}),
    ("tawpipe-paper", 4, 2, 2, {}),
    ("tawpipe", 6, 3, 3, {"chunk": 2}),
    ("tawpipe", 4, 2, 3, {"cache": False}),
    ("tawpipe-nooverlap", 4, 2, 2, {}),
    ("weipipe", 3, 1, 2, {}),
    # Shards of different sizes: every transfer and buffer the shard's size.
    ("weipipe", 3, 1, 2, {"num_layers": 5}),
    ("tawpipe", 4, 2, 2, {"num_layers": 6}),
    ("tawpipe", 4, 2, 3, {"num_layers": 7, "replicate_first": True, "chunk": 2}),
]


@pytest.mark.parametrize("faithful", [True, False], ids=["nccl-faithful", "direct"])
@pytest.mark.parametrize("schedule,P,D,N,opts", CASES, ids=[f"{c[0]}-P{c[1]}-D{c[2]}-N{c[3]}{c[4]}" for c in CASES])
def test_every_owner_gets_every_contribution(schedule, P, D, N, opts, faithful):
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=N, **opts)
    validate_plan(plan)
    results = run_ranks(_run_plan, P, plan.to_json(), faithful, 60, True, timeout=120)
    _expect_sums(plan, results)
    # The connection warm-up ran first, every operation of it (under NCCL's rules when faithful).
    warmup = connection_warmup(plan)
    assert [res["connected"] for res in results] == [sum(not isinstance(a, A.Wait) for a in acts)
                                                      for acts in warmup]
    assert any(res["connected"] for res in results)


def test_unsafe_plan_runs_on_gloo_but_fails_nccl_faithful_within_timeout():
    """A TawPipe plan whose rank 0 receives its shard's gradients from ranks 3, 2, 1 in the opposite order
    of the planner's (tests/data/tawpipe_crossed_down_P4_D4.json, the planner's P = D = 4 plan with two
    receives swapped): gloo matches by tag and runs it; NCCL-faithful mode reports the hang after the
    executor's timeout, naming the rank, the step and what holds its FIFO."""
    with open(os.path.join(DATA, "tawpipe_crossed_down_P4_D4.json"), encoding="utf-8") as f:
        plan_json = f.read()
    plan = Plan.from_json(plan_json)
    _expect_sums(plan, run_ranks(_run_plan, 4, plan_json, False, 60, timeout=120))
    results = run_ranks(_run_plan, 4, plan_json, True, 3, timeout=60)
    failures = [r["failure"] for r in results if "failure" in r]
    assert failures, results
    text = "\n".join(failures)
    assert "under NCCL's ordering rules" in text
    assert "FIFO on the grad point-to-point (down: toward lower ranks) process group is held by step" in text
    for message in failures:
        assert message.startswith("rank ") and ", step " in message


def test_a_transfer_whose_sides_differ_in_size_fails_nccl_faithful():
    """A receive naming another shard than its send, with shards of different sizes: NCCL would post two
    different counts (a hang or a truncated message); NCCL-faithful mode says so on both ranks."""
    plan = build_plan("weipipe", num_ranks=3, num_groups=1, num_layers=5, num_microbatches=2)
    for acts in plan.actions:
        for i, a in enumerate(acts):
            if type(a).__name__ == "RecvStart" and a.kind == "weight" and plan.shard_layers[a.shard] == 2:
                acts[i] = dataclasses.replace(a, shard=2)      # shard 2 has one layer
                break
        else:
            continue
        break
    results = run_ranks(_run_plan, 3, plan.to_json(), True, 3, timeout=60)
    failures = "\n".join(r["failure"] for r in results if "failure" in r)
    assert "NCCL would hang or truncate" in failures, results
    assert f"has {NUMEL} elements and its partner" in failures or f"{NUMEL} elements" in failures
