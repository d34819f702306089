"""Bytes every collective and point-to-point call of a run sends, per link class (inside a node / between nodes).

:class:`CollectiveCounter` wraps the ``torch.distributed`` functions (the module's attributes and
``distributed_c10d``'s, so that calls from inside torch count too; a call made from inside another
counted call counts once) and adds what each call makes *this* rank send, by the algorithm gloo runs:

* ``all_reduce`` of B bytes over n members: a ring, each member sends ``2(n-1)/n * B`` to its
  successor in the group's rank order;
* ``reduce_scatter`` of an input of B bytes: gloo runs an all-reduce of the input, ``2(n-1)/n * B``
  to the successor (a ring reduce-scatter, NCCL's, sends ``(n-1)/n * B``);
* ``all_gather`` of an output of B bytes: a ring, ``(n-1)/n * B`` to the successor;
* ``broadcast`` of B bytes: a binomial tree from the root (in round k each member below 2^k, counted
  from the root in group order, sends B to the member 2^k after it);
* ``reduce`` of B bytes to the root: gloo's ring reduce-scatter (``(n-1)/n * B`` to the successor), then
  each member's reduced ``B/n`` to the root;
* ``scatter`` from the root: each member's part from the root; ``gather``: B from every other member
  to the root;
* ``all_to_all_single``: each member's part to every other member;
* ``send`` / ``isend``: B to the peer (``batch_isend_irecv`` counts through them); receiving sends nothing.

A member's bytes are between nodes when the member it sends to sits on another node; a node is
``LOCAL_WORLD_SIZE`` consecutive global ranks (torchrun's layout). Payload only: the interfaces
also carry TCP/IP headers, the rendezvous store and connection set-up
(:data:`INTERFACE_TOLERANCE`).

Every call is also tallied by its formula (:meth:`CollectiveCounter.formulas`: operation, members, which
of them sit on other nodes, payload, bytes sent per link class), and the totals are snapshotted at each
training iteration's end (:func:`install_in_training`), so a run's bytes per iteration leave out its
start-up. No torch at import; torch is imported by :meth:`CollectiveCounter.install`.
"""

from __future__ import annotations

import inspect
import json
import sys
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_tawpipe.compat import patches

ENV_OUTPUT = "TAWPIPE_COLLECTIVE_BYTES_DIR"   # where each rank writes rank<r>.json (set by the benchmark)
ENV_RANKS_PER_NODE = "TAWPIPE_COLLECTIVE_RANKS_PER_NODE"   # ranks of a node (default: torchrun's LOCAL_WORLD_SIZE)

# Counted payload against what the node interfaces sent in a run (eth0 tx, whole run): TCP/IP headers are
# ~4.5% of a full frame, ACKs and the rendezvous store a little more; the tests and the docs hold runs to this.
INTERFACE_TOLERANCE = 0.10

_SUMMED = ("calls", "payload", "intra", "inter")

# name -> the kind of collective it is
_WRAPPED = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",   # FSDP2 calls the last
    "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather", "all_gather": "all_gather",
    "all_gather_single": "all_gather", "all_gather_coalesced": "all_gather",
    "broadcast": "broadcast", "scatter": "scatter", "reduce": "reduce", "gather": "gather",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
    "send": "send", "isend": "send",
}


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return int(t.numel()) * int(t.element_size())


def ring_successor(ranks: Sequence[int], rank: int) -> int:
    return ranks[(list(ranks).index(rank) + 1) % len(ranks)]


def binomial_children(relative: int, n: int) -> List[int]:
    """Relative ranks a member at ``relative`` (the root: 0) sends to in a binomial broadcast over ``n``:
    in round k every member below 2^k sends to itself + 2^k."""
    children, step = [], 1
    while step < n:
        if relative < step and relative + step < n:
            children.append(relative + step)
        step *= 2
    return children


