"""When a run stops before --train-iters: Megatron-LM's exit flags.

* ``--exit-interval N``: after iteration N (and every multiple of it);
* ``--exit-duration-in-mins M``: once the run has lasted M minutes, start-up included;
* ``--exit-signal-handler``: once any rank has received ``--exit-signal`` (SIGTERM by
  default: what Slurm sends before it preempts or times out a job).

The loop asks after every iteration; the caller then saves a checkpoint (with ``--save``)
and stops. The duration and the signal are agreed on by all ranks (one max-reduction of
two flags per iteration, only when either flag is set), so every rank stops after the
same iteration even if the signal reached only some of them.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

from megatron_tawpipe.arguments.run_config import TrainingConfig


class ExitConditions:
    def __init__(self, training: TrainingConfig, started: float):
        self.training = training
        self.started = started
        self.received: Optional[str] = None
        self._previous = None
        self._signal = None
        if training.exit_signal_handler:
            self._signal = getattr(signal, training.exit_signal)
            self._previous = signal.signal(self._signal, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self, iteration: int) -> Optional[str]:
        """Why the run stops after ``iteration``, or None to go on (a collective when it may stop)."""
        training = self.training
        if training.exit_signal_handler or training.exit_duration_in_mins:
            from megatron_tawpipe.monitor.metrics import max_over_ranks

            minutes = (time.time() - self.started) / 60.0
            overdue = bool(training.exit_duration_in_mins) and minutes >= training.exit_duration_in_mins
            signalled, timed_out = max_over_ranks([float(self.received is not None), float(overdue)])
            if signalled:
                return f"received {training.exit_signal} (--exit-signal-handler)"
            if timed_out:
                return f"ran for more than --exit-duration-in-mins {training.exit_duration_in_mins:g}"
        if training.exit_interval and iteration % training.exit_interval == 0:
            return f"--exit-interval {training.exit_interval}"
        return None

    def close(self) -> None:
        if self._signal is not None:
            signal.signal(self._signal, self._previous)
            self._signal = None
