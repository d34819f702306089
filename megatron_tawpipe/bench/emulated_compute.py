"""Emulated compute: real tensors on the real links, compute replaced by calibrated sleeps.

``--emulated-compute-times FILE`` turns any schedule (tawpipe, weipipe, native
1f1b/interleaved, FSDP and HSDP, megatron's distributed optimizer) into a measurement of schedule and
overlap quality alone: every tensor that the schedule communicates keeps its
real size and crosses the real (possibly shaped) links, while each forward,
backward and recompute of a decoder layer, and of the output layer, becomes a
sleep of the time in FILE. On a CPU machine where four ranks share two cores,
real compute contends for the cores and hides schedule effects; sleeps do not.

FILE is the JSON that ``tools/calibrate.py`` writes and ``tools/simulate.py
--measured-times`` reads (seconds per layer and micro-batch)::

    {"layer_forward": 0.02, "layer_backward": 0.04, "layer_recompute": 0.02,
     "head_forward": 0.01, "head_backward": 0.02, "device": "...", ...}

What stays real: the data pipeline, every weight, gradient and activation
transfer, collectives, the optimizer step on the real parameter sizes.
Losses are not computed (reported as 0); the metrics record
``compute_busy_fraction`` as slept time over iteration time on every schedule.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_tawpipe.plan.costmodel import MEASURED_INFO_KEYS as INFO_KEYS
from megatron_tawpipe.plan.costmodel import MEASURED_TIME_KEYS as TIME_KEYS


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


def load_compute_times(path: str, flag: str = "--emulated-compute-times") -> ComputeTimes:
    """Read and check FILE; errors name the flag and the file."""
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
    return ComputeTimes(**values)


# ---- slept time (the busy fraction of emulated runs) ------------------------------------

_slept = {"seconds": 0.0}


def reset_slept() -> None:
    _slept["seconds"] = 0.0


def slept_seconds() -> float:
    return _slept["seconds"]


def emulate(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
        _slept["seconds"] += seconds


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
    def forward(ctx, forward_s: float, backward_s: float, out_shape: Tuple[int, ...], x, *params):
        ctx.backward_s = backward_s
        ctx.same_shape = tuple(x.shape) == tuple(out_shape)
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        emulate(forward_s)
        return x.new_empty(out_shape) if ctx.same_shape else x.new_zeros(out_shape)

    @staticmethod
    def backward(ctx, grad_out):
        emulate(ctx.backward_s)
        shape, dtype, device = ctx.x_meta
        grad_x = grad_out if ctx.same_shape else torch.zeros(shape, dtype=dtype, device=device)
        grads = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.param_meta]
        return (None, None, None, grad_x, *grads)


def sleeping_block(x: torch.Tensor, out_shape: Sequence[int], forward_s: float, backward_s: float,
                   params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    trainable = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
        emulate(forward_s)
        return x.clone() if tuple(x.shape) == tuple(out_shape) else x.new_zeros(out_shape)
    return _SleepingCompute.apply(forward_s, backward_s, tuple(out_shape), x, *trainable)


# ---- a megatron-core GPTModel (one pipeline chunk, or the whole model under FSDP) -------

def emulate_gpt_model(gpt, times: ComputeTimes, recompute: bool) -> None:
    """Replace ``gpt.forward`` by sleeps of its layers' and output layer's calibrated times.

    The chunk keeps its parameters (DDP and FSDP hooks, buffers and collectives
    see their real sizes); its input is the embedding output on the first
    stage and the received activation elsewhere, its output a hidden state of
    the real shape ``[s, b, h]`` or, on the last stage, per-token losses ``[b, s]``.
    Layers run as modules, so FSDP all-gathers each layer's weights as usual.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in gpt.decoder.layers:
        if isinstance(layer, TransformerLayer):
            layer.forward = _sleeping_layer_forward(layer, times, recompute)

    def forward(input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **_):
        batch, seq = input_ids.shape
        hidden_shape = (seq, batch, gpt.config.hidden_size)
        if gpt.pre_process:
            embedding = [p for p in gpt.embedding.parameters()]
            source = embedding[0]
            hidden = sleeping_block(source.new_empty(hidden_shape), hidden_shape, 0.0, 0.0, embedding)
        else:
            hidden = gpt.decoder.input_tensor
        for layer in gpt.decoder.layers:
            hidden = layer(hidden)
        if not gpt.post_process:
            return hidden
        head = list(gpt.decoder.final_layernorm.parameters()) if gpt.decoder.final_layernorm is not None else []
        head += list(gpt.output_layer.parameters())
        per_token = sleeping_block(hidden, (batch, seq), times.head_forward, times.head_backward, head)
        return per_token.float()

    gpt.forward = forward


