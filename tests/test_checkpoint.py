"""Checkpoints: resume reproduces the uninterrupted run, also across pipeline layouts."""

import json
import os

import pytest
import torch

from distributed_harness import run_ranks
from megatron_tawpipe.common.checkpointable import CheckpointDefaults
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
    from megatron.core import dist_checkpointing

    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", save,
                                       "--exit-interval", "3", train_iters=ITERS))
    common = dist_checkpointing.load_common_state_dict(os.path.join(save, "iter_0000003"))
    assert common["iteration"] == 3 and common["tawpipe"]["world_size"] == 2
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=ITERS))
    assert_close_rel(losses(resumed), losses(uninterrupted[3:]), 1e-5)


def test_per_parameter_checkpoint_holds_every_parameter_once_under_global_names(tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", save, "--ckpt-format", "tawpipe",
                                       train_iters=2))
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


@pytest.mark.parametrize("ckpt_format, victim", [("tawpipe", "params_rank00000.pt"), ("torch_dist", "__0_0.distcp")])
def test_truncated_shard_is_refused_naming_the_file(tmp_path, ckpt_format, victim):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "1", "--ckpt-format", ckpt_format,
                                       train_iters=2))
    shard = os.path.join(save, "iter_0000001", victim)
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(AssertionError, match="iter_0000001"):
        run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=2))


class _OwnerOf(CheckpointDefaults):
    """A trainer holding only ``names`` (as a weight-passing rank holds its own shard)."""

    def __init__(self, names):
        self.masters = {name: torch.zeros(3) for name in names}
        self.states = {}

    def named_master_parameters(self):
        for name, master in self.masters.items():
            yield name, master, master

    def set_optimizer_state(self, master, state):
        self.states[id(master)] = state

    def after_parameters_loaded(self):
        pass

    def load_grad_scaler_state(self, state):
        pass


def _write_sharded_checkpoint(root, args, files):
    """``files``: {filename: [names]}; every parameter is ``[i, i, i]`` with an ``exp_avg`` of ``-i``."""
    from megatron_tawpipe import checkpoint
    from megatron_tawpipe.checkpoint import per_parameter

    directory = checkpoint.iteration_dir(root, 5)
    os.makedirs(directory)
    index, value = {}, 0.0
    for filename, names in files.items():
        params, optim = {}, {}
        for name in names:
            value += 1.0
            params[name] = torch.full((3,), value)
            optim[name] = {"exp_avg": torch.full((3,), -value), "step": torch.tensor(5.0)}
            index[name] = [[3], filename]
        torch.save({"params": params, "optimizer": optim}, os.path.join(directory, filename))
    common = {"format_version": per_parameter.FORMAT_VERSION, "iteration": 5, "consumed_samples": 40,
              "scheduler": None, "grad_scaler": None, "index": index, "pipeline_schedule": "tawpipe",
              "world_size": len(files), "model": checkpoint.model_signature(args)}
    torch.save(common, os.path.join(directory, "common.pt"))
    with open(os.path.join(root, checkpoint.TRACKER_FILE), "w") as handle:
        handle.write("5\n")
    return directory


