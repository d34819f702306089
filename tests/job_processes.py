"""The processes of a job the tests start: torchrun, its ranks (each in a session of its own), their loader
workers and checkpoint writers, orphans included, found by a mark in the environment they all inherit."""

import os
import signal
import subprocess
import time

JOB_MARK = "TAWPIPE_TEST_JOB"   # set in the job's environment: every process it starts inherits it


def state(pid):
    """(state letter, parent pid) of process ``pid`` from /proc, or None once it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) "
    return fields[0], int(fields[1])


def alive(pid):
    """Whether ``pid`` runs (a zombie does not)."""
    found = state(pid)
    return found is not None and found[0] != "Z"


def environ(pid):
    """Process ``pid``'s environment entries (bytes ``NAME=value``), empty once it is gone."""
    try:
        return open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return []


def children(pid):
    """The live processes whose parent is ``pid``."""
    found = {int(e): state(e) for e in os.listdir("/proc") if e.isdigit()}
    return [p for p, st in found.items() if st is not None and st[0] != "Z" and st[1] == pid]


def job_pids(job):
    """The live (not zombie) processes of ``job``: torchrun, the ranks (each in a session of its own),
    their loader workers and checkpoint writers, orphans included."""
    mark = f"{JOB_MARK}={job}".encode()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != os.getpid() and mark in environ(e) and alive(e)]


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


def describe(pid):
    """``pid``, its state, parent and command line, for a message."""
    found = state(pid)
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        argv = "?"
    where = f"state {found[0]}, parent {found[1]}" if found else "gone"
    return f"{pid} ({where}): {argv[:300]}"


def ended(proc, timeout=120):
    """When the job's last process ended (None after ``timeout``; then the rest is killed, and listed: pid,
    state, parent and command line)."""
    ended = wait_for(lambda: proc.poll() is not None and not job_pids(proc.job), timeout)
    left = [describe(pid) for pid in job_pids(proc.job)]
    if left:   # do not leave them behind the test either
        signal_job(proc.job, signal.SIGKILL)
        proc.wait()
    return ended, left


