"""Megatron-LM's legacy ``--ckpt-format torch`` files with the optimizer state under the weight-passing schedules.

A weight-passing rank owns some parameters' fp32 masters and Adam moments; Megatron-LM's file holds megatron-core's
``optimizer.state_dict()``, indexed by megatron-core's parameter order. So the files are written exactly as a native
run at tensor/pipeline size 1 with megatron-core's non-distributed optimizer writes them, by that run's own objects:
rank 0 gathers the whole masters and moments, puts them (by global name) into megatron-core's model and optimizer
built for that layout (by the ``legacy_reference`` factory the training layer passes to the checkpoint functions;
built on every rank, as megatron-core agrees its parameter groups over all ranks, and dropped again at once but
on rank 0), and writes what megatron-core's
``state_dict_for_save_checkpoint()`` and ``optimizer.state_dict()`` give. Loading runs the other way: rank 0 has
megatron-core's ``optimizer.load_state_dict`` read the file, then hands each parameter's whole master and moments
to the ranks that hold it, one parameter at a time. Rank 0 holds one whole model with its optimizer state meanwhile,
as Megatron-LM's tensor/pipeline-size-1 file does anyway.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.common.checkpointable import ReferenceFactory
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.common.errors import CheckpointError
from megatron_tawpipe.checkpoint import megatron_state
from megatron_tawpipe.checkpoint.state import rank, restore_optimizer_state, tied_alias, world, writer_entries

MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPERPARAMETERS = ("lr", "weight_decay")   # what the LR schedule sets in each group


def _group_key(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys  # how megatron-core matches groups

    return tuple(group.get(key) for key in param_group_identifier_keys)


def _gather(value) -> Optional[list]:
    """Every rank's ``value`` on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [value]
    parts = [None] * world() if rank() == 0 else None
    dist.gather_object(value, parts, dst=0)
    return parts


def reference_state(trainer, args, build_reference: ReferenceFactory) -> Optional[dict]:
    """Collective. On rank 0: ``model`` and ``optimizer`` as megatron-core writes them at tensor/pipeline size 1
    with its non-distributed optimizer, holding this run's masters, moments, LR and loss scale; None elsewhere."""
    tied = not args.untie_embeddings_and_output_weights
    local = {}
    for name, master, state in writer_entries(trainer):
        if tied_alias(name, tied) is None and not trainer.skip_in_checkpoint(name):
            local[name] = (master.detach().float().cpu().clone(),
                           {key: value.detach().float().cpu().clone() for key, value in state.items()})
    groups = [{key: group.get(key) for key in _HYPERPARAMETERS} | {"key": _group_key(group)}
              for group in trainer.optimizer.param_groups]
    parts, group_parts = _gather(local), _gather(groups)
    reference = build_reference()   # (collective: megatron-core agrees its parameter groups over all ranks)
    if rank() != 0:
        return None
    wholes: Dict[str, tuple] = {}
    for part in parts:
        for name, entry in part.items():
            wholes.setdefault(name, entry)
    with torch.no_grad():
        for name, param, master in reference.named_master_parameters():
            wanted = tied_alias(name, tied) or name
            if wanted not in wholes:
                raise CheckpointError(f"--ckpt-format torch: no rank wrote parameter {wanted}")
            whole, state = wholes[wanted]
            master.copy_(whole.view(master.shape))
            if param is not master:
                param.copy_(whole.view(param.shape))
            restore_optimizer_state(reference, master, state)
    reference.after_parameters_loaded()
    reference.load_grad_scaler_state(trainer.grad_scaler_state())
    settings = {group["key"]: group for part in group_parts for group in part}
    for group in reference.param_groups():
        found = settings.get(_group_key(group))
        if found is not None:
            group.update({key: found[key] for key in _HYPERPARAMETERS if found[key] is not None})
    return megatron_state.legacy_state_dict(reference, True, None)


def load_reference_optimizer(optimizer_state: Optional[dict], trainer, args, build_reference: ReferenceFactory) -> None:
    """Collective. Rank 0 loads ``optimizer_state`` (megatron-core's ``optimizer.state_dict()`` at tensor/pipeline
    size 1, non-distributed) into megatron-core's optimizer; every rank then takes the whole fp32 masters and Adam
    state of the parameters it holds, and the loss scale."""
    tied = not args.untie_embeddings_and_output_weights
    reference, listing = build_reference(), None   # (collective, as above; used on rank 0)
    if rank() != 0:
        reference = None
    else:
        try:
            megatron_state.load_legacy_optimizer(reference, optimizer_state, None)
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:   # not megatron-core's state at this layout
            listing = {"error": f"megatron-core's optimizer.load_state_dict refused its optimizer state: {exc}"}
    if rank() == 0 and listing is None:
        listing = {"params": [], "scaler": reference.grad_scaler_state()}
        for name, param, master in reference.named_master_parameters():
            state = reference.optimizer_state_for(master)
            step = float(state["step"]) if "step" in state else None
            # fp32 masters: the file's (fp16/bf16 training: the optimizer's); fp32 training: the weights, read already
            listing["params"].append((name, tuple(master.shape), step, param is not master))
    box = [listing]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    listing = box[0]
    if "error" in listing:
        raise CheckpointError(listing["error"])
    wanted = {tied_alias(name, tied) or name for name, _param, _master in trainer.named_master_parameters()}
    received: Dict[str, Tuple[torch.Tensor, Optional[float]]] = {}
    masters = {name: master for name, _param, master in reference.named_master_parameters()} if reference else {}
    for name, shape, step, has_master in listing["params"]:
        numel = torch.Size(shape).numel()
        rows = torch.zeros(1 + len(MOMENTS), numel, dtype=torch.float32, device=current_device())
        if reference is not None:
            state = reference.optimizer_state_for(masters[name])
            rows[0] = masters[name].detach().reshape(-1).float()
            for i, moment in enumerate(MOMENTS):
                if moment in state:
                    rows[1 + i] = state[moment].detach().reshape(-1).float()
        if dist.is_initialized():
            dist.broadcast(rows, src=0)
        if name in wanted:
            received[name] = (rows.cpu().view(1 + len(MOMENTS), *shape), step, has_master)
    del reference, masters
    with torch.no_grad():
        for name, param, master in trainer.named_master_parameters():
            source = tied_alias(name, tied) or name
            if source not in received:
                raise CheckpointError(f"--ckpt-format torch: the checkpoint's optimizer holds no parameter {source}")
            rows, step, has_master = received[source]
            pieces = [trainer.checkpoint_slice(name, param, row) for row in rows]
            if has_master:
                master.copy_(pieces[0].to(device=master.device, dtype=torch.float32))
                if param is not master:
                    param.copy_(pieces[0].to(device=param.device, dtype=param.dtype))
            if step is not None:    # (before the first step taken Adam has no state: it creates it at that step)
                state = {moment: piece for moment, piece in zip(MOMENTS, pieces[1:])}
                state["step"] = torch.tensor(step, dtype=torch.float32)
                restore_optimizer_state(trainer, master, state)
    if listing["scaler"] is not None:
        trainer.load_grad_scaler_state(listing["scaler"])


def rng_states_of_every_rank(state: dict) -> Optional[List[dict]]:
    """Collective: every rank's RNG ``state`` on rank 0, in rank order (Megatron-LM's ``rng_state`` list)."""
    return _gather(state)
