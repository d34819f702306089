"""Symbolic execution of a plan (the dynamic half of the validator).

All ranks run together under conservative blocking semantics: starts never
block; a wait completes only when every participant of the operation has
posted its start (a send needs its receive posted, a collective all members).
If no rank can move while some are unfinished, the plan deadlocks.  Along the
way the executor tracks which shard each weight buffer holds, which (stream,
micro-batch) contributions each gradient buffer holds (a bit set, followed
through sends, reductions and accumulation), the forward/backward progress of
every micro-batch, and buffer hazards.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.symbolic_end import EndChecks
from megatron_tawpipe.plan.symbolic_replicated import ReplicatedRules
from megatron_tawpipe.plan.symbolic_slices import SliceRules


class _RankState:
    __slots__ = ("w", "g", "moved", "locks", "pending", "main", "act", "agrad", "pc",
                 "replicated_done", "compute_closed", "last_input", "scattered", "gathered")

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
        self.replicated_done = set()                # parts all-reduced
        self.compute_closed = set()                 # parts whose all-reduce started
        self.last_input = -1                        # last micro-batch started at shard 0
        self.scattered = set()                      # grad buffers holding only this rank's slice
        self.gathered = set()                       # replicated parts whose weights' all-gather was waited


class SymbolicExecutor(SliceRules, EndChecks, ReplicatedRules):
    def __init__(self, plan: Plan, starts):
        self.plan = plan
        self.starts = starts
        self.S = plan.num_shards
        self.N = plan.num_microbatches
        stream_ids = sorted(set(plan.streams))
        self.stream_index = {s: i for i, s in enumerate(stream_ids)}
        self.full = (1 << (len(stream_ids) * self.N)) - 1
        self.state = [_RankState() for _ in range(plan.num_ranks)]
        # the replicated parts' optimizer sharded: their gradients reduce-scattered, their weights all-gathered
        self.sharded_replicated = any(type(a) is A.ReplicatedAllReduceStart and a.mode != "sum"
                                      for actions in plan.actions for a in actions)
        for s in range(self.S):
            for holder in plan.holders(s):
                self.state[holder].main[s] = 0
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
            self._err(f"buffer {buf!r} has a transfer in flight (tag {tag}, not yet waited)",
                      r, i, a)

    def _lock(self, st, buf, tag, mode):
        st.locks.setdefault(buf, {})[tag] = mode

    def _weight(self, st, buf, shard, r, i, a):
        self._unlocked(st, buf, r, i, a, allow_read=True)
        held = st.w.get(buf)
        if held != shard:
            what = "nothing" if held is None else f"shard {held}"
            self._err(f"weight buffer {buf!r} holds {what}, not shard {shard}", r, i, a)

    def _grad_target(self, st, buf, shard, r, i, a, slice_ok=False) -> list:
        self._unlocked(st, buf, r, i, a)
        if not slice_ok:
            self._whole(st, buf, r, i, a)
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
        self._check_gathered(r, i, a)
        closed = self.state[r].compute_closed
        if closed:
            if "all" in closed:
                self._err("compute after the replicated all-reduce started", r, i, a)
            backward = type(a) is not A.Forward
            if backward and a.shard == self.S - 1 and "head" in closed:
                self._err("backward of the last shard after the head's replicated all-reduce "
                          "started (its gradients were not final)", r, i, a)
            if backward and a.shard == 0 and "embedding" in closed:
                self._err("backward of shard 0 after the embedding's replicated all-reduce "
                          "started (its gradients were not final)", r, i, a)
        return (self.plan.streams[r], a.mb)

    # ------------------------------------------------------------- compute
    def _forward(self, r, st, i, a):
        key = self._mb_key(r, i, a)
        self._weight(st, a.wbuf, a.shard, r, i, a)
        nxt = self.fwd_next.get(key, 0)
        if nxt != a.shard:
            self._err(f"forward of micro-batch {a.mb} reaches shard {a.shard} but its next "
                      f"forward shard is {nxt}", r, i, a)
        if a.shard == 0:
            # Executors read micro-batches from a data iterator: a rank starts
            # its micro-batches in increasing order.
            if a.mb < st.last_input:
                self._err(f"micro-batch {a.mb} starts after micro-batch {st.last_input}; "
                          "micro-batches must start in increasing order", r, i, a)
            st.last_input = a.mb
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
                      f"{self.fwd_rank.get(key + (a.shard,))}, its saved input is not here",
                      r, i, a)
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
            if self._sliced(a.shard):
                self._err(f"writes 'main', which holds one slice of shard {a.shard} (spread ownership): a "
                          "backward needs a whole gradient buffer", r, i, a)
            self._add(st.main, a.shard, bit, "this backward", r, i, a)
        else:
            self._grad_target(st, a.gbuf, a.shard, r, i, a)
            self._add(st.g, a.gbuf, bit, "this backward", r, i, a)

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
        if not 0 <= a.shard < self.S or r not in self.plan.holders(a.shard):
            self._err(f"only the owner of shard {a.shard} (or a replica) can load it", r, i, a)
        if self._sliced(a.shard):
            self._err(f"this rank keeps one slice of shard {a.shard} (spread ownership): gather the shard "
                      "from its holders (AllGatherStart)", r, i, a)
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
        st.scattered.discard(a.buf)

    def _accumulate(self, r, st, i, a):
        if a.shard not in st.main:
            self._err(f"this rank does not own shard {a.shard}", r, i, a)
        entry = self._grad_target(st, a.buf, a.shard, r, i, a, slice_ok=True)
        if self._sliced(a.shard) != (a.buf in st.scattered):
            self._err(f"this rank keeps one slice of shard {a.shard}: only the result of its reduce-scatter "
                      "can be accumulated" if self._sliced(a.shard) else
                      f"{a.buf!r} holds one slice of a reduce-scatter, shard {a.shard} is not kept in slices",
                      r, i, a)
        self._add(st.main, a.shard, entry[1], "accumulating", r, i, a)
        st.scattered.discard(a.buf)
        del st.g[a.buf]
        st.moved[a.buf] = i

    def _optimizer(self, r, st, i, a):
        if st.pending:
            tag = next(iter(st.pending))
            self._err(f"operation tag {tag} still in flight", r, i, a)
        if i != len(self.plan.actions[r]) - 1:
            self._err("the optimizer step must be the last action", r, i, a)
        done = st.replicated_done
        if self.plan.family == "weight" and "all" not in done and not {"head", "embedding"} <= done:
            self._err("replicated gradients were not all-reduced before the step", r, i, a)
        if self.sharded_replicated and "all" not in st.gathered and not {"head", "embedding"} <= st.gathered:
            self._err("replicated weights were not all-gathered in this iteration", r, i, a)
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
        self._whole(st, buf, r, i, a)
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
                st.scattered.discard(a.buf)
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

    def _all_reduce(self, r, st, i, a):
        if a.kind != "grad":
            self._err("only gradients can be all-reduced", r, i, a)
        if tuple(sorted(self.plan.holders(a.shard))) != a.ranks:
            self._err(f"all-reduces shard {a.shard} over ranks {list(a.ranks)}, not over its holders "
                      f"{sorted(self.plan.holders(a.shard))}", r, i, a)
        if self._sliced(a.shard):
            self._err(f"shard {a.shard} is kept in slices (spread ownership): its gradient is reduce-scattered "
                      "to the holders (ReduceScatterStart), not all-reduced", r, i, a)
        entry = self._grad_target(st, a.buf, a.shard, r, i, a)
        self._lock(st, a.buf, a.tag, "w")
        st.pending[a.tag] = (i, a, entry[1])
        self._post(r, a.tag, entry[1])

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
        elif t is A.AllGatherStart:
            st.w[a.buf] = a.shard
        elif (t is A.ReduceStart and r == a.root) or t is A.AllReduceStart or t is A.ReduceScatterStart:
            what = "reduction" if t is A.ReduceStart else "all-reduce" if t is A.AllReduceStart else "reduce-scatter"
            total = 0
            for member, snap in self.posted[w.tag].items():
                if total & snap:
                    self._err(f"{what} counts contributions {self._describe_mask(total & snap)}"
                              f" twice (member {member})", r, i, w)
                total |= snap
            st.g[a.buf] = [a.shard, total]
            if t is A.ReduceScatterStart:
                st.scattered.add(a.buf)
        elif t is A.ReplicatedAllReduceStart:
            (st.gathered if a.mode == "gather" else st.replicated_done).add(a.part)

    _handlers = {
        A.Forward: _forward, A.Backward: _backward, A.BackwardInput: _bi, A.BackwardWeight: _bw,
        A.LoadWeights: _load, A.ZeroGrad: _zero, A.AccumulateToOwner: _accumulate,
        A.OptimizerStep: _optimizer, A.SendStart: _send, A.RecvStart: _recv,
        A.BroadcastStart: _broadcast, A.ReduceStart: _reduce, A.AllReduceStart: _all_reduce,
        A.AllGatherStart: SliceRules._all_gather, A.ReduceScatterStart: SliceRules._reduce_scatter,
        A.ReplicatedAllReduceStart: ReplicatedRules._replicated,
    }
