"""Per-shard compute times of the weight-passing runtime, written as the calibration JSON.

The runtime runs a shard by binding its weights into a template of
``layers_per_shard`` megatron-core decoder layers (:class:`ShardTemplate`).
This module times exactly those calls on one device:

* forward: ``run_layers`` without autograd (a shard's forward when backward recomputes);
* recompute: ``run_layers`` with autograd (the recompute that starts a backward);
* backward: back-propagation through the recomputed shard plus adding its
  weight gradients into the fp32 gradient buffer (``layer_grads_into``);
* head forward / backward: embedding, final norm, output layer and loss, as in
  ``tools/calibrate.py``.

Each figure is the fastest of ``repeats`` runs after ``warmup``, timed with CUDA
events on a GPU and the wall clock on a CPU (:func:`calibrate.fastest_time`).
Per-layer times are per-shard times over ``layers_per_shard``; the JSON has the
keys ``tools/simulate.py --measured-times`` and ``--emulated-compute-times`` read.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_tawpipe.bench.calibrate import device_description, fastest_time, model_shape, timer_name


def _shard_inputs(args, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(args.seed)
    seq, batch, hidden = args.seq_length, args.micro_batch_size, args.hidden_size
    hidden_in = torch.randn(seq, batch, hidden, generator=generator).to(device, dtype)
    grad_out = (torch.randn(seq, batch, hidden, generator=generator) * 1e-2).to(device, dtype)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=generator).to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    return hidden_in, grad_out, tokens, torch.roll(tokens, -1, dims=1), position_ids


def measure_shard_times(args, layers_per_shard: int, device: torch.device, repeats: int,
                        warmup: int) -> Dict[str, float]:
    """Seconds per shard (``shard_forward``, ``shard_recompute``, ``shard_backward``) and head."""
    from megatron_tawpipe.runtime.shard_model import bound_shard_template

    template, weights = bound_shard_template(args, layers_per_shard, device)
    grad_buffer = torch.zeros(template.shard_numel, dtype=torch.float32, device=device)
    hidden_in, grad_out, tokens, labels, position_ids = _shard_inputs(args, device, weights.dtype)
    rotary = template.rotary(args.seq_length)
    state: dict = {}

    def forward() -> None:
        with torch.no_grad():
            template.run_layers(hidden_in, rotary, None)

    def recompute() -> None:
        state.clear()
        with torch.enable_grad():
            state["out"] = template.run_layers(hidden_in.detach().requires_grad_(True), rotary, None)

    def backward() -> None:
        state.pop("out").backward(grad_out)
        template.layer_grads_into(grad_buffer)

    def head_forward() -> None:
        with torch.no_grad():
            template.head_loss(template.embed(tokens, position_ids), labels)

    def head_prepare() -> None:
        state.clear()
        with torch.enable_grad():
            state["loss"] = template.head_loss(template.embed(tokens, position_ids), labels).float().mean()

    def head_backward() -> None:
        state.pop("loss").backward()
        for _, param in template.replicated_parameters():
            param.grad = None

    return {
        "shard_forward": fastest_time(forward, repeats, warmup, device),
        "shard_recompute": fastest_time(recompute, repeats, warmup, device),
        "shard_backward": fastest_time(backward, repeats, warmup, device, prepare=recompute),
        "head_forward": fastest_time(head_forward, repeats, warmup, device),
        "head_backward": fastest_time(head_backward, repeats, warmup, device, prepare=head_prepare),
    }


def calibration_record(args, shard_times: Dict[str, float], layers_per_shard: int, device: torch.device,
                       repeats: int, warmup: int) -> Dict[str, object]:
    """The calibration JSON (``tools/calibrate.py``'s keys) from per-shard times."""
    from megatron_tawpipe.models.llama import resolve_attention_backend

    return {
        "layer_forward": shard_times["shard_forward"] / layers_per_shard,
        "layer_backward": shard_times["shard_backward"] / layers_per_shard,
        "layer_recompute": shard_times["shard_recompute"] / layers_per_shard,
        "head_forward": shard_times["head_forward"],
        "head_backward": shard_times["head_backward"],
        "device": device_description(device),
        "source": f"tools/gpu_check.py ({timer_name(device)}): one shard of {layers_per_shard} layers through "
                  f"the runtime's shard template, fastest of {repeats} after {warmup} warm-up, divided by "
                  f"{layers_per_shard}; backward includes adding the weight gradients into the fp32 "
                  "gradient buffer; head = embedding + final norm + output layer + loss",
        "attention": resolve_attention_backend(args.attention_backend),
        "dtype": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        **model_shape(args),
    }
