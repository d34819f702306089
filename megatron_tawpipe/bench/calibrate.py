"""Per-layer compute times for the simulator and the emulated-compute mode.

Two sources, one JSON (the keys ``ComputeTimes`` reads)::

    {"layer_forward": s, "layer_backward": s, "layer_recompute": s,
     "head_forward": s, "head_backward": s, "device": ..., "source": ...}

* ``measure_compute_times(args)``: times the megatron-core Llama model of the
  pretraining flags on this process's device (a GPU when there is one, with TE's
  attention when TE is installed, else the SDPA core attention; the CPU
  otherwise). A layer's time is the difference between models of
  ``k + 4`` and ``k`` layers divided by 4, so that the embedding, final norm,
  output layer and loss (the "head") fall out; the head is what remains of
  the ``k``-layer model. Forward is timed without autograd (what a shard's
  forward costs when backward recomputes it), recompute is the forward with
  autograd, backward is the backward pass alone. Each figure is the fastest
  of ``repeats`` runs: other processes (or other ranks on a shared CPU) only
  ever add time, and the emulation wants the device's own speed. On a GPU each
  run is timed with CUDA events recorded on the current stream around it
  (kernels are asynchronous: a host clock would measure their launch); on the
  CPU with the host's monotonic clock (``time.perf_counter``).
* ``cost_model_times(...)``: the simulator's FLOP model at a given peak and
  efficiency (``CostModel.from_flops``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional

import torch

from megatron_tawpipe.emulation.compute import TIME_KEYS
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.common.atomic import atomic_write_json


def uses_cuda_events(device: torch.device) -> bool:
    """Whether compute on ``device`` is timed with CUDA events (else with the host clock)."""
    return torch.device(device).type == "cuda"


def time_once(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds that ``fn``'s work takes on ``device``.

    CUDA: events recorded on the current stream before and after ``fn``, then
    the end event is waited for, so the figure is the GPU's time for the
    queued kernels (work queued earlier is drained first, so it does not
    count). CPU: ``time.perf_counter`` around the call.
    """
    if uses_cuda_events(device):
        torch.cuda.current_stream(device).synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def fastest_time(fn: Callable[[], None], repeats: int, warmup: int, device: torch.device,
                 prepare: Optional[Callable[[], None]] = None) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones.

    ``prepare`` (untimed) runs before every call, e.g. the forward whose backward is timed.
    """
    times: List[float] = []
    for i in range(warmup + repeats):
        if prepare is not None:
            prepare()
        if i < warmup:
            fn()
            continue
        times.append(time_once(fn, device))
    return min(times)


def timer_name(device: torch.device) -> str:
    return "CUDA events" if uses_cuda_events(device) else "wall clock"


def device_description(device: torch.device) -> str:
    """The device and software a measurement ran on (the ``device`` key of the JSON)."""
    name = torch.cuda.get_device_name(device) if uses_cuda_events(device) else "cpu"
    return f"{name}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_times(result: Dict[str, object], path: str) -> None:
    """Write a times JSON atomically (a reader never sees half a file)."""
    atomic_write_json(path, result, indent=1, newline=True)


def _model_times(args, num_layers: int, repeats: int, warmup: int) -> Dict[str, float]:
    """Forward (no autograd), forward with autograd, and backward of a ``num_layers`` model."""
    import copy

    from megatron_tawpipe.models.llama import build_llama_model, llama_config

    layer_args = copy.copy(args)
    layer_args.num_layers = num_layers
    config = llama_config(layer_args)
    model = build_llama_model(layer_args, config)
    device = next(model.parameters()).device
    batch, seq = args.micro_batch_size, args.seq_length
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab_size or 1000, (batch, seq), generator=generator).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)

    def forward():
        return model(tokens, position_ids, None, labels=labels)

    def forward_no_grad():
        with torch.no_grad():
            forward()

    def forward_grad():
        forward()

    state = {}

    def prepare_backward():
        state["loss"] = forward().float().mean()

    def backward():
        state.pop("loss").backward()
        model.zero_grad(set_to_none=True)

    fwd = fastest_time(forward_no_grad, repeats, warmup, device)
    fwd_grad = fastest_time(forward_grad, repeats, warmup, device)
    bwd = fastest_time(backward, repeats, warmup, device, prepare=prepare_backward)
    return {"forward": fwd, "forward_grad": fwd_grad, "backward": bwd}


def measure_compute_times(args, repeats: int = 5, warmup: int = 2, base_layers: int = 1,
                          extra_layers: int = 4) -> Dict[str, object]:
    """Measure per-layer and head times of the model ``args`` describes (see the module docstring)."""
    from megatron_tawpipe.models.backends import resolve_attention_backend

    small = _model_times(args, base_layers, repeats, warmup)
    large = _model_times(args, base_layers + extra_layers, repeats, warmup)
    per_layer = {k: max(0.0, (large[k] - small[k]) / extra_layers) for k in small}
    head = {k: max(0.0, small[k] - base_layers * per_layer[k]) for k in small}
    device = current_device()
    return {
        "layer_forward": per_layer["forward"],
        "layer_backward": per_layer["backward"],
        "layer_recompute": per_layer["forward_grad"],
        "head_forward": head["forward"],
        "head_backward": head["backward"],
        "device": device_description(device),
        "source": f"measured ({timer_name(device)}): fastest of {repeats} after {warmup} warm-up, "
                  f"{base_layers}- vs {base_layers + extra_layers}-layer model",
        "attention": resolve_attention_backend(args.attention_backend),
        "dtype": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        **model_shape(args),
    }


def cost_model_times(args, peak_tflops: float, efficiency: float) -> Dict[str, object]:
    """The FLOP model's times of the model ``args`` describes (its output layer: the padded vocabulary, as
    measured); recompute is the forward, as measured."""
    from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig
    from megatron_tawpipe.sim.run_cost import cost_model_for_run

    cost = cost_model_for_run(ModelConfig.from_args(args), PrecisionConfig.from_args(args), args.micro_batch_size,
                              recompute=True, peak_tflops=peak_tflops, efficiency=efficiency)
    times = {key: getattr(cost, key) for key in TIME_KEYS}
    return {**times, "device": f"cost model: {peak_tflops:g} TFLOP/s peak x {efficiency:g}",
            "source": "FLOP model (tools/simulate.py's CostModel.from_flops)", **model_shape(args)}


def model_shape(args) -> Dict[str, object]:
    """The model and batch sizes a set of times belongs to (descriptive keys of the JSON)."""
    return {"hidden_size": args.hidden_size, "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "num_attention_heads": args.num_attention_heads,
            "ffn_hidden_size": args.ffn_hidden_size, "vocab_size": args.vocab_size}


def main(argv=None) -> int:
    """``tools/calibrate.py``: the tool's own flags, then pretrain_llama.py's model flags."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="calibrate.py",
        description="Write per-layer forward/backward/recompute times (JSON) for tools/simulate.py "
                    "--measured-times and pretrain_llama.py --emulated-compute-times. Model flags are "
                    "pretrain_llama.py's (--hidden-size, --seq-length, --micro-batch-size, --vocab-size, --bf16, ...).")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--from-cost-model", action="store_true",
                        help="use the simulator's FLOP model instead of measuring on this device")
    parser.add_argument("--peak-tflops", type=float, default=None, help="with --from-cost-model")
    parser.add_argument("--efficiency", type=float, default=0.5, help="with --from-cost-model")
    parser.add_argument("--measure-activations", action="store_true",
                        help="also measure what one decoder layer keeps for its backward on this device "
                             "(layer_activation_bytes: the simulator's memory model reads it from the file)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every time (e.g. to emulate a slower device on a CPU machine's links)")
    tool, rest = parser.parse_known_args(argv)

    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.data import pad_vocab_size

    try:
        args = parse_args(rest + ([] if "--train-iters" in rest else ["--train-iters", "1"]))
    except ArgumentError as exc:
        parser.error(str(exc))
    if not args.vocab_size:
        parser.error("--vocab-size is required (the output layer's size)")
    if tool.from_cost_model and not tool.peak_tflops:
        parser.error("--from-cost-model needs --peak-tflops")
    if tool.from_cost_model and not args.swiglu:
        parser.error("--from-cost-model counts a Llama layer (SwiGLU MLP): pass --swiglu (with the other Llama "
                     "flags), or measure this model without --from-cost-model")
    if tool.repeats < 1 or tool.warmup < 0 or tool.scale <= 0:
        parser.error("--repeats must be >= 1, --warmup >= 0, --scale > 0")
    args.padded_vocab_size = pad_vocab_size(args.vocab_size)
    args.micro_batch_size = args.micro_batch_size or 1

    if tool.from_cost_model:
        result = cost_model_times(args, tool.peak_tflops, tool.efficiency)
    if not tool.from_cost_model or tool.measure_activations:   # measured on this device
        from megatron_tawpipe.bench.activation_bytes import measure_layer_activation_bytes
        from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel

        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("RANK", "0")
        initialize_distributed(args)
        initialize_model_parallel(args)
        try:
            if not tool.from_cost_model:
                result = measure_compute_times(args, tool.repeats, tool.warmup)
            if tool.measure_activations:
                result["layer_activation_bytes"] = measure_layer_activation_bytes(args, current_device())
        finally:
            destroy()
    if tool.scale != 1.0:
        for key in TIME_KEYS:
            result[key] *= tool.scale
        result["comment"] = f"times scaled by {tool.scale:g}"
    write_times(result, tool.output)
    print(json.dumps({k: result[k] for k in TIME_KEYS}), file=sys.stdout)
    return 0
