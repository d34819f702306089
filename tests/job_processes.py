"""The processes of a job the tests start: torchrun, its ranks (each in a session of its own), their loader
workers and checkpoint writers, orphans included, found by a mark in the environment they all inherit."""

import os
import signal
import subprocess
import time

JOB_MARK = "TAWPIPE_TEST_JOB"   # set in the job's environment: every process it starts inherits it


def job_pids(job):
    """The live (not zombie) processes of ``job``: torchrun, the ranks (each in a session of its own),
    their loader workers and checkpoint writers, orphans included."""
    mark = f"{JOB_MARK}={job}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        if mark in environ and stat[stat.rindex(")") + 2] != "Z":
            pids.append(int(entry))
    return pids


def signal_job(job, signum):
    """``signum`` to every process of ``job``, as Slurm signals every process of a job step."""
    for pid in job_pids(job):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def start(cmd, log_path, env, cwd):
    job = f"{os.getpid()}-{time.monotonic_ns()}"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=dict(env, **{JOB_MARK: job}), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    proc.job = job
    return proc


def wait_for(predicate, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if proc is not None and proc.poll() is not None and not predicate():
            return None
        time.sleep(0.05)
    return None


def ended(proc, timeout=120):
    """When the job's last process ended (None after ``timeout``; then the rest is killed, and listed)."""
    ended = wait_for(lambda: proc.poll() is not None and not job_pids(proc.job), timeout)
    left = job_pids(proc.job)
    if left:   # do not leave them behind the test either
        signal_job(proc.job, signal.SIGKILL)
        proc.wait()
    return ended, left


