"""The GPT model on megatron-core, built from Megatron-LM's flags: config, layer spec, builder.

The model is megatron-core's ``GPTModel`` as Megatron-LM builds it from the same
flags: LayerNorm or RMSNorm (zero-centred with ``--apply-layernorm-1p``), a GELU,
SwiGLU or squared-ReLU MLP, linear biases unless ``--disable-bias-linear``,
learned absolute, rotary or no position embeddings, grouped-query attention,
tied or untied embeddings, dropout. With Megatron-LM's defaults that is GPT;
Llama is ``LLAMA_FLAGS`` in :mod:`megatron_tawpipe.arguments`. Layer spec:
Transformer Engine's when TE is importable with a GPU (or ``--transformer-impl
transformer_engine``), otherwise megatron-core's local spec with our SDPA core
attention (megatron's local attention materialises the S x S score matrix) and norms
named explicitly, the block's final norm included (:func:`norm_modules`): Apex's
LayerNorm on a GPU, torch norms that take zero-centred weights and sequence
parallelism (:mod:`megatron_tawpipe.models.norms`), otherwise torch's own.

Initial weights are a pure function of ``(seed, global parameter name)``
(:mod:`megatron_tawpipe.models.initialization`; names, shapes and tensor-parallel
slices: :mod:`megatron_tawpipe.models.parameters`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tawpipe.arguments.run_config import LayerOptions
from megatron_tawpipe.models.attention import SDPAttention
from megatron_tawpipe.models.backends import (  # noqa: F401 (the model's names)
    ATTENTION_BACKENDS, TE_ATTENTION_BACKENDS, check_model_support, resolve_attention_backend,
    transformer_engine_available)
from megatron_tawpipe.models.initialization import init_llama_weights
from megatron_tawpipe.models.norms import TorchNorm, TorchQKNorm
from megatron_tawpipe.models.parameters import mark_tensor_parallel_weights

def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # missing, or built for another torch / CUDA
        return False
    return True


@dataclasses.dataclass(frozen=True)
class FusionKernels:
    """Which of megatron-core's fused kernels can run here (each is optional)."""

    swiglu: bool = False               # megatron's bias-SwiGLU, jit-fused by torch.compile (Triton on GPUs)
    rope: bool = False                 # Transformer Engine's fused RoPE (>= 1.4)
    masked_softmax: bool = False       # the scaled (upper-triangular) masked softmax CUDA extensions (Apex)
    wgrad_accumulation: bool = False   # fused_weight_gradient_mlp_cuda (Apex): wgrad GEMM into main_grad

    @classmethod
    def probe(cls) -> "FusionKernels":
        return cls(swiglu=_swiglu_fusion_importable(), rope=_rope_fusion_importable(),
                   masked_softmax=(_importable("scaled_upper_triang_masked_softmax_cuda")
                                   and _importable("scaled_masked_softmax_cuda")),
                   wgrad_accumulation=_importable("fused_weight_gradient_mlp_cuda"))


def _swiglu_fusion_importable() -> bool:
    if not _importable("megatron.core.fusions.fused_bias_swiglu"):
        return False
    from megatron.core import jit

    # megatron's jit_fuser is torch.compile on current torch: its GPU code generator is Triton.
    return jit.jit_fuser is not torch.compile or _importable("triton")


def _rope_fusion_importable() -> bool:
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except Exception:
        return False
    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None


@functools.lru_cache(maxsize=1)
def available_fusion_kernels() -> FusionKernels:
    """The fused kernels importable in this process (probed once; only asked for with CUDA)."""
    return FusionKernels.probe()


