"""Two decoder-layer specs on the same weights: do they compute the same thing?

The Transformer Engine spec fuses each RMSNorm into the linear layer after it,
so two parameters have other names than in megatron-core's local spec:

=====================================================  ===============================
TE spec                                                local spec
=====================================================  ===============================
``self_attention.linear_qkv.layer_norm_weight``        ``input_layernorm.weight``
``mlp.linear_fc1.layer_norm_weight``                   ``pre_mlp_layernorm.weight``
=====================================================  ===============================

Every other decoder-layer parameter has the same name and shape in both. A
comparison builds the Llama model under both specs, initialises the reference
one (norm weights are scaled away from 1 so that swapping the two norms would
show), copies every decoder-layer weight into the candidate by name, runs the
same input through the decoder layers of each, back-propagates the same output
gradient, and reports the largest relative difference (max abs difference over
the reference's max abs value) of the output, of the input gradient and of
every weight gradient.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

# (suffix in the TE spec, suffix in the local spec)
TE_TO_LOCAL_NAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)

# Default tolerances on the relative difference, by compute dtype: the two specs
# round differently (fused kernels, other GEMM and attention algorithms).
DEFAULT_TOLERANCE = {"bf16": 3e-2, "fp32": 2e-3}


def transformer_engine_unavailable_reason() -> Optional[str]:
    """None when Transformer Engine imports, else why not (one line)."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError:
        return "Transformer Engine not installed"
    except Exception as exc:  # installed, but built for another torch / CUDA
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"Transformer Engine does not import ({first})"
    return None


def canonical_layer_name(name: str) -> str:
    """A decoder-layer parameter's name as the local spec calls it."""
    for te_suffix, local_suffix in TE_TO_LOCAL_NAMES:
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def layer_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Decoder-layer parameters under their local-spec names (``0.self_attention...``)."""
    return {canonical_layer_name(name): param for name, param in model.decoder.layers.named_parameters()}


def copy_layer_weights(source: torch.nn.Module, target: torch.nn.Module) -> int:
    """Copy every decoder-layer weight of ``source`` into ``target`` by name; return the count.

    Raises ValueError naming the parameters that only one side has or whose shapes differ.
    """
    src, dst = layer_parameters(source), layer_parameters(target)
    if set(src) != set(dst):
        only_src, only_dst = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
        raise ValueError(f"decoder-layer parameters differ between the specs: only in the reference "
                         f"{only_src}, only in the candidate {only_dst}")
    with torch.no_grad():
        for name, param in src.items():
            if dst[name].shape != param.shape:
                raise ValueError(f"{name}: shape {tuple(dst[name].shape)} in the candidate, "
                                 f"{tuple(param.shape)} in the reference")
            dst[name].copy_(param)
    return len(src)


def relative_difference(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """max |candidate - reference| / max |reference| (in fp32)."""
    candidate, reference = candidate.float(), reference.float()
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    diff = float((candidate - reference).abs().max()) if reference.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass
class SpecComparison:
    reference: str
    candidate: str
    dtype: str
    tolerance: float
    output: float
    input_grad: float
    weight_grads: Dict[str, float] = field(default_factory=dict)

    @property
    def worst_weight_grad(self) -> Tuple[str, float]:
        name = max(self.weight_grads, key=self.weight_grads.get)
        return name, self.weight_grads[name]

    @property
    def passed(self) -> bool:
        return max(self.output, self.input_grad, self.worst_weight_grad[1]) <= self.tolerance

    def summary(self) -> str:
        name, worst = self.worst_weight_grad
        return (f"{self.dtype}: output {self.output:.1e}, input grad {self.input_grad:.1e}, "
                f"weight grads <= {worst:.1e} ({name}); tolerance {self.tolerance:.0e}")

    def to_json(self) -> dict:
        return {"reference": self.reference, "candidate": self.candidate, "dtype": self.dtype,
                "tolerance": self.tolerance, "passed": self.passed, "output": self.output,
                "input_grad": self.input_grad, "weight_grads": dict(self.weight_grads)}


def _build(args, attention_backend: str, device: torch.device) -> torch.nn.Module:
    from megatron_tawpipe.models.llama import construct_llama_model, llama_config

    spec_args = copy.copy(args)
    spec_args.attention_backend = attention_backend
    model = construct_llama_model(spec_args, llama_config(spec_args)).to(device)
    model.train()
    return model


def _initialise_reference(model: torch.nn.Module, args, seed: int) -> None:
    """Megatron-style initial weights, with norm weights moved away from 1."""
    from megatron_tawpipe.models.initialization import init_llama_weights
    from megatron_tawpipe.models.llama import llama_config

    init_llama_weights(model, seed, llama_config(args))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in layer_parameters(model).items():
            if "layernorm" in name:
                scale = 1.0 + 0.2 * torch.randn(param.shape, generator=generator)
                param.mul_(scale.to(param.device, param.dtype))


def _run_layers(model: torch.nn.Module, hidden: torch.Tensor, grad_output: torch.Tensor):
    """Forward through the decoder layers and back; output, input gradient and weight gradients."""
    rotary = model.rotary_pos_emb(hidden.shape[0])
    model.zero_grad(set_to_none=True)
    x = hidden.detach().clone().requires_grad_(True)
    out = x
    for layer in model.decoder.layers:
        out, _ = layer(hidden_states=out, attention_mask=None, rotary_pos_emb=rotary)
    out.backward(grad_output)
    grads = {name: param.grad.detach().clone() for name, param in layer_parameters(model).items()
             if param.grad is not None}
    return out.detach(), x.grad.detach(), grads


def compare_layer_specs(args, reference_backend: str, candidate_backend: str, device: torch.device,
                        tolerance: float, seed: int = 1234) -> SpecComparison:
    """Compare the decoder layers of two ``--attention-backend`` specs on the same weights.

    ``args`` are parsed pretraining flags (``--bf16`` or not decides the dtype);
    ``"te"`` is Transformer Engine's spec, ``"sdpa"`` / ``"local"`` the local spec.
    """
    reference = _build(args, reference_backend, device)
    candidate = _build(args, candidate_backend, device)
    _initialise_reference(reference, args, seed)
    copy_layer_weights(reference, candidate)
    dtype = next(reference.parameters()).dtype
    generator = torch.Generator().manual_seed(seed + 2)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    hidden = torch.randn(shape, generator=generator).to(device, dtype)
    grad_output = torch.randn(shape, generator=generator).to(device, dtype)
    ref_out, ref_dx, ref_grads = _run_layers(reference, hidden, grad_output)
    cand_out, cand_dx, cand_grads = _run_layers(candidate, hidden, grad_output)
    missing = sorted(set(ref_grads) ^ set(cand_grads))
    if missing:
        raise ValueError(f"only one spec produced gradients for {missing}")
    return SpecComparison(
        reference=reference_backend, candidate=candidate_backend,
        dtype="bf16" if dtype == torch.bfloat16 else "fp16" if dtype == torch.float16 else "fp32",
        tolerance=tolerance, output=relative_difference(cand_out, ref_out),
        input_grad=relative_difference(cand_dx, ref_dx),
        weight_grads={name: relative_difference(cand_grads[name], ref_grads[name]) for name in ref_grads})
