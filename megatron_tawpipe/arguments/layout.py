"""Sizes that follow from the parsed flags: the data-parallel size and the interleaved schedule's virtual
pipeline size, as Megatron-LM derives them."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_tawpipe.arguments.flags import WEIGHT_PASSING_SCHEDULES


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES:
        return world_size // args.tensor_model_parallel_size
    return world_size // (args.pipeline_model_parallel_size * args.tensor_model_parallel_size)


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    if args.pipeline_schedule != "interleaved":
        return None
    return args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
