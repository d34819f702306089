"""TawPipe's spread ownership layout trained by the runtime (``--tawpipe-ownership spread``): exactly like the
single-process reference at 2, 3 and 4 groups, with shards of different sizes, without the shard cache and with
tensor parallelism inside the groups, all under NCCL's ordering rules on gloo; the bytes between groups those of
its plan (and of the one-owner layout's); checkpoints that one layout writes resumed by the other and by native
megatron, with their optimizer state."""

import json

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, assert_trains_like, losses, tiny_args, train_rank, pinned_layout

from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.plan.traffic import link_bytes
from megatron_tawpipe.sim.costmodel import params_per_layer

ITERS = 3
LAYERS, BATCH = 12, 12      # 12 layers and sequences: 2, 3 or 4 groups of one rank (or of one TP group of 2)
# the spread layout, its other knobs given (a case's own flags come after and win): the bytes of one plan
SPREAD = ("--pipeline-schedule", "tawpipe", *pinned_layout(2), "--tawpipe-ownership", "spread", "--tawpipe-nccl-faithful",
          "--distributed-timeout-minutes", "2")
# a decoder layer of the tiny model (H 64, FFN 128, 4 heads, gated FFN, RMSNorm, no biases), fp32 on the wire
LAYER_BYTES = 4 * params_per_layer(64, 128, 4, 4)


