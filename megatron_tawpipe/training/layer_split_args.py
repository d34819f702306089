"""How the decoder layers are cut over the pipeline: Megatron-LM's flags, checked once before any process group.

``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first and/or
last piece; ``--pipeline-model-parallel-layout`` gives every piece (megatron-core's layout string,
parsed by megatron-core: ``E`` embedding, ``t`` decoder layer, ``L`` loss, ``|`` between stages,
``(...)*n`` repeats). The pieces are:

* weight-passing schedules: the shards, one per weight-pipeline rank (per tensor-parallel group
  with ``--tensor-model-parallel-size``). Without the flags, the default split
  (``common.layer_split.default_layer_split``: the first ``L mod P`` shards one layer more);
* native schedules: the pipeline stages (``pp x vp`` of them with a layout). Megatron-core's own rules
  apply: with the first/last flags the middle stages share the rest equally, and without any flag
  the pipeline size must divide the layers.

The result is ``args.decoder_layer_split``: a tuple of layer counts in layer order, or None where
megatron-core's even split applies unchanged (native schedules without the flags).
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

from megatron_tawpipe.arguments import is_weight_passing, weight_pipeline_ranks
from megatron_tawpipe.arguments.weight_passing import AUTO
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.common.layer_split import default_layer_split, first_last_layer_split

FIRST, LAST, LAYOUT = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                       "--pipeline-model-parallel-layout")


def settle_layer_split(args: argparse.Namespace, world_size: int) -> None:
    """Check the layer-split flags against the schedule and set ``args.decoder_layer_split``."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    layout = args.pipeline_model_parallel_layout
    if layout is not None and (first is not None or last is not None):
        raise ArgumentError(f"{LAYOUT} gives every stage; it cannot be combined with {FIRST} / {LAST}")
    if is_weight_passing(args.pipeline_schedule):
        ranks = weight_pipeline_ranks(args, world_size)
        # --tawpipe-shards-per-rank auto: the first count the split flags allow until the layout is decided at
        # start-up (training.tawpipe_layout_args), which settles the split again
        per_rank = args.tawpipe_shards_per_rank
        args.decoder_layer_split = _weight_pipeline_split(
            args, ranks, shards_per_rank_candidates(args, ranks)[0] if per_rank == AUTO else per_rank)
    else:
        args.decoder_layer_split = _native_split(args)
        _check_virtual_stages(args)


