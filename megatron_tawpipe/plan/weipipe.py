"""WeiPipe planners: weights and weight gradients circulate on a ring of all ranks.

Shard ``s`` is owned by rank ``s``.  Data moves one hop per *turn*, from rank
``r+1`` to rank ``r``.  Two copies of every shard circulate: a forward copy F_s
and a backward copy B_s (WeiPipe's circle of 2P positions, F_0..F_{P-1} on one
half and B_{P-1}..B_0 on the other).  At turn ``t`` rank ``r`` holds

    forward shard  f = (r + t) mod P      (increasing over time)
    backward shard b = (P-1-r-t) mod P    (decreasing over time)

so a rank meets the shards in forward order on one copy and in backward order
on the other.  Its micro-batches start when it holds F_0 (and B_{P-1}), i.e.
at turns t = (P-r) mod P + kP.  WeiPipe-Interleave uses both copies in the
same turn (forward of micro-batch k, backward of micro-batch k-1); the naive
variant alternates a forward round and a backward round.

The gradient of shard ``s`` travels with B_s: each holder that computes a
backward on ``s`` adds into it, and the owner absorbs it into its ``main``
gradient when it passes by.  A copy is sent on only while some later holder
needs it before it next passes its owner; the owner never receives its own
shard (it loads from its master instead).  Both rules are derived per turn
from the schedule, which is what makes the plan right for every P.

Zero-bubble variants (``zero_bubble``, interleaved only): every backward is split into its input-gradient
pass (``BackwardInput``, right after the turn's forward; nothing on the ring waits for it) and its
weight-gradient pass (``BackwardWeight``, the only user of the travelling gradient, waited for just
before it). WZB1 runs the weight-gradient pass in the turn of its input gradient; WZB2 one round (P
turns) later, when the rank holds the same shard's gradient again, so the ring moves the same bytes for
one more round of turns at the end.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.builder import PlanBuilder

# Phases inside a turn (second element of the sort key).
WAIT, POST, FWD, GWAIT, BWD, GPOST = range(6)
END = 10 ** 9


def _rank_turns(P: int, N: int, interleave: bool, zero_bubble: int = 0):
    """{(rank, turn): (fwd, bwd, wgrad)}, each (mb, shard) or None: the forward, the backward (its input
    gradient where the backward is split) and the weight-gradient pass of the turn (the backward's own
    where it is not split; WZB2: the backward of the same position one round earlier)."""
    work: Dict[Tuple[int, int], Tuple[Optional[tuple], Optional[tuple], Optional[tuple]]] = {}
    lag = 2 if zero_bubble == 2 else 1    # rounds from a forward round to its weight-gradient passes
    rounds = (N + 1 if interleave else 2 * N) + lag - 1
    for r in range(P):
        offset = (P - r) % P
        for k in range(rounds):
            for i in range(P):
                t = offset + k * P + i
                if interleave:
                    f = (k, i) if k < N else None
                    b = (k - 1, P - 1 - i) if 1 <= k <= N else None
                    w = (k - lag, P - 1 - i) if lag <= k <= N - 1 + lag else None
                else:
                    f = (k // 2, i) if k % 2 == 0 else None
                    b = w = (k // 2, P - 1 - i) if k % 2 == 1 else None
                work[(r, t)] = (f, b, w)
    return work


def plan_weipipe(num_ranks: int, num_groups: int, num_layers: int, num_microbatches: int,
                 interleave: bool = True, overlap: bool = True, zero_bubble: int = 0):
    """WeiPipe's plan; ``zero_bubble`` 1 or 2 splits every backward (WZB1, WZB2: see the module's text)."""
    P, N = num_ranks, num_microbatches
    if zero_bubble not in (0, 1, 2) or (zero_bubble and not interleave):
        raise ValueError(f"zero_bubble must be 0, 1 or 2 (1 and 2 on the interleaved schedule), not {zero_bubble}")
    if num_layers < P:
        raise ValueError(f"num_layers ({num_layers}) must be at least the number of ranks ({P}): one shard each")
    b = PlanBuilder(P, num_groups)
    work = _rank_turns(P, N, interleave, zero_bubble)
    last_turn = max(t for _, t in work)

    def holder(kind: str, s: int, t: int) -> int:
        return (s - t) % P if kind == "F" else (P - 1 - s - t) % P

    def uses(kind: str, s: int, t: int) -> bool:
        f, bw, wg = work.get((holder(kind, s, t), t), (None, None, None))
        items = (f,) if kind == "F" else (bw, wg)
        return any(item is not None and item[1] == s for item in items)

    # Keys: with overlap the next turn's data is posted before this turn's
    # compute; without, it is exchanged (start+wait) after the compute.
    def k_post(t):
        return (t, POST) if overlap else (t, GPOST, 1)

    def k_wait(t):
        return (t, WAIT) if overlap else (t - 1, GPOST, 2)

    weight_buf: Dict[Tuple[str, int, int], str] = {}
    for kind in ("F", "B"):
        for s in range(P):
            present = [False] * (last_turn + 2)
            for t in range(last_turn, -1, -1):
                carry = present[t + 1] and holder(kind, s, t + 1) != s
                present[t] = uses(kind, s, t) or carry
            for t in range(last_turn + 1):
                if not present[t]:
                    continue
                h = holder(kind, s, t)
                buf = f"~w{kind}{s}.{t}"
                weight_buf[(kind, s, t)] = buf
                if h == s:
                    b.emit(h, k_post(t - 1), A.LoadWeights, s, buf)
                else:
                    # present[t-1] holds by construction (t >= 1 here).
                    prev = holder(kind, s, t - 1)
                    b.p2p(prev, h, "weight", s, weight_buf[(kind, s, t - 1)], buf,
                          start_key=k_post(t - 1), src_wait_key=k_wait(t), dst_wait_key=k_wait(t))

    # Gradient tokens follow the backward copy.
    grad_buf: Dict[Tuple[int, int], str] = {}   # (shard, turn) -> buffer receiving/holding it
    last_gturn = last_turn
    for s in range(P):
        carried: Optional[str] = None           # buffer the token arrives in at turn t
        t = 0
        while t <= last_turn or carried is not None:
            h = holder("B", s, t)
            wg = work.get((h, t), (None, None, None))[2]
            buf = carried
            if wg is not None and wg[1] == s:
                if buf is None and h != s:
                    buf = f"~g{s}.{t}"
                    b.emit(h, (t, GWAIT, 1), A.ZeroGrad, s, buf)
                grad_buf[(s, t)] = buf if buf is not None else A.MAIN
            if buf is not None and h == s:
                b.emit(h, (t, GPOST, 0), A.AccumulateToOwner, s, buf)
                buf = None
            carried = None
            if buf is not None:
                nxt = holder("B", s, t + 1)
                carried = f"~g{s}.{t + 1}"
                src_wait, dst_wait = ((t + 1, WAIT), (t + 1, GWAIT, 0)) if overlap else \
                    ((t, GPOST, 2), (t, GPOST, 2))
                b.p2p(h, nxt, "grad", s, buf, carried, start_key=(t, GPOST, 1),
                      src_wait_key=src_wait, dst_wait_key=dst_wait)
            last_gturn = max(last_gturn, t + 1)
            t += 1

    # Compute. Split (WZB): the input gradient right after the forward, before the gradient token is
    # waited for; the weight-gradient pass, the token's only user, after it.
    for (r, t), (f, bw, wg) in work.items():
        if f is not None:
            m, s = f
            b.emit(r, (t, FWD), A.Forward, m, s, weight_buf[("F", s, t)])
        if zero_bubble:
            if bw is not None:
                m, s = bw
                b.emit(r, (t, FWD, 1), A.BackwardInput, m, s, weight_buf[("B", s, t)])
            if wg is not None:
                m, s = wg
                b.emit(r, (t, BWD), A.BackwardWeight, m, s, weight_buf[("B", s, t)], grad_buf[(s, t)])
        elif bw is not None:
            m, s = bw
            b.emit(r, (t, BWD), A.Backward, m, s, weight_buf[("B", s, t)], grad_buf[(s, t)])

    last_bwd: Dict[int, int] = {}
    last_head: Dict[int, int] = {}
    for (r, t), (_, _, wg) in work.items():
        if wg is not None:
            last_bwd[r] = max(last_bwd.get(r, t), t)
            if wg[1] == P - 1:
                last_head[r] = max(last_head.get(r, t), t)
    b.replicated_allreduce_parts({r: (last_head[r], GPOST, 9) for r in range(P)},
                                 {r: (last_bwd[r], GPOST, 9) for r in range(P)}, (END, 0))
    for r in range(P):
        b.emit(r, (END, 1), A.OptimizerStep)
    name = f"weipipe-zb{zero_bubble}" if zero_bubble else "weipipe" if interleave else "weipipe-naive"
    options = {"interleave": interleave, "overlap": overlap, "turns": last_gturn + 1}
    if zero_bubble:
        options.update(zero_bubble=zero_bubble, split_backward=True)
    return b.build(schedule=name, family="weight", num_layers=num_layers,
                   num_microbatches=N, owners=range(P), streams=range(P), options=options)
