"""``--context-parallel-size C``: the checks that settle whether a run can split its sequences over C ranks,
each one line naming the flags, before any process group or model exists.

The native schedules (no pipelining, ``1f1b``, ``interleaved``, with megatron's DDP or distributed optimizer)
run megatron-core's context parallelism: its process groups, its balanced split of each sequence into 2C
chunks, its loss scaling and its gradient reduction over the data- and context-parallel ranks. The layers'
attention is Transformer Engine's where it is installed, else the ring attention of
:mod:`megatron_tawpipe.models.ring_attention` (the ``sdpa`` backend).
"""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.flags import ArgumentError, is_weight_passing


def check_context_parallel(args: argparse.Namespace, world_size: int) -> None:
    """Raise :class:`ArgumentError` for a context-parallel run this project cannot run as asked."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    flag = f"--context-parallel-size {cp}"
    if is_weight_passing(args.pipeline_schedule):
        raise ArgumentError(f"{flag} with --pipeline-schedule {args.pipeline_schedule}: context parallelism runs "
                            "under the native schedules (1f1b, interleaved, or none with "
                            "--pipeline-model-parallel-size 1, megatron's DDP or --use-distributed-optimizer); "
                            "the weight-passing schedules do not split sequences yet")
    if args.use_torch_fsdp2 or args.use_megatron_fsdp:
        which = "--use-torch-fsdp2" if args.use_torch_fsdp2 else "--use-megatron-fsdp"
        raise ArgumentError(f"{flag} with {which}: context parallelism runs with megatron's DDP or "
                            "--use-distributed-optimizer; drop " + which)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp * cp):
        raise ArgumentError(f"{flag} x --tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = "
                            f"{tp * pp * cp} must divide the number of ranks {world_size}")
    if args.seq_length % (2 * cp):
        raise ArgumentError(f"{flag} cuts each sequence into {2 * cp} equal chunks (two per rank): --seq-length "
                            f"{args.seq_length} must be divisible by {2 * cp}")
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        raise ArgumentError(f"--sequence-parallel with {flag}: each rank's {args.seq_length // cp} tokens must be "
                            f"divisible by --tensor-model-parallel-size {tp}")
    if args.emulated_compute_times:
        raise ArgumentError(f"--emulated-compute-times with {flag}: emulated layers sleep a whole sequence's time "
                            "and exchange no keys or values; context parallelism runs the real layers")
    if args.reset_attention_mask:
        raise ArgumentError(f"--reset-attention-mask with {flag}: the context-parallel attention is causal over "
                            "the whole sequence (documents are not masked from each other); drop one of them")
    _check_attention(args, flag)


def _check_attention(args: argparse.Namespace, flag: str) -> None:
    from megatron_tawpipe.models.llama import resolve_attention_backend

    try:
        backend = resolve_attention_backend(args.attention_backend, args)
    except ValueError:
        return   # the model's own check names the flag (check_model_support)
    if backend == "local":
        why = (" (--apply-query-key-layer-scaling keeps it)" if args.apply_query_key_layer_scaling else "")
        raise ArgumentError(f"{flag} with megatron-core's local attention{why}: it has no context parallelism; use "
                            "--attention-backend auto or sdpa (the ring attention), or Transformer Engine's")
    if backend == "sdpa" and args.attention_dropout > 0.0:
        raise ArgumentError(f"{flag} without Transformer Engine: the ring attention has no dropout; give "
                            f"--attention-dropout 0 (now {args.attention_dropout}) or install Transformer Engine")
