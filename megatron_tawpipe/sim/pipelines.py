"""Megatron pipelines beside the weight pipelines, as the advisor and ``tools/simulate.py`` price
them: every stage inside one node, data parallelism over each stage's ranks in the node
(:func:`simulate_pipeline`; ``pp-nodes`` is one stage per node), the same 1F1B / interleaved plans
the simulator runs for the plan-based schedules; their memory (:func:`pipeline_memory`); and the
linear extension of a steady-state schedule's simulation (:func:`simulate_extended`), which the
weight pipelines use too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

from megatron_tawpipe.common.layer_split import check_layer_split, default_layer_split, is_even
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.sim.collectives import exposed, pair_allreduce_time, ring_time
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import (MemoryBreakdown, gb, logits_bytes, native_activations, replicated_state,
                                         _logits_note)
from megatron_tawpipe.sim.simulate import SimResult, simulate
from megatron_tawpipe.sim.stages import split_label


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
            elif t is A.Backward or t is A.BackwardInput:     # a split backward frees them in its input pass
                cur -= plan.shard_layers[a.shard] if layers else 1
        out.append(best)
    return out


def _cached_plan(cache: Optional[Dict], key, build):
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def simulate_extended(build, cost: CostModel, n: int, n1: int, n2: int, around=None) -> SimResult:
    """Simulate the plan ``build(n)`` of ``n`` micro-batches; when ``n > n2``
    simulate ``n1`` and ``n2`` instead and extend linearly.  Once a schedule
    is in its steady state every further micro-batch (round) adds the same
    time, compute and bytes.  Checked against full simulations (16-24 ranks,
    10 and 100 Gbit/s, tests/test_advisor.py): TawPipe and 1F1B from 2 and 4
    visits / 2p and 4p micro-batches exactly, WeiPipe within 0.2%, interleaved
    1F1B within 0.5%.  Memory fields are those of the ``n2``
    plan (buffers and stored boundaries saturate after a few micro-batches). ``around(plan)``: what each rank
    runs beside the plan's actions (``simulate``'s ``around``)."""
    def run(m):
        plan = build(m)
        return simulate(plan, cost, record=False, around=around(plan) if around is not None else None)

    if n <= n2:
        return run(n)
    r1, r2 = run(n1), run(n2)
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
                      stage_layers: Optional[Sequence[int]] = None, context_parallel: int = 1) -> SimResult:
    """Megatron pipeline of ``pipeline_size`` stages (a multiple of D: every stage
    inside one node, stage boundaries crossing nodes D-1 times), data-parallel
    size ``dp = P / pipeline_size`` inside each stage's node with the
    distributed optimizer and ``overlap_grad_reduce`` (not ``overlap_param_gather``: the
    parameter gather after the step is exposed).  One pipeline runs the
    1F1B (or interleaved) plan on ``total_microbatches / dp`` micro-batches; the
    dp pipelines share each node link, so it sees ``inter_bw / dp``.  Only
    stage-boundary activations cross nodes; gradients are reduced inside the
    node once per iteration.  Megatron's layout: embedding on the first stage,
    output layer on the last; with tied embeddings (``cost.tied_embeddings``, Megatron-LM's
    default) the last stage holds its own copy of the word embedding as the output layer, and
    after the data-parallel reduction each pipeline's first and last stage all-reduce that
    matrix's gradient (megatron's word-embedding group, :func:`embedding_allreduce`), over the
    node link when the two stages sit on different nodes.  ``stage_layers``:
    decoder layers per (virtual) stage in layer order (default: as equal as possible,
    the larger first); every stage is priced with its own layers, so the slowest sets
    the pipeline's pace, and the data-parallel reduction of the largest stage is the one
    that shows.  ``exact=False``: more than 4 x pipeline_size micro-batches per pipeline
    are simulated as 2x and 4x and extended (:func:`simulate_extended`). ``context_parallel`` C: the ranks
    are virtual ranks of C context-parallel GPUs (:mod:`megatron_tawpipe.sim.context_parallel`): a boundary's
    activation leaves in C slices, each on its own link inside the node, and each stage's gradients are
    reduced over its data x context-parallel GPUs (C x dp members, each with the whole stage)."""
    P, D, L, pp, V = num_ranks, num_groups, num_layers, pipeline_size, virtual_stages
    C = context_parallel
    dp, m = _pipeline_shape(P, D, total_microbatches, pp)
    split = _stage_split(L, pp, V, stage_layers)
    schedule = "interleaved" if V > 1 else "1f1b"
    n1, n2 = (2 * pp, 4 * pp) if not exact else (m, m)
    build = lambda n: _pipeline_plan(D, L, n, pp, V, plan_cache, split)[0]  # noqa: E731
    inter = Link(cost.inter.bandwidth / dp, cost.inter.latency)
    sim_cost = replace(cost, inter=inter, pair_bandwidth=cost.pair_bandwidth or cost.inter.bandwidth,
                       replicated_params=0.0, embedding_params=0.0, optimizer_time_per_param=0.0,
                       intra=Link(cost.intra.bandwidth * C, cost.intra.latency))
    r = simulate_extended(build, sim_cost, m, n1, n2)
    best = pipeline_memory(cost, P, D, L, total_microbatches, pp, V, plan_cache, min(m, n2), split)
    w = cost.dtype_bytes
    # Each rank reduces its stage's gradients over its dp replicas in per-layer buckets during its last
    # backward (``--overlap-grad-reduce``): the last bucket follows that backward
    # (:func:`~megatron_tawpipe.sim.collectives.exposed`). The command has no --overlap-param-gather, so
    # the distributed optimizer all-gathers the updated parameters synchronously after its step
    # (megatron-core's DistributedDataParallel.start_param_sync: "when overlap_param_gather is set to
    # False, calls synchronous communication"): all of it shows. The rank that exposes most shows.
    # Tied embeddings: the first and last stage then all-reduce the word embedding's gradient, before
    # the step (megatron-core's finalize_model_grads, synchronous).
    t_emb, emb_bytes, emb_link = embedding_allreduce(cost, D, pp, dp * C, grad_bytes)
    extra, psi_all = 0.0, 0.0
    for rank, layers, psi_stage in _stage_params(cost, split, pp):
        members = dp * C
        t_rs = ring_time(cost.intra, grad_bytes * psi_stage, members)
        t_ag = ring_time(cost.intra, w * psi_stage, members)
        s_bwd = layers * (cost.layer_backward + cost.layer_recompute)
        shown = exposed(t_rs, s_bwd, layers) + t_ag + (t_emb if rank in (0, pp - 1) else 0.0)
        extra = max(extra, shown + psi_stage / dp * cost.optimizer_time_per_param)
        psi_all += psi_stage
    iteration = r.iteration_time + extra
    compute = sum(r.compute_time) * dp
    tokens = total_microbatches * cost.tokens_per_microbatch
    lb = {k: v * dp for k, v in r.link_bytes.items()}
    lb["intra"] += (dp * C - 1) * (grad_bytes + w) * psi_all if dp * C > 1 else 0.0
    if emb_bytes:
        lb[emb_link] += emb_bytes
    options = dict(pipeline_size=pp, data_parallel=dp, virtual_stages=V, microbatches_per_pipeline=m,
                   inter_bytes_per_node=lb["inter"] / D, exposed_comm_s=extra,
                   embedding_allreduce_bytes=emb_bytes, embedding_allreduce_s=t_emb,
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


def embedding_allreduce(cost: CostModel, num_groups: int, pp: int, dp: int, grad_bytes: int = 4):
    """(time, bytes of all ``dp`` pipelines, link class) of the tied word embedding's gradient all-reduce
    between each pipeline's first and last stage: a ring of 2 members, each sending the whole gradient
    (V x H x ``grad_bytes``) once; the stages sit on different nodes when the pipeline spans several
    (``num_groups`` > 1), and the ``dp`` pipelines' pairs then share the node links. None without tied
    embeddings or a pipeline (megatron has no such group then): (0, 0, "inter")."""
    if not cost.tied_embeddings or pp < 2 or not cost.embedding_params:
        return 0.0, 0.0, "inter"
    nbytes = grad_bytes * cost.embedding_params
    if num_groups > 1:
        return pair_allreduce_time(cost, nbytes, cost.inter, flows=dp), 2 * dp * nbytes, "inter"
    return pair_allreduce_time(cost, nbytes, cost.intra), 2 * dp * nbytes, "intra"


def with_embedding_allreduce(result: SimResult, cost: CostModel, num_groups: int) -> SimResult:
    """``result`` of a pipeline plan over all its ranks (``1f1b``, ``interleaved``, ``gpipe``: one
    pipeline, no data parallelism) with the tied word embedding's all-reduce between its first and
    last rank after the last backward (:func:`embedding_allreduce`): its time added to the iteration,
    its bytes to the links. Unchanged without tied embeddings."""
    P = result.num_ranks
    t, nbytes, link = embedding_allreduce(cost, num_groups, P, 1, cost.grad_bytes)
    if not nbytes:
        return result
    T = result.iteration_time + t
    lb = dict(result.link_bytes)
    lb[link] += nbytes
    return replace(result, iteration_time=T, tokens_per_sec_per_rank=result.tokens_per_sec_per_rank
                   * result.iteration_time / T, bubble_ratio=1.0 - sum(result.compute_time) / (P * T),
                   link_bytes=lb, finish_time=[f + t if r in (0, P - 1) else f for r, f in
                                               enumerate(result.finish_time)],
                   options=dict(result.options, embedding_allreduce_bytes=nbytes, embedding_allreduce_s=t))


def _stage_split(L, pp, V, stage_layers) -> Tuple[int, ...]:
    """Decoder layers per virtual stage (layer order; rank ``k mod pp`` holds stage ``k``)."""
    if stage_layers is None:
        return default_layer_split(L, pp * V)
    return check_layer_split(stage_layers, L, pp * V)


def _stage_params(cost: CostModel, split, pp):
    """(rank, decoder layers, parameters) of every pipeline rank: its stages' layers, the embedding on
    the first, the output layer on the last (tied: the last stage's copy of the word embedding)."""
    emb = cost.embedding_params
    head = cost.replicated_params - emb + (emb if cost.tied_embeddings else 0.0)
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
