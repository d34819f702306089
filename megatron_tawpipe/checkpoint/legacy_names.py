"""Megatron-LM's older model (``megatron.legacy.model``, ``language_model.*``) under megatron-core's names.

What Megatron-LM's ``tools/checkpoint/convert.py`` writes with its default saver (``--saver megatron``, i.e.
``legacy``): each stage's ``model`` entry is the older GPT model's ``state_dict_for_save_checkpoint()``, nested
dicts::

    language_model.embedding.word_embeddings.weight          -> embedding.word_embeddings.weight
    language_model.embedding.position_embeddings.weight      -> embedding.position_embeddings.weight
    language_model.encoder.layers.N.input_norm.*             -> decoder.layers.N.input_layernorm.*
    language_model.encoder.layers.N.self_attention.query_key_value.*  -> ...self_attention.linear_qkv.*
    language_model.encoder.layers.N.self_attention.dense.*   -> ...self_attention.linear_proj.*
    language_model.encoder.layers.N.post_attention_norm.*    -> decoder.layers.N.pre_mlp_layernorm.*
    language_model.encoder.layers.N.mlp.dense_h_to_4h.*      -> ...mlp.linear_fc1.*
    language_model.encoder.layers.N.mlp.dense_4h_to_h.*      -> ...mlp.linear_fc2.*
    language_model.encoder.final_norm.*                      -> decoder.final_layernorm.*
    language_model.output_layer.weight                       -> output_layer.weight
    word_embeddings_for_head.weight (a later stage's tied copy) -> output_layer.weight

(and the still older ``input_layernorm`` / ``post_attention_layernorm`` / ``final_layernorm`` spellings). The
mapping is exact: the older model's fused QKV rows are grouped per query group (the group's query heads, then
its key and value head) as megatron-core's ``linear_qkv`` rows, its SwiGLU ``dense_h_to_4h`` holds [gate; up]
per tensor-parallel rank as ``linear_fc1`` does, and the layers are numbered within each stage the same way.
What has no exact counterpart (Transformer Engine's fused layer names from ``--saver-transformer-impl
transformer_engine``, BERT's heads, checkpoints before version 3.0 with another QKV row order, a residual taken
after the layer norm) is refused naming the converter's ``--saver core``, which writes megatron-core's names.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

from megatron_tawpipe.common.errors import CheckpointSetupError

CORE_SAVER = ("convert it with Megatron-LM's tools/checkpoint/convert.py --saver core (megatron-core's names; "
              "or tools/hf_checkpoint.py import from Hugging Face weights)")
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = (("input_norm.", "input_layernorm."), ("input_layernorm.", "input_layernorm."),
                ("self_attention.query_key_value.", "self_attention.linear_qkv."),
                ("self_attention.dense.", "self_attention.linear_proj."),
                ("post_attention_norm.", "pre_mlp_layernorm."), ("post_attention_layernorm.", "pre_mlp_layernorm."),
                ("mlp.dense_h_to_4h.", "mlp.linear_fc1."), ("mlp.dense_4h_to_h.", "mlp.linear_fc2."))
_WHOLE = {"language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
          "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
          "language_model.output_layer.weight": "output_layer.weight",
          "word_embeddings_for_head.weight": "output_layer.weight"}
_FINAL_NORMS = ("language_model.encoder.final_norm.", "language_model.encoder.final_layernorm.")


def is_legacy_model(state: dict) -> bool:
    """Whether a stage's ``model`` entry is Megatron-LM's older model (``language_model``)."""
    return any(key == "language_model" or key.startswith("language_model.") for key in state)


def _flatten(tree: dict, prefix: str = "") -> Dict[str, object]:
    flat: Dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def core_name(name: str) -> Optional[str]:
    """megatron-core's name of an older-model parameter, None where there is no exact one."""
    if name in _WHOLE:
        return _WHOLE[name]
    for prefix in _FINAL_NORMS:
        if name.startswith(prefix) and name[len(prefix):] in ("weight", "bias"):
            return "decoder.final_layernorm." + name[len(prefix):]
    match = _LAYER.match(name)
    if match:
        rest = match.group(2)
        for old, new in _LAYER_PARTS:
            if rest.startswith(old) and rest[len(old):] in ("weight", "bias"):
                return f"decoder.layers.{match.group(1)}.{new}{rest[len(old):]}"
    return None


def check_legacy_args(saved_args, checkpoint_version, where: str) -> None:
    """Refuse an older-model checkpoint whose weights megatron-core's layer would not read the same way."""
    if checkpoint_version is not None and float(checkpoint_version) < 3.0:
        raise CheckpointSetupError(f"{where}: checkpoint_version {checkpoint_version} of Megatron-LM's older model "
                                   "orders its query_key_value rows differently from megatron-core; " + CORE_SAVER)
    if getattr(saved_args, "apply_residual_connection_post_layernorm", False):
        raise CheckpointSetupError(f"{where}: Megatron-LM's older model with "
                                   "--apply-residual-connection-post-layernorm has no megatron-core layer here; "
                                   + CORE_SAVER)


def core_state(state: dict, where: str) -> Dict[str, torch.Tensor]:
    """A stage's older-model ``model`` entry as megatron-core's flat state dict (tensors only; the rotary
    frequencies, derived from --rotary-base, and extra states are left out). Raises CheckpointSetupError
    naming ``--saver core`` for a name without an exact counterpart."""
    result: Dict[str, torch.Tensor] = {}
    for name, value in _flatten(state).items():
        if not isinstance(value, torch.Tensor) or name.endswith(("_extra_state", "inv_freq")):
            continue
        core = core_name(name)
        if core is None:
            raise CheckpointSetupError(f"{where}: {name} of Megatron-LM's older model (language_model.*) has no "
                                       "exact megatron-core counterpart here; " + CORE_SAVER)
        result[core] = value
    return result