def sent_bytes(kind: str, ranks: Sequence[int], rank: int, payload: float,
               root: Optional[int] = None) -> List[Tuple[int, float]]:
    """``[(destination, bytes)]`` that ``rank`` sends for one call of ``kind`` over the global ``ranks``
    (in group order) with ``payload`` bytes (all-reduce, broadcast, reduce: the tensor; reduce-scatter:
    its input; all-gather: its output; all-to-all and scatter: the whole input; send: the tensor)."""
    n = len(ranks)
    if kind == "send":
        return [(root, payload)]
    if n <= 1:
        return []
    ranks = list(ranks)
    root_index = ranks.index(root) if root in ranks else 0
    relative = (ranks.index(rank) - root_index) % n
    if kind in ("all_reduce", "reduce_scatter"):
        return [(ring_successor(ranks, rank), 2 * (n - 1) / n * payload)]
    if kind == "all_gather":
        return [(ring_successor(ranks, rank), (n - 1) / n * payload)]
    if kind == "broadcast":   # gloo: a binomial tree from the root, each member forwarding the whole tensor
        return [(ranks[(i + root_index) % n], payload) for i in binomial_children(relative, n)]
    if kind == "scatter":
        return [(r, payload / n) for r in ranks if r != rank] if rank == root else []
    if kind == "reduce":      # gloo: a ring reduce-scatter, then every member's reduced part to the root
        return [(ring_successor(ranks, rank), (n - 1) / n * payload)] + ([] if rank == root else [(root, payload / n)])
    if kind == "gather":
        return [] if rank == root else [(root, payload)]
    if kind == "all_to_all":
        return [(r, payload / n) for r in ranks if r != rank]
    raise ValueError(f"unknown collective {kind!r}")


class CollectiveCounter:
    """Counts what this rank sends per link class; :meth:`install` wraps torch.distributed."""

    def __init__(self, rank: int, ranks_per_node: int):
        self.rank = int(rank)
        self.ranks_per_node = max(1, int(ranks_per_node))
        self.totals = {"intra": 0.0, "inter": 0.0}
        self.by_formula: Dict[str, dict] = {}
        self.iterations: List[Dict[str, float]] = []   # cumulative totals at each iteration's end
        self.formula_iterations: List[Dict[str, dict]] = []   # cumulative by_formula counts, the same
        self._lock = threading.Lock()
        self._local = threading.local()
        self._applied = None   # the patch in place while installed
        self.uncounted: Dict[str, int] = {}   # calls whose bytes could not be counted, per kind

    def node_of(self, rank: int) -> int:
        return int(rank) // self.ranks_per_node

    def link(self, src: int, dst: int) -> str:
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def add(self, kind: str, ranks: Sequence[int], payload: float, root: Optional[int] = None) -> None:
        """Count one call of ``kind`` (see :func:`sent_bytes`) made by this rank."""
        ranks = [int(r) for r in ranks]
        if self.rank not in ranks and kind != "send":
            return
        sends = sent_bytes(kind, ranks, self.rank, payload, root)
        nodes = sorted({self.node_of(r) for r in ranks})
        hops = sum(self.node_of(r) != self.node_of(ring_successor(ranks, r)) for r in ranks) if len(ranks) > 1 else 0
        key = f"{kind} n={len(ranks)} nodes={len(nodes)}" + (
            f" hops={hops}" if kind in ("all_reduce", "reduce_scatter", "all_gather") else "")
        with self._lock:
            row = self.by_formula.setdefault(key, {"kind": kind, "members": len(ranks), "nodes": len(nodes),
                                                   "crossing_hops": hops, "calls": 0, "payload": 0.0,
                                                   "intra": 0.0, "inter": 0.0})
            row["calls"] += 1
            row["payload"] += payload
            for dst, nbytes in sends:
                where = self.link(self.rank, dst)
                self.totals[where] += nbytes
                row[where] += nbytes

    def snapshot(self) -> None:
        """Record the cumulative totals, and per formula, (at an iteration's end)."""
        with self._lock:
            self.iterations.append(dict(self.totals))
            self.formula_iterations.append({k: {f: v[f] for f in _SUMMED} for k, v in self.by_formula.items()})

    # ------------------------------------------------------------------ wrapping torch.distributed
    def install(self) -> "CollectiveCounter":
        """Wrap torch.distributed's functions (the registered patch ``collective-bytes``,
        :mod:`megatron_tawpipe.compat.patches`) until :meth:`uninstall`."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrappers = {}
        for name, kind in _WRAPPED.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original, kind, inspect.signature(original))
            wrappers[f"{patches.C10D}:{name}"] = wrapper
            if getattr(dist, name, None) is original:
                wrappers[f"torch.distributed:{name}"] = wrapper
        self._applied = patches.apply("collective-bytes", replace=wrappers)
        return self

    def uninstall(self) -> None:
        if self._applied is not None:
            self._applied.undo()
            self._applied = None

    def _wrap(self, original, kind: str, signature):
        counter = self

        def counted(*args, **kwargs):
            if getattr(counter._local, "inside", False):
                return original(*args, **kwargs)
            counter._local.inside = True
            try:
                try:
                    counter._count_call(kind, signature.bind(*args, **kwargs).arguments)
                except Exception as exc:  # noqa: BLE001 - counting never breaks a run; the call reports bad arguments
                    counter._skipped(kind, exc)
                return original(*args, **kwargs)
            finally:
                counter._local.inside = False

        counted.__wrapped__ = original
        counted.__name__ = getattr(original, "__name__", kind)
        return counted

    def _skipped(self, kind: str, exc: BaseException) -> None:
        """A call not counted: tallied per kind (in the rank's file), said once per kind on stderr."""
        with self._lock:
            first = kind not in self.uncounted
            self.uncounted[kind] = self.uncounted.get(kind, 0) + 1
        if first:
            print(f"collective bytes, rank {self.rank}: a {kind} call was not counted ({type(exc).__name__}: "
                  f"{exc}); this run's counts leave such calls out (their number is in the rank's file)",
                  file=sys.stderr, flush=True)

    def _count_call(self, kind: str, a: dict) -> None:
        import torch.distributed as dist

        group = a.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

        def peer(global_key: str, group_key: str) -> Optional[int]:
            if a.get(global_key) is not None:
                return int(a[global_key])
            if a.get(group_key) is not None:
                return ranks[int(a[group_key])]
            return None

        if kind == "send":
            payload, root = _nbytes(a.get("tensor")), peer("dst", "group_dst")
            self.add("send", [self.rank, root], payload, root)
            return
        if kind == "all_reduce":
            payload = _nbytes(a.get("tensor", a.get("tensors")))
        elif kind == "reduce_scatter":
            payload = _nbytes(a.get("input", a.get("input_list", a.get("input_tensor"))))
        elif kind == "all_gather":
            out = a.get("output_tensor", a.get("tensor_list", a.get("output_tensor_lists")))
            payload = _nbytes(out)
        elif kind in ("broadcast", "reduce", "gather"):
            payload = _nbytes(a.get("tensor"))
        elif kind == "scatter":
            payload = _nbytes(a.get("scatter_list")) or _nbytes(a.get("tensor")) * len(ranks)
        else:   # all_to_all
            payload = _nbytes(a.get("input"))
        root = None
        if kind in ("broadcast", "scatter"):
            root = peer("src", "group_src")
        elif kind in ("reduce", "gather"):
            root = peer("dst", "group_dst")
        if root is None and kind in ("broadcast", "scatter", "reduce", "gather"):
            root = ranks[0]
        self.add(kind, ranks, payload, root)

    # ------------------------------------------------------------------ results
    def to_json(self) -> dict:
        with self._lock:
            return {"rank": self.rank, "node": self.node_of(self.rank), "ranks_per_node": self.ranks_per_node,
                    "totals": dict(self.totals), "iterations": [dict(i) for i in self.iterations],
                    "formula_iterations": list(self.formula_iterations),
                    "by_formula": {k: dict(v) for k, v in self.by_formula.items()},
                    "uncounted": dict(self.uncounted)}

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{self.rank}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)
        return path


