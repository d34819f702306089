"""The collective half of settling a TawPipe run's layout (:mod:`megatron_tawpipe.training.tawpipe_layout_args`
is the rest): after the process groups exist, the node link (measured by
:mod:`megatron_tawpipe.distributed.link_probe`, or ``--tawpipe-link-bandwidth``), the compute times
(``--tawpipe-compute-times``, ``--emulated-compute-times``, or the device's peak at a stated efficiency) and the
device's memory (the smallest over ranks) are read; rank 0 sets the cost model up from them and
:func:`megatron_tawpipe.sim.layout_choice.choose_layout` finds the fastest layout the flags given allow that fits,
every rank pricing its share of the candidates; rank 0's choice is broadcast, every rank writes it into its flags,
rank 0 prints one line.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.layout import weight_pipeline_ranks
from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig
from megatron_tawpipe.arguments.weight_passing import AUTO_CACHE_MEMORY_FRACTION, is_auto
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.common.units import parse_rate, parse_time
from megatron_tawpipe.distributed import parallel_state
from megatron_tawpipe.distributed.link_probe import LinkMeasure, probe_links
from megatron_tawpipe.runtime.tawpipe_cache import least_device_memory
from megatron_tawpipe.sim.context_parallel import AttentionShape
from megatron_tawpipe.sim.context_parallel_weights import Pieces, virtual_rank_pricing
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.layout_choice import (LayoutChoice, LayoutInputs, LayoutRequest, Priced, TawPipeLayout,
                                                choose_layout, fixed_choice)
from megatron_tawpipe.sim.run_cost import cost_model_for_run
from megatron_tawpipe.training.layer_split_args import settle_layer_split, shards_per_rank_candidates
from megatron_tawpipe.training.tawpipe_layout_args import (apply_layout, microbatch_counts, settle_fixed_layouts,
                                                           tawpipe_request)
from megatron_tawpipe.training.weipipe_recompute import settle_weipipe_recompute

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
        # the node link given: nothing is probed (the link inside a node: the stated default)
        inter = LinkMeasure(parse_rate(args.tawpipe_link_bandwidth),
                            parse_time(args.tawpipe_link_latency or "20us"), 0.0, "--tawpipe-link-bandwidth")
        return inter, intra_default
    inter, intra, _ = probe_links(groups, per_group, device, PROBE_BUDGET_S, DEFAULT_INTER, intra_default)
    return inter, intra


def settle_tawpipe_layout(args: argparse.Namespace, world_size: int, device: torch.device) -> Optional[LayoutChoice]:
    """Decide every TawPipe layout flag left at auto (collective: every rank calls it) and write the decision into
    ``args`` (see the module docstring); None for another schedule."""
    settle_fixed_layouts(args)
    if args.pipeline_schedule == "weipipe" and is_auto(args.tawpipe_recompute):
        settle_weipipe_recompute(args, world_size, device)
    if args.pipeline_schedule != "tawpipe" or getattr(args, "tawpipe_layout", None) is not None:
        return None   # another schedule, or settled already
    ranks = weight_pipeline_ranks(args, world_size)
    groups = args.tawpipe_num_groups or parallel_state.default_num_groups(world_size, "tawpipe")
    layout = layout_inputs(args, world_size)
    request = layout.request
    key = decision_key(args, request, world_size, groups)
    if request.is_fixed():
        choice = fixed_choice(request)
    else:
        choice = _saved_decision(args, key) or _decide(args, layout, world_size, ranks, groups, device)
    choice.key, choice.request = key, request
    apply_layout(args, choice, world_size)
    if dist.get_rank() == 0:
        print(choice.line(), flush=True)
    return choice


@dataclass
class RunInputs:
    """What a decision is priced on: the links, the device's memory (the smallest over ranks) and the time
    measuring them took."""

    inter: LinkMeasure
    intra: LinkMeasure
    memory: float
    memory_what: str
    seconds: float

    def describe(self, groups: int) -> Dict[str, str]:
        out = {"node link": self.inter.describe(), "link in a node": self.intra.describe(),
               "memory limit": f"{AUTO_CACHE_MEMORY_FRACTION:g} x {self.memory / 1e9:.2f} GB ({self.memory_what})"}
        if groups < 2:
            out.pop("node link")
        return out


def measure_inputs(args: argparse.Namespace, world_size: int, groups: int, device: torch.device) -> RunInputs:
    """The links (probed, or given) and the device's memory, alike on every rank (collective)."""
    started = time.perf_counter()
    per_group = world_size // groups
    if groups >= 2 or per_group >= 2:
        inter, intra = _link(args, groups, per_group, device)
    else:
        inter, intra = DEFAULT_INTER, DEFAULT_INTRA["cuda" if device.type == "cuda" else "cpu"]
    least, what = least_device_memory(device)
    return RunInputs(inter, intra, least, what, time.perf_counter() - started)


