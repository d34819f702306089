"""Strategies practitioners use on slow-link clusters, beside the plan-based
schedules: analytic models of HSDP, megatron's distributed optimizer (one
instance per node, or one over all ranks) and Megatron-FSDP's HFSDP, and a
pipeline of stages inside nodes with data parallelism across each stage's
ranks (``pp-nodes``: one stage per node) that reuses the 1F1B / interleaved
plan simulation.

Notation: Psi parameters (decoder layers + embedding + output layer), P ranks
in D nodes of d, N micro-batches per rank, ``w`` bytes per weight on the wire
(the compute dtype, 2) and ``g`` per gradient (4: megatron reduces in fp32
under ``--bf16``, FSDP2 with ``reduce_dtype=float32``).  ``link_bytes`` are
cluster totals per iteration (as for the plan-based schedules);
``options["inter_bytes_per_node"]`` is one node's outgoing bytes.

Overlap assumptions (stated once, used by every model here):

* a collective that megatron / FSDP starts per bucket or unit (one per layer)
  during the last micro-batch's backward (``overlap_grad_reduce``; HSDP's
  cross-node all-reduce, issued after each unit's last reduce-scatter) hides
  behind the rest of that backward, except its last bucket, which follows the
  last backward: exposed ``max(T_comm/L, T_comm - T_backward * (L-1)/L)``
  (:func:`megatron_tawpipe.sim.collectives.exposed`);
* a parameter all-gather after the optimizer step (``overlap_param_gather``,
  HFSDP's outer all-gather) hides behind the next iteration's first forward
  likewise, except its first bucket, which precedes the first layer's forward;
* FSDP's per-unit gathers and reduce-scatters overlap the neighbouring unit's
  compute (prefetch), as in :mod:`plan.fsdp`;
* collectives are rings: ``(n-1)/n * bytes / bandwidth + (n-1) * latency``;
  a ring over ranks in several nodes runs at the node link's bandwidth.

These are NCCL's overlaps on GPUs (``CostModel.backend == "nccl"``).  With
``backend="gloo"`` (``tools/simulate.py --backend gloo``, what the emulated
cluster's CPU runs do) the libraries' overlap is gone where it lives in CUDA
streams: FSDP2 blocks on each gather and reduction (HSDP's all-reduce
included) and its gloo reduce-scatter costs an all-reduce; megatron with more
than one distributed-optimizer instance reduces every bucket synchronously.
One instance's bucket reductions are asynchronous gloo work and still overlap.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_tawpipe.sim.collectives import exposed, per_microbatch, ring_time, total_params
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.memory import (MemoryBreakdown, gb, generic_breakdown, logits_bytes, native_activations,
                                         replicated_state, weight_passing_breakdown, _logits_note)
from megatron_tawpipe.sim.pipelines import peak_stash, pipeline_memory, simulate_extended, simulate_pipeline
from megatron_tawpipe.sim.plan_memory import memory_fields
from megatron_tawpipe.sim.simulate import SimResult

# The pipeline family (megatron_tawpipe.sim.pipelines) and total_params (sim.collectives) lived here; their
# importers still find them here.
__all__ = ["STRATEGIES", "peak_stash", "pipeline_memory", "plan_memory", "plan_memory_fields", "run_strategy",
           "simulate_distopt", "simulate_extended", "simulate_hfsdp", "simulate_hsdp", "simulate_pipeline",
           "total_params"]

INF = float("inf")

#: strategy -> (description, trainable with pretrain_llama.py)
STRATEGIES = {
    "hsdp": ("FSDP2 sharded inside each node, replicated across nodes", True),
    "distopt-node": ("megatron distributed optimizer, one instance per node", True),
    "distopt": ("megatron distributed optimizer over all ranks", True),
    "hfsdp": ("Megatron-FSDP, sharded inside nodes, optimizer sharded across nodes", False),
    "pp-nodes": ("megatron 1F1B, one stage per node, distributed optimizer inside it", True),
}


def _result(name, P, cost, N, iteration, compute, link_bytes, mem: MemoryBreakdown,
            wbuf=0.0, gbuf=0.0, nw=0, ng=0, **options) -> SimResult:
    tokens = N * cost.tokens_per_microbatch
    mem_dict = mem.as_dict()
    options.update(analytic=True, memory_breakdown=mem_dict)
    return SimResult(
        schedule=name, num_ranks=P, iteration_time=iteration,
        tokens_per_sec_per_rank=tokens / iteration if iteration > 0 else INF,
        bubble_ratio=1.0 - compute / iteration if iteration > 0 else 0.0,
        link_bytes=link_bytes, replicated_allreduce_bytes=0.0, weight_buffers=nw,
        grad_buffers=ng, weight_buffer_bytes=wbuf, grad_buffer_bytes=gbuf,
        activation_bytes=mem.activations, state_bytes=mem.weights + mem.grads + mem.optimizer,
        compute_time=[compute] * P, finish_time=[iteration] * P, options=options)


def _sharded_units(cost, d, unit_layers, grad_bytes):
    """FSDP units sharded over the d ranks of a node: (unit parameters, one
    unit's all-gather, its gradient reduce-scatter, one micro-batch's time per
    unit, what an iteration adds at its ends).  NCCL: the gathers and
    reductions overlap the neighbouring units' compute, the first gather and
    the last reduction are exposed.  gloo: FSDP2 blocks on every collective
    and its reduce-scatter costs an all-reduce."""
    unit_params = cost.params_per_layer * unit_layers
    ag = ring_time(cost.intra, unit_params * cost.dtype_bytes, d)
    rs = ring_time(cost.intra, unit_params * grad_bytes, d, factor=cost.reduce_scatter_factor)
    t_f = cost.layer_forward * unit_layers
    t_b = (cost.layer_backward + cost.layer_recompute) * unit_layers
    if cost.library_collectives_block:
        return unit_params, ag, rs, t_f + ag + t_b + ag + rs, 0.0
    return unit_params, ag, rs, max(t_f, ag) + max(t_b, ag + rs), ag + rs


def _fsdp_memory(cost, num_layers, psi, unit_params, d, grad_bytes, weights_div, opt_div):
    w = cost.dtype_bytes
    m = replicated_state(psi, d, w, True, True, opt_div)
    if weights_div is None:     # FSDP2: the fp32 shard is the master (counted in optimizer)
        m.weights = 0.0
        m.notes["weights"] = "none resident: the fp32 shard is the master (optimizer term)"
    m.comm_buffers = 2 * unit_params * w + unit_params * grad_bytes + cost.replicated_params * w
    m.notes["comm_buffers"] = (f"2 gathered layers x {gb(unit_params * w)} + 1 unsharded grad "
                               f"{gb(unit_params * grad_bytes)} + gathered embedding/output "
                               f"{gb(cost.replicated_params * w)}")
    m.activations, m.notes["activations"] = native_activations(cost, num_layers, 1)
    m.logits = logits_bytes(cost)
    m.notes["logits"] = _logits_note(cost)
    return m


# ----------------------------------------------------------------- analytic
def simulate_hsdp(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                  num_microbatches: int, grad_bytes: int = 4, unit_layers: int = 1) -> SimResult:
    """FSDP2 on a (D, d) mesh: per micro-batch each layer is gathered inside the
    node (forward and backward) and its gradient reduce-scattered inside the node;
    gradients are all-reduced across nodes once per iteration (``set_requires_
    all_reduce(False)`` on all micro-batches but the last): ``2 g Psi (D-1)/D``
    bytes per node."""
    P, D, N, L = num_ranks, num_groups, num_microbatches, num_layers
    d = P // D
    units = L // unit_layers
    unit_params, ag, rs, per_unit, edges = _sharded_units(cost, d, unit_layers, grad_bytes)
    psi = total_params(cost, L)
    fwd, bwd = per_microbatch(cost, L)
    per_mb = units * per_unit + cost.head_forward + cost.head_backward
    node_bytes = 2 * grad_bytes * psi * (D - 1) / D
    t_ar = ring_time(cost.inter, grad_bytes * psi, D, factor=2.0)
    # per unit after its last reduce-scatter; the last unit's follows the last backward (gloo: blocking)
    shown = exposed(t_ar, bwd, 1 if cost.library_collectives_block else units)
    iteration = N * per_mb + edges + shown + psi / d * cost.optimizer_time_per_param
    intra = N * units * P * (d - 1) / d * unit_params * (2 * cost.dtype_bytes + cost.reduce_scatter_factor * grad_bytes)
    mem = _fsdp_memory(cost, L, psi, unit_params, d, grad_bytes, None, d)
    return _result("hsdp", P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes, "intra": intra}, mem,
                   wbuf=2 * unit_params * cost.dtype_bytes + cost.replicated_params * cost.dtype_bytes,
                   gbuf=unit_params * grad_bytes, nw=2, ng=1, inter_bytes_per_node=node_bytes,
                   exposed_comm_s=shown, unit_layers=unit_layers, trainable=True)


def simulate_distopt(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                     num_microbatches: int, instances: int = 1, grad_bytes: int = 4,
                     context_parallel: int = 1) -> SimResult:
    """Megatron DDP + distributed optimizer (``overlap_grad_reduce``,
    ``overlap_param_gather``).  Every rank holds the bf16 model and an fp32
    gradient buffer; the optimizer state is sharded over the P/instances ranks of
    an instance.  ``instances = D`` (``distopt-node``): gradients are
    reduce-scattered inside the node, each shard all-reduced across instances,
    ``2 g Psi (D-1)/D`` bytes per node; parameters are all-gathered inside the
    node.  ``instances = 1`` (``distopt``): reduce-scatter of gradients and
    all-gather of parameters over all P ranks, ``(P-1)/P (g+w) Psi`` per node. A
    reduce-scatter on gloo moves an all-reduce's bytes (``reduce_scatter_factor``).

    ``context_parallel`` C: the ranks are virtual ranks of C context-parallel GPUs each
    (:mod:`megatron_tawpipe.sim.context_parallel`); the gradient and parameter rings run over the data x
    context-parallel GPUs, C times the ranks, each with the whole model (memory and the optimizer step stay
    the virtual ranks' figures)."""
    P, D, N, L = num_ranks, num_groups, num_microbatches, num_layers
    d = P // D
    R, r = P * context_parallel, d * context_parallel      # ring members: all of them, those of a node
    w = cost.dtype_bytes
    psi = total_params(cost, L)
    shards = P // instances
    fwd, bwd = per_microbatch(cost, L)
    if instances == 1:
        link = cost.inter if D > 1 else cost.intra
        rsf = cost.reduce_scatter_factor
        t_rs, t_ag = ring_time(link, grad_bytes * psi, R, factor=rsf), ring_time(link, w * psi, R)
        node_bytes = (R - 1) / R * (rsf * grad_bytes + w) * psi if D > 1 else 0.0
        intra = (R - (D if D > 1 else 0)) * (R - 1) / R * (rsf * grad_bytes + w) * psi
        name = "distopt"
    else:
        if instances != D:
            raise ValueError("distopt-node needs one instance per node (instances = num_groups)")
        t_rs = ring_time(cost.intra, grad_bytes * psi, r, factor=cost.reduce_scatter_factor) + \
            ring_time(cost.inter, grad_bytes * psi, D, 2.0)
        t_ag = ring_time(cost.intra, w * psi, r)
        node_bytes = 2 * grad_bytes * psi * (D - 1) / D
        intra = R * (r - 1) / r * (cost.reduce_scatter_factor * grad_bytes + w) * psi
        name = "distopt-node"
    # Buckets of a layer: the last reduce-scatter follows the last backward, the first gather precedes
    # the first forward. More than one instance reduces each bucket synchronously, relying on a side
    # CUDA stream for overlap: on gloo the reductions add to the iteration (the gathers stay asynchronous).
    rs_buckets = 1 if instances > 1 and cost.library_collectives_block else L
    shown = exposed(t_rs, bwd, rs_buckets) + exposed(t_ag, fwd, L)
    iteration = N * (fwd + bwd) + shown + psi / shards * cost.optimizer_time_per_param
    mem = replicated_state(psi, shards, w, False, False, shards)
    mem.notes["comm_buffers"] = "none extra: buckets are views of the grad and param buffers"
    mem.activations, mem.notes["activations"] = native_activations(cost, L, 1)
    mem.logits, mem.notes["logits"] = logits_bytes(cost), _logits_note(cost)
    return _result(name, P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes if D > 1 else 0.0, "intra": intra}, mem,
                   inter_bytes_per_node=node_bytes, exposed_comm_s=shown,
                   instances=instances, trainable=True)


