"""--step-batch-size-schedule: Megatron-LM's batch-size ramp, under every schedule and across a resume."""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank

from megatron_tawpipe.arguments import ArgumentError, parse_args
from megatron_tawpipe.training.validate_args import validate_args
from megatron_tawpipe.data import batch_schedule

# Sequences of 32 tokens: 192 tokens = 6 samples. Batches of 4 until 6 samples are consumed, then 8:
# the iterations consume 4, 4, 8, 8 (0 -> 4 -> 8 -> 16 -> 24).
RAMP = ["--step-batch-size-schedule", "0:4 192:8"]
CONSUMED = [4, 8, 16, 24]


def ramp_args(*extra: str, train_iters: int = 4):
    argv = tiny_args(*RAMP, *extra, train_iters=train_iters)
    i = argv.index("--global-batch-size")
    del argv[i:i + 2]
    return argv


def test_parse_reads_megatron_lm_format():
    assert batch_schedule.parse_step_schedule("0:768 250B:1536, 500B:3072", 2048) == [
        (0, 768), (250 * 10 ** 9 // 2048, 1536), (500 * 10 ** 9 // 2048, 3072)]
    assert batch_schedule.parse_step_schedule("1.5k:32 0:16", 64) == [(0, 16), (23, 32)]   # sorted; 1500 // 64


@pytest.mark.parametrize("text,message", [
    ("64:4 128:8", "the first threshold must be 0"),
    ("0:4 0:8", "thresholds must increase strictly"),
    ("0:4 31:8", "thresholds must increase strictly"),     # 31 tokens is 0 samples of 32 tokens
    ("0-4", "is not THRESHOLD:BATCH"),
    ("0:x", "is not THRESHOLD:BATCH"),
    ("0:0", "must be positive"),
])
def test_malformed_schedules_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        batch_schedule.parse_step_schedule(text, 32)


def test_iterations_and_samples_follow_the_schedule():
    ramp = [(0, 4), (6, 8)]
    assert [batch_schedule.samples_after(ramp, i) for i in range(5)] == [0] + CONSUMED
    # Megatron-LM's count for --train-samples: run until the consumed samples reach it.
    assert batch_schedule.iterations_for_samples(ramp, 20) == 4
    assert batch_schedule.iterations_for_samples(ramp, 16) == 3
    assert batch_schedule.iterations_for_samples([(0, 8)], 20) == 2   # constant: floor, as Megatron-LM
    assert batch_schedule.reachable([(0, 4), (6, 8), (100, 16)], 8, 50) == [(6, 8)]


def test_validation_sets_batches_iterations_and_lr_spans():
    args = validate_args(parse_args(ramp_args()), world_size=4)
    assert args.batch_schedule == [(0, 4), (6, 8)]
    assert (args.global_batch_size, args.num_microbatches) == (4, 1)
    assert args.lr_warmup_steps == 4 and args.lr_decay_steps == 24      # 1 and 4 iterations, in samples
    argv = ramp_args()
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = argv.index(flag)
        del argv[i:i + 2]
    args = validate_args(parse_args(argv + ["--train-samples", "20", "--lr-warmup-samples", "4"]), world_size=4)
    assert args.train_iters == 4 and args.lr_decay_steps == 20


@pytest.mark.parametrize("extra,world,message", [
    (["--global-batch-size", "8"], 4, "--step-batch-size-schedule and --global-batch-size are mutually exclusive"),
    (["--step-batch-size-schedule", "0:4 192:6"], 4,
     "--step-batch-size-schedule: the global batch 6 (from 6 samples) must be a multiple of --micro-batch-size 1 x "
     "data-parallel size 4 = 4"),
    (["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--step-batch-size-schedule", "0:3 192:8"], 2,
     "--pipeline-schedule interleaved needs the number of micro-batches (3) to be a multiple of "
     "--pipeline-model-parallel-size 2"),
])
def test_schedules_that_do_not_fit_are_refused(extra, world, message):
    argv = ramp_args()
    if "--step-batch-size-schedule" in extra:
        i = argv.index("--step-batch-size-schedule")
        del argv[i:i + 2]
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(argv + extra), world_size=world)
    assert message in str(info.value)


def test_rampup_batch_size_notice_says_what_megatron_lm_does(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    argv = tiny_args("--rampup-batch-size", "16", "16", "1000")
    validate_args(parse_args(argv), world_size=1)
    err = capsys.readouterr().out
    assert "--rampup-batch-size 16 16 1000: deprecated, and ignored by Megatron-LM" in err
    assert "--step-batch-size-schedule" in err


def test_step_schedule_matches_one_process_under_every_schedule(tmp_path):
    """4 ranks under tawpipe, weipipe and 1f1b (2 stages x 2 data-parallel) step from 1 to 2
    micro-batches per rank after iteration 2; 1F1B saves there and tawpipe resumes. Every run
    follows the one-process run (4 then 8 micro-batches) within 1e-5."""
    reference = run_ranks(train_rank, 1, ramp_args())[0]
    assert [r["consumed_samples"] for r in reference] == CONSUMED
    assert [r["global_batch_size"] for r in reference] == [4, 4, 8, 8]
    # Throughput counts each iteration's own batch: the model FLOPs per sample come out the same throughout.
    per_sample = [r["tflops_per_rank"] * r["elapsed_ms"] / r["global_batch_size"] for r in reference]
    assert max(per_sample) / min(per_sample) - 1 < 1e-9, per_sample
    runs = {schedule: run_ranks(train_rank, 4, ramp_args("--pipeline-schedule", schedule))[-1]
            for schedule in ("tawpipe", "weipipe")}
    first = run_ranks(train_rank, 4, ramp_args("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "2",
                                               "--save", str(tmp_path), "--exit-interval", "2"))[-1]
    resumed = run_ranks(train_rank, 4, ramp_args("--pipeline-schedule", "tawpipe", "--load", str(tmp_path)))[-1]
    runs["1f1b then tawpipe"] = first + resumed
    for name, records in runs.items():
        assert [r["consumed_samples"] for r in records] == CONSUMED, name
        assert_close_rel(losses(records), losses(reference), 1e-5, f"{name} loss")
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-5,
                         f"{name} grad norm")
        assert_close_rel([r["learning_rate"] for r in records], [r["learning_rate"] for r in reference], 1e-6,
                         f"{name} learning rate")


def _core_step_calculator():
    from megatron.core import num_microbatches_calculator as calculators

    return getattr(calculators, "StepBatchsizeNumMicroBatchesCalculator", None)


@pytest.mark.skipif(_core_step_calculator() is None,
                    reason="megatron-core < 0.18 has no step batch-size calculator (CI's 0.16.1); checked under 0.19")
def test_schedule_agrees_with_megatron_cores_calculator():
    """Where megatron-core has Megatron-LM's step calculator, both give the same batch and micro-batch
    count for every consumed-sample count, for the same schedule string."""
    text, seq_length, micro, dp = "0:4 192:8 1.5K:16 2K:24", 32, 2, 2
    core = _core_step_calculator()(micro_batch_size=micro, data_parallel_size=dp, decrease_batch_size_if_needed=False,
                                   rank=1, schedule=text, seq_length=seq_length)
    ours = batch_schedule.parse_step_schedule(text, seq_length)
    for consumed in range(0, 120):
        core.update(consumed, consistency_check=False)
        assert batch_schedule.batch_at(ours, consumed) == core.get_current_global_batch_size(), consumed
        assert batch_schedule.micro_batches(batch_schedule.batch_at(ours, consumed), micro, dp) == core.get(), consumed
