"""Compute time of the executor's Forward/Backward actions.

On CPU a kernel has finished when the call returns: the wall clock is the
compute time.  On CUDA kernels are asynchronous and a wall-clock timer around
them measures launch time, so each span is a pair of CUDA events, read once
per iteration (one synchronisation) for the busy fraction, and placed on the
wall clock for timelines by an anchor event recorded with a host timestamp.
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
        self.reset()

    def reset(self) -> None:
        self._seconds = 0.0
        self._events: List[Tuple[object, object]] = []
        self._last: Tuple[Stamp, Stamp] = (0.0, 0.0)
        self._anchor = None

    @contextlib.contextmanager
    def span(self):
        if not self.cuda:
            start = time.time()
            yield
            end = time.time()
            self._seconds += end - start
            self._last = (start, end)
            return
        if self._anchor is None:
            torch.cuda.synchronize()
            self._anchor = (torch.cuda.Event(enable_timing=True), time.time())
            self._anchor[0].record()
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        finish.record()
        self._events.append((begin, finish))
        self._last = (self._wall(begin), self._wall(finish))

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
        """Seconds of compute since ``reset``."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
            self._events = []
        return self._seconds
