"""Run a plan against a cost model: a discrete-event simulation.

Each rank executes its list in order.  Compute and local actions (load, zero,
accumulate, optimizer) occupy the rank for their duration; starts are posted
instantly; a wait blocks until its operation completed.  Starts join their
communicator's FIFO as NCCL runs them (:mod:`plan.nccl`, one FIFO per rank and
process group; a ``batch`` is one entry): an operation begins once every
participant posted it *and* has it in the head entry of its FIFO, so a posted
transfer holds its stream until its partner runs.  Then it moves its bytes:

* intra-group flows get the full intra bandwidth each (a switched fabric with
  bandwidth-optimal collectives: an intra-group broadcast or reduce takes
  ``latency + bytes/bandwidth``);
* inter-group flows share each node's outgoing and incoming link max-min
  fairly with every other flow of that node, after the link latency; on
  ``gloo``, two flows between the same two ranks in opposite directions on one
  connection (megatron's pipelines; not the weight-passing runtime, whose
  point-to-point groups are one per direction) also share one link's rate
  once each has sent ``CostModel.pair_duplex_bytes``;
* broadcasts and reductions are star-shaped (root to/from each member); a
  collective spanning several groups therefore sends one copy per remote
  member over the slow links, which is what a topology-unaware flat group
  costs;
* all-reduces (the holders' of a replicated first shard, and the replicated
  embedding / output layer's over all ranks) are rings: each member sends
  ``2(n-1)/n`` of the buffer to its successor as one flow, the hops between
  nodes sharing the node links with the other flows, and the ring pays
  ``2(n-1)`` latencies; all-gathers and reduce-scatters (the holders' of a
  shard kept in slices) likewise with ``(n-1)/n`` and ``n-1`` latencies.

Results: iteration time, tokens/s per rank, bubble ratio (idle compute
fraction), bytes per link class (the plan's transfers, :func:`plan.traffic.link_bytes`,
plus the replicated all-reduce's ring, :func:`plan.traffic.replicated_allreduce_bytes`),
buffer counts and memory, and the per-rank timeline (compute spans and transfers).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from collections import deque

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.network import Flow, max_min_rates
from megatron_tawpipe.sim.plan_facts import plan_entries, plan_structure, plan_traffic
from megatron_tawpipe.sim.plan_memory import memory_fields
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.timeline import COMPUTE_LABELS, SPAN_LABELS
from megatron_tawpipe.plan.traffic import ring_share

INF = float("inf")


@dataclass
class Span:
    rank: int
    start: float
    end: float
    kind: str        # F, B, Bi, Bw, load, zero, acc, opt
    mb: int = -1
    shard: int = -1


@dataclass
class Transfer:
    tag: int
    src: int
    dst: int
    kind: str
    link: str
    nbytes: float
    posted: float     # when the last participant posted (transfer may begin)
    end: float = 0.0


@dataclass
class SimResult:
    schedule: str
    num_ranks: int
    iteration_time: float
    tokens_per_sec_per_rank: float
    bubble_ratio: float
    link_bytes: Dict[str, float]
    replicated_allreduce_bytes: float
    weight_buffers: int
    grad_buffers: int
    weight_buffer_bytes: float
    grad_buffer_bytes: float
    activation_bytes: float
    state_bytes: float
    compute_time: List[float]
    finish_time: List[float]
    spans: List[Span] = field(default_factory=list, repr=False)
    transfers: List[Transfer] = field(default_factory=list, repr=False)
    options: dict = field(default_factory=dict)
    # (rank, step) of every Wait at which the rank blocked -> the seconds it waited there
    idle: Dict[tuple, float] = field(default_factory=dict, repr=False)

    @property
    def memory_bytes(self) -> float:
        return (self.weight_buffer_bytes + self.grad_buffer_bytes + self.activation_bytes +
                self.state_bytes)

    def row(self) -> dict:
        """Flat summary (what ``tools/simulate.py --json`` prints)."""
        return {
            "schedule": self.schedule,
            "iteration_time_s": self.iteration_time,
            "tokens_per_sec_per_rank": self.tokens_per_sec_per_rank,
            "bubble_ratio": self.bubble_ratio,
            "inter_group_bytes": self.link_bytes.get("inter", 0.0),
            "intra_group_bytes": self.link_bytes.get("intra", 0.0),
            "replicated_allreduce_bytes": self.replicated_allreduce_bytes,
            "weight_buffers": self.weight_buffers,
            "grad_buffers": self.grad_buffers,
            "weight_buffer_bytes": self.weight_buffer_bytes,
            "grad_buffer_bytes": self.grad_buffer_bytes,
            "activation_bytes": self.activation_bytes,
            "state_bytes": self.state_bytes,
            "memory_bytes": self.memory_bytes,
        }


# ----------------------------------------------------------------- simulator
class _Op:
    __slots__ = ("tag", "need", "posted", "done", "waiters", "flows_left", "start", "began")

    def __init__(self, tag: int, need: int, start):
        self.tag, self.need, self.start = tag, need, start
        self.posted = 0
        self.began = False
        self.done: Optional[float] = None
        self.waiters: List[int] = []
        self.flows_left = 0


class _Simulator:
    def __init__(self, plan: Plan, cost: CostModel, record: bool, around=None):
        self.plan, self.cost, self.record = plan, cost, record
        # what a rank does beside the plan's actions (context parallelism's pieces: :mod:`.context_parallel_weights`)
        self.around = around
        self.paid: Dict[int, int] = {}          # rank -> the step whose time before its start was spent
        self.G = plan.ranks_per_group
        self.events: list = []
        self.seq = 0
        self.ops: Dict[int, _Op] = {}
        self.pc = [0] * plan.num_ranks
        self.finish = [0.0] * plan.num_ranks
        self.busy = [0.0] * plan.num_ranks
        self.blocked_at: Dict[int, float] = {}
        self.idle: Dict[tuple, float] = {}      # (rank, step of a Wait) -> seconds the rank waited there
        self.spans: List[Span] = []
        self.transfers: List[Transfer] = []
        self.flows: List[Flow] = []
        self.net_time = 0.0
        self.net_version = 0
        self.need = plan_structure(plan)[0]   # read only
        # NCCL streams: entries (lists of tags, a batch is one entry) per (rank, communicator): (rank, tag) ->
        # the entry's number; per entry its communicator key, its tags, and (``left``) its tags not yet completed
        self.entry_of, self.entry_key, self.entry_tags, sizes = plan_entries(plan)
        self.left = list(sizes)
        self.fifo: Dict[tuple, deque] = {}
        # Bytes of one unit of each transfer kind, per shard (shards may differ in size).
        self.unit = {kind: [cost.unit_bytes(plan, kind, s) for s in range(plan.num_shards)]
                     for kind in ("weight", "grad", "act", "actgrad")}
        self.fwd = [cost.forward_time(plan, s) for s in range(plan.num_shards)]
        self.bwd = [cost.backward_time(plan, s) for s in range(plan.num_shards)]
        self.bwd_i = [cost.backward_input_time(plan, s) for s in range(plan.num_shards)]
        self.bwd_w = [cost.backward_weight_time(plan, s) for s in range(plan.num_shards)]
        self.copy = [cost.copy_time(plan, s) for s in range(plan.num_shards)]
        # per action class: (seconds per shard, span label) as :meth:`duration` gives them; the optimizer step's
        # depends on the rank (:meth:`duration`); a class not here takes no time
        half_copy = [c / 2 for c in self.copy]
        self._timed = {cls: (times, SPAN_LABELS[cls]) for cls, times in (
            (A.Forward, self.fwd), (A.Backward, self.bwd), (A.BackwardInput, self.bwd_i),
            (A.BackwardWeight, self.bwd_w), (A.LoadWeights, self.copy), (A.AccumulateToOwner, self.copy),
            (A.ZeroGrad, half_copy))}
        self._timed[A.OptimizerStep] = _OPTIMIZER

    def push(self, t, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    # ------------------------------------------------------------- main loop
    def run(self):
        for r in range(self.plan.num_ranks):
            self.push(0.0, "rank", r)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "rank":
                self.step(payload, t)
            elif kind == "done":
                self.complete(payload, t)
            elif kind == "flowend":
                self.flow_end(payload, t)
            elif kind == "enter":
                self.advance_net(t)
                self.flows.append(payload)
                self.reschedule(t)
            elif kind == "net" and payload == self.net_version:
                self.advance_net(t)
                finished = [f for f in self.flows if f.remaining <= 1e-9 * f.nbytes + 1e-6]
                if finished:
                    self.flows = [f for f in self.flows if f not in finished]
                    for f in finished:
                        f.transfer.end = t
                        self.flow_end(f.op, t)
                self.reschedule(t)
        stuck = [r for r in range(self.plan.num_ranks) if self.pc[r] < len(self.plan.actions[r])]
        if stuck:
            r = stuck[0]
            raise RuntimeError(f"simulation stalled: rank {r} at step {self.pc[r]} "
                               f"({A.describe(self.plan.actions[r][self.pc[r]])}); "
                               "validate the plan first")

    def step(self, r: int, t: float) -> None:
        acts = self.plan.actions[r]
        n, pc = len(acts), self.pc[r]
        timed = self._timed
        while pc < n:
            a = acts[pc]
            cls = type(a)
            if cls is _WAIT:
                op = self._op(a.tag)
                if op.done is None:
                    self.pc[r] = pc
                    op.waiters.append(r)
                    self.blocked_at[r] = t
                    return
                if r in self.blocked_at:
                    self.idle[(r, pc)] = t - self.blocked_at.pop(r)
                pc += 1
                after = self.around.after_wait(r, op.start.get(r)) if self.around is not None else 0.0
                if after > 0:     # a collective the rank runs once the transfer arrived
                    self.pc[r] = pc
                    self.push(t + after, "rank", r)
                    return
                continue
            if cls in _STARTS:
                if self.around is not None and self.paid.get(r) != pc:
                    before = self.around.before_start(r, a)
                    if before > 0:    # a collective the rank runs before the transfer leaves
                        self.pc[r] = pc
                        self.paid[r] = pc
                        self.push(t + before, "rank", r)
                        return
                pc += 1
                self.pc[r] = pc
                self.post(r, a, t)
                continue
            pc += 1
            how = timed.get(cls)
            if how is None:       # takes no time
                continue
            self.pc[r] = pc
            if how is _OPTIMIZER:
                dur, kind = self.duration(r, a)
            else:
                dur, kind = how[0][a.shard], how[1]
            if dur > 0:
                if kind in COMPUTE_LABELS:
                    self.busy[r] += dur
                if self.record:
                    self.spans.append(Span(r, t, t + dur, kind, getattr(a, "mb", -1),
                                           getattr(a, "shard", -1)))
                self.push(t + dur, "rank", r)
                return
        self.pc[r] = pc
        self.finish[r] = t

    def duration(self, r: int, a):
        """Seconds ``a`` keeps rank ``r`` busy, and its span label (:data:`plan.timeline.SPAN_LABELS`)."""
        cls = type(a)
        if cls is A.Forward:
            dur = self.fwd[a.shard]
        elif cls is A.Backward:
            dur = self.bwd[a.shard]
        elif cls is A.BackwardInput:
            dur = self.bwd_i[a.shard]
        elif cls is A.BackwardWeight:
            dur = self.bwd_w[a.shard]
        elif cls is A.LoadWeights or cls is A.AccumulateToOwner:
            dur = self.copy[a.shard]
        elif cls is A.ZeroGrad:
            dur = self.copy[a.shard] / 2
        elif cls is A.OptimizerStep:
            dur = self.cost.optimizer_time(self.plan, r)
            if self.around is not None:
                dur += self.around.before_optimizer(r)
        else:
            return 0.0, "other"
        return dur, SPAN_LABELS[cls]

    # ------------------------------------------------------------------ comm
    def _op(self, tag: int) -> _Op:
        op = self.ops.get(tag)
        if op is None:
            op = self.ops[tag] = _Op(tag, self.need[tag], {})
        return op

    def post(self, r: int, a, t: float) -> None:
        tag = a.tag
        op = self._op(tag)
        op.start[r] = a
        op.posted += 1
        entry = self.entry_of[(r, tag)]
        if self.entry_tags[entry][0] == tag:        # the first start of its entry: the entry joins the FIFO
            fifo = self.fifo.get((r, self.entry_key[entry]))
            if fifo is None:
                fifo = self.fifo[(r, self.entry_key[entry])] = deque()
            fifo.append(entry)
        if op.posted == op.need and self._at_heads(op):
            self.begin(op, t)

    def _at_heads(self, op: _Op) -> bool:
        entry_of, keys, fifo, tag = self.entry_of, self.entry_key, self.fifo, op.tag
        for r in op.start:
            entry = entry_of[(r, tag)]
            if fifo[(r, keys[entry])][0] != entry:
                return False
        return True

    def _leave_fifos(self, op: _Op, t: float) -> None:
        """``op`` completed: its entries may leave their FIFOs, letting the next ones run."""
        left = self.left
        for r in op.start:
            entry = self.entry_of[(r, op.tag)]
            left[entry] -= 1
            if left[entry]:
                continue
            fifo = self.fifo[(r, self.entry_key[entry])]
            fifo.popleft()
            if fifo:
                for tag in self.entry_tags[fifo[0]]:
                    nxt = self.ops.get(tag)
                    if nxt is not None and nxt.done is None and not nxt.began and \
                            nxt.posted == nxt.need and self._at_heads(nxt):
                        self.begin(nxt, t)

    def begin(self, op: _Op, t: float) -> None:
        op.began = True
        a = next(iter(op.start.values()))
        cls = type(a)
        # a ring all-gather or reduce-scatter: (n-1)/n, n-1 steps; gloo's reduce-scatter runs an all-reduce
        # (``cost.reduce_scatter_factor``), priced as for every other strategy's
        half = cls is A.AllGatherStart or (cls is A.ReduceScatterStart and self.cost.reduce_scatter_factor == 1.0)
        ring = cls is A.AllReduceStart or cls is A.ReplicatedAllReduceStart or cls in _SLICES
        if cls is A.SendStart or cls is A.RecvStart:
            for src, send in op.start.items():
                if type(send) is A.SendStart:
                    break
            else:
                raise RuntimeError(f"transfer {op.tag} has receives and no send; validate the plan first")
            pairs = [(src, send.peer)]
        elif cls is A.BroadcastStart:
            pairs = [(a.root, m) for m in a.ranks if m != a.root]
        elif ring:
            pairs = [(m, ring_share(a.ranks, m)[0]) for m in a.ranks if len(a.ranks) > 1]
        else:
            pairs = [(m, a.root) for m in a.ranks if m != a.root]
        if cls is A.ReplicatedAllReduceStart:
            # The embedding / output layer's gradients (fp32), a ring like the holders' all-reduce: each
            # member sends 2(n-1)/n of them to its successor, the D hops between nodes sharing the node
            # links with whatever weight and gradient transfers run at the same time. Sharded: the gradients'
            # reduce-scatter ((n-1)/n; gloo's an all-reduce) or the weights' all-gather in the compute dtype.
            params = self.cost.replicated_part_params(a.part)
            kind, nbytes = "replicated", params * (self.cost.dtype_bytes if a.mode == "gather" else self.cost.grad_bytes)
            if a.mode != "sum":
                half = a.mode == "gather" or self.cost.reduce_scatter_factor == 1.0
        else:
            kind, nbytes = a.kind, a.size * self.unit[a.kind][a.shard]
        if cls is A.ReplicatedAllReduceStart and a.node_size > 1 and pairs:
            pairs, sizes, t = self._through_nodes(a, nbytes, t, half)
        else:
            if ring:
                nbytes *= ring_share(a.ranks, a.ranks[0], half)[1]
            sizes = [nbytes] * len(pairs)
            if ring and pairs:   # a ring's 2(n-1) steps each pay a latency; the flows pay one
                crossing = any(src // self.G != dst // self.G for src, dst in pairs)
                steps = len(pairs) - 1 if half else 2 * len(pairs) - 2
                t += (steps - 1) * (self.cost.inter if crossing else self.cost.intra).latency
        op.flows_left = len(pairs)
        if not pairs:
            self.push(t, "done", op)
        for (src, dst), nbytes in zip(pairs, sizes):
            link = "intra" if src // self.G == dst // self.G else "inter"
            tr = Transfer(op.tag, src, dst, kind, link, nbytes, t)
            if self.record:
                self.transfers.append(tr)
            if link == "intra" or self.cost.inter.bandwidth == INF:
                lk = self.cost.intra if link == "intra" else self.cost.inter
                tr.end = t + lk.time(nbytes)
                self.push(tr.end, "flowend", op)
            else:
                flow = Flow(op, nbytes, src // self.G, dst // self.G, tr,
                            shared=A.CHANNEL.get(kind) not in A.DIRECTED_CHANNELS)
                self.push(t + self.cost.inter.latency, "enter", flow)

    def _through_nodes(self, a, nbytes: float, t: float, half: bool = False):
        """A hierarchical all-reduce's flows (``ReplicatedAllReduceStart.node_size``): each node's ring
        carries the reduce-scatter and the all-gather, 2(G-1)/G of the data, and the ring of the j-th
        members across the nodes 2(D-1)/D of its 1/G; the stages' latencies are paid up front. ``half``: one
        half of it (the sharded optimizer's reduce-scatter or all-gather), (G-1)/G and (D-1)/D."""
        G = a.node_size
        nodes = [a.ranks[i:i + G] for i in range(0, len(a.ranks), G)]
        across = [tuple(node[j] for node in nodes) for j in range(G)]
        pairs = [(m, ring_share(node, m)[0]) for node in nodes for m in node]
        sizes = [nbytes * ring_share(nodes[0], nodes[0][0], half)[1]] * len(pairs)
        if len(nodes) > 1:
            share = ring_share(across[0], across[0][0], half)[1] / G
            pairs += [(m, ring_share(ring, m)[0]) for ring in across for m in ring]
            sizes += [nbytes * share] * (len(pairs) - len(sizes))
        steps_in, steps_across = (1 if half else 2) * (G - 1), (1 if half else 2) * (len(nodes) - 1)
        return pairs, sizes, t + steps_in * self.cost.intra.latency + max(0, steps_across - 1) * self.cost.inter.latency

    def flow_end(self, op: _Op, t: float) -> None:
        op.flows_left -= 1
        if op.flows_left == 0:
            self.complete(op, t)

    def complete(self, op: _Op, t: float) -> None:
        op.done = t
        for r in op.waiters:
            self.push(t, "rank", r)
        op.waiters = []
        self._leave_fifos(op, t)

    # ------------------------------------------------------- shared network
    def advance_net(self, t: float) -> None:
        dt = t - self.net_time
        if dt > 0:
            for f in self.flows:
                f.remaining -= f.rate * dt
        self.net_time = t

    def reschedule(self, t: float) -> None:
        self.net_version += 1
        if not self.flows:
            return
        free = self.cost.pair_duplex_bytes
        max_min_rates(self.flows, self.cost.inter.bandwidth, free, self.cost.pair_bandwidth)
        nxt = min(t + max(f.remaining, 0.0) / f.rate for f in self.flows)
        if free != INF:     # the next flow to leave its free bytes while its pair sends the other way
            active = {f.pair() for f in self.flows if f.shared}
            for f in self.flows:
                if not f.has_sent(free) and f.reverse_in(active):
                    nxt = min(nxt, t + (free - (f.nbytes - f.remaining)) / f.rate)
        self.push(nxt, "net", self.net_version)


_STARTS = frozenset(A.STARTS)
_WAIT = A.Wait
_OPTIMIZER = object()   # :attr:`_Simulator._timed`'s mark of the optimizer step (priced per rank)
_SLICES = frozenset(A.SLICE_COLLECTIVES)


def simulate(plan: Plan, cost: CostModel, record: bool = True, around=None) -> SimResult:
    """Simulate one iteration of ``plan`` (which should be validated first). ``around``: what each rank runs
    beside the plan's actions (``after_wait(rank, start)``, ``before_start(rank, start)``,
    ``before_optimizer(rank)``: seconds), as context parallelism's pieces inside weight passing
    (:class:`~megatron_tawpipe.sim.context_parallel_weights.PieceCollectives`)."""
    sim = _Simulator(plan, cost, record, around)
    sim.run()
    P = plan.num_ranks
    iteration = max(sim.finish) if P else 0.0
    compute = sum(sim.busy)
    tokens = plan.num_streams * plan.num_microbatches * cost.tokens_per_microbatch
    # what crosses the links: the replicated ring too
    lb, rep = plan_traffic(plan, cost.shard_bytes(plan), cost.activation_bytes, cost.grad_shard_bytes(plan),
                           cost.reduce_scatter_factor, cost.replicated_params * cost.grad_bytes,
                           cost.replicated_params * cost.dtype_bytes)
    return SimResult(
        schedule=plan.schedule, num_ranks=P, iteration_time=iteration,
        tokens_per_sec_per_rank=(tokens / iteration / P) if iteration > 0 else INF,
        bubble_ratio=(1.0 - compute / (P * iteration)) if iteration > 0 else 0.0,
        link_bytes=lb, replicated_allreduce_bytes=rep["intra"] + rep["inter"],
        **memory_fields(plan, cost), compute_time=sim.busy, finish_time=sim.finish,
        spans=sim.spans, transfers=sim.transfers, options=dict(plan.options), idle=sim.idle)
