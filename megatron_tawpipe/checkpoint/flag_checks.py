"""Checks of Megatron-LM's checkpoint companion flags (``--save-retain-interval``, ``--async-save`` and its
options, ``--ckpt-format torch``, the distributed optimizer's format flags): a refusal naming the flag, or
one-line notices of what a flag does here."""

from __future__ import annotations

from typing import List

from megatron_tawpipe.common.errors import ArgumentError


def check_checkpoint_flags(args) -> List[str]:
    """Raise ArgumentError for a combination that cannot work; return the notices to print."""
    notices: List[str] = []
    if args.save_retain_interval is not None:
        if not args.save:
            notices.append(f"--save-retain-interval {args.save_retain_interval}: no effect without --save")
        elif args.save_interval and args.save_retain_interval % args.save_interval:
            raise ArgumentError(f"--save-retain-interval {args.save_retain_interval} must be a multiple of "
                                f"--save-interval {args.save_interval} (as in Megatron-LM)")
    notices += _check_async(args)
    if args.ckpt_format == "torch" and args.save:
        _check_torch_format_save(args)
    if args.dist_ckpt_optim_fully_reshardable:
        notices.append("--dist-ckpt-optim-fully-reshardable: always so here: the distributed optimizer's state is "
                       "saved in model space (megatron-core's fully_reshardable), never per data-parallel buffer")
    if args.distrib_optim_fully_reshardable_mem_efficient:
        notices.append("--distrib-optim-fully-reshardable-mem-efficient: no effect: the fully_reshardable state is "
                       "gathered over the data-parallel group as megatron-core does by default")
    if args.use_dist_ckpt_deprecated:
        notices.append("--use-dist-ckpt is deprecated in Megatron-LM and has no effect: --ckpt-format selects the format")
    if args.dist_ckpt_format_deprecated is not None:
        notices.append(f"--dist-ckpt-format {args.dist_ckpt_format_deprecated} is deprecated in Megatron-LM and has "
                       "no effect: --ckpt-format selects the format")
    return notices


def _check_async(args) -> List[str]:
    notices: List[str] = []
    if not 0 <= args.async_ckpt_io_priority <= 3:
        raise ArgumentError(f"--async-ckpt-io-priority {args.async_ckpt_io_priority}: an I/O scheduling class "
                            "0-3 (3 = idle)")
    if args.async_ckpt_cpu_priority < 0:
        raise ArgumentError(f"--async-ckpt-cpu-priority {args.async_ckpt_cpu_priority}: a nice value 0-19")
    if not args.async_save:
        args.async_strategy = "mcore"  # as Megatron-LM does without --async-save
        if args.use_persistent_ckpt_worker:
            notices.append("--use-persistent-ckpt-worker: no effect without --async-save")
        return notices
    if args.ckpt_format != "torch_dist":
        raise ArgumentError(f"--async-save writes --ckpt-format torch_dist only (as in Megatron-LM), not "
                            f"{args.ckpt_format}")
    if not args.save:
        notices.append("--async-save: no effect without --save")
    if args.async_strategy == "nvrx":
        notices.append("--async-strategy nvrx (Megatron-LM's default, nvidia-resiliency-ext's writer): "
                       "megatron-core's own (mcore) writes the same torch_dist files here")
        args.async_strategy = "mcore"
    if args.async_ckpt_use_cpu_shm:
        notices.append("--async-ckpt-use-cpu-shm: no effect: it applies to nvrx's writer only (as in Megatron-LM)")
    if args.use_persistent_ckpt_worker:
        import torch

        if not torch.cuda.is_available():
            # Which process writes changes nothing that is written: the same files, made visible the same way.
            notices.append("--use-persistent-ckpt-worker: megatron-core's persistent checkpoint worker sets a CUDA "
                           "device; without a GPU --async-save forks a writer per save instead (the same files)")
            args.use_persistent_ckpt_worker = False
    return notices


def _check_torch_format_save(args) -> None:
    from megatron_tawpipe.arguments import is_weight_passing

    if not args.no_save_optim:
        if args.use_torch_fsdp2 or args.use_megatron_fsdp:
            raise ArgumentError("--ckpt-format torch: the optimizer state of Megatron-LM's legacy files is "
                                "megatron-core's per-rank optimizer.state_dict(), written from megatron-core's own "
                                "optimizer (the native and weight-passing schedules), not under FSDP; pass "
                                "--no-save-optim (weights only), or use --ckpt-format torch_dist (which carries "
                                "FSDP's optimizer state)")
        if is_weight_passing(args.pipeline_schedule) and args.tensor_model_parallel_size != 1:
            raise ArgumentError(f"--ckpt-format torch under --pipeline-schedule {args.pipeline_schedule} writes the "
                                "files of a native run at tensor/pipeline size 1 (megatron-core's optimizer state "
                                "of the whole model), from --tensor-model-parallel-size 1 only, not "
                                f"{args.tensor_model_parallel_size}; pass --no-save-optim or use --ckpt-format "
                                "torch_dist")
        return      # native: one file per tensor- and pipeline-parallel rank, as Megatron-LM writes them;
        # weight passing: the file of a native run at tensor/pipeline size 1 with the non-distributed optimizer
    if args.tensor_model_parallel_size != 1:
        raise ArgumentError(f"--ckpt-format torch --no-save-optim writes whole weights (mp_rank_00) from "
                            f"--tensor-model-parallel-size 1 only, not {args.tensor_model_parallel_size}; save the "
                            "optimizer state too (one file per rank) or use --ckpt-format torch_dist")
