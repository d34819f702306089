"""Plans under NCCL's ordering rules (plan/nccl.py): what gloo runs but a GPU cluster would hang on."""

import os

import pytest

from megatron_tawpipe.plan import Plan, PlanError, build_plan, validate_plan
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.connect import check_nccl_order, connection_warmup
from megatron_tawpipe.plan.nccl import ALL_MODES, MODES, NcclModel, batch_entries, entries_of
from megatron_tawpipe.plan.sweep import run_sweep

DATA = os.path.join(os.path.dirname(__file__), "data")


def _two_rank_plan(acts0, acts1) -> Plan:
    """A bare P = 2 activation-family plan around the given communication."""
    return Plan(schedule="hand", family="activation", num_ranks=2, num_groups=2, num_layers=2,
                num_microbatches=1, owners=(0, 1), streams=(0, 0), max_weight_buffers=0,
                max_grad_buffers=0, actions=[list(acts0), list(acts1)])


def _exchange(batched: bool, recv_first_on_1: bool = False):
    """Each rank sends one activation to the other and receives the other's."""
    b0, b1 = (1, 2) if batched else (None, None)
    s0 = A.SendStart(1, 1, "", "act", 0, "inter", mb=0, batch=b0)
    r0 = A.RecvStart(2, 1, "", "act", 1, "inter", mb=0, batch=b0)
    s1 = A.SendStart(2, 0, "", "act", 1, "inter", mb=0, batch=b1)
    r1 = A.RecvStart(1, 0, "", "act", 0, "inter", mb=0, batch=b1)
    first1 = [r1, s1] if recv_first_on_1 else [s1, r1]
    return _two_rank_plan([s0, r0, A.Wait(1), A.Wait(2)], first1 + [A.Wait(2), A.Wait(1)])


@pytest.mark.parametrize("mode", MODES)
def test_send_send_exchange_deadlocks_and_names_both_ranks(mode):
    plan = _exchange(batched=False)
    with pytest.raises(PlanError) as info:
        NcclModel(plan, mode).run()
    text = str(info.value)
    assert "deadlock" in text and "rank 0" in text and "rank 1" in text
    # Both heads are named: rank 0's send waits behind nothing, rank 1's send is its head.
    assert "SendStart(tag=1" in text or "sa0>1" in text
    assert "SendStart(tag=2" in text or "sa1>0" in text


@pytest.mark.parametrize("mode", MODES)
def test_batched_or_complementary_exchange_runs(mode):
    NcclModel(_exchange(batched=True), mode).run()
    NcclModel(_exchange(batched=False, recv_first_on_1=True), mode).run()


def test_crossed_pairing_is_reported_as_nccl_ignores_tags():
    """Two sends 0 -> 1 received in the other order: gloo matches by tag, NCCL by position."""
    a = A.SendStart(1, 1, "", "act", 0, "inter", mb=0)
    b = A.SendStart(2, 1, "", "act", 0, "inter", mb=1)
    ra = A.RecvStart(1, 0, "", "act", 0, "inter", mb=0)
    rb = A.RecvStart(2, 0, "", "act", 0, "inter", mb=1)
    plan = _two_rank_plan([a, b, A.Wait(1), A.Wait(2)], [rb, ra, A.Wait(1), A.Wait(2)])
    with pytest.raises(PlanError, match="NCCL ignores tags") as info:
        NcclModel(plan, "group").run()
    assert info.value.rank == 1 and info.value.step == 0


def test_partner_batched_on_another_communicator_is_reported():
    """In pair mode a batched send runs on the group communicator, an unbatched receive on the
    pair's: they never meet."""
    s = A.SendStart(1, 1, "", "act", 0, "inter", mb=0, batch=7)
    r = A.RecvStart(1, 0, "", "act", 0, "inter", mb=0)
    plan = _two_rank_plan([s, A.Wait(1)], [r, A.Wait(1)])
    with pytest.raises(PlanError, match="no partner"):
        NcclModel(plan, "pair").run()
    NcclModel(plan, "group").run()


