"""What a plan costs: the cost model, the discrete-event simulator, the other strategies' models and the advisor.

    result = simulate(build_plan("tawpipe", ...), CostModel.from_flops(...))

Pure Python (no torch), like :mod:`megatron_tawpipe.plan` below it.
"""

from megatron_tawpipe.sim.costmodel import CostModel, Link, params_per_layer, parse_rate, parse_time
from megatron_tawpipe.sim.simulate import SimResult, Span, Transfer, simulate

__all__ = ["CostModel", "Link", "params_per_layer", "parse_rate", "parse_time", "SimResult", "Span", "Transfer",
           "simulate"]
