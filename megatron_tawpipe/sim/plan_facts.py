"""What the simulator derives from a plan alone, once per plan object: the advisor prices one plan under many
cost models (micro-batch sizes, recompute), and these do not depend on the cost."""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import batch_entries
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.traffic import link_bytes, replicated_allreduce_bytes

_STARTS = frozenset(A.STARTS)

# id(plan) -> (the plan, weakly; id of its action lists; what was derived): plans are neither hashable nor
# immutable, and the advisor prices one plan under many cost models
_HELD_STATES: Dict[int, Tuple[weakref.ref, int, list]] = {}
_STRUCTURE: Dict[int, Tuple[weakref.ref, int, tuple]] = {}
_ENTRIES: Dict[int, Tuple[weakref.ref, int, tuple]] = {}
_TRAFFIC: Dict[int, Tuple[weakref.ref, int, dict]] = {}


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


def plan_entries(plan: Plan) -> tuple:
    """The NCCL entries of :func:`plan_structure` indexed for a simulation: ``(index, keys, tags, sizes)`` with
    ``index[(rank, tag)]`` the entry's number, ``keys[i]`` its communicator key, ``tags[i]`` its tags (a batch is
    one entry), ``sizes[i]`` their count; cached per plan."""
    def derive(plan):
        index: Dict[tuple, int] = {}
        keys, tags = [], []
        for i, (r, key, entry_tags) in enumerate(plan_structure(plan)[1]):
            keys.append(key)
            tags.append(entry_tags)
            for tag in entry_tags:
                index[(r, tag)] = i
        return index, keys, tags, [len(t) for t in tags]
    return _cached(_ENTRIES, plan, derive)


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


def plan_traffic(plan: Plan, bytes_per_shard: float, bytes_per_activation: float, bytes_per_grad: float,
                 reduce_scatter_factor: float, replicated_bytes: float,
                 gathered_bytes: Optional[float] = None) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(``link_bytes`` of ``plan`` with the replicated all-reduce's bytes added, ``replicated_allreduce_bytes``)
    per link class: each computed once per plan object and byte sizes (a new dict each call)."""
    table = _cached(_TRAFFIC, plan, lambda p: {})
    # with what else link_bytes reads of the plan besides its actions (a plan edited in place after a simulation)
    key = (bytes_per_shard, bytes_per_activation, bytes_per_grad, reduce_scatter_factor, replicated_bytes,
           gathered_bytes, tuple(plan.shard_layers), plan.ranks_per_group, plan.num_groups)
    hit = table.get(key)
    if hit is None:
        lb = link_bytes(plan, bytes_per_shard, bytes_per_activation, bytes_per_grad,
                        reduce_scatter_factor=reduce_scatter_factor)
        rep = replicated_allreduce_bytes(plan, replicated_bytes, reduce_scatter_factor, gathered_bytes)
        hit = table[key] = ({k: v + rep[k] for k, v in lb.items()}, dict(rep))
    return dict(hit[0]), dict(hit[1])
