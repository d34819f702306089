"""--tensor-model-parallel-size inside weight passing: tawpipe and weipipe over P / T virtual ranks.

Each case runs 3 iterations (clipping active, fp32, forked gloo ranks, the executor's NCCL-faithful
mode) and compares, against one process without any parallelism: the loss and gradient norm of every
iteration, and every parameter after every step, gathered into whole tensors by the checkpoint (the
parameters read back from both runs' torch_dist checkpoints). The bytes each link class carried equal
the plan's, now summed over the tensor-parallel indices (each moves 1/T of every shard).
"""

import pytest

from distributed_harness import run_ranks
# The single-process reference runs (a module-scoped fixture, cached per shape) and their arguments.
from test_weight_passing_equivalence import ITERS, _args, reference  # noqa: F401
from training_helpers import GPT_FLAGS, assert_close_rel, assert_matches_reference, losses, tiny_args, train_rank
from megatron_tawpipe.arguments import LLAMA_FLAGS

GPT = list(GPT_FLAGS)
QK_NORM = list(LLAMA_FLAGS) + ["--qk-layernorm"]


TAWPIPE = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"]
WEIPIPE = ["--pipeline-schedule", "weipipe"]
SP = ["--sequence-parallel"]
# world, flags, layers, global batch, architecture. T = 2 everywhere: P / 2 virtual ranks, each owning
# (layers / virtual ranks) layers, with (global batch / virtual ranks) micro-batches.
CASES = [
    (4, TAWPIPE, 2, 2, LLAMA_FLAGS),                                            # 1 layer/shard, 1 mb
    (4, TAWPIPE + SP, 4, 6, LLAMA_FLAGS),                                       # 2 layers/shard, 3 mb
    (4, TAWPIPE + SP + ["--tawpipe-no-recompute"], 2, 6, GPT),                  # biases, LayerNorm, positions
    (8, TAWPIPE, 8, 12, LLAMA_FLAGS),                                           # 2 layers/shard, 3 mb
    (8, TAWPIPE + SP + ["--tawpipe-microbatches-per-visit", "2"], 4, 8, QK_NORM),
    (4, TAWPIPE + ["--tawpipe-replicate-first-shard"], 4, 6, LLAMA_FLAGS),     # shard 0 in both groups
    (4, WEIPIPE + SP, 2, 6, LLAMA_FLAGS),                                       # 1 layer/shard, 3 mb
    (4, WEIPIPE + ["--tawpipe-no-recompute"], 4, 2, GPT),                       # 2 layers/shard, 1 mb
    (6, WEIPIPE + SP, 6, 3, LLAMA_FLAGS),                                       # 2 layers/shard, 1 mb
    (6, WEIPIPE + ["--tawpipe-no-recompute"], 3, 9, QK_NORM),                   # 1 layer/shard, 3 mb
    (4, TAWPIPE, 3, 4, LLAMA_FLAGS),                                            # shards of 2 and 1 layers, 2 mb
    (6, WEIPIPE + SP, 5, 3, LLAMA_FLAGS),                                       # shards of 2, 2, 1 layers, 1 mb
]


def _case_id(case):
    world, extra, layers, batch, architecture = case
    flags = "-".join(f.lstrip("-").replace("tawpipe-", "") for f in extra if f.startswith("--")
                     and f not in ("--pipeline-schedule", "--tawpipe-num-groups"))
    arch = "gpt" if architecture is GPT else ("qknorm" if architecture is QK_NORM else "llama")
    virtual = world // 2
    per_shard = f"{layers // virtual}lps" if layers % virtual == 0 else f"L{layers}"
    return f"{extra[1]}-P{world}-T2-{flags or 'plain'}-{arch}-{per_shard}-{batch // virtual}mb"


