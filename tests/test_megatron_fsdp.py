"""megatron-core's Megatron-FSDP (--use-megatron-fsdp), HFSDP included, trains like a single-process run.

Reference: megatron's no-pipelining schedule on one rank (fp32). 2 layers, global batch 8 with micro-batch 1:
2 micro-batches per rank on 4 ranks (4 on 2), so megatron's no_sync drives Megatron-FSDP's outer reduction;
the gradient norm exceeds 1, so clipping is active. Clipping and Adam leave a gradient off by a constant
factor (megatron-core 0.19.2's HFSDP lost the 1/dp average: 4x here) invisible in the losses; the
gradient norm is what shows it.
"""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank

SMALL = ["--num-layers", "2"]
EVALUATE = ["--eval-interval", "1", "--eval-iters", "1", "--split", "90,10,0"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--data-parallel-sharding-strategy", "optim_grads_params"]
HFSDP = MEGATRON_FSDP + ["--outer-dp-sharding-strategy", "optim", "--num-distributed-optimizer-instances", "2"]


def grad_norms(records):
    return [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def reference():
    (records,) = run_ranks(train_rank, 1, tiny_args(*SMALL, *EVALUATE))
    assert len(records) == 3 and losses(records)[0] != losses(records)[-1]   # it trains
    assert max(grad_norms(records)) > 1.0                                    # clipping is active
    return records


@pytest.mark.parametrize("world,extra", [(4, HFSDP), (2, MEGATRON_FSDP)], ids=["hfsdp-2x2", "megatron-fsdp"])
def test_megatron_fsdp_matches_single_process(reference, world, extra):
    per_rank = run_ranks(train_rank, world, tiny_args(*SMALL, *EVALUATE, *extra))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
        # With the outer optim sharding, megatron-core's own grad-stats group would see half the gradient,
        # and on 0.19.2 (without restore_hfsdp_grad_scaling) the gradients would be 4x.
        assert_close_rel(grad_norms(records), grad_norms(reference), 1e-5, "grad norm")
        assert_close_rel([r["validation_lm_loss"] for r in records],
                         [r["validation_lm_loss"] for r in reference], 1e-5, "validation loss")


@pytest.mark.parametrize("extra,message", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp needs --use-distributed-optimizer"),
    (MEGATRON_FSDP + ["--pipeline-model-parallel-size", "2"], "leave --pipeline-model-parallel-size at 1"),
    (MEGATRON_FSDP + ["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 with --use-megatron-fsdp"),
    (MEGATRON_FSDP + ["--use-torch-fsdp2"], "--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive"),
    (MEGATRON_FSDP + ["--pipeline-schedule", "tawpipe"], "--use-megatron-fsdp does not apply to --pipeline-schedule"),
    (MEGATRON_FSDP + ["--outer-dp-sharding-strategy", "optim"], "needs --num-distributed-optimizer-instances N > 1"),
    (HFSDP + ["--data-parallel-sharding-strategy", "optim_grads"], "needs --data-parallel-sharding-strategy "
                                                                  "optim_grads_params"),
    (MEGATRON_FSDP + ["--fp16"], "--fp16 is not supported"),
    (MEGATRON_FSDP + ["--save", "/tmp/x"], "--save / --load with --use-megatron-fsdp"),
    (MEGATRON_FSDP + ["--load", "/tmp/x"], "--save / --load with --use-megatron-fsdp"),
    (MEGATRON_FSDP + ["--fsdp-double-buffer"], "--fsdp-double-buffer: Megatron-FSDP's"),
])
def test_megatron_fsdp_flag_errors_name_the_flag(extra, message):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(tiny_args(*extra)), world_size=4)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_sharding_strategies_without_megatron_fsdp_change_nothing(capsys):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    validate_args(parse_args(tiny_args("--outer-dp-sharding-strategy", "optim")), world_size=4)
    assert "--outer-dp-sharding-strategy optim: no effect without --use-megatron-fsdp" in capsys.readouterr().out


def _count_outer_collectives(rank, argv):
    """Train, counting the input bytes of every all-gather and reduce-scatter on the outer (cross-instance)
    group: ranks {r, r + 2} of 2 instances of 2 ranks."""
    import torch.distributed as dist

    counted = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}
    for name in counted:
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            if group is not None and sorted(dist.get_process_group_ranks(group)) == [rank % 2, rank % 2 + 2]:
                tensor = kwargs.get("input_tensor", kwargs.get("input"))
                counted[_name] += tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    train_rank(rank, argv)
    return counted


def test_hfsdp_gathers_the_weights_across_instances_twice_per_step(tmp_path):
    """What the simulator's HFSDP model prices (sim/strategies.simulate_hfsdp): once per step megatron-core
    reduce-scatters the gradients across instances, and gathers the updated weights across them twice: the
    gather the optimizer step starts for the next iteration (start_param_sync, --overlap-param-gather) and
    again in the first micro-batch's forward (the outer gather runs whenever microbatch_count is 0). Per
    iteration the outer gathers take in more than 1.5 times the one gather a step needs (the reduce-scatter's
    input is an instance's shard: twice a rank's outer shard); if megatron-core stops repeating it, this
    fails and the model must follow. 4 micro-batches per rank: emulated compute sends exactly what real
    compute does (its modules run as modules, so Megatron-FSDP's end-of-backward hook fires)."""
    import json

    iters = 3
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"layer_forward": 0.002, "layer_backward": 0.004, "layer_recompute": 0.002,
                                 "head_forward": 0.001, "head_backward": 0.002}))
    argv = tiny_args(*SMALL, *HFSDP, train_iters=iters, global_batch=16) + ["--eval-iters", "0"]
    real = run_ranks(_count_outer_collectives, 4, argv)
    emulated = run_ranks(_count_outer_collectives, 4, argv + ["--emulated-compute-times", str(times)])
    assert emulated == real
    for counted in real:
        once = counted["reduce_scatter_tensor"] / iters / 2      # a rank's (outer, inner) shard, fp32
        per_step = (counted["all_gather_into_tensor"] - once) / iters   # less the gather when the model is built
        assert once > 0 and per_step > 1.5 * once, counted