def run_cost_of(args: argparse.Namespace, device: torch.device, inputs: RunInputs) -> Tuple[Callable, str]:
    """(``cost_of(micro_batch_size, recompute)``: the run's cost model, what its compute times are)."""
    times = args.tawpipe_compute_times or args.emulated_compute_times
    kwargs = {}
    if times is None:
        rate, compute = peak_rate(device)
        kwargs = dict(peak_tflops=rate / 1e12, efficiency=1.0)
    else:
        compute = f"the times in {times}"
    model, precision = ModelConfig.from_args(args), PrecisionConfig.from_args(args)
    backend = "nccl" if dist.get_backend() == "nccl" else "gloo"

    def cost_of(micro_batch_size: int, recompute: bool):
        cost = cost_model_for_run(model, precision, micro_batch_size, recompute, **kwargs)
        if times is not None:
            cost = cost.with_measured(times, micro_batch_size=micro_batch_size, seq_length=args.seq_length)
        return replace(cost, backend=backend, inter=Link(inputs.inter.bandwidth, inputs.inter.latency),
                       intra=Link(inputs.intra.bandwidth, inputs.intra.latency))

    return cost_of, compute


def decision_key(args: argparse.Namespace, request: LayoutRequest, world_size: int, groups: int) -> Dict[str, object]:
    """What a decision depends on besides measurements: the layout flags given, the cluster's shape, the model and
    the batch. A resumed run whose key equals its checkpoint's takes the checkpoint's layout."""
    schedule = args.batch_schedule or ((0, args.global_batch_size),)
    cp = {"context_parallel": args.context_parallel_size} if args.context_parallel_size > 1 else {}
    return {**cp, "request": [getattr(request, name) for name in ("ownership", "shards_per_rank", "replicate_first", "cache",
                                                            "microbatches_per_visit", "replicated_reduce", "recompute")],
            "world_size": world_size, "groups": groups, "tensor_parallel": args.tensor_model_parallel_size,
            "num_layers": args.num_layers, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "batch_schedule": [list(step) for step in schedule],
            "link": args.tawpipe_link_bandwidth,
            "compute_times": args.tawpipe_compute_times or args.emulated_compute_times}


def _saved_decision(args: argparse.Namespace, key: Dict[str, object]) -> Optional[LayoutChoice]:
    """The layout the checkpoint ``--load`` resumes from was decided with, when it was decided on the same
    flags, cluster, model and batch (``key``); None otherwise (the run decides again). Every rank reads the same
    file."""
    if not args.load or getattr(args, "finetune", False):
        return None
    from megatron_tawpipe.checkpoint import checkpoint_dir, latest_iteration, saved_run_arguments

    try:
        if latest_iteration(args.load) is None:
            return None
        saved = saved_run_arguments(checkpoint_dir(args.load)).get("tawpipe_layout")
    except Exception:   # an unreadable checkpoint is the load's to report, with its own message
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    choice = fixed_choice(LayoutRequest(**saved["layout"]), dict(saved.get("inputs") or {}))
    choice.saved_from = checkpoint_dir(args.load)
    return choice


def layout_inputs(args: argparse.Namespace, world_size: int) -> LayoutInputs:
    """What the layout decision takes from the run's flags besides the cost model (the run's and
    ``--pipeline-schedule auto``'s TawPipe candidate's): over the weight pipeline's (virtual) ranks."""
    ranks = weight_pipeline_ranks(args, world_size)
    return LayoutInputs(tawpipe_request(args), microbatch_counts(args, ranks), shards_per_rank_candidates(args, ranks),
                        layer_split_of(args, ranks), layout_plan_schedule(args))


