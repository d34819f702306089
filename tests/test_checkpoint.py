"""Checkpoints: resume reproduces the uninterrupted run, also across pipeline layouts."""

import json
import os

import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank

ITERS = 6


@pytest.fixture(scope="module")
def uninterrupted():
    (records,) = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS))
    return records


def test_resume_reproduces_uninterrupted_run(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    (first,) = run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "3", train_iters=ITERS))
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=ITERS))
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in uninterrupted[3:]]
    # Same layout: bit-for-bit the same losses and learning rates.
    assert losses(resumed) == losses(uninterrupted[3:])
    assert [r["learning_rate"] for r in resumed] == [r["learning_rate"] for r in uninterrupted[3:]]


def test_resume_across_pipeline_layouts(tmp_path, uninterrupted):
    """Saved by 1F1B with 2 stages, resumed without pipelining on one process."""
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", save,
                                       "--exit-interval", "3", train_iters=ITERS))
    meta = json.load(open(os.path.join(save, "iter_0000003", "metadata.json")))
    assert meta["iteration"] == 3 and meta["world_size"] == 2
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=ITERS))
    assert_close_rel(losses(resumed), losses(uninterrupted[3:]), 1e-5)


def test_checkpoint_holds_every_parameter_once_under_global_names(tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", save, train_iters=2))
    common = torch.load(os.path.join(save, "iter_0000002", "common.pt"), weights_only=True)
    names = set(common["index"])
    assert {f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(8)} <= names
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= names
    files = {entry[1] for entry in common["index"].values()}
    assert files == {"params_rank00000.pt", "params_rank00001.pt"}
    for name, (shape, filename) in common["index"].items():
        shard = torch.load(os.path.join(save, "iter_0000002", filename), weights_only=True)
        assert list(shard["params"][name].shape) == shape
        assert set(shard["optimizer"][name]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert not any(entry.endswith(".tmp") for entry in os.listdir(save))


def test_mismatched_model_is_refused(tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "1", train_iters=2))
    argv = tiny_args("--load", save, train_iters=2)
    argv[argv.index("--hidden-size") + 1] = "32"
    with pytest.raises(AssertionError, match="hidden-size"):
        run_ranks(train_rank, 1, argv)


def test_truncated_shard_is_refused_naming_the_file(tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "1", train_iters=2))
    shard = os.path.join(save, "iter_0000001", "params_rank00000.pt")
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(AssertionError, match="params_rank00000.pt"):
        run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=2))
