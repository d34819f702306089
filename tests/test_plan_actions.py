"""Action set, plan text forms and grid printing."""

import json

import pytest

from megatron_tawpipe.plan import (SCHEDULES, Backward, BackwardInput, BackwardWeight, Forward,
                                   Plan, SendStart, build_plan, split_backward, validate_plan)
from megatron_tawpipe.plan import actions as A


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_json_and_csv_round_trip(schedule):
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=4)
    for text, parse in ((plan.to_json(), Plan.from_json), (plan.to_csv(), Plan.from_csv)):
        again = parse(text)
        assert again.actions == plan.actions
        assert again.meta() == plan.meta()
    validate_plan(Plan.from_csv(plan.to_csv()))


def test_json_is_plain_data():
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_microbatches=1)
    doc = json.loads(plan.to_json())
    first = doc["actions"][0][0]
    assert first == {"op": "LoadWeights", "shard": 0, "buf": "w0"}
    ops = {d["op"] for acts in doc["actions"] for d in acts}
    assert {"Forward", "Backward", "BroadcastStart", "ReduceStart", "SendStart", "RecvStart",
            "Wait", "AccumulateToOwner", "ReplicatedAllReduceStart", "OptimizerStep"} <= ops


def test_comm_actions_carry_what_an_executor_needs():
    plan = build_plan("tawpipe", num_ranks=8, num_groups=2, num_layers=16, num_microbatches=2)
    sends = [(r, a) for r, acts in enumerate(plan.actions) for a in acts if type(a) is SendStart]
    assert sends
    for r, a in sends:
        assert a.peer != r and a.kind in ("weight", "grad") and a.size == 1.0
        assert a.link == plan.link_between(r, a.peer)
    # Every distinct collective member set is reported once per channel.
    comms = plan.communicators()
    assert ((0, 1, 2, 3), "weight") in comms and ((4, 5, 6, 7), "grad") in comms
    assert (tuple(range(8)), "replicated") in comms


def test_grid_shows_every_rank_and_step():
    plan = build_plan("1f1b", num_ranks=3, num_microbatches=4)
    grid = plan.grid(compute_only=True).splitlines()
    assert grid[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    assert grid[1].split() == ["0", "F0.0", "F0.1", "F0.2"]
    assert grid[2].split() == ["1", "F1.0", "F1.1", "B0.2"]
    full = plan.grid()
    assert "sa1>1" in full and "w(ra1<0)" in full     # act send to rank 1 / wait on receive


def test_short_codes():
    assert A.short(Forward(3, 1, "w0")) == "F3.1"
    assert A.short(Backward(3, 1, "w0", "g1")) == "B3.1"
    send = A.SendStart(7, 2, "w1", "weight", 5, "inter")
    assert A.short(send) == "sw5>2"
    assert A.short(A.Wait(7), {7: send}) == "w(sw5>2)"
    assert "peer=2" in A.describe(send)


def test_split_backward_keeps_the_plan_sound():
    plan = build_plan("weipipe", num_ranks=4, num_groups=2, num_microbatches=2)
    split = split_backward(plan)
    kinds = {type(a) for acts in split.actions for a in acts}
    assert Backward not in kinds and {BackwardInput, BackwardWeight} <= kinds
    validate_plan(split)


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_plan("zigzag", num_ranks=2)
