"""Hugging Face weights in, Hugging Face weights out, without Megatron-LM's converter.

``import_hf(HF_DIR, OUT_DIR)`` writes what Megatron-LM's ``tools/checkpoint/convert.py --saver core`` writes:
a ``release`` checkpoint in the legacy ``--ckpt-format torch`` layout (``OUT_DIR/release/mp_rank_TT[_PPP]/
model_optim_rng.pt``, the tracker naming ``release``) with megatron-core's names and the model's arguments
(rope base and scaling included), cut for ``target_tp`` x ``target_pp`` ranks (Megatron-LM itself then loads it
at that layout; this project's loader joins the slices and loads it at any layout and under every schedule),
and ``OUT_DIR/model_flags.txt``: the model flags for ``pretrain_llama.py`` on one line.

``export_hf(CKPT, HF_DIR)`` writes a checkpoint of any format (torch_dist, torch, tawpipe) as a Hugging Face
model directory: ``config.json`` and safetensors files (and the tokenizer's files, where the run used a
Hugging Face tokenizer directory). Only ``torch`` and ``safetensors`` are used; ``transformers`` is not needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from typing import Dict, List, Optional

import torch

from megatron_tawpipe.checkpoint.hf_config import (ModelShape, hf_config, model_flags, read_hf_config,
                                                    shape_from_args, vocab_divisor)
from megatron_tawpipe.checkpoint.hf_weights import HfTensors, core_to_hf, hf_to_core, write_safetensors
from megatron_tawpipe.checkpoint.legacy_torch import split_for_rank
from megatron_tawpipe.common.atomic import atomic_torch_save, atomic_write_text, fsync_dir
from megatron_tawpipe.common.errors import CheckpointSetupError

FLAGS_FILE = "model_flags.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tokenizer_size(hf_dir: str) -> Optional[int]:
    """The number of ids of ``tokenizer.json`` (its vocabulary and added tokens), None without one."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        tokenizer = json.load(handle)
    vocab = tokenizer.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [token["id"] for token in tokenizer.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def tokenizer_flags(hf_dir: str, vocab_size: int):
    """``(flags, tokenizer size)``: the directory's Hugging Face tokenizer, or without one Megatron-LM's
    NullTokenizer over the model's vocabulary (its last id the end of document)."""
    if any(os.path.isfile(os.path.join(hf_dir, name)) for name in ("tokenizer.json", "tokenizer.model")):
        return (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.abspath(hf_dir)],
                _tokenizer_size(hf_dir))
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size - 1)], vocab_size


def _saved_args(flags: List[str], shape: ModelShape, tp: int, pp: int) -> argparse.Namespace:
    """The checkpoint's ``args``: the flags as this project (and Megatron-LM) parse them, at the files' layout."""
    from megatron_tawpipe.arguments import parse_args, plain_arguments

    parsed = plain_arguments(parse_args(flags))
    saved = argparse.Namespace(**{key: value for key, value in parsed.items() if not key.startswith("_")})
    saved.padded_vocab_size = shape.vocab_size
    saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size = tp, pp
    saved.virtual_pipeline_model_parallel_size = None
    saved.ckpt_format, saved.iteration, saved.consumed_train_samples, saved.consumed_valid_samples = "torch", 0, 0, 0
    saved.hf_model_type = shape.model_type
    return saved


def _check_layout(shape: ModelShape, tp: int, pp: int) -> None:
    problems = [text for bad, text in (
        (shape.num_query_groups % tp, f"{shape.num_query_groups} key/value heads"),
        (shape.ffn_hidden_size % tp, f"an MLP of {shape.ffn_hidden_size}"),
        (shape.vocab_size % tp, f"a vocabulary of {shape.vocab_size}")) if bad]
    if problems:
        raise CheckpointSetupError(f"--target-tensor-parallel-size {tp} does not divide " + ", ".join(problems))
    if shape.num_layers % pp:
        raise CheckpointSetupError(f"--target-pipeline-parallel-size {pp} does not divide {shape.num_layers} layers")