def test_a_rank_opens_only_the_files_holding_its_parameters(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megatron_tawpipe import checkpoint

    args = SimpleNamespace(num_layers=4, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                           num_query_groups=2, padded_vocab_size=128, untie_embeddings_and_output_weights=True,
                           no_load_optim=False, finetune=False, no_load_rng=False, pipeline_schedule="tawpipe",
                           **dict(checkpoint.ARCHITECTURE_KEYS, kv_channels=4))
    root = str(tmp_path)
    directory = _write_sharded_checkpoint(root, args, {
        "params_rank00000.pt": ["embedding.word_embeddings.weight", "decoder.layers.0.w"],
        "params_rank00001.pt": ["decoder.layers.1.w"],
        "params_rank00002.pt": ["decoder.layers.2.w"],
        "params_rank00003.pt": ["decoder.layers.3.w"]})
    opened = []
    real_load = torch.load

    def recording_load(path, *a, **kw):
        opened.append((os.path.basename(path), kw.get("mmap"), kw.get("weights_only")))
        return real_load(path, *a, **kw)

    monkeypatch.setattr(torch, "load", recording_load)
    trainer = _OwnerOf(["decoder.layers.2.w", "embedding.word_embeddings.weight"])
    assert checkpoint.load_checkpoint(root, trainer, None, args) == (5, 40)
    assert sorted(name for name, _, _ in opened) == ["common.pt", "params_rank00000.pt", "params_rank00002.pt"]
    assert all(mmap and weights_only for _, mmap, weights_only in opened), opened
    assert trainer.masters["decoder.layers.2.w"].tolist() == [4.0] * 3
    assert trainer.masters["embedding.word_embeddings.weight"].tolist() == [1.0] * 3
    state = trainer.states[id(trainer.masters["decoder.layers.2.w"])]
    assert state["exp_avg"].tolist() == [-4.0] * 3 and float(state["step"]) == 5.0
    # Restored state is the trainer's own memory, not a view of the memory-mapped file.
    state["exp_avg"].add_(100.0)
    saved = real_load(os.path.join(directory, "params_rank00002.pt"), weights_only=True)
    assert saved["optimizer"]["decoder.layers.2.w"]["exp_avg"].tolist() == [-4.0] * 3


DISTRIBUTED_OPTIMIZER_PER_NODE = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                  "--num-distributed-optimizer-instances", "2"]
HSDP = ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "2"]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "tawpipe"])
def test_sharded_optimizers_resume_across_strategies(tmp_path, uninterrupted, ckpt_format):
    """Saved by the distributed optimizer (one instance per 2-rank "node"), resumed under HSDP;
    saved there, resumed on one process: the optimizer state is gathered whole (or saved in megatron-core's
    model space) and re-sliced."""
    first, second = str(tmp_path / "distopt"), str(tmp_path / "hsdp")
    fmt = ["--ckpt-format", ckpt_format]
    run_ranks(train_rank, 4, tiny_args(*DISTRIBUTED_OPTIMIZER_PER_NODE, *fmt, "--save", first, "--exit-interval", "2",
                                       train_iters=ITERS))
    directory = os.path.join(first, "iter_0000002")
    if ckpt_format == "tawpipe":
        saved = torch.load(os.path.join(directory, "params_rank00000.pt"), weights_only=True)
        assert len(saved["params"]) > 10 and all(set(s) >= {"exp_avg", "exp_avg_sq", "step"}
                                                  for s in saved["optimizer"].values())
    else:
        from megatron_tawpipe.checkpoint import read_parameters
        from torch.distributed.checkpoint import FileSystemReader

        keys = set(FileSystemReader(directory).read_metadata().state_dict_metadata)
        names = [key for key in keys if not key.startswith("optimizer.") and not key.endswith("_extra_state")
                 and "/" not in key]
        assert len(names) > 5 and all(f"optimizer.state.{state}.{key}" in keys
                                      for key in names for state in ("exp_avg", "exp_avg_sq", "param"))
        assert len(read_parameters(directory)) > 10
        # --overlap-param-gather: the saved weights are the updated ones (the deferred all-gather was finished).
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
        pairs = {key: f"optimizer.state.param.{key}" for key in names
                 if isinstance(metadata[key], TensorStorageMetadata)}
        tensors = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype)
                   for pair in pairs.items() for k in pair}
        load(tensors, storage_reader=FileSystemReader(directory), no_dist=True)
        for key, master in pairs.items():
            assert torch.equal(tensors[key], tensors[master]), key
    resumed = run_ranks(train_rank, 4, tiny_args(*HSDP, *fmt, "--load", first, "--save", second, "--exit-interval",
                                                 "4", train_iters=ITERS))[-1]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_close_rel(losses(resumed), losses(uninterrupted[2:4]), 1e-5)
    (last,) = run_ranks(train_rank, 1, tiny_args("--load", second, train_iters=ITERS))
    assert [r["iteration"] for r in last] == [5, 6]
    assert_close_rel(losses(last), losses(uninterrupted[4:]), 1e-5)


# ---- resuming with another layer split: checkpoints hold whole layers under global names --------------------------

SPLIT_ITERS = 4
TAWPIPE_2211 = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"]   # 6 layers on 4 ranks: 2, 2, 1, 1


def _split_args(*extra):
    """6 layers (which 4 ranks, 3 ranks and pipelines of 2 or 3 stages split unevenly), 12 samples a step."""
    argv = tiny_args(*extra, train_iters=SPLIT_ITERS, global_batch=12)
    argv[argv.index("--num-layers") + 1] = "6"
    return argv


