"""The collective half of ``--pipeline-schedule auto`` (:mod:`megatron_tawpipe.cli.auto_schedule` is the rest):
the process group created, the links and memory measured as TawPipe's layout decision measures them, the
candidates ranked on rank 0 (:func:`megatron_tawpipe.sim.schedule_choice.rank_schedules`), the top three printed,
the winner's flags broadcast."""

from __future__ import annotations

import argparse
import time
from typing import Callable, List

import torch.distributed as dist

from megatron_tawpipe.arguments.weight_passing import AUTO_CACHE_MEMORY_FRACTION
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.data import build_tokenizer
from megatron_tawpipe.distributed import parallel_state
from megatron_tawpipe.distributed.initialize import initialize_distributed
from megatron_tawpipe.sim.advisor_configs import Cluster, ModelSpec
from megatron_tawpipe.sim.schedule_choice import rank_schedules
from megatron_tawpipe.training.tawpipe_layout import layout_inputs, measure_inputs, run_cost_of


def recompute_fixed(args: argparse.Namespace):
    """The recomputation the command fixes for the weight-passing candidates: True with
    ``--recompute-granularity full`` (megatron's candidates too) or ``--tawpipe-recompute on``, False with
    ``--tawpipe-recompute off`` (``--tawpipe-no-recompute``), None when it leaves it open (each candidate then
    recomputes only where it does not fit otherwise)."""
    if args.recompute_granularity == "full" or args.tawpipe_recompute == "on":
        return True
    if args.tawpipe_recompute == "off" or args.tawpipe_no_recompute:
        return False
    return None


def decide_schedule(args: argparse.Namespace, world_size: int, refusal: Callable[[List[str]], str]) -> List[str]:
    """The winner's flags (in place of ``--pipeline-schedule auto``); ``args``: the command validated under one
    candidate (its model, batch and cluster flags); ``refusal(flags)``: why the run refuses the command with
    ``flags`` ("" when it runs it). Collective."""
    started = time.perf_counter()
    initialize_distributed(args)
    device = current_device()
    groups = args.tawpipe_num_groups or parallel_state.default_num_groups(world_size, "tawpipe")
    inputs = measure_inputs(args, world_size, groups, device)
    box = [None]
    if dist.get_rank() == 0:
        build_tokenizer(args)   # the padded vocabulary: the output layer's size
        cost_of, compute = run_cost_of(args, device, inputs)
        model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                          num_query_groups=args.num_query_groups, vocab_size=args.padded_vocab_size,
                          seq_length=args.seq_length)
        cluster = Cluster(ranks=world_size, nodes=groups, intra_bw=inputs.intra.bandwidth,
                          inter_bw=inputs.inter.bandwidth, gpu_memory=inputs.memory,
                          memory_reserve=(1 - AUTO_CACHE_MEMORY_FRACTION) * inputs.memory,
                          intra_latency=inputs.intra.latency, inter_latency=inputs.inter.latency)
        T, C = args.tensor_model_parallel_size, args.context_parallel_size
        ranking = rank_schedules(model, cluster, args.global_batch_size, args.micro_batch_size, cost_of,
                                 weight_passing_recompute=recompute_fixed(args),
                                 native_recompute=True if args.recompute_granularity == "full" else None,
                                 check=refusal,
                                 grad_bytes=cost_of(args.micro_batch_size, False).grad_bytes,
                                 layout=layout_inputs(args, world_size), tensor_parallel=T, context_parallel=C)
        described = inputs.describe(groups)
        described["compute"] = compute
        if T * C > 1:   # every candidate over the virtual ranks of T x C GPUs
            described["virtual ranks"] = f"{world_size // (T * C)} of {T} x {C} GPUs (tensor x context parallel)"
        head = (f"--pipeline-schedule auto: {len(ranking.ranked)} strategies priced in "
                f"{time.perf_counter() - started:.1f} s; " + "; ".join(f"{k}: {v}" for k, v in described.items()))
        winner = ranking.winner
        if winner is None:
            box = [("error", "\n".join(ranking.lines()))]
        else:
            flags = list(winner.flags)   # TawPipe's: with its decided layout
            left = [f"  left out: {r.label}: {r.refusal}" for r in ranking.left_out[:3]]
            print("\n".join([head] + ranking.lines() + left + [
                f"running {winner.label}; to pin it, replace --pipeline-schedule auto with: {' '.join(flags)}"]),
                flush=True)
            box = [("flags", flags)]
    dist.broadcast_object_list(box, 0)
    kind, value = box[0]
    if kind == "error":
        raise ArgumentError(value)
    return value
