"""Optimizer pieces every trainer shares: Megatron's parameter groups (:mod:`.param_groups`) and gradient
clipping on the global norm (:mod:`.clip`)."""
