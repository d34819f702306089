"""Megatron's native pipeline schedules on gloo match a single-process run."""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank


@pytest.fixture(scope="module")
def reference():
    (records,) = run_ranks(train_rank, 1, tiny_args("--pipeline-model-parallel-size", "1"))
    return records


@pytest.mark.parametrize("world,extra", [
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "4"]),
    (4, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "4",
         "--num-layers-per-virtual-pipeline-stage", "1"]),
], ids=["1f1b-pp2", "1f1b-pp4", "interleaved-pp4-vp2"])
def test_pipeline_matches_single_process(reference, world, extra):
    per_rank = run_ranks(train_rank, world, tiny_args(*extra))
    assert len(reference) == 3
    for records in per_rank:  # every rank reports the same, reduced loss
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-4, "grad norm")
    # The run trains: the loss moves between iterations.
    assert losses(reference)[0] != losses(reference)[-1]


def test_data_parallel_pipeline_matches_single_process(reference):
    """pp 2 x dp 2: megatron DDP averages over replicas, the pipeline over stages."""
    per_rank = run_ranks(train_rank, 4, tiny_args("--pipeline-model-parallel-size", "2"))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