def install_in_training(counter: CollectiveCounter):
    """Snapshot ``counter`` at the end of every training iteration (every rank records one): the registered
    patch ``collective-bytes-iteration-end``; the result's ``undo()`` ends it."""
    from megatron_tawpipe.monitor.metrics import MetricsWriter

    def counting(record):
        def counted_record(self, *args, **kwargs):
            counter.snapshot()
            return record(self, *args, **kwargs)

        return counted_record

    target = "megatron_tawpipe.monitor.metrics:MetricsWriter.record"
    return patches.apply("collective-bytes-iteration-end", wrap={target: counting}, owners={target: MetricsWriter})


# ---------------------------------------------------------------------- reading a run's files
def read_rank_files(directory: str) -> List[dict]:
    """Every rank's counts a run wrote (rank order); [] if there are none."""
    if not directory or not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: r["rank"])


def summarize_counts(ranks: List[dict], train_iters: int, warmup: int) -> Optional[dict]:
    """All ranks together: bytes per link class per measured iteration (median of the iterations after
    ``warmup``), and the whole run's (start-up included) divided by ``train_iters`` (what the interface
    counters are compared with); the formulas' rows summed over ranks."""
    if not ranks:
        return None
    n_iter = min(len(r["iterations"]) for r in ranks)
    per_iteration: Dict[str, Optional[float]] = {"intra": None, "inter": None}
    if n_iter >= 1:
        import statistics

        for link in ("intra", "inter"):
            steps = []
            for i in range(min(warmup, n_iter - 1), n_iter):
                before = 0.0
                total = 0.0
                for r in ranks:
                    prev = r["iterations"][i - 1][link] if i > 0 else 0.0
                    total += r["iterations"][i][link] - prev
                    before += prev
                steps.append(total)
            per_iteration[link] = statistics.median(steps)
    formulas: Dict[str, dict] = {}       # whole run, summed over ranks
    for r in ranks:
        for key, row in r["by_formula"].items():
            acc = formulas.setdefault(key, {k: (0.0 if k in _SUMMED else v) for k, v in row.items()})
            for k in _SUMMED:
                acc[k] += row[k]
    measured: Dict[str, dict] = {}       # per measured iteration (after the warm-up), summed over ranks
    first = min(warmup, n_iter - 1) if n_iter else 0
    count = n_iter - first
    for r in ranks:
        snaps = r.get("formula_iterations") or []
        if count <= 0 or len(snaps) < n_iter:
            measured = {}
            break
        end, begin = snaps[n_iter - 1], (snaps[first - 1] if first > 0 else {})
        for key, row in end.items():
            acc = measured.setdefault(key, {k: (0.0 if k in _SUMMED else v) for k, v in r["by_formula"][key].items()})
            for k in _SUMMED:
                acc[k] += (row[k] - begin.get(key, {}).get(k, 0.0)) / count
    iters = max(1, int(train_iters))
    return {"ranks": len(ranks),
            "inter_node_bytes_per_iteration": per_iteration["inter"],
            "intra_node_bytes_per_iteration": per_iteration["intra"],
            "inter_node_bytes_whole_run_per_iteration": sum(r["totals"]["inter"] for r in ranks) / iters,
            "intra_node_bytes_whole_run_per_iteration": sum(r["totals"]["intra"] for r in ranks) / iters,
            "formulas": formulas, "formulas_per_iteration": measured,
            "uncounted_calls": {kind: sum(r.get("uncounted", {}).get(kind, 0) for r in ranks)
                                for kind in sorted({k for r in ranks for k in r.get("uncounted", {})})}}