def import_hf(hf_dir: str, out_dir: str, target_tp: int = 1, target_pp: int = 1, log=print) -> List[str]:
    """Write ``hf_dir``'s model as a release checkpoint under ``out_dir`` and its ``model_flags.txt``;
    returns the flags."""
    shape = read_hf_config(hf_dir)
    _check_layout(shape, target_tp, target_pp)
    tokenizer, tokenizer_size = tokenizer_flags(hf_dir, shape.vocab_size)
    flags = model_flags(shape, tokenizer, vocab_divisor(shape.vocab_size, tokenizer_size))
    source = HfTensors(hf_dir)
    used = set()
    weights: Dict[str, torch.Tensor] = {}
    try:
        for name, tensor in hf_to_core(_Tracked(source, used), shape):
            weights[name] = tensor
    except RuntimeError as exc:    # a reshape that does not fit: the config does not describe these tensors
        raise CheckpointSetupError(f"{hf_dir}: the tensors do not fit config.json's model: {exc}") from None
    if shape.tied and "lm_head.weight" in source:   # some tied models store the copy too: it must be the same
        used.add("lm_head.weight")
        if not torch.equal(source.get("lm_head.weight"), weights["embedding.word_embeddings.weight"]):
            raise CheckpointSetupError(f"{hf_dir}: tie_word_embeddings is true but lm_head.weight differs from "
                                       "model.embed_tokens.weight")
    unused = [name for name in source.names() if name not in used and not name.endswith("rotary_emb.inv_freq")]
    if unused:
        raise CheckpointSetupError(f"{hf_dir}: tensors the model of config.json has no place for: "
                                   f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    root_tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(root_tmp, ignore_errors=True)
    _write_release(weights, _saved_args(flags, shape, target_tp, target_pp), shape, root_tmp, target_tp, target_pp)
    atomic_write_text(os.path.join(root_tmp, FLAGS_FILE), " ".join(shlex.quote(flag) for flag in flags) + "\n")
    atomic_write_text(os.path.join(root_tmp, "latest_checkpointed_iteration.txt"), "release\n")
    fsync_dir(root_tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(root_tmp, out_dir)
    for note in shape.notes:
        log(f"note: {note}")
    log(f"{hf_dir} ({shape.model_type}, {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads / {shape.num_query_groups} key-value heads, vocabulary {shape.vocab_size}, "
        f"rope base {shape.rotary_base:g}) -> {out_dir}/release, {target_tp} x {target_pp} tensor x pipeline ranks")
    log(f"model flags ({os.path.join(out_dir, FLAGS_FILE)}): {' '.join(flags)}")
    return flags


class _Tracked:
    """The source's ``get``, recording each name read."""

    def __init__(self, source: HfTensors, used: set):
        self.source, self.used = source, used

    def get(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.source.get(name)


def _write_release(weights: Dict[str, torch.Tensor], saved: argparse.Namespace, shape: ModelShape, root: str,
                   tp: int, pp: int) -> None:
    per_stage = shape.num_layers // pp
    for stage in range(pp):
        for rank in range(tp):
            model = {}
            for name, whole in weights.items():
                if name.startswith("decoder.layers."):
                    layer, rest = name[len("decoder.layers."):].split(".", 1)
                    if int(layer) // per_stage != stage:
                        continue
                    name = f"decoder.layers.{int(layer) - stage * per_stage}.{rest}"
                elif stage != (0 if name.startswith("embedding.") else pp - 1):
                    continue
                model[name] = split_for_rank(name, whole, rank, tp, swiglu=True)
            if shape.tied and pp > 1 and stage == pp - 1:    # the last stage's copy of the tied embeddings
                model["output_layer.weight"] = split_for_rank(
                    "output_layer.weight", weights["embedding.word_embeddings.weight"], rank, tp, swiglu=True)
            state = {"args": saved, "checkpoint_version": 3.0, "iteration": 0, "model": model,
                     "num_floating_point_operations_so_far": 0}
            rank_dir = os.path.join(root, "release", f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir)
            atomic_torch_save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
            fsync_dir(rank_dir)


def _checkpoint_directory(path: str) -> str:
    from megatron_tawpipe.checkpoint.state import checkpoint_dir, latest_iteration

    if latest_iteration(path) is not None:
        return checkpoint_dir(path)
    return path


def export_hf(checkpoint: str, hf_dir: str, model_type: Optional[str] = None, dtype: Optional[str] = None,
              norm_epsilon: Optional[float] = None, max_shard_bytes: int = 5 * 2 ** 30,
              tokenizer_dir: Optional[str] = None, log=print) -> str:
    """Write the checkpoint ``checkpoint`` (a ``--save`` directory, whose latest checkpoint is taken, or one
    checkpoint's directory) as a Hugging Face model in ``hf_dir``; returns the checkpoint directory read."""
    from megatron_tawpipe.checkpoint import checkpoint_format, read_parameters, saved_run_arguments

    directory = _checkpoint_directory(checkpoint)
    kind = checkpoint_format(directory)
    saved = saved_run_arguments(directory)
    if norm_epsilon is not None:
        saved["norm_epsilon"] = norm_epsilon
    elif "norm_epsilon" not in saved:
        raise CheckpointSetupError(f"{directory}: a --ckpt-format {kind} checkpoint does not record the norm "
                                   "epsilon; give it with --norm-epsilon")
    params = read_parameters(directory)
    shape = shape_from_args(saved, params["embedding.word_embeddings.weight"].shape[0], model_type)
    dtype = dtype or shape.dtype
    if dtype not in DTYPES:
        raise CheckpointSetupError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    os.makedirs(hf_dir, exist_ok=True)
    files = write_safetensors(core_to_hf(params, shape, one_plus=bool(saved.get("apply_layernorm_1p"))),
                              hf_dir, DTYPES[dtype], max_shard_bytes)
    with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(hf_config(shape, dtype), handle, indent=2)
    files.append("config.json")
    source = tokenizer_dir or (saved.get("tokenizer_model") if saved.get("tokenizer_type") == "HuggingFaceTokenizer"
                               else None)
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(hf_dir, name))
                files.append(name)
    log(f"{directory} (--ckpt-format {kind}) -> {hf_dir}: {shape.model_type}, {', '.join(files)}")
    return directory
