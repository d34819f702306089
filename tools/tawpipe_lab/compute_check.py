"""Weight-passing compute against native megatron-core on the same decoder layers (``gpu_check --checks compute``).

Does the weight-passing runtime compute as fast as megatron-core does on the same layers? Both sides get
the same Llama decoder layers (the flags' layer spec, attention backend and dtype), the same weights, the
same input hidden states of one micro-batch and the same output gradient, as a middle shard / middle
pipeline stage sees them (no embedding, no head):

* **weight-passing**: the runtime's shard template bound to a flat compute-dtype weight buffer as the
  plan executor delivers one, run as :class:`megatron_tawpipe.runtime.layer_compute.LayerCompute` runs a
  middle shard's (micro-batch, shard) actions: without recompute (``--tawpipe-no-recompute``) the
  forward copies the weights into the template's slot (``bind_by_copy``) and keeps its graph, the backward
  copies them again, back-propagates and adds the layer gradients into the shard's gradient buffer
  (``layer_grads_into``; fp32, or ``--main-grads-dtype``); with recompute (TawPipe's default) the forward
  runs without autograd on the bound buffer (``bind``) and the backward recomputes it with autograd first.
* **native**: megatron-core's ``GPTModel`` of a middle pipeline stage (``pre_process=False``,
  ``post_process=False``: its ``TransformerBlock`` of the same layers, no final norm), built as the native
  trainer builds its model (``main_grad`` buffers, so CUDA's fused gradient accumulation where it can
  run), cast to the compute dtype as ``Float16Module`` does and wrapped in megatron-core's
  ``DistributedDataParallel``, whose hooks add the gradients into its fp32 ``main_grad`` buffer; the input
  enters through ``set_input_tensor`` as a pipeline stage's does.

One call of each is a forward plus a backward of one micro-batch; the calls are interleaved, ``warmup``
untimed rounds, then ``repeats`` timed ones (CUDA events on a GPU, the wall clock on the CPU:
:func:`calibrate.time_once`). Tokens/s is ``seq_length x micro_batch_size`` over the fastest call; the
ratio is weight-passing (without recompute: the same work as native) over native. Before timing, one
call of each from zeroed gradients is compared: the output, the input gradient and every weight
gradient of each weight-passing path against native, as the largest difference relative to native's
largest value, must stay within a tolerance derived from the dtype (:func:`default_tolerance`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from megatron_tawpipe.bench.calibrate import time_once, timer_name
from tawpipe_lab.layer_specs import copy_layer_weights, relative_difference

PATHS = ("weight_passing", "weight_passing_recompute", "native")
LABELS = {"weight_passing": "weight-passing", "weight_passing_recompute": "weight-passing with recompute",
          "native": "native megatron-core"}


def default_tolerance(dtype: torch.dtype) -> float:
    """Two units of the dtype's last place (bf16 1.6e-2, fp16 2.0e-3), at least 1e-4 (fp32: sums over
    ``seq x batch`` products ordered differently by other GEMM algorithms)."""
    return max(2 * torch.finfo(dtype).eps, 1e-4)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


@dataclass
class ComputeComparison:
    layers: int
    tokens: int                       # per forward + backward: seq_length x micro_batch_size
    dtype: str
    attention: str
    timer: str
    tolerance: float
    seconds: Dict[str, List[float]]   # path -> timed forward + backward calls
    differences: Dict[str, Dict[str, float]] = field(default_factory=dict)  # weight-passing path -> figures

    def tokens_per_s(self, path: str) -> float:
        return self.tokens / min(self.seconds[path])

    @property
    def ratio(self) -> float:
        """Weight-passing tokens/s over native tokens/s (the same work: no recompute on either side)."""
        return self.tokens_per_s("weight_passing") / self.tokens_per_s("native")

    @property
    def recompute_ratio(self) -> float:
        return self.tokens_per_s("weight_passing_recompute") / self.tokens_per_s("native")

    def worst(self, path: str) -> float:
        return max(self.differences[path].values())

    @property
    def passed(self) -> bool:
        # Written so that a NaN difference fails.
        return all(self.worst(path) <= self.tolerance for path in self.differences)

    def summary(self) -> str:
        same = self.differences["weight_passing"]
        return (f"{self.layers} layers, {self.tokens} tokens, {self.dtype}, {self.attention}, {self.timer}: "
                f"weight-passing {self.tokens_per_s('weight_passing'):.0f} tokens/s, native "
                f"{self.tokens_per_s('native'):.0f} tokens/s, ratio {self.ratio:.3f}; with recompute "
                f"{self.tokens_per_s('weight_passing_recompute'):.0f} tokens/s ({self.recompute_ratio:.3f}); "
                f"vs native: output {same['output']:.1e}, input grad {same['input_grad']:.1e}, weight grads "
                f"<= {same['weight_grads']:.1e} (recompute path <= {self.worst('weight_passing_recompute'):.1e}); "
                f"tolerance {self.tolerance:.1e}")

    def to_json(self) -> dict:
        return {"layers": self.layers, "tokens": self.tokens, "dtype": self.dtype, "attention": self.attention,
                "timer": self.timer, "tolerance": self.tolerance, "passed": self.passed,
                "tokens_per_s": {path: self.tokens_per_s(path) for path in PATHS},
                "ratio": self.ratio, "recompute_ratio": self.recompute_ratio,
                "fastest_s": {path: min(self.seconds[path]) for path in PATHS},
                "median_s": {path: statistics.median(self.seconds[path]) for path in PATHS},
                "seconds": {path: list(self.seconds[path]) for path in PATHS},
                "differences": {path: dict(figures) for path, figures in self.differences.items()}}


class WeightPassingLayers:
    """A middle shard of ``layers`` layers as the runtime runs it, on shard 0's initial weights."""

    def __init__(self, args, layers: int, device: torch.device):
        from megatron_tawpipe.optimizer.precision_aware import OptimizerDtypes
        from megatron_tawpipe.runtime.shard_model import bound_shard_template

        self.template, self.weights = bound_shard_template(args, layers, device)   # the executor's buffer
        self.grad_buffer = torch.zeros(self.template.shard_numel, dtype=OptimizerDtypes.from_args(args).main_grads,
                                       device=device)
        self.rotary = self.template.rotary(args.seq_length)

    def step(self, hidden: torch.Tensor, grad_out: torch.Tensor, recompute: bool):
        """One micro-batch's forward and backward; returns (output, input gradient)."""
        template = self.template
        if recompute:
            layers = template.bind(self.weights)
            with torch.no_grad():
                out = template.run_layers(hidden, self.rotary, None, layers)
            template.bind(self.weights)
            with torch.enable_grad():
                x = hidden.detach().requires_grad_(True)
                root = template.run_layers(x, self.rotary, None, layers)
        else:
            layers = template.bind_by_copy(self.weights)
            with torch.enable_grad():
                x = hidden.detach().requires_grad_(True)
                out = root = template.run_layers(x, self.rotary, None, layers)
            template.bind_by_copy(self.weights)
        root.backward(grad_out)
        template.layer_grads_into(self.grad_buffer)
        return out, x.grad

    def weight_grads(self) -> Dict[str, torch.Tensor]:
        """The gradient buffer's views under the layers' parameter names (``0.mlp.linear_fc1.weight``)."""
        views = self.template.views(self.grad_buffer)
        return {slot.local_name: view for slot, view in zip(self.template.slots, views)}


