"""Parameters across partitions: global names, whole shapes and tensor-parallel slices.

A pipeline stage numbers its decoder layers from 0 and a tensor-parallel rank holds a slice of
each split weight; these helpers give every parameter the name and the shape it has in the whole
model, and cut a whole tensor into this rank's slice as megatron-core lays it out.
"""

from __future__ import annotations

import re
from typing import Iterator, List, Tuple

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_parameter_names(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` with decoder layers numbered by their global index.

    A pipeline stage numbers its layers from 0; megatron keeps each layer's
    global 1-based ``layer_number``, which we use so that a parameter has the
    same name on every partition of the model.
    """
    module = unwrap_model(model)
    layers = module.decoder.layers if hasattr(module, "decoder") else []
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, param in module.named_parameters():
        match = _LAYER_PREFIX.match(name)
        if match:
            local = int(match.group(1))
            name = f"decoder.layers.{offsets[local]}." + name[match.end():]
        yield name, param


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (they all keep the wrapped model in ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give tensor-parallel weights megatron-core's ``tensor_model_parallel``/``partition_dim`` attributes.

    megatron-core sets them on weights only while initialising them itself, which this project does
    not let it do (``perform_initialization=False``); biases have them already. Column-parallel layers
    and the vocabulary-parallel embedding split their rows (dim 0), row-parallel layers their columns.
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    for module in model.modules():
        mode = getattr(module, "parallel_mode", None)  # Transformer Engine's layers say which they are
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or mode == "column":
            dim = 0
        elif isinstance(module, RowParallelLinear) or mode == "row":
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _tensor_parallel_size(param: torch.Tensor) -> int:
    if not getattr(param, "tensor_model_parallel", False):
        return 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def global_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """The whole parameter's shape: a tensor-parallel slice times the tensor-parallel size along its
    ``partition_dim`` (megatron-core marks its column-, row- and vocabulary-parallel weights)."""
    shape = list(param.shape)
    tp = _tensor_parallel_size(param)
    if tp > 1:
        shape[param.partition_dim] *= tp
    return tuple(shape)


def is_gated_fc1(name: str, config: TransformerConfig) -> bool:
    """Whether ``name`` is a gated MLP's ``linear_fc1`` weight or bias, which stacks [gate; up] and whose
    tensor-parallel slice is [gate slice; up slice]."""
    return bool(config.gated_linear_unit) and name.rsplit(".", 1)[0].endswith("linear_fc1")


def tensor_parallel_slice(name: str, whole: torch.Tensor, param: torch.Tensor,
                          config: TransformerConfig) -> torch.Tensor:
    """This rank's slice of the whole tensor ``whole`` of parameter ``param``, as megatron-core lays it out.

    Query-key-value rows are grouped by query group, so a contiguous split gives each rank its groups;
    a SwiGLU ``linear_fc1`` stacks [gate; up], and each rank holds [gate slice; up slice].
    """
    tp = _tensor_parallel_size(param)
    if tp == 1:
        return whole
    from megatron.core import parallel_state

    rank, dim = parallel_state.get_tensor_model_parallel_rank(), param.partition_dim
    if is_gated_fc1(name, config):
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim)[rank], up.chunk(tp, dim)[rank]], dim=0)
    return whole.chunk(tp, dim)[rank]


def count_parameters(models: List[torch.nn.Module]) -> int:
    return sum(p.numel() for m in models for p in m.parameters())
