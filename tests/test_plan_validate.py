"""The validator accepts every planner's output over the grid and rejects
broken plans with an error that names the rank, the step and the action."""

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from megatron_tawpipe.plan import (AccumulateToOwner, Backward, Forward, PlanError, RecvStart,
                                   ReplicatedAllReduceStart, SendStart, Wait, build_plan,
                                   validate_plan)
from megatron_tawpipe.plan import actions as A

# Every planner the issue names; variants of tawpipe are checked further below.
SCHEDULES = ("weipipe", "weipipe-naive", "tawpipe", "tawpipe-nooverlap", "tawpipe-flat",
             "gpipe", "1f1b", "interleaved")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_grid_point(job):
    """Validate ``schedule`` for P ranks over D | P, L/P in 1..3, N in 1..6;
    return the failures as text."""
    schedule, P = job
    failures = []
    for D in divisors(P):
        for layers_per_rank in (1, 2, 3):
            for N in range(1, 7):
                try:
                    plan = build_plan(schedule, num_ranks=P, num_groups=D,
                                      num_layers=layers_per_rank * P, num_microbatches=N)
                    report = validate_plan(plan)
                    assert report.contributions == plan.num_streams * N * plan.num_shards
                    assert sum(plan.shard_layers) == layers_per_rank * P and not plan.uneven
                except Exception as e:  # collected, reported by the test below
                    failures.append(f"P={P} D={D} L={layers_per_rank * P} N={N}: {e!r}")
    return failures


@pytest.fixture(scope="module")
def grid_failures():
    """The grid is pure Python and embarrassingly parallel: use the machine's
    cores (forked workers, nothing but this package runs in them)."""
    jobs = [(s, P) for P in range(8, 1, -1) for s in SCHEDULES]
    workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else os.cpu_count() or 1)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            return dict(zip(jobs, ex.map(check_grid_point, jobs)))
    return {job: check_grid_point(job) for job in jobs}


@pytest.mark.parametrize("P", range(2, 9))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grid_is_accepted(grid_failures, schedule, P):
    """P in 2..8, D | P, L/P in 1..3, N in 1..6 (N per rank for weight passing,
    per pipeline for activation passing)."""
    assert grid_failures[(schedule, P)] == []


@pytest.mark.parametrize("options", [
    dict(cache=False, drain=True),      # the reference arrangement, "tawpipe-paper"
    dict(cache=False), dict(cache=True), dict(chunk=2), dict(chunk=4, cache=False),
    dict(prefetch=1), dict(prefetch=4, cache=False), dict(stagger=False), dict(drain=True),
    dict(overlap=False, cache=True), dict(groups=2), dict(drain=True, stagger=False),
    dict(replicate_first=True), dict(replicate_first=True, chunk=2), dict(replicate_first=True, stagger=True),
    dict(replicate_first=True, cache=False), dict(replicate_first=True, overlap=False),
])
def test_tawpipe_options_are_accepted(options):
    for P in (4, 6, 8):
        for D in divisors(P):
            if "groups" in options and P % options["groups"]:
                continue
            if options.get("replicate_first") and D < 2:
                continue
            for N in (1, 3, 5):
                validate_plan(build_plan("tawpipe", num_ranks=P, num_groups=D,
                                         num_microbatches=N, **options))


def test_weipipe_ring_is_right_for_every_P():
    # Rank r computes forward shard (r+t) mod P and backward shard (P-1-r-t) mod P at
    # turn t; every compute must find that shard in its buffer (checked symbolically).
    for P in range(2, 17):
        for interleave in ("weipipe", "weipipe-naive"):
            validate_plan(build_plan(interleave, num_ranks=P, num_microbatches=3))


# ----------------------------------------------------------- broken plans
def mutable(plan):
    return dataclasses.replace(plan, actions=[list(x) for x in plan.actions])


def find(plan, rank, cls, pred=lambda a: True, start=0):
    for i, a in enumerate(plan.actions[rank][start:], start):
        if type(a) is cls and pred(a):
            return i
    raise LookupError(cls)


def expect(plan, rank, step, action, *words):
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    err = info.value
    assert (err.rank, err.step, err.action) == (rank, step, action), str(err)
    text = str(err)
    assert text.startswith(f"rank {rank}, step {step}, {type(action).__name__}("), text
    for w in words:
        assert w in text, text
    return text


def test_swapped_shard_is_rejected():
    """WeiPipe rank 2 uses its backward-copy buffer for a forward (the kind of slot
    mix-up the reference implementation makes for P > 2)."""
    plan = mutable(build_plan("weipipe", num_ranks=4, num_microbatches=2))
    acts = plan.actions[2]
    i = find(plan, 2, Forward, lambda a: a.mb == 1)
    j = find(plan, 2, Backward, start=i)
    f, b = acts[i], acts[j]
    assert f.shard != b.shard
    acts[i] = Forward(f.mb, f.shard, b.wbuf)
    expect(plan, 2, i, acts[i], f"holds shard {b.shard}, not shard {f.shard}")


