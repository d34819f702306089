"""The launch scripts: they relaunch a failed job from its latest checkpoint (examples/restarts.sh) and
pass the package's Llama flags (examples/llama_flags.sh)."""

import os
import signal
import subprocess
import time

from distributed_harness import free_port
from training_helpers import assert_close_rel, metrics_by_iteration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_llama_multinode.sh")


def _env(out_dir, restarts, ranks=4):
    env = dict(os.environ, NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GPUS_PER_NODE=str(ranks), BACKEND="gloo", SCHEDULE="tawpipe", NUM_LAYERS="4", HIDDEN="128", FFN="384",
               HEADS="4", SEQ="256", GLOBAL_BATCH="8", TRAIN_ITERS="8", WARMUP_ITERS="2", VOCAB_SIZE="512",
               OUT_DIR=str(out_dir), LOG_INTERVAL="1", EVAL_INTERVAL="1000", EVAL_ITERS="0", SAVE_INTERVAL="2",
               MAX_RESTARTS=str(restarts), RESTART_DELAY_S="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return env


def _worker_pid(local_rank):
    """The pid of the training process of ``local_rank`` (a torchrun worker)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"pretrain_llama.py") for arg in cmdline) and \
                f"LOCAL_RANK={local_rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return int(pid)
    return None


def test_a_killed_rank_costs_no_manual_step(tmp_path):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(["bash", SCRIPT], env=_env(reference_dir, 0), cwd=ROOT, check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(["bash", SCRIPT], env=_env(run_dir, 1), cwd=ROOT, stdout=log, stderr=log)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    checkpoint = run_dir / "checkpoints" / "iter_0000002"
    killed = None
    deadline = time.time() + 300
    while killed is None and time.time() < deadline and proc.poll() is None:
        done = metrics_by_iteration(metrics)
        if checkpoint.exists() and max(done, default=0) >= 3:
            pid = _worker_pid(2)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = max(done)
        time.sleep(0.02)
    assert killed is not None and killed < 8, "the run ended before a rank could be killed"
    assert proc.wait(timeout=600) == 0, open(tmp_path / "killed.log").read()[-3000:]
    text = open(tmp_path / "killed.log").read()
    assert "restart 1 of 1 from the latest checkpoint" in text
    ours, reference = metrics_by_iteration(metrics), metrics_by_iteration(os.path.join(reference_dir, "metrics.jsonl"))
    assert sorted(ours) == list(range(1, 9))
    assert_close_rel([ours[i]["lm_loss"] for i in range(1, 9)], [reference[i]["lm_loss"] for i in range(1, 9)],
                     1e-5)


def test_the_examples_llama_flags_are_the_packages():
    from megatron_tawpipe.arguments import LLAMA_FLAGS

    out = subprocess.run(["bash", "-c", 'source examples/llama_flags.sh; printf "%s\\n" "${LLAMA_FLAGS[@]}"'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert tuple(out.split()) == tuple(LLAMA_FLAGS)


def _run_script(out_dir, restarts, *extra, ranks=4):
    started = time.monotonic()
    proc = subprocess.run(["bash", SCRIPT, *extra], env=_env(out_dir, restarts, ranks), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    return proc, time.monotonic() - started


def test_a_refused_flag_runs_once_and_exits_2(tmp_path):
    """Every rank refuses the flag before training: torchrun says 1, the ranks' records say refused; the
    script prints the line once, restarts nothing, exits 2. Two ranks: each start of a rank costs seconds of
    imports, and two records show the line is printed once as well as four."""
    proc, _ = _run_script(tmp_path / "refused", 3, "--ckpt-format", "zarr", ranks=2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "restart 1 of" not in proc.stderr
    assert proc.stderr.count("--ckpt-format zarr: this project writes torch_dist") == 1, proc.stderr[-3000:]
    assert "run_with_restarts: not restarted (refused on 2 rank(s) of this node" in proc.stderr


def test_a_nan_loss_ends_without_a_restart(tmp_path):
    """A learning rate that diverges on the tiny model: the run stops on the non-finite gradient, which would
    recur from the same checkpoint, so the script exits 3 without restarting; RESTART_ANY_FAILURE=1 still
    retries it. On two ranks, as the refused flag above."""
    diverging = ("--lr", "1e30", "--min-lr", "0", "--clip-grad", "0")
    proc, _ = _run_script(tmp_path / "nan", 3, *diverging, ranks=2)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "restart 1 of" not in proc.stderr
    assert "not restarted (repeatable on 2 rank(s)" in proc.stderr and "NaN/Inf gradient" in proc.stderr
    env = dict(_env(tmp_path / "forced", 1, ranks=2), RESTART_ANY_FAILURE="1")
    forced = subprocess.run(["bash", SCRIPT, *diverging], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert forced.returncode == 3 and "restart 1 of 1" in forced.stderr, forced.stderr[-3000:]
