"""One benchmark run's launch: torchrun on this machine or on the emulated cluster, every rank's log kept,
a fresh rendezvous port per run, no process left behind, and a failure told with its failing rank's log.

* **Logs**: torchrun writes each rank's stdout and stderr to ``<run>-ranks/[node<k>/]<id>/attempt_0/<local
  rank>/`` (``--log-dir --redirects 3 --tee 3``, so the run's combined log ``<run>.log`` has them too);
  nothing is deleted after a failure.
* **Ports**: on the emulated cluster each run's rendezvous store listens on a port no earlier run of the
  process used (:class:`PortSequence`), so a run never meets the previous one's sockets in TIME_WAIT;
  locally torchrun ``--standalone`` picks a free port itself.
* **Leftovers**: a run that times out has its whole process group stopped (SIGTERM, then SIGKILL); on the
  cluster, whatever still runs in the node namespaces after a run is stopped before the next starts
  (the cluster's ``stop_leftovers``, ``tools/tawpipe_lab/emulated_cluster.py``), and said.
* **Retries**: a run is started again (once, on a fresh port, and said so) only when it failed before
  training began (no metrics written) with a rendezvous/connection error in its log
  (:data:`RETRY_PATTERNS`): nothing was measured, so nothing is lost or mixed.
* **Failure**: :func:`failure_report` names the strategy, torchrun's exit status, the failing rank and its
  exit code (torchrun's "Root Cause"), the folder of the logs, and the last :data:`TAIL_LINES` lines of
  that rank's log.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_tawpipe.bench.subprocesses import exit_code, terminate_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNTED_PRETRAIN = os.path.join(ROOT, "megatron_tawpipe", "bench", "counted_pretrain.py")
TAIL_LINES = 40
FIRST_PORT = 29600            # the emulated cluster's rendezvous ports: FIRST_PORT, FIRST_PORT + 1, ...
PORT_SPAN = 2000
RETRY_PATTERNS = ("Address already in use", "RendezvousConnectionError", "RendezvousTimeoutError",
                  "DistNetworkError", "Connection refused", "Connection reset by peer", "Broken pipe",
                  "Timed out waiting for clients", "failed to bind", "EADDRINUSE")
TERM_GRACE_S = 5.0


class PortSequence:
    """Rendezvous ports, a new one per run (wrapping after ``PORT_SPAN``)."""

    def __init__(self, first: int = FIRST_PORT):
        self._ports = (first + i % PORT_SPAN for i in itertools.count())

    def next(self) -> int:
        return next(self._ports)


@dataclass
class Launched:
    rc: int                           # torchrun's exit status (124: timed out)
    node_tx: Optional[int] = None     # bytes all nodes' eth0 sent (cluster only)
    leftovers: int = 0                # processes found running after the run (and stopped)


def torchrun_log_args(log_dir: str) -> List[str]:
    """torchrun options that keep each rank's stdout/stderr under ``log_dir`` and on the console."""
    return ["--log-dir", log_dir, "--redirects", "3", "--tee", "3"]


