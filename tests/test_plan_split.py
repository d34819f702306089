"""Deferred weight passes (plan/zero_bubble.py, sim/split.py): the split schedules validate (NCCL's rules
included), keep every dependency, and the simulator and memory model price them."""

from dataclasses import replace

import pytest

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan, split_backward, validate_plan
from megatron_tawpipe.plan.sweep import run_sweep
from megatron_tawpipe.plan.zero_bubble import defer_weight_passes
from megatron_tawpipe.sim import CostModel, simulate
from megatron_tawpipe.sim.plan_memory import activation_peaks
from megatron_tawpipe.sim.split import best_split, place_weight_passes

SHAPES = [(2, 1, 2), (2, 2, 3), (3, 1, 2), (4, 2, 2), (4, 4, 1), (6, 3, 2)]


def _compute(acts):
    return [(type(a), a.mb, a.shard) for a in acts if type(a) in A.COMPUTE]


@pytest.mark.parametrize("schedule", ["tawpipe-zb", "weipipe-interleave-zb"])
@pytest.mark.parametrize("P,D,N", SHAPES)
def test_split_schedules_keep_every_dependency(schedule, P, D, N):
    base = build_plan(schedule.replace("-zb", "").replace("-interleave", ""), num_ranks=P, num_groups=D,
                      num_microbatches=N)
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=N)
    validate_plan(plan)
    for r, (old, new) in enumerate(zip(base.actions, plan.actions)):
        assert A.Backward not in {type(a) for a in new}
        # the same actions, backwards split; the starts in the same order (NCCL), the waits too
        assert sorted(map(repr, (a for a in old if type(a) not in A.COMPUTE))) == \
            sorted(map(repr, (a for a in new if type(a) not in A.COMPUTE)))
        for kinds in (A.STARTS, (A.Wait,)):
            assert [a for a in old if type(a) in kinds] == [a for a in new if type(a) in kinds]
        order = _compute(new)
        for t, m, s in order:
            if t is A.BackwardWeight:
                assert order.index((A.BackwardInput, m, s)) < order.index((t, m, s)), (r, m, s)
        # input passes keep the plain plan's backward order, forwards theirs
        assert [(m, s) for t, m, s in order if t is A.BackwardInput] == \
            [(m, s) for t, m, s in _compute(old) if t is A.Backward]


def test_sweep_checks_the_split_schedules():
    result = run_sweep([2, 3, 4], [1, 2], full_product_max_ranks=3, schedules=["tawpipe-zb", "weipipe-interleave-zb"])
    assert not result.failures, result.failures[:1]
    assert result.by_schedule["tawpipe-zb"] > 50 and result.by_schedule["weipipe-interleave-zb"] == 7 * 2 * 2 * 2   # (P, D) pairs x N x overlap x splits


def test_latest_placement_moves_weight_passes_after_the_next_input_pass():
    plan = defer_weight_passes(build_plan("weipipe", num_ranks=4, num_microbatches=2), "latest")
    validate_plan(plan)
    moved = 0
    for acts in plan.actions:
        order = _compute(acts)
        for i, (t, m, s) in enumerate(order):
            if t is A.BackwardWeight and order[i - 1] != (A.BackwardInput, m, s):
                moved += 1
    assert moved > 0


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="choose must be one of"):
        defer_weight_passes(build_plan("weipipe", num_ranks=2), "soonest")


COST = CostModel.from_flops(hidden_size=4096, seq_length=16384, num_attention_heads=32, inter_bw="12.5GB/s")


def test_deferred_kernels_are_the_default_and_split_the_backward():
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2)
    assert COST.deferred_weight_gradients
    for s in range(plan.num_shards):
        whole = COST.backward_time(plan, s)
        assert COST.backward_input_time(plan, s) + COST.backward_weight_time(plan, s) == pytest.approx(whole)
        assert COST.backward_weight_time(plan, s) == pytest.approx(COST.layer_backward / 2)


