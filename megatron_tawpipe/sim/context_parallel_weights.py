"""Context parallelism inside weight passing (``tawpipe`` / ``weipipe`` with ``--context-parallel-size C``, beside
``--tensor-model-parallel-size T`` or not), as the simulator prices it: in the same detail as the native strategies'
(:mod:`.context_parallel`), what :mod:`megatron_tawpipe.runtime.context_parallel` runs.

The plan runs over P / (T x C) *virtual ranks*, each T x C GPUs of one node. GPU (t, c) holds tensor-parallel slice
t of every shard (1/T of its bytes, whole over the C members) and moves piece c of that slice in every transfer
(1/(T x C) of the plan's bytes), with:

* **compute** the native side's (:func:`~megatron_tawpipe.sim.context_parallel.context_parallel_cost` at T x C):
  per decoder layer and micro-batch 1/(T x C) of the layer's work (the linear layers per token, the causal score
  blocks balanced by the 2C-chunk split), megatron's tensor-parallel collectives of the local tokens' hidden state
  (:func:`~megatron_tawpipe.sim.tensor_parallel.virtual_rank_cost`) and the ring attention's exposed time on the
  node's link, forward, backward and recompute; the output layer 1/(T x C) plus its tensor-parallel collective;
* **weight and gradient transfers** in the plan's bytes unchanged: GPU (t, c) moves piece c of slice t, each on its
  own GPU's link inside the node (T x C times one GPU's bandwidth, as tensor parallelism's slices alone), all of
  them through the node's one link between nodes, so that link carries the bytes of T x C = 1;
* **the pieces' collectives** over the C members of a virtual rank that share a tensor-parallel rank t, each
  carrying that GPU's slice (the bytes of T = 1 / T) on one GPU's link inside the node (the T groups of C run side
  by side on their own links), blocking the rank (the runtime issues them synchronously at the plan's member
  points, :func:`megatron_tawpipe.plan.context_parallel.member_points`: :class:`PieceCollectives`): the
  all-gather of a weight that arrived (a receive, a broadcast's non-root) before it is used; the reduce-scatter of
  a gradient before it leaves (a send, a reduction to its owner, the all-reduce of a replicated shard's holders;
  gloo's moves an all-reduce's bytes, ``CostModel.reduce_scatter_factor``); the reduce-scatter of the replicated
  parameters' gradients before their all-reduce over the virtual ranks (each lane all-reduces its piece); and
  around the optimizer step the reduce-scatter of every accumulated gradient the rank keeps (its owned shards',
  and the replicated parameters' where the plan has not reduced them) and the all-gather of their stepped fp32
  masters (:mod:`megatron_tawpipe.runtime.member_state`);
* **the optimizer** over piece c of the GPU's tensor-parallel slice: 1/(T x C) of the virtual rank's parameters;
* **memory** per GPU: the activations and logits / (T x C) (the local tokens, sequence-parallel over T);
  weights, gradients, buffers and fp32 masters / T (the slice, whole on every member), the Adam moments
  / (T x C) (each member keeps its piece's);
* tokens/s per GPU: 1/(T x C) of the virtual rank's.

With C = 1 this is tensor parallelism's pricing (:mod:`.tensor_parallel`), with T = 1 context parallelism's at
C GPUs per virtual rank. The replicated parameters' slices are priced as 1/T (the embedding and the output layer
are split over the vocabulary; the final norm, whole on every tensor-parallel rank, is a few kB).

Ring collectives: an all-gather of B bytes over C members sends (C-1)/C x B per member in C-1 steps, an all-reduce
2(C-1)/C x B in 2(C-1), each step paying the link's latency.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Dict, Mapping, Optional, Tuple

from megatron_tawpipe.plan.context_parallel import member_points
from megatron_tawpipe.sim.context_parallel import (AttentionShape, context_parallel_bytes_per_gpu,
                                                   context_parallel_cost, context_parallel_ring_seconds_per_gpu)
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import TERMS, MemoryBreakdown
from megatron_tawpipe.sim.tensor_parallel import per_gpu_breakdown as tensor_parallel_breakdown

#: memory terms that hold the local tokens' share inside weight passing (the rest are whole on every member)
LOCAL_TOKEN_TERMS = ("activations", "logits")
#: bytes of an fp32 master and of its two Adam moments (the memory model's optimizer term: 12 B per parameter)
MASTER_BYTES, MOMENT_BYTES = 4.0, 8.0


def optimizer_share(cp: int) -> float:
    """The part of the optimizer term (fp32 master + Adam moments) a member keeps: the whole master, 1/C of the
    moments."""
    return (MASTER_BYTES + MOMENT_BYTES / cp) / (MASTER_BYTES + MOMENT_BYTES)


def weight_passing_cost(cost: CostModel, cp: int, shape: AttentionShape, tp: int = 1) -> CostModel:
    """The cost model of one virtual rank of T x C GPUs: the native side's compute, tensor-parallel collectives and
    ring (:func:`~megatron_tawpipe.sim.context_parallel.context_parallel_cost`), the plan's transfers inside the
    node on T x C GPUs' links, and the optimizer over piece c of the tensor-parallel slice. C = 1: tensor
    parallelism's :func:`~megatron_tawpipe.sim.tensor_parallel.virtual_rank_cost`."""
    virtual = context_parallel_cost(cost, cp, shape, tp)
    return replace(virtual, intra=Link(cost.intra.bandwidth * tp * cp, cost.intra.latency),
                   # every member steps its piece of the masters of its tensor-parallel slice
                   optimizer_time_per_param=cost.optimizer_time_per_param / (tp * cp))


