"""Context parallelism in weight-passing plans: the members' collectives at their points of the list, and the
per-GPU plan (the members as lanes, those collectives as operations) under NCCL's rules.

The points are counted here from the plan's transfers independently of ``member_points``: one gather per weight
that arrives (a receive, a broadcast to a non-root), one scatter per gradient that leaves (a send, a reduction,
an all-reduce), one sum of the replicated gradients per replicated all-reduce, one per compute action, one at the
end. Wrong per-GPU plans (two members meeting in different orders, a meeting inside an NCCL group) must fail.
"""

import dataclasses

import pytest

from megatron_tawpipe.plan import PlanError, build_plan, validate_plan
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.connect import check_nccl_order
from megatron_tawpipe.plan.context_parallel import MemberCollectiveStart, lanes, member_points
from megatron_tawpipe.plan.nccl import MODES
from megatron_tawpipe.plan.sweep import run_sweep

PLANS = [
    ("tawpipe", dict(num_ranks=4, num_groups=2, num_layers=8, num_microbatches=2)),
    ("tawpipe", dict(num_ranks=4, num_groups=2, num_layers=8, num_microbatches=4, cache=True)),
    ("tawpipe", dict(num_ranks=4, num_groups=2, num_layers=8, num_microbatches=2, replicate_first=True)),
    ("tawpipe", dict(num_ranks=6, num_groups=3, num_layers=6, num_microbatches=2, cache=False)),
    ("tawpipe", dict(num_ranks=4, num_groups=2, num_layers=10, num_microbatches=2, shard_layers=(3, 2, 2, 3))),
    ("weipipe", dict(num_ranks=4, num_groups=1, num_layers=4, num_microbatches=4)),
    ("weipipe-zb1", dict(num_ranks=4, num_groups=2, num_layers=4, num_microbatches=4)),
]
IDS = ["tawpipe-4x2", "tawpipe-cache", "tawpipe-replicated-first", "tawpipe-3-groups", "tawpipe-uneven", "weipipe", "weipipe-zb1"]


def _plan(schedule, kwargs):
    return build_plan(schedule, **kwargs)


def _expected(actions, rank):
    """The member points of a list, counted from its transfers."""
    out = {"compute": 0, "gather": 0, "scatter": 0, "replicated": 0, "sum": 1}
    for a in actions:
        t = type(a)
        if t in A.COMPUTE:
            out["compute"] += 1
        elif t is A.ReplicatedAllReduceStart:
            out["replicated"] += 1
        elif t is A.RecvStart and a.kind == "weight":
            out["gather"] += 1
        elif t is A.BroadcastStart and a.kind == "weight" and a.root != rank:
            out["gather"] += 1
        elif t in (A.SendStart, A.ReduceStart, A.AllReduceStart) and a.kind == "grad":
            out["scatter"] += 1
    return out


@pytest.mark.parametrize("schedule,kwargs", PLANS, ids=IDS)
def test_member_points_are_where_the_members_must_meet(schedule, kwargs):
    plan = _plan(schedule, kwargs)
    for rank, acts in enumerate(plan.actions):
        points = member_points(acts, rank)
        counts = {op: sum(p.op == op for p in points) for op in ("compute", "gather", "scatter", "replicated", "sum")}
        assert counts == _expected(acts, rank)
        assert counts["gather"] > 0 and counts["scatter"] > 0
        assert points[-1].op == "sum" and points[-1].step == len(acts)
        assert [p.step for p in points] == sorted(p.step for p in points)
        waited = {}
        for step, a in enumerate(acts):
            if type(a) is A.Wait:
                waited[a.tag] = step
        for p in points:
            if p.op == "gather":   # right after the wait of the weight's arrival
                assert p.step == waited[p.action.tag] and type(acts[p.step]) is A.Wait
            elif p.op == "scatter":   # before the gradient leaves, and before its whole NCCL group
                issued = acts.index(p.action)
                assert p.step <= issued
                batch = getattr(p.action, "batch", None)
                if batch is not None:
                    assert all(getattr(x, "batch", None) != batch for x in acts[:p.step] if type(x) in A.P2P)
                else:
                    assert p.step == issued


