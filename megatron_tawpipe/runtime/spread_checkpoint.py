"""Checkpoints of the spread ownership layout: the same files as every other layout's.

A checkpoint holds every parameter whole under its global name, whatever layout wrote it, so a run of the
spread layout resumes from one written by the one-owner layout or by megatron's native schedules, and the
other way round. Saving gathers each shard's slices over its holders (its fp32 master and Adam moments, one
collective per shard, in shard order on every holder) and the shard's owner writes it as the one-owner
layout's owner does; loading gives the checkpoint code a stand-in per parameter that keeps the piece this
rank's slice covers (:class:`~megatron_tawpipe.runtime.shard_slices.SliceTarget`).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.runtime.shard_slices import ADAM_MOMENTS as _MOMENTS, SliceTarget, piece_view

Entry = Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]


def spread_load_targets(model, set_state: Callable[[torch.Tensor, Dict[str, torch.Tensor]], None]
                        ) -> Iterator[Tuple[str, SliceTarget, SliceTarget]]:
    """``(global name, target, target)`` for every parameter this rank's slices cover."""
    for shard in sorted(model.slices):
        for piece, view in model.slice_pieces(shard):
            target = SliceTarget(piece.slot, view.device, [(piece, view)], set_state)
            yield piece.name, target, target


def _holders_group(model, holders: Tuple[int, ...]):
    """The process group the plan gathers this shard's weights on (its holders, this tensor-parallel index)."""
    for key, group in model.communicators.groups.items():
        if key[0] == "collective" and key[2] == "weight" and tuple(sorted(key[1])) == holders:
            return group
    raise RuntimeError(f"no process group of the shard holders {list(holders)}")


def gather_spread_shards(model, state_for: Callable[[torch.Tensor], Dict[str, torch.Tensor]]) -> List[Entry]:
    """Every shard this rank holds a slice of, gathered over its holders (collective, in shard order); the
    shard's owner keeps ``(name, whole master, whole Adam state)`` per parameter, in host memory."""
    entries: List[Entry] = []
    template = model.template
    for shard in sorted(model.slices):
        piece_of = model.slices[shard]
        master = model.master(shard)
        length, members = piece_of.length, piece_of.members
        local = torch.zeros(1 + len(_MOMENTS), length, dtype=torch.float32, device=master.device)
        local[0].copy_(master)
        step = torch.zeros(1, dtype=torch.float64, device=master.device)
        for piece, view in model.slice_pieces(shard):
            state = state_for(view)
            for row, moment in enumerate(_MOMENTS, start=1):
                if moment in state:
                    piece_view(local[row], piece).copy_(state[moment].reshape(-1))
            if "step" in state:
                step.fill_(float(state["step"]))
        group = _holders_group(model, piece_of.holders)
        gathered = torch.empty(members * local.numel(), dtype=torch.float32, device=master.device)
        dist.all_gather(list(gathered.chunk(members)), local.reshape(-1), group=group)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)   # every holder stepped alike
        if model.plan.owners[shard] != model.rank:
            continue
        numel = template.numel_of(shard)
        rows = gathered.view(members, 1 + len(_MOMENTS), length).transpose(0, 1).reshape(1 + len(_MOMENTS), -1)
        rows = rows[:, :numel].cpu()
        masters = template.tagged_views(rows[0].clone())
        moments = [template.views(rows[row].clone()) for row in range(1, 1 + len(_MOMENTS))]
        taken = float(step)
        for i, slot in enumerate(template.slots_of(shard)):
            # Before the first step taken (fp16 skipping its first steps) Adam has no state to hand over.
            state = ({moment: moments[m][i] for m, moment in enumerate(_MOMENTS)}
                     | {"step": torch.tensor(taken, dtype=torch.float32)}) if taken > 0 else {}
            entries.append((template.global_name(shard, slot), masters[i], state))
    return entries