def fusion_settings(on_cuda: bool, kernels: FusionKernels, main_grad_buffers: bool,
                    args=None) -> Dict[str, bool]:
    """TransformerConfig fusion flags: each on only with CUDA, its kernel importable, and not
    turned off by Megatron-LM's ``--no-*-fusion`` flag in ``args`` (the flags, a :class:`LayerOptions`, or None:
    Llama's, every fusion wanted).

    ``gradient_accumulation_fusion`` also needs every weight to carry an fp32 ``main_grad``
    that the wgrad GEMM accumulates into (megatron's backward reads ``weight.main_grad``
    unconditionally once the flag is on). megatron's DDP provides one (native schedules:
    ``main_grad_buffers=True``); the weight-passing shard template does not: its gradients
    come out of autograd into ``param.grad`` and are added into the plan's gradient buffers
    (see :meth:`runtime.shard_model.ShardTemplate.layer_grads_into`), so it stays off there.
    The bias-activation fusion is megatron's jit-fused SwiGLU, or its bias-GELU, which needs
    linear biases; squared ReLU has none. Bias-dropout-add fusion stays off: its compiled
    dropout is a second random-number path that the recompute-replays-dropout tests (on CPU)
    could not check.
    """
    if not on_cuda:
        kernels = FusionKernels()
    options = LayerOptions.of(args)
    if options.swiglu:
        activation = kernels.swiglu and options.bias_swiglu_fusion
    else:  # bias-GELU; squared ReLU has no fused kernel
        activation = (kernels.swiglu and options.bias_gelu_fusion and not options.squared_relu
                      and options.add_bias_linear)
    return {
        "bias_activation_fusion": bool(activation),
        "apply_rope_fusion": bool(kernels.rope and options.position_embedding_type == "rope"
                                  and options.apply_rope_fusion),
        "masked_softmax_fusion": bool(kernels.masked_softmax and options.masked_softmax_fusion),
        "gradient_accumulation_fusion": bool(kernels.wgrad_accumulation and main_grad_buffers
                                             and options.gradient_accumulation_fusion),
    }


def _mlp_activation(args):
    """(activation, gated) of the MLP: SwiGLU, squared ReLU or (Megatron-LM's default) GELU."""
    if args.swiglu:
        return F.silu, True
    if args.squared_relu:
        return squared_relu, False
    return F.gelu, False


def params_dtype(args) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def llama_config(args, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: Optional[int] = None,
                 main_grad_buffers: bool = False, tensor_model_parallel_size: int = 1,
                 sequence_parallel: bool = False) -> TransformerConfig:
    """A megatron-core TransformerConfig for a Llama-style model from parsed arguments.

    ``main_grad_buffers``: the model's parameters will get fp32 ``main_grad`` buffers (megatron
    DDP), which fused gradient accumulation needs (see :func:`fusion_settings`).
    """
    on_gpu = torch.cuda.is_available()
    dtype = params_dtype(args)
    fusions = fusion_settings(on_gpu, available_fusion_kernels() if on_gpu else FusionKernels(), main_grad_buffers,
                              args)
    activation, gated = _mlp_activation(args)
    # Native pipelines with stages of different sizes: megatron-core's own fields build each stage's layers
    # (Megatron-LM's --decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout). Weight passing
    # (pipeline size 1 here) cuts its shards itself.
    stage_split = {}
    if pipeline_model_parallel_size > 1:
        stage_split = {"num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
                       "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
                       "pipeline_model_parallel_layout": args.pipeline_model_parallel_layout}
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        layernorm_epsilon=args.norm_epsilon,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=gated,
        activation_func=activation,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # Initialisation is ours (init_llama_weights): skip megatron's.
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        **stage_split,
        sequence_parallel=sequence_parallel,
        **context_parallel_settings(args),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        # Fused kernels: with CUDA, where importable (fusion_settings); all off on CPU.
        **fusions,
        bias_dropout_fusion=False,
        persist_layer_norm=False,  # Apex's persistent LayerNorm kernel is not used
        cross_entropy_loss_fusion=bool(args.cross_entropy_loss_fusion and on_gpu),
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        **_te_attention_backend(args),
        deallocate_pipeline_outputs=on_gpu,
        variable_seq_lengths=False,
        **native_pipeline_settings(args, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                                   fusions.get("gradient_accumulation_fusion", False)),
    )


