"""``--context-parallel-size C``: the checks that settle whether a run can split its sequences over C ranks,
each one line naming the flags, before any process group or model exists.

The native schedules (no pipelining, ``1f1b``, ``interleaved``, with megatron's DDP or distributed optimizer)
run megatron-core's context parallelism: its process groups, its balanced split of each sequence into 2C
chunks, its loss scaling and its gradient reduction over the data- and context-parallel ranks. ``tawpipe`` and
``weipipe`` run the weight pipeline over virtual ranks of T x C GPUs inside one node, each moving its 1/C piece
of every transfer (:mod:`megatron_tawpipe.runtime.context_parallel`). The layers'
attention is Transformer Engine's where it is installed, else the ring attention of
:mod:`megatron_tawpipe.models.ring_attention` (the ``sdpa`` backend). ``--emulated-compute-times`` runs with it: each emulated layer sleeps 1/C of its
calibrated times around the ring's real exchange of keys and values (:mod:`megatron_tawpipe.emulation.ring`).
"""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.flags import ArgumentError, is_weight_passing
from megatron_tawpipe.common import launcher


def check_context_parallel(args: argparse.Namespace, world_size: int) -> None:
    """Raise :class:`ArgumentError` for a context-parallel run this project cannot run as asked."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    flag = f"--context-parallel-size {cp}"
    if is_weight_passing(args.pipeline_schedule):
        _check_weight_passing(args, world_size, flag)
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
    if args.reset_attention_mask:
        raise ArgumentError(f"--reset-attention-mask with {flag}: the context-parallel attention is causal over "
                            "the whole sequence (documents are not masked from each other); drop one of them")
    _check_attention(args, flag)


def _check_weight_passing(args: argparse.Namespace, world_size: int, flag: str) -> None:
    """tawpipe / weipipe: every tensor x context-parallel group (a virtual rank of T x C GPUs) inside one node (or
    one group of --tawpipe-num-groups); the spread layout (slices of a shard over its holders) is not run with it."""
    schedule, tp, cp = args.pipeline_schedule, args.tensor_model_parallel_size, args.context_parallel_size
    size = tp * cp
    groups = args.tawpipe_num_groups
    if groups is not None and groups > 0 and world_size % groups == 0:
        per_node, where = world_size // groups, f"--tawpipe-num-groups {groups} gives {world_size // groups} ranks per group"
    else:
        local = launcher.local_world_size(world_size)
        per_node = local if local > 0 and world_size % local == 0 else world_size
        where = f"{per_node} ranks per node (LOCAL_WORLD_SIZE)"
    if per_node % size:
        raise ArgumentError(f"{flag} x --tensor-model-parallel-size {tp} with --pipeline-schedule {schedule}: {where}, "
                            f"which {size} does not divide, so a context-parallel group would span nodes; the "
                            f"{size} ranks of a weight-pipeline rank must stay inside a node")
    if schedule == "tawpipe" and args.tawpipe_ownership == "spread":
        raise ArgumentError(f"--tawpipe-ownership spread with {flag}: the spread layout does not run with context "
                            "parallelism; give --tawpipe-ownership owner (or auto, which then picks it)")


def _check_attention(args: argparse.Namespace, flag: str) -> None:
    from megatron_tawpipe.models.backends import resolve_attention_backend

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
