"""pretrain_llama.py as users run it: torchrun, metrics file, and one-line errors for bad flags."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(nproc, argv, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_llama.py")] + argv
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _metrics(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


ITERS = 5


@pytest.fixture(scope="module")
def native_on_one(tmp_path_factory):
    """One rank, native 1F1B without a pipeline (the reference of both tests below): ``(process, metrics file)``."""
    tmp_path = tmp_path_factory.mktemp("native_on_one")
    path = tmp_path / "1f1b.jsonl"
    proc = _torchrun(1, tiny_args("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "1",
                                  "--metrics-file", str(path), "--log-interval", "1", train_iters=ITERS), tmp_path)
    return proc, path


def test_metrics_file_losses_agree_between_pp1_and_pp2(tmp_path, native_on_one):
    proc, one = native_on_one
    two = tmp_path / "pp2.jsonl"
    _torchrun(2, tiny_args("--pipeline-model-parallel-size", "2", "--metrics-file", str(two), train_iters=ITERS),
              tmp_path)
    first, second = _metrics(one), _metrics(two)
    assert [r["iteration"] for r in first] == list(range(1, ITERS + 1))
    for record in first:
        assert {"iteration", "lm_loss", "grad_norm", "tokens_per_sec_per_rank", "elapsed_ms"} <= set(record)
        assert record["tokens_per_sec_per_rank"] > 0 and record["elapsed_ms"] > 0
        # Building the model and its optimizer state grows the peak resident set, within the peak.
        assert 0 < record["memory_since_model_bytes_max_rank"] <= record["peak_memory_bytes_max_rank"]
    assert_close_rel([r["lm_loss"] for r in second], [r["lm_loss"] for r in first], 1e-5)
    log_lines = [line for line in proc.stdout.splitlines() if "iteration" in line and "lm loss:" in line]
    assert len(log_lines) == ITERS
    for key in ("consumed samples", "elapsed time per iteration (ms)", "tokens per second per rank",
                "throughput per rank (TFLOP/s)", "learning rate", "lm loss", "grad norm"):
        assert key in log_lines[0]


def test_tawpipe_on_4_ranks_matches_native_on_one(tmp_path, native_on_one):
    """The user-facing proof (docs/pretrain-llama-and-megatron-lm.md): same seed, mock data and global batch, 5 iterations."""
    taw = tmp_path / "tawpipe.jsonl"
    _, ref = native_on_one
    _torchrun(4, tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                           "--metrics-file", str(taw), train_iters=ITERS), tmp_path)
    assert len(_metrics(taw)) == ITERS
    assert_close_rel([r["lm_loss"] for r in _metrics(taw)], [r["lm_loss"] for r in _metrics(ref)], 1e-5)
    assert all(r["inter_group_bytes"] > 0 for r in _metrics(taw))
    compare = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare_metrics.py"), str(taw), str(ref)],
                             capture_output=True, text=True)
    assert compare.returncode == 0 and "agree" in compare.stdout, compare.stdout


def _main_rank(rank, argv):
    import pretrain_llama

    return pretrain_llama.main(argv)


def test_apply_layernorm_1p_trains_on_cpu_ranks(tmp_path):
    """--apply-layernorm-1p (zero-centred norm weights) without Transformer Engine or Apex: torch's norms take it,
    under tawpipe as in one process (docs/pretrain-llama-and-megatron-lm.md)."""
    runs = {}
    for name, world, schedule in (("tawpipe", 2, ["--pipeline-schedule", "tawpipe"]),
                                  ("reference", 1, ["--pipeline-model-parallel-size", "1"])):
        path = tmp_path / f"{name}.jsonl"
        argv = tiny_args("--apply-layernorm-1p", *schedule, "--metrics-file", str(path), train_iters=3)
        assert run_ranks(_main_rank, world, argv) == [0] * world
        runs[name] = [r["lm_loss"] for r in _metrics(path)]
    assert len(runs["tawpipe"]) == 3
    assert_close_rel(runs["tawpipe"], runs["reference"], 1e-5)


BAD_FLAGS = [
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 8 must be divisible by --pipeline-model-parallel-size 3"),
    (["--pipeline-schedule", "zigzag"], 1, "--pipeline-schedule 'zigzag' is unknown"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 must be divisible"),
    (["--seq-length", "64"], 1, "--seq-length 64 exceeds --max-position-embeddings 32"),
    (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size 2 must divide the number of ranks 3"),
    (["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2"], 2,
     "needs --num-layers-per-virtual-pipeline-stage"),
    (["--lr-warmup-iters", "3"], 1, "--lr-warmup-iters 3 must be smaller than --lr-decay-iters 3"),
    (["--pipeline-schedule", "tawpipe", "--num-layers", "2"], 3, "2 layers cannot be cut into 3 pieces of one layer"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3"], 4, "--tawpipe-num-groups 3 must divide"),
    (["--pipeline-schedule", "tawpipe", "--global-batch-size", "6"], 4, "--global-batch-size 6 must be divisible"),
    (["--pipeline-schedule", "weipipe", "--tawpipe-microbatches-per-visit", "2"], 4,
     "--tawpipe-microbatches-per-visit applies to --pipeline-schedule tawpipe only"),
    (["--tawpipe-microbatches-per-visit", "2"], 1, "need --pipeline-schedule tawpipe or weipipe"),
    (["--pipeline-schedule", "tawpipe", "--weipipe-zero-bubble", "1"], 4,
     "--weipipe-zero-bubble applies to --pipeline-schedule weipipe only"),
    (["--weipipe-zero-bubble", "2"], 1, "--weipipe-zero-bubble / --timeline-file / --record-plan-memory need"),
    (["--record-plan-memory"], 1, "--record-plan-memory need --pipeline-schedule tawpipe or"),
    (["--pipeline-schedule", "weipipe", "--record-plan-memory", "--emulated-compute-times", "TIMES"], 4,
     "--record-plan-memory measures what real compute holds"),
    (["--pipeline-schedule", "weipipe", "--tawpipe-replicate-first-shard"], 4,
     "--tawpipe-replicate-first-shard applies to --pipeline-schedule tawpipe"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "1", "--tawpipe-replicate-first-shard"], 4,
     "--tawpipe-replicate-first-shard needs two or more groups"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-ownership", "spread"], 4,
     "--tawpipe-ownership spread needs two or more groups"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-ownership", "spread", "--tawpipe-num-groups", "2",
      "--tawpipe-replicate-first-shard"], 4, "--tawpipe-ownership spread with --tawpipe-replicate-first-shard"),
    (["--pipeline-schedule", "weipipe", "--tawpipe-ownership", "spread"], 4,
     "--tawpipe-ownership spread applies to --pipeline-schedule tawpipe only"),
    (["--pipeline-schedule", "weipipe", "--tawpipe-shards-per-rank", "2"], 4,
     "--tawpipe-shards-per-rank 2 applies to --pipeline-schedule tawpipe"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-shards-per-rank", "3"], 4,
     "with --tawpipe-shards-per-rank 3: 8 layers cannot be cut into 12 pieces of one layer or more"),
    # Megatron-LM's flags that are not implemented: one line each, never "unrecognized arguments".
    (["--use-megatron-fsdp"], 1, "--use-megatron-fsdp needs --use-distributed-optimizer"),
    (["--fsdp-double-buffer"], 1, "--fsdp-double-buffer: Megatron-FSDP's fp8 / double-buffer options are not supported"),
    (["--moe-router-topk", "4"], 1, "--moe-router-topk 4: mixture-of-experts models are not supported"),
    (["--sample-rate", "0.5"], 1, "--sample-rate 0.5: sub-sampling the training data is not supported"),
    (["--position-embedding-type", "yarn"], 1, "--position-embedding-type yarn is not supported yet"),
    (["--train-samples", "64"], 1, "give exactly one of --train-iters and --train-samples"),
    (["--tokenizer-type", "BertWordPieceCase"], 1, "--tokenizer-type BertWordPieceCase is not supported yet"),
    (["--tokenizer-type", "GPT2BPETokenizer"], 1, "--vocab-file is required with --tokenizer-type GPT2BPETokenizer"),
    (["--context-parallel-size", "2", "--attention-backend", "local"], 2,
     "--context-parallel-size 2 with megatron-core's local attention: it has no context parallelism"),
    (["--transformer-impl", "transformer_engine"], 1, "needs Transformer Engine and a CUDA GPU"),
    (["--squared-relu"], 1, "--swiglu and --squared-relu are mutually exclusive"),
    (["--optimizer", "sgd"], 1, "--optimizer sgd is not supported"),
    (["--lr-warmup-fraction", "0.1"], 1, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"),
]


@pytest.mark.parametrize("extra,world,message", BAD_FLAGS, ids=[m.split()[0] + str(i) for i, (_, _, m) in enumerate(BAD_FLAGS)])
def test_bad_flags_give_one_line_before_any_process_group(extra, world, message, capsys, monkeypatch):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = tiny_args() + extra
    assert pretrain_llama.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert message in err[0]
    assert not dist.is_initialized()


def test_missing_data_files_are_named(tmp_path, capsys, monkeypatch):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [a for a in tiny_args() if a != "--mock-data"] + ["--data-path", str(tmp_path / "nothere")]
    assert pretrain_llama.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothere" in err[0] and "--data-path" in err[0], err
    assert not dist.is_initialized()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_without_a_gpu_is_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_llama.py"), "--distributed-backend", "nccl"]
                          + tiny_args(train_iters=3), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "--distributed-backend nccl needs CUDA GPUs" in lines[-1] and "Traceback" not in proc.stderr
