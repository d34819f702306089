"""Megatron-LM's checkpoint format (--ckpt-format torch_dist): what native megatron-core writes loads
under the weight-passing schedules and back, and megatron-core's own loader reads what they write."""

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


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe"])
def test_native_to_weight_passing_to_native_round_trip(tmp_path, uninterrupted, schedule):
    """1F1B with 2 stages saves (megatron-core's sharded state dicts); the weight-passing schedule resumes
    and saves; native megatron without pipelining resumes: the losses continue the uninterrupted run."""
    native, weight_passing = str(tmp_path / "native"), str(tmp_path / schedule)
    first = run_ranks(train_rank, 2, tiny_args("--pipeline-model-parallel-size", "2", "--save", native,
                                               "--exit-interval", "2", train_iters=ITERS))[-1]
    second = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", schedule, "--load", native,
                                                "--save", weight_passing, "--exit-interval", "4",
                                                train_iters=ITERS))[-1]
    (third,) = run_ranks(train_rank, 1, tiny_args("--load", weight_passing, train_iters=ITERS))
    assert [r["iteration"] for r in first + second + third] == list(range(1, ITERS + 1))
    assert_close_rel(losses(first + second + third), losses(uninterrupted), 1e-5)
    assert [r["consumed_samples"] for r in third] == [r["consumed_samples"] for r in uninterrupted[4:]]


def _tensor_metadata(directory):
    from megatron.core import dist_checkpointing

    return {key: (tuple(meta.global_shape), meta.dtype)
            for key, meta in dist_checkpointing.load_tensors_metadata(directory).items()}


def test_weight_passing_writes_megatron_cores_keys_shapes_and_common_entries(tmp_path):
    """Under --bf16 (fp32 masters beside bf16 weights) tawpipe writes the tensors megatron-core's own
    sharded state dicts write, and the common entries Megatron-LM reads."""
    from megatron.core import dist_checkpointing

    native, tawpipe = str(tmp_path / "native"), str(tmp_path / "tawpipe")
    run_ranks(train_rank, 1, tiny_args("--bf16", "--save", native, "--exit-interval", "1", train_iters=2))
    run_ranks(train_rank, 2, tiny_args("--bf16", "--pipeline-schedule", "tawpipe", "--save", tawpipe,
                                       "--exit-interval", "1", train_iters=2))
    expected = _tensor_metadata(os.path.join(native, "iter_0000001"))
    written = _tensor_metadata(os.path.join(tawpipe, "iter_0000001"))
    assert written == expected
    assert expected["decoder.layers.mlp.linear_fc1.weight"] == ((8, 256, 64), torch.bfloat16)
    assert expected["optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight"][1] == torch.float32
    assert {"optimizer.state.exp_avg.embedding.word_embeddings.weight",
            "optimizer.state.exp_avg_sq.output_layer.weight"} <= set(written)
    common = dist_checkpointing.load_common_state_dict(os.path.join(tawpipe, "iter_0000001"))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 1
    assert common["args"].consumed_train_samples == 8 and common["args"].hidden_size == 64
    assert common["opt_param_scheduler"]["num_steps"] == 8
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert sorted(group["wd_mult"] for group in groups) == [0.0, 1.0]
    assert float(common["optimizer"]["optimizer"]["state"]["common_step"]) == 1.0
    with open(os.path.join(tawpipe, "iter_0000001", "metadata.json")) as handle:
        assert '"sharded_backend": "torch_dist"' in handle.read()


def _load_with_megatron_core(rank, argv, directory):
    """Megatron-LM's own loading steps on a native trainer: megatron-core's sharded state dicts filled by
    dist_checkpointing.load (strict), then the model's and the optimizer's load_state_dict."""
    from megatron.core import dist_checkpointing

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.training import build_trainer
    from megatron_tawpipe.checkpoint import load_checkpoint
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel
    from megatron_tawpipe.models.parameters import unwrap_model

    args = validate_args(parse_args(argv))
    initialize_distributed(args)
    initialize_model_parallel(args)
    try:
        build_tokenizer(args)
        by_megatron, by_us = build_trainer(args, gpt_forward_step), build_trainer(args, gpt_forward_step)
        model = unwrap_model(by_megatron.model[0])
        state = {"model": model.sharded_state_dict()}
        state["optimizer"] = by_megatron.optimizer.sharded_state_dict(state, is_loading=True)
        loaded = dist_checkpointing.load(state, directory)
        model.load_state_dict(loaded["model"])
        by_megatron.optimizer.load_state_dict(loaded["optimizer"])
        args.load = os.path.dirname(directory)
        load_checkpoint(args.load, by_us, None, args)
        compared = []
        for (name, param, master), (_n, param_us, master_us) in zip(by_megatron.named_master_parameters(),
                                                                      by_us.named_master_parameters()):
            assert torch.equal(param, param_us) and torch.equal(master, master_us), name
            ours = by_us.optimizer_state_for(master_us)
            theirs = by_megatron.optimizer_state_for(master)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(torch.as_tensor(theirs[key]), torch.as_tensor(ours[key])), (name, key)
            compared.append(name)
        return compared, float(master.abs().sum())
    finally:
        destroy()


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_megatron_core_loads_a_tawpipe_checkpoint(tmp_path, precision):
    save = str(tmp_path / "tawpipe")
    run_ranks(train_rank, 2, tiny_args(*precision, "--pipeline-schedule", "tawpipe", "--save", save, train_iters=2))
    (result,) = run_ranks(_load_with_megatron_core, 1, tiny_args(*precision, train_iters=2),
                          os.path.join(save, "iter_0000002"))
    compared, checksum = result
    assert len(compared) == 8 * 6 + 3 and checksum > 0  # 6 a layer, embedding, final norm, output layer


def test_use_checkpoint_args_takes_the_model_flags_from_the_checkpoint(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "3", train_iters=ITERS))
    argv = tiny_args("--load", save, "--use-checkpoint-args", train_iters=ITERS)
    for flag, value in (("--hidden-size", "32"), ("--num-layers", "2"), ("--ffn-hidden-size", "96")):
        argv[argv.index(flag) + 1] = value
    (resumed,) = run_ranks(train_rank, 1, argv)
    assert losses(resumed) == losses(uninterrupted[3:])
