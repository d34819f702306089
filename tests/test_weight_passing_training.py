"""Weight-passing training beyond fp32 equivalence: resume across schedules, precision, dropout, errors."""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank, pinned_layout

ITERS = 6
TAWPIPE = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *pinned_layout(2)]   # the files of one layout


@pytest.fixture(scope="module")
def uninterrupted_tawpipe():
    return run_ranks(train_rank, 4, tiny_args(*TAWPIPE, train_iters=ITERS))[0]


@pytest.fixture(scope="module")
def saved_by_tawpipe(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("tawpipe-ckpt"))
    # This project's per-parameter format (torch_dist, the default, is covered by test_torch_dist_checkpoint.py):
    # resuming reads only each rank's own files, and the earlier format loads under every schedule.
    first = run_ranks(train_rank, 4, tiny_args(*TAWPIPE, "--save", save, "--exit-interval", "3", "--ckpt-format",
                                               "tawpipe", train_iters=ITERS))[0]
    assert [r["iteration"] for r in first] == [1, 2, 3]
    return save


def _train_recording_loads(rank, argv):
    """Train, and name every file this rank passed to torch.load."""
    import os

    import torch

    opened = []
    real_load = torch.load

    def load(path, *args, **kwargs):
        opened.append(os.path.basename(str(path)))
        return real_load(path, *args, **kwargs)

    torch.load = load
    return train_rank(rank, argv), sorted(opened)


def test_resume_under_tawpipe_is_exact(saved_by_tawpipe, uninterrupted_tawpipe):
    results = run_ranks(_train_recording_loads, 4, tiny_args(*TAWPIPE, "--load", saved_by_tawpipe, train_iters=ITERS))
    resumed = results[0][0]
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(uninterrupted_tawpipe[3:])
    # Each rank reads the index, the file of its own shard, rank 0's (replicated parts) and its RNG state.
    for rank, (_, opened) in enumerate(results):
        assert opened == sorted({"common.pt", "params_rank00000.pt", f"params_rank{rank:05d}.pt",
                                 f"rng_rank{rank:05d}.pt"}), (rank, opened)


@pytest.mark.parametrize("world,extra", [
    (4, ["--pipeline-schedule", "weipipe"]),
    (1, ["--pipeline-schedule", "1f1b"]),
    (2, ["--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "2"]),
], ids=["to-weipipe", "to-native-1f1b", "to-native-1f1b-pp2"])
def test_resume_across_schedules(saved_by_tawpipe, uninterrupted_tawpipe, world, extra):
    resumed = run_ranks(train_rank, world, tiny_args(*extra, "--load", saved_by_tawpipe, train_iters=ITERS))[0]
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert_close_rel(losses(resumed), losses(uninterrupted_tawpipe[3:]), 1e-5)


def test_native_checkpoint_resumes_under_tawpipe(tmp_path, uninterrupted_tawpipe):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", save,
                                       "--exit-interval", "3", train_iters=ITERS))
    resumed = run_ranks(train_rank, 4, tiny_args(*TAWPIPE, "--load", save, train_iters=ITERS))[0]
    assert_close_rel(losses(resumed), losses(uninterrupted_tawpipe[3:]), 1e-5)


