"""Which attention a run gets, and whether this machine can build its model, without importing megatron-core.

Kept apart from :mod:`.llama` (which builds megatron-core's model) so that checking a command line
(``pretrain_llama.py``'s validation, the advisor's check of every command it prints) does not import
megatron-core."""

from __future__ import annotations

import os

from megatron_tawpipe.arguments.run_config import LayerOptions

ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local", "flash", "fused", "unfused")
TE_ATTENTION_BACKENDS = ("flash", "fused", "unfused")


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_attention_backend(requested: str, args=None) -> str:
    """te, sdpa or local (megatron-core's unfused attention); flash/fused/unfused are TE's kernels. ``args``: the
    flags, a :class:`LayerOptions`, or None (Llama's)."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    options = LayerOptions.of(args)
    impl = options.transformer_impl
    if impl == "inference_optimized":
        raise ValueError("--transformer-impl inference_optimized is for inference; train with transformer_engine "
                         "or local")
    if impl == "transformer_engine" and not transformer_engine_available():
        raise ValueError("--transformer-impl transformer_engine needs Transformer Engine and a CUDA GPU; "
                         "on this machine use --transformer-impl local")
    use_te = impl == "transformer_engine" or (impl is None and transformer_engine_available())
    if requested in TE_ATTENTION_BACKENDS or requested == "te":
        if not transformer_engine_available():
            raise ValueError(f"--attention-backend {requested} needs Transformer Engine and a CUDA GPU; "
                             "use auto or local")
        if impl == "local":
            raise ValueError(f"--attention-backend {requested} is Transformer Engine's: it needs --transformer-impl "
                             "transformer_engine, not local")
        return "te"
    if requested == "auto":
        if use_te:
            return "te"
        # megatron's query-key layer scaling lives in its own softmax: keep its attention then.
        return "local" if options.apply_query_key_layer_scaling else "sdpa"
    if requested == "sdpa" and options.apply_query_key_layer_scaling:
        raise ValueError("--apply-query-key-layer-scaling needs --attention-backend local or auto (not sdpa)")
    return requested


def check_model_support(args) -> None:
    """Raise ValueError for an architecture this machine cannot build (before any process group)."""
    backend = resolve_attention_backend(args.attention_backend, args)
    if (args.apply_query_key_layer_scaling and backend == "te"
            and os.environ.get("NVTE_APPLY_QK_LAYER_SCALING") != "1"):
        raise ValueError("--apply-query-key-layer-scaling with Transformer Engine's attention needs "
                         "NVTE_APPLY_QK_LAYER_SCALING=1 in the environment (or --attention-backend local)")
