"""Faults: dead or stalled ranks, a kill during checkpointing, NaN/Inf, an unreachable master."""

import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from distributed_harness import run_ranks, run_ranks_outcomes
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan
from training_helpers import assert_close_rel, losses, tiny_args, train_rank, pinned_layout

TIMEOUT_MINUTES = 0.25  # 15 s: the bound within which survivors must report


def _faulty_rank(rank, argv, victim, fault, after_calls):
    """Train; on ``victim`` the ``after_calls``-th shard forward kills or stalls the process."""
    from megatron_tawpipe.runtime import weight_pipe_model

    if rank == victim:
        original = weight_pipe_model.WeightPipeModel.forward
        calls = {"n": 0}

        def forward(self, mb, shard, weights):
            calls["n"] += 1
            if calls["n"] == after_calls:
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            return original(self, mb, shard, weights)

        weight_pipe_model.WeightPipeModel.forward = forward
    return train_rank(rank, argv)


@pytest.mark.parametrize("schedule,fault", [("tawpipe", "kill"), ("weipipe", "kill"), ("tawpipe", "stall")])
def test_survivors_report_a_dead_or_stalled_rank(schedule, fault):
    layout = pinned_layout(2) if schedule == "tawpipe" else []   # the plan steps of one layout
    argv = tiny_args("--pipeline-schedule", schedule, "--tawpipe-num-groups", "2", *layout,
                     "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), train_iters=3)
    # 8 layers on 4 ranks, 2 micro-batches per rank: 8 shard forwards per iteration; fail in iteration 2.
    outcomes = run_ranks_outcomes(_faulty_rank, 4, argv, 2, fault, 11, timeout=120, expected_reports=3)
    assert outcomes[2][0] == "gone"
    # The 11th shard forward of rank 2 is its 3rd forward of iteration 2: that plan step is where it stopped.
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=2)
    forwards = [i for i, a in enumerate(plan.actions[2]) if isinstance(a, A.Forward)]
    assert len(forwards) == 8
    culprit = (f"rank 2 {'stopped' if fault == 'kill' else 'stalled'} "
               f"(.*) at iteration 2, plan step {forwards[2]} of {len(plan.actions[2])}, Forward\\(")
    survivors = [outcomes[r] for r in (0, 1, 3)]
    for status, text, seconds in survivors:
        assert status == "error", (status, text)
        assert "PeerFailure" in text or "failed or did not complete" in text, text[-2000:]
        # Names this rank, its plan step, and the peer(s) it was waiting for...
        assert re.search(r"rank \d, step \d+ of \d+", text), text[-2000:]
        assert re.search(r"(from|to) rank \d|over ranks \[", text), text[-2000:]
        # ...and, from every rank's posted progress, the rank that stopped first and its plan step,
        # also where this rank waited on an intermediate rank that gave up because of it.
        assert re.search(culprit, text), text[-2000:]
        # Bounded by the timeout (plus start-up, a cascade of at most a few waits and the diagnosis).
        assert seconds < 4 * TIMEOUT_MINUTES * 60 + 30, seconds


def _faulty_native_rank(rank, argv, victim, fault, after_calls):
    """Native megatron schedule; on ``victim`` the ``after_calls``-th micro-batch forward kills or stalls it."""
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    forward_step_func = gpt_forward_step
    if rank == victim:
        original = gpt_forward_step
        calls = {"n": 0}

        def forward_step(data_iterator, model):
            calls["n"] += 1
            if calls["n"] == after_calls:
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            return original(data_iterator, model)

        forward_step_func = forward_step
    return train_rank(rank, argv, forward_step_func)


