"""Recompute decided with the layout (``--tawpipe-recompute auto``, the default): activations kept wherever the
layout fits without recompute, recompute where only it makes the layout fit; a setting given (``on``, ``off``,
``--tawpipe-no-recompute``, megatron's ``--recompute-granularity full``) is never overridden, two that disagree are
refused in one line; WeiPipe decides on its memory model alone; the advisor and ``--pipeline-schedule auto``
decide alike."""

from dataclasses import replace

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank

from megatron_tawpipe.arguments import parse_args
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.layout_choice import LayoutRequest, candidate_layouts, choose_layout, price_layout
from megatron_tawpipe.training.validate_args import validate_args


def _costs(inter_bw=150e6 / 8):
    def one(recompute):
        base = CostModel.from_flops(hidden_size=256, seq_length=3072, micro_batch_size=1, ffn_hidden_size=704,
                                    vocab_size=2048, num_attention_heads=4, num_query_groups=4, recompute=recompute,
                                    dtype_bytes=4, peak_tflops=0.4, efficiency=1.0)
        return replace(base, backend="gloo", intra=Link(0.6e9, 5e-6), inter=Link(inter_bw, 50e-6))

    return {False: one(False), True: one(True)}


def test_activations_kept_where_they_fit_recompute_where_only_it_fits():
    costs = _costs()
    free = choose_layout(LayoutRequest(), costs, 6, 3, 12, [4])
    assert free.chosen.recompute is False and "activations kept" in free.line()
    kept = free.chosen_priced
    # a limit the fastest layout keeping activations exceeds, but its recomputing form meets
    on = price_layout(replace(free.chosen, recompute=True), costs[True], 6, 3, 12, [4])
    assert on[0] >= kept.iteration_time and on[1] < kept.memory_bytes
    limit = (on[1] + kept.memory_bytes) / 2
    tight = choose_layout(LayoutRequest(), costs, 6, 3, 12, [4], memory_limit=limit)
    assert tight.chosen_priced.fits and tight.chosen_priced.memory_bytes <= limit
    fitting_kept = [p for p in tight.priced if p.fits and not p.layout.recompute]
    if tight.chosen.recompute:   # recompute chosen: it beats every layout that fits without it
        assert all(p.iteration_time >= tight.chosen_priced.iteration_time * 0.998 for p in fitting_kept)
    else:
        assert fitting_kept and tight.chosen_priced in fitting_kept
    # a limit nothing meets without recompute: the choice recomputes
    least_kept = min(p.memory_bytes for p in free.priced if not p.layout.recompute)
    cramped = choose_layout(LayoutRequest(), costs, 6, 3, 12, [4], memory_limit=least_kept * 0.999)
    assert cramped.chosen.recompute and cramped.chosen_priced.memory_bytes < least_kept


def test_recompute_never_beats_the_same_layout_keeping_activations():
    """Why the decision prices recompute only where the layout does not fit without it: on every candidate,
    recompute is no faster (the same plan, longer backward actions)."""
    costs = _costs()
    for layout in candidate_layouts(LayoutRequest(recompute=False), 6, 3, 12, [4], recomputes=(False,))[:12]:
        kept = price_layout(layout, costs[False], 6, 3, 12, [4])
        recomputed = price_layout(replace(layout, recompute=True), costs[True], 6, 3, 12, [4])
        assert recomputed[0] >= kept[0] * (1 - 1e-9) and recomputed[1] <= kept[1]


def test_a_setting_given_is_kept():
    costs = _costs()
    on = choose_layout(LayoutRequest(recompute=True), costs, 6, 3, 12, [4])
    assert on.chosen.recompute and all(p.layout.recompute for p in on.priced)
    single = choose_layout(LayoutRequest(), costs[True], 6, 3, 12, [4])   # one cost model: its own setting
    assert all(p.layout.recompute for p in single.priced)
    with pytest.raises(ValueError, match="no TawPipe layout"):
        choose_layout(LayoutRequest(recompute=False), costs[True], 6, 3, 12, [4])


def _validated(*extra, world=4):
    return validate_args(parse_args(tiny_args(*extra)), world_size=world)


@pytest.mark.parametrize("flags,setting", [
    ([], "auto"), (["--tawpipe-recompute", "on"], "on"), (["--tawpipe-no-recompute"], "off"),
    (["--recompute-granularity", "full"], "on"), (["--tawpipe-recompute", "off", "--tawpipe-no-recompute"], "off")])
def test_the_flags_settle_to_one_setting(flags, setting):
    args = _validated("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *flags)
    assert args.tawpipe_recompute == setting
    assert args.tawpipe_no_recompute == (setting == "off")


@pytest.mark.parametrize("flags,named", [
    (["--pipeline-schedule", "tawpipe", "--tawpipe-recompute", "on", "--tawpipe-no-recompute"],
     "--tawpipe-recompute on and --tawpipe-no-recompute disagree"),
    (["--pipeline-schedule", "weipipe", "--tawpipe-recompute", "off", "--recompute-granularity", "full"],
     "--tawpipe-recompute off and --recompute-granularity full disagree"),
    (["--pipeline-schedule", "1f1b", "--tawpipe-recompute", "on"], "--tawpipe-recompute")])
def test_disagreeing_or_misplaced_settings_are_refused_in_one_line(flags, named):
    with pytest.raises(ArgumentError) as err:
        _validated(*flags)
    assert named in str(err.value) and "\n" not in str(err.value)


def _like(per_rank, reference):
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-5, "grad norm")


def test_the_recomputing_layout_trains_like_the_reference_and_weipipe_decides_alone(tmp_path, capfd):
    """The pinned recomputing form and WeiPipe's own decision both train exactly; each run says what it took."""
    (reference,) = run_ranks(train_rank, 1, tiny_args(train_iters=2))
    pinned = run_ranks(train_rank, 4, tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                               "--tawpipe-recompute", "on", "--tawpipe-link-bandwidth", "1Gbit/s",
                                               train_iters=2))
    _like(pinned, reference)
    assert pinned[0][0]["tawpipe_layout"]["layout"]["recompute"] is True
    assert "recompute" not in pinned[0][0]["tawpipe_layout"]["auto"]
    weipipe = run_ranks(train_rank, 4, tiny_args("--pipeline-schedule", "weipipe", train_iters=2))
    _like(weipipe, reference)
    out = capfd.readouterr().out
    assert out.count("weipipe recompute: off (activations kept) (auto: predicted peak") == 1
