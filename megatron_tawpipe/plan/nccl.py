"""NCCL's ordering rules, as a model a plan must satisfy.

gloo matches point-to-point messages by tag and progresses each one on its
own; NCCL does neither (docs/nccl.md).  This module executes a plan's
communication the way ProcessGroupNCCL runs it and raises ``PlanError`` where
a cluster would hang:

* Every start action is enqueued, in the rank's issue order, on a *stream*
  (a FIFO) of one communicator.  An entry is one start, or every start of one
  ``batch`` (an NCCL group: ``batch_isend_irecv``), and only the head entry of
  a FIFO runs.  Inside a running entry its operations progress in any order;
  the entry leaves the head once all of them completed.
* A send or receive completes only when its partner is in the head entry of
  the peer's FIFO of the same communicator (a large send cannot finish until
  the receive runs).  NCCL ignores tags: on each communicator, the k-th send
  from ``a`` to ``b`` is received by the k-th receive on ``b`` from ``a``.
* A collective completes when it is in the head entry on every member.
* ``Wait`` blocks its rank until the operation completed.  (On a GPU it
  blocks the compute stream, and later communication is ordered after that
  stream, which comes to the same thing.)

Which FIFO an operation joins (``mode``):

* ``"pair"`` -- PyTorch's default lazy initialisation: an unbatched send or
  receive runs on a communicator of its two ranks, created at their first
  operation together (that first call blocks both hosts until both made it);
  batched sends/receives and collectives run on the process group's own
  communicator.
* ``"group"`` -- eager initialisation (``init_process_group(device_id=...)``):
  one FIFO per rank for all operations of a process group, whatever the peer.

* ``"device"`` -- the strictest reading of NCCL's rule for several
  communicators: every operation of a rank, whatever its communicator, joins
  one FIFO (kernels of different communicators never run side by side).
  Pairing stays per communicator (``"group"``'s).  Reported by the sweep, not
  required: the runtime relies on the communicators of a rank progressing
  side by side (docs/nccl.md says what that needs).

*Lazy connection* (``lazy=True``): NCCL connects a communicator's channels
inside the first call that needs them, and that call blocks its host until the
peers involved make theirs.  The first send from ``a`` to ``b`` on a
communicator waits for ``b``'s first receive from ``a`` there (and the other
way round); the first collective of each kind and size on a communicator waits
for every member (which covers the ring's neighbours, the tree's, and NVLS's
all-members rule).  The executor connects everything a plan uses before its
first iteration (:func:`plan.connect.connection_warmup`); the validator proves
that warm-up followed by the plan runs under this rule.

The process groups are the executor's (:class:`runtime.executor.Communicators`):
one for all point-to-point traffic of each channel (weights, gradients, ...),
one per (members, channel) of broadcasts/reductions (the holders' all-reduce of
a replicated first shard among them), and the default group for the replicated
all-reduce.  The executor creates every process group's
communicator before the first iteration, collectively and in one order, so a
group communicator's first use inside a plan never blocks; the pair
communicators of ``"pair"`` mode are created by the plan's traffic.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, Optional, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.nccl_terms import (P2P_TYPES, batch_entries, communicator_of,  # noqa: F401 (re-exported)
                                              describe_elements, describe_fifo, describe_size, entries_of, nth,
                                              DIRECTIONS, is_pair_communicator, process_group,
                                              transfer_elements)
from megatron_tawpipe.plan.plan import Plan

MODES = ("pair", "group")          # the arrangements the validator requires
ALL_MODES = MODES + ("device",)     # "device": one FIFO per rank (reported, not required)


# ------------------------------------------------------------------- model
class _Entry:
    __slots__ = ("rank", "key", "comm", "ops", "left")

    def __init__(self, rank: int, key: tuple, comm: tuple, ops: List[Tuple[int, object]]):
        self.rank, self.key, self.comm, self.ops = rank, key, comm, ops
        self.left = len(ops)


class NcclModel:
    """Issue-order execution of a plan's communication under NCCL's rules."""

    def __init__(self, plan: Plan, mode: str, lazy: bool = False, prologue: Optional[List[list]] = None):
        """``lazy``: NCCL's lazy connection rule; ``prologue``: per-rank actions run before the
        plan (the executor's connection warm-up)."""
        if mode not in ALL_MODES:
            raise ValueError(f"unknown NCCL model mode {mode!r}; known: {', '.join(ALL_MODES)}")
        self.plan, self.mode, self.lazy = plan, mode, lazy
        P = plan.num_ranks
        self.prologue = [len(p) for p in prologue] if prologue else [0] * P
        self.actions = [list(prologue[r]) + list(plan.actions[r]) for r in range(P)] if prologue else plan.actions
        self.entries: List[List[_Entry]] = []
        self.entry_of: Dict[Tuple[int, int], _Entry] = {}       # (rank, tag) -> entry
        self.first_of_step: List[Dict[int, _Entry]] = []        # rank -> {step: entry posted there}
        for r in range(P):
            entries, first = [], {}
            for key, ops in entries_of(self.actions[r], r, mode):
                e = _Entry(r, key, communicator_of(r, ops[0][1], mode), ops)
                entries.append(e)
                first[ops[0][0]] = e
                for _, a in ops:
                    self.entry_of[(r, a.tag)] = e
            self.entries.append(entries)
            self.first_of_step.append(first)
        self.partners = self._match()
        self.fifo: Dict[Tuple[int, tuple], deque] = defaultdict(deque)
        self.done = set()
        self.pc = [0] * P
        self.arrived: Dict[tuple, set] = defaultdict(set)        # pair communicator -> ranks
        self.connected = set()                                   # lazy rule: connections made
        self.parties: Dict[tuple, frozenset] = {}                # connection -> ranks it needs

    # ------------------------------------------------------------ matching
    def _match(self) -> Dict[Tuple[int, int], List[Tuple[int, int]]]:
        """Partners of every operation, as NCCL pairs them: {(rank, tag): [(rank, tag)]}."""
        sends, recvs = defaultdict(list), defaultdict(list)
        members: Dict[int, List[int]] = defaultdict(list)
        sizes: Dict[int, set] = defaultdict(set)
        for r, entries in enumerate(self.entries):
            for e in entries:
                comm = e.comm     # each communicator (pair or group) pairs its own traffic
                for step, a in e.ops:
                    t = type(a)
                    if t is A.SendStart:
                        sends[(comm, r, a.peer)].append((step, a))
                    elif t is A.RecvStart:
                        recvs[(comm, a.peer, r)].append((step, a))
                    else:
                        members[a.tag].append(r)
                        sizes[a.tag].add((type(a), transfer_elements(self.plan, a)))
                        if len(sizes[a.tag]) > 1:
                            raise PlanError(f"NCCL ({self.mode} mode): the members of collective tag {a.tag} "
                                            f"name different sizes ({A.describe(a)}: "
                                            f"{describe_elements(self.plan, a)})", r, step, a)
        partners: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
        for (comm, src, dst) in sorted(set(sends) | set(recvs), key=repr):   # one order: the same message every run
            s_list, r_list = sends.get((comm, src, dst), []), recvs.get((comm, src, dst), [])
            for k, ((ss, sa), (rs, ra)) in enumerate(zip(s_list, r_list)):
                if sa.tag != ra.tag:
                    raise PlanError(
                        f"NCCL ({self.mode} mode) pairs the send at rank {src} step {ss} "
                        f"({A.describe(sa)}) with the receive at rank {dst} step {rs} "
                        f"({A.describe(ra)}): they are the {nth(k)} send and receive between "
                        f"these ranks on the {describe_fifo(comm)}, and NCCL ignores tags",
                        dst, rs, ra)
                if transfer_elements(self.plan, sa) != transfer_elements(self.plan, ra):
                    raise PlanError(
                        f"NCCL ({self.mode} mode): the send at rank {src} step {ss} ({A.describe(sa)}) carries "
                        f"{describe_elements(self.plan, sa)} and its receive {describe_elements(self.plan, ra)}: "
                        "both sides of a transfer must have the same size", dst, rs, ra)
                partners[(src, sa.tag)] = [(dst, ra.tag)]
                partners[(dst, ra.tag)] = [(src, sa.tag)]
            if len(s_list) != len(r_list):
                longer, side, rank = (s_list, "send", src) if len(s_list) > len(r_list) else \
                    (r_list, "receive", dst)
                step, a = longer[min(len(s_list), len(r_list))]
                raise PlanError(f"NCCL ({self.mode} mode): this {side} has no partner on the "
                                f"{describe_fifo(comm)} (its partner is issued on another "
                                "communicator, batched differently)", rank, step, a)
        for tag, ranks in members.items():
            for r in ranks:
                partners[(r, tag)] = [(x, tag) for x in ranks if x != r]
        return partners

    # ------------------------------------------------------------- running
    def run(self) -> None:
        P = self.plan.num_ranks
        ready = deque(range(P))
        waiting: Dict[object, List[int]] = defaultdict(list)     # tag or pair key -> ranks
        queued = set(ready)
        while ready:
            r = ready.popleft()
            queued.discard(r)
            blocker, woken = self._advance(r)
            if blocker is not None:
                waiting[blocker].append(r)
            for x in woken:
                for rr in waiting.pop(x, ()):
                    if rr not in queued:
                        queued.add(rr)
                        ready.append(rr)
        stuck = [r for r in range(P) if self.pc[r] < len(self.actions[r])]
        if stuck:
            self._deadlock(stuck)

    def _advance(self, r: int):
        """Run rank ``r`` until it blocks; returns (what it blocks on, things that happened)."""
        acts = self.actions[r]
        first = self.first_of_step[r]
        woken: List[object] = []
        pc = self.pc[r]
        while pc < len(acts):
            a = acts[pc]
            t = type(a)
            if t is A.Wait:
                if a.tag not in self.done:
                    self.pc[r] = pc
                    return a.tag, woken
                pc += 1
                continue
            e = first.get(pc)
            if e is not None:
                if self.mode == "pair" and is_pair_communicator(e.key):
                    pair = e.key
                    arrived = self.arrived[pair]
                    if r not in arrived:
                        arrived.add(r)
                        woken.append(pair)
                    if len(arrived) < 2:
                        # Lazy creation of a pair communicator: both hosts block until both call.
                        self.pc[r] = pc
                        return pair, woken
                if self.lazy:
                    missing = self._connect(r, e, woken)
                    if missing:
                        # Lazy connection: the host blocks in this call until the peers make theirs.
                        self.pc[r] = pc
                        return missing[0], woken
                fifo = self.fifo[(r, e.key)]
                fifo.append(e)
                if len(fifo) == 1:
                    woken += self._run_head(r, e.key)
            pc += 1
        self.pc[r] = pc
        return None, woken

    def connections(self, r: int, e: _Entry) -> List[tuple]:
        """The connections ``e``'s operations need, each with the ranks that make it."""
        out = []
        for _, a in e.ops:
            if type(a) in P2P_TYPES:
                src, dst = (r, a.peer) if type(a) is A.SendStart else (a.peer, r)
                key = ("connect", e.comm, src, dst)
                self.parties.setdefault(key, frozenset((src, dst)))
            else:
                key = ("connect", e.comm, type(a).__name__, transfer_elements(self.plan, a))
                self.parties.setdefault(key, frozenset(a.ranks))
            out.append(key)
        return out

    def _connect(self, r: int, e: _Entry, woken: List[object]) -> List[tuple]:
        """Register ``r`` at the connections ``e`` needs; return those still waiting for peers."""
        missing = []
        for key in self.connections(r, e):
            if key in self.connected:
                continue
            arrived = self.arrived[key]
            if r not in arrived:
                arrived.add(r)
                if arrived >= self.parties[key]:
                    self.connected.add(key)
                    woken.append(key)
                    continue
            missing.append(key)
        return missing

    def _run_head(self, r: int, key: tuple) -> List[object]:
        """Complete what can complete now that an entry reached the head of a FIFO."""
        woken: List[object] = []
        todo = [(r, key)]
        while todo:
            rank, k = todo.pop()
            fifo = self.fifo.get((rank, k))
            if not fifo:
                continue
            head = fifo[0]
            for _, a in list(head.ops):
                if a.tag in self.done or not self._partners_at_head(rank, a.tag):
                    continue
                self.done.add(a.tag)
                woken.append(a.tag)
                for x, tag in [(rank, a.tag)] + self.partners.get((rank, a.tag), []):
                    e = self.entry_of[(x, tag)]
                    e.left -= 1
                    if e.left == 0:
                        q = self.fifo[(x, e.key)]
                        q.popleft()
                        if q:
                            todo.append((x, e.key))
        return woken

    def _partners_at_head(self, r: int, tag: int) -> bool:
        for x, t in self.partners.get((r, tag), ()):
            e = self.entry_of[(x, t)]
            q = self.fifo.get((x, e.key))
            if not q or q[0] is not e:
                return False
        return True

    # --------------------------------------------------------- diagnosis
    def _deadlock(self, stuck: List[int]) -> None:
        """Explain the hang: follow who waits for whom from the first stuck rank."""
        lines, seen = [], set()
        r = stuck[0]
        blame = None
        while r is not None and r not in seen and len(lines) < 8:
            seen.add(r)
            line, nxt, where = self._why(r)
            if blame is None:
                blame = where
            lines.append(line)
            r = nxt
        others = [x for x in stuck if x not in seen]
        rule = ", lazy connection" if self.lazy else ""
        warm = f", after a {max(self.prologue)}-action connection warm-up" if any(self.prologue) else ""
        msg = f"NCCL ordering ({self.mode} mode{rule}{warm}): deadlock. " + "; ".join(lines)
        if others:
            msg += f". Also stuck: rank(s) {others}"
        rank, step, action = blame
        raise PlanError(msg, rank, step, action)

    def _why(self, r: int):
        """One link of the wait chain: (text, next rank to look at, (rank, step, action))."""
        step = self.pc[r]
        a = self.actions[r][step]
        where = (r, step - self.prologue[r], a)
        if type(a) is not A.Wait:
            e = self.first_of_step[r][step]
            if self.lazy and not (self.mode == "pair" and is_pair_communicator(e.key) and len(self.arrived[e.key]) < 2):
                key = self._connect(r, e, [])[0]
                absent = sorted(self.parties[key] - self.arrived[key])
                what = (f"the {key[2]} -> {key[3]} connection" if isinstance(key[2], int) else
                        f"its first {key[2][:-5]} of {describe_size(key[3])}")
                return (f"rank {r} step {step} ({A.describe(a)}) makes {what} on the "
                        f"{describe_fifo(e.comm)} lazily and waits for rank(s) {absent} to reach theirs (rank "
                        f"{absent[0]} is stopped at step {self.pc[absent[0]]})"), absent[0], where
            other = e.key[-2] if e.key[-2] != r else e.key[-1]
            return (f"rank {r} step {step} ({A.describe(a)}) is creating the "
                    f"{describe_fifo(e.key)} and waits for rank {other} to call it"), other, where
        e = self.entry_of[(r, a.tag)]
        q = self.fifo[(r, e.key)]
        head = q[0]
        text = f"rank {r} step {step} waits for tag {a.tag}"
        if head is not e:
            hs, ha = head.ops[0]
            text += (f", queued on the {describe_fifo(e.key)} behind the head "
                     f"{A.short(ha)} (step {hs}, {A.describe(ha)})")
        pending = [(s, x) for s, x in head.ops if x.tag not in self.done]
        for s, x in pending:
            for peer, tag in self.partners.get((r, x.tag), ()):
                pe = self.entry_of[(peer, tag)]
                pq = self.fifo.get((peer, pe.key))
                if pq and pq[0] is pe:
                    continue
                pstep = next(st for st, y in pe.ops if y.tag == tag)
                if pq and pe in pq:
                    phs, pha = pq[0].ops[0]
                    return (text + f"; its partner on rank {peer} (step {pstep}) is queued behind "
                            f"rank {peer}'s head {A.short(pha)} (step {phs}, {A.describe(pha)}) on "
                            f"the {describe_fifo(pe.key)}"), peer, where
                return (text + f"; rank {peer} has not issued its partner (step {pstep}) yet: it "
                        f"is stopped at step {self.pc[peer]}"), peer, where
        return text, None, where


