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

* a collective that megatron / FSDP starts per bucket or unit during the last
  micro-batch's backward (``overlap_grad_reduce``; HSDP's cross-node
  all-reduce, issued after each unit's last reduce-scatter) hides behind the
  rest of that backward: exposed ``max(0, T_comm - T_backward * (L-1)/L)``;
* a parameter all-gather after the optimizer step (``overlap_param_gather``,
  HFSDP's outer all-gather) hides behind the next iteration's first forward
  likewise;
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

from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

from megatron_tawpipe.common.layer_split import check_layer_split, default_layer_split, is_even
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import (MemoryBreakdown, gb, generic_breakdown, logits_bytes, native_activations,
                     replicated_state, weight_passing_breakdown, _logits_note)
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.sim.simulate import SimResult, memory_fields, simulate
from megatron_tawpipe.sim.stages import split_label

INF = float("inf")

#: strategy -> (description, trainable with pretrain_llama.py)
STRATEGIES = {
    "hsdp": ("FSDP2 sharded inside each node, replicated across nodes", True),
    "distopt-node": ("megatron distributed optimizer, one instance per node", True),
    "distopt": ("megatron distributed optimizer over all ranks", True),
    "hfsdp": ("Megatron-FSDP, sharded inside nodes, optimizer sharded across nodes", False),
    "pp-nodes": ("megatron 1F1B, one stage per node, distributed optimizer inside it", True),
}


def _ring(link: Link, nbytes: float, n: int, factor: float = 1.0) -> float:
    """Time of a ring reduce-scatter / all-gather (factor 2: all-reduce)."""
    if n <= 1:
        return 0.0
    bw = 0.0 if link.bandwidth == INF else (n - 1) / n * nbytes / link.bandwidth
    return factor * ((n - 1) * link.latency + bw)


def total_params(cost: CostModel, num_layers: int) -> float:
    return num_layers * cost.params_per_layer + cost.replicated_params


def _per_mb(cost: CostModel, num_layers: int):
    """(forward, backward incl. recompute) of one micro-batch through the whole model."""
    fwd = num_layers * cost.layer_forward + cost.head_forward
    bwd = num_layers * (cost.layer_backward + cost.layer_recompute) + cost.head_backward
    return fwd, bwd


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
    ag = _ring(cost.intra, unit_params * cost.dtype_bytes, d)
    rs = _ring(cost.intra, unit_params * grad_bytes, d, factor=cost.reduce_scatter_factor)
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
    fwd, bwd = _per_mb(cost, L)
    per_mb = units * per_unit + cost.head_forward + cost.head_backward
    node_bytes = 2 * grad_bytes * psi * (D - 1) / D
    t_ar = _ring(cost.inter, grad_bytes * psi, D, factor=2.0)
    exposed = t_ar if cost.library_collectives_block else max(0.0, t_ar - bwd * (units - 1) / units)
    iteration = N * per_mb + edges + exposed + psi / d * cost.optimizer_time_per_param
    intra = N * units * P * (d - 1) / d * unit_params * (2 * cost.dtype_bytes + cost.reduce_scatter_factor * grad_bytes)
    mem = _fsdp_memory(cost, L, psi, unit_params, d, grad_bytes, None, d)
    return _result("hsdp", P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes, "intra": intra}, mem,
                   wbuf=2 * unit_params * cost.dtype_bytes + cost.replicated_params * cost.dtype_bytes,
                   gbuf=unit_params * grad_bytes, nw=2, ng=1, inter_bytes_per_node=node_bytes,
                   exposed_comm_s=exposed, unit_layers=unit_layers, trainable=True)


