"""TawPipe's ownership layouts, and where the spread one applies (``--tawpipe-ownership auto`` decides among them
with the other layout knobs: :mod:`megatron_tawpipe.sim.layout_choice`).

``owner``: each shard's fp32 master weights, gradient accumulator and optimizer state live on one rank of
one group, which serves the shard to the other groups and receives their gradients; the groups run
staggered so that in a slot they fetch from different owners. ``spread``: a 1/D slice of every shard on
one rank of every group; the groups run in step, gather each shard from its D holders
(``AllGatherStart``) and reduce-scatter its gradient to them (``ReduceScatterStart``), right after its
last backward. Both move the same bytes between nodes with the shard cache; the spread layout spreads
them evenly over the node links and in time.
"""

from __future__ import annotations


OWNERSHIPS = ("owner", "spread")


def spread_problem(groups: int, replicate_first: bool = False, flat: bool = False) -> str:
    """Why the spread layout does not apply ("" when it does)."""
    if flat or groups < 2:
        return "one scheduling group: every shard is in it already"
    if replicate_first:
        return "a replicated first shard is held whole in every group (the spread layout holds every shard there)"
    return ""
