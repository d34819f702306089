"""Sizes that follow from the parsed flags: the data-parallel size and the interleaved schedule's virtual
pipeline size, as Megatron-LM derives them (the latter needs the flags validated first: with
``--pipeline-model-parallel-layout`` it counts the layout's stages, ``args.decoder_layer_split``)."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_tawpipe.arguments.flags import is_weight_passing


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    if is_weight_passing(args.pipeline_schedule):
        return world_size // args.tensor_model_parallel_size
    return world_size // (args.pipeline_model_parallel_size * args.tensor_model_parallel_size)


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    """Model chunks per pipeline rank for --pipeline-schedule interleaved (None for the other schedules): the
    layout's stages / --pipeline-model-parallel-size, or the layers of a stage / --num-layers-per-virtual-pipeline-stage."""
    if args.pipeline_schedule != "interleaved":
        return None
    pp = args.pipeline_model_parallel_size
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        return len(args.decoder_layer_split) // pp
    return args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
