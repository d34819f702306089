"""A TawPipe run's layout, settled at start-up: every layout flag left at ``auto`` decided, once, alike on every rank.

Validation (before any process group) checks the flags given and leaves ``auto`` as it is; after the process
groups exist, :func:`settle_tawpipe_layout` reads what the decision needs -- the node link (measured by
:mod:`megatron_tawpipe.distributed.link_probe`, or ``--tawpipe-link-bandwidth``), the compute times
(``--tawpipe-compute-times``, ``--emulated-compute-times``, or the device's peak at a stated efficiency), the
device's memory (the smallest over ranks) -- and asks :func:`megatron_tawpipe.sim.layout_choice.choose_layout`,
on rank 0, for the fastest layout that the flags given allow and that fits; rank 0's answer is broadcast, every
rank writes it into its flags (and the layer split that follows from the shard count), and rank 0 prints one
line. The decision is kept in ``args.tawpipe_layout`` (the metrics file's first record and every checkpoint's
saved arguments carry it); a resumed run decides again on its own flags and cluster.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_tawpipe.arguments.layout import weight_pipeline_ranks
from megatron_tawpipe.arguments.weight_passing import AUTO, is_auto, layout_flags_given, plan_file_of
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.data import batch_schedule
from megatron_tawpipe.sim.layout_choice import LayoutChoice, LayoutRequest, candidate_layouts
from megatron_tawpipe.training.layer_split_args import settle_layer_split, shards_per_rank_candidates

def settle_fixed_layouts(args: argparse.Namespace) -> None:
    """The layout flags of a schedule that is not TawPipe: their fixed values (they do not apply)."""
    if args.pipeline_schedule == "tawpipe":
        return
    for name, value in (("tawpipe_ownership", "owner"), ("tawpipe_microbatches_per_visit", 1),
                        ("tawpipe_replicated_reduce", "hierarchical")):
        if is_auto(getattr(args, name)):
            setattr(args, name, value)
    if args.tawpipe_shards_per_rank == AUTO:
        args.tawpipe_shards_per_rank = 1   # a plan file's own count is checked against it where given
    if args.tawpipe_replicate_first_shard is None:
        args.tawpipe_replicate_first_shard = False
    if plan_file_of(args.pipeline_schedule) is not None and is_auto(args.tawpipe_recompute):
        args.tawpipe_recompute = "on"   # a plan file: recompute as before (weipipe decides at start-up)


def settle_recompute_flags(args: argparse.Namespace) -> None:
    """Weight passing: ``--tawpipe-no-recompute`` is ``--tawpipe-recompute off``, megatron's
    ``--recompute-granularity full`` is ``on``; two of them that disagree: one line naming both."""
    asked = [(flag, value) for flag, value in (
        ("--tawpipe-recompute " + args.tawpipe_recompute, args.tawpipe_recompute),
        ("--tawpipe-no-recompute", "off" if args.tawpipe_no_recompute else AUTO),
        ("--recompute-granularity full", "on" if args.recompute_granularity == "full" else AUTO)) if value != AUTO]
    if len({value for _, value in asked}) > 1:
        raise ArgumentError(f"{asked[0][0]} and {asked[-1][0]} disagree on whether --pipeline-schedule "
                            f"{args.pipeline_schedule} recomputes its shards; give one of them")
    if asked:
        args.tawpipe_recompute = asked[0][1]
    if args.tawpipe_recompute != AUTO:
        args.tawpipe_no_recompute = args.tawpipe_recompute == "off"


def tawpipe_request(args: argparse.Namespace) -> LayoutRequest:
    """What the flags fix of the layout (``None``: auto), with what the run's other flags rule out: no replicated
    first shard without overlap (``--tawpipe-no-overlap``), no spread layout with context parallelism (one owner
    per shard)."""
    cache, replicate_first = args.tawpipe_cache, args.tawpipe_replicate_first_shard
    ownership = args.tawpipe_ownership
    if is_auto(ownership) and getattr(args, "context_parallel_size", 1) > 1:
        ownership = "owner"
    return LayoutRequest(
        ownership=None if is_auto(ownership) else ownership,
        shards_per_rank=None if is_auto(args.tawpipe_shards_per_rank) else int(args.tawpipe_shards_per_rank),
        replicate_first=False if replicate_first is None and args.tawpipe_no_overlap else replicate_first,
        cache=None if is_auto(cache) else cache == "on",
        microbatches_per_visit=(None if is_auto(args.tawpipe_microbatches_per_visit)
                                else int(args.tawpipe_microbatches_per_visit)),
        replicated_reduce=None if is_auto(args.tawpipe_replicated_reduce) else args.tawpipe_replicated_reduce,
        recompute=None if is_auto(args.tawpipe_recompute) else args.tawpipe_recompute == "on")


def check_tawpipe_layout(args: argparse.Namespace, world_size: int, groups: int) -> None:
    """Validation: some layout agrees with the TawPipe layout flags given (one line naming them otherwise)."""
    if args.pipeline_schedule != "tawpipe":
        return
    if args.tawpipe_replicated_reduce == "sharded" and getattr(args, "context_parallel_size", 1) > 1:
        raise ArgumentError("--tawpipe-replicated-reduce sharded does not run with --context-parallel-size > 1 yet "
                            "(the context-parallel members sum the replicated gradients whole): use hierarchical, "
                            "flat or auto")
    ranks = weight_pipeline_ranks(args, world_size)
    counts = microbatch_counts(args, ranks)
    shards = shards_per_rank_candidates(args, ranks)
    if not candidate_layouts(tawpipe_request(args), ranks, groups, args.num_layers, counts, shards):
        given = " ".join(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in layout_flags_given(args))
        raise ArgumentError(f"no TawPipe layout has {given} on {ranks} ranks in {groups} groups with "
                            f"{counts[0]} micro-batches per rank (what each knob needs: docs/tawpipe-layout.md); "
                            "leave one of them at auto")


def microbatch_counts(args: argparse.Namespace, data_parallel_size: int) -> List[int]:
    """Micro-batches per rank of every global batch the run takes, the first batch's first."""
    schedule = args.batch_schedule or ((0, args.global_batch_size),)
    counts = [batch_schedule.micro_batches(batch, args.micro_batch_size, data_parallel_size) for _, batch in schedule]
    counts = [c for c in counts if c is not None]
    return list(dict.fromkeys(counts)) or [1]


def apply_layout(args: argparse.Namespace, choice: LayoutChoice, world_size: int) -> None:
    """Write the chosen layout into the flags, settle the layer split it gives, keep the decision's record."""
    layout = choice.chosen
    args.tawpipe_ownership = layout.ownership
    args.tawpipe_shards_per_rank = layout.shards_per_rank
    args.tawpipe_replicate_first_shard = layout.replicate_first
    args.tawpipe_cache = "on" if layout.cache else "off"
    args.tawpipe_microbatches_per_visit = layout.microbatches_per_visit
    args.tawpipe_replicated_reduce = layout.replicated_reduce
    args.tawpipe_recompute = "on" if layout.recompute else "off"
    args.tawpipe_no_recompute = not layout.recompute
    settle_layer_split(args, world_size)
    args.tawpipe_layout = choice.record()


def layout_record(args: argparse.Namespace) -> Optional[dict]:
    """The decision kept in ``args`` (None before it, or for another schedule)."""
    return getattr(args, "tawpipe_layout", None)

