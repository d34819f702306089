"""--tensor-model-parallel-size with the native schedules: megatron-core's tensor parallelism on gloo
(with and without --sequence-parallel) matches one process without it, and checkpoints move between
tensor-parallel layouts and schedules. (Inside weight passing: test_tensor_parallel_weight_passing.py.)"""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.arguments import LLAMA_FLAGS
from training_helpers import GPT_FLAGS, assert_close_rel, losses, tiny_args, train_rank

ITERS = 3


def _grad_norms(records):
    return [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def reference():
    """One process, no parallelism, Llama and GPT architectures (clipping at 1.0 is active: norms > 1)."""
    llama = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS))[0]
    gpt = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS, architecture=GPT_FLAGS))[0]
    return {"llama": llama, "gpt": gpt}


@pytest.mark.parametrize("world, extra, architecture", [
    (2, ["--tensor-model-parallel-size", "2"], "llama"),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], "llama"),
    (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"], "llama"),
    (2, ["--tensor-model-parallel-size", "2"], "gpt"),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "llama"),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"], "gpt"),
], ids=["tp2", "tp2-pp2", "tp2-dp2-distopt", "tp2-gpt", "tp2-sp", "tp2-sp-pp2-gpt"])
def test_tensor_parallel_matches_one_process(reference, world, extra, architecture):
    flags = GPT_FLAGS if architecture == "gpt" else None
    argv = tiny_args(*extra, train_iters=ITERS, **({"architecture": flags} if flags else {}))
    records = run_ranks(train_rank, world, argv)[-1]
    expected = reference[architecture]
    assert max(_grad_norms(expected)) > 1.0
    assert_close_rel(losses(records), losses(expected), 1e-5)
    assert_close_rel(_grad_norms(records), _grad_norms(expected), 1e-5, "grad norm")


def test_checkpoints_cross_tensor_parallel_layouts_and_schedules(tmp_path):
    """TP 2 saves (torch_dist); tawpipe resumes and saves; TP 2 x PP 2 resumes: the uninterrupted run's losses."""
    iters = 6
    (uninterrupted,) = run_ranks(train_rank, 1, tiny_args(train_iters=iters))
    tp, tawpipe = str(tmp_path / "tp"), str(tmp_path / "tawpipe")
    first = run_ranks(train_rank, 2, tiny_args("--tensor-model-parallel-size", "2", "--save", tp,
                                               "--exit-interval", "2", train_iters=iters))[-1]
    second = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", "--load", tp, "--save", tawpipe,
                                                "--exit-interval", "4", train_iters=iters))[-1]
    third = run_ranks(train_rank, 4, tiny_args("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                               "2", "--load", tawpipe, train_iters=iters))[-1]
    assert [r["iteration"] for r in first + second + third] == list(range(1, iters + 1))
    assert_close_rel(losses(first + second + third), losses(uninterrupted), 1e-5)


@pytest.mark.parametrize("architecture", ["llama", "gpt"])
def test_sequence_parallel_with_layernorm_1p_matches_one_process(architecture):
    """--sequence-parallel with zero-centred norm weights (--apply-layernorm-1p) on torch's norms: the norms'
    partial weight gradients are all-reduced over the tensor-parallel group, as without the flag."""
    flags = list(GPT_FLAGS if architecture == "gpt" else LLAMA_FLAGS) + ["--apply-layernorm-1p", "--qk-layernorm"]
    (expected,) = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS, architecture=flags))
    records = run_ranks(train_rank, 2, tiny_args("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                 train_iters=ITERS, architecture=flags))[-1]
    assert max(_grad_norms(expected)) > 1.0
    assert_close_rel(losses(records), losses(expected), 1e-5)
    assert_close_rel(_grad_norms(records), _grad_norms(expected), 1e-5, "grad norm")


@pytest.mark.parametrize("extra, message", [
    (["--num-query-groups", "1", "--group-query-attention"], "--num-query-groups 1 must be divisible by"),
    (["--save", "x", "--ckpt-format", "tawpipe"], "use --ckpt-format torch_dist"),
    (["--use-torch-fsdp2"], "--tensor-model-parallel-size 2 with --use-torch-fsdp2"),
])
def test_unsupported_tensor_parallel_combinations_are_refused(monkeypatch, extra, message):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_args(tiny_args("--tensor-model-parallel-size", "2", *extra)))
