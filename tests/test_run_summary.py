"""The closing summary of a job (megatron_tawpipe/training/summary.py) and megatron-core's per-rank warnings
shown once: a 2-rank torchrun job, its summary checked against its metrics and checkpoints, then the resume
command the summary prints, run as printed."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

from training_helpers import tiny_args

from megatron_tawpipe.arguments.defaults import complete_args
from megatron_tawpipe.training.summary import closing_summary, launch_command, resume_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_SCOPE = "full scope is deprecated"


def _args(**over):
    base = dict(save="ckpt", train_iters=10, metrics_file="m.jsonl", pipeline_schedule="tawpipe")
    base.update(over)
    return complete_args(argparse.Namespace(**base))


def test_the_launch_command_comes_from_torchrun_or_from_the_launch_script():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "4"}
    argv = [os.path.join(os.getcwd(), "pretrain_llama.py"), "--load", "old", "--lr", "3e-4", "--train-iters=5"]
    command = launch_command(torchrun, argv)
    assert command.endswith(" -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_llama.py --lr 3e-4")
    nodes = launch_command(dict(torchrun, GROUP_WORLD_SIZE="2", MASTER_ADDR="n0", MASTER_PORT="29400"), argv)
    assert "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint n0:29400 pretrain_llama.py" in nodes
    script = {"TAWPIPE_LAUNCH_COMMAND": "TRAIN_ITERS=12 OUT_DIR=a\\ b bash examples/quickstart_cpu.sh --load x "
                                        "--use-checkpoint-opt_param-scheduler --lr 3"}
    assert launch_command(script, ["pytest"]) == "TRAIN_ITERS=12 OUT_DIR='a b' bash examples/quickstart_cpu.sh --lr 3"
    assert launch_command({}, ["pytest"]) is None   # trained in-process: the command is not known


def test_the_resume_command_continues_a_finished_run_and_restarts_a_stopped_one():
    script = {"TAWPIPE_LAUNCH_COMMAND": "bash examples/quickstart_cpu.sh"}
    assert resume_command(_args(), True, script) == ("bash examples/quickstart_cpu.sh --load ckpt --train-iters 20 "
                                                     "--use-checkpoint-opt_param-scheduler")
    assert resume_command(_args(), False, script) == "bash examples/quickstart_cpu.sh --load ckpt"
    assert resume_command(_args(save=None), True, script) is None
    assert resume_command(_args(), False, {}, ["pytest"]) == "this job's command with --load ckpt"


def test_the_summary_without_checkpoints_or_iterations_says_so():
    text = closing_summary(_args(save=None, metrics_file=None), [], 10, None, 0.0, {}, ["pytest"])
    assert "no iteration ran: the job started at iteration 10 of 10" in text
    assert "checkpoints  none (--save DIR" in text and "metrics      none written" in text
    assert not re.search(r"^ resume ", text, re.M) and "--pipeline-schedule 1f1b" in text   # native suggested after tawpipe


def _full_scope_warns() -> bool:
    """Whether this megatron-core's TransformerConfig warns about its default CUDA-graph scope."""
    import megatron.core.transformer.transformer_config as config

    return FULL_SCOPE in open(config.__file__, encoding="utf-8").read()


def test_a_job_ends_on_one_summary_and_shows_each_per_rank_warning_once(tmp_path):
    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TAWPIPE_LAUNCH_COMMAND", None)
    env.pop("TAWPIPE_NEXT_STEPS", None)
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--metrics-file", str(metrics), "--save", str(save),
                     "--save-interval", "2", "--eval-interval", "3", "--eval-iters", "1", train_iters=3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "pretrain_llama.py")] + argv
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Every rank builds a TransformerConfig; only the first rank shows its warning, once.
    assert proc.stderr.count(FULL_SCOPE) == (1 if _full_scope_warns() else 0), proc.stderr
    assert proc.stderr.count("UserWarning: Apex is not installed. Falling back to Torch Norm") <= 1
    assert proc.stdout.count("summary of this run") == 1
    summary = proc.stdout[proc.stdout.index("summary of this run"):]
    assert proc.stdout.rstrip().endswith(summary.rstrip())   # the last thing the job prints
    last = [json.loads(line) for line in open(metrics)][-1]
    assert f"lm loss {last['lm_loss']:.6E} at iteration 3" in summary
    assert f"validation lm loss {last['validation_lm_loss']:.6E} at iteration 3" in summary
    assert "iterations 1-3 of 3" in summary and "--pipeline-schedule tawpipe, 2 ranks" in summary
    assert f"metrics      {metrics}" in summary and f"checkpoints  {save} (latest: iteration 3)" in summary
    resume = re.search(r"^ resume +(.*)$", summary, re.M)[1]
    assert resume.endswith(f"--load {save} --train-iters 6 --use-checkpoint-opt_param-scheduler")
    assert "native megatron-core on the same model and data: --pipeline-schedule 1f1b" in summary

    # The resume command, run as printed, goes on from the checkpoint to iteration 6.
    again = subprocess.run(["bash", "-c", resume], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"loaded checkpoint from {save} at iteration 3" in again.stdout
    assert [json.loads(line)["iteration"] for line in open(metrics)] == [1, 2, 3, 4, 5, 6]
    assert "iterations 4-6 of 6" in again.stdout
    assert shlex.split(resume)[0] in (sys.executable, os.path.basename(sys.executable))
