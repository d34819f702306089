"""A Hugging Face model's ``config.json`` as Megatron-LM's model flags, and back.

Llama 2/3/3.1 (grouped-query attention, Llama 3.x rope scaling), Mistral, Qwen 2 (biases on the query, key
and value projections) and Qwen 3 (RMS norms on each head's queries and keys): a decoder of RMSNorm, rotary
positions and a SwiGLU MLP. Either spelling of the rope settings is read: ``rope_theta`` with ``rope_scaling``
(transformers 4) or ``rope_parameters`` (transformers 5); both are written on export.

Rope scaling: ``llama3`` is megatron-core's ``--use-rope-scaling --rope-scaling-factor F``, whose other
parameters are fixed (low/high frequency factors 1 and 4, an original context of 8192 positions, Llama 3.1's
and 3.2's values); ``linear`` is ``--rotary-seq-len-interpolation-factor F`` (an integer, as Megatron-LM's
flag). Anything else is refused naming the setting: it would load into a different model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_tawpipe.common.errors import CheckpointSetupError

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# megatron-core's Llama 3.x rope scaling takes only the factor; the rest is fixed at these values.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class ModelShape:
    """What a checkpoint in either world says about the model."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    tied: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_scaling_factor: Optional[float] = None        # Llama 3.x (megatron-core's --use-rope-scaling)
    interpolation_factor: Optional[int] = None         # linear rope scaling
    attention_dropout: float = 0.0
    dtype: str = "float32"
    notes: List[str] = field(default_factory=list)


def _rope(config: dict, where: str):
    """``(theta, scaling dict or None)`` from either transformers' spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind == "default" else dict(params, rope_type=kind))
    scaling = config.get("rope_scaling")
    if scaling:
        scaling = dict(scaling, rope_type=scaling.get("rope_type", scaling.get("type")))
        if scaling["rope_type"] == "default":
            scaling = None
    return config.get("rope_theta", 10000.0), scaling


def _refuse(where: str, what: str) -> CheckpointSetupError:
    return CheckpointSetupError(f"{where}: {what}")


def read_hf_config(hf_dir: str) -> ModelShape:
    """The model of the Hugging Face directory ``hf_dir`` (its ``config.json``); refuses, naming the setting,
    what this project's models cannot reproduce exactly."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise CheckpointSetupError(f"{path}: cannot read the Hugging Face model's config: {exc}") from None
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise _refuse(path, f"model_type {kind!r}: supported are {', '.join(MODEL_TYPES)}")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(path, f"hidden_act {config.get('hidden_act')!r}: the MLP here is SwiGLU (silu)")
    if config.get("mlp_bias"):
        raise _refuse(path, "mlp_bias true: the MLP's linear layers here have no biases (--disable-bias-linear)")
    if kind in ("llama", "mistral", "qwen3") and config.get("attention_bias"):
        raise _refuse(path, "attention_bias true (biases on q, k, v and o): megatron-core adds the output "
                            "projection's bias only with every linear bias (MLP too); Qwen 2's q/k/v biases are "
                            "--add-qkv-bias")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = _rope(config, path)
    if float(theta) != int(theta):
        raise _refuse(path, f"rope_theta {theta}: Megatron-LM's --rotary-base takes an integer")
    shape = ModelShape(
        model_type=kind, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]), num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads), kv_channels=head_dim,
        vocab_size=int(config["vocab_size"]), max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rotary_base=float(theta),
        tied=bool(config.get("tie_word_embeddings", False)), qkv_bias=kind == "qwen2", qk_layernorm=kind == "qwen3",
        attention_dropout=float(config.get("attention_dropout", 0.0) or 0.0),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    if scaling is not None:
        _read_scaling(shape, scaling, path)
    window = config.get("sliding_window")
    if window and (kind == "mistral" or config.get("use_sliding_window")) and window < shape.max_position_embeddings:
        shape.notes.append(f"sliding_window {window}: attention here is over the whole sequence, the same as the "
                           f"model's for sequences up to {window} tokens")
    return shape


def _read_scaling(shape: ModelShape, scaling: dict, path: str) -> None:
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "llama3":
        differing = [f"{key} {scaling.get(key)} (megatron-core: {value:g})" for key, value in LLAMA3_FIXED.items()
                     if scaling.get(key) is not None and float(scaling[key]) != value]
        if differing:
            raise _refuse(path, "rope_scaling llama3 with " + ", ".join(differing) + ": megatron-core's "
                          "--use-rope-scaling fixes these")
        shape.rope_scaling_factor = factor
    elif kind == "linear":
        if factor != int(factor):
            raise _refuse(path, f"rope_scaling linear factor {factor}: --rotary-seq-len-interpolation-factor takes "
                                "an integer")
        shape.interpolation_factor = int(factor)
    else:
        raise _refuse(path, f"rope_scaling of type {kind!r}: only llama3 (--use-rope-scaling) and linear "
                            "(--rotary-seq-len-interpolation-factor) have megatron-core counterparts")


def _number(value: float) -> str:
    return str(int(value)) if float(value) == int(value) else repr(float(value))


def vocab_divisor(vocab_size: int, tokenizer_size: Optional[int]) -> int:
    """A ``--make-vocab-size-divisible-by`` that pads the tokenizer's size to exactly the model's vocabulary
    (the embedding's rows): the largest power of two up to Megatron-LM's 128 dividing it when that suffices,
    else the smallest divisor of the vocabulary above the gap."""
    gap = vocab_size - (tokenizer_size if tokenizer_size is not None else vocab_size)
    if gap < 0:
        raise CheckpointSetupError(f"the tokenizer has {tokenizer_size} ids, the model's vocabulary only {vocab_size}")
    divisor = 128
    while vocab_size % divisor:
        divisor //= 2
    if divisor > gap:
        return divisor
    return next(d for d in range(gap + 1, vocab_size + 1) if vocab_size % d == 0)


