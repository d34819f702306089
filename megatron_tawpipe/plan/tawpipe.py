"""TawPipe planner: topology-aware weight passing.

* Device-bound storage: shard ``s`` is owned by group ``s mod D``, local index
  ``(s div D) mod G``, i.e. rank ``(s mod D) * G + (s div D) mod G``; its master weights,
  optimizer state and ``main`` gradient never move.  The owner keeps one compute-dtype
  copy (``LoadWeights`` once) from which it serves every request.  There are
  ``shards_per_rank x P`` shards (default one per rank): with more, each rank owns (or
  stages) that many, and the transfers no compute hides at an iteration's boundary (its
  first weights, its last gradients) are that many times smaller.
* Group-based scheduling: the G ranks of a group work on the same shard at the
  same time, each on its own micro-batches.  A *visit* is one (phase, shard,
  micro-batches) step of a group: per round of micro-batches, forwards of
  shards 0..P-1, then backwards of P-1..0.  The shard arrives at the group's
  *root* -- the owner if the group owns it, else the *staging* rank with the
  owner's local index, which fetches it from the owner over the inter-group
  link -- and is broadcast inside the group.  After a backward visit the
  partial gradients are reduced to the root, which sends them (once,
  inter-group) to the owner, who accumulates.
* Comm/compute overlap (``overlap=True``): the inter-group fetch for a visit is
  posted ``prefetch`` slots ahead and the broadcast one slot ahead, into other
  buffers than the one being computed with; reductions and gradient sends are
  waited one or two slots later.  ``overlap=False`` starts and waits every
  transfer in place (the no-CCO ablation).

Arrangement (choices the papers leave open; the defaults are the fastest
arrangement the simulator found, see docs/simulator-cost-model.md; ``cache=False,
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
* ``prefetch``: how many slots ahead of its visit a fetch is posted (overlap).
* ``cache``: a staging rank keeps each fetched foreign shard for the whole
  iteration and accumulates its group's reduced gradient of that shard, sending
  it to the owner once at the end.  Cuts inter-group traffic to two shard units
  per foreign (group, shard) per iteration, ``2P(D-1)`` in all, independent of N.
  What it costs is what the builder's colouring gives: with overlap, a rank
  holds ``D+2`` weight and ``2D`` gradient buffers with it (``D`` and ``2D-2``
  with one rank per group) against 4 weight and about ``2D-2`` gradient buffers
  without (the gradient sends wait ``D-1`` slots late either way), i.e. ``D-2``
  more weight buffers and at most 2 more gradient buffers, whatever N, the
  chunk or a replicated first shard (``tests/test_tawpipe_cache.py``).  It has no
  effect with one group (every shard's owner is in the group).  ``None``: on for
  ``D <= 4`` groups, a default for tools that know no memory; ``pretrain_llama.py``
  passes its ``--tawpipe-cache`` decision (``runtime/tawpipe_cache.py``: ``auto``
  asks the memory model whether the buffers fit the device).
* ``replicate_first``: shard 0 is held by one rank in every group (the rank
  that would stage it), not by its owner alone: each holder keeps master
  weights, optimizer state and ``main`` gradient of it, its group's gradient
  of it is all-reduced among the holders (``AllReduceStart``) after the last
  backward, and every holder steps it identically.  No group waits for shard
  0 at the start of an iteration; with D = 2 the groups start together (no
  stagger unless asked for).  When the last visit has more than one
  micro-batch, the second-to-last visit's gradient leaves for its owner
  during it (after its first micro-batch), not with the iteration's last
  gradients.  The price is shard 0's master, optimizer state and gradient on
  D-1 more ranks (``Plan.replicas``).  Needs D >= 2; the simulator finds it
  faster for D = 2 and not for more groups.
* ``ownership="spread"``: each group keeps a 1/D slice of every shard (master weights, optimizer state,
  ``main`` gradient) on the rank that would stage it, the owner among them (``Plan.ownership``, the other
  holders in ``Plan.replicas``).  The groups run in step (no stagger), so the D holders of a shard need it
  at the same slot: they all-gather it (``AllGatherStart``, at a group's first visit with the cache, at every
  visit without) and, after its last backward (every backward visit without the cache), reduce-scatter the
  groups' gradients of it (``ReduceScatterStart``), each adding its slice into ``main``.  The same bytes
  between nodes as one owner with the cache, carried by every node link at once instead of queued on the
  owner's (docs/tawpipe-spread.md).
* ``early_grads`` (default: with ``ownership="spread"``): a shard's last backward visit's reduction is waited
  after the next visit's first micro-batch instead of after that whole visit, so its gradient leaves while
  the rest of the visit computes (with one owner the simulator finds it no faster: the early gradients queue
  on the owner's link with the others).
* ``groups``: scheduling groups (default: the physical groups).  ``groups=1``
  is the flat-group ablation (one group of all ranks, no GWPS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.builder import PlanBuilder

OWNERSHIPS = ("owner", "spread")   # shard state kept whole by one owner, or in slices by every group
START, END = -(10 ** 9), 10 ** 9    # slots before and after every visit
UNSET = -1                          # an empty key position: before every step placed there
WAIT, POST, COMP, AFTER = range(4)  # phases of a slot
# Steps of a shard's way in: in POST with overlap (fetch ``prefetch`` slots
# ahead, the rest one slot ahead), in WAIT of its own slot without.
FETCH, FETCHED, BROADCAST, BROADCASTED = range(4)
ZERO = 3            # POST: the visit's gradient buffers zeroed
WAITED = 0          # WAIT with overlap: the broadcast and gradient transfers waited
# Steps of the gradients' way out in AFTER without overlap (with overlap the
# reduction is waited at REDUCE of the next slot, see _gradient_keys).
REDUCE, REDUCED, READY, SEND, SENT = range(5)
LATE = 5            # AFTER: a shard no compute can hide is waited for after all of the above
ALL_REDUCE = 9      # AFTER: the replicated (embedding, head) gradients' all-reduce starts
OPEN, ALL_REDUCED, OPTIMIZER = range(3)  # phases at END: open transfers, replicated all-reduce, step
CACHED, REPLICA = 0, 5              # OPEN: cached gradients' transfer, shard 0's all-reduce waited


class Key(NamedTuple):
    """Where an action goes in its rank's list: the builder runs them in key (tuple) order.
    Visit v of group g is in slot ``v`` (``+ g`` with stagger, ``+ (D-1)`` per earlier round
    with drain); a slot's phases are WAIT (what its compute needs), POST (transfers for later
    slots), COMP (the micro-batches) and AFTER (the gradients' way out)."""
    slot: int           # visit slot of the rank's group; START or END
    phase: int          # WAIT, POST, COMP or AFTER (at END: OPEN, ALL_REDUCED or OPTIMIZER)
    step: int = UNSET   # order inside the phase (COMP: the micro-batch's index in the visit)
    sub: int = UNSET    # order among actions placed right after ``step``

    def next(self) -> "Key":
        """The key one further at this key's depth (its last set position plus one)."""
        if self.sub != UNSET:
            return Key(self.slot, self.phase, self.step, self.sub + 1)
        return Key(self.slot, self.phase, self.step + 1)


class Visit(NamedTuple):
    phase: str                  # "F" or "B"
    shard: int
    mbs: Tuple[int, ...]        # the micro-batches each rank of the group runs
    round: int                  # index of the micro-batch chunk


def tawpipe_owner(shard: int, num_groups: int, ranks_per_group: int) -> int:
    return (shard % num_groups) * ranks_per_group + (shard // num_groups) % ranks_per_group


def _visits(P: int, N: int, chunk: int) -> List[Visit]:
    """One group's visits, in order."""
    out = []
    rounds = [tuple(range(k, min(N, k + chunk))) for k in range(0, N, chunk)]
    for k, mbs in enumerate(rounds):
        out += [Visit("F", s, mbs, k) for s in range(P)]
        out += [Visit("B", s, mbs, k) for s in reversed(range(P))]
    return out


@dataclass
class _Layout:
    """A plan's shape, options and shard placement, as the helpers below read them."""
    b: PlanBuilder
    P: int                              # ranks (the shards: S, shards_per_rank x P)
    D: int                              # scheduling groups
    G: int                              # ranks per scheduling group
    overlap: bool
    cache: bool
    prefetch: int
    replicate_first: bool
    spread: bool                        # every group keeps a slice of every shard (``ownership="spread"``)
    early: bool                         # each shard's last gradient leaves right after its last backward
    slack: int                          # slots a group may run off its nominal stagger
    owner: List[int]
    replicas: Dict[int, Tuple[int, ...]]
    visits: List[Visit]
    first_b: Dict[int, int]             # shard -> its first backward visit
    last_b: Dict[int, int]              # shard -> its last backward visit

    @property
    def S(self) -> int:
        return len(self.owner)

    def own_buffer(self, s: int) -> str:
        """The owner's compute-dtype copy of shard ``s`` (one per owned shard)."""
        return "~wown" if self.S == self.P else f"~wown{s}"

    def root(self, g: int, s: int) -> int:
        """The rank of group ``g`` at which shard ``s`` arrives: its owner or its staging rank (spread: the
        group's holder of a slice of it, the same rank)."""
        return self.owner[s] if self.owner[s] // self.G == g else g * self.G + (s // self.D) % self.G

    def holders(self, s: int) -> List[int]:
        """Spread layout: the ranks that keep a slice of shard ``s``, one per group."""
        return [self.root(g, s) for g in range(self.D)]


def _weights_in(t: _Layout, members: List[int], v: int, tau: int, root: int,
                ahead: bool, prev_wbuf: Optional[dict], fetched: Set[int]) -> dict:
    """Bring visit ``v``'s shard to every member; returns their weight buffers."""
    s = t.visits[v].shard
    if v > 0 and t.visits[v - 1].shard == s:
        # The same shard as the previous visit (F then B of the last shard,
        # or B then F of shard 0): the group still has it.
        return prev_wbuf
    # The shard is normally waited for (and broadcast) before the previous visit's compute, so
    # that the broadcast hides behind it.  If no compute of this group lies between posting the
    # fetch and that point (the first visits, or after a drain gap), wait after the previous
    # visit instead, so that the fetch does.
    if ahead:
        fetched_key, bcast_key = Key(tau - 1, POST, FETCHED), Key(tau - 1, POST, BROADCAST)
    else:
        fetched_key, bcast_key = Key(tau - 1, AFTER, LATE, FETCHED), Key(tau - 1, AFTER, LATE, BROADCAST)
    wbuf = {m: f"~w{v}" for m in members}
    if t.spread:
        # Every group gathers the shard from the D slice holders at the same key (the groups run in
        # step): emitted once, with group 0's visit, for every holder.
        wbuf[root] = f"~wc{s}" if t.cache else f"~w{v}"
        if members[0] == 0 and (not t.cache or s not in fetched):
            fetched.add(s)
            keys = (Key(tau - t.prefetch, POST, FETCH), fetched_key) if t.overlap \
                else (Key(tau, WAIT, FETCH), Key(tau, WAIT, FETCHED))
            t.b.all_reduce(t.holders(s), {h: wbuf[root] for h in t.holders(s)}, "weight", s, *keys,
                           cls=A.AllGatherStart)
    elif root == t.owner[s]:
        wbuf[root] = t.own_buffer(s)
    elif root in t.replicas.get(s, ()):
        wbuf[root] = f"~wrep{s}"
    else:
        wbuf[root] = f"~wc{s}" if t.cache else f"~w{v}"
        if not t.cache or s not in fetched:
            fetched.add(s)
            keys = (Key(tau - t.prefetch, POST, FETCH), Key(END, OPEN), fetched_key) if t.overlap \
                else (Key(tau, WAIT, FETCH), Key(tau, WAIT, FETCHED), Key(tau, WAIT, FETCHED))
            t.b.p2p(t.owner[s], root, "weight", s, t.own_buffer(s), wbuf[root], *keys)
    if t.G > 1:
        keys = (bcast_key, Key(tau, WAIT, WAITED)) if t.overlap else \
            (Key(tau, WAIT, BROADCAST), Key(tau, WAIT, BROADCASTED))
        t.b.collective(A.BroadcastStart, root, members, wbuf, "weight", s, *keys)
    return wbuf


def _compute(t: _Layout, members: List[int], v: int, tau: int, root: int, wbuf: dict) -> dict:
    """Visit ``v``'s forwards or backwards; returns the gradient buffers of a backward."""
    phase, s, mbs, _ = t.visits[v]
    if phase == "F":
        for j, m in enumerate(mbs):
            for r in members:
                t.b.emit(r, Key(tau, COMP, j), A.Forward, m, s, wbuf[r])
        return {}
    gbuf = {m: f"~g{v}" for m in members}
    replicated = s in t.replicas
    cached = t.cache and (root != t.owner[s] or t.spread)
    if t.G == 1 and root == t.owner[s] and not replicated and not t.spread:
        gbuf[root] = A.MAIN             # straight into the owner's gradient
    elif replicated:
        gbuf[root] = f"~gx{s}"          # the group's gradient, all-reduced among the holders at the end
    elif cached:
        gbuf[root] = f"~gc{s}"
    for r in members:
        accumulating = r == root and (replicated or cached)
        if gbuf[r] != A.MAIN and (not accumulating or t.first_b[s] == v):
            t.b.emit(r, Key(tau, POST, ZERO), A.ZeroGrad, s, gbuf[r])
        for j, m in enumerate(mbs):
            t.b.emit(r, Key(tau, COMP, j), A.Backward, m, s, wbuf[r], gbuf[r])
    return gbuf


def _gradient_keys(t: _Layout, v: int, slots: List[int]) -> Tuple[Optional[Key], Key, Key]:
    """(reduction waited, gradient ready at the root, the key after that) of backward visit ``v``."""
    tau = slots[v]
    if t.G == 1:
        return None, Key(tau, AFTER, READY), Key(tau, AFTER, READY)
    if not t.overlap:
        reduced = Key(tau, AFTER, REDUCED)
    elif ((t.early and t.last_b[t.visits[v].shard] == v) or (t.replicate_first and v + 2 == len(t.visits))) \
            and v + 1 < len(t.visits) and slots[v + 1] == tau + 1 and len(t.visits[v + 1].mbs) > 1:
        # With replicate_first, when the next visit is the group's last, and with ``early`` for
        # every shard's last backward, when the next visit has more than one micro-batch: after its
        # first one, so that this gradient leaves for its owner(s) while the rest of that visit
        # computes, not after it (for the second-to-last visit: not after the whole backward).
        # (Not by default with one owner: moving a send ahead of others on the gradient channel can
        # block them behind a late receiver; the spread layout's reduce-scatters gain from it.)
        reduced = Key(tau + 1, COMP, 0, 1)
    else:
        # After the next visit's compute: a member that finished this visit
        # early does not wait for the slowest one.
        reduced = Key(tau + 1, AFTER, REDUCE)
    ready = reduced.next()
    return reduced, ready, ready.next()


def _gradients_out(t: _Layout, g: int, members: List[int], v: int, slots: List[int],
                   root: int, gbuf: dict) -> Optional[Key]:
    """Reduce backward visit ``v``'s gradient to the root and send it on to the owner;
    returns the key at which the group's gradient of a replicated shard is final."""
    s, tau = t.visits[v].shard, slots[v]
    reduced, ready, after_ready = _gradient_keys(t, v, slots)
    if reduced is not None:
        t.b.collective(A.ReduceStart, root, members, gbuf, "grad", s, Key(tau, AFTER, REDUCE), reduced)
    if s in t.replicas:
        return ready if t.last_b[s] == v else None
    if t.spread:
        _reduce_scatter(t, members, v, s, ready, after_ready, gbuf[root])
        return None
    if root == t.owner[s]:
        t.b.emit(root, ready, A.AccumulateToOwner, s, gbuf[root])
        return None
    if t.cache and t.last_b[s] != v:
        return None
    if t.overlap and t.cache:
        # The group's whole gradient of the shard, sent once; nothing reuses
        # the buffers, so nobody waits before the iteration ends.
        start, wait = after_ready, Key(END, OPEN, CACHED)
    elif t.overlap:
        start, wait = after_ready, Key(ready.slot + 1 + t.slack, WAIT, WAITED)
    else:
        start, wait = Key(tau, AFTER, SEND), Key(tau, AFTER, SENT)
    recv = f"~gr{g}.{v}"
    t.b.p2p(root, t.owner[s], "grad", s, gbuf[root], recv, start_key=start,
            src_wait_key=wait, dst_wait_key=wait)
    t.b.emit(t.owner[s], wait.next(), A.AccumulateToOwner, s, recv)
    return None


def _reduce_scatter(t: _Layout, members: List[int], v: int, s: int, ready: Key, after_ready: Key,
                    buf: str) -> None:
    """Spread layout: the groups' gradients of shard ``s`` reduce-scattered to its D slice holders (once,
    after the last backward, with the cache; after every backward visit without), each holder adding its
    slice into ``main``.  Emitted once, with group 0's visit, for every holder (the groups run in step)."""
    if members[0] != 0 or (t.cache and t.last_b[s] != v):
        return
    if t.overlap and t.cache:
        start, wait = after_ready, Key(END, OPEN, CACHED)
    elif t.overlap:
        start, wait = after_ready, Key(ready.slot + 1 + t.slack, WAIT, WAITED)
    else:
        start, wait = Key(ready.slot, AFTER, SEND), Key(ready.slot, AFTER, SENT)
    holders = t.holders(s)
    t.b.all_reduce(holders, {h: buf for h in holders}, "grad", s, start, wait, cls=A.ReduceScatterStart)
    for h in holders:
        t.b.emit(h, wait.next(), A.AccumulateToOwner, s, buf)


def _group(t: _Layout, g: int, slots: List[int]) -> Optional[Key]:
    """Every visit of group ``g`` (visit v in ``slots[v]``); returns the key at
    which its gradient of the replicated shard is final (None without one)."""
    members = list(range(g * t.G, (g + 1) * t.G))
    busy = set(slots)
    fetched: Set[int] = set()
    wbuf = replica_ready = None
    for v, visit in enumerate(t.visits):
        tau = slots[v]
        root = t.root(g, visit.shard)
        ahead = any(x in busy for x in range(tau - t.prefetch, tau - 1))
        wbuf = _weights_in(t, members, v, tau, root, ahead, wbuf, fetched)
        gbuf = _compute(t, members, v, tau, root, wbuf)
        if visit.phase == "B" and gbuf[root] != A.MAIN:
            replica_ready = _gradients_out(t, g, members, v, slots, root, gbuf) or replica_ready
    return replica_ready


def _replicated_gathers(t: _Layout, slots: List[List[int]], hierarchical: bool) -> None:
    """The replicated parts' optimizer sharded over the ranks: their weights all-gathered at the iteration's start
    from the slices the last step wrote, the embedding's waited before anything runs, the head's before the
    rank's first forward of the last shard (it travels during the forward of the others)."""
    b, P, G = t.b, t.P, t.G
    first_head = next(v for v, visit in enumerate(t.visits) if visit.phase == "F" and visit.shard == t.S - 1)
    start = {r: Key(START, 1) for r in range(P)}
    b.replicated_allreduce(start, Key(START, 2), "embedding", hierarchical, "gather")
    b.replicated_allreduce({r: Key(START, 1).next() for r in range(P)},
                           {r: Key(slots[r // G][first_head], WAIT) for r in range(P)}, "head", hierarchical, "gather")


def _iteration_end(t: _Layout, slots: List[List[int]], replica_ready: List[Optional[Key]],
                   hierarchical: bool, sharded: bool = False) -> None:
    """Shard 0's all-reduce among its holders, the replicated (embedding, head)
    gradients' all-reduce (``hierarchical``: through the nodes; ``sharded``: their reduce-scatter) and the
    optimizer step."""
    b, P, G = t.b, t.P, t.G
    for s in t.replicas:
        members = (t.owner[s],) + t.replicas[s]
        # Posted at the same key on every holder, after the last group's gradient is final
        # and after every rank's embedding all-reduce (one order of collectives on all ranks).
        last = Key(max(x[-1] for x in slots), AFTER, ALL_REDUCE)
        start = max([k for k in replica_ready if k is not None] + [last])
        b.all_reduce(members, {m: f"~gx{s}" for m in members}, "grad", s,
                     start.next(), Key(END, OPEN, REPLICA))
        for m in members:
            b.emit(m, Key(END, OPEN, REPLICA).next(), A.AccumulateToOwner, s, f"~gx{s}")
    head = [max(x[v] for v, visit in enumerate(t.visits) if visit.phase == "B" and visit.shard == t.S - 1)
            for x in slots]     # each group's slot of its last backward of the last shard
    b.replicated_allreduce_parts({r: Key(head[r // G], AFTER, ALL_REDUCE) for r in range(P)},
                                 {r: Key(slots[r // G][-1], AFTER, ALL_REDUCE) for r in range(P)},
                                 Key(END, ALL_REDUCED), hierarchical, "scatter" if sharded else "sum")
    for r in range(P):
        b.emit(r, Key(END, OPTIMIZER), A.OptimizerStep)


def _schedule_name(D: int, num_groups: int, overlap: bool, cache: bool, drain: bool,
                   replicate_first: bool, spread: bool = False) -> str:
    if not cache and drain and D == num_groups and overlap and not spread:
        return "tawpipe-paper"
    name = "tawpipe" if D == num_groups else ("tawpipe-flat" if D == 1 else f"tawpipe-groups{D}")
    return name + ("-rep" if replicate_first else "") + ("-spread" if spread else "") + \
        ("" if overlap else "-nooverlap")


def plan_tawpipe(num_ranks: int, num_groups: int, num_layers: int, num_microbatches: int,
                 groups: int = None, overlap: bool = True, stagger: bool = None,
                 drain: bool = False, chunk: int = 1, cache: bool = None, prefetch: int = 2,
                 replicate_first: bool = False, ownership: str = "owner", early_grads: bool = None,
                 hierarchical_replicated: bool = True, shards_per_rank: int = 1, sharded_replicated: bool = False):
    """TawPipe's plan (see the module's text). ``ownership``: ``"owner"`` (shard s kept whole by its owner)
    or ``"spread"`` (each group keeps a 1/D slice of every shard; the groups run in step, gather each shard
    from the D holders and reduce-scatter its gradient to them). ``early_grads``: each shard's last gradient
    leaves during the next visit (after its first micro-batch) instead of after it; default: with spread.
    ``hierarchical_replicated``: the replicated gradients' all-reduce goes through the nodes (inside each, across
    them, back inside) where there are several nodes of several ranks; otherwise one all-reduce over all.
    ``shards_per_rank``: the layers cut into that many times ``num_ranks`` shards. ``sharded_replicated``: the
    replicated parts' optimizer sharded over the ranks (their gradients reduce-scattered at the end, each rank
    stepping its slice, their weights all-gathered at the next iteration's start) instead of replicated (their
    gradients all-reduced)."""
    P, N = num_ranks, num_microbatches
    D = num_groups if groups is None else groups
    if ownership not in OWNERSHIPS:
        raise ValueError(f"ownership {ownership!r}: one of {', '.join(OWNERSHIPS)}")
    spread = ownership == "spread"
    if spread and (D < 2 or replicate_first or stagger):
        raise ValueError("spread ownership needs two or more scheduling groups, running in step (no stagger), "
                         "and holds every shard in every group already (no replicate_first)")
    if D < 1 or P % D:
        raise ValueError(f"scheduling groups ({D}) must divide ranks ({P})")
    if shards_per_rank < 1:
        raise ValueError("shards_per_rank must be >= 1")
    if num_layers < P * shards_per_rank:
        raise ValueError(f"num_layers ({num_layers}) must be at least the number of shards ({P * shards_per_rank}: "
                         f"{shards_per_rank} per rank): one layer each")
    if chunk < 1 or prefetch < 1:
        raise ValueError("chunk and prefetch must be >= 1")
    G = P // D
    S = P * shards_per_rank
    if replicate_first and D < 2:
        raise ValueError("replicate_first needs at least 2 scheduling groups (one holder of shard 0 per group)")
    if spread:
        stagger = False
    if early_grads is None:
        early_grads = spread
    if stagger is None:
        # Two groups that both hold shard 0 start together (a stagger would only delay the
        # second); with more, staggering still spreads each slot's fetches over the owners.
        stagger = not replicate_first or D > 2
    if cache is None:
        # The planner knows no memory: keep foreign shards for a few groups (nodes) by default.  Callers
        # that do (pretrain_llama.py's --tawpipe-cache auto, the advisor) choose explicitly.
        cache = D <= 4
    # Groups may run up to D-1 slots ahead of or behind their nominal stagger (they only stay
    # staggered while links are the bottleneck), so the side of an inter-group gradient transfer
    # that does not need it soon waits D-1 slots late.  Both sides *post* a transfer at the same
    # slot: on NCCL a posted send holds its stream until the receive runs, and equal keys are
    # what make the builder's batches line up (builder._batch_p2p).
    slack = D - 1 if stagger or drain else 0
    b = PlanBuilder(P, num_groups)
    owner = [tawpipe_owner(s, D, G) for s in range(S)]
    # A replicated shard's holder in group g is the rank that would otherwise stage it there.
    replicas = {0: tuple(g * G for g in range(D) if g != owner[0] // G)} if replicate_first else {}
    visits = _visits(S, N, chunk)
    backward = [(v, x.shard) for v, x in enumerate(visits) if x.phase == "B"]
    t = _Layout(b, P, D, G, overlap, cache, prefetch, replicate_first, spread, early_grads, slack, owner,
                replicas, visits, first_b={s: v for v, s in reversed(backward)}, last_b={s: v for v, s in backward})
    for s in range(S):
        if not spread:
            b.emit(owner[s], Key(START, 0), A.LoadWeights, s, t.own_buffer(s))
        for r in replicas.get(s, ()):
            b.emit(r, Key(START, 0), A.LoadWeights, s, f"~wrep{s}")
    slots = [[(g if stagger else 0) + v + (x.round * (D - 1) if drain else 0)
              for v, x in enumerate(visits)] for g in range(D)]
    replica_ready = [_group(t, g, slots[g]) for g in range(D)]
    if sharded_replicated:
        _replicated_gathers(t, slots, hierarchical_replicated)
    _iteration_end(t, slots, replica_ready, hierarchical_replicated, sharded_replicated)
    if spread:     # the plan's holders of shard s: its owner and the other groups' slice holders
        replicas = {s: tuple(h for h in t.holders(s) if h != owner[s]) for s in range(S)}
    return b.build(schedule=_schedule_name(D, num_groups, overlap, cache, drain, replicate_first, spread),
                   family="weight", num_layers=num_layers, num_microbatches=N,
                   owners=owner, streams=range(P), replicas=replicas, ownership=ownership,
                   options={"groups": D, "overlap": overlap, "stagger": stagger,
                            "drain": drain, "chunk": chunk, "cache": cache,
                            "prefetch": prefetch, **({"replicate_first": True} if replicate_first else {}),
                            **({"ownership": ownership} if spread else {}),
                            **({"early_grads": True} if early_grads else {}),
                            **({} if hierarchical_replicated else {"flat_replicated": True}),
                            **({"sharded_replicated": True} if sharded_replicated else {}),
                            **({"shards_per_rank": shards_per_rank} if shards_per_rank > 1 else {}),
                            "slots": max(x[-1] for x in slots) + 1})
