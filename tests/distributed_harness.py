"""Run a function on several ranks of a gloo process group, forked from the test process.

Forking from a parent that has already imported torch and megatron-core costs
a fraction of a second per rank, against several seconds for torchrun.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, List


# Ports for the ranks' rendezvous are drawn below Linux's ephemeral range (32768-60999 by default), where the
# kernel's own choices for other connections cannot take one between this check and the store's bind.
_PORTS = range(20000, 32000)


def _ports() -> range:
    """The ports this process draws from: all of ``_PORTS``, or with ``TAWPIPE_TEST_PORT_SLOT=I/N`` (CI runs
    N pytest processes at once, each in slot I) the I-th of N disjoint shares."""
    slot = os.environ.get("TAWPIPE_TEST_PORT_SLOT")
    if not slot:
        return _PORTS
    index, count = (int(part) for part in slot.split("/"))
    width = len(_PORTS) // count
    return range(_PORTS.start + index * width, _PORTS.start + (index + 1) * width)


def free_port() -> int:
    """A port nothing listens on now, at random below the ephemeral range (the kernel's pick otherwise)."""
    import random

    ports = _ports()
    draw = random.SystemRandom()   # not the random module's state, which runs seed the same way
    for _ in range(50):
        port = draw.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_taken(errors: List[str]) -> bool:
    """The run failed only because another process took the rendezvous port before rank 0's store bound it."""
    return bool(errors) and "EADDRINUSE" in errors[0]


def _child(fn: Callable, rank: int, world_size: int, port: int, queue, args, kwargs, stderr_path=None) -> None:
    if stderr_path:  # what a rank prints before exiting on its own (e.g. the hang watchdog)
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, *args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including SystemExit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Flush the queue's feeder thread, then skip interpreter teardown: inherited atexit handlers and process groups
        # of the parent must not run in the child.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300.0, **kwargs) -> List[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` forked ranks; return results by rank. A run whose
    rendezvous port was taken by another process before rank 0 bound it (nothing ran yet) is started again
    on another port, up to twice. A run in which a forked rank's interpreter crashed (SIGSEGV or SIGBUS, before
    it reported; CI's second torch build does so now and then in ranks forked by a long pytest process) is
    started again once, from the beginning, and says so on stderr; a second crash fails the test."""
    crashes_left = 1
    for attempt in range(4):
        errors, results = _run_ranks_once(fn, world_size, args, kwargs, timeout)
        if _port_taken(errors) and attempt < 2:
            continue
        if _crashed(errors) and crashes_left:
            crashes_left -= 1
            print(f"distributed_harness: {errors[0]}; the run is started again once", file=sys.stderr)
            continue
        break
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(world_size)]


_CRASH_SIGNALS = {signal.SIGSEGV: "SIGSEGV", signal.SIGBUS: "SIGBUS"}


def _crashed(errors: List[str]) -> bool:
    """A forked rank's interpreter died by a crash signal before reporting (see _signal_deaths)."""
    return bool(errors) and errors[0].startswith("rank ") and " crashed by " in errors[0]


def _signal_deaths(procs, reported) -> List[str]:
    """The ranks that ended by a crash signal without reporting, first in the errors: their peers' errors
    ("connection closed by peer") only follow from them. Ranks this harness kills (SIGKILL) are not among them."""
    return [f"rank {rank} crashed by {_CRASH_SIGNALS[-proc.exitcode]} before reporting (its faulthandler dump is in "
            f"the captured stderr)" for rank, proc in enumerate(procs)
            if rank not in reported and proc.exitcode is not None and -proc.exitcode in _CRASH_SIGNALS]


def _run_ranks_once(fn: Callable, world_size: int, args, kwargs, timeout: float):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, queue, args, kwargs))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict = {}
    errors: List[str] = []
    reported = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue_module.Empty:
                if time.monotonic() >= deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks; finished: {sorted(results)}")
                    break
                if any(proc.exitcode not in (None, 0) for proc in procs):   # died without reporting
                    errors.append(f"a rank ended without reporting; finished: {sorted(results)}")
                    break
                continue
            reported.add(rank)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
        errors[:0] = _signal_deaths(procs, reported) if errors else []
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return errors, results


def run_ranks_outcomes(fn: Callable, world_size: int, *args, timeout: float = 120.0,
                       expected_reports: int = None, **kwargs) -> List[tuple]:
    """Like run_ranks, but for fault tests: returns ``(status, payload, seconds)`` per rank.

    status is "ok" (payload = result), "error" (payload = traceback text), or
    "gone" (the rank exited without reporting, payload = its stderr, seconds = when
    its exit was seen; or it was still running at ``timeout`` and was killed, seconds = None).
    With ``expected_reports``, ranks still running once that many have reported are killed.
    """
    import tempfile

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        stderr_paths = [os.path.join(tmp, f"rank{rank}.stderr") for rank in range(world_size)]
        procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, queue, args, kwargs, stderr_paths[rank]))
                 for rank in range(world_size)]
        start = time.monotonic()
        for proc in procs:
            proc.start()
        outcomes: dict = {}
        exited: dict = {}
        deadline = start + timeout
        wanted = world_size if expected_reports is None else expected_reports
        while len(outcomes) < wanted and time.monotonic() < deadline:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except Exception:
                for rank, proc in enumerate(procs):
                    if not proc.is_alive() and rank not in exited:
                        exited[rank] = time.monotonic() - start
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            outcomes[rank] = ("ok" if ok else "error", payload, time.monotonic() - start)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for rank in range(world_size):
            if rank not in outcomes:
                with open(stderr_paths[rank], errors="replace") as f:
                    outcomes[rank] = ("gone", f.read(), exited.get(rank))
    return [outcomes[rank] for rank in range(world_size)]
