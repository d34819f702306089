"""Deterministic, partition-independent initialisation of the model's weights.

Initial weights are a pure function of ``(seed, global parameter name)``:
every parameter draws from its own generator. A model therefore starts from
the same weights whether it is built whole, cut into pipeline stages, or
assembled shard by shard by a weight-passing schedule, which is what makes
cross-schedule equivalence and checkpoint exchange possible. The values are
drawn on the host (a CPU generator) and copied to the parameter's device, so a
GPU run starts from the same weights as a CPU run, whichever GPU it runs on.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tawpipe.models.parameters import global_parameter_names, global_shape, tensor_parallel_slice, unwrap_model


def init_std_for(name: str, config: TransformerConfig) -> Optional[float]:
    """Standard deviation for a parameter, or None for norm weights (ones) and biases (zeros).

    Megatron's convention: N(0, std) everywhere, N(0, std / sqrt(2 L)) for the
    two projections that write into the residual stream.
    """
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name.split(".")[-2] or leaf.startswith("layer_norm") or leaf == "bias":
        return None
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_values(shape, std: float, seed: int, name: str) -> torch.Tensor:
    """The whole tensor ``name`` starts from: N(0, ``std``) drawn in fp32 by a CPU generator seeded from
    ``(seed, name)``, on the host whatever device the parameter is on.

    A CUDA generator draws other numbers than the CPU's, and its normal draws depend on the GPU model (the
    kernel's launch shape follows the number of multiprocessors): drawing on the parameter's device would
    start CPU and GPU runs, or runs on different GPUs, from different weights. Drawing here gives every
    machine the same fp32 values (and the same values rounded to bf16 or fp16)."""
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    values = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    return values.normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, seed: int, config: TransformerConfig) -> None:
    """Norm weights 1 (0 when zero-centred), biases 0, weights N(0, std) drawn for the *whole* tensor from a
    seed of the global name (:func:`initial_values`, on the host), so that every partition (pipeline stage,
    tensor-parallel slice) and every device starts equal; this rank's slice is copied to the parameter's
    device and dtype."""
    std = init_std_for(name, config)
    if std is None:
        # Norm weights start at 1, or at 0 when stored zero-centred (--apply-layernorm-1p).
        one = 0.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 1.0
        param.fill_(0.0 if name.endswith("bias") else one)
        return
    values = initial_values(global_shape(param), std, seed, name)
    param.copy_(tensor_parallel_slice(name, values, param, config))


def init_llama_weights(model: torch.nn.Module, seed: int, config: TransformerConfig) -> None:
    for name, param in global_parameter_names(model):
        # A tied output layer on a later pipeline stage starts as a copy of the
        # word embeddings (megatron synchronises them through the embedding group).
        if name == "output_layer.weight" and not getattr(unwrap_model(model), "share_embeddings_and_output_weights", False):
            init_parameter(param, name, seed, config)
        elif name == "output_layer.weight":
            init_parameter(param, "embedding.word_embeddings.weight", seed, config)
        else:
            init_parameter(param, name, seed, config)
