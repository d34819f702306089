"""Emulated compute with context parallelism: the ring attention's real exchange between sleeps.

With ``--context-parallel-size C`` each GPU of a context-parallel group computes S / C tokens of every sequence
(the balanced split into 2C chunks, :mod:`megatron_tawpipe.models.ring_attention`). The emulated layer does
what that layer does, with its arithmetic replaced by sleeps:

* **How the calibrated times scale.** The file's times are one GPU's for a whole micro-batch at the run's
  ``--seq-length`` S (``tools/calibrate.py`` refuses a file measured at another length). With C > 1 a layer
  sleeps 1/C of them (and 1/T under tensor parallelism): the linear layers, norms and MLP are per token, and
  the balanced split gives every rank 1/C of the causal score blocks (flash-style kernels: a diagonal block
  costs half a block). The output layer and loss sleep 1/C of theirs (per token).
* **Where the ring runs.** A layer's time is cut as the simulator cuts it
  (:func:`megatron_tawpipe.sim.context_parallel.attention_share`, the FLOP model's share of the score blocks
  QK^T and AV): the linear part, half before and half after the attention, and the attention's share in C
  ring steps of equal work (two chunk x chunk blocks each, the causal diagonals counted as half a block).
* **The exchange is real.** Forward: before each of the first C-1 steps the rank posts, with
  ``batch_isend_irecv`` on megatron-core's context-parallel group, the send of the keys and values it holds
  (one buffer of 2 x S/C x b x kv channels / T values of the compute dtype, the real ring's size and dtype)
  to the next rank and the receive of the previous rank's, sleeps the step's blocks, then waits. Backward: the
  keys and values travel again (C-1 times) and the fp32 key/value-gradient accumulator of the same shape C
  times: the accumulator of step s travels during step s+1, the last after the last step (nothing left to
  hide it), as the real ring's backward. A full recompute runs the forward's ring again first. So the ring's
  time on the critical path is what the links take beyond the sleeps that overlap it, measured, not modelled.

What is emulated: the arithmetic (slept) and the buffers' contents (never read). What is real: every ring
message's size, dtype, peers and order, and its overlap with the step it hides behind.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_tawpipe.sim.context_parallel import AttentionShape, attention_share

#: bytes of the key/value-gradient accumulator's values (fp32), as the real ring sends them
ACCUMULATOR_DTYPE = torch.float32


def ring_shape(args) -> AttentionShape:
    """The run's micro-batch shape for the ring's sizes and attention's share of a layer."""
    shape = AttentionShape.of_flags(args)
    return shape if getattr(args, "group_query_attention", False) else replace(shape, num_query_groups=None)