def model_flags(shape: ModelShape, tokenizer_flags: List[str], divisor: int) -> List[str]:
    """Megatron-LM's flags for ``shape`` (what ``model_flags.txt`` holds), ``pretrain_llama.py``'s spelling."""
    flags = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
             "--ffn-hidden-size", str(shape.ffn_hidden_size), "--num-attention-heads", str(shape.num_attention_heads)]
    if shape.num_query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        flags += ["--kv-channels", str(shape.kv_channels)]
    flags += ["--max-position-embeddings", str(shape.max_position_embeddings),
              "--position-embedding-type", "rope", "--rotary-base", _number(shape.rotary_base)]
    if shape.rope_scaling_factor is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(shape.rope_scaling_factor)]
    if shape.interpolation_factor is not None:
        flags += ["--rotary-seq-len-interpolation-factor", str(shape.interpolation_factor)]
    flags += ["--normalization", "RMSNorm", "--norm-epsilon", repr(shape.norm_epsilon), "--swiglu",
              "--disable-bias-linear"]
    if shape.qkv_bias:
        flags.append("--add-qkv-bias")
    if shape.qk_layernorm:
        flags.append("--qk-layernorm")
    if not shape.tied:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--hidden-dropout", "0.0", "--attention-dropout", _number(shape.attention_dropout),
              "--attention-softmax-in-fp32", "--make-vocab-size-divisible-by", str(divisor)]
    return flags + list(tokenizer_flags)


def shape_from_args(args: Dict[str, object], vocab_size: int, model_type: Optional[str]) -> ModelShape:
    """The model a checkpoint's saved arguments describe; refuses, naming the flag, what a Hugging Face
    Llama/Mistral/Qwen model cannot hold."""
    def arg(key, default=None):
        return args.get(key, default)

    problems = [text for bad, text in (
        (arg("normalization") != "RMSNorm", f"--normalization {arg('normalization')} (RMSNorm)"),
        (not arg("swiglu"), "no --swiglu"),
        (arg("add_bias_linear"), "linear biases (--disable-bias-linear)"),
        (arg("position_embedding_type") != "rope", f"--position-embedding-type {arg('position_embedding_type')} "
                                                   "(rope)"),
        (float(arg("rotary_percent", 1.0)) != 1.0, f"--rotary-percent {arg('rotary_percent')} (1.0)"),
        (arg("add_qkv_bias") and arg("qk_layernorm"), "--add-qkv-bias with --qk-layernorm")) if bad]
    if problems:
        raise CheckpointSetupError("the checkpoint's model has no Hugging Face Llama/Mistral/Qwen counterpart: "
                                   + ", ".join(problems))
    kind = model_type or ("qwen2" if arg("add_qkv_bias") else "qwen3" if arg("qk_layernorm") else "llama")
    if (kind == "qwen2") != bool(arg("add_qkv_bias")) or (kind == "qwen3") != bool(arg("qk_layernorm")):
        raise CheckpointSetupError(f"--model-type {kind}: the checkpoint has add_qkv_bias={arg('add_qkv_bias')}, "
                                   f"qk_layernorm={arg('qk_layernorm')} (qwen2: q/k/v biases, qwen3: q/k norms)")
    heads, hidden = int(arg("num_attention_heads")), int(arg("hidden_size"))
    groups = int(arg("num_query_groups") or heads) if arg("group_query_attention", True) else heads
    return ModelShape(
        model_type=kind, num_layers=int(arg("num_layers")), hidden_size=hidden,
        ffn_hidden_size=int(arg("ffn_hidden_size")), num_attention_heads=heads, num_query_groups=groups,
        kv_channels=int(arg("kv_channels") or hidden // heads), vocab_size=vocab_size,
        max_position_embeddings=int(arg("max_position_embeddings") or arg("seq_length")),
        norm_epsilon=float(arg("norm_epsilon", 1e-5)), rotary_base=float(arg("rotary_base", 10000)),
        tied=not arg("untie_embeddings_and_output_weights"), qkv_bias=bool(arg("add_qkv_bias")),
        qk_layernorm=bool(arg("qk_layernorm")),
        rope_scaling_factor=float(arg("rope_scaling_factor")) if arg("use_rope_scaling") else None,
        interpolation_factor=arg("rotary_seq_len_interpolation_factor"),
        dtype="bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32")


def hf_config(shape: ModelShape, dtype: str) -> dict:
    """A ``config.json`` transformers 4 and 5 both read (the rope settings in both spellings)."""
    scaling = None
    if shape.rope_scaling_factor is not None:
        scaling = dict(LLAMA3_FIXED, rope_type="llama3", factor=shape.rope_scaling_factor)
    elif shape.interpolation_factor is not None:
        scaling = {"rope_type": "linear", "factor": float(shape.interpolation_factor)}
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=shape.rotary_base)
    config = {
        "architectures": [ARCHITECTURES[shape.model_type]], "model_type": shape.model_type,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups, "head_dim": shape.kv_channels,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon, "hidden_act": "silu", "tie_word_embeddings": shape.tied,
        "rope_theta": shape.rotary_base, "rope_scaling": scaling, "rope_parameters": rope,
        "attention_dropout": shape.attention_dropout, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }
    if shape.model_type in ("llama", "mistral", "qwen3"):
        config["attention_bias"] = False
    if shape.model_type == "llama":
        config["mlp_bias"] = False
    if shape.model_type == "mistral":
        config["sliding_window"] = None
    if shape.model_type.startswith("qwen"):
        config.update(use_sliding_window=False, sliding_window=None)
    return config
