"""TawPipe planner: topology-aware weight passing.

* Device-bound storage: shard ``s`` is owned by group ``s mod D``, local index
  ``s div D``, i.e. rank ``(s mod D) * G + s div D``; its master weights, optimizer
  state and ``main`` gradient never move.  The owner keeps one compute-dtype
  copy (``LoadWeights`` once) from which it serves every request.
* Group-based scheduling: the G ranks of a group work on the same shard at the
  same time, each on its own micro-batches.  A *visit* is one (phase, shard,
  micro-batches) step of a group.  The shard arrives at the group's *root* --
  the owner if the group owns it, else the *staging* rank with the owner's local
  index, which fetches it from the owner over the inter-group link -- and is
  broadcast inside the group.  After a backward visit the partial gradients are
  reduced to the root, which sends them (once, inter-group) to the owner, who
  accumulates.
* Comm/compute overlap (``overlap=True``): the inter-group fetch for a visit is
  posted ``prefetch`` slots ahead and the broadcast one slot ahead, into other
  buffers than the one being computed with; reductions and gradient sends are
  waited one or two slots later.  ``overlap=False`` starts and waits every
  transfer in place (the no-CCO ablation).

Arrangement (choices the papers leave open; the defaults are the fastest
arrangement the simulator found, see megatron_tawpipe/plan/README.md; ``cache=False,
drain=True`` is the reference arrangement, schedule ``tawpipe-paper``):

* ``stagger``: group g runs ``g`` slots behind group 0, so that in a slot the D
  groups need D different shards owned by D different groups and every node
  link carries about one transfer each way.
* ``drain``: re-align the groups after every micro-batch round as the
  reference arrangement does (``D-1`` idle slots per round).  Weights do not
  change within an iteration, so by default groups run their rounds back to
  back and only stagger once per iteration.
* ``chunk``: micro-batches each rank runs per visit (weights fetched once per
  chunk instead of once per micro-batch; more boundary activations kept).
* ``cache``: a staging rank keeps each fetched foreign shard for the whole
  iteration and accumulates its group's reduced gradient of that shard, sending
  it to the owner once at the end.  Costs up to ``D-1`` weight and ``D-1``
  gradient buffers on a rank; cuts inter-group traffic to two shard units per
  foreign (group, shard) per iteration, independent of N.  Default: on for
  ``D <= 4`` groups.
* ``replicate_first``: shard 0 is held by one rank in every group (the rank
  that would stage it), not by its owner alone: each holder keeps master
  weights, optimizer state and ``main`` gradient of it, its group's gradient
  of it is all-reduced among the holders (``AllReduceStart``) after the last
  backward, and every holder steps it identically.  No group waits for shard
  0 at the start of an iteration; with D = 2 the groups start together (no
  stagger unless asked for).  When the last visit has more than one
  micro-batch, the second-to-last visit's gradient leaves for its owner
  during it (after its first micro-batch), not with the iteration's last
  gradients.  The price is shard 0's master, optimizer state
  and gradient on D-1 more ranks (``Plan.replicas``).  Needs D >= 2; the
  simulator finds it faster for D = 2 and not for more groups.
* ``groups``: scheduling groups (default: the physical groups).  ``groups=1``
  is the flat-group ablation (one group of all ranks, no GWPS).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.builder import PlanBuilder

WAIT, POST, COMP, AFTER = range(4)
START, END = -(10 ** 9), 10 ** 9


def tawpipe_owner(shard: int, num_groups: int, ranks_per_group: int) -> int:
    return (shard % num_groups) * ranks_per_group + shard // num_groups


def _visits(P: int, N: int, chunk: int) -> List[Tuple[str, int, Tuple[int, ...], int]]:
    """(phase, shard, micro-batches, round) of one group, in order."""
    out = []
    rounds = [tuple(range(k, min(N, k + chunk))) for k in range(0, N, chunk)]
    for k, mbs in enumerate(rounds):
        out += [("F", s, mbs, k) for s in range(P)]
        out += [("B", s, mbs, k) for s in reversed(range(P))]
    return out


def plan_tawpipe(num_ranks: int, num_groups: int, num_layers: int, num_microbatches: int,
                 groups: int = None, overlap: bool = True, stagger: bool = None,
                 drain: bool = False, chunk: int = 1, cache: bool = None, prefetch: int = 2,
                 replicate_first: bool = False):
    P, N = num_ranks, num_microbatches
    D = num_groups if groups is None else groups
    if D < 1 or P % D:
        raise ValueError(f"scheduling groups ({D}) must divide ranks ({P})")
    if num_layers % P:
        raise ValueError(f"num_layers ({num_layers}) must be a multiple of ranks ({P})")
    if chunk < 1 or prefetch < 1:
        raise ValueError("chunk and prefetch must be >= 1")
    G = P // D
    if replicate_first and D < 2:
        raise ValueError("replicate_first needs at least 2 scheduling groups (one holder of shard 0 per group)")
    if stagger is None:
        # Two groups that both hold shard 0 start together (a stagger would only delay the
        # second); with more, staggering still spreads each slot's fetches over the owners.
        stagger = not replicate_first or D > 2
    if cache is None:
        # Keeping foreign shards costs 2(D-1) shard buffers per rank: worth it
        # for a few groups (nodes), not when groups are tiny.
        cache = D <= 4
    # Groups may run up to D-1 slots ahead of or behind their nominal stagger
    # (they only stay staggered while links are the bottleneck), so the side
    # of an inter-group gradient transfer that does not need it soon waits
    # D-1 slots late.  Both sides *post* a transfer at the same slot: on NCCL
    # a posted send holds its stream until the receive runs, and equal keys
    # are what make the builder's batches line up (builder._batch_p2p).
    slack = D - 1 if stagger or drain else 0
    b = PlanBuilder(P, num_groups)
    owner = [tawpipe_owner(s, D, G) for s in range(P)]
    # A replicated shard's holder in group g is the rank that would otherwise stage it there.
    replicas = {0: tuple(g * G for g in range(D) if g != owner[0] // G)} if replicate_first else {}
    holders = {s: (owner[s],) + replicas.get(s, ()) for s in range(P)}
    visits = _visits(P, N, chunk)

    for s in range(P):
        b.emit(owner[s], (START, 0), A.LoadWeights, s, "~wown")
        for r in replicas.get(s, ()):
            b.emit(r, (START, 0), A.LoadWeights, s, f"~wrep{s}")
    replica_ready: Dict[int, tuple] = {}   # group -> key at which its gradient of shard 0 is final

    first_b_visit: Dict[int, int] = {}
    last_b_visit: Dict[int, int] = {}
    for v, (phase, s, _, _) in enumerate(visits):
        if phase == "B":
            first_b_visit.setdefault(s, v)
            last_b_visit[s] = v
    fetched = set()
    last_slot = {}
    head_slot = {}      # group -> slot of its last backward of the last shard
    for g in range(D):
        members = list(range(g * G, (g + 1) * G))
        prev_wbuf = None
        slots = [(g if stagger else 0) + v + (k * (D - 1) if drain else 0)
                 for v, (_, _, _, k) in enumerate(visits)]
        busy = set(slots)
        for v, (phase, s, mbs, k) in enumerate(visits):
            tau = slots[v]
            last_slot[g] = tau
            if phase == "B" and s == P - 1:
                head_slot[g] = tau
            # The next shard is normally waited for (and broadcast) before the
            # previous visit's compute, so that the broadcast hides behind it.
            # If no compute of this group lies between posting the fetch and
            # that point (the first visits, or after a drain gap), wait after
            # the previous visit's compute instead, so that the fetch does.
            ahead = any(x in busy for x in range(tau - prefetch, tau - 1))
            ready_key = (tau - 1, POST) if ahead else (tau - 1, AFTER, 5)
            root = owner[s] if owner[s] // G == g else g * G + s // D
            wbuf = {m: f"~w{v}" for m in members}
            # -------------------------------------------------- weights in
            if v > 0 and visits[v - 1][1] == s:
                # The same shard as the previous visit (F then B of the last
                # shard, or B then F of shard 0): the group still has it.
                wbuf = prev_wbuf
            elif root == owner[s]:
                wbuf[root] = "~wown"
            elif root in holders[s]:
                wbuf[root] = f"~wrep{s}"
            else:
                wbuf[root] = f"~wc{s}" if cache else f"~w{v}"
                if not cache or (g, s) not in fetched:
                    fetched.add((g, s))
                    if overlap:
                        b.p2p(owner[s], root, "weight", s, "~wown", wbuf[root],
                              start_key=(tau - prefetch, POST, 0), src_wait_key=(END, 0),
                              dst_wait_key=ready_key + (1,))
                    else:
                        b.p2p(owner[s], root, "weight", s, "~wown", wbuf[root],
                              start_key=(tau, WAIT, 0), src_wait_key=(tau, WAIT, 1),
                              dst_wait_key=(tau, WAIT, 1))
            if G > 1 and wbuf is not prev_wbuf:
                keys = (ready_key + (2,), (tau, WAIT, 0)) if overlap else \
                    ((tau, WAIT, 2), (tau, WAIT, 3))
                b.collective(A.BroadcastStart, root, members, wbuf, "weight", s, *keys)
            prev_wbuf = wbuf
            # ------------------------------------------------------ compute
            if phase == "F":
                for j, m in enumerate(mbs):
                    for r in members:
                        b.emit(r, (tau, COMP, j), A.Forward, m, s, wbuf[r])
                continue
            gbuf = {m: f"~g{v}" for m in members}
            replicated = s in replicas
            direct = G == 1 and root == owner[s] and not replicated
            if direct:
                gbuf[root] = A.MAIN
            elif replicated:
                gbuf[root] = f"~gx{s}"     # the group's gradient, all-reduced among the holders at the end
            elif cache and root != owner[s]:
                gbuf[root] = f"~gc{s}"
            for r in members:
                accumulating = r == root and (replicated or (cache and root != owner[s]))
                if gbuf[r] != A.MAIN and (not accumulating or first_b_visit[s] == v):
                    b.emit(r, (tau, POST, 3), A.ZeroGrad, s, gbuf[r])
                for j, m in enumerate(mbs):
                    b.emit(r, (tau, COMP, j), A.Backward, m, s, wbuf[r], gbuf[r])
            if direct:
                continue
            # -------------------------------------------------- gradients out
            if G > 1:
                # Waited after the next visit's compute: a member that finished
                # this visit early does not wait for the slowest one.  With
                # replicate_first, when the next visit is the group's last and
                # has more than one micro-batch: after its first one, so that
                # this gradient leaves for its owner while the rest of that
                # visit computes instead of joining shard 0's all-reduce on the
                # node link.  (Not in general: moving a send ahead of others on
                # the gradient channel can block them behind a late receiver.)
                split = replicate_first and v + 2 == len(visits) and slots[v + 1] == tau + 1 and \
                    len(visits[v + 1][2]) > 1
                done = (tau + 1, COMP, 0, 1) if split else (tau + 1, AFTER, 0)
                keys = ((tau, AFTER, 0), done) if overlap else ((tau, AFTER, 0), (tau, AFTER, 1))
                b.collective(A.ReduceStart, root, members, gbuf, "grad", s, *keys)
                ready = done[:-1] + (done[-1] + 1,) if overlap else (tau, AFTER, 2)
                after_ready = ready[:-1] + (ready[-1] + 1,)
            else:
                ready = after_ready = (tau, AFTER, 2)
            if replicated:
                if last_b_visit[s] == v:
                    replica_ready[g] = ready
                continue
            if root == owner[s]:
                b.emit(root, ready, A.AccumulateToOwner, s, gbuf[root])
                continue
            if cache and last_b_visit[s] != v:
                continue
            recv = f"~gr{g}.{v}"
            if overlap and cache:
                # The group's whole gradient of the shard, sent once; nothing
                # reuses the buffers, so nobody waits before the iteration ends.
                start = after_ready
                src_wait = dst_wait = (END, 0, 0)
            elif overlap:
                start = after_ready
                src_wait = dst_wait = (ready[0] + 1 + slack, WAIT, 0)
            else:
                start = (tau, AFTER, 3)
                src_wait = dst_wait = (tau, AFTER, 4)
            b.p2p(root, owner[s], "grad", s, gbuf[root], recv, start_key=start,
                  src_wait_key=src_wait, dst_wait_key=dst_wait)
            b.emit(owner[s], dst_wait[:2] + (dst_wait[2] + 1,), A.AccumulateToOwner, s, recv)

    for s, members in holders.items():
        if len(members) > 1:
            # Posted at the same key on every holder, after the last group's gradient is final
            # and after every rank's embedding all-reduce (one order of collectives on all ranks).
            start = max(list(replica_ready.values()) + [(max(last_slot.values()), AFTER, 9)])
            b.all_reduce(members, {m: f"~gx{s}" for m in members}, "grad", s,
                         start[:-1] + (start[-1] + 1,), (END, 0, 5))
            for m in members:
                b.emit(m, (END, 0, 6), A.AccumulateToOwner, s, f"~gx{s}")
    b.replicated_allreduce_parts({r: (head_slot[r // G], AFTER, 9) for r in range(P)},
                                 {r: (last_slot[r // G], AFTER, 9) for r in range(P)}, (END, 1))
    for r in range(P):
        b.emit(r, (END, 2), A.OptimizerStep)
    name = "tawpipe" if D == num_groups else ("tawpipe-flat" if D == 1 else f"tawpipe-groups{D}")
    if replicate_first:
        name += "-rep"
    if not overlap:
        name += "-nooverlap"
    if not cache and drain and D == num_groups and overlap:
        name = "tawpipe-paper"
    return b.build(schedule=name, family="weight", num_layers=num_layers, num_microbatches=N,
                   owners=owner, streams=range(P), replicas=replicas,
                   options={"groups": D, "overlap": overlap, "stagger": stagger,
                            "drain": drain, "chunk": chunk, "cache": cache,
                            "prefetch": prefetch, **({"replicate_first": True} if replicate_first else {}),
                            "slots": max(last_slot.values()) + 1})
