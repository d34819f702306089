"""Validation of parsed flags before any process group exists: every inconsistency is one
:class:`ArgumentError` line that names the flag (Megatron-LM's rules, and this project's)."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_tawpipe.arguments.flags import (CKPT_FORMATS, PIPELINE_SCHEDULES, PLAN_FILE_PREFIX,
                                              SUPPORTED_TOKENIZERS, ArgumentError, is_weight_passing, plan_file_of)
from megatron_tawpipe.arguments.weight_passing import (AUTO, tawpipe_cache_problem, tawpipe_ownership_problem,
                                                       tawpipe_shards_per_rank_problem)
from megatron_tawpipe.common import launcher
from megatron_tawpipe.compat.megatron_lm import NOTICES
from megatron_tawpipe.optimizer.precision_flags import precision_refusal
from megatron_tawpipe.training.context_parallel_args import check_context_parallel
from megatron_tawpipe.training.layer_split_args import settle_layer_split
from megatron_tawpipe.training.data_parallel_args import notice, validate_data_parallel
from megatron_tawpipe.training.plan_file_args import check_plan_file
from megatron_tawpipe.training.tawpipe_layout_args import (check_tawpipe_layout, settle_fixed_layouts,
                                                           settle_recompute_flags)
from megatron_tawpipe.training.settle_args import (apply_checkpoint_args, derive_args, settle_batch_schedule,
                                                  settle_iterations, settle_micro_batches)

def world_size_from_env() -> int:
    return launcher.world_size()


def weight_passing_runtime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron_tawpipe.runtime.trainer") is not None


def _validate_logging(args: argparse.Namespace) -> None:
    """--logging-level / MEGATRON_LOGGING_LEVEL must be a level (monitor.log_level)."""
    from megatron_tawpipe.monitor.log_level import logging_level

    try:
        logging_level(args)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check flags before any process group is created; raise ArgumentError naming the flag.

    The flags read off disk first (``--use-checkpoint-args``: :func:`apply_checkpoint_args`), then the values
    that follow from the flags alone (:func:`derive_args`), then the checks; the checks set nothing: the
    values that follow from checked flags (the layer split, the batch schedule, the iterations and LR spans
    in samples, the micro-batches) are settled by ``settle_*`` functions (``settle_args``, ``layer_split_args``)
    where the checks they need have passed."""
    world_size = world_size_from_env() if world_size is None else world_size
    _check_schedule_name(args)
    if args.use_checkpoint_args:
        apply_checkpoint_args(args)
    derive_args(args, world_size)
    _check_args(args, world_size)
    for message in vars(args).pop(NOTICES, ()):   # the Megatron-LM flags that change nothing here
        notice(message)
    return args


def _check_schedule_name(args: argparse.Namespace) -> None:
    if args.pipeline_schedule == "auto":
        raise ArgumentError("--pipeline-schedule auto is decided by pretrain_llama.py at start-up (it measures the "
                            "cluster first); give a schedule here")
    if args.pipeline_schedule not in PIPELINE_SCHEDULES and plan_file_of(args.pipeline_schedule) is None:
        raise ArgumentError(
            f"--pipeline-schedule {args.pipeline_schedule!r} is unknown; choose one of {', '.join(PIPELINE_SCHEDULES)} "
            f"or {PLAN_FILE_PREFIX}FILE (a weight-passing plan file)")
    if is_weight_passing(args.pipeline_schedule) and not weight_passing_runtime_available():
        raise ArgumentError(
            f"--pipeline-schedule {args.pipeline_schedule} is registered but its runtime is not part of this "
            "version yet; use --pipeline-schedule 1f1b or interleaved")