def test_batch_must_be_adjacent_and_on_one_communicator():
    s = A.SendStart(1, 1, "", "act", 0, "inter", mb=0, batch=3)
    r = A.RecvStart(2, 1, "", "actgrad", 1, "inter", mb=0, batch=3)
    plan = _two_rank_plan([s, r, A.Wait(1), A.Wait(2)], [])
    with pytest.raises(PlanError, match="mixes communicators"):
        batch_entries(plan, 0, "group")
    r2 = A.RecvStart(2, 1, "", "act", 1, "inter", mb=0, batch=3)
    plan = _two_rank_plan([s, A.Wait(1), r2, A.Wait(2)], [])
    with pytest.raises(PlanError, match="not adjacent"):
        batch_entries(plan, 0, "group")


def test_lazy_pair_communicator_creation_blocks_the_host():
    """Rank 0 first talks to rank 1 on a new pair communicator, but rank 1 first needs
    rank 0's message on another channel, posted after that creation: pair mode hangs,
    eager (group) mode does not."""
    g = A.SendStart(1, 1, "", "actgrad", 0, "inter", mb=0)     # creates the actgrad pair comm
    s = A.SendStart(2, 1, "", "act", 0, "inter", mb=0)
    plan = _two_rank_plan(
        [g, s, A.Wait(2), A.Wait(1)],
        [A.RecvStart(2, 0, "", "act", 0, "inter", mb=0), A.Wait(2),
         A.RecvStart(1, 0, "", "actgrad", 0, "inter", mb=0), A.Wait(1)])
    with pytest.raises(PlanError, match="creating the actgrad point-to-point communicator"):
        NcclModel(plan, "pair").run()
    NcclModel(plan, "group").run()


@pytest.mark.parametrize("name", ["tawpipe_gloo_era_P2_D2.json", "tawpipe_gloo_era_P4_D2.json"])
def test_gloo_era_multigroup_tawpipe_plan_is_rejected(name):
    """The multi-group TawPipe plans of the gloo-only era: correct on gloo (the symbolic pass
    accepts them), deadlocked at the first inter-group weight fetch under NCCL's lazy pair communicators."""
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        plan = Plan.from_json(f.read())
    validate_plan(plan, nccl_modes=())
    # Its inter-group exchanges go opposite ways unbatched: on eager communicators each direction's process
    # group runs them side by side; created lazily, the pair communicators deadlock them.
    check_nccl_order(plan, ("group",))
    for mode in ("pair",):
        with pytest.raises(PlanError) as info:
            check_nccl_order(plan, (mode,))
        text = str(info.value)
        assert "deadlock" in text and "weight point-to-point" in text
        assert "SendStart" in text and info.value.rank is not None
        # Both sides of the stuck exchange are named with their steps.
        assert text.count("step") >= 2


@pytest.mark.parametrize("schedule,P,D,N,opts", [
    ("tawpipe", 2, 2, 2, {}), ("tawpipe", 4, 2, 3, {}), ("tawpipe", 8, 4, 2, {}),
    ("tawpipe-paper", 4, 2, 2, {}), ("tawpipe", 6, 3, 4, {"cache": False}),
    ("tawpipe", 8, 2, 4, {"chunk": 2}), ("weipipe", 5, 1, 3, {}), ("interleaved", 4, 2, 4, {}),
])
def test_planners_batch_every_transfer_and_pass(schedule, P, D, N, opts):
    layers = 2 * P if schedule == "interleaved" else P
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=N, num_layers=layers,
                      **opts)
    validate_plan(plan)
    p2p = [a for acts in plan.actions for a in acts if isinstance(a, A.P2P)]
    assert p2p and all(a.batch is not None for a in p2p)
    # The batch field survives the text forms, so outside tools see the grouping.
    assert Plan.from_csv(plan.to_csv()).actions == plan.actions
    assert Plan.from_json(plan.to_json()).actions == plan.actions


