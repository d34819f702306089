"""Weight passes placed where the simulator shows a rank idle.

:func:`place_weight_passes` splits a weight-passing plan's backwards and moves each block of weight passes
(:mod:`megatron_tawpipe.plan.zero_bubble`) to the latest ``Wait`` in its window at which the simulated
rank blocked long enough to run it, consuming that wait's idle time; a block with no such wait stays
right after its input pass. :func:`best_split` returns whichever of the plain split, the idle placement
and the latest placement (the ``-zb`` schedules' own, without a cost model) the simulator finds fastest.
"""

from __future__ import annotations

from typing import Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.zero_bubble import split_backward
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.zero_bubble import defer_weight_passes
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.simulate import SimResult, simulate


def place_weight_passes(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` split, its weight passes moved into the waits where the simulated ranks idle."""
    split = plan if plan.options.get("split_backward") else split_backward(plan)
    timeline = simulate(split, cost, record=False)
    idle = {id(split.actions[r][i]): s for (r, i), s in timeline.idle.items()}
    time_of = [cost.backward_weight_time(split, s) for s in range(split.num_shards)]

    def choose(rank, acts, block, cands):
        need = sum(time_of[acts[i].shard] for i in block if type(acts[i]) is A.BackwardWeight)
        for c in reversed(cands[1:]):
            left = idle.get(id(acts[c]), 0.0) if c < len(acts) else 0.0
            if left > 0.0 and left >= need:
                idle[id(acts[c])] = max(left - need, 0.0)
                return c
        return cands[0]

    return defer_weight_passes(split, choose, name=plan.schedule + "-zb")


def best_split(plan: Plan, cost: CostModel) -> Tuple[Plan, SimResult]:
    """The fastest, by the simulator, of ``plan``'s split backward placed as is, by idle time and latest."""
    best = None
    for candidate in (split_backward(plan), place_weight_passes(plan, cost), defer_weight_passes(plan)):
        result = simulate(candidate, cost, record=False)
        if best is None or result.iteration_time < best[1].iteration_time:
            best = (candidate, result)
    return best