def _check_args(args: argparse.Namespace, world_size: int) -> None:
    _validate_model(args)
    _validate_required(args)
    _validate_logging(args)
    if args.emulated_deferred_weight_gradients:
        notice("--emulated-deferred-weight-gradients: no effect, a split backward's weight-gradient kernels always "
               "run in its weight pass (real and emulated compute alike)")
    if args.record_plan_memory and args.emulated_compute_times:
        raise ArgumentError("--record-plan-memory measures what real compute holds; emulated compute "
                            "(--emulated-compute-times) keeps no activations")
    if args.emulated_compute_times:
        from megatron_tawpipe.emulation.compute import load_compute_times

        try:
            load_compute_times(args.emulated_compute_times, micro_batch_size=args.micro_batch_size,
                               seq_length=args.seq_length)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        if args.tensor_model_parallel_size > 1 and not is_weight_passing(args.pipeline_schedule):
            raise ArgumentError("--emulated-compute-times with --tensor-model-parallel-size > 1 is emulated for "
                                "--pipeline-schedule tawpipe / weipipe only (the native emulation replaces whole "
                                "layers and would drop megatron's tensor-parallel collectives)")
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are mutually exclusive")
    precision = precision_refusal(args, weight_passing=is_weight_passing(args.pipeline_schedule))
    if precision:
        raise ArgumentError(precision)
    _validate_parallel_layout(args, world_size)
    settle_layer_split(args, world_size)   # the stages (interleaved's virtual stages), or the weight pipeline's shards
    validate_data_parallel(args, world_size)
    settle_batch_schedule(args)
    settle_iterations(args)
    settle_micro_batches(args)
    settle_fixed_layouts(args)   # the layout flags of another schedule than tawpipe: their fixed values
    check_tawpipe_layout(args, world_size, args.tawpipe_num_groups or world_size // _ranks_per_node(world_size))
    check_plan_file(args, world_size, _ranks_per_node(world_size))
    _validate_logging_and_checkpoints(args)
    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ArgumentError(f"{flag} must be in [0, 1), got {value}")


def _validate_required(args: argparse.Namespace) -> None:
    """Flags Megatron-LM has no default for, and choices it has that this project does not implement."""
    if args.lr is None:
        raise ArgumentError("--lr is required (Megatron-LM has no default learning rate)")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    if args.min_lr < 0:
        raise ArgumentError(f"--min-lr must be >= 0, got {args.min_lr}")
    if args.lr_warmup_init > args.lr:
        raise ArgumentError(f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}")
    if args.decoupled_lr is not None and (args.decoupled_min_lr or 0.0) > args.decoupled_lr:
        raise ArgumentError(f"--decoupled-min-lr {args.decoupled_min_lr} must not exceed --decoupled-lr "
                            f"{args.decoupled_lr}")
    if args.optimizer != "adam":
        raise ArgumentError(f"--optimizer {args.optimizer} is not supported; adam (AdamW, Megatron-LM's default) is")
    if args.tokenizer_type is None:
        raise ArgumentError("--tokenizer-type is required (Megatron-LM has no default): NullTokenizer --vocab-size N "
                            "with --mock-data, or SentencePieceTokenizer --tokenizer-model FILE")
    if args.tokenizer_type not in SUPPORTED_TOKENIZERS:
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} is not supported yet; use "
                            f"{' or '.join(SUPPORTED_TOKENIZERS)}")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notice(f"--tiktoken-pattern {args.tiktoken_pattern}: applies to TikTokenizer only; no effect with "
               f"{args.tokenizer_type}")
    if args.dataloader_type == "external":
        raise ArgumentError("--dataloader-type external (a user-supplied iterator) has no place in a command line; "
                            "single (the default: every sample once, in the dataset's shuffled order) or cyclic "
                            "(Megatron-LM's random sampler: epochs, each in a random order) are")