@pytest.mark.parametrize("fault", ["stall", "kill"])
def test_native_pipeline_does_not_hang_on_a_stalled_or_dead_rank(fault):
    """megatron's own pipeline transfers wait without a bound: the progress watchdog bounds them."""
    from megatron_tawpipe.monitor.progress import hang_limit_s

    argv = tiny_args("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "4",
                     "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), train_iters=3)
    # 8 micro-batches per iteration on one pipeline: the 11th forward of stage 2 is in iteration 2.
    outcomes = run_ranks_outcomes(_faulty_native_rank, 4, argv, 2, fault, 11, timeout=150)
    limit = hang_limit_s(TIMEOUT_MINUTES * 60)
    for rank in (0, 1, 3):
        status, text, seconds = outcomes[rank]
        assert status in ("error", "gone") and text, (rank, status, text)
        assert seconds is not None and seconds < limit + 45, (rank, seconds)
        if fault == "stall":
            assert re.search(r"rank 2 stalled \(.*\) at iteration 2, native schedule, forward number 2 ", text), text[-2000:]
        else:
            assert re.search(r"rank 2 stopped \(.*\) at iteration 2, native schedule, forward number 2 ", text), text[-2000:]
    if fault == "stall":  # the stalled rank's own watchdog ends it too
        status, text, seconds = outcomes[2]
        assert status == "gone" and seconds is not None and "rank 2 made no progress" in text, (status, text)


def _kill_while_saving(rank, argv, kill_at_iteration):
    """Rank 0 is killed after every file of that iteration's checkpoint was written, as it is about to
    promote the temporary directory (either format)."""
    from megatron_tawpipe.checkpoint import state

    partial = f"iter_{kill_at_iteration:07d}.tmp"
    original_fsync = state.fsync_dir

    def fsync_dir(path):
        if path.endswith(partial):
            os.kill(os.getpid(), signal.SIGKILL)
        return original_fsync(path)

    state.fsync_dir = fsync_dir
    return train_rank(rank, argv)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "tawpipe"])
def test_kill_during_checkpoint_save_leaves_previous_checkpoint_loadable(tmp_path, ckpt_format):
    save = str(tmp_path / "ckpt")
    iters = 6
    tawpipe = ("--pipeline-schedule", "tawpipe", *pinned_layout(1))   # separate runs compared bit for bit
    uninterrupted = run_ranks(train_rank, 2, tiny_args(*tawpipe, train_iters=iters))[0]
    argv = tiny_args(*tawpipe, "--save", save, "--save-interval", "2", "--ckpt-format",
                     ckpt_format, "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), train_iters=iters)
    outcomes = run_ranks_outcomes(_kill_while_saving, 2, argv, 4, timeout=120)
    assert outcomes[0][0] == "gone"
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert os.path.isdir(os.path.join(save, "iter_0000004.tmp"))  # the partial save, never promoted
    resumed = run_ranks(train_rank, 2, tiny_args(*tawpipe, "--load", save, train_iters=iters))[0]
    assert [r["iteration"] for r in resumed] == [3, 4, 5, 6]
    assert losses(resumed) == losses(uninterrupted[2:])


@pytest.mark.parametrize("world,extra", [(4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"]),
                                         (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                              "--tensor-model-parallel-size", "2"]),
                                         (1, ["--pipeline-schedule", "1f1b"])], ids=["tawpipe", "tawpipe-tp2", "native"])
def test_nan_stops_every_rank_naming_iteration(world, extra):
    argv = tiny_args(*extra, "--lr", "1e20", "--min-lr", "1e20", train_iters=6)
    outcomes = run_ranks_outcomes(train_rank, world, argv, timeout=120)
    for status, text, _ in outcomes:
        assert status == "error", (status, text)
        assert "NaN" in text or "nan" in text or "inf" in text.lower(), text[-1500:]
        assert "iteration" in text
    if world > 1:
        assert all("shard" in text or "replicated" in text for _, text, _ in outcomes)
    if "--tensor-model-parallel-size" in extra:   # owners named as tensor-parallel groups of global ranks
        assert all("ranks 0-1, a tensor-parallel group" in text or "ranks 2-3, a tensor-parallel group" in text
                   or "replicated" in text for _, text, _ in outcomes)


def test_nan_check_can_be_disabled():
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--lr", "1e20", "--min-lr", "1e20",
                     "--no-check-for-nan-in-loss-and-grad", train_iters=4)
    records = run_ranks(train_rank, 2, argv)[0]
    assert len(records) == 4


def test_unresolvable_master_address_is_one_line(monkeypatch, capsys):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert pretrain_llama.main(tiny_args("--pipeline-model-parallel-size", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MASTER_ADDR 'no-such-host.invalid' does not resolve" in err[0], err
    assert not dist.is_initialized()


def test_unreachable_master_is_reported_after_the_timeout(monkeypatch, capsys):
    import pretrain_llama
    from distributed_harness import free_port

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    start = time.monotonic()
    assert pretrain_llama.main(tiny_args("--pipeline-model-parallel-size", "2",
                                         "--distributed-timeout-minutes", "0.05")) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach MASTER_ADDR:MASTER_PORT 127.0.0.1:" in err[-1], err
    assert not dist.is_initialized()
