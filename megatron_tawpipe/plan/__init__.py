"""Schedules as data: build, validate and print pipeline plans (the simulator is :mod:`megatron_tawpipe.sim`).

    plan = build_plan("tawpipe", num_ranks=8, num_groups=2, num_layers=16, num_microbatches=4)
    validate_plan(plan)                      # raises PlanError if unsound

Pure Python (no torch): usable on a laptop to plan a cluster run.
"""

from megatron_tawpipe.plan import actions
from megatron_tawpipe.plan.actions import (Forward, Backward, BackwardInput, BackwardWeight, LoadWeights, ZeroGrad,
                      AccumulateToOwner, SendStart, RecvStart, BroadcastStart, ReduceStart,
                      AllReduceStart, ReplicatedAllReduceStart, Wait, OptimizerStep, MAIN)
from megatron_tawpipe.plan.plan import Plan
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.validate import ValidationReport, validate_plan
from megatron_tawpipe.plan.planners import SCHEDULES, build_plan
from megatron_tawpipe.plan.zero_bubble import split_backward

__all__ = [
    "actions", "Plan", "PlanError", "ValidationReport", "validate_plan", "build_plan",
    "split_backward", "SCHEDULES", "Forward", "Backward", "BackwardInput", "BackwardWeight",
    "LoadWeights", "ZeroGrad", "AccumulateToOwner", "SendStart", "RecvStart", "BroadcastStart",
    "ReduceStart", "AllReduceStart", "ReplicatedAllReduceStart", "Wait", "OptimizerStep", "MAIN",
]
from megatron_tawpipe.plan.traffic import link_bytes, replicated_allreduce_bytes, ring_share

__all__ += ["link_bytes", "replicated_allreduce_bytes", "ring_share"]
from megatron_tawpipe.plan.files import read_plan, write_plan

__all__ += ["read_plan", "write_plan"]