def simulate_hfsdp(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                   num_microbatches: int, grad_bytes: int = 4, unit_layers: int = 1) -> SimResult:
    """Megatron-FSDP, ``optim_grads_params`` inside the node and optimizer
    sharding across nodes (HFSDP): per-micro-batch gathers and reduce-scatters
    inside the node; once per step the gradients are reduce-scattered across nodes
    and the updated weights all-gathered across nodes -- twice, as megatron-core
    runs it: the gather the optimizer step starts for the next iteration
    (``start_param_sync`` with ``--overlap-param-gather``, megatron_fsdp.py:1120 in
    0.16.1) and again in the first micro-batch's forward (the outer gather runs
    whenever ``microbatch_count`` is 0, :444; the same in 0.17 and later), so
    ``(2w + g) Psi (D-1)/D`` bytes per node (the reduce-scatter's share doubled on
    gloo, which moves an all-reduce's bytes for it); memory
    ``Opt/(d D) + (Grad + Weight)/d``."""
    P, D, N, L = num_ranks, num_groups, num_microbatches, num_layers
    d = P // D
    w = cost.dtype_bytes
    units = L // unit_layers
    unit_params, ag, rs, per_unit, edges = _sharded_units(cost, d, unit_layers, grad_bytes)
    psi = total_params(cost, L)
    fwd, bwd = per_microbatch(cost, L)
    per_mb = units * per_unit + cost.head_forward + cost.head_backward
    t_rs = ring_time(cost.inter, grad_bytes * psi, D, factor=cost.reduce_scatter_factor)
    t_ag = ring_time(cost.inter, w * psi, D)
    # per unit: both outer gathers before and beside the first forward, its first unit's exposed; the last
    # unit's outer reduce-scatter after the last backward
    shown = exposed(t_rs, bwd, units) + exposed(2 * t_ag, fwd, units)
    node_bytes = (2 * w + cost.reduce_scatter_factor * grad_bytes) * psi * (D - 1) / D
    iteration = N * per_mb + edges + shown + psi / P * cost.optimizer_time_per_param
    intra = N * units * P * (d - 1) / d * unit_params * (2 * w + cost.reduce_scatter_factor * grad_bytes)
    mem = _fsdp_memory(cost, L, psi, unit_params, d, grad_bytes, d, P)
    return _result("hfsdp", P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes, "intra": intra}, mem,
                   wbuf=2 * unit_params * w + cost.replicated_params * w,
                   gbuf=unit_params * grad_bytes, nw=2, ng=1, inter_bytes_per_node=node_bytes,
                   exposed_comm_s=shown, unit_layers=unit_layers)