FORMULA_TEXT = {
    "all_reduce": "ring all-reduce (2(n-1)/n x B per member to its successor)",
    "reduce_scatter": "reduce-scatter of input B (gloo: an all-reduce, 2(n-1)/n x B per member)",
    "all_gather": "ring all-gather of output B ((n-1)/n x B per member)",
    "broadcast": "broadcast (binomial tree: n-1 copies of B)",
    "scatter": "scatter (B/n from the root to each other member)",
    "reduce": "reduce (gloo: ring reduce-scatter (n-1)/n x B, then B/n from each other member to the root)",
    "gather": "gather (B from each other member to the root)",
    "all_to_all": "all-to-all (B/n from each member to each other)",
    "send": "point-to-point (B to the peer)",
}


def format_formulas(formulas: Dict[str, dict], iterations: float = 1) -> List[str]:
    """One line per (operation, members, nodes, ring hops between nodes): calls and bytes per member, the
    formula with its numbers, and the bytes sent between and inside nodes (all ranks), divided by
    ``iterations``; largest between-node share first."""
    rows = sorted(formulas.items(), key=lambda kv: -kv[1]["inter"])
    out = []
    it = iterations or 1
    for key, row in rows:
        if row["inter"] + row["intra"] <= 0:
            continue
        n, hops, kind = int(row["members"]), int(row.get("crossing_hops", 0)), row["kind"]
        per_member = row["payload"] / it / (1 if kind == "send" else n)   # B: what one member holds
        mb = per_member / 1e6
        if kind in ("all_reduce", "reduce_scatter"):
            how = f"{hops} of {n} ring hops cross nodes: {hops} x 2({n}-1)/{n} x {mb:.2f} MB"
        elif kind == "all_gather":
            how = f"{hops} of {n} ring hops cross nodes: {hops} x ({n}-1)/{n} x {mb:.2f} MB"
        elif kind == "send":
            how = f"{mb:.2f} MB sent in all"
        else:
            how = f"B = {mb:.2f} MB; members on {row['nodes']} node(s)"
        out.append(f"{key}: {row['calls'] / it / (1 if kind == 'send' else n):g} calls of {FORMULA_TEXT[kind]}; "
                   f"{how} -> between nodes {row['inter'] / it / 1e6:.2f} MB, inside {row['intra'] / it / 1e6:.2f} MB")
    return out