def test_sweep_small_range_passes():
    result = run_sweep(ranks=range(2, 5), microbatches=(1, 2), full_product_max_ranks=3)
    assert not result.failures, result.failures[:3]
    assert result.checked > 500
    assert set(result.by_schedule) == {"tawpipe", "tawpipe-spread", "weipipe", "weipipe-naive", "weipipe-zb1", "weipipe-zb2",
                                       "tawpipe-zb", "weipipe-interleave-zb", "weipipe-zb1-paired",
                                       "gpipe", "1f1b", "interleaved"}


# ---- lazy connection (NCCL_RUNTIME_CONNECT) and the executor's warm-up ------------------------------

def _crossed_first_uses() -> Plan:
    """Rank 0's first weight send and rank 1's first gradient send, each partnered late: safe once
    connected (each channel has its own FIFO), but each host blocks in its first call until the
    peer makes its first call of the same direction -- which the peer issues after its own."""
    w0 = A.SendStart(1, 1, "w", "weight", 0, "inter", batch=0)
    g0 = A.RecvStart(2, 1, "g", "grad", 0, "inter", batch=1)
    g1 = A.SendStart(2, 0, "g", "grad", 0, "inter", batch=0)
    w1 = A.RecvStart(1, 0, "w", "weight", 0, "inter", batch=1)
    return Plan(schedule="hand", family="weight", num_ranks=2, num_groups=2, num_layers=2,
                num_microbatches=1, owners=(0, 1), streams=(0, 0), max_weight_buffers=1,
                max_grad_buffers=1, actions=[[w0, g0, A.Wait(1), A.Wait(2)], [g1, w1, A.Wait(2), A.Wait(1)]])


def test_first_use_connection_blocks_the_host_and_the_warmup_prevents_it():
    plan = _crossed_first_uses()
    NcclModel(plan, "group").run()                       # connected up front: fine
    with pytest.raises(PlanError) as info:
        NcclModel(plan, "group", lazy=True).run()
    text = str(info.value)
    assert "lazily" in text and "0 -> 1 connection" in text and "1 -> 0 connection" in text
    warmup = connection_warmup(plan)
    NcclModel(plan, "group", lazy=True, prologue=warmup).run()
    check_nccl_order(plan, MODES)


def test_first_collective_of_a_size_waits_for_every_member():
    """A first all-reduce of a new size connects lazily: rank 2 reaches it only after a message
    that rank 0 sends after its own all-reduce."""
    ranks = (0, 1, 2)
    ar = A.AllReduceStart(1, ranks, "g", "grad", 0, "intra")
    send = A.SendStart(2, 2, "w", "weight", 0, "inter", batch=0)
    recv = A.RecvStart(2, 0, "w", "weight", 0, "inter", batch=0)
    plan = Plan(schedule="hand", family="weight", num_ranks=3, num_groups=1, num_layers=3,
                num_microbatches=1, owners=(0, 1, 2), streams=(0, 0, 0), max_weight_buffers=1,
                max_grad_buffers=1, actions=[[ar, send, A.Wait(2), A.Wait(1)], [ar, A.Wait(1)],
                                             [recv, A.Wait(2), ar, A.Wait(1)]])
    NcclModel(plan, "group").run()
    with pytest.raises(PlanError, match="first AllReduce"):
        NcclModel(plan, "group", lazy=True).run()
    NcclModel(plan, "group", lazy=True, prologue=connection_warmup(plan)).run()


