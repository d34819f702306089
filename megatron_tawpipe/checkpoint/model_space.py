"""Megatron-core's model-space keys of a torch_dist checkpoint: parameter names to checkpoint keys, tensors
(whole, one decoder layer of a stacked key, or a tensor-parallel slice) to ShardedTensors, layer extra state.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import torch

from megatron_tawpipe.checkpoint.state import rank, world

CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version for torch_dist checkpoints
RECORD_KEY = "tawpipe"
RNG_KEY = "tawpipe_rng_state"
SAVE_STRATEGY = ("torch_dist", 1)
# How Megatron-LM reads the optimizer part back (it records the same when it saves).
CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                    "singleton_local_shards": False}
MOMENTS = ("exp_avg", "exp_avg_sq")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def layer_keys_map(args) -> Dict[str, str]:
    """The decoder layer spec's renames for checkpoints (megatron-core's local layer stores its norms
    under Transformer Engine's names, ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``)."""
    from megatron_tawpipe.models.llama import llama_layer_spec

    spec = llama_layer_spec(args.attention_backend, args)
    return dict(getattr(spec.submodules, "sharded_state_dict_keys_map", None) or {})


def model_space_key(name: str, keys_map: Dict[str, str]) -> Tuple[str, Optional[int]]:
    """A global parameter name's megatron-core checkpoint key and decoder layer (None outside the decoder):
    ``decoder.layers.5.mlp.linear_fc1.weight`` -> (``decoder.layers.mlp.linear_fc1.weight``, 5)."""
    match = _LAYER.match(name)
    if not match:
        return name, None
    rest = match.group(2)
    for old, new in keys_map.items():  # the first matching prefix, as megatron-core applies them
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return "decoder.layers." + rest, int(match.group(1))


def sharded_tensor(key: str, tensor: torch.Tensor, layer: Optional[int], num_layers: int, replica_id: int = 0,
             fragment: Optional[Tuple[int, int, int]] = None):
    """A whole parameter (one layer's, for a stacked decoder key) as a megatron-core ShardedTensor; with
    ``fragment = (axis, index, count)``, piece ``index`` of ``count`` equal pieces along ``axis`` of it
    (a tensor-parallel slice)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prepend = 0 if layer is None else 1
    offsets = [] if layer is None else [(0, layer, num_layers)]
    if fragment is not None:
        axis, index, count = fragment
        offsets.append((prepend + axis, index, count))
    return ShardedTensor.from_rank_offsets(key, tensor, *offsets, replica_id=replica_id, prepend_axis_num=prepend)


def sharded_pieces(key: str, tensor: torch.Tensor, layer: Optional[int], num_layers: int, fragments, replica_id: int = 0):
    """``tensor`` as ShardedTensors: one for a whole tensor or a plain tensor-parallel slice, one per piece
    where the slice is several pieces of the whole (SwiGLU's [gate; up] rows), keyed by piece."""
    if not fragments:
        return {"": sharded_tensor(key, tensor, layer, num_layers, replica_id)}
    chunks = tensor.chunk(len(fragments), dim=fragments[0][0]) if len(fragments) > 1 else (tensor,)
    return {f"#{i}" if len(fragments) > 1 else "": sharded_tensor(key, chunk, layer, num_layers, replica_id, fragment)
            for i, (chunk, fragment) in enumerate(zip(chunks, fragments))}


def layer_extra_states(layer_module, layer: int, num_layers: int, replica_id: int = 0) -> Dict[str, object]:
    """megatron-core's extra-state objects of decoder layer ``layer`` (Transformer Engine's metadata,
    None for megatron's own layers), read from any module built from the same layer spec."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    local = "decoder.layers.0."
    state = layer_module.sharded_state_dict(local, [(0, layer, num_layers)], None)
    replace_prefix_for_sharding(state, local, "decoder.layers.")
    return {f"{obj.key}@{layer}": replace(obj, replica_id=replica_id)
            for obj in nested_values(state) if isinstance(obj, ShardedObject)}


def rng_object(state):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG_KEY, state, (world(),), (rank(),), replica_id=0)