def _train_returning_first_shard(rank, argv):
    """Train; return the records and this rank's fp32 master of shard 0 and its Adam moments, where it holds them."""
    from megatron_tawpipe.runtime.trainer import WeightPassingTrainer

    held = {}
    close = WeightPassingTrainer.close

    def keep(self):
        if 0 in self.model.owned:
            master = self.model.master(0)
            names = {self.model.template.global_name(0, slot) for slot in self.model.template.slots}
            state = [self.optimizer_state_for(view) for name, view, _ in self.named_master_parameters()
                     if name in names]
            assert len(state) == len(names)
            # (bytes: tensors from forked ranks do not survive their exit)
            held["shard0"] = (master.numpy().tobytes(), [s["exp_avg"].numpy().tobytes() for s in state],
                              [s["exp_avg_sq"].numpy().tobytes() for s in state])
        close(self)

    WeightPassingTrainer.close = keep
    return train_rank(rank, argv), held.get("shard0")


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "tawpipe"])
def test_replicated_first_shard_stays_identical_on_its_holders_and_resumes(tmp_path, uninterrupted_tawpipe,
                                                                           ckpt_format):
    """--tawpipe-replicate-first-shard: the holders of shard 0 (ranks 0 and 2) step it to bitwise
    the same weights and Adam state; training matches the plain plan; a checkpoint (written by the
    owner only) resumes it, the replica reading shard 0 back, in either checkpoint format."""
    flags = TAWPIPE + ["--tawpipe-replicate-first-shard", "--ckpt-format", ckpt_format]
    save = str(tmp_path / "ckpt")
    first = run_ranks(_train_returning_first_shard, 4, tiny_args(*flags, "--save", save, "--exit-interval", "3",
                                                                 train_iters=ITERS))
    assert [r["iteration"] for r in first[0][0]] == [1, 2, 3]
    assert first[1][1] is None and first[3][1] is None
    (w0, m0, v0), (w2, m2, v2) = first[0][1], first[2][1]
    assert w0 == w2 and m0 == m2 and v0 == v2
    assert_close_rel(losses(first[0][0]), losses(uninterrupted_tawpipe[:3]), 1e-5)
    resumed = run_ranks(_train_returning_first_shard, 4, tiny_args(*flags, "--load", save, train_iters=ITERS))
    assert [r["iteration"] for r in resumed[0][0]] == [4, 5, 6]
    assert_close_rel(losses(resumed[0][0]), losses(uninterrupted_tawpipe[3:]), 1e-5)
    assert resumed[0][1] == resumed[2][1]


@pytest.fixture(scope="module")
def fp32_reference():
    return run_ranks(train_rank, 1, tiny_args(train_iters=3))[0]


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]], ids=["bf16", "fp16"])
def test_reduced_precision_trains_close_to_fp32(precision, fp32_reference):
    records = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", *precision, train_iters=3))[0]
    assert not any(r["skipped"] for r in records)
    assert_close_rel(losses(records), losses(fp32_reference), 2e-3, "loss vs fp32")
    if "--fp16" in precision:
        assert all(r["loss_scale"] == 4096.0 for r in records)


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale():
    overflowing = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", "--fp16",
                                                     "--initial-loss-scale", "1e30", train_iters=3))
    frozen = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", "--fp16", "--lr", "0",
                                                "--min-lr", "0", train_iters=3))[0]
    for records in overflowing:
        assert [r["skipped"] for r in records] == [True, True, True]
        scales = [r["loss_scale"] for r in records]
        assert scales[0] > scales[1] > scales[2]
        # Skipped steps leave the weights as they were: same losses as a run that never updates.
        assert losses(records) == losses(frozen)


def test_recompute_replays_dropout_masks():
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    # one layout (the dropout masks follow the layout's order of micro-batches and shards), recompute on and off
    recompute = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", *dropout, *pinned_layout(1),
                                                   train_iters=3))[0]
    keep = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", *dropout,
                                              *pinned_layout(1, recompute=False), train_iters=3))[0]
    no_dropout = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", train_iters=3))[0]
    assert_close_rel(losses(recompute), losses(keep), 1e-6, "loss with recompute vs without")
    assert losses(recompute)[0] != losses(no_dropout)[0], "dropout must be active"


def _dispatch(rank):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules as megatron_schedules

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed
    from megatron_tawpipe.runtime.schedules import (forward_backward_tawpipe, forward_backward_weipipe,
                                                    get_forward_backward_func)

    initialize_distributed(parse_args(["--train-iters", "1"]))
    parallel_state.initialize_model_parallel(1, 1)
    try:
        return (get_forward_backward_func("tawpipe") is forward_backward_tawpipe,
                get_forward_backward_func("weipipe") is forward_backward_weipipe,
                get_forward_backward_func("1f1b") is megatron_schedules.forward_backward_no_pipelining)
    finally:
        destroy()


def test_dispatcher_sits_beside_megatrons():
    # Native schedules are megatron-core's own functions.
    assert run_ranks(_dispatch, 1)[0] == (True, True, True)
