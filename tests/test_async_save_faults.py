"""Background saves under faults: ``--async-save`` with ``--save-retain-interval``, a save every iteration, ranks
SIGKILLed at random during training and during a background save under the multi-node launch script (which
restarts from the latest checkpoint); a killed rank's writer ends with it. Nothing is lost: the tracker never
names a half-written, ``.tmp`` or ``.deleting`` folder, retention never deletes the newest complete
checkpoint, and the losses equal an uninterrupted run's."""

import argparse
import glob
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time

from distributed_harness import free_port
from job_processes import alive, ended, environ, job_pids, start, state
from megatron_tawpipe.checkpoint import async_save
from training_helpers import metrics_by_iteration, pinned_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_llama_multinode.sh")
ITERS, RETAIN = 10, 4
# the layout pinned: the faulted run and the reference are launched separately and compared bit for bit
FLAGS = ["--tawpipe-num-groups", "2", *pinned_layout(2), "--async-save", "--save-retain-interval", str(RETAIN),
         "--ckpt-format", "torch_dist"]


def _env(out_dir, restarts):
    env = dict(os.environ, NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GPUS_PER_NODE="2", BACKEND="gloo", SCHEDULE="tawpipe", NUM_LAYERS="4", HIDDEN="64", FFN="128",
               HEADS="4", SEQ="64", GLOBAL_BATCH="4", TRAIN_ITERS=str(ITERS), WARMUP_ITERS="2", VOCAB_SIZE="256",
               OUT_DIR=str(out_dir), LOG_INTERVAL="1", EVAL_INTERVAL="1000", EVAL_ITERS="0", SAVE_INTERVAL="1",
               MAX_RESTARTS=str(restarts), RESTART_DELAY_S="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def _is_torchrun(pid):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith(b"torchrun") or arg == b"torch.distributed.run" for arg in argv[:3])


def _rank_pids(job):
    """pid -> LOCAL_RANK of the ranks of ``job``: torchrun's children, not their writers or loader workers
    (forked, they carry the rank's environment; a killed rank's would be re-parented)."""
    ranks = {}
    for pid in job_pids(job):
        local = [v for v in environ(pid) if v.startswith(b"LOCAL_RANK=")]
        found = state(pid)
        if local and found is not None and _is_torchrun(found[1]):
            ranks[pid] = int(local[0].split(b"=")[1])
    return ranks


def _saving_since(checkpoints, since):
    """Whether a background save is in flight: an ``iter_*.tmp`` folder written to after ``since`` (a killed
    attempt's unfinished one stays until the next save of that iteration clears it)."""
    for folder in glob.glob(os.path.join(checkpoints, "iter_*.tmp")):
        try:
            if os.stat(folder).st_mtime > since:
                return True
        except OSError:
            pass
    return False


def _check_tracker(checkpoints, problems):
    """The tracker names a complete checkpoint: its folder in place (not .tmp or .deleting) with its metadata."""
    tracker = os.path.join(checkpoints, "latest_checkpointed_iteration.txt")
    try:
        named = open(tracker).read().strip()
    except OSError:
        return None
    if not named:
        return None
    folder = os.path.join(checkpoints, f"iter_{int(named):07d}")
    # Read the folder after the tracker: a newer checkpoint may replace both in between, never the reverse.
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        again = open(tracker).read().strip()
        if again == named:
            problems.append(f"the tracker names iteration {named}, whose folder is missing or incomplete: "
                            f"{sorted(os.listdir(checkpoints))}")
    return int(named)


def test_kills_during_training_and_background_saves_lose_nothing(tmp_path):
    seed = random.SystemRandom().randrange(1 << 30)
    draw = random.Random(seed)
    reference = tmp_path / "reference"
    subprocess.run(["bash", SCRIPT, *FLAGS], env=_env(reference, 0), cwd=ROOT, check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = metrics_by_iteration(reference / "metrics.jsonl")
    assert sorted(expected) == list(range(1, ITERS + 1))

    run = tmp_path / "faulted"
    checkpoints = str(run / "checkpoints")
    proc = start(["bash", SCRIPT, *FLAGS], tmp_path / "faulted.log", _env(run, 4), ROOT)
    # Two kills, each of a random rank, in an attempt of its own: one as soon as a random early iteration is
    # logged (a background save may be in flight: with a save every iteration one nearly always is), one
    # while a save of the restarted attempt is being written (its iter_*.tmp folder made after the restart)
    # at a random later iteration. The second waits for the restart the first caused (its line in the log,
    # ranks none of which was seen before): without that wait, the surviving rank of the first attempt can
    # log one more iteration and start its save before it notices its peer is gone, and both kills land in
    # one attempt. (A kill with no background save at all: tests/test_launch_restarts.py.)
    plan = [("training", draw.randint(2, 4)), ("saving", draw.randint(5, 7))]
    kills, problems, seen, attempt_start = [], [], set(), 0.0
    deadline = time.monotonic() + 900
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            latest = _check_tracker(checkpoints, problems)
            restarted = open(tmp_path / "faulted.log").read().count("from the latest checkpoint")
            if plan and latest is not None and restarted == len(kills):
                if not attempt_start:   # the killed attempt's processes (writers too) have ended by now
                    attempt_start = time.time()
                moment, after = plan[0]
                done = max(metrics_by_iteration(run / "metrics.jsonl"), default=0)
                if done >= after and (moment == "training" or _saving_since(checkpoints, attempt_start)):
                    ranks = _rank_pids(proc.job)
                    if len(ranks) == 2 and not seen & set(ranks):
                        pid = draw.choice(sorted(ranks))
                        os.kill(pid, signal.SIGKILL)
                        attempt_start = 0.0
                        seen |= set(ranks)
                        kills.append((moment, done, ranks[pid], latest))
                        plan.pop(0)
            time.sleep(0.01)
    finally:
        _, left = ended(proc, 0 if proc.poll() is None else 30)
    text = open(tmp_path / "faulted.log").read()
    assert not left, f"processes left behind: {left}"
    assert proc.wait() == 0, f"seed {seed}, kills {kills}\n" + text[-3000:]
    assert not problems, f"seed {seed}: {problems[:3]}"
    assert [k[0] for k in kills] == ["training", "saving"], f"seed {seed}: kills {kills}"
    assert text.count("from the latest checkpoint") == 2, f"seed {seed}, kills {kills}\n" + text[-3000:]

    ours = metrics_by_iteration(run / "metrics.jsonl")
    assert sorted(ours) == list(range(1, ITERS + 1))
    assert [ours[i]["lm_loss"] for i in ours] == [expected[i]["lm_loss"] for i in ours], f"seed {seed}, kills {kills}"
    # What retention keeps: the multiples of --save-retain-interval and the latest; nothing half-written remains
    # where a checkpoint is looked for.
    kept = sorted(name for name in os.listdir(checkpoints) if name.startswith("iter_"))
    complete = [name for name in kept if name[5:].isdigit()]
    assert complete == [f"iter_{i:07d}" for i in range(1, ITERS + 1) if i % RETAIN == 0 or i == ITERS], kept
    assert open(os.path.join(checkpoints, "latest_checkpointed_iteration.txt")).read().strip() == str(ITERS)


def _write_pid_and_wait(pid_file):
    with open(pid_file + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".part", pid_file)
    time.sleep(120)


def _write_until_killed(pid_file):
    """A writer that forks a write process of its own, as megatron-core's writer does per bucket."""
    worker = multiprocessing.get_context("fork").Process(target=_write_pid_and_wait, args=(pid_file + ".worker",))
    worker.start()
    _write_pid_and_wait(pid_file)


def _rank_with_a_writer(pid_file):
    """A rank's main thread forks its background writer as megatron-core's temporal worker does."""
    args = argparse.Namespace(async_ckpt_cpu_priority=None, async_ckpt_io_priority=None,
                              use_persistent_ckpt_worker=False)
    writer = multiprocessing.get_context("fork").Process(
        target=async_save.writer_body(_write_until_killed, args, report=False), args=(pid_file,))
    writer.start()
    writer.join()


def test_a_writer_and_its_write_processes_end_with_their_killed_rank(tmp_path):
    pid_file = str(tmp_path / "writer.pid")
    rank = multiprocessing.get_context("fork").Process(target=_rank_with_a_writer, args=(pid_file,))
    rank.start()
    deadline = time.monotonic() + 60
    while not (os.path.exists(pid_file) and os.path.exists(pid_file + ".worker")) and time.monotonic() < deadline:
        time.sleep(0.01)
    pids = [int(open(pid_file).read()), int(open(pid_file + ".worker").read())]
    assert all(alive(pid) for pid in pids)
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"outlived their rank by 10 s: {left} of writer, write process {pids}"


def test_only_a_writer_forked_by_the_main_thread_is_tied_to_the_rank():
    """The kernel ends a child with the thread that forked it: a writer forked by another thread is not tied
    (it would end with that thread), nor megatron-core's persistent worker (it lives for the run)."""
    forked = argparse.Namespace(async_ckpt_cpu_priority=None, async_ckpt_io_priority=None,
                                use_persistent_ckpt_worker=False)
    persistent = argparse.Namespace(**dict(vars(forked), use_persistent_ckpt_worker=True))
    bodies = [async_save.writer_body(print, forked, report=False), async_save.writer_body(print, persistent, False)]
    thread = threading.Thread(target=lambda: bodies.append(async_save.writer_body(print, forked, report=False)))
    thread.start()
    thread.join()
    assert [body.args[0] for body in bodies] == [os.getpid(), None, None]
