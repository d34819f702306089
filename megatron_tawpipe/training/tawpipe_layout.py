"""The collective half of settling a TawPipe run's layout (:mod:`megatron_tawpipe.training.tawpipe_layout_args`
is the rest): after the process groups exist, the node link (measured by
:mod:`megatron_tawpipe.distributed.link_probe`, or ``--tawpipe-link-bandwidth``), the compute times
(``--tawpipe-compute-times``, ``--emulated-compute-times``, or the device's peak at a stated efficiency) and the
device's memory (the smallest over ranks) are read; rank 0 asks
:func:`megatron_tawpipe.sim.layout_choice.choose_layout` for the fastest layout the flags given allow that fits, and
broadcasts it; every rank writes it into its flags; rank 0 prints one line.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig
from megatron_tawpipe.arguments.weight_passing import AUTO_CACHE_MEMORY_FRACTION
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.common.units import parse_rate, parse_time
from megatron_tawpipe.distributed import parallel_state
from megatron_tawpipe.distributed.link_probe import LinkMeasure, probe_links
from megatron_tawpipe.monitor.metrics import min_over_ranks
from megatron_tawpipe.runtime.tawpipe_cache import device_memory
from megatron_tawpipe.sim.costmodel import Link
from megatron_tawpipe.sim.layout_choice import LayoutChoice, LayoutRequest, choose_layout, fixed_choice
from megatron_tawpipe.sim.run_cost import cost_model_for_run
from megatron_tawpipe.training.layer_split_args import settle_layer_split, shards_per_rank_candidates
from megatron_tawpipe.training.tawpipe_layout_args import (apply_layout, microbatch_counts, settle_fixed_layouts,
                                                           tawpipe_request)

#: the efficiency a device's peak is taken at when no compute times are given (the advisor's default)
PEAK_EFFICIENCY = 0.4
#: dense bf16 peaks of common GPUs, TFLOP/s, by a name's fragment (the first match counts)
GPU_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                   ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("A10", 125.0),
                   ("V100", 125.0))
#: the link inside a node where it is not measured (one rank per node): NVLink-class on GPUs, loopback on CPUs
DEFAULT_INTRA = {"cuda": LinkMeasure(200e9, 5e-6, 0.0, "default"), "cpu": LinkMeasure(0.6e9, 20e-6, 0.0, "default")}
DEFAULT_INTER = LinkMeasure(12.5e9, 20e-6, 0.0, "default")
PROBE_BUDGET_S = 3.0


def peak_rate(device: torch.device) -> tuple:
    """(FLOP/s, what it is) of the device at :data:`PEAK_EFFICIENCY`: a GPU's dense bf16 peak by its name, else a
    matrix multiply's measured rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in GPU_PEAK_TFLOPS:
            if fragment in name:
                return tflops * 1e12 * PEAK_EFFICIENCY, f"{name}'s {tflops:g} TFLOP/s peak x {PEAK_EFFICIENCY:g}"
    size = 512
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.matmul(a, b)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.05:
        torch.matmul(a, b)
        runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = 2 * size ** 3 * runs / (time.perf_counter() - start)
    return rate * PEAK_EFFICIENCY, f"a measured {rate / 1e12:.3g} TFLOP/s matrix multiply x {PEAK_EFFICIENCY:g}"


def _link(args: argparse.Namespace, groups: int, per_group: int, device: torch.device):
    """(node link, link inside a node, what was said of them) as given by the flags or probed."""
    intra_default = DEFAULT_INTRA["cuda" if device.type == "cuda" else "cpu"]
    if args.tawpipe_link_bandwidth is not None:
        inter = LinkMeasure(parse_rate(args.tawpipe_link_bandwidth),
                            parse_time(args.tawpipe_link_latency or "20us"), 0.0, "--tawpipe-link-bandwidth")
        _, intra, _ = probe_links(1, per_group, device, PROBE_BUDGET_S / 2, DEFAULT_INTER, intra_default)
        return inter, intra
    inter, intra, _ = probe_links(groups, per_group, device, PROBE_BUDGET_S, DEFAULT_INTER, intra_default)
    return inter, intra