@pytest.mark.parametrize("world,extra,layers,global_batch,architecture", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_single_process_reference(world, extra, layers, global_batch, architecture, reference, tmp_path):
    ref_records, ref_save = reference(layers, global_batch, architecture=architecture)
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, world, _args(
        *extra, "--tensor-model-parallel-size", "2", "--tawpipe-nccl-faithful", "--distributed-timeout-minutes", "2",
        layers=layers, global_batch=global_batch, save=save, architecture=architecture))
    for records in per_rank:
        assert_close_rel(losses(records), losses(ref_records), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], 1e-5,
                         "grad norm")
    assert max(r["grad_norm"] for r in ref_records) > 1.0   # clipping was active
    # Gradients entering every optimizer step within 1e-5; parameters within what Adam makes of gradient
    # differences of that size (the key bias's exact gradient is zero: rounding noise that Adam scales to
    # updates of about --lr, as it does any element whose gradient is within rounding of zero).
    assert_matches_reference(save, ref_save, ITERS)
    for record in per_rank[0]:
        assert record["inter_group_bytes"] == record["planned_inter_group_bytes"]
        assert record["intra_group_bytes"] == record["planned_intra_group_bytes"]
        assert record["inter_group_bytes"] + record["intra_group_bytes"] > 0


def test_node_links_carry_each_shard_once_whatever_the_tensor_parallel_size():
    """The same plan (2 virtual ranks in 2 groups) with T = 1 on 2 ranks and T = 2 on 4: with T = 2 each
    rank sends its 1/T of every shard, so the node links carry what they carry with T = 1, plus the
    norm weights that every tensor-parallel rank keeps whole (well under 5% here)."""
    flags = TAWPIPE + ["--tawpipe-nccl-faithful", "--distributed-timeout-minutes", "2"]
    one = run_ranks(train_rank, 2, tiny_args(*flags, train_iters=2, global_batch=4))[0][0]
    two = run_ranks(train_rank, 4, tiny_args(*flags, "--tensor-model-parallel-size", "2", train_iters=2,
                                             global_batch=4))[0][0]
    assert one["inter_group_bytes"] > 0
    assert one["inter_group_bytes"] < two["inter_group_bytes"] < 1.05 * one["inter_group_bytes"]
    assert_close_rel([two["lm_loss"]], [one["lm_loss"]], 1e-5)


def test_checkpoints_cross_tensor_parallel_sizes_and_schedules(tmp_path):
    """tawpipe T = 2 saves (its slices, as pieces of the whole tensors); tawpipe T = 1 resumes and saves;
    native 1F1B with T = 2 x 2 stages (megatron-core's own sharded layout) resumes and saves; tawpipe
    T = 2 resumes (reading its slices as pieces): the losses of one uninterrupted run."""
    iters = 8
    (uninterrupted,) = run_ranks(train_rank, 1, tiny_args(train_iters=iters))
    dirs = [str(tmp_path / name) for name in ("t2", "t1", "native")]
    segments = [
        (4, TAWPIPE + ["--tensor-model-parallel-size", "2", "--save", dirs[0], "--exit-interval", "2"]),
        (2, TAWPIPE + ["--load", dirs[0], "--save", dirs[1], "--exit-interval", "4"]),
        (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--load", dirs[1], "--save",
             dirs[2], "--exit-interval", "6"]),
        (4, TAWPIPE + ["--tensor-model-parallel-size", "2", "--load", dirs[2]]),
    ]
    records = []
    for world, flags in segments:
        records += run_ranks(train_rank, world, tiny_args(*flags, train_iters=iters))[-1]
    assert [r["iteration"] for r in records] == list(range(1, iters + 1))
    assert_close_rel(losses(records), losses(uninterrupted), 1e-5)


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_low_precision_and_evaluation_follow_tensor_parallelism_one(precision):
    """bf16 (fp32 masters) and fp16 (dynamic loss scaling) with T = 2 train and evaluate like T = 1 up to
    rounding: the same validation batches, losses within 2% (different summation orders in 16 bits)."""
    flags = TAWPIPE + [precision, "--eval-interval", "2", "--eval-iters", "2", "--tawpipe-nccl-faithful"]
    one = run_ranks(train_rank, 2, tiny_args(*flags, train_iters=4, global_batch=4))[0]
    two = run_ranks(train_rank, 4, tiny_args(*flags, "--tensor-model-parallel-size", "2", train_iters=4,
                                             global_batch=4))[0]
    assert_close_rel(losses(two), losses(one), 2e-2)
    validation = [(r["iteration"], r["validation_lm_loss"]) for r in two if r.get("validation_lm_loss") is not None]
    expected = [(r["iteration"], r["validation_lm_loss"]) for r in one if r.get("validation_lm_loss") is not None]
    assert [i for i, _ in validation] == [i for i, _ in expected] == [2, 4]
    assert_close_rel([v for _, v in validation], [v for _, v in expected], 2e-2, "validation loss")
    if precision == "--fp16":
        assert all(r["loss_scale"] > 1 for r in two)