class NativeLayers:
    """The same layers as a middle pipeline stage of native megatron-core."""

    def __init__(self, args, device: torch.device):
        from megatron.core.distributed import DistributedDataParallel

        from megatron_tawpipe.arguments.run_config import OptimizerSettings, PrecisionConfig
        from megatron_tawpipe.baselines.native import ddp_config
        from megatron_tawpipe.models.llama import construct_llama_model, llama_config, params_dtype

        config = llama_config(args, main_grad_buffers=True)
        self.gpt = construct_llama_model(args, config, pre_process=False, post_process=False).to(device)
        self.gpt.to(params_dtype(args))   # as Float16Module does
        self.gpt.train(True)
        ddp = ddp_config(OptimizerSettings.from_args(args), PrecisionConfig.from_args(args), interleaved=False)
        self.ddp = DistributedDataParallel(config, ddp, self.gpt)

    def step(self, hidden: torch.Tensor, grad_out: torch.Tensor):
        x = hidden.detach().requires_grad_(True)
        self.gpt.set_input_tensor(x)
        out = self.ddp(None, None, None)
        out.backward(grad_out)
        return out, x.grad

    def weight_grads(self) -> Dict[str, torch.Tensor]:
        return {name: param.main_grad for name, param in self.gpt.decoder.layers.named_parameters()}


