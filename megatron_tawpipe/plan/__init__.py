"""Schedules as data: build, validate, simulate and print pipeline plans.

    plan = build_plan("tawpipe", num_ranks=8, num_groups=2, num_layers=16, num_microbatches=4)
    validate_plan(plan)                      # raises PlanError if unsound
    result = simulate(plan, CostModel.from_flops(...))

Pure Python (no torch): usable on a laptop to plan a cluster run.
"""

from . import actions
from .actions import (Forward, Backward, BackwardInput, BackwardWeight, LoadWeights, ZeroGrad,
                      AccumulateToOwner, SendStart, RecvStart, BroadcastStart, ReduceStart,
                      AllReduceStart, ReplicatedAllReduceStart, Wait, OptimizerStep, MAIN)
from .plan import Plan
from .errors import PlanError
from .validate import ValidationReport, validate_plan
from .planners import SCHEDULES, build_plan, split_backward

__all__ = [
    "actions", "Plan", "PlanError", "ValidationReport", "validate_plan", "build_plan",
    "split_backward", "SCHEDULES", "Forward", "Backward", "BackwardInput", "BackwardWeight",
    "LoadWeights", "ZeroGrad", "AccumulateToOwner", "SendStart", "RecvStart", "BroadcastStart",
    "ReduceStart", "AllReduceStart", "ReplicatedAllReduceStart", "Wait", "OptimizerStep", "MAIN",
]
from .costmodel import CostModel, Link, params_per_layer, parse_rate, parse_time
from .simulate import SimResult, Span, Transfer, link_bytes, replicated_allreduce_bytes, simulate

__all__ += ["CostModel", "Link", "params_per_layer", "parse_rate", "parse_time", "SimResult",
            "Span", "Transfer", "link_bytes", "replicated_allreduce_bytes", "simulate"]
