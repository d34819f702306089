"""Norms for megatron-core's local layer where its own torch norm falls short: zero-centred weights
(``--apply-layernorm-1p``) and ``--sequence-parallel``.

megatron-core's torch norm (``WrappedTorchNorm``) refuses both; Transformer Engine's norms, and Apex's
LayerNorm on a GPU, do both. :class:`TorchNorm` does them with torch alone, so that these flags also
run on CPUs (and on GPUs without TE or Apex).

Zero-centred gamma (Megatron's "layernorm 1p"): the stored parameter ``weight`` is gamma - 1 and starts
at 0 (:mod:`megatron_tawpipe.models.initialization`); the norm computes ``normalised(x) * (1 + weight)
(+ bias)``. Parameter names and shapes are torch's, which are megatron-core's (``weight``, and ``bias``
for LayerNorm), so checkpoints keep their layout and hold gamma - 1, as Transformer Engine's do. As in
Transformer Engine's kernels, ``1 + weight`` and the normalisation are computed in fp32 and the result
is rounded once to the input's dtype: with bf16 or fp16 weights, adding 1 in the weights' own dtype
would round away the small deviations from 1 that zero-centring keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class _ZeroCentredWeight:
    """Starts ``weight`` (gamma - 1) at zero: gamma = 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            with torch.no_grad():
                self.weight.zero_()


class ZeroCentredLayerNorm(_ZeroCentredWeight, torch.nn.LayerNorm):
    """LayerNorm with ``weight`` = gamma - 1: ``(x - mean) / sqrt(var + eps) * (1 + weight) + bias``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1.0
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(input.float(), self.normalized_shape, weight, bias, self.eps).to(input.dtype)


class ZeroCentredRMSNorm(_ZeroCentredWeight, torch.nn.RMSNorm):
    """RMSNorm with ``weight`` = gamma - 1: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1.0
        return F.rms_norm(input.float(), self.normalized_shape, weight, self.eps).to(input.dtype)


NORMS = {  # --normalization -> (torch's norm, its zero-centred form)
    "LayerNorm": (torch.nn.LayerNorm, ZeroCentredLayerNorm),
    "RMSNorm": (torch.nn.RMSNorm, ZeroCentredRMSNorm),
}


class TorchNorm:
    """torch's LayerNorm or RMSNorm for megatron-core's local layer, zero-centred with
    ``config.layernorm_zero_centered_gamma`` (--apply-layernorm-1p), also under --sequence-parallel.

    Under sequence parallelism a norm sees 1/T of the tokens on each tensor-parallel rank, so its
    weight gradients are partial sums: its parameters are marked ``sequence_parallel``, as
    megatron-core's own norms mark theirs, and the gradients are all-reduced over the
    tensor-parallel group (megatron-core's ``finalize_model_grads`` for the native schedules, the
    weight-passing trainer for its own). Used in place of megatron-core's torch norm, which refuses
    zero-centred weights and sequence parallelism, when either is asked for without Transformer
    Engine or Apex.
    """

    marks_sequence_parallel = True

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        classes = NORMS.get(config.normalization)
        if classes is None:
            raise ValueError(f"--normalization {config.normalization}: LayerNorm or RMSNorm")
        norm_cls = classes[1] if config.layernorm_zero_centered_gamma else classes[0]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel and cls.marks_sequence_parallel)
        return norm


class TorchQKNorm(TorchNorm):
    """:class:`TorchNorm` for the per-head query/key norms: they see every token (attention gathers the
    sequence first), so their gradients are not sequence-parallel partial sums."""

    marks_sequence_parallel = False
