"""The steps of flag handling that are not checks (validate_args runs them): the flags read off disk
(``--use-checkpoint-args``), the values that follow from the flags alone, and those that follow from
checked flags: the global batch schedule, the iterations and LR spans in samples, the micro-batches. Each
refuses, in one line naming the flag, what it cannot settle."""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.flags import ArgumentError, is_weight_passing
from megatron_tawpipe.arguments.layout import data_parallel_size
from megatron_tawpipe.data import batch_schedule
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


def settle_batch_schedule(args: argparse.Namespace) -> None:
    """The global batch over the run: --global-batch-size (default: one micro-batch per data-parallel
    rank) or --step-batch-size-schedule, kept as ``args.batch_schedule``."""
    dp = args.data_parallel_size   # derive_args
    if args.step_batch_size_schedule is not None:
        if args.global_batch_size is not None:
            raise ArgumentError("--step-batch-size-schedule and --global-batch-size are mutually exclusive "
                                "(as in Megatron-LM): the schedule gives the global batch")
        try:
            args.batch_schedule = batch_schedule.parse_step_schedule(args.step_batch_size_schedule,
                                                                     args.seq_length)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
    else:
        if args.global_batch_size is None:
            args.global_batch_size = args.micro_batch_size * dp
        args.batch_schedule = batch_schedule.constant(args.global_batch_size)
    args.global_batch_size = batch_schedule.batch_at(args.batch_schedule, 0)


def settle_iterations(args: argparse.Namespace) -> None:
    """--train-iters or --train-samples, and the LR schedule in the same unit (Megatron-LM's rules).

    Sets ``args.train_iters`` in both modes and ``args.lr_warmup_steps``, ``lr_decay_steps``,
    ``wsd_decay_steps`` and ``wd_incr_steps`` in samples, the unit of megatron-core's scheduler.
    """
    schedule = args.batch_schedule

    def samples(iterations: int) -> int:
        return batch_schedule.samples_after(schedule, iterations)

    if (args.train_iters is None) == (args.train_samples is None):
        raise ArgumentError("give exactly one of --train-iters and --train-samples")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if args.train_iters is not None:
        if args.lr_decay_samples is not None or args.lr_warmup_samples or args.lr_wsd_decay_samples:
            raise ArgumentError("--lr-decay-samples / --lr-warmup-samples / --lr-wsd-decay-samples go with "
                                "--train-samples; with --train-iters use --lr-decay-iters / --lr-warmup-iters")
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        decay_iters = args.lr_decay_iters or args.train_iters
        decay = samples(decay_iters)
        warmup = samples(args.lr_warmup_iters)
        # The anneal is the decay's last iterations.
        wsd = decay - samples(max(decay_iters - (args.lr_wsd_decay_iters or 0), 0))
        total = samples(args.train_iters)
    else:
        if args.lr_decay_iters is not None or args.lr_warmup_iters or args.lr_wsd_decay_iters:
            raise ArgumentError("--lr-decay-iters / --lr-warmup-iters / --lr-wsd-decay-iters go with --train-iters; "
                                "with --train-samples use --lr-decay-samples / --lr-warmup-samples")
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive")
        args.train_iters = batch_schedule.iterations_for_samples(schedule, args.train_samples)
        if args.train_iters == 0:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                                f"({schedule[0][1]})")
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples or 0
        total = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    if warmup >= decay:
        unit = "iters" if args.train_samples is None else "samples"
        given = (f"--lr-warmup-fraction {args.lr_warmup_fraction}" if args.lr_warmup_fraction is not None
                 else f"--lr-warmup-{unit} {args.lr_warmup_iters if unit == 'iters' else args.lr_warmup_samples}")
        span = decay_iters if unit == "iters" else decay
        raise ArgumentError(f"{given} must be smaller than --lr-decay-{unit} {span} (default: --train-{unit})")
    if args.lr_decay_style == "WSD" and not wsd:
        notice("--lr-decay-style WSD without --lr-wsd-decay-iters / --lr-wsd-decay-samples: the anneal "
               f"({args.lr_wsd_decay_style}) spans the whole decay (Megatron-LM requires the flag)")
        wsd = decay
    args.lr_warmup_steps, args.lr_decay_steps, args.wsd_decay_steps = int(warmup), int(decay), int(wsd)
    args.wd_incr_steps = total
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ArgumentError("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style "
                                "linear or cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                            "and --end-weight-decay")
    elif not 0.0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ArgumentError(f"--start-weight-decay {args.start_weight_decay} must be >= 0 and at most "
                            f"--end-weight-decay {args.end_weight_decay}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                            "mutually exclusive")


def settle_micro_batches(args: argparse.Namespace) -> None:
    """``args.num_microbatches`` of the first batch, once every global batch the run reaches is checked to be a
    whole number of micro-batches per data-parallel rank (a multiple of the pipeline size for the interleaved
    schedule). A run that resumes (--load) may start past entries that do not fit this layout: the check then
    waits for the checkpoint (and the count for the loop)."""
    try:
        counts = batch_schedule.check_layout(args, 0)
    except ValueError as exc:
        if args.load and len(args.batch_schedule) > 1:
            args.num_microbatches = None
            return
        raise ArgumentError(str(exc)) from None
    if args.pipeline_schedule == "interleaved":
        for count in counts:
            if count % args.pipeline_model_parallel_size:
                raise ArgumentError(
                    f"--pipeline-schedule interleaved needs the number of micro-batches ({count}) "
                    f"to be a multiple of --pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.num_microbatches = batch_schedule.micro_batches(args.global_batch_size, args.micro_batch_size,
                                                         args.data_parallel_size)
