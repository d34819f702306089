"""Hugging Face tensors and megatron-core's, both ways, and the files that hold them (safetensors).

Hugging Face (``LlamaForCausalLM`` and its kin)          megatron-core (this project's global names)
``model.embed_tokens.weight``                            ``embedding.word_embeddings.weight``
``model.layers.N.input_layernorm.weight``                ``decoder.layers.N.input_layernorm.weight``
``model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}``  ``decoder.layers.N.self_attention.linear_qkv.*``
``model.layers.N.self_attn.o_proj.weight``               ``decoder.layers.N.self_attention.linear_proj.weight``
``model.layers.N.self_attn.{q,k}_norm.weight``           ``decoder.layers.N.self_attention.{q,k}_layernorm.weight``
``model.layers.N.post_attention_layernorm.weight``       ``decoder.layers.N.pre_mlp_layernorm.weight``
``model.layers.N.mlp.{gate,up}_proj.weight``             ``decoder.layers.N.mlp.linear_fc1.weight`` ([gate; up])
``model.layers.N.mlp.down_proj.weight``                  ``decoder.layers.N.mlp.linear_fc2.weight``
``model.norm.weight``                                    ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied)                              ``output_layer.weight``

megatron-core's fused QKV rows are grouped per key/value group: the group's query heads, then its key head,
then its value head (each ``kv_channels`` rows). Both sides rotate the two halves of each head
(``rotate_half``; megatron-core's default, not interleaved), so no row is permuted.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Tuple

import torch

from megatron_tawpipe.checkpoint.hf_config import ModelShape
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError

_LAYER_PAIRS = (("input_layernorm.weight", "input_layernorm.weight"),
                ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
                ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                ("mlp.down_proj.weight", "mlp.linear_fc2.weight"))
# Transformer Engine's spelling of the layer norms (torch_dist checkpoints) -> megatron-core's local layer's.
_TE_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
             ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointSetupError("Hugging Face weights are read and written with the safetensors package: "
                                   "pip install safetensors (or megatron_tawpipe[hf])") from None
    return safetensors


class HfTensors:
    """The tensors of a Hugging Face model directory, read one at a time (``model.safetensors``, its sharded
    index, or ``pytorch_model.bin`` files)."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self.files: Dict[str, str] = {}
        self._open: Dict[str, object] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(hf_dir, index)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    weight_map = json.load(handle)["weight_map"]
                self.files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                path = os.path.join(hf_dir, single)
                if os.path.isfile(path):
                    self.files = {name: path for name in self._names_in(path)}
                    break
        if not self.files:
            raise CheckpointSetupError(f"{hf_dir}: no Hugging Face weights (model.safetensors, "
                                       "model.safetensors.index.json or pytorch_model.bin)")

    def _names_in(self, path: str) -> List[str]:
        return list(self._handle(path).keys())

    def _handle(self, path: str):
        if path not in self._open:
            if path.endswith(".safetensors"):
                self._open[path] = _safetensors().safe_open(path, framework="pt")
            else:
                self._open[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._open[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"{self.hf_dir}: tensor {name} is missing from the Hugging Face weights")
        handle = self._handle(self.files[name])
        return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]

    def names(self) -> List[str]:
        return sorted(self.files)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` rows (weight or bias) from Hugging Face's q, k and v projections."""
    groups, dim = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * dim, *rest), k.reshape(groups, dim, *rest),
                       v.reshape(groups, dim, *rest)], dim=1)
    return fused.reshape(groups * (per_group + 2) * dim, *rest)


def split_qkv(fused: torch.Tensor, shape: ModelShape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's q, k and v projections from megatron-core's ``linear_qkv`` rows."""
    groups, dim = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per_group + 2) * dim, *rest).split([per_group * dim, dim, dim], dim=1)
    return (q.reshape(groups * per_group * dim, *rest), k.reshape(groups * dim, *rest), v.reshape(groups * dim, *rest))


def _layer_pairs(shape: ModelShape):
    return [(hf, core) for hf, core in _LAYER_PAIRS if shape.qk_layernorm or "_norm." not in hf]


def hf_to_core(source: HfTensors, shape: ModelShape) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every megatron-core tensor of the model, one at a time, from the Hugging Face tensors."""
    yield "embedding.word_embeddings.weight", source.get("model.embed_tokens.weight")
    for i in range(shape.num_layers):
        hf, core = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, core_name in _layer_pairs(shape):
            yield core + core_name, source.get(hf + hf_name)
        attn = hf + "self_attn."
        yield core + "self_attention.linear_qkv.weight", fuse_qkv(
            *(source.get(f"{attn}{p}_proj.weight") for p in "qkv"), shape)
        if shape.qkv_bias:
            yield core + "self_attention.linear_qkv.bias", fuse_qkv(
                *(source.get(f"{attn}{p}_proj.bias") for p in "qkv"), shape)
        yield core + "mlp.linear_fc1.weight", torch.cat(
            [source.get(hf + "mlp.gate_proj.weight"), source.get(hf + "mlp.up_proj.weight")], dim=0)
    yield "decoder.final_layernorm.weight", source.get("model.norm.weight")
    if not shape.tied:
        yield "output_layer.weight", source.get("lm_head.weight")


def local_spelling(name: str) -> str:
    """A parameter name with its layer norm under megatron-core's local layer's name."""
    for fused, local in _TE_NORMS:
        name = name.replace(fused, local)
    return name


def core_to_hf(params: Dict[str, torch.Tensor], shape: ModelShape,
               one_plus: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every Hugging Face tensor from megatron-core's (whole tensors under either norm spelling). With
    ``one_plus`` (--apply-layernorm-1p: zero-centred norm weights) the norms' weights are stored plus one."""
    params = {local_spelling(name): value for name, value in params.items()}

    def get(name: str) -> torch.Tensor:
        if name not in params:
            raise CheckpointError(f"the checkpoint has no {name}")
        value = params[name]
        return value + 1.0 if one_plus and name.endswith("layernorm.weight") else value

    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in range(shape.num_layers):
        hf, core = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, core_name in _layer_pairs(shape):
            yield hf + hf_name, get(core + core_name)
        for p, tensor in zip("qkv", split_qkv(get(core + "self_attention.linear_qkv.weight"), shape)):
            yield f"{hf}self_attn.{p}_proj.weight", tensor
        if shape.qkv_bias:
            for p, tensor in zip("qkv", split_qkv(get(core + "self_attention.linear_qkv.bias"), shape)):
                yield f"{hf}self_attn.{p}_proj.bias", tensor
        gate, up = get(core + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield hf + "mlp.gate_proj.weight", gate
        yield hf + "mlp.up_proj.weight", up
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not shape.tied:
        yield "lm_head.weight", get("output_layer.weight")


def write_safetensors(tensors: Iterator[Tuple[str, torch.Tensor]], hf_dir: str, dtype: torch.dtype,
                      max_shard_bytes: int) -> List[str]:
    """Hugging Face's files: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``; returns the files written."""
    save_file = _safetensors().torch.save_file
    shards: List[Dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in tensors:
        tensor = tensor.detach().to(dtype).contiguous().clone()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + size > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += size
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(hf_dir, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor in shard}}
        with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)
        names.append("model.safetensors.index.json")
    return names
