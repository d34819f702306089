"""A job always ends: after the run summary, after an error, on SIGTERM with and without
``--exit-signal-handler``, every process of the job (torchrun, the ranks, their data-loader workers) is gone
within seconds; a signalled stop saves, exits with the documented status and resumes exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest

from distributed_harness import free_port
import job_processes as jobs
from training_helpers import metrics_by_iteration, pinned_layout, tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_llama_multinode.sh")
SUMMARY = "summary of this run"
GRACE_S = 30.0   # the bound: every process gone within 30 s of the summary (or of the error line)


def _gone_after(proc, marker_seen, timeout=600):
    """Seconds from ``marker_seen()`` first being true to the last process of the job ending."""
    seen = jobs.wait_for(marker_seen, timeout)
    if seen is None:
        jobs.ended(proc, 0)
        raise AssertionError("the marker never appeared")
    ended, left = jobs.ended(proc)
    assert ended is not None, f"processes still alive 120 s after the marker: {left}"
    return ended - seen


def _torchrun(nproc, argv):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            os.path.join(ROOT, "pretrain_llama.py")] + argv


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


def _contains(path, text):
    return lambda: os.path.exists(path) and text in open(path, errors="replace").read()


# Megatron-LM launch lines of 2026 use these; with workers that leave --exit-signal to their rank, a loader
# nobody closed kept the ranks waiting in their exit handlers for good.
HANGING_FLAGS = ["--num-workers", "2", "--exit-signal-handler", "--manual-gc", "--eval-iters", "0"]
SCHEDULES = {"tawpipe": ["--pipeline-schedule", "tawpipe"], "weipipe": ["--pipeline-schedule", "weipipe"],
             "1f1b": ["--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "2"]}


@pytest.mark.parametrize("evaluation", [False, True], ids=["no-eval", "eval"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_process_ends_after_the_summary(tmp_path, schedule, evaluation):
    flags = list(HANGING_FLAGS)
    if evaluation:   # validation every iteration and after the last, each with its own loader
        flags[flags.index("--eval-iters") + 1] = "1"
        flags += ["--eval-interval", "1"]
    log = tmp_path / "run.log"
    proc = jobs.start(_torchrun(2, tiny_args(*SCHEDULES[schedule], *flags, train_iters=2)), log, _env(), tmp_path)
    seconds = _gone_after(proc, _contains(log, SUMMARY))
    text = open(log).read()
    assert proc.returncode == 0, text[-3000:]
    assert ("validation loss at iteration 2" in text) == evaluation, text[-3000:]
    assert seconds < GRACE_S, f"the job lived {seconds:.1f} s after its summary"


def test_every_process_ends_after_an_error_mid_training(tmp_path):
    """A learning rate that diverges: the NaN/Inf stop is raised inside training, with loader workers alive."""
    log = tmp_path / "run.log"
    argv = tiny_args("--pipeline-schedule", "tawpipe", *HANGING_FLAGS, "--lr", "1e30", "--min-lr", "0",
                     "--clip-grad", "0", train_iters=6)
    proc = jobs.start(_torchrun(2, argv), log, _env(), tmp_path)
    seconds = _gone_after(proc, _contains(log, "pretrain_llama.py: error:"))
    text = open(log).read()
    assert "NaN/Inf" in text and proc.returncode != 0, text[-3000:]
    assert seconds < GRACE_S, f"the job lived {seconds:.1f} s after the error"


def _script_env(out_dir):
    return _env(NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GPUS_PER_NODE="2",
                BACKEND="gloo", SCHEDULE="tawpipe", NUM_LAYERS="4", HIDDEN="64", FFN="128", HEADS="4", SEQ="64",
                GLOBAL_BATCH="4", TRAIN_ITERS="8", WARMUP_ITERS="2", VOCAB_SIZE="256", OUT_DIR=str(out_dir),
                LOG_INTERVAL="1", EVAL_INTERVAL="1000", EVAL_ITERS="0", SAVE_INTERVAL="1000", MAX_RESTARTS="3",
                RESTART_DELAY_S="1")


def _signal_job_at(tmp_path, name, iteration, *flags):
    """The multi-node launch script (restarts on) on 2 local ranks; SIGTERM to every process of the job once
    ``iteration`` is in its metrics, as Slurm sends it. Returns (process, seconds to the last exit, log text)."""
    out = tmp_path / name
    log = tmp_path / f"{name}.log"
    proc = jobs.start(["bash", SCRIPT, "--num-workers", "2", *flags], log, _script_env(out), ROOT)
    metrics = out / "metrics.jsonl"
    if not jobs.wait_for(lambda: max(metrics_by_iteration(metrics), default=0) >= iteration, 600, proc):
        jobs.ended(proc, 0)
        raise AssertionError(open(log).read()[-3000:])
    workers = len(jobs.job_pids(proc.job))
    assert workers >= 8, workers   # bash, torchrun, 2 ranks, 2 loader workers each
    signalled = time.monotonic()
    jobs.signal_job(proc.job, signal.SIGTERM)
    ended, left = jobs.ended(proc)
    assert ended is not None, f"processes still alive 120 s after SIGTERM: {left}"
    return proc, ended - signalled, open(log).read()


def test_sigterm_with_the_handler_saves_stops_and_resumes_exactly(tmp_path):
    reference = tmp_path / "reference"
    # one layout for the three launches (left to the run, each would decide on its own measurements)
    layout = pinned_layout(1)
    subprocess.run(["bash", SCRIPT, "--num-workers", "2", *layout], env=_script_env(reference), cwd=ROOT, check=True,
                   timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = metrics_by_iteration(reference / "metrics.jsonl")
    assert sorted(expected) == list(range(1, 9))

    proc, seconds, text = _signal_job_at(tmp_path, "stopped", 2, "--exit-signal-handler", *layout)
    assert proc.returncode == 0, text[-3000:]          # stopped on request: the documented status
    assert "run_with_restarts: stopped on request, not restarted" in text, text[-3000:]
    assert "restart 1 of" not in text
    assert seconds < GRACE_S, f"the job lived {seconds:.1f} s after SIGTERM"
    tracker = tmp_path / "stopped" / "checkpoints" / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text().strip())
    done = metrics_by_iteration(tmp_path / "stopped" / "metrics.jsonl")
    assert 2 <= saved < 8 and max(done) == saved, (saved, sorted(done))
    assert f"exiting after iteration {saved}: received SIGTERM" in text

    # The same command again resumes from that checkpoint and ends where the uninterrupted run ended.
    subprocess.run(["bash", SCRIPT, "--num-workers", "2", "--exit-signal-handler", *layout],
                   env=_script_env(tmp_path / "stopped"), cwd=ROOT, check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resumed = metrics_by_iteration(tmp_path / "stopped" / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[i]["lm_loss"] for i in range(1, 9)] == [expected[i]["lm_loss"] for i in range(1, 9)]


def test_sigterm_without_the_handler_ends_the_job_at_once(tmp_path):
    proc, seconds, text = _signal_job_at(tmp_path, "killed", 2)
    assert proc.returncode == 143, text[-3000:]          # 128 + SIGTERM, and no restart
    assert "SIGTERM received, not restarted" in text and "restart 1 of" not in text, text[-3000:]
    assert seconds < 15.0, f"the job lived {seconds:.1f} s after SIGTERM"


class _Numbers:
    """A map-style dataset of small tensors (what the loader's workers fetch)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        import torch

        return {"tokens": torch.tensor([index])}


def test_closing_a_data_iterator_ends_its_workers_at_once():
    """Workers that ignore SIGTERM (they leave --exit-signal to their rank) end on close(), not on collection."""
    import multiprocessing

    from megatron_tawpipe.data import build_data_iterator, close_all_data_iterators

    iterator = build_data_iterator(_Numbers(), 2, 0, 1, 0, num_workers=2, ignore_signal=signal.SIGTERM,
                                   pin_memory=False)
    assert int(next(iterator)["tokens"][0]) == 0
    workers = [p for p in multiprocessing.active_children() if p.is_alive()]
    assert len(workers) == 2
    keep = iterator   # a second reference: closing must not depend on the garbage collector
    started = time.monotonic()
    keep.close()
    assert not any(p.is_alive() for p in workers) and time.monotonic() - started < 10.0
    assert iterator.closed and next(iterator, None) is None
    assert close_all_data_iterators() == 0   # nothing left open


def test_a_workers_rank_killed_leaves_no_orphan():
    """A rank SIGKILLed with its loader open: its workers (which ignore SIGTERM) end on their own."""
    code = ("import os, signal, sys, time; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
            "from test_job_ends import _Numbers\n"
            "from megatron_tawpipe.data import build_data_iterator\n"
            "it = build_data_iterator(_Numbers(), 2, 0, 1, 0, num_workers=2, ignore_signal=signal.SIGTERM, "
            "pin_memory=False)\n"
            "next(it); print('ready', flush=True); time.sleep(600)\n") % (ROOT, os.path.join(ROOT, "tests"))
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert rank.stdout.readline().strip() == "ready"
        workers = jobs.children(rank.pid)
        assert len(workers) >= 2, workers
    finally:
        rank.kill()
        rank.wait()
    gone = jobs.wait_for(lambda: not any(jobs.alive(pid) for pid in workers), 30)
    assert gone is not None, f"workers {workers} outlived their killed rank by 30 s"


def _cli_rank(rank, argv, exit_dir):
    from megatron_tawpipe.cli.pretrain import run_training

    os.environ["TAWPIPE_EXIT_DIR"] = exit_dir
    return run_training(argv)


@pytest.mark.parametrize("flag,value,reason", [("--exit-interval", "2", "--exit-interval 2"),
                                               ("--exit-duration-in-mins", "1e-9", "--exit-duration-in-mins")])
def test_an_exit_flag_saves_stops_with_status_0_and_is_recorded(tmp_path, flag, value, reason):
    from distributed_harness import run_ranks

    save, records = tmp_path / "ckpt", tmp_path / "exits"
    (status,) = run_ranks(_cli_rank, 1, tiny_args("--save", str(save), flag, value, train_iters=6), str(records))
    assert status == 0
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert stopped < 6
    (record,) = os.listdir(records)
    assert record == "rank0.stopped"
    line = (records / record).read_text()
    assert line.startswith(f"stopped after iteration {stopped}: ") and reason in line, line
