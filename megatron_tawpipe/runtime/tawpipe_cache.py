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

from megatron_tawpipe.arguments.run_config import RunConfig
from megatron_tawpipe.common import launcher
from megatron_tawpipe.monitor.metrics import min_over_ranks
from megatron_tawpipe.plan import Plan
from megatron_tawpipe.sim.run_cost import cost_model_for_run
from megatron_tawpipe.sim.tawpipe_cache import CacheDecision, decide_cache, predicted_peak


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


def least_device_memory(device: torch.device) -> Tuple[float, str]:
    """(bytes, what they are) of the smallest device memory over all ranks as ``auto`` counts it (collective:
    one all-reduce), so that every rank decides alike."""
    memory, what = device_memory(device)
    least = min_over_ranks(memory)
    return least, what + (", the smallest over ranks" if least < memory else "")


def decide(config: RunConfig, groups: int, build_plans: Callable[[bool], Dict[int, Plan]],
           device: torch.device) -> Tuple[CacheDecision, Dict[int, Plan]]:
    """The run's ``--tawpipe-cache`` decision and its plans (``build_plans(cache)``, by micro-batches per rank)."""
    schedule = config.schedule
    setting = schedule.tawpipe_cache
    if setting == "off" or (setting == "auto" and groups < 2):
        return decide_cache(setting, groups), build_plans(False)
    plans = build_plans(True)
    cost = cost_model_for_run(config.model, config.precision, schedule.micro_batch_size, schedule.recompute)
    peak = predicted_peak(plans.values(), cost, schedule.tawpipe_microbatches_per_visit,
                          config.layout.tensor_model_parallel_size)
    if setting == "on":
        return decide_cache(setting, groups, peak), plans
    least, what = least_device_memory(device)
    decision = decide_cache(setting, groups, peak, least, what)
    return decision, (plans if decision.cache else build_plans(False))
