"""Optimizer parameter groups as megatron-core makes them, for the optimizers this project builds.

The weight-passing trainer and the FSDP2 baseline run torch's AdamW; megatron's
``OptimizerParamScheduler`` sets each group's learning rate and weight decay from the keys
read here. The groups follow megatron-core's defaults:

* no weight decay on biases and 1-D parameters (norm weights), ``wd_mult`` 0;
* with ``--decoupled-lr``, the word embeddings and the output layer follow their own peak
  (and ``--decoupled-min-lr``) learning rate.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Tuple

import torch

EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def no_weight_decay(name: str, shape) -> bool:
    return name.endswith(".bias") or len(shape) == 1


def megatron_param_groups(named: Iterable[Tuple[str, torch.Tensor]], args,
                          shape_of: Optional[Callable[[str, torch.Tensor], Tuple[int, ...]]] = None) -> List[dict]:
    """Groups over ``(name, tensor)`` pairs; empty groups are left out. ``shape_of(name, tensor)``: the
    parameter's shape where ``tensor`` is a flat piece of it (default: the tensor's own)."""
    decoupled_lr, decoupled_min_lr = args.decoupled_lr, args.decoupled_min_lr
    buckets = {}
    for name, tensor in named:
        decoupled = decoupled_lr is not None and name in EMBEDDING_OR_OUTPUT
        shape = tensor.shape if shape_of is None else shape_of(name, tensor)
        key = (0.0 if no_weight_decay(name, shape) else 1.0, decoupled)
        buckets.setdefault(key, []).append(tensor)
    groups = []
    for (wd_mult, decoupled), params in sorted(buckets.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        max_lr = decoupled_lr if decoupled else args.lr
        min_lr = (decoupled_min_lr if decoupled_min_lr is not None else args.min_lr) if decoupled else args.min_lr
        groups.append({"params": params, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": decoupled,
                       "max_lr": max_lr, "min_lr": min_lr, "default_config": not decoupled,
                       "is_expert_parallel": False})
    return groups
