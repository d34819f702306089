"""One entry point for every schedule family."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megatron_tawpipe.common.layer_split import check_layer_split
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.activation import plan_activation
from megatron_tawpipe.plan.tawpipe import plan_tawpipe
from megatron_tawpipe.plan.weipipe import plan_weipipe
from megatron_tawpipe.plan.zero_bubble import defer_weight_passes


def _weipipe(**kw):
    return plan_weipipe(interleave=True, **kw)


def _weipipe_naive(**kw):
    return plan_weipipe(interleave=False, **kw)


def _weipipe_zb1(**kw):
    return plan_weipipe(interleave=True, zero_bubble=1, **kw)


def _weipipe_zb1_paired(**kw):
    """WZB1 in the WeiPipe paper's arrangement (backward copies and gradients in pairs, each weight pass one
    turn after its input pass): an even number of ranks (``plan.weipipe``)."""
    plan = plan_weipipe(interleave=True, zero_bubble=1, layout="paired", **kw)
    return dataclasses.replace(plan, schedule="weipipe-zb1-paired")


def _weipipe_zb2(**kw):
    return plan_weipipe(interleave=True, zero_bubble=2, **kw)


def _tawpipe_nooverlap(**kw):
    return plan_tawpipe(**{**kw, "overlap": False})


def _tawpipe_flat(**kw):
    return plan_tawpipe(**{**kw, "groups": 1})


def _tawpipe_rep(**kw):
    return plan_tawpipe(**{**kw, "replicate_first": True})


def _tawpipe_paper(**kw):
    return plan_tawpipe(**{"cache": False, "drain": True, **kw})


def _tawpipe_zb(**kw):
    return defer_weight_passes(plan_tawpipe(**kw), "weight-waits")


def _weipipe_interleave_zb(**kw):
    return defer_weight_passes(plan_weipipe(interleave=True, **kw), "weight-waits", name="weipipe-interleave-zb")


def _activation(name):
    def planner(**kw):
        return plan_activation(name, **kw)
    return planner


SCHEDULES = {
    "weipipe": _weipipe,
    "weipipe-naive": _weipipe_naive,
    "weipipe-zb1": _weipipe_zb1,
    "weipipe-zb1-paired": _weipipe_zb1_paired,
    "weipipe-zb2": _weipipe_zb2,
    "tawpipe": plan_tawpipe,
    "tawpipe-nooverlap": _tawpipe_nooverlap,
    "tawpipe-flat": _tawpipe_flat,
    "tawpipe-paper": _tawpipe_paper,
    "tawpipe-rep": _tawpipe_rep,
    "tawpipe-zb": _tawpipe_zb,
    "weipipe-interleave-zb": _weipipe_interleave_zb,
    "gpipe": _activation("gpipe"),
    "1f1b": _activation("1f1b"),
    "interleaved": _activation("interleaved"),
}


def build_plan(schedule: str, *, num_ranks: int, num_groups: int = 1, num_layers: int = None,
               num_microbatches: int = 1, shard_layers: Optional[Sequence[int]] = None, **options) -> Plan:
    """Build the plan of ``schedule`` (a key of ``SCHEDULES``) for ``num_ranks``
    ranks in ``num_groups`` groups (nodes) of consecutive ranks.  ``num_layers``
    defaults to one layer per shard; ``num_microbatches`` is per rank for weight
    passing and per pipeline for activation passing.  Extra keyword options go
    to the planner.  ``shard_layers`` gives each shard's (stage's) number of layers; by
    default the layers are split as equally as possible, the larger shards first."""
    try:
        planner = SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}") from None
    if num_layers is None:
        num_layers = num_ranks
    plan = planner(num_ranks=num_ranks, num_groups=num_groups, num_layers=num_layers,
                   num_microbatches=num_microbatches, **options)
    if shard_layers is not None:
        plan.shard_layers = check_layer_split(shard_layers, num_layers, plan.num_shards)
    return plan
