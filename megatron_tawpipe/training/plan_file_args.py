"""``--pipeline-schedule plan:FILE``: the plan file checked against the run's flags, before any process group.

A plan file (JSON or CSV, as ``Plan.to_json`` / ``to_csv`` or ``tools/plan.py build`` write it) runs on the
weight-passing runtime if it is a weight-passing plan (family ``weight``), the validator proves it sound, and
its shape is the run's: ranks (WORLD_SIZE / --tensor-model-parallel-size), groups (nodes, or
--tawpipe-num-groups), layers and their split over the shards, micro-batches per rank (one count: a plan file
cannot follow a batch that changes during the run). Every refusal is one :class:`ArgumentError` line naming
the file and the flag.
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_tawpipe.arguments import plan_file_of, weight_pipeline_ranks
from megatron_tawpipe.common.errors import ArgumentError, PlanError
from megatron_tawpipe.data import batch_schedule
from megatron_tawpipe.plan import Plan, read_plan, validate_plan
from megatron_tawpipe.training.layer_split_args import FIRST, LAST, LAYOUT


def check_plan_file(args: argparse.Namespace, world_size: int, ranks_per_node: int) -> Optional[Plan]:
    """The plan of ``--pipeline-schedule plan:FILE`` once it fits the run (None for a named schedule)."""
    path = plan_file_of(args.pipeline_schedule)
    if path is None:
        return None
    flag = f"--pipeline-schedule {args.pipeline_schedule}"
    if not path:
        raise ArgumentError("--pipeline-schedule plan: needs a file: plan:FILE (a JSON or CSV plan)")
    if args.tawpipe_no_overlap:
        raise ArgumentError(f"--tawpipe-no-overlap does not apply to {flag}: the plan file places every transfer")
    try:
        plan = read_plan(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ArgumentError(f"{flag}: {exc}") from None
    if plan.family != "weight":
        raise ArgumentError(f"{flag}: the plan's family is {plan.family!r}; the weight-passing executor runs "
                            "weight-passing plans (family 'weight') only, activation passing runs as "
                            "--pipeline-schedule 1f1b or interleaved")
    if tuple(plan.streams) != tuple(range(plan.num_ranks)):
        raise ArgumentError(f"{flag}: the plan's streams are {list(plan.streams)}; weight passing runs every rank on "
                            f"its own micro-batches: streams [0, 1, ..., {plan.num_ranks - 1}]")
    try:
        validate_plan(plan)
    except PlanError as exc:
        raise ArgumentError(f"{flag}: the validator refuses the plan: {' '.join(str(exc).split())}") from None
    _check_shape(args, plan, flag, world_size, ranks_per_node)
    return plan


def _check_shape(args: argparse.Namespace, plan: Plan, flag: str, world_size: int, ranks_per_node: int) -> None:
    tp = args.tensor_model_parallel_size * args.context_parallel_size
    ranks = weight_pipeline_ranks(args, world_size)
    if plan.num_ranks != ranks:
        over_tp = (f" / --tensor-model-parallel-size {args.tensor_model_parallel_size}" if tp > 1 else "") + (
            f" / --context-parallel-size {args.context_parallel_size}" if args.context_parallel_size > 1 else "")
        raise ArgumentError(f"{flag}: the plan has num_ranks={plan.num_ranks}; this run has {ranks} weight-pipeline "
                            f"ranks (WORLD_SIZE {world_size}{over_tp}): start {plan.num_ranks * tp} ranks")
    groups = args.tawpipe_num_groups
    if groups is not None and groups != plan.num_groups:
        raise ArgumentError(f"--tawpipe-num-groups {groups} does not match the plan's num_groups={plan.num_groups} "
                            f"({flag})")
    nodes = world_size // ranks_per_node
    if groups is None and nodes != plan.num_groups:
        raise ArgumentError(f"{flag}: the plan has num_groups={plan.num_groups}; this run has {nodes} node(s) of "
                            f"{ranks_per_node} ranks (LOCAL_WORLD_SIZE): run it on {plan.num_groups} nodes, or give "
                            f"--tawpipe-num-groups {plan.num_groups} (groups of {plan.ranks_per_group} consecutive "
                            "weight-pipeline ranks)")
    if plan.num_layers != args.num_layers:
        raise ArgumentError(f"--num-layers {args.num_layers} does not match the plan's num_layers={plan.num_layers} "
                            f"({flag})")
    split = tuple(args.decoder_layer_split)
    if plan.num_shards != len(split) and plan.num_shards % plan.num_ranks == 0:
        raise ArgumentError(f"{flag}: the plan has {plan.num_shards} shards, {plan.num_shards // plan.num_ranks} per "
                            f"rank; this run cuts the layers into {len(split)}: give --tawpipe-shards-per-rank "
                            f"{plan.num_shards // plan.num_ranks}")
    if tuple(plan.shard_layers) != split:
        given = any(value is not None for value in (
            args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.pipeline_model_parallel_layout))
        raise ArgumentError(f"{flag}: the plan splits its {plan.num_layers} layers over the shards as "
                            f"shard_layers={list(plan.shard_layers)}; this run's split is {list(split)} "
                            f"({'from the flags' if given else 'the default'}): give the plan's with {FIRST} / "
                            f"{LAST} or {LAYOUT}")
    _check_microbatches(args, plan, flag)


def _check_microbatches(args: argparse.Namespace, plan: Plan, flag: str) -> None:
    """One micro-batch count per rank over the whole run, the plan's (as the weight pipeline counts them:
    global batch / (--micro-batch-size x data-parallel ranks), one data-parallel rank per weight-pipeline rank)."""
    n, mbs, dp = plan.num_microbatches, args.micro_batch_size, args.data_parallel_size
    fits = n * mbs * dp
    if len(args.batch_schedule) > 1:
        counts = sorted({batch_schedule.micro_batches(batch, mbs, dp) for _, batch in args.batch_schedule} - {None})
        if counts != [n]:
            raise ArgumentError(f"--step-batch-size-schedule gives {', '.join(map(str, counts))} micro-batches per "
                                f"rank over the run; the plan has num_microbatches={n} ({flag}): a plan file runs "
                                f"one count, so keep the global batch at {fits} (--global-batch-size {fits})")
        return
    if args.num_microbatches != n:
        count = args.num_microbatches
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} gives {count} "
                            f"micro-batch{'es' if count != 1 else ''} per rank (--micro-batch-size {mbs} x {dp} "
                            f"data-parallel ranks); the plan has num_microbatches={n} ({flag}): give "
                            f"--global-batch-size {fits}")