def _validate_model(args: argparse.Namespace) -> None:
    """The architecture flags, as Megatron-LM builds them (see model.py)."""
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ArgumentError(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                            f"{args.num_attention_heads} (or give --kv-channels)")
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(
            f"--num-attention-heads {args.num_attention_heads} must be divisible by --num-query-groups {args.num_query_groups}")
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.swiglu and args.squared_relu:
        raise ArgumentError("--swiglu and --squared-relu are mutually exclusive")
    kind = args.position_embedding_type
    if kind in ("yarn", "mrope", "relative"):
        raise ArgumentError(f"--position-embedding-type {kind} is not supported yet; use learned_absolute, rope "
                            "or none")
    if not args.add_position_embedding and kind != "rope":
        raise ArgumentError(f"--no-position-embedding is only valid with --position-embedding-type rope (got {kind}); "
                            "use --position-embedding-type none for no position embedding")
    if (args.use_rope_scaling or args.rotary_seq_len_interpolation_factor) and kind != "rope":
        raise ArgumentError("--use-rope-scaling / --rotary-seq-len-interpolation-factor need "
                            "--position-embedding-type rope")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    from megatron_tawpipe.models.backends import check_model_support

    try:
        check_model_support(args)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _validate_logging_and_checkpoints(args: argparse.Namespace) -> None:
    if args.tensorboard_dir:
        from megatron_tawpipe.monitor.tensorboard_log import tensorboard_available

        if not tensorboard_available():
            raise ArgumentError(f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package "
                                "(pip install tensorboard)")
    if args.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ArgumentError(f"--wandb-project {args.wandb_project} needs the wandb package (pip install wandb)")
    elif args.wandb_exp_name or args.wandb_save_dir or args.wandb_entity:
        notice("--wandb-exp-name / --wandb-save-dir / --wandb-entity: no effect without --wandb-project")
    if args.save_interval is not None and not args.save:
        notice(f"--save-interval {args.save_interval} without --save: no checkpoints are written")
    from megatron_tawpipe.checkpoint.flag_checks import check_checkpoint_flags

    for line in check_checkpoint_flags(args):
        notice(line)
    if args.ckpt_format not in CKPT_FORMATS:
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: this project writes torch_dist (Megatron-LM's default, "
                            "megatron-core's dist_checkpointing), torch (Megatron-LM's legacy files) or "
                            "tawpipe (its own per-parameter files); "
                            f"Megatron-LM's {args.ckpt_format} format is not supported")
    if args.ckpt_format == "torch_dist" and args.save:
        try:
            import psutil  # noqa: F401  (megatron-core's torch_dist writer needs it)
        except ImportError:
            raise ArgumentError("--ckpt-format torch_dist needs the psutil package (pip install psutil), as "
                                "megatron-core's checkpoint writer does; or --ckpt-format tawpipe") from None
    if args.exit_on_missing_checkpoint and not args.load:
        raise ArgumentError("--exit-on-missing-checkpoint needs --load DIR")
    import signal

    if args.exit_signal_handler and (
            not isinstance(getattr(signal, str(args.exit_signal), None), signal.Signals)
            or args.exit_signal in ("SIGKILL", "SIGSTOP", "SIGCHLD")):
        raise ArgumentError(f"--exit-signal {args.exit_signal}: give a signal that can be caught and is not "
                            "SIGCHLD (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, ...)")
    if args.calculate_per_token_loss and args.eod_mask_loss:
        raise ArgumentError("--calculate-per-token-loss with --eod-mask-loss is not supported yet (micro-batches "
                            "with different numbers of loss tokens)")
    if args.calculate_per_token_loss:
        notice("--calculate-per-token-loss: every micro-batch has the same number of loss tokens without "
               "--eod-mask-loss, so the mean over the global batch's tokens is the mean over micro-batches")


