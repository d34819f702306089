"""What the simulator derives from a plan alone, once per plan object: the advisor prices one plan under many
cost models (micro-batch sizes, recompute), and these do not depend on the cost."""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import batch_entries
from megatron_tawpipe.plan.plan import Plan

_STARTS = frozenset(A.STARTS)

# id(plan) -> (the plan, weakly; id of its action lists; what was derived): plans are neither hashable nor
# immutable, and the advisor prices one plan under many cost models
_HELD_STATES: Dict[int, Tuple[weakref.ref, int, list]] = {}
_STRUCTURE: Dict[int, Tuple[weakref.ref, int, tuple]] = {}


def _cached(cache: dict, plan: Plan, derive):
    """``derive(plan)``, computed once per plan object and action lists."""
    hit = cache.get(id(plan))
    if hit is not None and hit[0]() is plan and hit[1] == id(plan.actions):
        return hit[2]
    value = derive(plan)
    if len(cache) >= 512:
        cache.clear()
    cache[id(plan)] = (weakref.ref(plan), id(plan.actions), value)
    return value


def plan_structure(plan: Plan) -> tuple:
    """(starts per tag, [(rank, communicator key, tags of one NCCL entry)]) of ``plan``."""
    def derive(plan):
        need: Dict[int, int] = {}
        for acts in plan.actions:
            for a in acts:
                if type(a) in _STARTS:
                    need[a.tag] = need.get(a.tag, 0) + 1
        entries = [(r, key, tuple(a.tag for _, a in ops))
                   for r in range(plan.num_ranks) for key, ops in batch_entries(plan, r, "group")]
        return need, entries
    return _cached(_STRUCTURE, plan, derive)


def held_states(plan: Plan) -> list:
    """Per rank, the distinct (stored inputs, layers in the weight-gradient store, shard-0 backwards in it,
    last-shard backwards in it) after each action, in order of first appearance; cached per plan."""
    return _cached(_HELD_STATES, plan, _derive_held_states)


def _derive_held_states(plan: Plan) -> list:
    last_shard = plan.num_shards - 1
    per_rank = []
    for acts in plan.actions:
        stash = layers = first = last = 0
        seen = {}
        for a in acts:
            t = type(a)
            stash += (t is A.Forward) - (t is A.Backward or t is A.BackwardInput)
            if t is A.BackwardInput or t is A.BackwardWeight:
                sign = 1 if t is A.BackwardInput else -1
                layers += sign * plan.shard_layers[a.shard]
                first += sign * (a.shard == 0)
                last += sign * (a.shard == last_shard)
            seen.setdefault((stash, layers, first, last), None)
        per_rank.append(list(seen))
    return per_rank