@pytest.mark.parametrize("schedule,kwargs", PLANS, ids=IDS)
@pytest.mark.parametrize("size", [2, 4])
def test_per_gpu_plan_has_the_lanes_and_the_meetings_and_passes_nccl(schedule, kwargs, size):
    plan = _plan(schedule, kwargs)
    gpus = lanes(plan, size)
    V = plan.num_ranks
    assert gpus.num_ranks == V * size
    meetings = {}
    for gpu, acts in enumerate(gpus.actions):
        v, c = divmod(gpu, size)
        mine = [a for a in acts if type(a) is MemberCollectiveStart]
        assert len(mine) == len(member_points(plan.actions[v], v))
        assert all(a.ranks == tuple(range(v * size, (v + 1) * size)) for a in mine)
        meetings.setdefault(v, []).append([(a.tag, a.op) for a in mine])
        lane = [a for a in acts if type(a) is not MemberCollectiveStart and not (
            type(a) is A.Wait and a.tag in {m.tag for m in mine})]
        assert len(lane) == len(plan.actions[v])
        for a, original in zip(lane, plan.actions[v]):
            assert type(a) is type(original)
            if hasattr(a, "peer"):
                assert a.peer == original.peer * size + c
            if hasattr(a, "ranks"):
                assert a.ranks == tuple(r * size + c for r in original.ranks)
    for v, lists in meetings.items():   # every member meets in the same order
        assert all(x == lists[0] for x in lists)
    check_nccl_order(gpus, MODES)
    validate_plan(plan, context_parallel=size)


def _swap_two_meetings(gpus, gpu):
    """``gpus`` with two of ``gpu``'s member collectives (with their waits) issued in the other order."""
    acts = list(gpus.actions[gpu])
    at = [i for i, a in enumerate(acts) if type(a) is MemberCollectiveStart]
    i, j = at[1], at[2]
    acts[i], acts[j] = acts[j], acts[i]
    acts[i + 1], acts[j + 1] = acts[j + 1], acts[i + 1]
    actions = list(gpus.actions)
    actions[gpu] = acts
    return dataclasses.replace(gpus, actions=actions)


@pytest.mark.parametrize("mode", MODES)
def test_members_meeting_in_different_orders_deadlock(mode):
    gpus = lanes(_plan(*PLANS[0]), 2)
    check_nccl_order(gpus, (mode,))
    with pytest.raises(PlanError) as info:
        check_nccl_order(_swap_two_meetings(gpus, 1), (mode,), lazy=False)
    text = str(info.value)
    assert "deadlock" in text and "rank 0 step" in text and "rank 1" in text   # the two members of virtual rank 0
    assert info.value.rank in (0, 1)


def test_a_meeting_inside_an_nccl_group_is_refused():
    plan = _plan(*PLANS[5])   # weipipe: a rank's sends and receives of one exchange are one NCCL group
    gpus = lanes(plan, 2)
    v = 1
    starts = plan.actions[v]
    first = next(i for i, a in enumerate(starts) if type(a) in A.P2P and a.batch is not None
                 and type(starts[i + 1]) in A.P2P and starts[i + 1].batch == a.batch)
    actions = list(gpus.actions)
    for gpu in (2 * v, 2 * v + 1):   # both members: they still meet in one order
        acts = list(actions[gpu])
        at = [i for i, a in enumerate(acts) if type(a) in A.P2P and a.batch == starts[first].batch][1]
        acts[at:at] = [MemberCollectiveStart(10 ** 6, (2 * v, 2 * v + 1), "scatter", 0), A.Wait(10 ** 6)]
        actions[gpu] = acts
    with pytest.raises(PlanError, match="not adjacent"):
        check_nccl_order(dataclasses.replace(gpus, actions=actions), MODES)


def test_the_spread_layout_has_no_per_gpu_plan_with_context_parallelism():
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=8, num_microbatches=2,
                      ownership="spread", shards_per_rank=2)
    assert plan.ownership == "spread"
    validate_plan(plan)
    with pytest.raises(PlanError, match="spread layout"):
        validate_plan(plan, context_parallel=2)


def test_activation_plans_are_not_lanes():
    with pytest.raises(PlanError, match="weight passing"):
        lanes(build_plan("1f1b", num_ranks=2, num_layers=2, num_microbatches=2), 2)


def test_sweep_checks_owner_weight_plans_with_members():
    result = run_sweep(ranks=[2, 3], microbatches=[1, 2], full_product_max_ranks=2,
                       schedules=("tawpipe", "tawpipe-spread", "weipipe", "1f1b"), context_parallel=(2,))
    assert not result.failures, result.failures[:2]
    owner = result.by_schedule["tawpipe"] + result.by_schedule["weipipe"]
    assert 0 < result.context_parallel[2] <= owner
    assert set(result.context_parallel) == {2}
