"""Checkpoints of trainers that shard parameters or optimizer state over data-parallel ranks.

The common checkpoint format stores every parameter whole, with its fp32 master and optimizer
state, under its global name (see :mod:`megatron_tawpipe.checkpoint`). Megatron's distributed
optimizer and FSDP2 hold only a slice of each on a rank, so:

* saving gathers each parameter's pieces, one parameter at a time and in the same order on every
  rank (a collective), and the writing rank keeps the whole tensors;
* loading reads each whole tensor from the (memory-mapped) file and copies only this rank's slice
  into place, through a :class:`SliceTarget` that stands in for the master tensor.

Distributed optimizer: a rank owns a contiguous range of each flattened parameter (possibly
empty); the pieces are summed over the optimizer instance's data-parallel group (every element is
owned by exactly one rank, the others contribute zeros, so the sum is exact).
FSDP2: a parameter is a DTensor sharded on dim 0 over the mesh's shard dimension
(``torch.chunk`` pieces); ``full_tensor()`` gathers it.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

# (global name, whole fp32 master, whole optimizer state) for the writing rank
Entry = Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]


class SliceTarget:
    """Stands in for a whole fp32 master during loading; copies this rank's slice into place.

    ``shape`` and ``device`` are the whole parameter's; ``copy_(whole)`` writes the slice, and
    ``store_state(state)`` installs the slices of whole optimizer-state tensors.
    """

    def __init__(self, shape: torch.Size, device: torch.device, take: Callable[[torch.Tensor], torch.Tensor],
                 put: Callable[[torch.Tensor], None], store_state: Callable[[Dict[str, torch.Tensor]], None]):
        self.shape = shape
        self.device = device
        self.take = take                # whole tensor -> this rank's slice (a view or copy)
        self.put = put                  # writes this rank's slice of the master
        self.store_state = store_state  # whole optimizer state -> this rank's slices, installed

    def copy_(self, whole: torch.Tensor) -> "SliceTarget":
        self.put(self.take(whole))
        return self


# ---- megatron's distributed optimizer ------------------------------------------------------

def _local_range(optimizer, param):
    """This rank's ``[start, end)`` of the flattened ``param``, or None when it owns nothing of it."""
    where = optimizer.model_param_gbuf_map.get(param)  # only parameters this rank owns a piece of
    if where is None:
        return None
    gbuf_index, dtype, bucket_index = where
    entry = optimizer.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][param]
    if entry["param"].size == 0:
        return None
    return entry["param"].start, entry["param"].end


_DISTRIBUTED_KEYS = ("param", "exp_avg", "exp_avg_sq")


def gather_distributed_optimizer(optimizer, named_params: List[Tuple[str, torch.nn.Parameter]],
                                 group, keep: bool) -> List[Entry]:
    """Whole masters and Adam state of ``named_params``, summed over ``group``; returned if ``keep``.

    One all-reduce per parameter (master and both moments stacked), and one for the step counts
    of all parameters (a MAX: every owner of a piece holds the same count).
    """
    device = named_params[0][1].device if named_params else torch.device("cpu")
    wholes, steps = [], torch.zeros(len(named_params), dtype=torch.float64, device=device)
    for i, (_name, param) in enumerate(named_params):
        owned = _local_range(optimizer, param)
        state = optimizer._get_main_param_and_optimizer_states(param) if owned else {}
        whole = torch.zeros(len(_DISTRIBUTED_KEYS), param.numel(), dtype=torch.float32, device=param.device)
        for row, key in enumerate(_DISTRIBUTED_KEYS):
            if owned and key in state:
                whole[row, owned[0]:owned[1]] = state[key].detach().view(-1).float()
        dist.all_reduce(whole, group=group)
        if owned and "step" in state:
            steps[i] = float(state["step"])
        wholes.append(whole.cpu() if keep else None)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    if not keep:
        return []
    entries: List[Entry] = []
    for (name, param), whole, step in zip(named_params, wholes, steps.tolist()):
        master, exp_avg, exp_avg_sq = (row.view(param.shape) for row in whole)
        # Before the first step taken (fp16 skipping its first steps) Adam has no state: nothing to hand over.
        optim = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": torch.tensor(step, dtype=torch.float32)} \
            if step > 0 else {}
        entries.append((name, master, optim))
    return entries


def distributed_optimizer_target(optimizer, param: torch.nn.Parameter) -> SliceTarget:
    """Where a whole tensor of ``param`` goes on this rank: its range of the fp32 main shard."""
    owned = _local_range(optimizer, param)

    def take(whole: torch.Tensor) -> torch.Tensor:
        flat = whole.reshape(-1)
        return flat[owned[0]:owned[1]] if owned else flat[:0]

    def put(piece: torch.Tensor) -> None:
        if owned:
            optimizer._get_main_param_and_optimizer_states(param)["param"].copy_(piece)

    return SliceTarget(param.shape, param.device, take, put,
                       lambda state: _store_distributed_state(optimizer, param, owned, take, state))


def _store_distributed_state(optimizer, param, owned, take, state: Dict[str, torch.Tensor]) -> None:
    if not owned:
        return
    group_index, group_order = optimizer.model_param_group_index_map[param]
    main = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    optimizer.optimizer.state[main] = {
        key: (take(value).to(main.device, copy=True) if value.dim() else value.clone())
        for key, value in state.items()}


# ---- FSDP2 -----------------------------------------------------------------------------------

def gather_fsdp(named_params: Iterator[Tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                keep: bool) -> List[Entry]:
    """Whole parameters and AdamW state of an FSDP2 model (every rank calls it, in order)."""
    entries: List[Entry] = []
    for name, param in named_params:
        whole = param.detach().full_tensor().float()
        optim = {}
        for key, value in optimizer.state.get(param, {}).items():
            optim[key] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()
        if keep:
            entries.append((name, whole.cpu(), {k: v.cpu() for k, v in optim.items()}))
    return entries


def fsdp_target(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> SliceTarget:
    """Where a whole tensor of an FSDP2 parameter goes: this rank's ``torch.chunk`` piece of dim 0."""
    mesh, placements = param.device_mesh, param.placements
    shard_dim = mesh.ndim - 1  # FSDP: the only dimension; HSDP: ("replicate", "shard")
    pieces, index = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    local = param.to_local()

    def take(whole: torch.Tensor) -> torch.Tensor:
        chunks = torch.chunk(whole, pieces, dim=0)
        return chunks[index] if index < len(chunks) else whole[:0]

    def put(piece: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(piece)

    def store_state(state: Dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        optimizer.state[param] = {
            key: (DTensor.from_local(take(value).to(local.device, dtype=local.dtype, copy=True), mesh, placements,
                                     shape=param.shape, stride=param.stride()) if value.dim() else value.clone())
            for key, value in state.items()}

    return SliceTarget(param.shape, local.device, take, put, store_state)