def context_parallel_settings(args) -> Dict[str, object]:
    """megatron-core's context-parallel fields: the size, and the ring (p2p) exchange of keys and values, which
    is what Transformer Engine's attention and :func:`~megatron_tawpipe.models.ring_attention.ring_attention`
    (the attention of the local layers) run."""
    size = getattr(args, "context_parallel_size", 1)
    return {"context_parallel_size": size, "cp_comm_type": "p2p" if size > 1 else None}


def native_pipeline_settings(args, pipeline_size: int, virtual_size: Optional[int],
                             gradient_accumulation_fusion: bool) -> Dict[str, object]:
    """megatron-core's p2p and deferred-wgrad fields from Megatron-LM's flags, as Megatron-LM sets them:
    p2p overlap (``--no-overlap-p2p-communication``, on by default) only with the interleaved schedule,
    batched p2p otherwise; ``--defer-embedding-wgrad-compute`` only with pipelines (it needs CUDA's fused
    gradient accumulation, as in megatron-core)."""
    overlap = virtual_size is not None and args.overlap_p2p_comm
    defer = pipeline_size > 1 and args.defer_embedding_wgrad_compute
    if defer and not gradient_accumulation_fusion:
        raise ValueError("--defer-embedding-wgrad-compute needs fused gradient accumulation (CUDA with Transformer "
                         "Engine or Apex, without --no-gradient-accumulation-fusion)")
    return dict(overlap_p2p_comm=overlap, batch_p2p_comm=not overlap,
                overlap_p2p_comm_warmup_flush=overlap and args.overlap_p2p_comm_warmup_flush,
                defer_embedding_wgrad_compute=defer,
                wgrad_deferral_limit=args.wgrad_deferral_limit if defer else 0,
                microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage
                if virtual_size is not None else None)


def _te_attention_backend(args) -> Dict[str, object]:
    """Megatron-LM's --attention-backend flash/fused/unfused: Transformer Engine's kernel choice."""
    if args.attention_backend not in TE_ATTENTION_BACKENDS:
        return {}
    from megatron.core.transformer.enums import AttnBackend

    return {"attention_backend": AttnBackend[args.attention_backend]}


def _apex_layer_norm_usable(options: LayerOptions) -> bool:
    """Whether megatron-core's Apex LayerNorm (``FusedLayerNorm``) can run here: a LayerNorm model on a GPU
    with Apex's fused LayerNorm kernel importable (it does no RMSNorm)."""
    return (options.normalization == "LayerNorm" and torch.cuda.is_available()
            and _importable("apex.normalization.fused_layer_norm") and _importable("fused_layer_norm_cuda"))


def _beyond_torch_norm(options: LayerOptions, backend: str) -> bool:
    """Whether the layers get a norm other than torch's: Transformer Engine's, or Apex's LayerNorm on a GPU
    (both take zero-centred weights and sequence parallelism themselves)."""
    return backend == "te" or _apex_layer_norm_usable(options)


def _uses_torch_norm(options: LayerOptions, backend: str) -> bool:
    """Whether megatron-core's local layer gets :class:`TorchNorm` in place of its own torch norm: for
    zero-centred weights (--apply-layernorm-1p) or --sequence-parallel, without TE or Apex."""
    wanted = bool(options.sequence_parallel) or bool(options.apply_layernorm_1p)
    return wanted and not _beyond_torch_norm(options, backend)


def norm_modules(args, backend: str):
    """``(norm, query/key norm)`` classes of megatron-core's local layer, which the block's final norm is
    too; None for Transformer Engine's layer, whose norms are TE's.

    Always named here rather than left to megatron-core, whose choice follows what is installed: its block
    takes TE's, else Apex's LayerNorm (LayerNorm only) for the final norm whenever Apex is importable, even
    for an RMSNorm model, and its local spec's LayerNorm follows a module global that an RMSNorm spec
    overwrites. Apex's LayerNorm for a LayerNorm model where it runs (:func:`_apex_layer_norm_usable`),
    :class:`TorchNorm` for zero-centred weights or sequence parallelism without it, otherwise megatron-core's
    torch norm (torch's LayerNorm or RMSNorm).
    """
    if backend == "te":
        return None
    options = LayerOptions.of(args)
    if _apex_layer_norm_usable(options):
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm, FusedLayerNorm
    if _uses_torch_norm(options, backend):
        return TorchNorm, TorchQKNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm, WrappedTorchNorm


