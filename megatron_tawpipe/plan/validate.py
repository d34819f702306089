"""Prove a plan sound before anyone runs it.

Two passes.  The static pass matches communication: every send has exactly
one receive with the same tag and fields, every collective has all its members
with the same fields, matched operations are posted in the same order on every
(src, dst, channel) and on every communicator, every wait belongs to an
earlier start on the same rank, buffer names stay within the plan's bounds.

The dynamic pass executes all ranks symbolically under conservative blocking
semantics: starts never block; a wait completes only when every participant
of the operation has posted its start (a send needs its receive posted, a
collective all members).  If no rank can move while some are unfinished, the
plan deadlocks.  Along the way it tracks which shard each weight buffer holds,
which (stream, micro-batch) contributions each gradient buffer holds (as a bit
set, following them through sends, reductions and accumulation), the order of
forward/backward work of every micro-batch, and buffer hazards (a buffer with
a transfer in flight may not be written, and one being received into may not
be read).  At the end every owner's gradient must hold each of the
``streams * N`` contributions exactly once.

Errors are ``PlanError`` with ``rank``, ``step`` and ``action`` set where one
place is to blame.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional

from . import actions as A
from .plan import Plan


class PlanError(Exception):
    def __init__(self, message: str, rank: Optional[int] = None, step: Optional[int] = None,
                 action=None):
        self.rank, self.step, self.action = rank, step, action
        if rank is not None:
            where = f"rank {rank}, step {step}"
            if action is not None:
                where += f", {A.describe(action)}"
            message = f"{where}: {message}"
        super().__init__(message)


@dataclass
class ValidationReport:
    actions: int
    transfers: int
    collectives: int
    weight_buffers: int
    grad_buffers: int
    contributions: int


def validate_plan(plan: Plan) -> ValidationReport:
    """Raise ``PlanError`` unless ``plan`` is sound; return a few counts."""
    _check_meta(plan)
    starts = _check_static(plan)
    _Executor(plan, starts).run()
    p2p = sum(1 for v in starts.values() if isinstance(v[0][2], A.P2P))
    return ValidationReport(actions=plan.num_actions(), transfers=p2p,
                            collectives=len(starts) - p2p,
                            weight_buffers=plan.max_weight_buffers,
                            grad_buffers=plan.max_grad_buffers,
                            contributions=plan.num_streams * plan.num_microbatches * plan.num_shards)


# ---------------------------------------------------------------- metadata
def _check_meta(plan: Plan) -> None:
    P = plan.num_ranks
    if len(plan.actions) != P or len(plan.streams) != P:
        raise PlanError(f"plan has {len(plan.actions)} action lists and {len(plan.streams)} "
                        f"streams for {P} ranks")
    if plan.num_groups < 1 or P % plan.num_groups:
        raise PlanError(f"{plan.num_groups} groups do not divide {P} ranks")
    if plan.num_shards < 1 or plan.num_layers % plan.num_shards:
        raise PlanError(f"{plan.num_layers} layers cannot be cut into {plan.num_shards} shards")
    if any(not 0 <= o < P for o in plan.owners):
        raise PlanError(f"shard owners {plan.owners} name ranks outside 0..{P - 1}")
    if plan.family == "weight" and sorted(plan.owners) != list(range(P)):
        raise PlanError("weight passing needs every rank to own exactly one shard "
                        f"(owners {plan.owners})")
    if plan.family not in ("weight", "activation"):
        raise PlanError(f"unknown plan family {plan.family!r}")


# ----------------------------------------------------------------- static
# Buffer fields with a fixed role, per action type; communication actions
# take the role from their kind.
_ROLE_FIELDS = {
    A.Forward: (("wbuf", "weight"),), A.BackwardInput: (("wbuf", "weight"),),
    A.Backward: (("wbuf", "weight"), ("gbuf", "grad")),
    A.BackwardWeight: (("wbuf", "weight"), ("gbuf", "grad")),
    A.LoadWeights: (("buf", "weight"),), A.ZeroGrad: (("buf", "grad"),),
    A.AccumulateToOwner: (("buf", "grad"),),
}
_COMM_BUF = frozenset((A.SendStart, A.RecvStart, A.BroadcastStart, A.ReduceStart))
_KNOWN = frozenset(A.ACTION_TYPES)
_MAIN_OK = frozenset((A.Backward, A.BackwardWeight))


def _check_static(plan: Plan):
    P = plan.num_ranks
    G = plan.ranks_per_group
    starts: Dict[int, list] = defaultdict(list)         # tag -> [(rank, step, action)]
    p2p_order = defaultdict(list)                       # (src, dst, channel, side) -> [tag]
    comm_order = defaultdict(list)                      # (ranks, channel, rank) -> [tag]
    for r, acts in enumerate(plan.actions):
        open_tags = set()
        seen_tags = set()
        roles: Dict[str, str] = {}
        for i, a in enumerate(acts):
            t = type(a)
            if t is A.Wait:
                if a.tag not in open_tags:
                    raise PlanError(f"waits for tag {a.tag}, which this rank has not started "
                                    "(or already waited for)", r, i, a)
                open_tags.discard(a.tag)
                continue
            if t not in _KNOWN:
                raise PlanError("not a plan action", r, i, a)
            fields = _ROLE_FIELDS.get(t)
            if fields is None and t in _COMM_BUF and a.kind in ("weight", "grad"):
                fields = (("buf", a.kind),)
            if fields:
                for f, role in fields:
                    name = getattr(a, f)
                    if name == A.MAIN:
                        if role != "grad" or t not in _MAIN_OK:
                            raise PlanError("'main' may only be the gradient target of a "
                                            "backward", r, i, a)
                        continue
                    if roles.setdefault(name, role) != role:
                        raise PlanError(f"buffer {name!r} is used both as {roles[name]} and "
                                        f"{role} buffer", r, i, a)
            if t in _STARTS:
                if a.tag in seen_tags:
                    raise PlanError(f"tag {a.tag} started twice on this rank", r, i, a)
                seen_tags.add(a.tag)
                open_tags.add(a.tag)
                starts[a.tag].append((r, i, a))
                if t in A.P2P:
                    if not 0 <= a.peer < P or a.peer == r:
                        raise PlanError(f"bad peer {a.peer}", r, i, a)
                    if a.kind not in A.KINDS:
                        raise PlanError(f"unknown kind {a.kind!r}", r, i, a)
                    if a.link != ("intra" if r // G == a.peer // G else "inter"):
                        raise PlanError(f"link class should be {plan.link_between(r, a.peer)!r}",
                                        r, i, a)
                    key = (r, a.peer) if t is A.SendStart else (a.peer, r)
                    p2p_order[key + (A.CHANNEL[a.kind], t is A.SendStart)].append(a.tag)
                else:
                    if r not in a.ranks or tuple(sorted(set(a.ranks))) != a.ranks or \
                            any(not 0 <= x < P for x in a.ranks):
                        raise PlanError(f"member list {a.ranks} must be sorted, distinct and "
                                        "include this rank", r, i, a)
                    channel = "replicated"
                    if t is not A.ReplicatedAllReduceStart:
                        if a.root not in a.ranks:
                            raise PlanError(f"root {a.root} is not a member", r, i, a)
                        if a.kind not in ("weight", "grad"):
                            raise PlanError(f"collectives move weights or grads, not {a.kind!r}",
                                            r, i, a)
                        want = "intra" if a.ranks[0] // G == a.ranks[-1] // G else "inter"
                        if a.link != want:
                            raise PlanError(f"link class should be {want!r}", r, i, a)
                        channel = A.CHANNEL[a.kind]
                    comm_order[(a.ranks, channel, r)].append(a.tag)
        if open_tags:
            tag = min(open_tags)
            rr, i, a = next(x for x in starts[tag] if x[0] == r)
            raise PlanError("started but never waited for", rr, i, a)
        for role, bound in (("weight", plan.max_weight_buffers), ("grad", plan.max_grad_buffers)):
            names = sorted(n for n, x in roles.items() if x == role)
            if len(names) > bound:
                raise PlanError(f"rank {r} uses {len(names)} {role} buffers {names}, more than "
                                f"the plan's bound {bound}")
    _check_matching(plan, starts)
    for (src, dst, channel, is_send), tags in p2p_order.items():
        if is_send:
            other = p2p_order.get((src, dst, channel, False), [])
            if tags != other:
                _order_error(plan, starts, tags, other, f"sends {src}->{dst} on channel "
                             f"{channel!r} and their receives are posted in different orders")
    by_comm = defaultdict(dict)
    for (ranks, channel, r), tags in comm_order.items():
        by_comm[(ranks, channel)][r] = tags
    for (ranks, channel), per_rank in by_comm.items():
        ref_rank = ranks[0]
        ref = per_rank.get(ref_rank, [])
        for r in ranks[1:]:
            if per_rank.get(r, []) != ref:
                _order_error(plan, starts, ref, per_rank.get(r, []),
                             f"collectives on communicator {ranks}/{channel} are issued in "
                             f"different orders on ranks {ref_rank} and {r}")
    return starts


def _order_error(plan, starts, a_tags, b_tags, what):
    for x, y in zip(a_tags, b_tags):
        if x != y:
            r, i, a = starts[y][-1]
            raise PlanError(f"{what}: expected tag {x} here", r, i, a)
    raise PlanError(what)


def _check_matching(plan: Plan, starts) -> None:
    for tag, posts in starts.items():
        r0, i0, a0 = posts[0]
        t = type(a0)
        if t in A.P2P:
            sends = [p for p in posts if type(p[2]) is A.SendStart]
            recvs = [p for p in posts if type(p[2]) is A.RecvStart]
            if len(posts) == 1 or not sends or not recvs:
                kind = "receive" if sends else "send"
                raise PlanError(f"has no matching {kind} (tag {tag})", r0, i0, a0)
            if len(posts) > 2 or len(sends) != 1:
                r, i, a = posts[2] if len(posts) > 2 else posts[1]
                raise PlanError(f"tag {tag} is used by more than one send/receive pair", r, i, a)
            (rs, i_s, s), (rr, i_r, rv) = sends[0], recvs[0]
            if s.peer != rr or rv.peer != rs:
                raise PlanError(f"send to rank {s.peer} is matched by a receive on rank {rr} "
                                f"from rank {rv.peer}", rr, i_r, rv)
            for f in ("kind", "shard", "size", "mb", "link"):
                if getattr(s, f) != getattr(rv, f):
                    raise PlanError(f"{f} differs from the matching send on rank {rs} step {i_s} "
                                    f"({A.describe(s)})", rr, i_r, rv)
        else:
            members = a0.ranks
            have = {p[0] for p in posts}
            missing = [m for m in members if m not in have]
            if missing:
                raise PlanError(f"collective tag {tag}: members {missing} never start it", r0, i0, a0)
            ref = _fields_but_buf(a0)
            for r, i, a in posts:
                if type(a) is not t or _fields_but_buf(a) != ref:
                    raise PlanError(f"differs from the same collective on rank {r0} step {i0} "
                                    f"({A.describe(a0)})", r, i, a)
                if r not in members:
                    raise PlanError(f"rank {r} is not a member of collective tag {tag}", r, i, a)


def _fields_but_buf(a):
    """The fields that must agree across members (buffers are per rank)."""
    return tuple(getattr(a, f) for f in A.FIELD_NAMES[type(a)] if f != "buf")


_STARTS = frozenset(A.STARTS)


# ---------------------------------------------------------------- dynamic
class _RankState:
    __slots__ = ("w", "g", "moved", "locks", "pending", "main", "act", "agrad", "pc",
                 "replicated_done", "compute_closed")

    def __init__(self):
        self.w: Dict[str, int] = {}                 # weight buffer -> shard
        self.g: Dict[str, list] = {}                # grad buffer -> [shard, mask]
        self.moved: Dict[str, int] = {}             # grad buffer -> step that emptied it
        self.locks: Dict[str, Dict[int, str]] = {}  # buffer -> {tag: 'r'|'w'}
        self.pending: Dict[int, tuple] = {}         # tag -> (step, action, snapshot)
        self.main: Dict[int, int] = {}              # owned shard -> mask
        self.act = set()                            # (mb, shard) input boundaries held
        self.agrad = set()                          # (mb, shard) output gradients held
        self.pc = 0
        self.replicated_done = False
        self.compute_closed = False


class _Executor:
    def __init__(self, plan: Plan, starts):
        self.plan = plan
        self.starts = starts
        self.S = plan.num_shards
        self.N = plan.num_microbatches
        stream_ids = sorted(set(plan.streams))
        self.stream_index = {s: i for i, s in enumerate(stream_ids)}
        self.full = (1 << (len(stream_ids) * self.N)) - 1
        self.state = [_RankState() for _ in range(plan.num_ranks)]
        for s, o in enumerate(plan.owners):
            self.state[o].main[s] = 0
        self.posted: Dict[int, Dict[int, object]] = defaultdict(dict)  # tag -> rank -> snapshot
        self.waiters: Dict[int, List[int]] = defaultdict(list)
        self.fwd_next: Dict[tuple, int] = {}
        self.bwd_next: Dict[tuple, int] = {}
        self.fwd_rank: Dict[tuple, int] = {}
        self.bi_open: Dict[tuple, int] = {}
        self.activation = plan.family == "activation"
        self._woken: List[int] = []
        self.need = {tag: len(posts) for tag, posts in starts.items()}

    # --------------------------------------------------------------- driver
    def run(self) -> None:
        plan = self.plan
        ready = list(range(plan.num_ranks))
        blocked: Dict[int, int] = {}
        while ready:
            r = ready.pop()
            tag = self._advance(r)
            if tag is not None:
                blocked[r] = tag
                self.waiters[tag].append(r)
            woken = self._woken
            if woken:
                for x in woken:
                    if x in blocked:
                        del blocked[x]
                        ready.append(x)
                self._woken = []
        unfinished = [r for r in range(plan.num_ranks) if self.state[r].pc < len(plan.actions[r])]
        if unfinished:
            self._deadlock(unfinished)
        self._final_checks()

    def _advance(self, r: int) -> Optional[int]:
        """Run rank ``r`` until it finishes or blocks; return the blocking tag."""
        st = self.state[r]
        acts = self.plan.actions[r]
        handlers = self._handlers
        posted, need, Wait = self.posted, self.need, A.Wait
        pc, n = st.pc, len(acts)
        try:
            while pc < n:
                a = acts[pc]
                if type(a) is Wait:
                    got = posted.get(a.tag)
                    if got is None or len(got) != need[a.tag]:
                        return a.tag
                    self._finish_wait(r, st, pc, a)
                else:
                    st.pc = pc
                    handlers[type(a)](self, r, st, pc, a)
                pc += 1
            return None
        finally:
            st.pc = pc

    def _post(self, r: int, tag: int, snapshot) -> None:
        posted = self.posted[tag]
        posted[r] = snapshot
        if len(posted) == self.need[tag] and tag in self.waiters:
            self._woken = self._woken + self.waiters.pop(tag)

    # ------------------------------------------------------------- helpers
    def _err(self, msg, r, i, a):
        raise PlanError(msg, r, i, a)

    def _unlocked(self, st, buf, r, i, a, allow_read=False):
        locks = st.locks.get(buf)
        if locks:
            if allow_read and "w" not in locks.values():
                return
            tag = next(iter(locks))
            self._err(f"buffer {buf!r} has a transfer in flight (tag {tag}, not yet waited)", r, i, a)

    def _lock(self, st, buf, tag, mode):
        st.locks.setdefault(buf, {})[tag] = mode

    def _weight(self, st, buf, shard, r, i, a):
        self._unlocked(st, buf, r, i, a, allow_read=True)
        held = st.w.get(buf)
        if held != shard:
            what = "nothing" if held is None else f"shard {held}"
            self._err(f"weight buffer {buf!r} holds {what}, not shard {shard}", r, i, a)

    def _grad_target(self, st, buf, shard, r, i, a) -> list:
        self._unlocked(st, buf, r, i, a)
        entry = st.g.get(buf)
        if entry is None:
            if buf in st.moved:
                self._err(f"gradient buffer {buf!r} was emptied at step {st.moved[buf]} "
                          "(sent, reduced or accumulated) and not re-initialised", r, i, a)
            self._err(f"gradient buffer {buf!r} was never initialised (ZeroGrad or receive)",
                      r, i, a)
        if entry[0] != shard:
            self._err(f"gradient buffer {buf!r} holds shard {entry[0]}, not shard {shard}", r, i, a)
        return entry

    def _add(self, mask_holder, key, bits, what, r, i, a):
        cur = mask_holder[key]
        cur_mask = cur[1] if isinstance(cur, list) else cur
        dup = cur_mask & bits
        if dup:
            self._err(f"{what} would count contributions {self._describe_mask(dup)} twice", r, i, a)
        if isinstance(cur, list):
            cur[1] = cur_mask | bits
        else:
            mask_holder[key] = cur_mask | bits

    def _describe_mask(self, mask: int) -> str:
        items = []
        streams = sorted(self.stream_index, key=self.stream_index.get)
        bit = 0
        while mask and len(items) < 4:
            if mask & 1:
                items.append(f"(stream {streams[bit // self.N]}, mb {bit % self.N})")
            mask >>= 1
            bit += 1
        return ", ".join(items) + (" ..." if mask else "")

    def _mb_key(self, r, i, a):
        if not 0 <= a.mb < self.N:
            self._err(f"micro-batch {a.mb} outside 0..{self.N - 1}", r, i, a)
        if not 0 <= a.shard < self.S:
            self._err(f"shard {a.shard} outside 0..{self.S - 1}", r, i, a)
        if self.state[r].compute_closed:
            self._err("compute after the replicated all-reduce started", r, i, a)
        return (self.plan.streams[r], a.mb)

    # ------------------------------------------------------------- compute
    def _forward(self, r, st, i, a):
        key = self._mb_key(r, i, a)
        self._weight(st, a.wbuf, a.shard, r, i, a)
        nxt = self.fwd_next.get(key, 0)
        if nxt != a.shard:
            self._err(f"forward of micro-batch {a.mb} reaches shard {a.shard} but its next "
                      f"forward shard is {nxt}", r, i, a)
        if self.activation and a.shard > 0 and (a.mb, a.shard) not in st.act:
            self._err(f"input activation of (mb {a.mb}, shard {a.shard}) is not on this rank",
                      r, i, a)
        self.fwd_next[key] = nxt + 1
        self.fwd_rank[key + (a.shard,)] = r
        if self.activation and a.shard + 1 < self.S:
            st.act.add((a.mb, a.shard + 1))

    def _backward_input(self, r, st, i, a):
        key = self._mb_key(r, i, a)
        self._weight(st, a.wbuf, a.shard, r, i, a)
        if self.fwd_next.get(key, 0) != self.S:
            self._err(f"backward of micro-batch {a.mb} before its forward finished", r, i, a)
        nxt = self.bwd_next.get(key, self.S - 1)
        if nxt != a.shard:
            self._err(f"backward of micro-batch {a.mb} reaches shard {a.shard} but its next "
                      f"backward shard is {nxt}", r, i, a)
        if self.fwd_rank.get(key + (a.shard,)) != r:
            self._err(f"the forward of (mb {a.mb}, shard {a.shard}) ran on rank "
                      f"{self.fwd_rank.get(key + (a.shard,))}, its saved input is not here", r, i, a)
        if self.activation and a.shard < self.S - 1 and (a.mb, a.shard) not in st.agrad:
            self._err(f"output gradient of (mb {a.mb}, shard {a.shard}) is not on this rank",
                      r, i, a)
        self.bwd_next[key] = nxt - 1
        if self.activation and a.shard > 0:
            st.agrad.add((a.mb, a.shard - 1))
        return key

    def _weight_grad(self, r, st, i, a, key):
        bit = 1 << (self.stream_index[key[0]] * self.N + a.mb)
        if a.gbuf == A.MAIN:
            if a.shard not in st.main:
                self._err(f"writes 'main' but this rank does not own shard {a.shard}", r, i, a)
            self._add(st.main, a.shard, bit, "this backward", r, i, a)
        else:
            entry = self._grad_target(st, a.gbuf, a.shard, r, i, a)
            self._add(st.g, a.gbuf, bit, "this backward", r, i, a)
            del entry

    def _backward(self, r, st, i, a):
        key = self._backward_input(r, st, i, a)
        self._weight_grad(r, st, i, a, key)

    def _bi(self, r, st, i, a):
        key = self._backward_input(r, st, i, a)
        self.bi_open[key + (a.shard,)] = r

    def _bw(self, r, st, i, a):
        key = self._mb_key(r, i, a)
        self._weight(st, a.wbuf, a.shard, r, i, a)
        if self.bi_open.pop(key + (a.shard,), None) != r:
            self._err(f"no BackwardInput of (mb {a.mb}, shard {a.shard}) on this rank precedes "
                      "it", r, i, a)
        self._weight_grad(r, st, i, a, key)

    # --------------------------------------------------------------- local
    def _load(self, r, st, i, a):
        if not 0 <= a.shard < self.S or self.plan.owners[a.shard] != r:
            self._err(f"only the owner of shard {a.shard} can load it", r, i, a)
        self._unlocked(st, a.buf, r, i, a)
        st.w[a.buf] = a.shard

    def _zero(self, r, st, i, a):
        self._unlocked(st, a.buf, r, i, a)
        entry = st.g.get(a.buf)
        if entry is not None and entry[1]:
            self._err(f"discards undelivered contributions {self._describe_mask(entry[1])} of "
                      f"shard {entry[0]} in {a.buf!r}", r, i, a)
        st.g[a.buf] = [a.shard, 0]
        st.moved.pop(a.buf, None)

    def _accumulate(self, r, st, i, a):
        if a.shard not in st.main:
            self._err(f"this rank does not own shard {a.shard}", r, i, a)
        entry = self._grad_target(st, a.buf, a.shard, r, i, a)
        self._add(st.main, a.shard, entry[1], "accumulating", r, i, a)
        del st.g[a.buf]
        st.moved[a.buf] = i

    def _optimizer(self, r, st, i, a):
        if st.pending:
            tag = next(iter(st.pending))
            self._err(f"operation tag {tag} still in flight", r, i, a)
        if i != len(self.plan.actions[r]) - 1:
            self._err("the optimizer step must be the last action", r, i, a)
        if self.plan.family == "weight" and not st.replicated_done:
            self._err("replicated gradients were not all-reduced before the step", r, i, a)
        for shard, mask in st.main.items():
            if mask != self.full:
                self._err(f"gradient of owned shard {shard} is missing contributions "
                          f"{self._describe_mask(self.full & ~mask)}", r, i, a)

    # ------------------------------------------------------------- comm starts
    def _send(self, r, st, i, a):
        snap = self._outgoing(r, st, i, a)
        if a.kind in ("weight", "grad"):
            self._lock(st, a.buf, a.tag, "r")
        st.pending[a.tag] = (i, a, snap)
        self._post(r, a.tag, snap)

    def _outgoing(self, r, st, i, a):
        if a.kind == "weight":
            self._weight(st, a.buf, a.shard, r, i, a)
            return a.shard
        if a.kind == "grad":
            entry = self._grad_target_read(st, a.buf, a.shard, r, i, a)
            del st.g[a.buf]
            st.moved[a.buf] = i
            return entry[1]
        token = (a.mb, a.shard)
        held = st.act if a.kind == "act" else st.agrad
        if token not in held:
            self._err(f"{a.kind} of (mb {a.mb}, shard {a.shard}) is not on this rank", r, i, a)
        return token

    def _grad_target_read(self, st, buf, shard, r, i, a):
        locks = st.locks.get(buf)
        if locks and "w" in locks.values():
            self._err(f"buffer {buf!r} is being received into (not yet waited)", r, i, a)
        if st.g.get(buf) is None:
            if buf in st.moved:
                self._err(f"gradient buffer {buf!r} holds no gradient: its contributions already "
                          f"left at step {st.moved[buf]} and would be counted twice", r, i, a)
            self._err(f"gradient buffer {buf!r} was never initialised", r, i, a)
        entry = st.g[buf]
        if entry[0] != shard:
            self._err(f"gradient buffer {buf!r} holds shard {entry[0]}, not shard {shard}", r, i, a)
        return entry

    def _recv(self, r, st, i, a):
        if a.kind in ("weight", "grad"):
            self._unlocked(st, a.buf, r, i, a)
            if a.kind == "grad":
                entry = st.g.get(a.buf)
                if entry is not None and entry[1]:
                    self._err(f"receiving into {a.buf!r} discards its undelivered contributions",
                              r, i, a)
                st.g.pop(a.buf, None)
            else:
                st.w.pop(a.buf, None)
            self._lock(st, a.buf, a.tag, "w")
        st.pending[a.tag] = (i, a, None)
        self._post(r, a.tag, None)

    def _broadcast(self, r, st, i, a):
        if a.kind != "weight":
            self._err("broadcasting a gradient would duplicate its contributions", r, i, a)
        if r == a.root:
            self._weight(st, a.buf, a.shard, r, i, a)
            snap = a.shard
            self._lock(st, a.buf, a.tag, "r")
        else:
            self._unlocked(st, a.buf, r, i, a)
            st.w.pop(a.buf, None)
            snap = None
            self._lock(st, a.buf, a.tag, "w")
        st.pending[a.tag] = (i, a, snap)
        self._post(r, a.tag, snap)

    def _reduce(self, r, st, i, a):
        if a.kind != "grad":
            self._err("only gradients can be reduced", r, i, a)
        if r == a.root:
            entry = self._grad_target(st, a.buf, a.shard, r, i, a)
            snap = entry[1]
            self._lock(st, a.buf, a.tag, "w")
        else:
            entry = self._grad_target_read(st, a.buf, a.shard, r, i, a)
            snap = entry[1]
            del st.g[a.buf]
            st.moved[a.buf] = i
            self._lock(st, a.buf, a.tag, "r")
        st.pending[a.tag] = (i, a, snap)
        self._post(r, a.tag, snap)

    def _replicated(self, r, st, i, a):
        st.compute_closed = True
        st.pending[a.tag] = (i, a, None)
        self._post(r, a.tag, None)

    # ---------------------------------------------------------------- waits
    def _finish_wait(self, r, st, i, w):
        start_step, a, _ = st.pending.pop(w.tag)
        t = type(a)
        if t is not A.ReplicatedAllReduceStart and (a.kind == "weight" or a.kind == "grad"):
            locks = st.locks[a.buf]
            del locks[w.tag]
            if not locks:
                del st.locks[a.buf]
        if t is A.RecvStart:
            sender = a.peer
            snap = self.posted[w.tag][sender]
            if a.kind == "weight":
                st.w[a.buf] = snap
            elif a.kind == "grad":
                st.g[a.buf] = [a.shard, snap]
                st.moved.pop(a.buf, None)
            elif a.kind == "act":
                st.act.add(snap)
            else:
                st.agrad.add(snap)
        elif t is A.BroadcastStart and r != a.root:
            st.w[a.buf] = self.posted[w.tag][a.root]
        elif t is A.ReduceStart and r == a.root:
            total = 0
            for member, snap in self.posted[w.tag].items():
                if total & snap:
                    self._err(f"reduction counts contributions {self._describe_mask(total & snap)}"
                              f" twice (member {member})", r, i, w)
                total |= snap
            st.g[a.buf] = [a.shard, total]
        elif t is A.ReplicatedAllReduceStart:
            st.replicated_done = True

    # ---------------------------------------------------------------- end
    def _deadlock(self, unfinished) -> None:
        lines = []
        for r in unfinished:
            st = self.state[r]
            i = st.pc
            a = self.plan.actions[r][i]
            if type(a) is A.Wait:
                _, start, _ = st.pending[a.tag]
                missing = [x[0] for x in self.starts[a.tag] if x[0] not in self.posted.get(a.tag, {})]
                lines.append((r, i, a, f"waits for {A.describe(start)}; rank(s) {missing} have not "
                              "posted their side"))
            else:
                lines.append((r, i, a, "cannot proceed"))
        r, i, a, why = lines[0]
        more = "; ".join(f"rank {rr} step {ii} {A.short(aa)}: {ww}" for rr, ii, aa, ww in lines[1:6])
        raise PlanError(f"deadlock: {why}" + (f". Also blocked: {more}" if more else ""), r, i, a)

    def _final_checks(self) -> None:
        S, N = self.S, self.N
        for stream in self.stream_index:
            for m in range(N):
                key = (stream, m)
                if self.fwd_next.get(key, 0) != S or self.bwd_next.get(key, S - 1) != -1:
                    raise PlanError(f"micro-batch {m} of stream {stream} ran {self.fwd_next.get(key, 0)}"
                                    f" of {S} forward and {S - 1 - self.bwd_next.get(key, S - 1)} of {S}"
                                    " backward shards")
        if self.bi_open:
            key = next(iter(self.bi_open))
            raise PlanError(f"BackwardInput of {key} has no BackwardWeight")
        for r, st in enumerate(self.state):
            for buf, (shard, mask) in st.g.items():
                if mask:
                    raise PlanError(f"rank {r}: gradient buffer {buf!r} ends holding undelivered "
                                    f"contributions {self._describe_mask(mask)} of shard {shard}")
            for shard, mask in st.main.items():
                if mask != self.full:
                    raise PlanError(f"rank {r}: gradient of owned shard {shard} is missing "
                                    f"contributions {self._describe_mask(self.full & ~mask)}")
            acts = self.plan.actions[r]
            if not acts or type(acts[-1]) is not A.OptimizerStep or \
                    sum(type(x) is A.OptimizerStep for x in acts) != 1:
                raise PlanError(f"rank {r} must end with exactly one OptimizerStep")

    _handlers = {
        A.Forward: _forward, A.Backward: _backward, A.BackwardInput: _bi, A.BackwardWeight: _bw,
        A.LoadWeights: _load, A.ZeroGrad: _zero, A.AccumulateToOwner: _accumulate,
        A.OptimizerStep: _optimizer, A.SendStart: _send, A.RecvStart: _recv,
        A.BroadcastStart: _broadcast, A.ReduceStart: _reduce,
        A.ReplicatedAllReduceStart: _replicated,
    }