class EmulatedRing:
    """One context-parallel member's ring: ``size`` GPUs in ``group``, this one ``rank``; ``kv_numel`` values
    in each keys-and-values message; ``share`` of a layer's time in the score blocks."""

    def __init__(self, group, size: int, rank: int, kv_numel: int, share: float):
        if size < 2:
            raise ValueError(f"an emulated ring needs at least 2 context-parallel ranks, not {size}")
        self.group, self.size, self.rank = group, size, rank
        self.kv_numel, self.share = int(kv_numel), float(share)
        self._buffers = {}
        self.spent_s = 0.0   # seconds spent posting and waiting for the exchanges (beside the sleeps)
        self.to_next = dist.get_global_rank(group, (rank + 1) % size)
        self.from_prev = dist.get_global_rank(group, (rank - 1) % size)

    @classmethod
    def of_megatron(cls, args, tensor_parallel_size: int = 1) -> Optional["EmulatedRing"]:
        """From megatron-core's parallel state (initialised with the run's context-parallel size); None for C = 1."""
        from megatron.core import parallel_state

        size = parallel_state.get_context_parallel_world_size()
        if size == 1:
            return None
        shape = ring_shape(args)
        numel = 2 * (args.seq_length // size) * args.micro_batch_size * shape.kv_channels // tensor_parallel_size
        return cls(parallel_state.get_context_parallel_group(), size, parallel_state.get_context_parallel_rank(),
                   numel, attention_share(shape))

    # ---- buffers (allocated once per dtype and device; their contents are never read) ----------------------
    def _pair(self, dtype, device):
        key = (dtype, str(device))
        if key not in self._buffers:
            self._buffers[key] = [torch.zeros(self.kv_numel, dtype=dtype, device=device) for _ in range(2)]
        return self._buffers[key]

    def _post(self, send: torch.Tensor, recv: torch.Tensor):
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, self.to_next, self.group),
               dist.P2POp(dist.irecv, recv, self.from_prev, self.group)]
        works = dist.batch_isend_irecv(ops)
        self.spent_s += time.perf_counter() - start
        return works

    def _wait(self, works, pass_sleep: Optional["PassSleep"] = None) -> None:
        start = time.perf_counter()
        for work in works or ():
            work.wait()
        waited = time.perf_counter() - start
        self.spent_s += waited
        if pass_sleep is not None:
            pass_sleep.waited(waited)

    def take_spent_s(self) -> float:
        """Seconds this member spent posting and waiting for the ring's exchanges since the last call: the
        ring's time on the critical path, the measured counterpart of the simulator's exposed ring time."""
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    # ---- one layer's passes ---------------------------------------------------------------------------------
    def _step_s(self, layer_s: float) -> float:
        """One ring step's sleep: the rank's score work (``share`` of its layer time) in C equal steps."""
        return self.share * layer_s / self.size

    def forward(self, layer_s: float, sleep: Callable[..., None], dtype, device) -> None:
        """A layer's forward (or recompute) of ``layer_s`` seconds on this rank, the ring's C-1 exchanges of
        keys and values between its steps."""
        linear = (1.0 - self.share) * layer_s
        sleep = PassSleep(sleep)
        sleep(linear / 2)
        held, incoming = self._pair(dtype, device)
        for step in range(self.size):
            works = self._post(held, incoming) if step < self.size - 1 else None
            sleep(self._step_s(layer_s))
            self._wait(works, sleep)
            held, incoming = incoming, held
        sleep(linear - linear / 2)

    def backward(self, layer_s: float, sleep: Callable[..., None], dtype, device) -> None:
        """A layer's backward of ``layer_s`` seconds: keys and values around the ring again, and the fp32
        key/value-gradient accumulator behind them, C times (the last after the last step)."""
        linear = (1.0 - self.share) * layer_s
        sleep = PassSleep(sleep)
        sleep(linear / 2)
        held, incoming = self._pair(dtype, device)
        grads, grads_in = self._pair(ACCUMULATOR_DTYPE, device)
        grad_works = None
        for step in range(self.size):
            kv_works = self._post(held, incoming) if step < self.size - 1 else None
            sleep(self._step_s(layer_s))
            if grad_works is not None:
                self._wait(grad_works, sleep)
                grads, grads_in = grads_in, grads
            grad_works = self._post(grads, grads_in)
            self._wait(kv_works, sleep)
            held, incoming = incoming, held
        self._wait(grad_works, sleep)
        sleep(linear - linear / 2)


class PassSleep:
    """The sleeps of one layer pass (2C + 2 of them around the ring's exchanges), each shortened by what the one
    before it overslept: ``time.sleep`` overruns every call by the timer's slack and the wake-up (a tenth of a
    millisecond or more on a shared CPU), which a GPU's back-to-back kernels do not. An overrun is owed only
    within the pass, less the time a wait for a message then spent (a wait longer than the overrun clears it: the
    next step starts when the message arrives, as the GPU's would); a wait shorter than the overrun, which may
    have blocked, leaves the rest owed, so a pass can come out shorter than the GPU's by at most one overrun but
    never shorter than its time. ``sleep``: the clock's, ``sleep(seconds, actual)``: counts ``seconds`` of
    compute, sleeps ``actual``."""

    def __init__(self, sleep: Callable[..., None]):
        self._sleep, self.owed = sleep, 0.0

    def __call__(self, seconds: float) -> None:
        if seconds <= 0:
            return
        target = seconds - self.owed
        if target <= 0:          # owed more than this step: skip it, still owing the rest
            self.owed = -target
            self._sleep(seconds, 0.0)
            return
        start = time.perf_counter()
        self._sleep(seconds, target)
        self.owed = max(0.0, time.perf_counter() - start - target)

    def waited(self, seconds: float) -> None:
        """A wait of ``seconds`` between two sleeps: that much of the overrun is no longer owed."""
        self.owed = max(0.0, self.owed - seconds)
