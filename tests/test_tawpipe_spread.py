"""TawPipe's spread ownership layout (each group keeps a 1/D slice of every shard) as plans: sound under the
validator (NCCL's rules included), refused where a rule is broken, the same bytes between nodes as one owner
with the cache, and what the simulator predicts for it."""

import dataclasses

import pytest
from dataclasses import replace

from megatron_tawpipe.plan import Plan, PlanError, actions as A, build_plan, validate_plan
from megatron_tawpipe.plan.sweep import run_sweep
from megatron_tawpipe.plan.traffic import link_bytes
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.layout_choice import LayoutRequest, choose_layout
from megatron_tawpipe.sim.ownership import spread_problem
from megatron_tawpipe.sim.simulate import simulate


def spread(D, G, N=2, **kw):
    kw.setdefault("num_layers", D * G)
    return build_plan("tawpipe", num_ranks=D * G, num_groups=D, num_microbatches=N, ownership="spread", **kw)


SHAPES = [(2, 1), (2, 2), (3, 1), (3, 2), (4, 2), (2, 3)]


@pytest.mark.parametrize("D,G", SHAPES)
@pytest.mark.parametrize("cache", [True, False])
def test_spread_plans_are_sound_with_every_option(D, G, cache):
    for N, chunk in [(1, 1), (3, 1), (4, 2)]:
        for overlap in (True, False):
            for early in (True, False):
                for layers in (D * G, D * G + (D * G + 1) // 2):      # equal shards, and the first ones larger
                    plan = spread(D, G, N, chunk=chunk, cache=cache, overlap=overlap, early_grads=early,
                                  num_layers=layers)
                    validate_plan(plan)
                    assert plan.spread and plan.options["ownership"] == "spread"


@pytest.mark.parametrize("D,G", SHAPES)
def test_every_group_keeps_one_slice_of_every_shard(D, G):
    plan = spread(D, G, num_layers=2 * D * G)
    for s in range(plan.num_shards):
        holders = sorted(plan.holders(s))
        assert [h // G for h in holders] == list(range(D))                 # one rank in every group ...
        assert len({h % G for h in holders}) == 1                          # ... with the same local index
    for r in range(plan.num_ranks):
        assert len(plan.shards_held_by(r)) == D                            # D slices of 1/D: one shard's worth
        assert plan.layers_held_by(r) == pytest.approx(2.0)
    gathers = [a for acts in plan.actions for a in acts if isinstance(a, A.AllGatherStart)]
    scatters = [a for acts in plan.actions for a in acts if isinstance(a, A.ReduceScatterStart)]
    assert all(a.ranks == tuple(sorted(plan.holders(a.shard))) for a in gathers + scatters)
    # with the cache: each shard gathered and reduce-scattered once per iteration, by each of its D holders
    assert len(gathers) == len(scatters) == D * plan.num_shards
    assert not any(isinstance(a, A.LoadWeights) for acts in plan.actions for a in acts)


def test_the_gradients_leave_after_each_shards_last_backward():
    """Each shard's reduce-scatter starts while the group computes its next visit (after that visit's first
    micro-batch), not after the whole backward."""
    plan = spread(3, 2, N=4, chunk=4, num_layers=12)
    acts = plan.actions[0]
    compute = [i for i, a in enumerate(acts) if isinstance(a, A.Backward)]
    starts = {a.shard: i for i, a in enumerate(acts) if isinstance(a, A.ReduceScatterStart)}
    last_backward = {a.shard: i for i, a in enumerate(acts) if isinstance(a, A.Backward)}
    for s in (1, 2):
        later = [i for i in compute if i > last_backward[s]]
        assert later[0] < starts[s] < later[-1], (s, starts[s], later)      # inside the next visit
    late = spread(3, 2, N=4, chunk=4, num_layers=12, early_grads=False).actions[0]
    late_start = [i for i, a in enumerate(late) if isinstance(a, A.ReduceScatterStart) and a.shard == 1][0]
    assert all(not isinstance(a, (A.Backward, A.Forward)) for a in late[late_start:])   # after the whole backward


@pytest.mark.parametrize("D,G", [(2, 2), (3, 2), (4, 1)])
def test_same_bytes_between_nodes_as_one_owner_with_the_cache(D, G):
    owner = build_plan("tawpipe", num_ranks=D * G, num_groups=D, num_microbatches=3, cache=True)
    assert link_bytes(spread(D, G, 3), 1.0)["inter"] == pytest.approx(link_bytes(owner, 1.0)["inter"])
    assert link_bytes(spread(D, G, 3), 1.0)["inter"] == pytest.approx(2 * D * G * (D - 1))


def test_json_and_csv_keep_the_layout():
    plan = spread(3, 2)
    for again in (Plan.from_json(plan.to_json()), Plan.from_csv(plan.to_csv())):
        assert again.spread and again.actions == plan.actions and again.replicas == plan.replicas
        validate_plan(again)


def _edit(plan, rank, fn):
    actions = [list(x) for x in plan.actions]
    actions[rank] = fn(actions[rank])
    return dataclasses.replace(plan, actions=actions)


def _refused(plan, *words):
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_validator_refuses_what_breaks_the_layout():
    plan = spread(3, 1, N=1)
    first = lambda acts, t: next(i for i, a in enumerate(acts) if isinstance(a, t))  # noqa: E731

    # a holder loading its slice as if it were the whole shard
    def load(acts):
        i = first(acts, A.AllGatherStart)
        acts.insert(i, A.LoadWeights(acts[i].shard, "w9"))
        return acts
    _refused(_edit(dataclasses.replace(plan, max_weight_buffers=9), 0, load), "slice", "AllGatherStart")

    # a backward straight into 'main', which holds one slice
    def into_main(acts):
        i = first(acts, A.Backward)
        a = acts[i]
        acts[i] = A.Backward(a.mb, a.shard, a.wbuf, A.MAIN)
        return acts
    _refused(_edit(plan, 0, into_main), "one slice")

    # accumulating the group's whole gradient into a slice, without its reduce-scatter (on every holder)
    tag = next(a.tag for a in plan.actions[0] if isinstance(a, A.ReduceScatterStart))
    no_scatter = plan
    for r in range(3):
        no_scatter = _edit(no_scatter, r, lambda acts: [a for a in acts if getattr(a, "tag", None) != tag])
    _refused(no_scatter, "only the result of its reduce-scatter can be accumulated")

    # two gathers issued in another order on one holder than on the others
    def swap(acts):
        idx = [i for i, a in enumerate(acts) if isinstance(a, A.AllGatherStart)]
        i, j = idx[0], idx[1]
        acts[i], acts[j] = acts[j], acts[i]
        return acts
    _refused(_edit(plan, 0, swap), "order")

    # an all-reduce where the layout needs a reduce-scatter (on every holder)
    def all_reduce(acts):
        i = first(acts, A.ReduceScatterStart)
        a = acts[i]
        acts[i] = A.AllReduceStart(a.tag, a.ranks, a.buf, a.kind, a.shard, a.link, a.size)
        return acts
    everywhere = plan
    for r in range(3):
        everywhere = _edit(everywhere, r, all_reduce)
    _refused(everywhere, "reduce-scattered to the holders", "not all-reduced")


def test_the_planner_refuses_what_the_layout_cannot_do():
    with pytest.raises(ValueError, match="two or more scheduling groups"):
        spread(1, 4)
    with pytest.raises(ValueError, match="replicate_first"):
        spread(2, 2, replicate_first=True)
    with pytest.raises(ValueError, match="no stagger"):
        spread(3, 1, stagger=True)
    with pytest.raises(ValueError, match="ownership"):
        build_plan("tawpipe", num_ranks=4, num_groups=2, ownership="shared")


def test_the_nccl_sweep_covers_the_layout():
    result = run_sweep([2, 3, 4], [1, 2], full_product_max_ranks=2, schedules=["tawpipe-spread"], report=True)
    assert not result.failures, result.failures[:2]
    assert result.by_schedule["tawpipe-spread"] > 100
    assert result.device_order_ok["tawpipe-spread"] == result.checked     # one issue order across a GPU's too


def _cost(inter_bw):
    return CostModel(layer_forward=0.025, layer_backward=0.05, layer_recompute=0.0, recompute=False,
                     params_per_layer=800_000, dtype_bytes=4, grad_bytes=4, activation_bytes=1e6,
                     tokens_per_microbatch=3072, inter=Link(inter_bw, 20e-6), intra=Link(0.6e9, 5e-6))


def test_the_simulator_prices_the_layout_and_auto_keeps_the_faster():
    """3 groups of 2 ranks, 2 layers per shard, 4 micro-batches in one visit, 300 Mbit/s: the one owner's
    staggered start and its incoming link at the end cost it against the spread layout."""
    def run(ownership, bw=37.5e6):
        plan = build_plan("tawpipe", num_ranks=6, num_groups=3, num_layers=12, num_microbatches=4, chunk=4,
                          cache=True, ownership=ownership)
        validate_plan(plan)
        return simulate(plan, _cost(bw))
    owner, spread_ = run("owner"), run("spread")
    assert spread_.link_bytes["inter"] == pytest.approx(owner.link_bytes["inter"])
    assert spread_.tokens_per_sec_per_rank > 1.05 * owner.tokens_per_sec_per_rank
    assert spread_.bubble_ratio < owner.bubble_ratio
    # auto, with the rest of this layout fixed, keeps the faster; with one group only one owner applies
    request = LayoutRequest(shards_per_rank=1, replicate_first=False, cache=True, microbatches_per_visit=4,
                            replicated_reduce="hierarchical")
    choice = choose_layout(request, _cost(37.5e6), 6, 3, 12, [4])
    assert choice.chosen.ownership == "spread" and {p.layout.ownership for p in choice.priced} == {"owner", "spread"}
    assert choice.chosen_priced.iteration_time == pytest.approx(spread_.iteration_time)
    assert choice.runner_up.iteration_time == pytest.approx(owner.iteration_time)
    one = choose_layout(replace(request, cache=None), _cost(37.5e6), 6, 1, 12, [4])
    assert one.chosen.ownership == "owner" and {p.layout.ownership for p in one.priced} == {"owner"}
    assert spread_problem(1) and spread_problem(3, replicate_first=True) and not spread_problem(3)


def test_the_simulator_flags_refuse_what_the_layout_cannot_do_in_one_line():
    import argparse

    from megatron_tawpipe.cli.plan_args import add_model_args, check_spread, cost_model, planner_options, run_one

    p = argparse.ArgumentParser()
    add_model_args(p)
    for flags, words in ((["--groups", "1"], "--groups 1"), (["--replicate-first-shard"], "--replicate-first-shard"),
                         (["--flat"], "--flat")):
        args = p.parse_args(["--ranks", "4", "--groups", "2", "--tawpipe-ownership", "spread"] + flags)
        with pytest.raises(ValueError, match=f"--tawpipe-ownership spread with {words}"):
            check_spread("tawpipe", args)
    args = p.parse_args(["--ranks", "6", "--groups", "3", "--num-layers", "6", "--num-microbatches", "2",
                         "--tawpipe-ownership", "auto", "--inter-bw", "1GB/s"])
    with pytest.raises(ValueError, match="auto picks a layout by simulating both"):
        planner_options("tawpipe", args)       # a plan to build needs owner or spread
    plan, result = run_one("tawpipe", args, cost_model(args))
    assert set(result.options["ownership_speeds"]) == {"owner", "spread"}
    choice = result.options["layout_choice"]     # pretrain_llama.py's decision, on the simulator's cost model
    assert plan.spread == (choice["layout"]["ownership"] == "spread")
    assert result.iteration_time == pytest.approx(choice["predicted_iteration_time"])
    assert choice["runner_up_iteration_time"] >= choice["predicted_iteration_time"] * (1 - 0.002)