def _decide(args, layout: LayoutInputs, world_size: int, ranks: int, groups: int,
            device: torch.device) -> LayoutChoice:
    """Collective: rank 0 sets the cost model up from the measured inputs; every rank prices its share of the
    candidate layouts on it (:func:`price_on_every_rank`); rank 0's choice is every rank's."""
    inputs = measure_inputs(args, world_size, groups, device)
    box = [_pricing(args, device, inputs, groups) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    choice = _choose(args, layout, ranks, groups, inputs, *box[0])
    box = [choice]
    dist.broadcast_object_list(box, 0)
    return box[0]


def price_on_every_rank(layouts: List[TawPipeLayout], price: Callable[[TawPipeLayout], Priced]) -> List[Priced]:
    """``layouts`` priced by the ranks together: rank r prices every world-size-th from the r-th, and every rank
    gets every price (collective). A run's ranks have a host core each: the decision takes the time of one
    rank's share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [price(layout) for layout in layouts[rank::world]]
    shares: List[Optional[List[Priced]]] = [None] * world
    dist.all_gather_object(shares, mine)
    by_layout = {p.layout: p for share in shares for p in share}
    return [by_layout[layout] for layout in layouts]


def layout_plan_schedule(args: argparse.Namespace) -> str:
    """The plan TawPipe's layouts are priced on: ``tawpipe-nooverlap`` with ``--tawpipe-no-overlap``."""
    return "tawpipe-nooverlap" if args.tawpipe_no_overlap else "tawpipe"


def layer_split_of(args: argparse.Namespace, ranks: int) -> Callable[[int], Optional[tuple]]:
    """``split_of(shards_per_rank)``: the layer split the run's flags give with that many shards per rank."""
    def split_of(per_rank: int):
        trial = argparse.Namespace(**vars(args))
        trial.tawpipe_shards_per_rank = per_rank
        settle_layer_split(trial, ranks * args.tensor_model_parallel_size * args.context_parallel_size)
        return trial.decoder_layer_split

    return split_of


def recompute_settings(args: argparse.Namespace) -> Tuple[bool, ...]:
    """The recompute settings TawPipe's layout decision chooses among: both under ``--tawpipe-recompute auto``."""
    return (False, True) if is_auto(args.tawpipe_recompute) else (args.tawpipe_recompute == "on",)


def layout_pricing(args: argparse.Namespace, one: Dict[bool, CostModel]
                   ) -> Tuple[Dict[bool, CostModel], Optional[Pieces]]:
    """(cost models, context parallelism's pieces) TawPipe's layout is priced on, from one GPU's cost models
    ``one`` (by recompute setting): with ``--context-parallel-size C`` (beside ``--tensor-model-parallel-size T``
    or not), the virtual ranks of T x C GPUs as the simulator prices them (1/(T x C) of the layers' work plus the
    tensor-parallel collectives and the ring's exposed time, the plan's transfers on T x C GPUs' links inside the
    node, the pieces' collectives of each GPU's tensor-parallel slice, the memory per GPU:
    :func:`megatron_tawpipe.sim.context_parallel_weights.virtual_rank_pricing`); with C = 1, one GPU's (the
    decision slices it over T)."""
    return virtual_rank_pricing(one, args.context_parallel_size, AttentionShape.of_flags(args),
                                args.tensor_model_parallel_size)


def _pricing(args, device: torch.device, inputs: RunInputs, groups: int
             ) -> Tuple[Dict[bool, CostModel], Optional[Pieces], float, Dict[str, str]]:
    """Rank 0's (cost model of each recompute setting the flags allow, context parallelism's pieces, memory limit,
    what they were set up from) for the decision."""
    cost_of, compute = run_cost_of(args, device, inputs)
    described = inputs.describe(groups)
    described["compute"] = compute
    costs, pieces = layout_pricing(args, {rc: cost_of(args.micro_batch_size, rc) for rc in recompute_settings(args)})
    if pieces is not None:
        T, C = args.tensor_model_parallel_size, args.context_parallel_size
        described["context parallelism"] = (f"{C} GPUs per virtual rank" if T == 1 else
                                            f"{T} x {C} GPUs per virtual rank (tensor x context parallel)")
    return costs, pieces, AUTO_CACHE_MEMORY_FRACTION * inputs.memory, described


def _choose(args, layout: LayoutInputs, ranks, groups, inputs: RunInputs, cost: Dict[bool, CostModel],
            pieces: Optional[Pieces], limit: float, described: Dict[str, str]) -> LayoutChoice:
    """The decision on rank 0's cost model (see :func:`settle_tawpipe_layout`; collective)."""
    try:
        choice = choose_layout(layout.request, cost, ranks, groups, args.num_layers, layout.microbatch_counts, limit,
                               layout.split_of, layout.shards_allowed, args.tensor_model_parallel_size,
                               dict(described), layout.plan_schedule, price_many=price_on_every_rank, pieces=pieces)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    choice.inputs["probe"] = f"{inputs.seconds:.2f} s"
    return choice