def llama_layer_spec(attention_backend: str = "auto", args=None, wgrad_store=None) -> ModuleSpec:
    """The decoder-layer spec the flags describe: TE's fused layer, or megatron's local layer with
    SDPA or megatron's own attention and the norms of :func:`norm_modules`. ``wgrad_store`` (a split
    backward's :class:`~megatron_tawpipe.models.deferred_linear.WgradStore`, local layers only) makes the
    local layer's linear layers the deferred ones (:func:`~megatron_tawpipe.models.deferred_linear.deferred_layer_spec`)."""
    options = LayerOptions.of(args)
    backend = resolve_attention_backend(attention_backend, options)
    normalization, qk_layernorm = options.normalization, bool(options.qk_layernorm)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    norm, qk_norm = norm_modules(options, backend)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if qk_layernorm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = qk_norm
    if backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if wgrad_store is not None:
        from megatron_tawpipe.models.deferred_linear import deferred_layer_spec

        spec = deferred_layer_spec(spec, wgrad_store)
    return spec


def block_spec(layer_spec, config: TransformerConfig, vp_stage: Optional[int], final_norm):
    """A decoder-layer spec as the block spec megatron-core's ``TransformerBlock`` makes of it
    (``_get_block_submodules``: this stage's number of layers, from its pipeline rank, uneven first and last
    stages and ``--pipeline-model-parallel-layout`` included), with ``final_norm`` as the final norm in
    place of megatron-core's default. Anything else (a block spec already) is returned as it is."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer
    from megatron.core.utils import get_pg_rank

    if not (isinstance(layer_spec, ModuleSpec) and isinstance(layer_spec.module, type)
            and issubclass(layer_spec.module, BaseTransformerLayer)):
        return layer_spec
    # The pipeline rank as the block takes it (GPTModel's process groups are megatron-core's own).
    pp_rank = get_pg_rank(parallel_state.get_pipeline_model_parallel_group(check_initialized=False))
    count = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * count, layer_norm=final_norm)


def construct_llama_model(args, config: TransformerConfig, pre_process: bool = True,
                          post_process: bool = True, vp_stage: Optional[int] = None, compute=None,
                          wgrad_store=None) -> GPTModel:
    """The megatron-core GPTModel the flags describe, not yet initialised, on the host.

    ``compute`` replaces the layers' and the model's compute (emulated compute): it gives the decoder-layer
    spec (``compute.layer_spec(spec)``) and the model class (``compute.gpt_model_class()``), which it is
    built with; the parameters are the same. The block's final norm is the layers' norm
    (:func:`norm_modules`), named explicitly, except with Transformer Engine's layer. ``wgrad_store``: the
    decoder layers' deferred weight gradients (:func:`llama_layer_spec`)."""
    spec = llama_layer_spec(args.attention_backend, args, wgrad_store)
    model_class, extra = GPTModel, {}
    if compute is not None:
        spec = compute.layer_spec(spec)
        model_class, extra = compute.gpt_model_class(), {"emulated_compute": compute}
    norms = norm_modules(args, resolve_attention_backend(args.attention_backend, args))
    if norms is not None:
        spec = block_spec(spec, config, vp_stage, final_norm=norms[0])
    return model_class(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
        **extra,
    )


def build_llama_model(args, config: TransformerConfig, pre_process: bool = True,
                      post_process: bool = True, vp_stage: Optional[int] = None, compute=None) -> GPTModel:
    """Build one (stage of a) Llama model and initialise it deterministically from ``args.seed``
    (``compute``: see :func:`construct_llama_model`)."""
    model = construct_llama_model(args, config, pre_process, post_process, vp_stage, compute)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.tensor_model_parallel_size > 1:
        mark_tensor_parallel_weights(model)
    init_llama_weights(model, args.seed, config)
    return model
