"""Emulated compute: real tensors on the real links, compute replaced by calibrated sleeps.

``--emulated-compute-times FILE`` turns any schedule (tawpipe, weipipe, native
1f1b/interleaved, FSDP and HSDP, megatron's distributed optimizer) into a measurement of schedule and
overlap quality alone: every tensor that the schedule communicates keeps its
real size and crosses the real (possibly shaped) links, while each forward,
backward and recompute of a decoder layer, and of the output layer, becomes a
sleep of the time in FILE. On a CPU machine where four ranks share two cores,
real compute contends for the cores and hides schedule effects; sleeps do not.

FILE is the JSON that ``tools/calibrate.py`` writes and ``tools/simulate.py
--measured-times`` reads (seconds per layer and micro-batch; times recorded for a micro-batch of
``micro_batch_size`` samples are scaled linearly to the run's ``--micro-batch-size``, so one file
serves every size)::

    {"layer_forward": 0.02, "layer_backward": 0.04, "layer_recompute": 0.02,
     "head_forward": 0.01, "head_backward": 0.02, "device": "...", ...}

What stays real: the data pipeline, every weight, gradient and activation
transfer, collectives, the optimizer step on the real parameter sizes.
Losses are not computed (reported as 0); the metrics record
``compute_busy_fraction`` as slept time over iteration time on every schedule.

:class:`EmulatedCompute` is the object a trainer makes from the flags and gives to its model: to
megatron-core's ``GPTModel`` as its decoder-layer spec and model class (:mod:`.gpt`), to a weight-pipeline
model as its shard compute (:meth:`EmulatedCompute.shard_compute`). It counts the time it slept; each
trainer reports that in its step result.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_tawpipe.sim.costmodel import MEASURED_INFO_KEYS, MEASURED_MEMORY_KEYS
from megatron_tawpipe.sim.costmodel import MEASURED_TIME_KEYS as TIME_KEYS
from megatron_tawpipe.sim.costmodel import measured_time_scale, weight_store_values_per_token

INFO_KEYS = MEASURED_INFO_KEYS + MEASURED_MEMORY_KEYS   # read by the simulator's memory model, not slept


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds per layer (or output layer) and micro-batch."""

    layer_forward: float
    layer_backward: float
    layer_recompute: float = 0.0
    head_forward: float = 0.0
    head_backward: float = 0.0

    def forward_s(self, layers: int, head: bool) -> float:
        return layers * self.layer_forward + (self.head_forward if head else 0.0)

    def backward_s(self, layers: int, head: bool, recompute: bool) -> float:
        per_layer = self.layer_backward + (self.layer_recompute if recompute else 0.0)
        return layers * per_layer + (self.head_backward if head else 0.0)

    def to_json(self) -> Dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_compute_times(path: str, flag: str = "--emulated-compute-times", micro_batch_size: Optional[int] = None,
                       seq_length: Optional[int] = None) -> ComputeTimes:
    """Read and check FILE; errors name the flag and the file. Given the run's ``micro_batch_size`` (and
    ``seq_length``), times the file records for micro-batches of another size are scaled to the run's
    (linear in the samples at one sequence length: :func:`~megatron_tawpipe.sim.costmodel.measured_time_scale`),
    so one calibration serves every micro-batch size; a file measured at another sequence length is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path}: expected a JSON object with {', '.join(TIME_KEYS)}")
    unknown = sorted(set(data) - set(TIME_KEYS) - set(INFO_KEYS))
    if unknown:
        raise ValueError(f"{flag} {path}: unknown keys {unknown}; allowed: {', '.join(TIME_KEYS + INFO_KEYS)}")
    missing = [k for k in ("layer_forward", "layer_backward") if k not in data]
    if missing:
        raise ValueError(f"{flag} {path}: missing {', '.join(missing)}")
    values = {}
    for key in TIME_KEYS:
        if key in data:
            value = data[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{flag} {path}: {key} must be a number of seconds >= 0, got {value!r}")
            values[key] = float(value)
    try:
        scale = measured_time_scale(data, micro_batch_size, seq_length)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    return ComputeTimes(**{key: scale * value for key, value in values.items()})


# ---- the object a model is given ---------------------------------------------------------------------------

class EmulatedCompute:
    """Calibrated sleeps in place of compute, and the seconds slept since the last :meth:`take_slept_s`."""

    def __init__(self, times: ComputeTimes, recompute: bool, deferred_weight_gradients: bool = True,
                 args=None):
        self.times = times
        self.recompute = recompute   # whether each backward also recomputes the forward (full recompute)
        # a split backward's weight-gradient half slept in its weight pass (deferred kernels: the runtime,
        # and the default) or, False, in its input pass
        self.deferred_weight_gradients = deferred_weight_gradients
        self.slept_s = 0.0
        # --context-parallel-size C: every layer sleeps 1/C of its times around the ring's real exchange
        # (:mod:`.ring`; made on first use, once megatron-core's parallel state exists)
        self.args = args
        self.context_parallel_size = (getattr(args, "context_parallel_size", 1) or 1) if args is not None else 1
        self._ring = None

    def ring(self, tensor_parallel_size: int = 1):
        """This rank's :class:`~megatron_tawpipe.emulation.ring.EmulatedRing` (None with C = 1)."""
        if self.context_parallel_size == 1:
            return None
        if self._ring is None:
            from megatron_tawpipe.emulation.ring import EmulatedRing

            self._ring = EmulatedRing.of_megatron(self.args, tensor_parallel_size)
        return self._ring

    @classmethod
    def from_args(cls, args, recompute: bool) -> Optional["EmulatedCompute"]:
        """The emulation ``--emulated-compute-times`` asks for; None without the flag (real compute)."""
        path = args.emulated_compute_times
        if not path:
            return None
        times = load_compute_times(path, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
        fine_timer_slack()
        # The runtime defers the weight-gradient kernels of a split backward; --emulated-deferred-weight-gradients
        # (kept for existing command lines) asks for what is now always done.
        return cls(times, recompute, True, args=args)

    def sleep(self, seconds: float, actual: Optional[float] = None) -> None:
        """Sleep ``seconds`` of compute (``actual``: the seconds to sleep for them where a pass owes an earlier
        sleep's overrun, :class:`~megatron_tawpipe.emulation.ring.PassSleep`); the compute counted is
        ``seconds``."""
        if seconds > 0:
            actual = seconds if actual is None else actual
            if actual > 0:
                time.sleep(actual)
            self.slept_s += seconds

    def start_step(self) -> None:
        """A training step starts: forget what was slept before it (evaluation, set-up)."""
        self.slept_s = 0.0
        if self._ring is not None:
            self._ring.take_spent_s()

    def take_ring_s(self) -> Optional[float]:
        """Seconds the ring attention's exchanges showed beside the sleeps since the last call (None without
        context parallelism; 0.0 on a rank whose ring has not run yet, so that every rank of the run reports):
        :meth:`megatron_tawpipe.emulation.ring.EmulatedRing.take_spent_s`."""
        if self.context_parallel_size == 1:
            return None
        return self._ring.take_spent_s() if self._ring is not None else 0.0

    def take_slept_s(self) -> float:
        """Seconds slept since the last call (one training step's compute time)."""
        slept, self.slept_s = self.slept_s, 0.0
        return slept

    def block(self, x: torch.Tensor, out_shape: Sequence[int], forward_s: float, backward_s: float,
              params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """A block of layers that sleeps ``forward_s`` forward and ``backward_s`` backward (see
        :class:`_SleepingCompute`); without autograd it only sleeps the forward."""
        trainable = [p for p in params if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
            self.sleep(forward_s)
            return x.clone() if tuple(x.shape) == tuple(out_shape) else x.new_zeros(out_shape)
        return _SleepingCompute.apply(self, forward_s, backward_s, tuple(out_shape), x, *trainable)

    def layer(self, x: torch.Tensor, params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """One decoder layer on this rank's tokens: :meth:`block` of the layer's times, or with context
        parallelism 1/C of them around the ring's real exchange (:class:`_RingLayer`)."""
        times, ring = self.times, self.ring()
        if ring is None:
            return self.block(x, x.shape, times.layer_forward, times.backward_s(1, False, self.recompute), params)
        trainable = [p for p in params if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
            ring.forward(times.layer_forward / ring.size, self.sleep, x.dtype, x.device)
            return x.clone()
        return _RingLayer.apply(self, ring, x, *trainable)

    # ---- megatron-core's GPTModel (one pipeline chunk, or the whole model under FSDP) ------------------------

    def layer_spec(self, spec):
        """megatron-core's decoder-layer spec with the layer emulated (:mod:`.gpt`)."""
        from megatron_tawpipe.emulation.gpt import emulated_layer_spec

        return emulated_layer_spec(spec, self)

    def gpt_model_class(self):
        """The GPTModel class whose forward sleeps its output layer's time (:mod:`.gpt`)."""
        from megatron_tawpipe.emulation.gpt import EmulatedGPTModel

        return EmulatedGPTModel

    # ---- a weight-pipeline rank --------------------------------------------------------------------------

    def shard_compute(self, model) -> "EmulatedShardCompute":
        """The shard compute of a weight-pipeline ``model`` (``WeightPipeModel(args, config, compute=...)``)."""
        return EmulatedShardCompute(model, self)


def fine_timer_slack() -> bool:
    """Ask Linux to wake this thread's sleeps on time, and those of the threads it starts afterwards (timer slack
    1 ns instead of the default 50 us; threads started before keep theirs), so that a sleep standing for a kernel
    overruns by the wake-up alone; whether it was set (False off Linux). The emulated compute sleeps on the
    thread that makes the run's :class:`EmulatedCompute` (autograd runs a CPU backward on the calling thread)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(29, 1, 0, 0, 0) == 0   # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


class _SleepingCompute(torch.autograd.Function):
    """A stand-in for a block of layers: sleeps in forward and backward.

    Output: a new tensor of ``out_shape``, allocated but not written when the
    shapes match (a layer's hidden state: what it holds does not matter, its
    size does), zeros otherwise (the per-token losses). Gradients: ``x`` gets
    the incoming gradient when the shapes match (zeros otherwise), every
    parameter gets zeros of its own size, so that gradient traffic (DDP, FSDP
    reduce-scatter) keeps its real size. What the CPU does besides sleeping is
    therefore one parameter-sized gradient per layer and micro-batch, which the
    library then accumulates; the weight-passing emulation below does the same.
    """

    @staticmethod
    def forward(ctx, clock: EmulatedCompute, forward_s: float, backward_s: float, out_shape: Tuple[int, ...], x,
                *params):
        ctx.clock = clock
        ctx.backward_s = backward_s
        ctx.same_shape = tuple(x.shape) == tuple(out_shape)
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        clock.sleep(forward_s)
        return x.new_empty(out_shape) if ctx.same_shape else x.new_zeros(out_shape)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.clock.sleep(ctx.backward_s)
        shape, dtype, device = ctx.x_meta
        grad_x = grad_out if ctx.same_shape else torch.zeros(shape, dtype=dtype, device=device)
        grads = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.param_meta]
        return (None, None, None, None, grad_x, *grads)


class _RingLayer(torch.autograd.Function):
    """A decoder layer under context parallelism: :class:`_SleepingCompute`'s tensors, its forward and
    backward (a recompute first, with full recompute) the ring's passes (:mod:`.ring`) of 1/C of the times."""

    @staticmethod
    def forward(ctx, clock: EmulatedCompute, ring, x, *params):
        ctx.clock, ctx.ring = clock, ring
        ctx.meta = (x.dtype, x.device)
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        ring.forward(clock.times.layer_forward / ring.size, clock.sleep, x.dtype, x.device)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        clock, ring, (dtype, device) = ctx.clock, ctx.ring, ctx.meta
        times = clock.times
        if clock.recompute and times.layer_recompute:
            ring.forward(times.layer_recompute / ring.size, clock.sleep, dtype, device)
        ring.backward(times.layer_backward / ring.size, clock.sleep, dtype, device)
        grads = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.param_meta]
        return (None, None, grad_out, *grads)


class EmulatedShardCompute:
    """A weight-pipeline rank's forward/backward actions as sleeps (the model's ``ShardCompute``).

    The executor still moves every weight and gradient buffer of real size; the
    data pipeline and ``forward_step_func`` still run, and the last shard
    reports a zero loss over the micro-batch's real token count. Each backward
    does the CPU work the native emulation leaves to autograd and megatron's
    gradient hooks: a zero gradient of the shard's size (and of the embedding
    on shard 0, of the head on the last shard) accumulated into the gradient
    buffer, so that no strategy is spared the other's memory traffic.

    With tensor parallelism (T > 1) each rank sleeps 1/T of the times (the layer's
    matrix work split T ways) and runs megatron's tensor-parallel collectives for
    real, with their real sizes, on the tensor-parallel group: per decoder layer two
    all-reduces of the hidden state in the forward, two in the backward and two in
    a recompute (under --sequence-parallel, an all-gather and a reduce-scatter for
    each), and one for the output layer's forward and backward.

    With context parallelism (C > 1) each rank sleeps 1/C of the times (1/(T x C) with both), every decoder
    layer around the ring attention's real exchange of keys and values (and, backward, of their fp32
    gradients) on the context-parallel group (:mod:`.ring`); the tensor-parallel collectives move the local
    S / C tokens' hidden state.
    """

    PER_LAYER = 2   # tensor-parallel hidden-state collectives per decoder layer and pass

    def __init__(self, model, clock: EmulatedCompute):
        self.model, self.clock = model, clock
        self.layers = model.plan.shard_layers   # per shard
        self.last = model.plan.num_shards - 1
        self.tp = model.tensor_parallel_size
        self.cp = getattr(model, "context_parallel_size", 1) or 1
        self.ring = clock.ring(self.tp) if self.cp > 1 else None
        self.split = self.tp * self.cp   # each GPU's share of a layer's (and the output layer's) work
        self._exchange = _tensor_parallel_exchange(model, self.cp) if self.tp > 1 else (lambda count: None)
        self._store: Dict[Tuple[int, int], torch.Tensor] = {}   # (mb, shard) -> its held weight-gradient store

    def reset(self) -> None:
        """Forget the weight-gradient stores of an unfinished run."""
        self._store.clear()

    def store_bytes(self, shard: int) -> int:
        """What the runtime keeps of (a micro-batch, ``shard``) from its input pass to its weight pass: per
        decoder layer every linear layer's input and output gradient (QKV, projection, gated FC1, FC2), in
        the compute dtype, divided over the tensor-parallel ranks -- as the simulator's memory model counts
        it (``CostModel.layer_weight_store_bytes``)."""
        args = self.model.args
        H, tokens = args.hidden_size, args.seq_length // self.cp * args.micro_batch_size
        ffn = args.ffn_hidden_size or 4 * H
        heads = args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else None
        kv = H * groups // heads if groups else H
        per_token = weight_store_values_per_token(H, ffn, kv)
        itemsize = torch.empty((), dtype=self.model.compute_dtype).element_size()
        return self.layers[shard] * tokens * per_token * itemsize // self.tp

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        batches, last = self.model.microbatches, shard == self.last
        if shard == 0:
            batches.start(mb)
        layers, times = self.layers[shard], self.clock.times
        if self.ring is None:
            self.clock.sleep(times.forward_s(layers, last) / self.split)
        else:
            dtype, device = self.model.compute_dtype, weights.device
            for _ in range(layers):
                self.ring.forward(times.layer_forward / self.split, self.clock.sleep, dtype, device)
            self.clock.sleep(times.forward_s(0, last) / self.split)
        self._exchange(self.PER_LAYER * layers + (1 if last else 0))
        if last:
            labels = batches.inputs[mb]["labels"]
            per_token = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            batches.finish_forward(mb, batches.loss(mb, per_token)[1])

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        self._backward_pass(shard, leave_s=0.0, dtype=self.model.compute_dtype, device=weights.device)
        self._weight_grads(mb, shard, grad_buffer)

    def _weight_half_s(self, shard: int) -> float:
        """A split backward's weight-gradient pass: half of its layers' backward (not the output layer's, nor
        a recompute) where its kernels are deferred (the runtime), as the simulator's cost model prices it;
        none where the input pass computes them."""
        if not self.clock.deferred_weight_gradients:
            return 0.0
        return 0.5 * self.layers[shard] * self.clock.times.layer_backward / self.split

    def backward_input(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        self._backward_pass(shard, leave_s=self._weight_half_s(shard), dtype=self.model.compute_dtype,
                            device=weights.device)
        if self.clock.deferred_weight_gradients:    # the store, held (allocated) until the weight pass
            self._store[(mb, shard)] = torch.empty(self.store_bytes(shard), dtype=torch.uint8,
                                                   device=weights.device)

    def backward_weight(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        self.clock.sleep(self._weight_half_s(shard))
        self._store.pop((mb, shard), None)
        self._weight_grads(mb, shard, grad_buffer)

    def _backward_pass(self, shard: int, leave_s: float, dtype=None, device=None) -> None:
        """The backward's time (recompute included) less ``leave_s``, and its tensor-parallel exchanges; with
        context parallelism each layer's recompute and backward run the ring (``leave_s`` taken evenly from
        the layers' backward)."""
        last, layers, times = shard == self.last, self.layers[shard], self.clock.times
        if self.ring is None:
            self.clock.sleep(times.backward_s(layers, last, self.model.recompute) / self.split - leave_s)
        else:
            self.clock.sleep(times.backward_s(0, last, False) / self.split)
            per_layer = times.layer_backward / self.split - leave_s / max(layers, 1)
            for _ in range(layers):
                if self.model.recompute and times.layer_recompute:
                    self.ring.forward(times.layer_recompute / self.split, self.clock.sleep, dtype, device)
                self.ring.backward(per_layer, self.clock.sleep, dtype, device)
        self._exchange(self.PER_LAYER * layers * (2 if self.model.recompute else 1) + (1 if last else 0))

    def _weight_grads(self, mb: int, shard: int, grad_buffer: torch.Tensor) -> None:
        model, last = self.model, shard == self.last
        grad_buffer.add_(torch.zeros_like(grad_buffer))
        parts = (["embedding"] if shard == 0 else []) + (["head"] if last else [])
        for part in parts:
            for grad in model.replicated_grads(part):
                grad.add_(torch.zeros_like(grad))
        if shard == 0:
            model.microbatches.release(mb)


def _tensor_parallel_exchange(model, context_parallel_size: int = 1):
    """``exchange(count)``: ``count`` of megatron's tensor-parallel hidden-state collectives on the
    group, of the real size (``seq x micro-batch x hidden`` in the compute dtype): all-reduces, or
    under --sequence-parallel all-gather + reduce-scatter pairs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    args, tp = model.args, model.tensor_parallel_size
    group = parallel_state.get_tensor_model_parallel_group()
    tokens = args.seq_length // context_parallel_size * args.micro_batch_size   # this rank's (context parallelism)
    full = torch.zeros(tokens * args.hidden_size, dtype=model.compute_dtype,
                       device=model.device)
    part = full[: full.numel() // tp].clone()
    sequence_parallel = bool(args.sequence_parallel)

    def exchange(count: int) -> None:
        for _ in range(count):
            if sequence_parallel:
                dist.all_gather_into_tensor(full, part, group=group)
                dist.reduce_scatter_tensor(part, full, group=group)
            else:
                dist.all_reduce(full, group=group)

    return exchange