def shards_per_rank_candidates(args: argparse.Namespace, ranks: int) -> Tuple[int, ...]:
    """The shard counts per rank a TawPipe run may take: the one ``--tawpipe-shards-per-rank`` gives; for auto, the
    count a ``--pipeline-model-parallel-layout`` gives (its stages over the ranks), one with
    ``--decoder-first/last-pipeline-num-layers`` (they size one shard per rank), else 1 and 2 where the layers allow
    (at least one layer per shard; 1 always, the layer split saying why where even that does not fit)."""
    per_rank = args.tawpipe_shards_per_rank
    if per_rank != AUTO:
        return (int(per_rank),)
    layout = args.pipeline_model_parallel_layout
    if layout is not None:
        stages = len(parse_layout(layout))
        return (stages // ranks,) if stages % ranks == 0 and stages >= ranks else (1,)
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        return (1,)
    if args.pipeline_schedule != "tawpipe":
        return (1,)
    return tuple(v for v in (1, 2) if v == 1 or args.num_layers >= v * ranks)


def parse_layout(text: str) -> List[List[str]]:
    """megatron-core's parse of a layout string: one list of layer kinds (``"embedding"``,
    ``"decoder"``, ``"loss"``, ``"mtp"``) per stage, in layer order."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    except (AssertionError, ValueError) as exc:
        raise ArgumentError(f"{LAYOUT} {text!r}: {exc} (layer kinds: E embedding, t decoder layer, L loss; "
                            "| between stages; (...)*n repeats)") from None
    return [[kind.name for kind in stage] for stage in stages]


def layout_decoder_counts(text: str, num_layers: int, stages_needed: Optional[int], what: str) -> Tuple[int, ...]:
    """Decoder layers per stage of a layout string, checked: ``E`` only in the first stage, ``L`` only in the
    last, no ``m`` (multi-token prediction), ``num_layers`` decoder layers in all, and (when given)
    ``stages_needed`` stages."""
    stages = parse_layout(text)
    if stages_needed is not None and len(stages) != stages_needed:
        raise ArgumentError(f"{LAYOUT} {text!r} has {len(stages)} stages; {what} needs {stages_needed}")
    for i, stage in enumerate(stages):
        if "mtp" in stage:
            raise ArgumentError(f"{LAYOUT}: multi-token prediction layers (m) are not supported")
        if "embedding" in stage and i != 0:
            raise ArgumentError(f"{LAYOUT} {text!r}: the embedding (E) belongs to the first stage, not stage {i}")
        if "loss" in stage and i != len(stages) - 1:
            raise ArgumentError(f"{LAYOUT} {text!r}: the loss (L) belongs to the last stage, not stage {i}")
    counts = tuple(stage.count("decoder") for stage in stages)
    if sum(counts) != num_layers:
        raise ArgumentError(f"{LAYOUT} {text!r} places {sum(counts)} decoder layers (t); --num-layers is {num_layers}")
    return counts


def _weight_pipeline_split(args: argparse.Namespace, ranks: int, per_rank: int = 1) -> Tuple[int, ...]:
    """The shards' layer counts: ``ranks x per_rank`` shards (``--tawpipe-shards-per-rank``)."""
    L = args.num_layers
    tp, cp = args.tensor_model_parallel_size, getattr(args, "context_parallel_size", 1)
    who = (f"{ranks} weight-pipeline ranks (tensor-parallel groups: ranks / --tensor-model-parallel-size {tp})"
           if tp > 1 and cp == 1 else f"{ranks} weight-pipeline ranks" if cp == 1 else
           f"{ranks} weight-pipeline ranks (ranks / (--tensor-model-parallel-size {tp} x --context-parallel-size {cp}))")
    what = f"--pipeline-schedule {args.pipeline_schedule} over {who}"
    if per_rank > 1:
        what += f" with --tawpipe-shards-per-rank {per_rank}"
    shards = ranks * per_rank
    if args.pipeline_model_parallel_layout is not None:
        counts = layout_decoder_counts(args.pipeline_model_parallel_layout, L, shards, f"{what} (one stage per shard)")
        if 0 in counts:
            raise ArgumentError(f"{LAYOUT}: stage {counts.index(0)} has no decoder layer (t); with {what} "
                                "every shard needs one or more")
        return counts
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    try:
        if first is not None or last is not None:
            return first_last_layer_split(L, shards, first, last)
        return default_layer_split(L, shards)
    except ValueError as exc:
        flags = ", ".join(f"{f} {v}" for f, v in ((FIRST, first), (LAST, last)) if v is not None)
        raise ArgumentError(f"--num-layers {L}{' with ' + flags if flags else ''}, {what}: {exc}") from None


def _native_split(args: argparse.Namespace) -> Optional[Tuple[int, ...]]:
    """The stages' layer counts for the native schedules (None: megatron-core's even split)."""
    pp, L = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    layout = args.pipeline_model_parallel_layout
    if layout is not None:
        if pp < 2:
            raise ArgumentError(f"{LAYOUT} needs --pipeline-model-parallel-size >= 2")
        counts = layout_decoder_counts(layout, L, None, "")
        if len(counts) % pp:
            raise ArgumentError(f"{LAYOUT} has {len(counts)} stages: a multiple of --pipeline-model-parallel-size "
                                f"{pp} is needed (pipeline size x virtual stages per rank)")
        _check_native_layout(args, layout, len(counts) // pp)
        return counts
    if first is None and last is None:
        if L % pp:
            raise ArgumentError(
                f"--num-layers {L} must be divisible by --pipeline-model-parallel-size {pp}, or the stages "
                f"given: {FIRST} / {LAST} (the middle stages share the rest equally) or {LAYOUT}")
        return None
    if pp < 2:
        raise ArgumentError(f"{FIRST} / {LAST} need --pipeline-model-parallel-size >= 2")
    if args.pipeline_schedule == "interleaved":
        raise ArgumentError(f"{FIRST} / {LAST} with --pipeline-schedule interleaved: give the virtual stages "
                            f"with {LAYOUT} instead")
    try:
        return first_last_layer_split(L, pp, first, last, even_middle=True)
    except ValueError as exc:
        raise ArgumentError(f"--num-layers {L} over --pipeline-model-parallel-size {pp} with {FIRST} / {LAST}: "
                            f"{exc}") from None


def _check_virtual_stages(args: argparse.Namespace) -> None:
    """--pipeline-schedule interleaved: virtual stages of --num-layers-per-virtual-pipeline-stage layers each,
    or those of a layout (checked with it); no virtual stages for the other native schedules."""
    pp, per_virtual = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_schedule != "interleaved":
        if per_virtual is not None:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --pipeline-schedule interleaved")
        return
    if args.pipeline_model_parallel_layout is not None:
        return
    if per_virtual is None:
        raise ArgumentError("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage "
                            f"(or the virtual stages given by {LAYOUT})")
    if pp < 2:
        raise ArgumentError("--pipeline-schedule interleaved needs --pipeline-model-parallel-size >= 2")
    if (args.num_layers // pp) % per_virtual or args.num_layers // pp == per_virtual:
        raise ArgumentError(
            f"--num-layers-per-virtual-pipeline-stage {per_virtual} must divide the {args.num_layers // pp} "
            "layers of a pipeline stage into at least two virtual stages")


def _check_native_layout(args: argparse.Namespace, layout: str, virtual: int) -> None:
    """A layout megatron-core's pipeline runs: its own check (one E opening the first stage, one L closing the
    last), and as many stages per rank as the schedule runs model chunks."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    pp, schedule = args.pipeline_model_parallel_size, args.pipeline_schedule
    try:
        PipelineParallelLayerLayout(layout, pp).validate_layer_layout(num_layers=args.num_layers, mtp_num_layers=None)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise ArgumentError(f"{LAYOUT} {layout!r}: {exc}") from None
    if schedule == "interleaved":
        if virtual < 2:
            raise ArgumentError(f"{LAYOUT} {layout!r} has {virtual * pp} stages, one per pipeline rank; "
                                f"--pipeline-schedule interleaved needs two or more per rank ({2 * pp}, {3 * pp}, ...)")
        if args.num_layers_per_virtual_pipeline_stage is not None:
            raise ArgumentError(f"{LAYOUT} gives the virtual stages; it cannot be combined with "
                                "--num-layers-per-virtual-pipeline-stage")
    elif virtual != 1:
        raise ArgumentError(f"{LAYOUT} {layout!r} has {virtual * pp} stages, {virtual} per pipeline rank: "
                            f"--pipeline-schedule {schedule} runs one per rank ({pp} stages); more are virtual "
                            "stages, which --pipeline-schedule interleaved runs")