def _args(*extra, save=None, iters=ITERS, hidden=64):
    argv = tiny_args(*extra, train_iters=iters, global_batch=BATCH, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(LAYERS)
    argv[argv.index("--hidden-size") + 1] = str(hidden)
    return argv + (["--save", save, "--save-interval", "1"] if save else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref"))
    (records,) = run_ranks(train_rank, 1, _args(save=save))
    return records, save


def _inter_layers(groups, cache, **options):
    """Layers' worth of bytes between groups per iteration of the run's plan (weights and gradients fp32)."""
    plan = build_plan("tawpipe", num_ranks=groups, num_groups=groups, num_layers=LAYERS,
                      num_microbatches=BATCH // groups, cache=cache, **options)
    return link_bytes(plan, 1.0)["inter"] * plan.max_layers_per_shard


@pytest.mark.parametrize("groups,extra", [
    (2, ()),
    (3, ()),
    (4, ()),
    (3, ("--tawpipe-cache", "off")),                                   # every visit gathered and reduce-scattered
    (4, ("--decoder-first-pipeline-num-layers", "6")),                 # shards of 6, 2, 2, 2 layers
    (3, ("--tawpipe-shards-per-rank", "2")),                          # 6 shards of 2 layers over 3 ranks
], ids=["D2", "D3", "D4", "D3-no-cache", "D4-uneven", "D3-two-shards-per-rank"])
def test_trains_like_the_single_process_reference(groups, extra, reference, tmp_path):
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, groups, _args(*SPREAD, "--tawpipe-num-groups", str(groups), *extra, save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
    sent = [r["inter_group_bytes"] for r in per_rank[0]]
    assert sent == [r["planned_inter_group_bytes"] for r in per_rank[0]]
    if "--decoder-first-pipeline-num-layers" not in extra:
        cache = "off" not in extra
        per_rank = {"shards_per_rank": int(extra[1])} if "--tawpipe-shards-per-rank" in extra else {}
        spread = _inter_layers(groups, cache, ownership="spread", **per_rank)
        # with the cache both layouts move the same bytes (every foreign shard in and its gradient out once)
        assert spread == pytest.approx(_inter_layers(groups, cache, **per_rank)) or not cache
        assert sent == [pytest.approx(spread * LAYER_BYTES, rel=1e-9)] * ITERS


@pytest.mark.parametrize("ownership", ["spread", "owner"])
def test_two_shards_per_rank_in_groups_of_two_train_like_the_reference(ownership, reference, tmp_path):
    """``--tawpipe-shards-per-rank 2`` with 2 groups of 2 ranks: 8 shards of 1.5 layers on average (12 layers:
    2, 2, 2, 2, 1, 1, 1, 1), each rank staging (and, one owner, owning) two; the bytes between groups those of
    its plan."""
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, 4, _args("--pipeline-schedule", "tawpipe", "--tawpipe-ownership", ownership,
                                              "--tawpipe-nccl-faithful", "--distributed-timeout-minutes", "2",
                                              "--tawpipe-num-groups", "2", "--tawpipe-shards-per-rank", "2", save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
    for records in per_rank:
        assert [r["inter_group_bytes"] for r in records] == [r["planned_inter_group_bytes"] for r in records]


def test_slices_padded_past_the_shard_train_like_the_reference(tmp_path):
    """Hidden size 80: a decoder layer has 80 x (4 x 80 + 3 x 128 + 2) = 56480 elements, a shard of 4 layers
    is not a multiple of 3, so the third group's slice ends in padding that the gather and the
    reduce-scatter carry and nothing reads."""
    assert (4 * 80 * (4 * 80 + 3 * 128 + 2)) % 3 != 0
    reference_save, save = str(tmp_path / "ref"), str(tmp_path / "ckpt")
    (expected,) = run_ranks(train_rank, 1, _args(save=reference_save, hidden=80))
    per_rank = run_ranks(train_rank, 3, _args(*SPREAD, "--tawpipe-num-groups", "3", save=save, hidden=80))
    assert_trains_like(per_rank, expected, save, reference_save, ITERS)


@pytest.mark.parametrize("reduce", ["hierarchical", "sharded"])
def test_tensor_parallel_inside_the_groups_trains_like_the_reference(reduce, reference, tmp_path):
    """2 groups of one tensor-parallel group of 2 ranks: each tensor-parallel index gathers and reduce-scatters
    its 1/2 of every shard's slices; sequence parallelism's partial gradients are summed over the pieces (with the
    replicated parts' optimizer sharded: over their slices, the final norm's among them)."""
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, 4, _args(*SPREAD, "--tawpipe-num-groups", "2", "--tensor-model-parallel-size",
                                              "2", "--sequence-parallel", "--tawpipe-replicated-reduce", reduce,
                                              save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)


def test_a_spread_plan_file_runs(reference, tmp_path):
    """``--pipeline-schedule plan:FILE`` with a plan of the spread layout (here with early gradients off)."""
    plan = build_plan("tawpipe", num_ranks=2, num_groups=2, num_layers=LAYERS, num_microbatches=BATCH // 2,
                      ownership="spread", early_grads=False)
    path = tmp_path / "spread.json"
    path.write_text(plan.to_json())
    assert json.loads(path.read_text())["meta"]["ownership"] == "spread"
    per_rank = run_ranks(train_rank, 2, _args("--pipeline-schedule", f"plan:{path}", "--tawpipe-num-groups", "2",
                                              "--tawpipe-nccl-faithful"))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference[0]), 1e-5)


# ------------------------------------------------------------------------------ checkpoints
RESUME_ITERS = 4
LAYOUTS = {"spread": (3, SPREAD + ("--tawpipe-num-groups", "3")),
           "spread-two-shards": (3, SPREAD + ("--tawpipe-num-groups", "3", "--tawpipe-shards-per-rank", "2")),
           "owner": (3, ("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3", *pinned_layout(3))),
           "native": (1, ()),
           # the replicated parts' optimizer sharded over the ranks (their masters and moments in slices)
           "owner-sharded": (3, ("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3", *pinned_layout(3),
                                 "--tawpipe-replicated-reduce", "sharded")),
           "spread-sharded": (3, SPREAD + ("--tawpipe-num-groups", "3", "--tawpipe-replicated-reduce", "sharded"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ranks, flags = LAYOUTS["spread"]
    return run_ranks(train_rank, ranks, _args(*flags, iters=RESUME_ITERS))[0]


@pytest.mark.parametrize("writer,reader,fmt", [
    ("spread", "owner", "torch_dist"), ("owner", "spread", "torch_dist"), ("spread", "native", "torch_dist"),
    ("spread", "spread", "torch"), ("spread-two-shards", "owner", "torch_dist"),
    ("owner-sharded", "owner", "torch_dist"), ("owner", "owner-sharded", "torch"),
    ("spread-sharded", "native", "torch_dist"), ("native", "spread-sharded", "torch"),
])
def test_a_checkpoint_resumes_in_the_other_layout(writer, reader, fmt, uninterrupted, tmp_path):
    """Train 2 of 4 iterations in one layout, resume the last 2 in another: the losses of an uninterrupted
    run; without the optimizer state (--no-load-optim) they are not, so the state did travel."""
    save = str(tmp_path / "ckpt")
    ranks, flags = LAYOUTS[writer]
    fmt_flags = ("--ckpt-format", fmt)
    run_ranks(train_rank, ranks, _args(*flags, *fmt_flags, "--save", save, "--save-interval", "2", "--exit-interval",
                                       "2", iters=RESUME_ITERS))
    ranks, flags = LAYOUTS[reader]
    resumed = run_ranks(train_rank, ranks, _args(*flags, *fmt_flags, "--load", save, iters=RESUME_ITERS))[0]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_close_rel(losses(resumed), losses(uninterrupted)[2:], 1e-6)
    if (writer, reader) in (("spread", "owner"), ("owner", "owner-sharded")):
        fresh = run_ranks(train_rank, ranks, _args(*flags, *fmt_flags, "--load", save, "--no-load-optim",
                                                   iters=RESUME_ITERS))[0]
        assert abs(losses(fresh)[-1] - losses(uninterrupted)[-1]) > 1e-4 * abs(losses(uninterrupted)[-1])
