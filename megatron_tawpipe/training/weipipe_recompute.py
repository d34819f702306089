"""``--pipeline-schedule weipipe --tawpipe-recompute auto``: keep the activations where they fit.

WeiPipe has no layout to decide; its one memory knob is recompute. Keeping each shard's activations saves one
forward per shard and micro-batch and never slows a step, so ``auto`` keeps them wherever the memory model's peak
per device without recompute (:func:`megatron_tawpipe.sim.tawpipe_cache.predicted_memory` on the run's own plans)
fits the share of the device's memory the TawPipe decision uses, the smallest device over ranks; otherwise it
recomputes. Collective (one all-reduce for the memory); rank 0 prints one line.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.layout import weight_pipeline_ranks
from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig, ScheduleConfig
from megatron_tawpipe.arguments.weight_passing import AUTO_CACHE_MEMORY_FRACTION
from megatron_tawpipe.distributed import parallel_state
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.runtime.tawpipe_cache import least_device_memory
from megatron_tawpipe.sim.run_cost import cost_model_for_run
from megatron_tawpipe.sim.tawpipe_cache import predicted_memory
from megatron_tawpipe.training.tawpipe_layout_args import microbatch_counts


def weipipe_peak_without_recompute(args: argparse.Namespace, world_size: int, groups: int) -> float:
    """The memory model's largest peak per device over the run's WeiPipe plans, activations kept."""
    ranks = weight_pipeline_ranks(args, world_size)
    name = ScheduleConfig.from_args(args).plan_name
    cost = cost_model_for_run(ModelConfig.from_args(args), PrecisionConfig.from_args(args), args.micro_batch_size,
                              False)
    split = tuple(args.decoder_layer_split) if args.decoder_layer_split else None
    return max(predicted_memory(build_plan(name, num_ranks=ranks, num_groups=groups, num_layers=args.num_layers,
                                           num_microbatches=n, shard_layers=split),
                                cost, 1, args.tensor_model_parallel_size).total
               for n in microbatch_counts(args, ranks))


def settle_weipipe_recompute(args: argparse.Namespace, world_size: int, device: torch.device) -> None:
    """Write WeiPipe's recompute decision into ``args`` (see the module docstring; collective)."""
    groups = args.tawpipe_num_groups or parallel_state.default_num_groups(world_size, "weipipe")
    least, what = least_device_memory(device)
    limit = AUTO_CACHE_MEMORY_FRACTION * least
    peak = weipipe_peak_without_recompute(args, world_size, groups)
    keep = peak <= limit
    args.tawpipe_recompute = "off" if keep else "on"
    args.tawpipe_no_recompute = keep
    if dist.get_rank() == 0:
        print(f"weipipe recompute: {'off (activations kept)' if keep else 'on'} (auto: predicted peak "
              f"{peak / 1e9:.2f} GB per device without recompute {'fits' if keep else 'exceeds'} "
              f"{AUTO_CACHE_MEMORY_FRACTION:g} x {least / 1e9:.2f} GB ({what}))", flush=True)