class PieceCollectives:
    """The context-parallel collectives one member runs beside the plan's actions (``simulate(..., around=)``),
    in seconds; ``cost`` is one GPU's (its link inside the node), ``plan`` the virtual ranks' plan, ``tp`` the
    tensor-parallel size beside C (each collective carries the GPU's slice: 1/T of the bytes)."""

    def __init__(self, cost: CostModel, cp: int, plan, tp: int = 1):
        self.cost, self.cp, self.plan, self.tp = cost, cp, plan, tp
        self.link = cost.intra
        self.bytes = {"gather": 0.0, "scatter": 0.0}   # per virtual rank's member, one iteration
        # where the members meet: the plan's member points (the executor's), as {rank: {tag of the start: op}}
        points = [[p for p in member_points(acts, r, compute=False) if p.op != "sum"]
                  for r, acts in enumerate(plan.actions)]
        self.points = [{p.action.tag: p.op for p in rank} for rank in points]
        # the replicated parts whose pieces the plan leaves summed (not reduce-scattered again before the step)
        summed = [{p.action.part for p in rank if p.op == "replicated"} for rank in points]
        self.summed_replicated = [cost.replicated_params if "all" in parts
                                  else sum(cost.replicated_part_params(part) for part in parts) for parts in summed]

    def _ring(self, nbytes: float, share: float, steps: int, what: str) -> float:
        nbytes = nbytes / self.tp                # this GPU's tensor-parallel slice
        self.bytes[what] += share * nbytes
        send = 0.0 if self.link.bandwidth == float("inf") else share * nbytes / self.link.bandwidth
        return steps * self.link.latency + send

    def all_gather(self, nbytes: float) -> float:
        """A ring all-gather over the C members of the slice of ``nbytes`` (the virtual rank's, all T slices)."""
        c = self.cp
        return self._ring(nbytes, (c - 1) / c, c - 1, "gather")

    def reduce_scatter(self, nbytes: float) -> float:
        c, factor = self.cp, self.cost.reduce_scatter_factor
        return self._ring(nbytes, factor * (c - 1) / c, int(factor * (c - 1)), "scatter")

    # ---- the simulator's hooks ----------------------------------------------------------------------------
    def after_wait(self, rank: int, start) -> float:
        """A weight that arrived (a receive, a broadcast's non-root): its pieces all-gathered."""
        if start is None or self.points[rank].get(start.tag) != "gather":
            return 0.0
        return self.all_gather(start.size * self.cost.shard_bytes(self.plan, start.shard))

    def before_start(self, rank: int, start) -> float:
        """A gradient about to leave, or the replicated gradients before their all-reduce over the virtual ranks:
        reduce-scattered into the member's piece (the piece its lane moves)."""
        op = self.points[rank].get(start.tag)
        if op == "replicated":
            return self.reduce_scatter(self.cost.replicated_part_params(start.part) * self.cost.grad_bytes)
        if op == "scatter":
            return self.reduce_scatter(start.size * self.cost.grad_shard_bytes(self.plan, start.shard))
        return 0.0

    def before_optimizer(self, rank: int) -> float:
        """Every accumulated gradient the rank keeps (its owned shards', the replicated parameters' but those the
        plan's replicated reduction left summed) reduce-scattered over the members, and after the step all their
        fp32 masters all-gathered."""
        params = self.plan.layers_held_by(rank) * self.cost.params_per_layer + self.cost.replicated_params
        scattered = params - self.summed_replicated[rank]
        return self.reduce_scatter(scattered * self.cost.grad_bytes) + self.all_gather(params * MASTER_BYTES)


@dataclass(frozen=True)
class Pieces:
    """What context parallelism adds to the pricing of a weight-passing plan over virtual ranks of T x C GPUs
    besides their cost model: the pieces' collectives beside the plan's actions (:meth:`around`, for ``simulate``)
    and the memory per GPU (:meth:`per_gpu`). ``one``: one GPU's cost model by recompute setting. Picklable (a
    run's ranks share it). A reader given a :class:`Pieces` prices on the virtual ranks' cost model as it is (its
    tensor parallelism ``tp`` is in it) and turns memory per GPU with :meth:`per_gpu` alone."""

    one: Mapping[bool, CostModel]
    cp: int
    tp: int = 1

    def around(self, recompute: bool):
        """``around(plan)``: the :class:`PieceCollectives` of a plan priced with ``recompute``."""
        return partial(PieceCollectives, self.one[recompute], self.cp, tp=self.tp)

    def per_gpu(self, memory: MemoryBreakdown) -> MemoryBreakdown:
        return per_gpu_breakdown(memory, self.cp, self.tp)


