"""``--async-save`` (Megatron-LM's): the tensors of a torch_dist checkpoint are written in the background
while training goes on, with megatron-core's ``dist_checkpointing`` async machinery.

``dist_checkpointing.save(..., async_sharded_save=True)`` does the collective part in the training loop
(planning, the common part, the save plan) and returns an ``AsyncRequest``: the write of this rank's tensor
files. It is scheduled on megatron-core's ``AsyncCallsQueue``:

* by default on a *temporal* worker: a process forked at the save (the fork is a copy-on-write snapshot of
  the host tensors; on a GPU megatron-core's preload first copies them to the host), which writes and exits;
* with ``--use-persistent-ckpt-worker`` on megatron-core's *persistent* worker (one spawned process per rank,
  kept for the run; megatron-core 0.16.1's sets a CUDA device in it, so it needs a GPU).

The checkpoint becomes visible only when the request is *finalized* on every rank: megatron-core gathers the
write results and writes ``.metadata``, then rank 0 fsyncs the files, renames ``iter_NNNNNNN.tmp`` into place
and replaces ``latest_checkpointed_iteration.txt`` (then ``--save-retain-interval`` applies). Finalizing is
collective: the training loop checks every iteration without waiting (:func:`finalize`), waits before the
next save and before exiting; a run that fails or is killed before that leaves the previous checkpoint as the
latest one, intact (the unfinished one stays a ``.tmp`` directory, removed by the next save of that iteration);
a killed rank's forked writer and its write processes end with it.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import sys
import threading
from typing import List, Optional

from megatron_tawpipe.common.process_death import end_tree_with_parent
from megatron_tawpipe.compat import patches

_calls = None            # megatron-core's AsyncCallsQueue, made at the first async save
_results_queues: dict = {}  # the writer's results queue, per kind of worker
_reported = False           # whether a writer was told to say that its priority could not be set


def enabled(args) -> bool:
    return bool(args.async_save)


def _calls_queue(args):
    global _calls
    if _calls is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _calls = AsyncCallsQueue(persistent=bool(args.use_persistent_ckpt_worker))
    return _calls


def use_results_queue(args) -> None:
    """Point megatron-core's torch_dist writer at a results queue the worker can reach (the registered patch
    ``checkpoint-write-results-queue``, :mod:`megatron_tawpipe.compat.patches`).

    The writer hands each rank's write results back through a module-level queue, by default served by a
    spawned multiprocessing manager (a second interpreter per rank). A synchronous save puts and gets in this
    process (a plain queue does); a temporal worker is forked, so a fork-inherited queue does; only the
    persistent worker, a spawned process, needs megatron-core's manager queue."""
    kind = "sync" if not enabled(args) else (
        "persistent" if args.use_persistent_ckpt_worker else "fork")
    if kind not in _results_queues:
        if kind == "sync":
            _results_queues[kind] = queue.Queue()
        elif kind == "fork":
            _results_queues[kind] = mp.get_context("fork").Queue()
        else:
            _results_queues[kind] = patches.new_write_results_queue()
    patches.apply("checkpoint-write-results-queue", replace={patches.WRITE_RESULTS_QUEUE: _results_queues[kind]})


def _write_with_priority(rank_pid: Optional[int], cpu_priority: Optional[int], io_priority: Optional[int],
                         report: bool, write, *args, **kwargs):
    """The writer process's body: end with its rank, lower its CPU priority (``--async-ckpt-cpu-priority``: a
    nice value, raised to the target, at most 19, never lowered) and I/O class (``--async-ckpt-io-priority``,
    3 = idle), then write. A priority that cannot be set (no psutil, class 1 without privileges) leaves the
    writer at its parent's; ``report``: say so (the first background save of the run does).

    ``rank_pid``: the rank that forked this writer from its main thread. A writer whose rank is killed is
    killed too, with the write processes it forked: its checkpoint can no longer be finalized, and a writer
    left running would go on writing into the ``iter_NNNNNNN.tmp`` folder that the restarted run's save of
    that iteration clears and fills again, holding a host copy of the rank's state meanwhile. Other signals
    reach it as before: a forked copy keeps the rank's handlers, so under ``--exit-signal-handler`` a stop on
    request lets it finish and the rank finalize its checkpoint."""
    if rank_pid is not None:
        end_tree_with_parent(rank_pid)
    if cpu_priority is not None:
        current = os.nice(0)
        target = min(int(cpu_priority), 19)
        if target > current:
            os.nice(target - current)
    if io_priority is not None:
        try:
            import psutil

            psutil.Process().ionice(int(io_priority))
        except (ImportError, OSError, ValueError, AttributeError) as exc:  # class 1 (real time) needs privileges
            if report:
                print(f"--async-ckpt-io-priority {io_priority}: not applied to the checkpoint writer "
                      f"({type(exc).__name__}: {exc}); it writes at the training process's I/O priority",
                      file=sys.stderr, flush=True)
    return write(*args, **kwargs)


def writer_body(write, args, report: bool):
    """What the writer runs in place of megatron-core's ``write``: :func:`_write_with_priority` with the
    priority flags and, for a temporal writer forked from this rank's main thread (the kernel ties a child's
    end to the thread that forked it), this rank's pid. megatron-core's persistent worker lives for the run
    and is its own business: not tied."""
    forked_here = not args.use_persistent_ckpt_worker and threading.current_thread() is threading.main_thread()
    rank_pid = os.getpid() if forked_here else None
    return functools.partial(_write_with_priority, rank_pid, args.async_ckpt_cpu_priority,
                             args.async_ckpt_io_priority, report, write)


def schedule(request, args) -> None:
    """Start the background write of ``request`` (every rank calls it); a save still pending is finalized first."""
    global _reported
    finalize(blocking=True)
    if request.async_fn is not None:
        request = request._replace(async_fn=writer_body(request.async_fn, args, report=not _reported))
        _reported = True
    _calls_queue(args).schedule_async_request(request)


def pending() -> int:
    """How many scheduled saves are not finalized yet."""
    return 0 if _calls is None else _calls.get_num_unfinalized_calls()


def finalize(blocking: bool) -> List[int]:
    """Finalize the saves whose background writes are done on every rank (all of them, waiting, with
    ``blocking``); collective: every rank calls it at the same points. Returns the finalized calls' indices."""
    if _calls is None or not _calls.get_num_unfinalized_calls():
        return []
    return _calls.maybe_finalize_async_calls(blocking=blocking)


def close(abort: bool = False) -> None:
    """End of the run: finalize what is pending (collective), or with ``abort`` (the run failed) kill the
    background writers without finalizing: their checkpoints never become the latest."""
    global _calls
    if _calls is None:
        return
    calls, _calls = _calls, None
    if abort:
        for active in list(calls.async_calls):
            active.async_caller.close(abort=True)
        calls.async_calls.clear()
    calls.close(abort=abort)