def plan_memory_fields(plan, cost: CostModel):
    """The simulator's memory fields of ``plan`` without simulating it (they
    depend on the plan's order only): an object with ``weight_buffers``,
    ``grad_buffers``, ``weight_buffer_bytes``, ``grad_buffer_bytes``,
    ``activation_bytes``, ``state_bytes`` as :func:`megatron_tawpipe.sim.simulate.simulate` sets them."""
    from types import SimpleNamespace

    return SimpleNamespace(**memory_fields(plan, cost))


def plan_memory(result: SimResult, cost: CostModel, plan) -> MemoryBreakdown:
    """Breakdown of a plan-based result as ``tools/simulate.py`` runs it."""
    if plan is None:
        return generic_breakdown(result, cost)
    chunk = plan.options.get("chunk", 1) or 1
    return weight_passing_breakdown(result, cost, plan, chunk)


def run_strategy(name: str, cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                 num_microbatches: int, plan_cache: Optional[Dict] = None, context_parallel: int = 1) -> SimResult:
    """One of :data:`STRATEGIES` with ``num_microbatches`` per rank (the
    global batch of ``tools/simulate.py``); ``context_parallel`` C > 1 (distopt, distopt-node, pp-nodes): the
    ranks are virtual ranks of C GPUs (:mod:`megatron_tawpipe.sim.context_parallel`)."""
    P, D, L, N, C = num_ranks, num_groups, num_layers, num_microbatches, context_parallel
    if C > 1 and name in ("hsdp", "hfsdp"):
        raise ValueError(f"{name} does not run context parallelism (FSDP)")
    if name == "hsdp":
        return simulate_hsdp(cost, P, D, L, N)
    if name == "distopt-node":
        return simulate_distopt(cost, P, D, L, N, instances=D, context_parallel=C)
    if name == "distopt":
        return simulate_distopt(cost, P, D, L, N, instances=1, context_parallel=C)
    if name == "hfsdp":
        return simulate_hfsdp(cost, P, D, L, N)
    if name == "pp-nodes":
        return simulate_pipeline(cost, P, D, L, N * P, pipeline_size=D, plan_cache=plan_cache, context_parallel=C)
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
