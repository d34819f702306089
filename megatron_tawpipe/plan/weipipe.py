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
pass (``BackwardInput``: nothing on the ring waits for it) and its weight-gradient pass (``BackwardWeight``,
the only user of the travelling gradient, waited for just before it).

* WZB1, ``layout="ring"`` (the default; ``weipipe-zb1``): WeiPipe-Interleave's ring, each gradient
  with its backward copy; the weight-gradient pass runs in the turn of its input pass, after the turn's
  forward.
* WZB1, ``layout="paired"`` (``weipipe-zb1-paired``, an even number of ranks): the WeiPipe paper's
  arrangement. The backward half of the circle holds the backward copies in pairs, pair ``j`` of shards
  ``P-1-j`` and ``P/2-1-j``, with the pair's gradients one position behind it, so a rank meets a weight
  pair (pair ``j`` at element ``2j`` of its round of P turns) and one turn later the same pair's
  gradients (element ``2j+1``), and runs each weight-gradient pass one turn after its input pass, into
  the gradient that then moves on. A micro-batch's backward takes two blocks of P turns, the upper
  shards ``P-1..P/2`` in one and the lower ``P/2-1..0`` in the next; a forward takes one block. Each
  rank fills its blocks with at most two of (a forward, an upper half, a lower half), lower halves
  first, then upper halves, then forwards (:func:`paired_blocks`): a turn computes two passes (F+B, F+W,
  B+B or W+W) where the ring's computes three, and moves a forward copy and two backward copies or two
  gradients. The weight-gradient pass reads the shard's weights: the rank keeps the backward copy it
  passed on for one more turn.
* WZB2: the weight-gradient pass one round (P turns) after its input pass, when the rank holds the same
  shard's gradient again on WeiPipe-Interleave's ring, so the ring moves the same bytes for one more round
  of turns at the end.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.builder import PlanBuilder

# Phases inside a turn (second element of the sort key).
WAIT, POST, FWD, GWAIT, BWD, GPOST = range(6)
END = 10 ** 9
LAYOUTS = ("ring", "paired")   # WZB1's arrangements of the backward half of the circle


def _ring_turns(P: int, N: int, interleave: bool, zero_bubble: int = 0):
    """{(rank, turn): (fwd, inputs, weights)} on WeiPipe-Interleave's ring: the forward ((mb, shard) or
    None), the backwards (their input-gradient passes where split) and the weight-gradient passes of the
    turn (unsplit: the same backward; WZB2: the backward of the same position one round earlier)."""
    work: Dict[Tuple[int, int], Tuple[Optional[tuple], tuple, tuple]] = {}
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
                work[(r, t)] = (f, (b,) if b else (), (w,) if w else ())
    return work


def paired_blocks(N: int) -> List[List[Tuple[str, int]]]:
    """WZB1's paired layout, per rank: for each block of P turns the (part, micro-batch) it runs, part
    ``"F"`` (a forward), ``"U"`` (the backward of the upper shards) or ``"L"`` (of the lower shards); at
    most two per block, a lower half first, then an upper half, then a forward; a part is ready the
    block after the one before it."""
    blocks: List[List[Tuple[str, int]]] = []
    upper: List[int] = []
    lower: List[int] = []
    k = 0
    while k < N or upper or lower:
        slots = []
        if lower:
            slots.append(("L", lower.pop(0)))
        if upper:
            slots.append(("U", upper.pop(0)))
        if len(slots) < 2 and k < N:
            slots.append(("F", k))
            k += 1
        upper += [m for part, m in slots if part == "F"]
        lower += [m for part, m in slots if part == "U"]
        blocks.append(slots)
    return blocks


def pair_index(P: int, s: int) -> int:
    """The pair of WZB1's paired layout that shard ``s`` belongs to: pair ``j`` is ``(P-1-j, P/2-1-j)``."""
    return P - 1 - s if s >= P // 2 else P // 2 - 1 - s


def _paired_turns(P: int, N: int):
    """{(rank, turn): (fwd, inputs, weights)} of WZB1's paired layout (see the module)."""
    work: Dict[Tuple[int, int], Tuple[Optional[tuple], tuple, tuple]] = {}
    for r in range(P):
        offset = (P - r) % P
        for blk, slots in enumerate(paired_blocks(N)):
            for i in range(P):
                f, inputs, weights = None, [], []
                j, step = divmod(i, 2)
                for part, k in slots:
                    if part == "F":
                        f = (k, i)
                    else:
                        s = P - 1 - j if part == "U" else P // 2 - 1 - j
                        (weights if step else inputs).append((k, s))
                work[(r, offset + blk * P + i)] = (f, tuple(inputs), tuple(weights))
    return work