def test_swapped_shards_in_transfer_are_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=1))
    i = find(plan, 0, RecvStart)
    recv = plan.actions[0][i]
    plan.actions[0][i] = dataclasses.replace(recv, shard=recv.shard + 1)
    expect(plan, 0, i, plan.actions[0][i], "shard differs from the matching send")


def test_missing_receive_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=8, num_groups=2, num_microbatches=2))
    i = find(plan, 5, RecvStart, lambda a: a.kind == "weight")
    recv = plan.actions[5][i]
    w = find(plan, 5, Wait, lambda a: a.tag == recv.tag)
    del plan.actions[5][w], plan.actions[5][i]
    s = find(plan, recv.peer, SendStart, lambda a: a.tag == recv.tag)
    expect(plan, recv.peer, s, plan.actions[recv.peer][s], "no matching receive")


def test_gradient_sent_twice_is_rejected():
    """A staging rank sends its group's partial gradient to the owner a second time
    (and the owner accumulates it again)."""
    plan = mutable(build_plan("tawpipe-paper", num_ranks=4, num_groups=2, num_microbatches=1))
    src = next(r for r in range(4) for a in plan.actions[r]
               if type(a) is SendStart and a.kind == "grad")
    i = find(plan, src, SendStart, lambda a: a.kind == "grad")
    send = plan.actions[src][i]
    dst = send.peer
    tag = 10_000
    j = find(plan, src, Wait, lambda a: a.tag == send.tag)
    plan.actions[src][j + 1:j + 1] = [dataclasses.replace(send, tag=tag), Wait(tag)]
    k = find(plan, dst, AccumulateToOwner, lambda a: a.shard == send.shard)
    recv = plan.actions[dst][find(plan, dst, RecvStart, lambda a: a.tag == send.tag)]
    extra = f"g{plan.max_grad_buffers}"    # a buffer of its own: no hazard with the plan's
    plan.max_grad_buffers += 1
    plan.actions[dst][k + 1:k + 1] = [dataclasses.replace(recv, tag=tag, buf=extra), Wait(tag),
                                      AccumulateToOwner(send.shard, extra)]
    expect(plan, src, j + 1, plan.actions[src][j + 1], "already left", "counted twice")


def test_gradient_accumulated_twice_is_rejected():
    plan = mutable(build_plan("weipipe", num_ranks=3, num_microbatches=2))
    r = next(r for r in range(3) if any(type(a) is AccumulateToOwner for a in plan.actions[r]))
    i = find(plan, r, AccumulateToOwner)
    acc = plan.actions[r][i]
    plan.actions[r].insert(i + 1, acc)
    expect(plan, r, i + 1, acc, f"emptied at step {i}")


def test_deadlocking_order_is_rejected():
    """1F1B on 2 ranks where rank 0 waits for the output gradient of micro-batch 0
    before it has sent the activation that produces it."""
    plan = mutable(build_plan("1f1b", num_ranks=2, num_microbatches=2))
    acts = plan.actions[0]
    i = find(plan, 0, RecvStart, lambda a: a.kind == "actgrad")
    recv = acts.pop(i)
    wait = acts.pop(find(plan, 0, Wait, lambda a: a.tag == recv.tag))
    acts[0:0] = [recv, wait]
    text = expect(plan, 0, 1, wait, "deadlock", "have not posted")
    assert "rank 1 step" in text      # the other blocked rank is named too


def test_deadlock_between_blocking_sends_is_rejected():
    """Both ranks wait for their own send before posting the receive."""
    plan = mutable(build_plan("weipipe", num_ranks=2, num_microbatches=1, overlap=False))
    for r in (0, 1):
        acts = plan.actions[r]
        i = find(plan, r, SendStart)
        send = acts[i]
        acts.remove(Wait(send.tag))
        acts.insert(i + 1, Wait(send.tag))
        j = find(plan, r, RecvStart)
        recv = acts.pop(j)
        acts.insert(i + 2, recv)
    with pytest.raises(PlanError, match="deadlock"):
        validate_plan(plan)


def test_reading_a_buffer_still_being_received_is_rejected():
    plan = mutable(build_plan("weipipe", num_ranks=3, num_microbatches=1))
    acts = plan.actions[1]
    i = find(plan, 1, Forward, lambda a: a.shard == 2)
    recv_i = max(k for k in range(i) if type(acts[k]) is RecvStart and acts[k].buf == acts[i].wbuf)
    w = find(plan, 1, Wait, lambda a: a.tag == acts[recv_i].tag)
    acts.insert(i + 1, acts.pop(w))
    expect(plan, 1, i - 1, acts[i - 1], "transfer in flight")


def test_missing_backward_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=2))
    i = find(plan, 3, Backward, lambda a: a.mb == 1 and a.shard == 2)
    del plan.actions[3][i]
    with pytest.raises(PlanError, match="backward of micro-batch 1 reaches shard 1 but its next "
                                        "backward shard is 2"):
        validate_plan(plan)


