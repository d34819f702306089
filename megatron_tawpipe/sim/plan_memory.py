"""What a plan holds in memory, from its action order alone: the activations each rank keeps for backward and
the weight and gradient buffers, as the simulator reports them (``SimResult``'s memory fields)."""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.plan_facts import held_states


def peak_activation_bytes(plan: Plan, cost: CostModel) -> float:
    """The most bytes a rank keeps for backward at once (plan order only): stored shard inputs (whole
    shards' activations without recompute) until their backward (its input pass, when split), and
    between a split backward's two passes its weight-gradient store (:func:`weight_store_bytes`)."""
    return max(activation_peaks(plan, cost), default=0.0)


def weight_store_bytes(plan: Plan, cost: CostModel, shard: int) -> float:
    """What one split backward of ``shard`` keeps from its input pass to its weight pass. Deferred kernels
    (``cost.deferred_weight_gradients``, the runtime): every linear layer's input and output gradient,
    ``layer_weight_store_bytes`` per layer; otherwise the shard's weight gradients in the compute dtype
    (with the embedding's on shard 0, the head's on the last shard)."""
    if cost.deferred_weight_gradients:
        return plan.shard_layers[shard] * cost.layer_weight_store_bytes
    params = plan.shard_layers[shard] * cost.params_per_layer
    params += cost.replicated_part_params("embedding") if shard == 0 else 0.0
    params += cost.replicated_part_params("head") if shard == plan.num_shards - 1 else 0.0
    return params * cost.dtype_bytes


def held_after_each(plan: Plan, cost: CostModel, acts) -> Iterator[Tuple[int, float]]:
    """After each of one rank's actions (plan order): (stored shard inputs or visits, bytes the split
    backwards' weight-gradient store holds)."""
    stash, kept = 0, 0.0
    for a in acts:
        t = type(a)
        stash += (t is A.Forward) - (t is A.Backward or t is A.BackwardInput)
        if t is A.BackwardInput:
            kept += weight_store_bytes(plan, cost, a.shard)
        elif t is A.BackwardWeight:
            kept -= weight_store_bytes(plan, cost, a.shard)
        yield stash, kept


def activation_peaks(plan: Plan, cost: CostModel, store: bool = False) -> list:
    """Per rank, the most activation bytes held at once (``store``: the weight-gradient store's part of
    that peak instead)."""
    lps = plan.max_layers_per_shard    # uneven shards: a stored visit of the largest
    per_stash = cost.activation_bytes if cost.recompute else lps * cost.layer_activation_bytes
    # What a split backward of a shard keeps is linear in (its layers, shard 0 or not, last shard or not): the
    # coefficients from the cost model, the counts held after each action from the plan alone (cached).
    if cost.deferred_weight_gradients:
        weights = (cost.layer_weight_store_bytes, 0.0, 0.0)
    else:
        weights = (cost.params_per_layer * cost.dtype_bytes,
                   cost.replicated_part_params("embedding") * cost.dtype_bytes,
                   cost.replicated_part_params("head") * cost.dtype_bytes)
    out = []
    for states in held_states(plan):
        best, best_kept = 0.0, 0.0
        for stash, layers, first, last in states:
            kept = layers * weights[0] + first * weights[1] + last * weights[2]
            held = stash * per_stash + kept
            if held > best:
                best, best_kept = held, kept
        out.append(best_kept if store else best)
    return out


def memory_fields(plan: Plan, cost: CostModel) -> Dict[str, float]:
    """A plan's per-rank memory fields of :class:`SimResult` (buffers, activations kept for backward,
    state), the largest over its ranks."""
    lps = plan.max_layers_per_shard
    working = lps * cost.layer_activation_bytes if cost.recompute else 0.0
    held = max(plan.layers_held_by(r) for r in range(plan.num_ranks))
    # fp32 master + Adam moments + fp32 main grad (16 B/param) for held layers
    # and the replicated parts, plus the replicated parts' compute copy; with their optimizer sharded
    # (``sharded_replicated``) each rank keeps the master and moments (12 B/param) of its 1/P slice only.
    rep_state = (4 + 12 / plan.num_ranks) if plan.options.get("sharded_replicated") else 16
    state = 16 * held * cost.params_per_layer + rep_state * cost.replicated_params + \
        cost.dtype_bytes * cost.replicated_params
    return dict(weight_buffers=plan.max_weight_buffers, grad_buffers=plan.max_grad_buffers,
                weight_buffer_bytes=plan.max_weight_buffers * cost.shard_bytes(plan),
                grad_buffer_bytes=plan.max_grad_buffers * cost.grad_shard_bytes(plan),
                activation_bytes=peak_activation_bytes(plan, cost) + working, state_bytes=state)