def load_native_weights(ours: WeightPassingLayers, native: NativeLayers) -> int:
    """Copy the weight-passing shard's weights into the native layers by name; returns the count."""
    return copy_layer_weights(ours.template.model, native.gpt)


def _differences(ours, theirs) -> Dict[str, float]:
    """Output, input gradient and worst weight gradient of ``ours`` relative to ``theirs``
    (``(output, input grad, {name: weight grad})`` each)."""
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = ours, theirs
    if set(grads) != set(ref_grads):
        raise ValueError(f"the two sides' layers differ in their parameters: {sorted(set(grads) ^ set(ref_grads))}")
    return {"output": relative_difference(out, ref_out), "input_grad": relative_difference(dx, ref_dx),
            "weight_grads": max(relative_difference(grads[name], ref_grads[name]) for name in ref_grads)}


def _inputs(args, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(args.seed + 7)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    hidden = torch.randn(shape, generator=generator).to(device, dtype)
    grad_out = (torch.randn(shape, generator=generator) * 1e-2).to(device, dtype)
    return hidden, grad_out


def compare_compute(args, layers: int, device: torch.device, repeats: int, warmup: int,
                    tolerance: float) -> ComputeComparison:
    """Weight-passing against native megatron-core on ``layers`` decoder layers (in a process group with
    megatron's parallel state: :func:`one_rank.one_rank_process_group`)."""
    from megatron_tawpipe.models.llama import params_dtype, resolve_attention_backend

    if args.hidden_dropout > 0 or args.attention_dropout > 0:
        raise ValueError("the compute check compares outputs: it needs --hidden-dropout 0 --attention-dropout 0")
    dtype = params_dtype(args)
    ours = WeightPassingLayers(args, layers, device)
    native = NativeLayers(args, device)
    load_native_weights(ours, native)
    hidden, grad_out = _inputs(args, device, dtype)

    def snapshot(step: Callable, side) -> tuple:
        out, dx = step()
        grads = {name: grad.detach().clone() for name, grad in side.weight_grads().items()}
        return out.detach().clone(), dx.detach().clone(), grads

    native.ddp.zero_grad_buffer()
    reference = snapshot(lambda: native.step(hidden, grad_out), native)
    differences = {}
    for path, recompute in (("weight_passing", False), ("weight_passing_recompute", True)):
        ours.grad_buffer.zero_()
        differences[path] = _differences(snapshot(lambda: ours.step(hidden, grad_out, recompute), ours), reference)
    del reference

    calls = {"weight_passing": lambda: ours.step(hidden, grad_out, False),
             "weight_passing_recompute": lambda: ours.step(hidden, grad_out, True),
             "native": lambda: native.step(hidden, grad_out)}
    seconds: Dict[str, List[float]] = {path: [] for path in PATHS}
    for round_ in range(warmup + repeats):
        for path in PATHS:
            if round_ < warmup:
                calls[path]()
            else:
                seconds[path].append(time_once(calls[path], device))
    ours.template.unbind()
    return ComputeComparison(layers=layers, tokens=args.seq_length * args.micro_batch_size, dtype=dtype_name(dtype),
                             attention=resolve_attention_backend(args.attention_backend, args),
                             timer=timer_name(device), tolerance=tolerance, seconds=seconds,
                             differences=differences)
