"""Shards and stages of different sizes: the split arithmetic, plans that carry it, the NCCL model's size
rule, the flags that choose a split, and groups (nodes) of different sizes, which are refused.

(Uneven shards train exactly like the single-process reference: tests/test_weight_passing_equivalence.py.)
"""

import dataclasses
import os

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.common.layer_split import (check_layer_split, default_layer_split, first_last_layer_split,
                                                 layer_offsets)
from megatron_tawpipe.plan import Plan, PlanError, actions as A, build_plan, validate_plan
from megatron_tawpipe.plan.connect import check_nccl_order
from training_helpers import tiny_args


def test_default_split_gives_the_first_shards_one_layer_more():
    assert default_layer_split(6, 4) == (2, 2, 1, 1)
    assert default_layer_split(10, 4) == (3, 3, 2, 2)
    assert default_layer_split(8, 4) == (2, 2, 2, 2)
    assert default_layer_split(32, 24) == (2,) * 8 + (1,) * 16
    assert default_layer_split(5, 5) == (1,) * 5
    with pytest.raises(ValueError, match="cannot be cut into 4 pieces"):
        default_layer_split(3, 4)


def test_first_and_last_pieces_fixed():
    assert first_last_layer_split(6, 4, last=3) == (1, 1, 1, 3)
    assert first_last_layer_split(7, 4, first=1) == (1, 2, 2, 2)
    assert first_last_layer_split(10, 4, first=1, last=1) == (1, 4, 4, 1)
    assert first_last_layer_split(9, 4, first=1, last=1) == (1, 4, 3, 1)       # the middle: the default split
    with pytest.raises(ValueError, match="divide evenly"):
        first_last_layer_split(9, 4, first=1, last=1, even_middle=True)        # megatron-core's rule
    assert first_last_layer_split(5, 2, first=2, last=3) == (2, 3)
    with pytest.raises(ValueError, match="must hold all 5 layers"):
        first_last_layer_split(5, 2, first=2, last=2)
    with pytest.raises(ValueError, match="1 layers are left for 2 middle pieces"):
        first_last_layer_split(5, 3, first=4)
    assert layer_offsets((2, 2, 1, 1)) == (0, 2, 4, 5)
    with pytest.raises(ValueError, match="hold 5 layers, not 6"):
        check_layer_split((2, 2, 1), 6, 3)
    with pytest.raises(ValueError, match="at least one layer"):
        check_layer_split((3, 0, 3), 6, 3)


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe", "tawpipe-rep", "1f1b"])
def test_uneven_plans_validate_and_round_trip(schedule):
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=6, num_microbatches=3)
    assert plan.shard_layers == (2, 2, 1, 1) and plan.uneven and plan.max_layers_per_shard == 2
    assert [list(plan.layers_of_shard(s)) for s in range(4)] == [[0, 1], [2, 3], [4], [5]]
    validate_plan(plan)
    for text_form in (Plan.from_json(plan.to_json()), Plan.from_csv(plan.to_csv())):
        assert text_form.shard_layers == plan.shard_layers
    chosen = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=6, num_microbatches=3,
                        shard_layers=(1, 1, 1, 3))
    assert chosen.layers_of_shard(3) == range(3, 6)
    validate_plan(chosen)
    with pytest.raises(ValueError, match="hold 5 layers, not 6"):
        build_plan(schedule, num_ranks=4, num_groups=2, num_layers=6, num_microbatches=3, shard_layers=(1, 1, 1, 2))


def test_even_plans_keep_their_text_form():
    """Plans whose shards are equal write no split (their files are what they were)."""
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=8, num_microbatches=2)
    assert "shard_layers" not in plan.meta() and not plan.uneven


def test_nccl_model_refuses_a_transfer_whose_sides_differ_in_size():
    """A receive that names another shard than its send: with shards of different sizes the two sides
    would post different counts, which NCCL does not match (a hang or corruption on a GPU)."""
    plan = build_plan("weipipe", num_ranks=3, num_groups=1, num_layers=5, num_microbatches=2)
    validate_plan(plan)
    for rank, acts in enumerate(plan.actions):
        for i, a in enumerate(acts):
            if type(a) is A.RecvStart and a.kind == "weight" and plan.shard_layers[a.shard] == 2:
                other = next(s for s in range(plan.num_shards) if plan.shard_layers[s] == 1)
                acts[i] = dataclasses.replace(a, shard=other)
                with pytest.raises(PlanError, match="shard differs from the matching send"):
                    validate_plan(plan)
                with pytest.raises(PlanError, match="both sides of a transfer must have the same size"):
                    check_nccl_order(plan)   # the NCCL model alone says why it would fail on a GPU
                return
    pytest.fail("no weight receive of a two-layer shard in the plan")


