"""TawPipe with several shards per rank (``--tawpipe-shards-per-rank``) as plans: sound under the validator
(NCCL's rules included) in both ownership layouts, each rank owning or holding its share, the same bytes
between nodes, refused where the layers are too few or the ranks' shares unequal, and the smaller pieces at the
iteration's boundary priced by the simulator."""

import dataclasses

import pytest

from megatron_tawpipe.plan import PlanError, actions as A, build_plan, read_plan, validate_plan
from megatron_tawpipe.plan.sweep import plan_cases, run_sweep
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.simulate import simulate


def plan(D, G, V=2, N=2, layers=None, **kw):
    return build_plan("tawpipe", num_ranks=D * G, num_groups=D, num_microbatches=N,
                      num_layers=layers or V * D * G, shards_per_rank=V, **kw)


@pytest.mark.parametrize("D,G,ownership", [(D, G, o) for D, G in [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3)]
                                             for o in ("owner", "spread") if D > 1 or o == "owner"])
def test_plans_are_sound_and_every_rank_has_its_share(D, G, ownership):
    for V, N, chunk, cache in [(2, 2, 1, True), (2, 4, 2, False), (3, 3, 3, True)]:
        p = plan(D, G, V, N, chunk=chunk, cache=cache, ownership=ownership)
        validate_plan(p)
        P = D * G
        assert p.num_shards == V * P and p.options["shards_per_rank"] == V
        assert sorted(p.owners) == sorted(list(range(P)) * V)                  # V shards owned by every rank
        for r in range(P):
            held = p.shards_held_by(r)
            assert len(held) == (V * D if ownership == "spread" else V)        # slices of 1/D, or whole shards
            assert p.layers_held_by(r) == pytest.approx(V)                     # one layer per shard here
        assert {a.shard for acts in p.actions for a in acts if isinstance(a, A.Forward)} == set(range(V * P))


def test_the_same_bytes_between_nodes_in_smaller_pieces():
    """Every shard gathered and reduce-scattered once per iteration either way: the bytes between nodes do not
    change, only the size of each transfer (half, with two shards per rank)."""
    cost = _cost(37.5e6)
    for ownership in ("owner", "spread"):
        one = simulate(plan(3, 2, V=1, N=4, layers=12, chunk=4, ownership=ownership), cost)
        two = simulate(plan(3, 2, V=2, N=4, layers=12, chunk=4, ownership=ownership), cost)
        assert two.link_bytes["inter"] == pytest.approx(one.link_bytes["inter"])
    gathers = [a for acts in plan(3, 2, N=4, layers=12, chunk=4, ownership="spread").actions for a in acts
               if isinstance(a, A.AllGatherStart)]
    assert len(gathers) == 3 * 12 and all(a.size == 1.0 for a in gathers)     # 12 shards of 1 layer, 3 holders


def test_the_validator_refuses_unequal_shares():
    p = plan(2, 2, V=2, ownership="owner")
    owners = list(p.owners)
    owners[owners.index(1)] = 0              # rank 0 owns three shards, rank 1 one
    with pytest.raises(PlanError, match="every rank to own the same number of shards"):
        validate_plan(dataclasses.replace(p, owners=tuple(owners)))


def test_the_planner_refuses_too_few_layers():
    with pytest.raises(ValueError, match=r"at least the number of shards \(8: 2 per rank\)"):
        plan(2, 2, V=2, layers=7)
    with pytest.raises(ValueError, match="shards_per_rank"):
        plan(2, 2, V=0, layers=4)


def test_plan_files_keep_the_shards(tmp_path):
    p = plan(3, 2, N=4, layers=12, chunk=4, ownership="spread")
    for name in ("p.json", "p.csv"):
        path = tmp_path / name
        path.write_text(p.to_json() if name.endswith("json") else p.to_csv())
        again = read_plan(str(path))
        assert again.actions == p.actions and again.owners == p.owners and again.shard_layers == p.shard_layers
        validate_plan(again)


def test_the_nccl_sweep_covers_two_shards_per_rank():
    cases = [kw for _, kw in plan_cases([2, 4], [2], full_product_max_ranks=2, schedules=["tawpipe", "tawpipe-spread"])
             if kw.get("shards_per_rank") == 2]
    assert len(cases) > 20 and any(kw.get("ownership") == "spread" for kw in cases)
    assert any(kw.get("replicate_first") for kw in cases)
    result = run_sweep([2, 4], [2], full_product_max_ranks=2, schedules=["tawpipe", "tawpipe-spread"], report=True)
    assert not result.failures, result.failures[:2]


def _cost(inter_bw):
    return CostModel(layer_forward=0.025, layer_backward=0.05, layer_recompute=0.0, recompute=False,
                     params_per_layer=800_000, dtype_bytes=4, grad_bytes=4, activation_bytes=1e6,
                     tokens_per_microbatch=3072, inter=Link(inter_bw, 20e-6), intra=Link(0.6e9, 5e-6))


def test_smaller_pieces_at_the_iteration_boundary_are_faster_where_the_link_binds():
    """3 groups of 2 ranks, 12 layers, 4 micro-batches in one visit, 300 Mbit/s: the last gradients and the first
    weights of an iteration, which no compute hides, cross the node links in pieces of one layer instead of two;
    the weight buffers are half the size."""
    one = simulate(plan(3, 2, V=1, N=4, layers=12, chunk=4, ownership="spread"), _cost(37.5e6))
    two = simulate(plan(3, 2, V=2, N=4, layers=12, chunk=4, ownership="spread"), _cost(37.5e6))
    assert two.tokens_per_sec_per_rank > 1.02 * one.tokens_per_sec_per_rank
    assert two.bubble_ratio < one.bubble_ratio
