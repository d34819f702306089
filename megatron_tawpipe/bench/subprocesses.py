"""The processes an emulated cluster starts: waiting for them, stopping them, and signals meanwhile.

Each process runs in its own process group (``start_new_session``), so stopping one stops what it
started too: :func:`terminate_all` sends SIGTERM to the groups and SIGKILL to what is left after a
grace period. :func:`wait_all` waits for a set of them, stopping the rest once one has failed or
the time is up. :class:`TeardownSignals` turns SIGINT/SIGTERM/SIGHUP into exceptions so that a
``with`` block's teardown runs, and holds them off while it does. No torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from megatron_tawpipe.common.process_death import die_with_parent

TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def set_pdeathsig() -> None:
    """In the child before exec: get SIGTERM if the launching thread dies (e.g. SIGKILL)."""
    die_with_parent(signal.SIGTERM)


def exit_code(returncode: int) -> int:
    """A shell-style exit status: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def terminate_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM the process groups of ``procs``, SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def wait_all(procs: List[subprocess.Popen], timeout: Optional[float], fail_grace: float,
             term_grace: float) -> int:
    """Wait for every process of ``procs``; returns 0, the exit status of the first that failed
    (128+N if killed by signal N), or 124 after ``timeout`` seconds.

    Once one has failed the others get ``fail_grace`` seconds to finish and are then stopped
    (:func:`terminate_all` with ``term_grace``), as they are on timeout or on an exception here.
    """
    start = time.monotonic()
    first_failure: Optional[int] = None
    failed_at = 0.0
    try:
        while True:
            codes = [p.poll() for p in procs]
            for c in codes:
                if c not in (None, 0) and first_failure is None:
                    first_failure, failed_at = exit_code(c), time.monotonic()
            if all(c is not None for c in codes):
                return first_failure or 0
            now = time.monotonic()
            if first_failure is not None and now - failed_at > fail_grace:
                print(f"emulated_cluster: a node failed with exit status {first_failure}; "
                      "stopping the others", file=sys.stderr, flush=True)
                terminate_all(procs, term_grace)
                return first_failure
            if timeout is not None and now - start > timeout:
                print(f"emulated_cluster: timed out after {timeout:g} s; stopping",
                      file=sys.stderr, flush=True)
                terminate_all(procs, term_grace)
                return 124
            time.sleep(0.05)
    except BaseException:
        terminate_all(procs, term_grace)
        raise


def pump(stream, tag: str) -> None:
    """Copy ``stream`` (binary lines) to stdout, each line prefixed with ``tag``, until it closes."""
    out = getattr(sys.stdout, "buffer", None)
    for line in iter(stream.readline, b""):
        data = tag.encode() + line
        if out is not None:
            out.write(data)
            out.flush()
        else:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
    stream.close()


class TeardownSignals:
    """SIGINT, SIGTERM and SIGHUP as exceptions, so that a ``with`` block's teardown runs.

    After :meth:`install` (main thread only), SIGINT raises KeyboardInterrupt and SIGTERM/SIGHUP
    raise SystemExit(128+signum) in the main thread. :meth:`defer` ignores them for a while (a
    teardown must not be interrupted); :meth:`restore` ends that and, with ``uninstall``, puts
    back the handlers from before :meth:`install`.
    """

    def __init__(self) -> None:
        self._old: Dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in TEARDOWN_SIGNALS:
            self._old[sig] = signal.signal(sig, handler)

    def defer(self) -> Optional[Dict[int, object]]:
        """Ignore the signals until :meth:`restore`; the handlers to restore (None off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return {sig: signal.signal(sig, lambda signum, frame: None) for sig in TEARDOWN_SIGNALS}

    def restore(self, deferred: Optional[Dict[int, object]], uninstall: bool) -> None:
        if deferred is None:
            return
        for sig, old in deferred.items():
            signal.signal(sig, old)
        if uninstall:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old = {}
