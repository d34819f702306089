"""The two steps of flag handling that are not checks, each done once before them (validate_args):
the flags read off disk (``--use-checkpoint-args``) and the values that follow from the flags alone."""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.flags import ArgumentError, is_weight_passing
from megatron_tawpipe.arguments.layout import data_parallel_size
from megatron_tawpipe.training.data_parallel_args import notice


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the model flags come from the checkpoint under --load (Megatron-LM's); the one
    step that reads flags off disk, before anything derives from or checks them."""
    from megatron_tawpipe.checkpoint import checkpoint_arguments
    from megatron_tawpipe.common.errors import CheckpointError

    if not args.load:
        raise ArgumentError("--use-checkpoint-args needs --load DIR (the checkpoint to take the model flags from)")
    try:
        found = checkpoint_arguments(args.load)
    except CheckpointError as exc:
        raise ArgumentError(f"--use-checkpoint-args: {exc}") from None
    if found is None:
        raise ArgumentError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint")
    directory, saved = found
    changed = []
    for key, value in saved.items():
        if getattr(args, key) != value:
            changed.append(f"--{key.replace('_', '-')} {value}")
            setattr(args, key, value)
    if changed:
        notice(f"--use-checkpoint-args: from {directory}: " + ", ".join(changed))


def derive_args(args: argparse.Namespace, world_size: int) -> None:
    """The values that follow from the flags alone, set once before the checks (none of them can fail):
    no --sequence-parallel without tensor parallelism (Megatron-LM's), a weight-passing run's pipeline size 1
    (every rank joins the weight pipeline), ``args.data_parallel_size``."""
    tp = args.tensor_model_parallel_size
    if tp == 1 and args.sequence_parallel:
        notice("--sequence-parallel: no effect with --tensor-model-parallel-size 1 (Megatron-LM turns it off too)")
        args.sequence_parallel = False
    pp = args.pipeline_model_parallel_size
    if is_weight_passing(args.pipeline_schedule) and pp != 1:
        owners = world_size // tp
        who = ("every rank is a data-parallel rank and owns" if tp == 1 else
               f"every tensor-parallel group of {tp} ranks is a data-parallel rank and owns")
        notice(f"--pipeline-schedule {args.pipeline_schedule}: the {pp} ranks of each "
               "--pipeline-model-parallel-size pipeline join the weight pipeline, which runs over all "
               f"{world_size} ranks ({who} 1/{owners} of the layers)")
        args.pipeline_model_parallel_size = 1
    args.data_parallel_size = data_parallel_size(args, world_size)
