"""TawPipe's shard cache as a choice (``pretrain_llama.py --tawpipe-cache {auto,on,off}``): what the memory
model predicts per device for a run's plans, and the ``auto`` rule.

The cache keeps every foreign shard a staging rank fetched for the whole iteration (one weight buffer each)
and accumulates its group's gradient of it (one gradient buffer each, sent once at the end): each foreign
shard crosses the node link twice per iteration whatever the micro-batches, against once per visit each way
without it. What it costs is the plan's buffers (``Plan.max_weight_buffers`` / ``max_grad_buffers``, counted
by the builder's interval colouring); the memory model (:mod:`megatron_tawpipe.sim.memory`) prices them with
everything else a rank holds.

``auto``: the cache is on when the predicted peak per device of the run's plans *with* the cache is at most
:data:`~megatron_tawpipe.arguments.weight_passing.AUTO_CACHE_MEMORY_FRACTION` of the device's memory; with one
group it is off (no shard is foreign). The runtime supplies the device's memory (torch-free here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from megatron_tawpipe.arguments.weight_passing import AUTO_CACHE_MEMORY_FRACTION, TAWPIPE_CACHE_SETTINGS
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.memory import MemoryBreakdown, weight_passing_breakdown
from megatron_tawpipe.sim.plan_memory import memory_fields
from megatron_tawpipe.sim.run_cost import run_cost_model  # noqa: F401  (re-exported)
from megatron_tawpipe.sim.tensor_parallel import per_gpu_breakdown


def predicted_memory(plan, cost: CostModel, microbatches_per_visit: int = 1,
                     tensor_parallel: int = 1) -> MemoryBreakdown:
    """The memory model's breakdown per device of one rank running ``plan`` (over the ``P / T`` virtual ranks
    of tensor parallelism ``T``: every term sliced over the T GPUs), as the advisor computes it."""
    from types import SimpleNamespace

    fields = SimpleNamespace(**memory_fields(plan, cost))
    return per_gpu_breakdown(weight_passing_breakdown(fields, cost, plan, microbatches_per_visit), tensor_parallel)


def predicted_peak(plans: Iterable, cost: CostModel, microbatches_per_visit: int = 1,
                   tensor_parallel: int = 1) -> float:
    """The largest predicted total per device over ``plans`` (a run has one per global batch size)."""
    return max(predicted_memory(p, cost, microbatches_per_visit, tensor_parallel).total for p in plans)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


@dataclass(frozen=True)
class CacheDecision:
    cache: bool
    reason: str         # one line: why

    def line(self) -> str:
        return f"tawpipe shard cache: {'on' if self.cache else 'off'} ({self.reason})"


def decide_cache(setting: str, num_groups: int, peak_with_cache: Optional[float] = None,
                 device_memory: Optional[float] = None, device: str = "device",
                 fraction: float = AUTO_CACHE_MEMORY_FRACTION) -> CacheDecision:
    """``--tawpipe-cache`` ``setting`` for ``num_groups`` groups: ``on`` / ``off`` as asked; ``auto`` on when
    ``peak_with_cache`` (bytes per device, the memory model's) is at most ``fraction`` x ``device_memory``
    (bytes; ``device`` says what that figure is), off otherwise and with one group."""
    if setting not in TAWPIPE_CACHE_SETTINGS:
        raise ValueError(f"--tawpipe-cache {setting!r}: expected one of {', '.join(TAWPIPE_CACHE_SETTINGS)}")
    predicted = f"; predicted peak with it {_size(peak_with_cache)} per device" if peak_with_cache is not None else ""
    if setting != "auto":
        return CacheDecision(setting == "on", f"--tawpipe-cache {setting}, {num_groups} groups{predicted}")
    if num_groups < 2:
        return CacheDecision(False, "auto: one group, no shard is foreign to it")
    if peak_with_cache is None or device_memory is None or device_memory <= 0:
        raise ValueError("--tawpipe-cache auto needs the predicted peak with the cache and the device's memory")
    limit = fraction * device_memory
    fits = peak_with_cache <= limit
    return CacheDecision(fits, f"auto, {num_groups} groups: the memory model's peak with the cache, "
                               f"{_size(peak_with_cache)} per device, is {'within' if fits else 'over'} "
                               f"{fraction:g} x {_size(device_memory)} ({device}) = {_size(limit)}")