def settle_tawpipe_layout(args: argparse.Namespace, world_size: int, device: torch.device) -> Optional[LayoutChoice]:
    """Decide every TawPipe layout flag left at auto (collective: every rank calls it) and write the decision into
    ``args`` (see the module docstring); None for another schedule."""
    settle_fixed_layouts(args)
    if args.pipeline_schedule != "tawpipe" or getattr(args, "tawpipe_layout", None) is not None:
        return None   # another schedule, or settled already
    tp = args.tensor_model_parallel_size
    ranks = world_size // tp
    groups = args.tawpipe_num_groups or parallel_state.default_num_groups(world_size, "tawpipe")
    request = tawpipe_request(args)
    shards = shards_per_rank_candidates(args, ranks)
    if request.is_fixed():
        choice = fixed_choice(request)
    else:
        choice = _decide(args, request, world_size, ranks, groups, shards, device)
    apply_layout(args, choice, world_size)
    if dist.get_rank() == 0:
        print(choice.line(), flush=True)
    return choice


def _decide(args, request: LayoutRequest, world_size: int, ranks: int, groups: int, shards: Sequence[int],
            device: torch.device) -> LayoutChoice:
    started = time.perf_counter()
    per_group = world_size // groups
    if groups >= 2 or per_group >= 2:
        inter, intra = _link(args, groups, per_group, device)
    else:
        inter, intra = DEFAULT_INTER, DEFAULT_INTRA["cuda" if device.type == "cuda" else "cpu"]
    memory, what = device_memory(device)
    least = min_over_ranks(memory)
    choice = None
    if dist.get_rank() == 0:
        choice = _choose(args, request, ranks, groups, shards, device, inter, intra, least, what,
                         time.perf_counter() - started)
    box = [choice]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _choose(args, request, ranks, groups, shards, device, inter: LinkMeasure, intra: LinkMeasure, memory: float,
            memory_what: str, probe_seconds: float) -> LayoutChoice:
    """Rank 0's decision (see :func:`settle_tawpipe_layout`)."""
    times = args.tawpipe_compute_times or args.emulated_compute_times
    kwargs = {}
    if times is None:
        rate, compute = peak_rate(device)
        kwargs = dict(peak_tflops=rate / 1e12, efficiency=1.0)
    else:
        compute = f"the times in {times}"
    recompute = not args.tawpipe_no_recompute
    cost = cost_model_for_run(ModelConfig.from_args(args), PrecisionConfig.from_args(args), args.micro_batch_size,
                              recompute, **kwargs)
    if times is not None:
        cost = cost.with_measured(times, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
    backend = "nccl" if dist.get_backend() == "nccl" else "gloo"
    cost = replace(cost, backend=backend, inter=Link(inter.bandwidth, inter.latency),
                   intra=Link(intra.bandwidth, intra.latency))
    limit = AUTO_CACHE_MEMORY_FRACTION * memory
    inputs = {"node link": inter.describe(), "link in a node": intra.describe(), "compute": compute,
              "memory limit": f"{AUTO_CACHE_MEMORY_FRACTION:g} x {memory / 1e9:.2f} GB ({memory_what})"}
    if groups < 2:
        inputs.pop("node link")
    counts = microbatch_counts(args, ranks)

    def split_of(per_rank: int):
        trial = argparse.Namespace(**vars(args))
        trial.tawpipe_shards_per_rank = per_rank
        settle_layer_split(trial, ranks * args.tensor_model_parallel_size)
        return trial.decoder_layer_split

    try:
        choice = choose_layout(request, cost, ranks, groups, args.num_layers, counts, limit, split_of, shards,
                               args.tensor_model_parallel_size, inputs,
                               "tawpipe-nooverlap" if args.tawpipe_no_overlap else "tawpipe")
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    choice.inputs["probe"] = f"{probe_seconds:.2f} s"
    return choice