@pytest.mark.parametrize("schedule,P,D,opts", [
    ("tawpipe", 4, 2, {}), ("tawpipe", 8, 4, {"replicate_first": True}), ("weipipe", 4, 1, {}),
    ("tawpipe-nooverlap", 8, 4, {}), ("tawpipe", 6, 3, {"num_layers": 9}),
])
def test_warmup_connects_each_connection_once_and_rescues_plans_that_would_hang(schedule, P, D, opts):
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=2, **opts)
    warmup = connection_warmup(plan)
    # Each directed pair of each point-to-point group and each collective kind and size, exactly once.
    model = NcclModel(plan, "group", lazy=True)
    needed = {key for r, entries in enumerate(model.entries) for e in entries for key in model.connections(r, e)}
    warm = NcclModel(plan, "group", lazy=True, prologue=warmup)
    made = [key for r in range(P) for e in warm.entries[r][:_starts(warmup[r], r)]
            for key in warm.connections(r, e)]
    assert needed == set(made)
    assert all(isinstance(a, A.Wait) or (a.batch is None or a.batch < 0) for acts in warmup for a in acts
               if not isinstance(a, A.Wait) and type(a) in A.P2P)
    # Without the warm-up these plans hang under the lazy rule; with it, every mode passes.
    with pytest.raises(PlanError, match="lazily"):
        NcclModel(plan, "group", lazy=True).run()
    check_nccl_order(plan, MODES)


def _starts(actions, rank: int) -> int:
    """Entries (batches or single starts) among ``actions`` of ``rank``."""
    return len(entries_of(list(actions), rank, "group"))


def test_device_wide_issue_order_is_reported_not_required():
    """One FIFO per GPU for all its communicators: the activation pipelines pass, the weight
    pipelines rely on their communicators progressing side by side (docs/nccl.md)."""
    assert "device" in ALL_MODES and "device" not in MODES
    NcclModel(build_plan("1f1b", num_ranks=4, num_groups=2, num_microbatches=4), "device").run()
    weipipe = build_plan("weipipe", num_ranks=4, num_groups=1, num_microbatches=2)
    validate_plan(weipipe)
    with pytest.raises(PlanError, match="device mode"):
        NcclModel(weipipe, "device").run()


@pytest.mark.parametrize("schedule,P,D", [("tawpipe", 4, 2), ("tawpipe", 6, 3), ("weipipe", 4, 1)])
def test_weight_passing_directions_have_process_groups_of_their_own(schedule, P, D):
    """The weight-passing runtime's point-to-point groups are one per channel and direction: every batch
    holds one direction, a rank has transfers both ways in flight at once (its gradients out to a higher
    rank while another's come in from above, say), and the plans pass NCCL's rules in every mode."""
    from megatron_tawpipe.plan.nccl import process_group

    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=2)
    both_ways = False
    for r, acts in enumerate(plan.actions):
        in_flight = {}
        for a in acts:
            if isinstance(a, A.Wait):
                in_flight.pop(a.tag, None)
            elif type(a) in (A.SendStart, A.RecvStart):
                key = process_group(a, r)
                assert key[0] == "p2p" and key[2] == ("up" if (r < a.peer) == (type(a) is A.SendStart) else "down")
                in_flight[a.tag] = key
                both_ways |= len({k[2] for k in in_flight.values() if k[1] == key[1]}) == 2
        for key, ops in batch_entries(plan, r, "group"):
            assert len({process_group(a, r) for _, a in ops}) == 1
    assert both_ways
    check_nccl_order(plan, MODES)


def test_unbatched_gradient_exchange_runs_both_ways_on_eager_groups():
    """Two ranks each send the other a gradient first: on the per-direction groups (eager) they run side
    by side; with lazily created pair communicators each host blocks creating its own."""
    s0 = A.SendStart(1, 1, "g0", "grad", 0, "inter")
    r0 = A.RecvStart(2, 1, "g1", "grad", 1, "inter")
    s1 = A.SendStart(2, 0, "g1", "grad", 1, "inter")
    r1 = A.RecvStart(1, 0, "g0", "grad", 0, "inter")
    plan = Plan(schedule="hand", family="weight", num_ranks=2, num_groups=2, num_layers=2, num_microbatches=1,
                owners=(0, 1), streams=(0, 1), max_weight_buffers=0, max_grad_buffers=2,
                actions=[[s0, r0, A.Wait(1), A.Wait(2)], [s1, r1, A.Wait(2), A.Wait(1)]])
    NcclModel(plan, "group").run()
    with pytest.raises(PlanError, match=r"deadlock.*grad point-to-point \(up: toward higher ranks\) communicator"):
        NcclModel(plan, "pair").run()
