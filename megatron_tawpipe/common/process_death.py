"""A child process that ends with the thread that started it (Linux's ``PR_SET_PDEATHSIG``).

A process forked or started by a training rank outlives the rank if the rank is killed (SIGKILL, the OOM
killer): it is re-parented and runs on, holding files, ports or memory the next attempt needs. Asking the
kernel for a signal when the parent dies ends it with its rank. The kernel ties the request to the *thread*
that forked, so callers ask only for children started by a thread that lives as long as the rank (its main
thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Dict, List, Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM, parent_pid: Optional[int] = None) -> bool:
    """In the child: receive ``signum`` when the thread that started this process ends. ``parent_pid``: the
    parent's pid as the parent saw it before starting the child; a parent already gone by the time of the
    call (this process re-parented) sends ``signum`` now. False where the kernel offers no such request
    (not Linux): the child then outlives its parent as before."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


def descendants(pid: int) -> List[int]:
    """The live processes below ``pid`` (children, their children, ...), from /proc; empty elsewhere."""
    below: Dict[int, List[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state, parent, ...
        if fields[0] != "Z":
            below.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        children = below.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def _end_tree(signum, frame) -> None:
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


# A real-time signal nobody else sends: the processes this applies to are forked copies of a rank, which
# keep the rank's handlers of the usual signals (its --exit-signal handler only notes a SIGTERM) and must
# keep them: a stop on request lets them finish.
PARENT_DIED = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None


def end_tree_with_parent(parent_pid: int) -> bool:
    """In a child forked by ``parent_pid``'s long-lived thread: when that parent ends, kill this process and
    every process it has started (SIGKILL: a half-done job of a dead parent is of no use, and what the child
    forked could otherwise hang on locks the child held). The signal is handled between Python bytecodes of
    this process's main thread, so a call in C (a write, an fsync) finishes first."""
    if PARENT_DIED is None:
        return False
    signal.signal(PARENT_DIED, _end_tree)
    return die_with_parent(PARENT_DIED, parent_pid)
