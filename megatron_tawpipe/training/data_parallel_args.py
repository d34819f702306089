"""The data-parallel flags before any process group exists: Megatron-LM's rules for megatron's DDP and
distributed optimizer, and what FSDP2, megatron-core's Megatron-FSDP (HFSDP) and weight passing allow
here; every inconsistency is one :class:`ArgumentError` line naming the flag."""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.flags import ArgumentError, is_weight_passing
from megatron_tawpipe.arguments.layout import data_parallel_size
from megatron_tawpipe.common import launcher


def notice(message: str) -> None:
    """A one-line notice about a flag that has no effect, printed once by the first rank."""
    if launcher.rank() == 0:
        print(f"notice: {message}", flush=True)


def validate_data_parallel(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's rules for its data-parallel flags, plus what FSDP2 and weight passing allow."""
    instances = args.num_distributed_optimizer_instances
    if is_weight_passing(args.pipeline_schedule):
        if args.use_megatron_fsdp:
            raise ArgumentError(f"--use-megatron-fsdp does not apply to --pipeline-schedule {args.pipeline_schedule} "
                                "(it already spreads weights, gradients and optimizer state over all ranks); "
                                "leave --pipeline-schedule at 1f1b")
        if args.use_torch_fsdp2 or instances != 1:
            raise ArgumentError(
                f"--use-torch-fsdp2 / --num-distributed-optimizer-instances do not apply to --pipeline-schedule "
                f"{args.pipeline_schedule} (it already spreads weights, gradients and optimizer state over all ranks)")
        if args.use_distributed_optimizer or args.overlap_grad_reduce or args.overlap_param_gather:
            notice(f"--pipeline-schedule {args.pipeline_schedule}: every rank already owns 1/P of the optimizer "
                   "state and transfers overlap compute; --use-distributed-optimizer / --overlap-grad-reduce / "
                   "--overlap-param-gather change nothing")
        return
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    dp = data_parallel_size(args, world_size)
    _validate_megatron_fsdp(args)
    if args.use_torch_fsdp2:
        if args.pipeline_schedule != "1f1b" or args.pipeline_model_parallel_size != 1:
            raise ArgumentError("--use-torch-fsdp2 shards over all ranks: leave --pipeline-schedule at 1f1b and "
                                "--pipeline-model-parallel-size at 1")
        if args.use_distributed_optimizer or args.overlap_grad_reduce or args.overlap_param_gather:
            raise ArgumentError("--use-torch-fsdp2 replaces megatron's DDP: it always shards the optimizer and "
                                "overlaps its gathers and reductions; drop --use-distributed-optimizer / "
                                "--overlap-grad-reduce / --overlap-param-gather")
        if args.fp16:
            raise ArgumentError("--use-torch-fsdp2 trains in fp32 or --bf16 (fp16 needs a loss scaler FSDP2 "
                                "does not have)")
    if args.ddp_bucket_size is not None and (args.use_torch_fsdp2 or not (args.overlap_grad_reduce
                                                                          or args.use_megatron_fsdp)):
        notice("--ddp-bucket-size changes nothing without --overlap-grad-reduce (megatron's DDP reduces all "
               "gradients at once then) or with --use-torch-fsdp2 (it reduces per layer)")
    if instances != 1 and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        raise ArgumentError("--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer "
                            "(or --use-torch-fsdp2 for HSDP)")
    if dp % instances:
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances} must divide the data-parallel "
                            f"size {dp}")


def _validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """--use-megatron-fsdp (megatron-core's Megatron-FSDP; HFSDP with an outer optim sharding): what runs here."""
    instances = args.num_distributed_optimizer_instances
    inner, outer = args.data_parallel_sharding_strategy, args.outer_dp_sharding_strategy
    if not args.use_megatron_fsdp:
        if inner != "optim_grads_params" or outer != "no_shard":
            given = (f"--data-parallel-sharding-strategy {inner}" if inner != "optim_grads_params"
                     else f"--outer-dp-sharding-strategy {outer}")
            notice(f"{given}: no effect without --use-megatron-fsdp (it configures Megatron-FSDP)")
        return
    if args.use_torch_fsdp2:
        raise ArgumentError("--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive: choose one FSDP")
    if args.pipeline_model_parallel_size != 1 or args.pipeline_schedule != "1f1b":
        raise ArgumentError("--use-megatron-fsdp runs megatron's schedule without pipelining here: leave "
                            "--pipeline-model-parallel-size at 1 and --pipeline-schedule at 1f1b")
    if args.tensor_model_parallel_size != 1:
        raise ArgumentError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} with --use-megatron-fsdp "
                            "is not supported yet: leave tensor parallelism at 1")
    if not args.use_distributed_optimizer:
        raise ArgumentError("--use-megatron-fsdp needs --use-distributed-optimizer (Megatron-FSDP's sharded "
                            "parameters are stepped by megatron's distributed optimizer, as in Megatron-LM)")
    if args.fp16:
        raise ArgumentError("--use-megatron-fsdp trains in fp32 or --bf16 here (--fp16 is not supported with it)")
    if outer == "optim":
        if instances < 2:
            raise ArgumentError("--outer-dp-sharding-strategy optim shards the optimizer state across optimizer "
                                "instances: it needs --num-distributed-optimizer-instances N > 1 (one per node)")
        if inner != "optim_grads_params":
            raise ArgumentError(f"--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy "
                                f"optim_grads_params (megatron-core's rule), not {inner}")
    if args.save or args.load:
        raise ArgumentError("--save / --load with --use-megatron-fsdp: checkpoints of Megatron-FSDP's sharded "
                            "(DTensor) parameters and optimizer state are not supported yet; train without them")