def simulate_distopt(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                     num_microbatches: int, instances: int = 1, grad_bytes: int = 4) -> SimResult:
    """Megatron DDP + distributed optimizer (``overlap_grad_reduce``,
    ``overlap_param_gather``).  Every rank holds the bf16 model and an fp32
    gradient buffer; the optimizer state is sharded over the P/instances ranks of
    an instance.  ``instances = D`` (``distopt-node``): gradients are
    reduce-scattered inside the node, each shard all-reduced across instances,
    ``2 g Psi (D-1)/D`` bytes per node; parameters are all-gathered inside the
    node.  ``instances = 1`` (``distopt``): reduce-scatter of gradients and
    all-gather of parameters over all P ranks, ``(P-1)/P (g+w) Psi`` per node."""
    P, D, N, L = num_ranks, num_groups, num_microbatches, num_layers
    d = P // D
    w = cost.dtype_bytes
    psi = total_params(cost, L)
    shards = P // instances
    fwd, bwd = _per_mb(cost, L)
    if instances == 1:
        link = cost.inter if D > 1 else cost.intra
        t_rs, t_ag = _ring(link, grad_bytes * psi, P), _ring(link, w * psi, P)
        node_bytes = (P - 1) / P * (grad_bytes + w) * psi if D > 1 else 0.0
        intra = (P - (D if D > 1 else 0)) * (P - 1) / P * (grad_bytes + w) * psi
        name = "distopt"
    else:
        if instances != D:
            raise ValueError("distopt-node needs one instance per node (instances = num_groups)")
        t_rs = _ring(cost.intra, grad_bytes * psi, d) + _ring(cost.inter, grad_bytes * psi, D, 2.0)
        t_ag = _ring(cost.intra, w * psi, d)
        node_bytes = 2 * grad_bytes * psi * (D - 1) / D
        intra = P * (d - 1) / d * (grad_bytes + w) * psi
        name = "distopt-node"
    hide = (L - 1) / L
    # More than one instance reduces each bucket synchronously, relying on a side CUDA stream for
    # overlap: on gloo the reductions add to the iteration (the parameter gathers stay asynchronous).
    hide_rs = 0.0 if instances > 1 and cost.library_collectives_block else hide
    exposed = max(0.0, t_rs - bwd * hide_rs) + max(0.0, t_ag - fwd * hide)
    iteration = N * (fwd + bwd) + exposed + psi / shards * cost.optimizer_time_per_param
    mem = replicated_state(psi, shards, w, False, False, shards)
    mem.notes["comm_buffers"] = "none extra: buckets are views of the grad and param buffers"
    mem.activations, mem.notes["activations"] = native_activations(cost, L, 1)
    mem.logits, mem.notes["logits"] = logits_bytes(cost), _logits_note(cost)
    return _result(name, P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes if D > 1 else 0.0, "intra": intra}, mem,
                   inter_bytes_per_node=node_bytes, exposed_comm_s=exposed,
                   instances=instances, trainable=True)


def simulate_hfsdp(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                   num_microbatches: int, grad_bytes: int = 4, unit_layers: int = 1) -> SimResult:
    """Megatron-FSDP, ``optim_grads_params`` inside the node and optimizer
    sharding across nodes (HFSDP): per-micro-batch gathers and reduce-scatters
    inside the node; once per step the gradients are reduce-scattered and the
    updated weights all-gathered across nodes, ``(w+g) Psi (D-1)/D`` bytes per
    node; memory ``Opt/(d D) + (Grad + Weight)/d``.  Simulator only: it runs in
    Megatron-LM, not in this project."""
    P, D, N, L = num_ranks, num_groups, num_microbatches, num_layers
    d = P // D
    w = cost.dtype_bytes
    units = L // unit_layers
    unit_params, ag, rs, per_unit, edges = _sharded_units(cost, d, unit_layers, grad_bytes)
    psi = total_params(cost, L)
    fwd, bwd = _per_mb(cost, L)
    per_mb = units * per_unit + cost.head_forward + cost.head_backward
    t_rs, t_ag = _ring(cost.inter, grad_bytes * psi, D), _ring(cost.inter, w * psi, D)
    hide = (units - 1) / units
    exposed = max(0.0, t_rs - bwd * hide) + max(0.0, t_ag - fwd * hide)
    node_bytes = (w + grad_bytes) * psi * (D - 1) / D
    iteration = N * per_mb + edges + exposed + psi / P * cost.optimizer_time_per_param
    intra = N * units * P * (d - 1) / d * unit_params * (2 * w + cost.reduce_scatter_factor * grad_bytes)
    mem = _fsdp_memory(cost, L, psi, unit_params, d, grad_bytes, d, P)
    return _result("hfsdp", P, cost, N, iteration, N * (fwd + bwd),
                   {"inter": D * node_bytes, "intra": intra}, mem,
                   wbuf=2 * unit_params * w + cost.replicated_params * w,
                   gbuf=unit_params * grad_bytes, nw=2, ng=1, inter_bytes_per_node=node_bytes,
                   exposed_comm_s=exposed, unit_layers=unit_layers, trainable=False,
                   note="Megatron-FSDP HFSDP runs in Megatron-LM, not in this project")


