"""Helpers shared by the planners.

Planners describe *when* (in a nominal slot order) each rank does something
by attaching a sort key to every action; the builder sorts each rank's actions
by key (ties keep emission order) and so produces the per-rank lists.  Both
sides of a transfer, and all members of a collective, get the same key, which
keeps matched operations in the same relative order on every rank.  As long
as every wait has a larger key than the starts it depends on (on all ranks),
executing the lists in key order cannot deadlock.

Planners name buffers virtually (``~w...`` for weights, ``~g...`` for
gradients), one name per use.  ``build`` maps them onto the fewest physical
slots (``w0, w1, ...``/``g0, ...``) by interval colouring over each rank's
list: a slot is reused once the last action touching the previous buffer,
including the wait of any transfer on it, is done.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Dict, Iterable, List, Sequence, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan

_BUF_FIELDS = ("wbuf", "gbuf", "buf")


class PlanBuilder:
    def __init__(self, num_ranks: int, num_groups: int):
        if num_groups < 1 or num_ranks % num_groups:
            raise ValueError(f"groups ({num_groups}) must divide ranks ({num_ranks})")
        self.num_ranks = num_ranks
        self.num_groups = num_groups
        self.ranks_per_group = num_ranks // num_groups
        self._items: List[List[Tuple[tuple, int, object]]] = [[] for _ in range(num_ranks)]
        self._seq = itertools.count()
        self._tag = 0

    # ------------------------------------------------------------ primitives
    def group_of(self, rank: int) -> int:
        return rank // self.ranks_per_group

    def link(self, ranks: Iterable[int]) -> str:
        return "intra" if len({self.group_of(r) for r in ranks}) == 1 else "inter"

    def new_tag(self) -> int:
        self._tag += 1
        return self._tag

    def emit(self, rank: int, key: tuple, cls, *args) -> None:
        """Append action ``cls(*args)`` (positional fields) to ``rank`` at ``key``."""
        self._items[rank].append((key, next(self._seq), cls, args))

    # ------------------------------------------------------- comm patterns
    def p2p(self, src: int, dst: int, kind: str, shard: int, src_buf: str, dst_buf: str,
            start_key: tuple, src_wait_key: tuple, dst_wait_key: tuple,
            size: float = 1.0, mb: int = -1) -> int:
        """A matched send/receive pair, both posted at ``start_key`` (the same
        key on both sides is what keeps them in step on NCCL: see ``build``)."""
        tag = self.new_tag()
        G = self.ranks_per_group
        link = "intra" if src // G == dst // G else "inter"
        self.emit(src, start_key, A.SendStart, tag, dst, src_buf, kind, shard, link, size, mb)
        self.emit(dst, start_key, A.RecvStart, tag, src, dst_buf, kind, shard, link, size, mb)
        self.emit(src, src_wait_key, A.Wait, tag)
        self.emit(dst, dst_wait_key, A.Wait, tag)
        return tag

    def collective(self, cls, root: int, members: Sequence[int], bufs: Dict[int, str],
                   kind: str, shard: int, start_key: tuple, wait_key: tuple,
                   size: float = 1.0) -> int:
        """A Broadcast/Reduce over ``members`` started and waited at the same
        keys on every member."""
        tag = self.new_tag()
        ranks = tuple(sorted(members))
        link = self.link(ranks)
        for r in ranks:
            self.emit(r, start_key, cls, tag, root, ranks, bufs[r], kind, shard, link, size)
        for r in ranks:
            self.emit(r, wait_key, A.Wait, tag)
        return tag

    def all_reduce(self, members: Sequence[int], bufs: Dict[int, str], kind: str, shard: int,
                   start_key: tuple, wait_key: tuple, size: float = 1.0, cls=A.AllReduceStart) -> int:
        """An all-reduce of ``bufs`` over ``members`` (``cls``: or another collective without a root, an
        all-gather or a reduce-scatter), started and waited at the same keys on every member."""
        tag = self.new_tag()
        ranks = tuple(sorted(members))
        link = self.link(ranks)
        for r in ranks:
            self.emit(r, start_key, cls, tag, ranks, bufs[r], kind, shard, link, size)
            self.emit(r, wait_key, A.Wait, tag)
        return tag

    def replicated_allreduce(self, start_keys: Dict[int, tuple], wait_key, part: str = "all",
                             hierarchical: bool = False, mode: str = "sum") -> int:
        """The replicated gradients' all-reduce over every rank (``mode``: or one half of it, see
        ``ReplicatedAllReduceStart``); ``hierarchical``: through the groups (nodes) when there are several of more
        than one rank (``ReplicatedAllReduceStart.node_size``). ``wait_key``: one key for every rank, or a key
        per rank."""
        tag = self.new_tag()
        ranks = tuple(range(self.num_ranks))
        G = self.ranks_per_group
        node_size = G if hierarchical and self.num_groups > 1 and G > 1 else 0
        for r in ranks:
            self.emit(r, start_keys[r], A.ReplicatedAllReduceStart, tag, ranks, part, node_size, mode)
            self.emit(r, wait_key[r] if isinstance(wait_key, dict) else wait_key, A.Wait, tag)
        return tag

    def replicated_allreduce_parts(self, head_keys: Dict[int, tuple], embedding_keys: Dict[int, tuple],
                                   wait_key: tuple, hierarchical: bool = False, mode: str = "sum") -> None:
        """The head's replicated gradients all-reduced (``mode`` "scatter": reduce-scattered) once the last
        shard's last backward ran, the embedding's after shard 0's: the first overlaps the remaining backward
        work instead of waiting for the end."""
        self.replicated_allreduce(head_keys, wait_key, "head", hierarchical, mode)
        self.replicated_allreduce(embedding_keys, wait_key, "embedding", hierarchical, mode)

    # ------------------------------------------------------------- finalise
    def build(self, *, schedule: str, family: str, num_layers: int, num_microbatches: int,
              owners: Sequence[int], streams: Sequence[int], options: dict,
              replicas: Dict[int, Sequence[int]] = None, shard_layers: Sequence[int] = (),
              ownership: str = "owner") -> Plan:
        lists = []
        weight_slots = grad_slots = 0
        batches = itertools.count()
        for rank, items in enumerate(self._items):
            items.sort()      # by key, then emission order (seq is unique)
            specs = _batch_p2p(rank, items, batches)
            acts, nw, ng = _assign_buffers(specs)
            weight_slots, grad_slots = max(weight_slots, nw), max(grad_slots, ng)
            lists.append(acts)
        return Plan(schedule=schedule, family=family, num_ranks=self.num_ranks,
                    num_groups=self.num_groups, num_layers=num_layers,
                    num_microbatches=num_microbatches, owners=tuple(owners),
                    streams=tuple(streams), max_weight_buffers=weight_slots,
                    max_grad_buffers=grad_slots, actions=lists, options=dict(options),
                    replicas={s: tuple(r) for s, r in (replicas or {}).items()},
                    shard_layers=tuple(shard_layers or ()), ownership=ownership)


def _batch_p2p(rank: int, items: list, counter) -> list:
    """Lower sorted ``(key, emission order, class, args)`` items of ``rank`` to ``(class, args)``
    specs in which the sends and receives of one key, one channel and, on the
    weight-passing channels, one direction (toward higher or lower ranks: each
    its own process group, ``nccl_terms.process_group``) form one NCCL group
    (``batch``).

    Why this makes a plan safe under NCCL's ordering rules (plan/nccl.py), by
    induction over keys: both sides of every transfer and all members of a
    collective are posted at the same key, and every wait has a larger key
    than what it waits for.  Once everything below key K has completed, every
    rank reaches its key-K starts; each FIFO then holds at its head exactly one
    key-K entry per channel, whose partners are the peers' key-K entries, so
    all of them run (a batch's partners are in the same direction's
    communicator: what ``rank`` sends up, its higher peer receives from below).
    Starts of one key are moved to the last of them, never
    earlier, so nothing they read is written after them.  Every send and
    receive is batched (a batch of one included): ProcessGroupNCCL runs
    batches on the process group's own communicator, which the executor creates
    up front, so no pair communicator is created in the middle of a plan."""
    out = []
    append = out.append
    send_start, recv_start = A.SendStart, A.RecvStart
    i = 0
    n = len(items)
    while i < n:
        j = i + 1
        key = items[i][0]
        while j < n and items[j][0] == key:
            j += 1
        if j == i + 1:    # alone at its key: a transfer is a batch of one
            cls, args = items[i][2], items[i][3]
            append((cls, tuple(args) + (next(counter),)) if cls is send_start or cls is recv_start else (cls, args))
            i = j
            continue
        run = items[i:j]
        groups: Dict[str, list] = {}
        for _, _, cls, args in run:
            if cls is send_start or cls is recv_start:
                channel = A.CHANNEL[args[3]]
                sender, receiver = (rank, args[1]) if cls is send_start else (args[1], rank)
                way = sender < receiver if channel in A.DIRECTED_CHANNELS else None
                groups.setdefault((channel, way), []).append((cls, args))
        last = {id(members[-1][1]): channel for channel, members in groups.items()}
        for _, _, cls, args in run:
            if cls is send_start or cls is recv_start:
                channel = last.get(id(args))
                if channel is None:
                    continue
                batch = next(counter)
                for c, a in groups[channel]:
                    append((c, tuple(a) + (batch,)))
            else:
                append((cls, args))
        i = j
    return out


_BUF_INDEX = {cls: tuple(j for j, f in enumerate(A.FIELD_NAMES[cls]) if f in _BUF_FIELDS)
              for cls in A.ACTION_TYPES}
_START_TYPES = frozenset(A.STARTS)


def _assign_buffers(specs: list):
    """Interval-colour the virtual buffers of one rank's (class, args) list;
    returns the actions and the number of weight and gradient slots used."""
    first: Dict[str, int] = {}
    last: Dict[str, int] = {}
    tag_buf: Dict[int, str] = {}
    refs = []                                   # (index, [field index])
    Wait, buf_index, start_types = A.Wait, _BUF_INDEX, _START_TYPES
    for i, (cls, args) in enumerate(specs):
        if cls is Wait:
            b = tag_buf.get(args[0])
            if b is not None:
                last[b] = i
            continue
        found = None
        for j in buf_index[cls]:
            b = args[j]
            if b and b[0] == "~":
                if b not in first:
                    first[b] = i
                last[b] = i
                if found is None:
                    found = []
                    if cls in start_types:
                        tag_buf[args[0]] = b
                found.append(j)
        if found:
            refs.append((i, found))
    names: Dict[str, str] = {}
    counts = {}
    for pool, prefix in (("~w", "w"), ("~g", "g")):
        bufs = sorted((b for b in first if b.startswith(pool)), key=first.__getitem__)
        free: List[int] = []          # heap of free slot numbers
        busy: List[Tuple[int, int]] = []  # heap of (last index, slot)
        used = 0
        for b in bufs:
            start = first[b]
            while busy and busy[0][0] < start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            slot = heapq.heappop(free) if free else used
            used = max(used, slot + 1)
            names[b] = f"{prefix}{slot}"
            heapq.heappush(busy, (last[b], slot))
        counts[pool] = used
    for i, found in refs:
        cls, args = specs[i]
        args = list(args)
        for j in found:
            args[j] = names[args[j]]
        specs[i] = (cls, args)
    return [cls(*args) for cls, args in specs], counts["~w"], counts["~g"]