def test_buffer_bound_is_enforced():
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=2)
    tight = dataclasses.replace(plan, max_weight_buffers=plan.max_weight_buffers - 1)
    with pytest.raises(PlanError, match="more than the plan's bound"):
        validate_plan(tight)


def test_only_the_owner_may_load_or_step():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=1))
    i = find(plan, 1, A.LoadWeights)
    plan.actions[1][i] = A.LoadWeights(0, plan.actions[1][i].buf)
    expect(plan, 1, i, plan.actions[1][i], "only the owner of shard 0")


def test_collective_member_mismatch_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=1, num_microbatches=1))
    i = find(plan, 2, A.BroadcastStart)
    a = plan.actions[2][i]
    plan.actions[2][i] = dataclasses.replace(a, root=(a.root + 1) % 4)
    with pytest.raises(PlanError, match="differs from the same collective"):
        validate_plan(plan)


def test_head_all_reduce_starts_before_the_last_backward_of_shard_0():
    """The head's replicated gradients are final after the last shard's last backward: their
    all-reduce starts then, overlapping the rest of the backward work."""
    for plan in (build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=2),
                 build_plan("weipipe", num_ranks=3, num_microbatches=2)):
        for acts in plan.actions:
            head = next(i for i, a in enumerate(acts)
                        if type(a) is ReplicatedAllReduceStart and a.part == "head")
            later = [a for a in acts[head:] if type(a) is Backward]
            assert later and all(a.shard != plan.num_shards - 1 for a in later)


def test_backward_after_its_replicated_all_reduce_started_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=2))
    r = 0
    i = find(plan, r, ReplicatedAllReduceStart, lambda a: a.part == "head")
    start = plan.actions[r].pop(i)
    j = max(k for k, a in enumerate(plan.actions[r])
            if type(a) is Backward and a.shard == plan.num_shards - 1)
    plan.actions[r].insert(j, start)      # started before the last shard's last backward
    expect(plan, r, j + 1, plan.actions[r][j + 1], "not final")


# ------------------------------------------------------ a shard held by one rank per group
def test_replicated_first_shard_is_held_and_stepped_by_one_rank_per_group():
    """--tawpipe-replicate-first-shard: shard 0 is loaded from local masters in every group (no
    transfer of its weights), its gradient all-reduced among its holders, then accumulated by each."""
    plan = build_plan("tawpipe", num_ranks=6, num_groups=3, num_layers=6, num_microbatches=2,
                      replicate_first=True)
    validate_plan(plan)
    assert plan.replicas == {0: (2, 4)} and plan.holders(0) == (0, 2, 4)
    assert plan.shards_held_by(2) == [0, 1] and plan.shards_owned_by(2) == [1]
    assert not [a for acts in plan.actions for a in acts
                if type(a) in (A.SendStart, A.RecvStart) and a.shard == 0]
    for r in range(6):
        reduces = [a for a in plan.actions[r] if type(a) is A.AllReduceStart]
        assert [(a.ranks, a.shard) for a in reduces] == ([((0, 2, 4), 0)] if r in (0, 2, 4) else [])
    again = type(plan).from_json(plan.to_json())
    assert again.replicas == plan.replicas and again.actions == plan.actions
    with pytest.raises(ValueError, match="at least 2 scheduling groups"):
        build_plan("tawpipe", num_ranks=4, num_groups=1, replicate_first=True)


def test_replicated_shard_missing_another_groups_gradient_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=2, replicate_first=True))
    for r in (0, 2):   # both holders skip the all-reduce: each steps with its own group's gradient only
        i = find(plan, r, A.AllReduceStart)
        tag = plan.actions[r][i].tag
        plan.actions[r] = [a for a in plan.actions[r] if getattr(a, "tag", None) != tag]
    with pytest.raises(PlanError, match="gradient of owned shard 0 is missing contributions"):
        validate_plan(plan)


def test_all_reduce_over_other_ranks_than_the_holders_is_rejected():
    plan = mutable(build_plan("tawpipe", num_ranks=6, num_groups=3, num_layers=6, num_microbatches=1,
                              replicate_first=True))
    tag = plan.actions[4][find(plan, 4, A.AllReduceStart)].tag
    plan.actions[4] = [a for a in plan.actions[4] if getattr(a, "tag", None) != tag]
    for r in (0, 2):
        i = find(plan, r, A.AllReduceStart)
        plan.actions[r][i] = dataclasses.replace(plan.actions[r][i], ranks=(0, 2))
    with pytest.raises(PlanError, match=r"not over its holders \[0, 2, 4\]"):
        validate_plan(plan)


def test_replicas_naming_the_owner_are_rejected():
    plan = dataclasses.replace(build_plan("tawpipe", num_ranks=4, num_groups=2, replicate_first=True),
                               replicas={0: (0,)})
    with pytest.raises(PlanError, match="other than its owner 0"):
        validate_plan(plan)