def _validate_tensor_parallel(args: argparse.Namespace) -> None:
    """megatron-core's tensor parallelism (native schedules, and inside weight passing: see _validate_weight_pipeline_ranks)."""
    tp = args.tensor_model_parallel_size
    if tp == 1:   # --sequence-parallel is off then (derive_args)
        return
    if args.use_torch_fsdp2:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} with --use-torch-fsdp2: the FSDP2 baseline shards "
                            "whole layers over all ranks; leave tensor parallelism at 1")
    for flag, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups), ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % tp:
            raise ArgumentError(f"{flag} {value} must be divisible by --tensor-model-parallel-size {tp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel splits the sequence over the tensor-parallel ranks: --seq-length "
                            f"{args.seq_length} must be divisible by --tensor-model-parallel-size {tp}")
    if args.ckpt_format == "tawpipe" and args.save:
        raise ArgumentError(f"--ckpt-format tawpipe stores whole parameters, which a tensor-parallel rank does not "
                            f"hold: with --tensor-model-parallel-size {tp} use --ckpt-format torch_dist (the default)")


def _validate_parallel_layout(args: argparse.Namespace, world_size: int) -> None:
    check_context_parallel(args, world_size)
    _validate_tensor_parallel(args)
    groups = args.tawpipe_num_groups or world_size // _ranks_per_node(world_size)
    cache_problem = tawpipe_cache_problem(args.pipeline_schedule, args.tawpipe_cache, groups)
    problem = cache_problem or tawpipe_ownership_problem(
        args.pipeline_schedule, args.tawpipe_ownership, groups,
        args.tawpipe_replicate_first_shard) or tawpipe_shards_per_rank_problem(
        args.pipeline_schedule, args.tawpipe_shards_per_rank)
    if problem:
        raise ArgumentError(problem)
    pp = args.pipeline_model_parallel_size   # 1 with weight passing (derive_args)
    if is_weight_passing(args.pipeline_schedule):
        _validate_weight_pipeline_ranks(args, world_size)
        if args.recompute_granularity == "selective":
            raise ArgumentError(
                f"--recompute-granularity selective is not supported with --pipeline-schedule "
                f"{args.pipeline_schedule} (it recomputes whole shards: --tawpipe-recompute on / off / auto)")
        settle_recompute_flags(args)
        if args.timeline_file and os.path.isdir(args.timeline_file):
            raise ArgumentError(f"--timeline-file {args.timeline_file} is a directory; give a file name")
        if args.tawpipe_microbatches_per_visit not in (1, AUTO) and args.pipeline_schedule != "tawpipe":
            raise ArgumentError("--tawpipe-microbatches-per-visit applies to --pipeline-schedule tawpipe only")
        if args.tawpipe_replicated_reduce == "sharded" and args.pipeline_schedule != "tawpipe":
            raise ArgumentError(f"--tawpipe-replicated-reduce sharded applies to --pipeline-schedule tawpipe only "
                                f"({args.pipeline_schedule} all-reduces the replicated gradients); leave it at auto")
        if args.tawpipe_replicate_first_shard:
            _validate_replicated_first_shard(args, world_size)
        if args.weipipe_zero_bubble and args.pipeline_schedule != "weipipe":
            raise ArgumentError("--weipipe-zero-bubble applies to --pipeline-schedule weipipe only")
        backend = args.distributed_backend or ("nccl" if _cuda_available() else "gloo")
        if args.tawpipe_nccl_faithful and backend != "gloo":
            raise ArgumentError("--tawpipe-nccl-faithful runs NCCL's rules on gloo: it needs "
                                "--distributed-backend gloo (on NCCL the rules are NCCL's own)")
        return
    if (args.tawpipe_num_groups is not None or args.tawpipe_no_overlap or args.tawpipe_no_recompute
            or args.tawpipe_microbatches_per_visit not in (1, AUTO) or args.timeline_file or args.tawpipe_nccl_faithful
            or args.tawpipe_replicate_first_shard or args.weipipe_zero_bubble
            or args.record_plan_memory or args.tawpipe_recompute != AUTO):
        raise ArgumentError(
            "--tawpipe-num-groups / --tawpipe-no-overlap / --tawpipe-no-recompute / --tawpipe-recompute / "
            "--tawpipe-microbatches-per-visit / --tawpipe-replicate-first-shard / --tawpipe-nccl-faithful / "
            "--weipipe-zero-bubble / --timeline-file / --record-plan-memory need --pipeline-schedule tawpipe or "
            "weipipe")
    tp = args.tensor_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must divide "
                            f"the number of ranks {world_size}")


