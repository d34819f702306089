"""TawPipe's ownership layout, chosen by simulation (``--tawpipe-ownership auto``).

``owner``: each shard's fp32 master weights, gradient accumulator and optimizer state live on one rank of
one group, which serves the shard to the other groups and receives their gradients; the groups run
staggered so that in a slot they fetch from different owners. ``spread``: a 1/D slice of every shard on
one rank of every group; the groups run in step, gather each shard from its D holders
(``AllGatherStart``) and reduce-scatter its gradient to them (``ReduceScatterStart``), right after its
last backward. Both move the same bytes between nodes with the shard cache; the spread layout spreads
them evenly over the node links and in time. ``auto`` simulates both and keeps the faster (ties: owner).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple, TypeVar

OWNERSHIPS = ("owner", "spread")
Result = TypeVar("Result")


def spread_problem(groups: int, replicate_first: bool = False, flat: bool = False) -> str:
    """Why the spread layout does not apply ("" when it does)."""
    if flat or groups < 2:
        return "one scheduling group: every shard is in it already"
    if replicate_first:
        return "a replicated first shard is held whole in every group (the spread layout holds every shard there)"
    return ""


def choose_ownership(simulate_layout: Callable[[str], Result], speed: Callable[[Result], float],
                     applies: bool = True) -> Tuple[str, Result, Dict[str, float]]:
    """(the faster layout, its result, every simulated layout's speed) with ``simulate_layout(ownership)``;
    only ``owner`` where the spread layout does not apply."""
    results = {o: simulate_layout(o) for o in (OWNERSHIPS if applies else OWNERSHIPS[:1])}
    speeds = {o: speed(r) for o, r in results.items()}
    best = max(results, key=lambda o: (speeds[o], o == "owner"))
    return best, results[best], speeds
