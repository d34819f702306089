"""Compute time of the executor's Forward/Backward actions, and times for timelines.

On CPU a kernel has finished when the call returns: the wall clock is the
compute time.  On CUDA kernels are asynchronous and a wall-clock timer around
them measures launch time, so each span is a pair of CUDA events, read once
per iteration -- after the plan, when every operation of this rank has been
issued -- for the busy fraction.  Timelines place events on the wall clock
through one anchor: an event recorded, with its host time, when the timer is
created (before any plan runs, the one moment a device-wide synchronisation
cannot hold up a peer).  Nothing here synchronises while a plan runs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Tuple, Union

import torch

Stamp = Union[float, Callable[[], float]]


class ComputeTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._anchor = None
        if self.cuda:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self._anchor = (event, time.time())
        self.reset()

    def reset(self) -> None:
        self._seconds = 0.0
        self._events: List[Tuple[object, object]] = []
        self._last: Tuple[Stamp, Stamp] = (0.0, 0.0)

    @contextlib.contextmanager
    def span(self):
        if not self.cuda:
            start = time.time()
            yield
            end = time.time()
            self._seconds += end - start
            self._last = (start, end)
            return
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        finish.record()
        self._events.append((begin, finish))
        self._last = (self._wall(begin), self._wall(finish))

    def stamp(self, host: float) -> Stamp:
        """A point of the timeline: ``host`` on CPU; on CUDA the moment the current stream reaches
        this point (an event, resolved after the plan), so that a transfer waited on with
        ``work.wait()`` ends when the stream is past it, not when the wait was enqueued."""
        if not self.cuda:
            return host
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return self._wall(event)

    def _wall(self, event) -> Callable[[], float]:
        anchor, host = self._anchor

        def resolve() -> float:
            event.synchronize()
            return host + anchor.elapsed_time(event) / 1000.0
        return resolve

    def last_span(self) -> Tuple[Stamp, Stamp]:
        """(start, end) of the latest span: seconds, or on CUDA functions that give them."""
        return self._last

    def total(self) -> float:
        """Seconds of compute since ``reset`` (call it after the plan: on CUDA it waits for the last span)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
            self._events = []
        return self._seconds