# -------------------------------------------------------------- plan-based
def peak_stash(plan, layers: bool = False) -> list:
    """Per rank, the most micro-batch shard inputs stored at once (plan order only); ``layers``: the
    most decoder layers' inputs (each stored shard input counted with its shard's layers)."""
    out = []
    for acts in plan.actions:
        cur = best = 0
        for a in acts:
            t = type(a)
            if t is A.Forward:
                cur += plan.shard_layers[a.shard] if layers else 1
                best = max(best, cur)
            elif t is A.Backward or t is A.BackwardWeight:
                cur -= plan.shard_layers[a.shard] if layers else 1
        out.append(best)
    return out


def _cached_plan(cache: Optional[Dict], key, build):
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def simulate_extended(build, cost: CostModel, n: int, n1: int, n2: int) -> SimResult:
    """Simulate the plan ``build(n)`` of ``n`` micro-batches; when ``n > n2``
    simulate ``n1`` and ``n2`` instead and extend linearly.  Once a schedule
    is in its steady state every further micro-batch (round) adds the same
    time, compute and bytes.  Checked against full simulations (16-24 ranks,
    10 and 100 Gbit/s, tests/test_advisor.py): TawPipe and 1F1B from 2 and 4
    visits / 2p and 4p micro-batches exactly, WeiPipe within 0.2%, interleaved
    1F1B within 0.5%.  Memory fields are those of the ``n2``
    plan (buffers and stored boundaries saturate after a few micro-batches)."""
    if n <= n2:
        return simulate(build(n), cost, record=False)
    r1 = simulate(build(n1), cost, record=False)
    r2 = simulate(build(n2), cost, record=False)
    f = (n - n2) / (n2 - n1)
    ext = lambda a, b: b + f * (b - a)  # noqa: E731
    T = ext(r1.iteration_time, r2.iteration_time)
    busy = [ext(a, b) for a, b in zip(r1.compute_time, r2.compute_time)]
    P = r2.num_ranks
    tokens = r2.tokens_per_sec_per_rank * r2.iteration_time * n / n2
    return replace(r2, iteration_time=T, tokens_per_sec_per_rank=tokens / T,
                   bubble_ratio=1.0 - sum(busy) / (P * T), compute_time=busy, finish_time=[T] * P,
                   link_bytes={k: ext(r1.link_bytes[k], v) for k, v in r2.link_bytes.items()},
                   options=dict(r2.options, extended_from=(n1, n2)))