def plan_weipipe(num_ranks: int, num_groups: int, num_layers: int, num_microbatches: int,
                 interleave: bool = True, overlap: bool = True, zero_bubble: int = 0,
                 layout: Optional[str] = None):
    """WeiPipe's plan; ``zero_bubble`` 1 or 2 splits every backward (WZB1, WZB2: see the module's text).
    ``layout`` (WZB1 only): ``"ring"`` (the default) or ``"paired"`` (an even number of ranks)."""
    P, N = num_ranks, num_microbatches
    if zero_bubble not in (0, 1, 2) or (zero_bubble and not interleave):
        raise ValueError(f"zero_bubble must be 0, 1 or 2 (1 and 2 on the interleaved schedule), not {zero_bubble}")
    if num_layers < P:
        raise ValueError(f"num_layers ({num_layers}) must be at least the number of ranks ({P}): one shard each")
    layout = layout or "ring"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    paired = layout == "paired"
    if paired and (zero_bubble != 1 or P % 2):
        raise ValueError(f"the paired layout (weipipe-zb1-paired) is WZB1's (zero_bubble 1) on an even number of "
                         f"ranks, not zero_bubble {zero_bubble} on {P} ranks: it pairs shard P-1-j with P/2-1-j; "
                         "on an odd number of ranks use weipipe-zb1 (the ring layout)")
    b = PlanBuilder(P, num_groups)
    work = _paired_turns(P, N) if paired else _ring_turns(P, N, interleave, zero_bubble)
    last_turn = max(t for _, t in work)
    idle = (None, (), ())

    def holder(kind: str, s: int, t: int) -> int:
        """Who holds, at turn ``t``, shard ``s``'s forward copy (F), backward copy (B) or gradient (G)."""
        if kind == "F":
            return (s - t) % P
        if paired:
            return (2 * pair_index(P, s) + (kind == "G") - t) % P
        return (P - 1 - s - t) % P

    def uses(kind: str, s: int, t: int) -> bool:
        f, inputs, weights = work.get((holder(kind, s, t), t), idle)
        if kind == "F":
            return f is not None and f[1] == s
        if paired:     # the weight pass one turn later reads the copy the rank kept
            weights = work.get((holder("G", s, t + 1), t + 1), idle)[2]
        return any(item[1] == s for item in inputs + weights)

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

    # Gradient tokens: with the backward copy (ring), one position behind it (paired).
    grad_buf: Dict[Tuple[int, int], str] = {}   # (shard, turn) -> buffer receiving/holding it
    last_gturn = last_turn
    for s in range(P):
        carried: Optional[str] = None           # buffer the token arrives in at turn t
        t = 0
        while t <= last_turn or carried is not None:
            h = holder("G", s, t)
            buf = carried
            if any(item[1] == s for item in work.get((h, t), idle)[2]):
                if buf is None and h != s:
                    buf = f"~g{s}.{t}"
                    b.emit(h, (t, GWAIT, 1), A.ZeroGrad, s, buf)
                grad_buf[(s, t)] = buf if buf is not None else A.MAIN
            if buf is not None and h == s:
                b.emit(h, (t, GPOST, 0), A.AccumulateToOwner, s, buf)
                buf = None
            carried = None
            if buf is not None:
                nxt = holder("G", s, t + 1)
                carried = f"~g{s}.{t + 1}"
                src_wait, dst_wait = ((t + 1, WAIT), (t + 1, GWAIT, 0)) if overlap else \
                    ((t, GPOST, 2), (t, GPOST, 2))
                b.p2p(h, nxt, "grad", s, buf, carried, start_key=(t, GPOST, 1),
                      src_wait_key=src_wait, dst_wait_key=dst_wait)
            last_gturn = max(last_gturn, t + 1)
            t += 1

    # Compute. Split (WZB): the input gradients right after the forward, before any gradient token is
    # waited for; the weight-gradient passes, the tokens' only users, after them.
    lag = 1 if paired else 0         # turns from the copy a weight pass reads to the pass
    for (r, t), (f, inputs, weights) in work.items():
        if f is not None:
            m, s = f
            b.emit(r, (t, FWD), A.Forward, m, s, weight_buf[("F", s, t)])
        for m, s in inputs:
            if zero_bubble:
                b.emit(r, (t, FWD, 1), A.BackwardInput, m, s, weight_buf[("B", s, t)])
            else:
                b.emit(r, (t, BWD), A.Backward, m, s, weight_buf[("B", s, t)], grad_buf[(s, t)])
        if zero_bubble:
            for m, s in weights:
                b.emit(r, (t, BWD), A.BackwardWeight, m, s, weight_buf[("B", s, t - lag)], grad_buf[(s, t)])

    last_bwd: Dict[int, int] = {}
    last_head: Dict[int, int] = {}
    for (r, t), (_, _, weights) in work.items():
        if weights:
            last_bwd[r] = max(last_bwd.get(r, t), t)
            if any(s == P - 1 for _, s in weights):
                last_head[r] = max(last_head.get(r, t), t)
    b.replicated_allreduce_parts({r: (last_head[r], GPOST, 9) for r in range(P)},
                                 {r: (last_bwd[r], GPOST, 9) for r in range(P)}, (END, 0))
    for r in range(P):
        b.emit(r, (END, 1), A.OptimizerStep)
    name = f"weipipe-zb{zero_bubble}" if zero_bubble else "weipipe" if interleave else "weipipe-naive"
    options = {"interleave": interleave, "overlap": overlap, "turns": last_gturn + 1}
    if zero_bubble:
        options.update(zero_bubble=zero_bubble, split_backward=True)
    if zero_bubble == 1:
        options["layout"] = layout
    return b.build(schedule=name, family="weight", num_layers=num_layers,
                   num_microbatches=N, owners=range(P), streams=range(P), options=options)