def _argv(*extra, layers, schedule="tawpipe"):
    argv = tiny_args("--pipeline-schedule", schedule, *extra, train_iters=2, global_batch=8, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return argv


def _validated(argv, world):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    return validate_args(parse_args(argv), world_size=world)


@pytest.mark.parametrize("extra,layers,world,split", [
    ([], 6, 4, (2, 2, 1, 1)),
    (["--decoder-first-pipeline-num-layers", "3"], 6, 4, (3, 1, 1, 1)),
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"], 7, 4, (1, 3, 2, 1)),
    (["--pipeline-model-parallel-layout", "Et|(tt|)*2tL"], 6, 4, (1, 2, 2, 1)),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "2"], 3, 4, (2, 1)),
])
def test_flags_choose_the_weight_pipeline_split(extra, layers, world, split):
    assert _validated(_argv(*extra, layers=layers), world).decoder_layer_split == split


@pytest.mark.parametrize("extra,layers,message", [
    (["--pipeline-model-parallel-layout", "Et|tt|t|tL"], 6, "places 5 decoder layers (t); --num-layers is 6"),
    (["--pipeline-model-parallel-layout", "Ettt|tttL"], 6, "has 2 stages; --pipeline-schedule tawpipe over 4"),
    (["--pipeline-model-parallel-layout", "Et|tt|ttt|L"], 6, "stage 3 has no decoder layer"),
    (["--pipeline-model-parallel-layout", "Et|tt|Et|tL"], 6, "the embedding (E) belongs to the first stage"),
    (["--pipeline-model-parallel-layout", "Et|ttx|tt|tL"], 6, "Invalid layer character: x"),
    (["--pipeline-model-parallel-layout", "Et|tt|t|tL", "--decoder-first-pipeline-num-layers", "1"], 5,
     "cannot be combined"),
    (["--decoder-first-pipeline-num-layers", "5"], 6, "1 layers are left for 3 middle pieces"),
    ([], 3, "3 layers cannot be cut into 4 pieces"),
])
def test_bad_splits_are_refused_naming_the_flag(extra, layers, message):
    from megatron_tawpipe.common.errors import ArgumentError

    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        _validated(_argv(*extra, layers=layers), 4)


def test_groups_of_different_sizes_are_refused_before_training(monkeypatch):
    from megatron_tawpipe.common.errors import ArgumentError

    with pytest.raises(ArgumentError, match="--tawpipe-num-groups 3 must divide the number of ranks 4"):
        _validated(_argv("--tawpipe-num-groups", "3", layers=4), 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ArgumentError, match=r"this node runs 3 of the 4 ranks \(LOCAL_WORLD_SIZE\), so the nodes "
                                            "differ in size"):
        _validated(_argv(layers=4, schedule="tawpipe"), 4)
    with pytest.raises(ArgumentError, match="weipipe's ring does not depend on the groups: --tawpipe-num-groups 1"):
        _validated(_argv(layers=4, schedule="weipipe"), 4)
    assert _validated(_argv("--tawpipe-num-groups", "1", layers=4, schedule="weipipe"), 4).tawpipe_num_groups == 1
    assert _validated(_argv("--tawpipe-num-groups", "2", layers=4), 4).tawpipe_num_groups == 2


def _default_groups(rank, local_sizes):
    import torch.distributed as dist

    from megatron_tawpipe.distributed.parallel_state import default_num_groups

    os.environ["LOCAL_WORLD_SIZE"] = str(local_sizes[rank])
    dist.init_process_group("gloo", rank=rank, world_size=len(local_sizes))
    try:
        return default_num_groups(len(local_sizes))
    except ValueError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()


def test_nodes_of_different_sizes_are_refused_on_every_rank():
    """Nodes of 2, 1 and 1 ranks: each node's size divides the 4 ranks, so no rank can tell alone; the
    weight pipeline compares them and every rank refuses alike (none runs a plan the others do not)."""
    answers = run_ranks(_default_groups, 4, [2, 2, 1, 1])
    assert all("the nodes run different numbers of ranks (LOCAL_WORLD_SIZE from 1 to 2, 4 ranks)" in str(a)
               for a in answers), answers
    assert run_ranks(_default_groups, 4, [2, 2, 2, 2]) == [2, 2, 2, 2]