@pytest.mark.parametrize("P,N", [(4, 1), (4, 2), (8, 1)])
def test_split_interleave_idles_less_than_weipipe(P, N):
    """WeiPipe-Interleave with deferred weight passes idles less than WeiPipe where the ring waits for
    weights (here P = 4 and 8 with one or two micro-batches per rank, 12.5 GB/s between nodes)."""
    plain = simulate(build_plan("weipipe", num_ranks=P, num_groups=2, num_microbatches=N), COST, record=False)
    split = simulate(build_plan("weipipe-interleave-zb", num_ranks=P, num_groups=2, num_microbatches=N), COST,
                     record=False)
    assert split.bubble_ratio <= plain.bubble_ratio + 1e-12
    zb1 = simulate(build_plan("weipipe-zb1", num_ranks=P, num_groups=2, num_microbatches=N), COST, record=False)
    assert zb1.bubble_ratio < plain.bubble_ratio


def test_idle_placement_is_never_slower_than_the_plain_split():
    for P, D, N in ((4, 2, 2), (4, 1, 2), (8, 2, 1)):
        for schedule in ("tawpipe", "weipipe"):
            base = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=N)
            placed = place_weight_passes(base, COST)
            validate_plan(placed)
            split = simulate(split_backward(base), COST, record=False).iteration_time
            assert simulate(placed, COST, record=False).iteration_time <= split * (1 + 1e-9)
            best, result = best_split(base, COST)
            assert result.iteration_time <= split * (1 + 1e-9)


def test_memory_model_counts_the_weight_gradient_store():
    """Between its two passes a split backward keeps its store (each linear layer's input and output
    gradient); its input pass frees the stored activations."""
    plan = build_plan("weipipe-interleave-zb", num_ranks=4, num_groups=2, num_microbatches=2)
    H, S = 4096, 16384
    ffn = COST.layer_output_grad_bytes / (S * 2) - 3 * H - 2 * H   # (3H + 2kv + 2ffn) / 2 with kv = H
    ffn /= 2
    assert COST.layer_weight_store_bytes == pytest.approx(S * ((3 * H + ffn) + (3 * H + 2 * H + 2 * ffn)) * 2)
    peaks, stores = activation_peaks(plan, COST), activation_peaks(plan, COST, store=True)
    assert max(stores) > 0
    held = replace(COST, layer_weight_store_bytes=0.0)
    assert max(activation_peaks(plan, held)) < max(peaks)
    unsplit = simulate(build_plan("weipipe", num_ranks=4, num_groups=2, num_microbatches=2), COST, record=False)
    split = simulate(plan, COST, record=False)
    assert split.activation_bytes > unsplit.activation_bytes


# ---- WZB1 in the WeiPipe paper's arrangement (weipipe-zb1-paired) -----------------------------------------

def test_paired_blocks_follow_the_papers_order():
    """At most two parts per block of P turns, lower halves first, then upper halves, then forwards: for two
    micro-batches F0 | U0 F1 | L0 U1 | L1 (the paper's worker 0 from its t = 0)."""
    from megatron_tawpipe.plan.weipipe import paired_blocks

    assert paired_blocks(2) == [[("F", 0)], [("U", 0), ("F", 1)], [("L", 0), ("U", 1)], [("L", 1)]]
    for N in range(1, 7):
        blocks = paired_blocks(N)
        assert all(1 <= len(b) <= 2 for b in blocks)
        done = {}
        for i, b in enumerate(blocks):
            for part, m in b:
                done[(part, m)] = i
        for m in range(N):
            assert done[("F", m)] < done[("U", m)] < done[("L", m)]


@pytest.mark.parametrize("P", [2, 4, 6])
def test_paired_wzb1_validates_and_moves_gradients_in_pairs(P):
    """Every shape validates (NCCL's rules included), each weight pass follows its input pass on its rank,
    and the gradients travel in pairs: shard P-1-j with P/2-1-j, to the same peer in the same batch (one of
    them alone where the other has reached its owner)."""
    half = P // 2
    partner = {s: (s - half if s >= half else s + half) for s in range(P)}
    for D in [d for d in range(1, P + 1) if P % d == 0]:
        for N in (1, 2, 3):
            for overlap in (True, False):
                for layers in (P, P + half):
                    plan = build_plan("weipipe-zb1-paired", num_ranks=P, num_groups=D, num_layers=layers,
                                      num_microbatches=N, overlap=overlap)
                    validate_plan(plan)
                    assert plan.options["layout"] == "paired" and plan.schedule == "weipipe-zb1-paired"
                    pairs = 0
                    for acts in plan.actions:
                        by_batch = {}
                        for a in acts:
                            if type(a) is A.SendStart and a.kind == "grad":
                                by_batch.setdefault((a.batch, a.peer), set()).add(a.shard)
                        for shards in by_batch.values():   # one pair's gradients, or one of them
                            assert len(shards) == 1 or shards == {min(shards), partner[min(shards)]}, shards
                            pairs += len(shards) == 2
                        order = _compute(acts)
                        for i, (t, m, s) in enumerate(order):
                            if t is A.BackwardWeight:
                                assert order.index((A.BackwardInput, m, s)) < i
                    assert pairs > 0 or N == 1 or P == 2


