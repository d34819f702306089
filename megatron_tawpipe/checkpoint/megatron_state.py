"""What Megatron-LM's formats write of megatron-core's own objects, for a trainer that has them (the native schedules).

A trainer hands over its model chunks (``megatron_model_chunks()``) and its optimizer (``megatron_optimizer()``);
this module asks them for what Megatron-LM saves: ``sharded_state_dict()`` for ``--ckpt-format torch_dist``,
``state_dict_for_save_checkpoint()`` and ``optimizer.state_dict()`` for the legacy ``--ckpt-format torch`` (with
the distributed optimizer's ``save_parameter_state`` / ``load_parameter_state``), and loads the legacy optimizer
state back as Megatron-LM does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _single(optimizer):
    """The one optimizer of a ChainedOptimizer (a model without decoupled parameter groups), or ``optimizer``."""
    if hasattr(optimizer, "chained_optimizers"):
        (optimizer,) = optimizer.chained_optimizers
    return optimizer


def _distributed(optimizer) -> bool:
    return bool(getattr(getattr(optimizer, "config", None), "use_distributed_optimizer", False))


def initialize_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of torch's Adam/AdamW that has no state yet the state Adam creates at its first
    step (step 0, zero moments): the same update follows. megatron-core 0.16.1's distributed optimizer cannot
    write its state dict while torch's Adam has taken no step (it reads the step from the per-parameter state),
    as under fp16 while the first iterations overflow and skip their step."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        device_step = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state = {"step": torch.zeros((), dtype=scalar, device=param.device) if device_step
                     else torch.tensor(0.0, dtype=scalar),
                     "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            optimizer.state[param] = state


def _model_states(chunks, state_of: Callable) -> dict:
    """``model`` (``model0``, ``model1``, ... with virtual stages): ``state_of`` each chunk."""
    if len(chunks) == 1:
        return {"model": state_of(chunks[0])}
    return {f"model{i}": state_of(chunk) for i, chunk in enumerate(chunks)}


def sharded_state_dict(trainer, with_optimizer: bool) -> Optional[dict]:
    """``model`` (``model0``, ``model1``, ... with virtual stages) and ``optimizer`` as Megatron-LM saves them
    with ``--ckpt-format torch_dist``: megatron-core's own sharded state dicts, the distributed optimizer in its
    model-space ``fully_reshardable`` form; None for a trainer without megatron-core's own objects."""
    chunks = trainer.megatron_model_chunks()
    if chunks is None:
        return None
    state = _model_states(chunks, lambda chunk: chunk.sharded_state_dict())
    if with_optimizer:
        optimizer = trainer.megatron_optimizer()
        distributed = _distributed(optimizer)
        if distributed:
            initialize_adam_state(_single(optimizer).optimizer)   # (no step taken yet: fp16 skipping its first steps)
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if distributed else None
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    return state


def legacy_state_dict(trainer, with_optimizer: bool, parameter_state: Optional[str]) -> Optional[dict]:
    """``model`` (``model0``, ``model1``, ...) and ``optimizer`` as Megatron-LM's ``--ckpt-format torch`` writes
    them: each chunk's ``state_dict_for_save_checkpoint()`` and megatron-core's ``optimizer.state_dict()``; the
    distributed optimizer's parameter state goes to ``parameter_state`` (megatron-core's ``save_parameter_state``,
    written by data-parallel rank 0; collective). None for a trainer without megatron-core's own objects."""
    chunks = trainer.megatron_model_chunks()
    optimizer = trainer.megatron_optimizer()
    if chunks is None or optimizer is None:
        return None
    state = _model_states(chunks, lambda chunk: chunk.state_dict_for_save_checkpoint())
    if with_optimizer:
        if _distributed(optimizer):
            initialize_adam_state(_single(optimizer).optimizer)   # (no step taken yet: fp16 skipping its first steps)
            optimizer.save_parameter_state(parameter_state)
        state["optimizer"] = optimizer.state_dict()
    return state


def load_legacy_optimizer(trainer, optimizer_state: dict, parameter_state: Optional[str]) -> None:
    """Megatron-LM's loading steps into the trainer's megatron-core optimizer: ``optimizer.load_state_dict`` (for
    the fp16/bf16 optimizers the fp32 masters and the loss scaler too), then the distributed optimizer's
    ``load_parameter_state``."""
    optimizer = trainer.megatron_optimizer()
    if optimizer is None:
        raise TypeError("only a trainer with megatron-core's own optimizer loads its legacy optimizer state")
    states = _single(optimizer).optimizer.state
    for param in [param for param, state in states.items() if not state]:
        del states[param]   # (entries the weights' loading made by looking up states: megatron-core would keep them)
    optimizer.load_state_dict(optimizer_state)
    if _distributed(optimizer):
        # megatron-core 0.16.1 with torch's Adam (no Apex/TE) puts the step (from the param groups) into each
        # parameter's state in load_state_dict, then load_parameter_state copies every state key from the
        # file, which has none for the step: set it aside meanwhile. It sets one step tensor for every
        # parameter, which torch's Adam would count up once per parameter: each gets its own copy.
        states = _single(optimizer).optimizer.state   # (load_state_dict replaced the dict)
        steps = {param: state.pop("step") for param, state in states.items() if "step" in state}
        try:
            with torch.no_grad():   # (fp32: the main shards are views of the parameters)
                optimizer.load_parameter_state(parameter_state)
        finally:
            for param, step in steps.items():   # (one tensor shared by every parameter: each its own)
                states[param]["step"] = step.clone()