def simulate_pipeline(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                      total_microbatches: int, pipeline_size: int, virtual_stages: int = 1,
                      grad_bytes: int = 4, plan_cache: Optional[Dict] = None,
                      name: Optional[str] = None, exact: bool = True,
                      stage_layers: Optional[Sequence[int]] = None) -> SimResult:
    """Megatron pipeline of ``pipeline_size`` stages (a multiple of D: every stage
    inside one node, stage boundaries crossing nodes D-1 times), data-parallel
    size ``dp = P / pipeline_size`` inside each stage's node with the
    distributed optimizer and ``overlap_grad_reduce``.  One pipeline runs the
    1F1B (or interleaved) plan on ``total_microbatches / dp`` micro-batches; the
    dp pipelines share each node link, so it sees ``inter_bw / dp``.  Only
    stage-boundary activations cross nodes; gradients are reduced inside the
    node once per iteration.  Megatron's layout: embedding on the first stage,
    output layer on the last, no embedding all-reduce (untied).  ``stage_layers``:
    decoder layers per (virtual) stage in layer order (default: as equal as possible,
    the larger first); every stage is priced with its own layers, so the slowest sets
    the pipeline's pace, and the data-parallel reduction of the largest stage is the one
    that shows.  ``exact=False``: more than 4 x pipeline_size micro-batches per pipeline
    are simulated as 2x and 4x and extended (:func:`simulate_extended`)."""
    P, D, L, pp, V = num_ranks, num_groups, num_layers, pipeline_size, virtual_stages
    dp, m = _pipeline_shape(P, D, total_microbatches, pp)
    split = _stage_split(L, pp, V, stage_layers)
    schedule = "interleaved" if V > 1 else "1f1b"
    n1, n2 = (2 * pp, 4 * pp) if not exact else (m, m)
    build = lambda n: _pipeline_plan(D, L, n, pp, V, plan_cache, split)[0]  # noqa: E731
    inter = Link(cost.inter.bandwidth / dp, cost.inter.latency)
    sim_cost = replace(cost, inter=inter, pair_bandwidth=cost.pair_bandwidth or cost.inter.bandwidth,
                       replicated_params=0.0, embedding_params=0.0, optimizer_time_per_param=0.0)
    r = simulate_extended(build, sim_cost, m, n1, n2)
    best = pipeline_memory(cost, P, D, L, total_microbatches, pp, V, plan_cache, min(m, n2), split)
    w = cost.dtype_bytes
    # Each rank reduces its stage's gradients over its dp replicas after its last backward (overlapped
    # with it) and gathers parameters before the next forward; the rank that exposes most shows.
    extra, psi_all = 0.0, 0.0
    for rank, layers, psi_stage in _stage_params(cost, split, pp):
        t_rs, t_ag = _ring(cost.intra, grad_bytes * psi_stage, dp), _ring(cost.intra, w * psi_stage, dp)
        s_fwd = layers * cost.layer_forward
        s_bwd = layers * (cost.layer_backward + cost.layer_recompute)
        exposed = max(0.0, t_rs - s_bwd) + max(0.0, t_ag - s_fwd)
        extra = max(extra, exposed + psi_stage / dp * cost.optimizer_time_per_param)
        psi_all += psi_stage
    iteration = r.iteration_time + extra
    compute = sum(r.compute_time) * dp
    tokens = total_microbatches * cost.tokens_per_microbatch
    lb = {k: v * dp for k, v in r.link_bytes.items()}
    lb["intra"] += dp * (dp - 1) / dp * (grad_bytes + w) * psi_all if dp > 1 else 0.0
    options = dict(pipeline_size=pp, data_parallel=dp, virtual_stages=V, microbatches_per_pipeline=m,
                   inter_bytes_per_node=lb["inter"] / D, exposed_comm_s=extra,
                   analytic=False, memory_breakdown=best.as_dict(), trainable=True)
    if not is_even(split):
        options["stage_layers"] = list(split)
    if "extended_from" in r.options:
        options["extended_from"] = r.options["extended_from"]
    return SimResult(
        schedule=name or ("pp-nodes" if pp == D and V == 1 else schedule), num_ranks=P,
        iteration_time=iteration, tokens_per_sec_per_rank=tokens / iteration / P,
        bubble_ratio=1.0 - compute / (P * iteration), link_bytes=lb,
        replicated_allreduce_bytes=0.0, weight_buffers=0, grad_buffers=0,
        weight_buffer_bytes=0.0, grad_buffer_bytes=best.comm_buffers,
        activation_bytes=best.activations,
        state_bytes=best.weights + best.grads + best.optimizer,
        compute_time=[compute / P] * P, finish_time=[iteration] * P, options=options)


def _stage_split(L, pp, V, stage_layers) -> Tuple[int, ...]:
    """Decoder layers per virtual stage (layer order; rank ``k mod pp`` holds stage ``k``)."""
    if stage_layers is None:
        return default_layer_split(L, pp * V)
    return check_layer_split(stage_layers, L, pp * V)


def _stage_params(cost: CostModel, split, pp):
    """(rank, decoder layers, parameters) of every pipeline rank: its stages' layers, the embedding on
    the first, the output layer on the last."""
    emb = cost.embedding_params
    head = cost.replicated_params - emb
    for rank in range(pp):
        layers = sum(split[rank::pp])
        params = layers * cost.params_per_layer + (emb if rank == 0 else 0.0) + (head if rank == pp - 1 else 0.0)
        yield rank, layers, params


def _pipeline_shape(P, D, total_microbatches, pp):
    if pp % D or P % pp:
        raise ValueError(f"pipeline size {pp} must be a multiple of the {D} nodes and divide {P} ranks")
    dp = P // pp
    if total_microbatches % dp:
        raise ValueError(f"{total_microbatches} micro-batches do not split over {dp} pipelines")
    return dp, total_microbatches // dp


def _pipeline_plan(D, L, m, pp, V, plan_cache, split=None):
    """(plan, per-rank peak of stored micro-batch chunks, per-rank peak of stored layer inputs) of one
    pipeline of m micro-batches."""
    schedule = "interleaved" if V > 1 else "1f1b"
    opts = {"virtual_stages": V} if V > 1 else {}
    split = _stage_split(L, pp, V, split)

    def build():
        plan = build_plan(schedule, num_ranks=pp, num_groups=D, num_layers=L, num_microbatches=m,
                          shard_layers=split, **opts)
        return plan, peak_stash(plan), peak_stash(plan, layers=True)
    return _cached_plan(plan_cache, (schedule, pp, D, L, m, V, split), build)


