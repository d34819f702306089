"""Sizes that follow from the parsed flags: the data-parallel size and the interleaved schedule's virtual
pipeline size, as Megatron-LM derives them (the latter needs the flags validated first: with
``--pipeline-model-parallel-layout`` it counts the layout's stages, ``args.decoder_layer_split``)."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_tawpipe.arguments.run_config import derive_data_parallel_size


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    return derive_data_parallel_size(args.pipeline_schedule, world_size, args.tensor_model_parallel_size,
                                     args.pipeline_model_parallel_size, args.context_parallel_size)


def weight_pipeline_ranks(args: argparse.Namespace, world_size: int) -> int:
    """The weight pipeline's (virtual) ranks: one per tensor x context-parallel group of T x C consecutive ranks."""
    return world_size // (args.tensor_model_parallel_size * getattr(args, "context_parallel_size", 1))


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    """Model chunks per pipeline rank for --pipeline-schedule interleaved (None for the other schedules): the
    layout's stages / --pipeline-model-parallel-size, or the layers of a stage / --num-layers-per-virtual-pipeline-stage."""
    if args.pipeline_schedule != "interleaved":
        return None
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        return len(args.decoder_layer_split) // pp
    return args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
