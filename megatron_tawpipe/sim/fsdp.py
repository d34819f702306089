"""Analytic FSDP / ZeRO-3 model for comparison (no plan: its collectives are
all-gathers and reduce-scatters, which the weight-passing action set does not
need).

Every rank is a data-parallel rank and holds 1/P of every unit (a unit is
``unit_layers`` decoder layers).  Per micro-batch, each unit is all-gathered
before its forward and again before its backward, and its gradient is
reduce-scattered after its backward; the next unit's gather is prefetched
while the current one computes.  Collectives are rings over all P ranks; a
ring over D groups crosses each node's inter-group link once per direction,
so a collective on B bytes takes about ``(P-1)/P * B / bandwidth`` on the
slowest link class it uses (plus ``P-1`` latencies).
"""

from __future__ import annotations

from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.simulate import SimResult

INF = float("inf")


def simulate_fsdp(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                  num_microbatches: int, unit_layers: int = None,
                  grad_bytes: int = None) -> SimResult:
    """``grad_bytes``: bytes per gradient element in the reduce-scatter (default
    the compute dtype; 4 with FSDP2's ``reduce_dtype=float32``)."""
    P, D, N = num_ranks, num_groups, num_microbatches
    unit_layers = unit_layers or max(1, num_layers // P)
    if num_layers % unit_layers:
        raise ValueError("unit_layers must divide num_layers")
    units = num_layers // unit_layers
    unit_bytes = cost.params_per_layer * unit_layers * cost.dtype_bytes
    link = cost.inter if D > 1 else cost.intra
    moved = (P - 1) / P * unit_bytes
    coll = (P - 1) * link.latency + (0.0 if link.bandwidth == INF else moved / link.bandwidth)
    if P == 1:
        coll = 0.0
    g_ratio = (grad_bytes or cost.dtype_bytes) / cost.dtype_bytes
    t_f = cost.layer_forward * unit_layers
    t_b = (cost.layer_backward + cost.layer_recompute) * unit_layers
    params = (num_layers * cost.params_per_layer + cost.replicated_params) / P
    heads = cost.head_forward + cost.head_backward
    rs_ratio = g_ratio * cost.reduce_scatter_factor   # a reduce-scatter in units of one gather
    if cost.library_collectives_block:
        # FSDP2 on gloo blocks on every gather and reduce-scatter: nothing overlaps.
        per_mb = units * (t_f + t_b + (2 + rs_ratio) * coll) + heads
        iteration = N * per_mb + params * cost.optimizer_time_per_param
    else:
        per_mb = units * (max(t_f, coll) + max(t_b, (1 + rs_ratio) * coll)) + heads
        # Exposed: the first gather of an iteration, the last reduce-scatter, and
        # the optimizer on the local 1/P of everything.
        iteration = N * per_mb + (1 + rs_ratio) * coll + params * cost.optimizer_time_per_param
    compute = N * (units * (t_f + t_b) + heads)
    collectives = N * units * (2 + rs_ratio)      # two gathers, one reduce-scatter
    crossing = D if D > 1 else 0
    link_bytes = {"inter": collectives * crossing * moved,
                  "intra": collectives * (P - crossing) * moved}
    lps = unit_layers
    per_stash = cost.activation_bytes if cost.recompute else lps * cost.layer_activation_bytes
    working = lps * cost.layer_activation_bytes if cost.recompute else 0.0
    state = 16 * params + cost.dtype_bytes * cost.replicated_params
    tokens = N * cost.tokens_per_microbatch
    return SimResult(
        schedule="fsdp", num_ranks=P, iteration_time=iteration,
        tokens_per_sec_per_rank=tokens / iteration if iteration > 0 else INF,
        bubble_ratio=1.0 - compute / iteration if iteration > 0 else 0.0,
        link_bytes=link_bytes, replicated_allreduce_bytes=0.0,
        # two gathered units (current + prefetched) and one unsharded gradient
        weight_buffers=2, grad_buffers=1, weight_buffer_bytes=2 * unit_bytes,
        grad_buffer_bytes=unit_bytes * g_ratio, activation_bytes=units * per_stash + working,
        state_bytes=state, compute_time=[compute] * P, finish_time=[iteration] * P,
        options={"unit_layers": unit_layers, "analytic": True, "backend": cost.backend})
