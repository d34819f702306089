"""--context-parallel-size with the native schedules: megatron-core's context parallelism (its groups, its
balanced split of each sequence, its loss scaling and gradient reduction) with the ring attention on gloo
trains like one process without it; checkpoints move between context-parallel sizes; what it cannot run is
refused in one line before any rank starts."""

import pytest

from distributed_harness import run_ranks
from training_helpers import GPT_FLAGS, assert_close_rel, losses, tiny_args, train_rank

ITERS = 3
GQA = ["--group-query-attention", "--num-query-groups", "2"]


def _grad_norms(records):
    return [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def reference():
    """One process without context parallelism: Llama with grouped-query attention (clipping at 1.0 active)."""
    (llama,) = run_ranks(train_rank, 1, tiny_args(*GQA, train_iters=ITERS))
    return llama


@pytest.mark.parametrize("world, extra", [
    (2, []),
    (4, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--context-parallel-size", "4"]),
    (4, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
         "--num-layers-per-virtual-pipeline-stage", "2"]),
], ids=["cp2", "cp2-pp2-1f1b", "cp4", "cp2-dp2-distopt", "cp2-tp2-sp", "cp2-pp2-interleaved"])
def test_context_parallel_matches_one_process(reference, world, extra):
    cp = [] if "--context-parallel-size" in extra else ["--context-parallel-size", "2"]
    per_rank = run_ranks(train_rank, world, tiny_args(*GQA, *cp, *extra, train_iters=ITERS))
    assert max(_grad_norms(reference)) > 1.0
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel(_grad_norms(records), _grad_norms(reference), 1e-5, "grad norm")


def test_context_parallel_gpt_architecture_matches_one_process():
    """Megatron-LM's default architecture (learned absolute positions, LayerNorm, biases): each rank's
    positions are its tokens' own."""
    (expected,) = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS, architecture=GPT_FLAGS))
    records = run_ranks(train_rank, 2, tiny_args("--context-parallel-size", "2", train_iters=ITERS,
                                                 architecture=GPT_FLAGS))[-1]
    assert_close_rel(losses(records), losses(expected), 1e-5)
    assert_close_rel(_grad_norms(records), _grad_norms(expected), 1e-5, "grad norm")


def test_checkpoints_cross_context_parallel_sizes(tmp_path):
    """CP 2 saves; CP 1 (2 data-parallel ranks) resumes and saves; CP 2 x PP 2 resumes: the uninterrupted
    run's losses."""
    iters = 6
    (uninterrupted,) = run_ranks(train_rank, 1, tiny_args(train_iters=iters))
    cp2, cp1 = str(tmp_path / "cp2"), str(tmp_path / "cp1")
    first = run_ranks(train_rank, 2, tiny_args("--context-parallel-size", "2", "--save", cp2, "--exit-interval", "2",
                                               train_iters=iters))[-1]
    second = run_ranks(train_rank, 2, tiny_args("--load", cp2, "--save", cp1, "--exit-interval", "4",
                                                train_iters=iters))[-1]
    third = run_ranks(train_rank, 4, tiny_args("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                               "--load", cp1, train_iters=iters))[-1]
    assert [r["iteration"] for r in first + second + third] == list(range(1, iters + 1))
    assert_close_rel(losses(first + second + third), losses(uninterrupted), 1e-5)


@pytest.mark.parametrize("world, extra, message", [
    (4, ["--context-parallel-size", "2", "--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
         "--tawpipe-ownership", "spread"], "--tawpipe-ownership spread with --context-parallel-size 2"),
    (4, ["--context-parallel-size", "3"], "must divide the number of ranks 4"),
    (2, ["--context-parallel-size", "2", "--seq-length", "30", "--max-position-embeddings", "32"],
     "--seq-length 30 must be divisible by 4"),
    (2, ["--context-parallel-size", "2", "--attention-backend", "local"], "megatron-core's local attention"),
    (2, ["--context-parallel-size", "2", "--attention-dropout", "0.1"], "--attention-dropout 0"),
    (2, ["--context-parallel-size", "2", "--reset-attention-mask"], "--reset-attention-mask with"),
    (2, ["--context-parallel-size", "2", "--use-torch-fsdp2"], "drop --use-torch-fsdp2"),
])
def test_what_context_parallelism_cannot_run_is_refused_in_one_line(monkeypatch, world, extra, message):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(tiny_args(*extra)))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_long_context_launch_script_runs_on_cpu_ranks(tmp_path):
    """examples/pretrain_llama_long_context.sh as its header runs it on 2 CPU ranks (CP 2): it trains, writes its
    metrics and ends with status 0."""
    import json
    import os
    import subprocess

    from distributed_harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, BACKEND="gloo", GPUS_PER_NODE="2", CP="2", TP="1", NUM_LAYERS="2", HIDDEN="64", FFN="128",
               HEADS="4", KV_HEADS="2", SEQ="256", GLOBAL_BATCH="2", TRAIN_ITERS="2", WARMUP_ITERS="1", PRECISION="",
               VOCAB_SIZE="256", EVAL_ITERS="0", MAX_RESTARTS="0", OUT_DIR=str(tmp_path), MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", os.path.join(root, "examples", "pretrain_llama_long_context.sh")], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if line.strip()]
    iterations = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in iterations] == [1, 2]
    assert all(5.0 < r["lm_loss"] < 6.0 for r in iterations)   # ln(256) = 5.5 at the start