def test_bf16_resume_with_tensor_parallelism_continues_exactly(tmp_path):
    """--bf16, T = 2: a run stopped after iteration 2 and resumed from its checkpoint (bf16 weights,
    fp32 masters and Adam moments written and read as slices) repeats the uninterrupted run's losses."""
    flags = TAWPIPE + ["--bf16", "--tensor-model-parallel-size", "2"]
    save = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(train_rank, 4, tiny_args(*flags, train_iters=4, global_batch=4))[0]
    first = run_ranks(train_rank, 4, tiny_args(*flags, "--save", save, "--exit-interval", "2", train_iters=4,
                                               global_batch=4))[0]
    second = run_ranks(train_rank, 4, tiny_args(*flags, "--load", save, train_iters=4, global_batch=4))[0]
    assert [r["iteration"] for r in first + second] == [1, 2, 3, 4]
    assert losses(first + second) == losses(uninterrupted)


@pytest.mark.parametrize("world, local, extra, message", [
    (6, "3", ["--pipeline-schedule", "tawpipe"],
     "3 ranks per node (LOCAL_WORLD_SIZE), which 2 does not divide, so a tensor-parallel group would span nodes"),
    (4, None, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "4"],
     "--tawpipe-num-groups 4 gives 1 ranks per group, which 2 does not divide"),
    (4, None, ["--pipeline-schedule", "weipipe", "--num-attention-heads", "2", "--ffn-hidden-size", "129"],
     "--ffn-hidden-size 129 must be divisible by --tensor-model-parallel-size 2"),
    (4, None, ["--pipeline-schedule", "weipipe", "--num-layers", "1"],
     "--num-layers 1, --pipeline-schedule weipipe over 2 weight-pipeline ranks (tensor-parallel groups: ranks / "
     "--tensor-model-parallel-size 2): 1 layers cannot be cut into 2 pieces"),
    (6, None, ["--pipeline-schedule", "weipipe", "--tensor-model-parallel-size", "4"],
     "--tensor-model-parallel-size 4 must divide the number of ranks 6"),
    (4, None, ["--pipeline-schedule", "tawpipe", "--sequence-parallel", "--seq-length", "31", "--max-position-embeddings",
               "31"], "--seq-length 31 must be divisible by --tensor-model-parallel-size 2"),
])
def test_unsupported_layouts_are_refused_before_any_process_group(monkeypatch, world, local, extra, message):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("WORLD_SIZE", str(world))
    if local:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    else:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = tiny_args("--tensor-model-parallel-size", "2", *extra)
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(argv))
    assert message in str(info.value)


def test_transfer_errors_name_global_ranks():
    """With T = 2, plan rank 1 is global rank 2 or 3 depending on the tensor-parallel index: what a wait
    reports (a dead or stalled peer) names the global ranks a user sees in the launcher's logs."""
    from megatron_tawpipe.plan import actions as A
    from megatron_tawpipe.runtime.transport import describe_op

    physical = lambda rank: rank * 2 + 1  # noqa: E731 - tensor-parallel index 1 of T = 2
    recv = A.RecvStart(tag=5, peer=1, buf="w0", kind="weight", shard=3, link="inter")
    assert describe_op(recv, 0, physical) == ("receive of weight shard 3 from rank 3 (rank 3 stopped, stalled or "
                                              "is unreachable)")
    bcast = A.BroadcastStart(tag=6, root=0, ranks=(0, 1), buf="w1", kind="weight", shard=0, link="intra")
    assert describe_op(bcast, 1, physical) == "broadcast of weight shard 0 from rank 1 over ranks [1, 3]"
    assert "from rank 1 " in describe_op(recv, 0)   # without tensor parallelism, plan ranks are global