def test_paired_layout_needs_an_even_number_of_ranks():
    with pytest.raises(ValueError, match="even number of ranks.*use weipipe-zb1"):
        build_plan("weipipe-zb1-paired", num_ranks=3)
    assert build_plan("weipipe-zb1", num_ranks=4).options["layout"] == "ring"


def test_paired_wzb1_idles_less_on_fast_links_and_more_on_slow_ones():
    """The paired layout computes two passes a turn where the ring computes three and moves as many bytes a
    turn: with free links and no recompute it idles less than the ring WZB1 (P = 8, N = 1: 0.260 against
    0.360), with two nodes at 12.5 GB/s more (P = 4, N = 4)."""
    fast = CostModel.from_flops(hidden_size=1024, seq_length=8192, num_attention_heads=8, recompute=False,
                                intra_bw="1000GB/s", inter_bw="1000GB/s")
    ring, paired = (simulate(build_plan(s, num_ranks=8, num_layers=16, num_microbatches=1), fast, record=False)
                    for s in ("weipipe-zb1", "weipipe-zb1-paired"))
    assert paired.bubble_ratio == pytest.approx(0.260, abs=5e-3) and ring.bubble_ratio == pytest.approx(0.360, abs=5e-3)
    ring, paired = (simulate(build_plan(s, num_ranks=4, num_groups=2, num_layers=16, num_microbatches=4), COST,
                             record=False) for s in ("weipipe-zb1", "weipipe-zb1-paired"))
    assert paired.bubble_ratio > ring.bubble_ratio + 0.05


def test_simulator_command_lines_price_deferred_kernels_by_default():
    """tools/simulate.py and tools/plan.py (cli.plan_args) price the runtime's split by default;
    --no-deferred-weight-gradients prices the former model, whose weight pass costs nothing."""
    import argparse

    from megatron_tawpipe.cli.plan_args import add_model_args, cost_model

    p = argparse.ArgumentParser()
    add_model_args(p)
    plan = build_plan("weipipe-zb1", num_ranks=4, num_groups=2, num_layers=16)
    default, explicit, former = (cost_model(p.parse_args(argv)) for argv in
                                 ([], ["--deferred-weight-gradients"], ["--no-deferred-weight-gradients"]))
    assert default.deferred_weight_gradients and explicit.deferred_weight_gradients
    assert not former.deferred_weight_gradients
    assert default.backward_weight_time(plan, 0) > 0 and former.backward_weight_time(plan, 0) == 0


def test_memory_note_names_the_weight_gradient_store_apart_from_stored_inputs():
    from megatron_tawpipe.sim.memory import weight_passing_breakdown

    for schedule, has_store in (("weipipe", False), ("weipipe-zb2", True)):
        plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=16, num_microbatches=2)
        result = simulate(plan, COST, record=False)
        note = weight_passing_breakdown(result, COST, plan).notes["activations"]
        assert ("weight-gradient store" in note) == has_store, note
        stores = activation_peaks(plan, COST, store=True)
        inputs = int(note.split(" stored shard inputs")[0])
        per = COST.activation_bytes
        working = plan.max_layers_per_shard * COST.layer_activation_bytes
        peaks = activation_peaks(plan, COST)
        assert inputs * per + stores[peaks.index(max(peaks))] + working == pytest.approx(result.activation_bytes)


def test_measured_activations_do_not_rescale_the_store():
    """The store is arithmetic on the linear layers' shapes: a measured activation size changes the
    activation terms, never the store."""
    measured = COST.with_measured({"layer_activation_bytes": 3 * COST.layer_activation_bytes})
    assert measured.layer_activation_bytes == pytest.approx(3 * COST.layer_activation_bytes)
    assert measured.layer_weight_store_bytes == COST.layer_weight_store_bytes