def _validate_weight_pipeline_ranks(args: argparse.Namespace, world_size: int) -> None:
    """Groups (nodes), tensor-parallel groups and layers for a weight-passing schedule: the plan runs over
    world / T virtual ranks, each a tensor-parallel group of T ranks inside one node."""
    schedule, tp = args.pipeline_schedule, args.tensor_model_parallel_size
    groups = args.tawpipe_num_groups
    if groups is not None and world_size % groups:
        raise ArgumentError(f"--tawpipe-num-groups {groups} must divide the number of ranks {world_size}: "
                            f"--pipeline-schedule {schedule} runs groups of equal size (groups of unequal size "
                            "are not supported)")
    if groups is None:
        _check_equal_nodes(schedule, world_size)
    if tp > 1:
        if world_size % tp:
            raise ArgumentError(f"--tensor-model-parallel-size {tp} must divide the number of ranks {world_size}")
        per_node = world_size // groups if groups is not None else _ranks_per_node(world_size)
        if per_node % tp:
            where = (f"--tawpipe-num-groups {groups} gives {per_node} ranks per group" if groups is not None
                     else f"{per_node} ranks per node (LOCAL_WORLD_SIZE)")
            raise ArgumentError(f"--tensor-model-parallel-size {tp} with --pipeline-schedule {schedule}: {where}, "
                                f"which {tp} does not divide, so a tensor-parallel group would span nodes; "
                                "tensor-parallel groups must stay inside a node")


def _validate_replicated_first_shard(args: argparse.Namespace, world_size: int) -> None:
    """--tawpipe-replicate-first-shard: tawpipe (with overlap) over two or more groups."""
    if args.pipeline_schedule != "tawpipe" or args.tawpipe_no_overlap:
        raise ArgumentError("--tawpipe-replicate-first-shard applies to --pipeline-schedule tawpipe (without "
                            "--tawpipe-no-overlap) only")
    groups = args.tawpipe_num_groups or world_size // _ranks_per_node(world_size)
    if groups < 2:
        raise ArgumentError("--tawpipe-replicate-first-shard needs two or more groups (nodes, or "
                            f"--tawpipe-num-groups); this run has {groups}")


def _check_equal_nodes(schedule: str, world_size: int) -> None:
    """Refuse nodes of different sizes as far as one rank can tell (the weight pipeline checks the rest
    once the process group exists: parallel_state.default_num_groups)."""
    local = launcher.local_world_size(world_size)
    if local > 0 and world_size % local:
        raise ArgumentError(
            f"--pipeline-schedule {schedule}: this node runs {local} of the {world_size} ranks (LOCAL_WORLD_SIZE), "
            "so the nodes differ in size; weight passing needs groups (nodes) of equal size: start the same "
            "number of ranks on every node (torchrun --nproc-per-node), or give --tawpipe-num-groups D with D "
            f"dividing {world_size} (groups of {world_size}/D consecutive ranks){_WEIPIPE_GROUPS[schedule == 'weipipe']}")


# WeiPipe's ring is the same plan whatever the groups (they only say which links are node links).
_WEIPIPE_GROUPS = ("", "; weipipe's ring does not depend on the groups: --tawpipe-num-groups 1 runs it (its bytes "
                       "then all count as intra-group)")


def _ranks_per_node(world_size: int) -> int:
    """Ranks per node as torchrun reports them (LOCAL_WORLD_SIZE; all ranks when unset)."""
    local = launcher.local_world_size(world_size)
    return local if local > 0 and world_size % local == 0 else world_size


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