def _sleeping_layer_forward(layer, times: ComputeTimes, recompute: bool):
    def forward(hidden_states, *args, **kwargs):
        # The layer's parameters as registered now: FSDP2 swaps in the gathered (unsharded)
        # parameters for the forward, and only gradients on those are reduced.
        return sleeping_block(hidden_states, hidden_states.shape, times.layer_forward,
                              times.backward_s(1, False, recompute), list(layer.parameters()))

    return forward


# ---- a weight-passing rank (the executor's compute callbacks) ---------------------------

def emulate_weight_pipe_model(model, times: ComputeTimes) -> None:
    """Replace a ``WeightPipeModel``'s forward/backward callbacks by sleeps.

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
    """
    from megatron_tawpipe.runtime.weight_pipe_model import _normalised_loss

    layers = model.plan.layers_per_shard
    last = model.plan.num_shards - 1
    tp = getattr(model, "tensor_parallel_size", 1)
    exchange = _tensor_parallel_exchange(model) if tp > 1 else (lambda count: None)
    per_layer = 2

    def forward(mb: int, shard: int, weights: torch.Tensor) -> None:
        if shard == 0:
            model._start_microbatch(mb)
        emulate(times.forward_s(layers, shard == last) / tp)
        exchange(per_layer * layers + (1 if shard == last else 0))
        if shard == last:
            labels = model._batches[mb]["labels"]
            per_token = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            model._reports[mb] = _normalised_loss(model._loss_funcs[mb](per_token), model._num_microbatches)[1]
            if model._forward_only:
                model._batches.pop(mb)

    def backward(mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        emulate(times.backward_s(layers, shard == last, model.recompute) / tp)
        exchange(per_layer * layers * (2 if model.recompute else 1) + (1 if shard == last else 0))
        grad_buffer.add_(torch.zeros_like(grad_buffer))
        parts = (["embedding"] if shard == 0 else []) + (["head"] if shard == last else [])
        for part in parts:
            for grad in model.replicated_grads(part):
                grad.add_(torch.zeros_like(grad))
        if shard == 0:
            model._batches.pop(mb, None)
            model._loss_funcs.pop(mb, None)

    model.forward = forward
    model.backward = backward


def _tensor_parallel_exchange(model):
    """``exchange(count)``: ``count`` of megatron's tensor-parallel hidden-state collectives on the
    group, of the real size (``seq x micro-batch x hidden`` in the compute dtype): all-reduces, or
    under --sequence-parallel all-gather + reduce-scatter pairs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    args, tp = model.args, model.tensor_parallel_size
    group = parallel_state.get_tensor_model_parallel_group()
    full = torch.zeros(args.seq_length * args.micro_batch_size * args.hidden_size, dtype=model.compute_dtype,
                       device=model.device)
    part = full[: full.numel() // tp].clone()
    sequence_parallel = bool(getattr(args, "sequence_parallel", False))

    def exchange(count: int) -> None:
        for _ in range(count):
            if sequence_parallel:
                dist.all_gather_into_tensor(full, part, group=group)
                dist.reduce_scatter_tensor(part, full, group=group)
            else:
                dist.all_reduce(full, group=group)

    return exchange


def maybe_load(args) -> Optional[ComputeTimes]:
    path = getattr(args, "emulated_compute_times", None)
    return load_compute_times(path) if path else None