def pipeline_memory(cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                    total_microbatches: int, pipeline_size: int, virtual_stages: int = 1,
                    plan_cache: Optional[Dict] = None,
                    plan_microbatches: Optional[int] = None,
                    stage_layers: Optional[Sequence[int]] = None) -> MemoryBreakdown:
    """Per-GPU memory of :func:`simulate_pipeline`'s layout: the largest over the
    pipeline's ranks, each with its own stages' layers (the first also holds the
    embedding and the most micro-batches in flight: the plan's peak; the last the
    output layer and its logits); the distributed optimizer shards
    the stage's optimizer state over the data-parallel ranks.
    ``plan_microbatches``: read the peaks from a plan of that many micro-batches
    per pipeline (they saturate once the warm-up fits)."""
    P, L, pp, V = num_ranks, num_layers, pipeline_size, virtual_stages
    dp, m = _pipeline_shape(P, num_groups, total_microbatches, pp)
    split = _stage_split(L, pp, V, stage_layers)
    _, peaks, layer_peaks = _pipeline_plan(num_groups, L, plan_microbatches or m, pp, V, plan_cache, split)
    w = cost.dtype_bytes
    best = None
    for rank, layers, params in _stage_params(cost, split, pp):
        mem = replicated_state(params, dp, w, False, False, dp, label=" (stage %d)" % rank)
        mem.comm_buffers = 2 * cost.activation_bytes
        mem.notes["comm_buffers"] = f"send + receive boundary {gb(cost.activation_bytes)} x 2"
        chunks = split[rank::pp]
        if len(set(chunks)) == 1:
            mem.activations, note = native_activations(cost, chunks[0], peaks[rank])
        else:   # chunks of different sizes: the peak of stored layer inputs, in layers
            mem.activations, note = native_activations(cost, layer_peaks[rank], 1)
            note = note.replace("1 mb x ", "", 1) + f" (peak over chunks of {split_label(chunks)} layers)"
        mem.notes["activations"] = f"stage {rank}: " + note
        if rank == pp - 1:
            mem.logits, mem.notes["logits"] = logits_bytes(cost), _logits_note(cost)
        if best is None or mem.total > best.total:
            best = mem
    return best


def plan_memory_fields(plan, cost: CostModel):
    """The simulator's memory fields of ``plan`` without simulating it (they
    depend on the plan's order only): an object with ``weight_buffers``,
    ``grad_buffers``, ``weight_buffer_bytes``, ``grad_buffer_bytes``,
    ``activation_bytes``, ``state_bytes`` as :func:`megatron_tawpipe.sim.simulate.simulate` sets them."""
    from types import SimpleNamespace

    return SimpleNamespace(**memory_fields(plan, cost, max(peak_stash(plan))))


def plan_memory(result: SimResult, cost: CostModel, plan) -> MemoryBreakdown:
    """Breakdown of a plan-based result as ``tools/simulate.py`` runs it."""
    if plan is None:
        return generic_breakdown(result, cost)
    chunk = plan.options.get("chunk", 1) or 1
    return weight_passing_breakdown(result, cost, plan, chunk)


def run_strategy(name: str, cost: CostModel, num_ranks: int, num_groups: int, num_layers: int,
                 num_microbatches: int, plan_cache: Optional[Dict] = None) -> SimResult:
    """One of :data:`STRATEGIES` with ``num_microbatches`` per rank (the
    global batch of ``tools/simulate.py``)."""
    P, D, L, N = num_ranks, num_groups, num_layers, num_microbatches
    if name == "hsdp":
        return simulate_hsdp(cost, P, D, L, N)
    if name == "distopt-node":
        return simulate_distopt(cost, P, D, L, N, instances=D)
    if name == "distopt":
        return simulate_distopt(cost, P, D, L, N, instances=1)
    if name == "hfsdp":
        return simulate_hfsdp(cost, P, D, L, N)
    if name == "pp-nodes":
        return simulate_pipeline(cost, P, D, L, N * P, pipeline_size=D, plan_cache=plan_cache)
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
