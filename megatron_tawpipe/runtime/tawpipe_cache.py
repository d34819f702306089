"""``--tawpipe-cache {auto,on,off}`` at start-up: the decision every rank of a TawPipe run takes alike.

``auto`` asks the memory model (:mod:`megatron_tawpipe.sim.tawpipe_cache`) for the peak per device of the
run's plans with the cache and compares it with the device's memory: on a GPU its total memory
(``torch.cuda.get_device_properties(...).total_memory``); on the host, the memory Linux reports available
(``MemAvailable`` in ``/proc/meminfo``) divided by the ranks on this node (``LOCAL_WORLD_SIZE``), since they
share it. Every rank takes the smallest figure over all ranks (one all-reduce), so all build the same plans.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import torch

from megatron_tawpipe.common import launcher
from megatron_tawpipe.monitor.metrics import min_over_ranks
from megatron_tawpipe.plan import Plan
from megatron_tawpipe.sim.tawpipe_cache import CacheDecision, decide_cache, predicted_peak, run_cost_model


def host_available_bytes() -> float:
    """The host's available memory (``MemAvailable``; without /proc/meminfo, free pages x page size)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory(device: torch.device) -> Tuple[float, str]:
    """(bytes, what they are) of this rank's device memory as ``auto`` counts it."""
    if device.type == "cuda":
        total = float(torch.cuda.get_device_properties(device).total_memory)
        return total, f"{torch.cuda.get_device_name(device)} total memory"
    ranks = max(launcher.local_world_size(), 1)
    return host_available_bytes() / ranks, f"host's available memory / {ranks} ranks on it"


def decide(args, groups: int, build_plans: Callable[[bool], Dict[int, Plan]], device: torch.device,
           compute_bytes: int, grad_bytes: int) -> Tuple[CacheDecision, Dict[int, Plan]]:
    """The run's ``--tawpipe-cache`` decision and its plans (``build_plans(cache)``, by micro-batches per rank).
    ``compute_bytes`` / ``grad_bytes``: bytes per element of the compute dtype and of the gradients."""
    setting = getattr(args, "tawpipe_cache", "auto")
    if setting == "off" or (setting == "auto" and groups < 2):
        return decide_cache(setting, groups), build_plans(False)
    plans = build_plans(True)
    cost = run_cost_model(hidden_size=args.hidden_size, seq_length=args.seq_length,
                          micro_batch_size=args.micro_batch_size, ffn_hidden_size=args.ffn_hidden_size,
                          vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
                          num_attention_heads=args.num_attention_heads,
                          num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False)
                          else None, recompute=not args.tawpipe_no_recompute, dtype_bytes=compute_bytes,
                          grad_bytes=grad_bytes,
                          untied_embeddings=getattr(args, "untie_embeddings_and_output_weights", True))
    peak = predicted_peak(plans.values(), cost, getattr(args, "tawpipe_microbatches_per_visit", 1),
                          getattr(args, "tensor_model_parallel_size", 1))
    if setting == "on":
        return decide_cache(setting, groups, peak), plans
    memory, what = device_memory(device)
    least = min_over_ranks(memory)
    if least < memory:
        what += ", the smallest over ranks"
    decision = decide_cache(setting, groups, peak, least, what)
    return decision, (plans if decision.cache else build_plans(False))
