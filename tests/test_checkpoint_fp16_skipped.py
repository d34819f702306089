"""fp16 starts at Megatron-LM's loss scale 2**32, so its first iterations overflow and skip the optimizer
step: a checkpoint saved then holds Adam's state before its first step (zero moments, step 0), and resuming
from it continues the uninterrupted run exactly (losses, loss scale, parameters)."""

import os

import pytest

from distributed_harness import run_ranks
from training_helpers import losses, pinned_layout, tiny_args, train_rank

ITERS = 5
SAVED = 2      # every iteration up to here skips its step (the loss scale halves from 2**23 to 2**21)
# (2**23 rather than 2**32: this tiny model overflows at every scale above 2**21, so the same thing happens in
# two iterations rather than eleven.)
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 23), "--hysteresis", "1"]
# tawpipe's layout pinned: the resumed and the uninterrupted runs are launched separately and compared bit for bit
SCHEDULES = {"tawpipe": (2, ["--pipeline-schedule", "tawpipe", *pinned_layout(1)]),
             "1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
             "distributed-optimizer": (2, ["--use-distributed-optimizer"])}


def _run(world, extra, save=None, load=None, exit_interval=None, fmt="torch_dist"):
    argv = tiny_args(*FP16, *extra, "--ckpt-format", fmt, train_iters=ITERS)
    if save:
        argv += ["--save", save, "--save-interval", "1"]
    if load:
        argv += ["--load", load]
    if exit_interval:
        argv += ["--exit-interval", str(exit_interval)]
    return run_ranks(train_rank, world, argv)[-1]


CASES = [(schedule, fmt) for schedule in sorted(SCHEDULES) for fmt in ("torch_dist", "tawpipe")] + [
    ("1f1b", "torch"), ("distributed-optimizer", "torch")]     # the legacy format: megatron-core's own optimizer


@pytest.mark.parametrize("schedule,fmt", CASES)
def test_resume_from_a_checkpoint_saved_before_the_first_step(tmp_path, schedule, fmt):
    from megatron_tawpipe.checkpoint import read_parameters

    world, extra = SCHEDULES[schedule]
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    uninterrupted = _run(world, extra, save=whole, fmt=fmt)
    assert [r["skipped"] for r in uninterrupted[:SAVED]] == [True] * SAVED, uninterrupted
    assert not uninterrupted[-1]["skipped"]
    first = _run(world, extra, save=part, exit_interval=SAVED, fmt=fmt)
    second = _run(world, extra, save=part, load=part, fmt=fmt)
    resumed = first + second
    assert [r["iteration"] for r in resumed] == list(range(1, ITERS + 1))
    assert losses(resumed) == losses(uninterrupted)
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in uninterrupted]
    assert [r["skipped"] for r in resumed] == [r["skipped"] for r in uninterrupted]
    final = f"iter_{ITERS:07d}"
    ours, theirs = (read_parameters(os.path.join(root, final)) for root in (part, whole))
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].equal(theirs[name]), name


def test_a_missing_state_after_a_step_is_still_refused():
    """Only a checkpoint with no step count and no moment at all holds Adam's initial state."""
    import torch

    from megatron_tawpipe.checkpoint.torch_dist import optimizer_before_first_step

    weights = {"embedding.word_embeddings.weight": None}
    moments = dict(weights, **{"optimizer.state.exp_avg.embedding.word_embeddings.weight": None})
    assert optimizer_before_first_step(weights, None)
    assert optimizer_before_first_step(weights, torch.tensor(0.0))
    assert not optimizer_before_first_step(weights, torch.tensor(3.0))
    assert not optimizer_before_first_step(moments, None)