@pytest.fixture(scope="module")
def uninterrupted_l6(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("uninterrupted-L6"))
    (records,) = run_ranks(train_rank, 1, _split_args("--save", save, "--save-interval", "1"))
    return records, save


@pytest.fixture(scope="module")
def tawpipe_uneven_saved(tmp_path_factory):
    """tawpipe, shards of 2, 2, 1, 1 layers, saved after 2 iterations in each format."""
    cache = {}

    def get(ckpt_format):
        if ckpt_format not in cache:
            save = str(tmp_path_factory.mktemp(f"tawpipe-2211-{ckpt_format}"))
            per_rank = run_ranks(train_rank, 4, _split_args(*TAWPIPE_2211, "--ckpt-format", ckpt_format, "--save", save,
                                                            "--exit-interval", "2"))
            cache[ckpt_format] = (per_rank[-1], save)
        return cache[ckpt_format]

    return get


def _assert_same_parameters(root, reference_root, iteration, rtol=1e-5):
    from megatron_tawpipe.checkpoint import read_parameters

    ours, theirs = (read_parameters(os.path.join(r, f"iter_{iteration:07d}")) for r in (root, reference_root))
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        diff = (ours[name] - expected).abs().max().item()
        assert diff <= rtol * expected.abs().max().item(), f"{name} after step {iteration}: max diff {diff}"


def _resume_one_step(tmp_path, uninterrupted_l6, load, world, extra):
    """Resume from ``load`` for iteration 3 (saved, in torch_dist): loss and every parameter as uninterrupted."""
    reference, reference_save = uninterrupted_l6
    save = str(tmp_path / "resumed")
    resumed = run_ranks(train_rank, world, _split_args(*extra, "--load", load, "--save", save,
                                                       "--exit-interval", "3"))[-1]
    assert [r["iteration"] for r in resumed] == [3]
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in reference[2:3]]
    assert_close_rel(losses(resumed), losses(reference[2:3]), 1e-5)
    _assert_same_parameters(save, reference_save, 3)


RESUME_SPLITS = [
    (4, TAWPIPE_2211 + ["--decoder-last-pipeline-num-layers", "3"]),                        # 1, 1, 1, 3
    (3, ["--pipeline-schedule", "weipipe"]),                                                 # 2, 2, 1
    (3, ["--pipeline-model-parallel-size", "3", "--decoder-last-pipeline-num-layers", "4"]),  # native 1F1B: 1, 1, 4
]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "tawpipe"])
@pytest.mark.parametrize("world,extra", RESUME_SPLITS, ids=["tawpipe-1113", "weipipe-221", "1f1b-pp3-114"])
def test_uneven_shards_resume_with_another_split(tmp_path, uninterrupted_l6, tawpipe_uneven_saved, ckpt_format,
                                                 world, extra):
    """Saved by tawpipe with shards of 2, 2, 1, 1 layers; resumed with shards of 1, 1, 1, 3, by weipipe on 3
    ranks, and by native 1F1B with stages of 1, 1 and 4 layers."""
    first, saved = tawpipe_uneven_saved(ckpt_format)
    assert_close_rel(losses(first), losses(uninterrupted_l6[0][:2]), 1e-5)
    _resume_one_step(tmp_path, uninterrupted_l6, saved, world, extra)


@pytest.mark.parametrize("ckpt_format,native,world,weight_passing", [
    ("torch_dist", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],   # 1, 5
     4, TAWPIPE_2211),
    ("tawpipe", ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",              # 1, 2 | 1, 2
                 "--pipeline-model-parallel-layout", "Et|tt|t|ttL"], 3, ["--pipeline-schedule", "weipipe"]),
], ids=["1f1b-first1-to-tawpipe", "interleaved-layout-to-weipipe"])
def test_uneven_native_pipeline_resumes_under_weight_passing(tmp_path, uninterrupted_l6, ckpt_format, native, world,
                                                             weight_passing):
    saved = str(tmp_path / "native")
    first = run_ranks(train_rank, 2, _split_args(*native, "--ckpt-format", ckpt_format, "--save", saved,
                                                 "--exit-interval", "2"))[-1]
    assert_close_rel(losses(first), losses(uninterrupted_l6[0][:2]), 1e-5)
    _resume_one_step(tmp_path, uninterrupted_l6, saved, world, weight_passing)