def virtual_rank_pricing(one: Mapping[bool, CostModel], cp: int, shape: AttentionShape, tp: int = 1
                         ) -> Tuple[Dict[bool, CostModel], Optional[Pieces]]:
    """(the virtual ranks' cost model by recompute setting, their :class:`Pieces`) of weight passing with context
    parallelism C beside tensor parallelism T, from one GPU's cost models ``one``: the one pricing of the advisor,
    of ``pretrain_llama.py``'s TawPipe layout decision, of ``tools/simulate.py`` and of ``--pipeline-schedule
    auto``. C = 1: ``one`` and None (tensor parallelism alone is sliced by each reader:
    :func:`~megatron_tawpipe.sim.tensor_parallel.virtual_rank_cost`, which :func:`weight_passing_cost` equals
    there)."""
    if cp == 1:
        return dict(one), None
    return ({rc: weight_passing_cost(cost, cp, shape, tp) for rc, cost in one.items()},
            Pieces(dict(one), cp, tp))


def per_gpu_breakdown(memory: MemoryBreakdown, cp: int, tp: int = 1) -> MemoryBreakdown:
    """A virtual rank's memory per GPU: the activations and logits / (T x C), the Adam moments / (T x C), the rest /
    T (the tensor-parallel slice, whole on every member). C = 1: tensor parallelism's (every term / T)."""
    if cp == 1:
        return tensor_parallel_breakdown(memory, tp)
    out = MemoryBreakdown(notes=dict(memory.notes))
    for term in TERMS:
        local = term in LOCAL_TOKEN_TERMS
        share = optimizer_share(cp) if term == "optimizer" else 1.0
        setattr(out, term, getattr(memory, term) * share / (tp * cp if local else tp))
        note = out.notes.get(term, "")
        if local:
            what = f"/ {tp} tensor- x {cp} context-parallel GPUs" if tp > 1 else f"/ {cp} context-parallel GPUs"
            out.notes[term] = f"({note}) {what}" if note else what
        else:
            whole = (f"(the masters whole, the Adam moments / {cp} context-parallel GPUs)" if term == "optimizer"
                     else f"(whole on each of {cp} context-parallel GPUs)")
            what = f"/ {tp} tensor-parallel GPUs {whole}" if tp > 1 else whole
            out.notes[term] = f"({note}) {what}" if note and tp > 1 else (f"{note} {what}" if note else what)
    return out


def per_gpu_result(result, cp: int, cost: CostModel, shape: AttentionShape, pieces: PieceCollectives,
                   microbatches: float, tp: int = 1):
    """A virtual-rank result of weight passing as per-GPU figures, in place: tokens/s and activations / (T x C),
    the buffers and the state / T; the ring's and the pieces' bytes per GPU inside the node in ``options``."""
    n = tp * cp
    result.tokens_per_sec_per_rank /= n
    result.activation_bytes /= n
    # the optimizer term of the state (12 B per held and replicated parameter): each member keeps 1/C of the moments
    held = max(pieces.plan.layers_held_by(r) for r in range(pieces.plan.num_ranks))
    optimizer = (MASTER_BYTES + MOMENT_BYTES) * (held * cost.params_per_layer + cost.replicated_params)
    result.state_bytes -= optimizer * (1.0 - optimizer_share(cp))
    for name in ("weight_buffer_bytes", "grad_buffer_bytes", "state_bytes"):
        setattr(result, name, getattr(result, name) / tp)
    breakdown = result.options.get("memory_breakdown")
    if breakdown is not None:
        result.options["memory_breakdown"] = per_gpu_breakdown(MemoryBreakdown.from_dict(breakdown), cp,
                                                               tp).as_dict()
    result.options["context_parallel_size"] = cp
    if tp > 1:
        result.options["tensor_model_parallel_size"] = tp
    # every virtual rank runs every layer for each of its micro-batches
    layers = pieces.plan.num_layers if hasattr(pieces.plan, "num_layers") else sum(pieces.plan.shard_layers)
    result.options["context_parallel_bytes_per_gpu"] = context_parallel_bytes_per_gpu(cost, shape, cp, tp, layers,
                                                                                      microbatches)
    result.options["context_parallel_ring_seconds_per_gpu"] = context_parallel_ring_seconds_per_gpu(
        cost, shape, cp, tp, layers, microbatches)
    ranks = max(pieces.plan.num_ranks, 1)
    result.options["context_parallel_piece_bytes_per_gpu"] = {k: v / ranks for k, v in pieces.bytes.items()}
    return result
