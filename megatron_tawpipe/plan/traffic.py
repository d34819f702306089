"""Traffic arithmetic of a plan: the bytes it moves per link class, exactly as its actions say.

The executor counts its transfers the same way, so a run's measured bytes per link class equal
:func:`link_bytes` of its plan; the simulator prices the same bytes.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan


def link_bytes(plan: Plan, bytes_per_shard: float, bytes_per_activation: float = 0.0,
               bytes_per_grad: Optional[float] = None, reduce_scatter_factor: float = 1.0) -> Dict[str, float]:
    """Bytes moved per link class in one iteration, exactly as the plan says.

    Point-to-point: ``size`` units from sender to receiver.  Broadcast/reduce:
    ``size`` units between the root and each other member (a member in the
    root's group counts as intra, otherwise inter).  A gradient unit is
    ``bytes_per_grad`` (default ``bytes_per_shard``).  An executor that counts
    the same way (per send, per received broadcast copy, per contributed
    reduction input) measures the same numbers.  All-reduce, all-gather and
    reduce-scatter (the holders' of a replicated or sliced shard) are rings: each
    member sends its ring share (:func:`ring_share`) to its successor.  The replicated all-reduce is
    not included (see ``replicated_allreduce_bytes``). ``reduce_scatter_factor``: 2 where the library's
    reduce-scatter runs an all-reduce (gloo), 1 for a ring (NCCL, and what the executor counts).

    With shards of different sizes, ``bytes_per_shard`` and ``bytes_per_grad`` are the
    largest shard's (a buffer's); a transfer of shard ``s`` carries
    ``shard_layers[s] / max_layers_per_shard`` of that."""
    out = {"intra": 0.0, "inter": 0.0}
    G = plan.ranks_per_group
    units = {"weight": bytes_per_shard, "grad": bytes_per_shard if bytes_per_grad is None else bytes_per_grad,
             "act": bytes_per_activation, "actgrad": bytes_per_activation}
    largest = plan.max_layers_per_shard

    def unit(a) -> float:
        if a.kind in ("weight", "grad"):
            return units[a.kind] * plan.shard_layers[a.shard] / largest
        return units[a.kind]

    for r, acts in enumerate(plan.actions):
        for a in acts:
            t = type(a)
            if t is A.SendStart:
                out[a.link] += a.size * unit(a)
            elif (t is A.BroadcastStart or t is A.ReduceStart) and r != a.root:
                out["intra" if r // G == a.root // G else "inter"] += a.size * unit(a)
            elif t is A.AllReduceStart or t in _SLICES:
                successor, share = ring_share(a.ranks, r, t in _SLICES)
                share *= reduce_scatter_factor if t is A.ReduceScatterStart else 1.0
                out["intra" if r // G == successor // G else "inter"] += share * a.size * unit(a)
    return out


_SLICES = frozenset(A.SLICE_COLLECTIVES)


def ring_share(ranks, rank: int, half: bool = False):
    """``rank``'s successor in a ring all-reduce over ``ranks`` and the fraction of the buffer it
    sends there: 2(n-1)/n (reduce-scatter, then all-gather); ``half``: a ring all-gather or
    reduce-scatter alone, (n-1)/n."""
    n = len(ranks)
    return ranks[(ranks.index(rank) + 1) % n], ((1 if half else 2) * (n - 1) / n if n > 1 else 0.0)


def replicated_allreduce_bytes(plan: Plan, replicated_bytes: float, reduce_scatter_factor: float = 1.0,
                               gathered_bytes: Optional[float] = None) -> Dict[str, float]:
    """Ring all-reduce estimate, summed over the ranks: each rank sends 2(P-1)/P of the data to its
    ring successor; with groups of consecutive ranks D of the P hops cross groups (none when D = 1).
    Through the nodes (``node_size`` G > 1): each rank sends 2(G-1)/G of the data inside its node (the
    reduce-scatter and the all-gather) and 2(D-1)/D of its 1/G across the nodes.

    With the replicated parts' optimizer sharded (``ReplicatedAllReduceStart.mode`` "scatter" / "gather") the
    2 x ``replicated_bytes`` become a reduce-scatter of them (x ``reduce_scatter_factor``: 2 where the library
    runs it as an all-reduce) and an all-gather of ``gathered_bytes`` (the weights in the compute dtype;
    default half of ``replicated_bytes``)."""
    P, D = plan.num_ranks, plan.num_groups
    rep = [a for a in plan.actions[0] if isinstance(a, A.ReplicatedAllReduceStart)]
    if P == 1 or not rep:
        return {"intra": 0.0, "inter": 0.0}
    if any(a.mode != "sum" for a in rep):
        gathered = replicated_bytes / 2 if gathered_bytes is None else gathered_bytes
        moved = reduce_scatter_factor * replicated_bytes + gathered
    else:
        moved = 2 * replicated_bytes
    G = rep[0].node_size
    if G > 1:
        return {"intra": P * (G - 1) / G * moved, "inter": P * (D - 1) / D * moved / G}
    per_hop = (P - 1) / P * moved
    inter_hops = D if D > 1 else 0
    return {"intra": (P - inter_hops) * per_hop, "inter": inter_hops * per_hop}