def launch_local(ranks: int, script_args: List[str], log_path: str, log_dir: str, env: Dict[str, str],
                 python: str, timeout: Optional[float]) -> Launched:
    """torchrun ``--standalone`` on this machine, in its own process group (stopped whole on timeout)."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += torchrun_log_args(log_dir) + list(script_args)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.write(f"\nbenchmark: timed out after {timeout:g} s; stopping the run\n")
            log.flush()
            terminate_all([proc], TERM_GRACE_S)
            return Launched(124)
        except BaseException:
            terminate_all([proc], TERM_GRACE_S)
            raise
        finally:
            terminate_all([proc], TERM_GRACE_S)
            left = stop_group(proc.pid, TERM_GRACE_S)   # ranks torchrun may have left behind it
            if left:
                log.write(f"\nbenchmark: stopped what the run left running (process group {proc.pid})\n")
    return Launched(exit_code(rc), leftovers=int(left))


def stop_group(pgid: int, grace: float) -> bool:
    """SIGTERM what is left of process group ``pgid``, SIGKILL it after ``grace`` seconds, and wait until it
    is gone; whether anything was left."""
    def alive() -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    if not alive():
        return False
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive():
                return True
            time.sleep(0.05)
    return True


def launch_on_cluster(cluster, ports: PortSequence, script_args: List[str], log_path: str, log_dir: str,
                      env: Dict[str, str], python: str, timeout: Optional[float]) -> Launched:
    """torchrun on every node of ``cluster`` with a fresh rendezvous port; node k's ranks log under
    ``log_dir/node<k>``; eth0 tx of every node measured around it; leftovers stopped afterwards."""
    before = _tx(cluster)
    port = ports.next()
    # run_torchrun streams the ranks' output to ours: send it to the run's log.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        print(f"benchmark: rendezvous on {cluster.master_addr}:{port}", flush=True)
        rc = cluster.run_torchrun(script_args, env=env, timeout=timeout, python=python, master_port=port,
                                  torchrun_args=lambda node: torchrun_log_args(os.path.join(log_dir, f"node{node}")))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for d in (fd, *saved):
            os.close(d)
    leftovers = cluster.stop_leftovers()
    after = _tx(cluster)
    return Launched(rc, sum(after[n] - before[n] for n in before), leftovers)


def _tx(cluster) -> Dict[int, int]:
    return {n: cluster.link_bytes(n)["eth0"]["tx_bytes"] for n in range(cluster.nodes)}


# ------------------------------------------------------------------------------------------ logs
def rank_logs(log_dir: str, ranks_per_node: int) -> Dict[int, str]:
    """Global rank -> its stderr log under ``log_dir`` (``node<k>/...`` on a cluster; the last attempt)."""
    found: Dict[int, str] = {}
    if not os.path.isdir(log_dir):
        return found
    for dirpath, _dirs, files in os.walk(log_dir):
        if "stderr.log" not in files:
            continue
        parts = os.path.relpath(dirpath, log_dir).split(os.sep)
        if not parts[-1].isdigit() or len(parts) < 3 or not parts[-2].startswith("attempt_"):
            continue
        node = int(parts[0][4:]) if parts[0].startswith("node") and parts[0][4:].isdigit() else 0
        rank = node * ranks_per_node + int(parts[-1])
        path = os.path.join(dirpath, "stderr.log")
        if rank not in found or path > found[rank]:      # attempt_1 after attempt_0
            found[rank] = path
    return found


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def failing_rank(combined_log: str, logs: Dict[int, str]) -> tuple:
    """(rank, its exit code or None) that failed first: torchrun's "Root Cause", else the first rank whose
    log has a traceback or an error line, else the lowest rank with a log."""
    text = _read(combined_log)
    m = _ROOT_CAUSE.search(text)
    if m:
        return int(m.group(1)), int(m.group(2))
    for rank in sorted(logs):
        body = _read(logs[rank])
        if "Traceback" in body or "error:" in body:
            return rank, None
    return (min(logs), None) if logs else (None, None)


def tail(path: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def retryable(combined_log: str, metrics_file: str) -> Optional[str]:
    """Why a failed run may be started again (it failed in the rendezvous, before any metrics), else None."""
    if os.path.exists(metrics_file) and os.path.getsize(metrics_file) > 0:
        return None
    text = _read(combined_log)
    for pattern in RETRY_PATTERNS:
        if pattern in text:
            return pattern
    return None


def failure_report(schedule: str, repetition: int, rc: int, combined_log: str, log_dir: str,
                   ranks_per_node: int) -> str:
    """What a failed run says: strategy, exit status, failing rank, where the logs are, its log's tail."""
    logs = rank_logs(log_dir, ranks_per_node)
    rank, code = failing_rank(combined_log, logs)
    what = "timed out" if rc == 124 else f"exit status {rc}"
    head = f"strategy {schedule} repetition {repetition} failed ({what}"
    if rank is not None:
        head += f"; rank {rank} failed first" + (f" with exit code {code}" if code is not None else "")
    head += f"); logs kept: {combined_log} and every rank's in {log_dir}"
    source = logs.get(rank) if rank is not None else None
    body = tail(source) if source and _read(source).strip() else tail(combined_log)
    where = source if source and _read(source).strip() else combined_log
    return f"{head}\nlast {TAIL_LINES} lines of {where}:\n{body}"

