"""Activation-passing planners (GPipe, 1F1B, interleaved 1F1B) for comparisons.

These are the schedules Megatron runs natively; here they exist so that the
simulator can compare them with the weight-passing plans on the same cost
model.  One pipeline of P stages; shard ``s`` (``P*V`` shards) lives on rank
``s mod P`` as its model chunk ``s div P``; its weights never move.  The
pipeline processes ``N`` micro-batches (all ranks share one data stream).
Boundary activations go forward (kind ``act``) and their gradients backward
(kind ``actgrad``); a receive is posted one compute step before it is needed,
so a transfer overlaps the receiver's previous compute, and sends are waited
at the end.
"""

from __future__ import annotations

from typing import List, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.builder import PlanBuilder

END = 10 ** 9
Op = Tuple[str, int, int]   # ("F"|"B", micro-batch, shard)


def gpipe_order(P: int, N: int, rank: int) -> List[Op]:
    return [("F", m, rank) for m in range(N)] + [("B", m, rank) for m in range(N)]


def one_f_one_b_order(P: int, N: int, rank: int) -> List[Op]:
    warmup = min(P - rank - 1, N)
    ops = [("F", m, rank) for m in range(warmup)]
    for i in range(N - warmup):
        ops += [("F", warmup + i, rank), ("B", i, rank)]
    ops += [("B", m, rank) for m in range(N - warmup, N)]
    return ops


def _interleave(fwd: List[Op], bwd: List[Op], warmup: int) -> List[Op]:
    ops = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[len(fwd) - warmup:]


def interleaved_orders(P: int, N: int, V: int) -> List[List[Op]]:
    """Megatron's interleaved 1F1B order: micro-batches in groups of P, each
    group run chunk by chunk; warm-up (P-rank-1)*2 + (V-1)*P forwards.  When N
    is not a multiple of P the last, smaller group can need a longer warm-up;
    it is found by running the dependencies (each rank's warm-up grows until
    no rank waits for work that comes later in another rank's list)."""
    fwd_mc, bwd_mc = [], []
    for g0 in range(0, N, P):
        group = range(g0, min(N, g0 + P))
        fwd_mc += [(m, c) for c in range(V) for m in group]
        bwd_mc += [(m, c) for c in reversed(range(V)) for m in group]
    total = N * V
    fwd = [[("F", m, c * P + r) for m, c in fwd_mc] for r in range(P)]
    bwd = [[("B", m, c * P + r) for m, c in bwd_mc] for r in range(P)]
    warmup = [min(total, (P - r - 1) * 2 + (V - 1) * P) for r in range(P)]
    while True:
        orders = [_interleave(fwd[r], bwd[r], warmup[r]) for r in range(P)]
        stuck = _first_stuck(orders, P * V)
        if not stuck:
            return orders
        for r in stuck:
            if warmup[r] >= total:
                raise RuntimeError(f"no deadlock-free interleaved order for P={P} N={N} V={V}")
            warmup[r] += 1


def _first_stuck(orders: List[List[Op]], S: int) -> List[int]:
    """Ranks blocked on a backward when executing ``orders`` with their data
    dependencies; empty if everything runs."""
    _, _, pc = _run_orders(orders, S)
    return [r for r, ops in enumerate(orders)
            if pc[r] < len(ops) and ops[pc[r]][0] == "B"]


def _run_orders(orders: List[List[Op]], S: int):
    """Run each rank's order as soon as each op's input is ready (forward 1,
    backward 2 time units): ``(start, end, pc)``, ``pc`` where each rank stopped."""
    start, end = {}, {}
    pc = [0] * len(orders)
    clock = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(orders):
            while pc[r] < len(ops):
                phase, m, s = op = ops[pc[r]]
                dep = (("F", m, s - 1) if s > 0 else None) if phase == "F" else \
                    (("B", m, s + 1) if s + 1 < S else ("F", m, s))
                if dep is not None and dep not in end:
                    break
                start[op] = max(clock[r], end[dep] if dep is not None else 0)
                end[op] = clock[r] = start[op] + (1 if phase == "F" else 2)
                pc[r] += 1
                moved = True
    return start, end, pc


def plan_activation(schedule: str, num_ranks: int, num_groups: int, num_layers: int,
                    num_microbatches: int, virtual_stages: int = None):
    P, N = num_ranks, num_microbatches
    if schedule == "interleaved":
        V = virtual_stages or _default_virtual_stages(num_layers, P)
    else:
        V = 1
    S = P * V
    if num_layers < S:
        raise ValueError(f"num_layers ({num_layers}) must be at least {S} (ranks x virtual stages): "
                         "one layer per stage")
    if schedule == "gpipe":
        orders = [gpipe_order(P, N, r) for r in range(P)]
    elif schedule == "1f1b":
        orders = [one_f_one_b_order(P, N, r) for r in range(P)]
    elif schedule == "interleaved":
        orders = interleaved_orders(P, N, V)
    else:
        raise ValueError(f"unknown activation schedule {schedule!r}")

    b = PlanBuilder(P, num_groups)
    owner = [s % P for s in range(S)]
    for r in range(P):
        for s in range(r, S, P):
            b.emit(r, (-1, 0), A.LoadWeights, s, f"~w{s}")
    # Keys are times of one global clock (each rank's order run as soon as its
    # inputs are ready), so that both sides of a transfer are posted at the
    # same key: when the producer finishes.  The consumer waits right before use.
    start, end = _asap_times(orders, S)
    for r, ops in enumerate(orders):
        for phase, m, s in ops:
            op = (phase, m, s)
            if phase == "F":
                b.emit(r, (start[op], 2), A.Forward, m, s, f"~w{s}")
                nxt = s + 1
                if nxt < S and owner[nxt] != r:
                    _transfer(b, "act", m, nxt, r, end[op], owner[nxt], start[("F", m, nxt)])
            else:
                b.emit(r, (start[op], 2), A.Backward, m, s, f"~w{s}", A.MAIN)
                prv = s - 1
                if prv >= 0 and owner[prv] != r:
                    _transfer(b, "actgrad", m, prv, r, end[op], owner[prv], start[("B", m, prv)])
    for r in range(P):
        b.emit(r, (END, 1), A.OptimizerStep)
    return b.build(schedule=schedule, family="activation", num_layers=num_layers,
                   num_microbatches=N, owners=owner, streams=[0] * P,
                   options={"virtual_stages": V})


def _asap_times(orders: List[List[Op]], S: int):
    """Start and end time of every op (see ``_run_orders``)."""
    start, end, pc = _run_orders(orders, S)
    if any(pc[r] < len(ops) for r, ops in enumerate(orders)):
        raise RuntimeError("activation schedule orders have a cyclic dependency")
    return start, end


def _transfer(b: PlanBuilder, kind: str, mb: int, shard: int, src: int, ready: int,
              dst: int, use: int) -> None:
    tag = b.new_tag()
    link = b.link((src, dst))
    b.emit(src, (ready, 0), A.SendStart, tag, dst, "", kind, shard, link, 1.0, mb)
    b.emit(src, (END, 0), A.Wait, tag)
    b.emit(dst, (ready, 0), A.RecvStart, tag, src, "", kind, shard, link, 1.0, mb)
    b.emit(dst, (use, 1), A.Wait, tag)


def _default_virtual_stages(num_layers: int, P: int) -> int:
    per_rank = num_layers // P
    for v in range(2, per_rank + 1):
        if per_rank % v == 0:
            return v
    return 1
