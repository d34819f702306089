"""The simulator's shared node links: a transfer between nodes is a :class:`Flow` that uses its source
node's outgoing and its destination node's incoming link; the flows of a moment share them max-min
fairly (:func:`max_min_rates`, progressive filling), and on gloo two ranks' opposite flows on one
connection (a process group carrying both directions) take turns beyond their first bytes
(:data:`megatron_tawpipe.sim.costmodel.GLOO_PAIR_DUPLEX_BYTES`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

INF = float("inf")


class Flow:
    """One transfer's bytes over the node links: ``out`` and ``into`` are the nodes, ``rate`` its share."""

    __slots__ = ("op", "remaining", "rate", "out", "into", "transfer", "nbytes", "shared")

    def __init__(self, op, nbytes, out, into, transfer, shared: bool = True):
        self.op, self.remaining, self.nbytes = op, nbytes, nbytes
        self.rate = 0.0
        self.out, self.into, self.transfer = out, into, transfer
        # Whether its connection carries both directions (one process group for both ways: megatron's
        # pipelines, collectives); the weight-passing runtime's groups are one per direction.
        self.shared = shared

    def pair(self) -> Tuple[int, int]:
        return self.transfer.src, self.transfer.dst

    def reverse_in(self, active: set) -> bool:
        """Whether a flow between the same two ranks runs the other way on the same connection (``active``:
        the pairs of the flows on connections that carry both directions)."""
        return self.shared and (self.transfer.dst, self.transfer.src) in active

    def has_sent(self, nbytes: float) -> bool:
        return self.nbytes - self.remaining >= nbytes * (1 - 1e-9)


def max_min_rates(flows: List[Flow], capacity: float, pair_free: float = INF,
                  pair_capacity: Optional[float] = None) -> None:
    """Max-min fair rates (progressive filling); each flow uses its source
    node's outgoing and its destination node's incoming link, each of
    ``capacity`` bytes/s; a flow past its first ``pair_free`` bytes while a flow
    between the same two ranks runs the other way also uses that pair's turn,
    ``pair_capacity`` bytes/s (default ``capacity``) shared by both directions (gloo)."""
    users: Dict[tuple, List[Flow]] = {}
    active = {f.pair() for f in flows if f.shared} if pair_free != INF else set()
    uses: Dict[int, tuple] = {}
    for f in flows:
        f.rate = -1.0
        res = [("o", f.out), ("i", f.into)]
        if f.reverse_in(active) and f.has_sent(pair_free):
            res.append(("pair",) + tuple(sorted(f.pair())))
        uses[id(f)] = tuple(res)
        for r in res:
            users.setdefault(r, []).append(f)
    turn = capacity if pair_capacity is None else pair_capacity
    remaining = {res: (turn if res[0] == "pair" else capacity) for res in users}
    unfrozen = {res: len(fs) for res, fs in users.items()}
    while unfrozen:
        best = min(unfrozen, key=lambda res: remaining[res] / unfrozen[res])
        share = remaining[best] / unfrozen[best]
        for f in users[best]:
            if f.rate < 0:
                f.rate = share
                for res in uses[id(f)]:
                    remaining[res] -= share
                    unfrozen[res] -= 1
        unfrozen = {res: n for res, n in unfrozen.items() if n > 0}
