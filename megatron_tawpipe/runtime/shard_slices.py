"""A shard kept in slices over its holders (TawPipe's spread ownership layout, ``Plan.ownership`` "spread").

The holders of shard ``s`` (``Plan.holders(s)``, one rank per node group) each keep one slice of its flat
layout: with D holders and ``n`` elements, slice ``k`` (member k of the sorted holders) is elements
``[k * c, (k + 1) * c)`` with ``c = ceil(n / D)``; the last slice is padded with zeros past ``n``, so that the
gather and the reduce-scatter move D equal pieces (``D * c`` elements, a buffer's padded length). A holder
keeps its slice's fp32 master, gradient and optimizer state; the optimizer sees a slice as the pieces of the
parameters it covers (:meth:`ShardSlice.pieces`), each stepped under its parameter's name and shape, so
weight decay and learning-rate groups are the parameter's.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Dict, List, Sequence, Tuple

import torch


#: the Adam state tensors a slice's checkpoint gathers (beside the step count)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def parameter_slot(name: str, param: torch.Tensor, offset: int = 0) -> types.SimpleNamespace:
    """What a :class:`Piece` and a :class:`SliceTarget` read of a parameter laid out alone or at ``offset`` of a
    flat tensor (as of a shard's ParamSlot): its name, place, shape and tensor-parallel split (-1: none)."""
    split = bool(getattr(param, "tensor_model_parallel", False))
    return types.SimpleNamespace(name=name, offset=offset, numel=param.numel(), shape=tuple(param.shape),
                                 partition_dim=getattr(param, "partition_dim", -1) if split else -1)


def slice_length(numel: int, members: int) -> int:
    """Elements of each of ``members`` equal slices of ``numel`` (the last padded): ``ceil(numel / members)``."""
    return -(-numel // members)


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter that a slice covers."""

    name: str                     # the parameter's global name
    slot: object                  # its ShardTemplate ParamSlot (shape, tensor-parallel split)
    param_start: int              # first element of the parameter (flattened) in the slice
    slice_start: int              # where it lies in the slice
    numel: int


@dataclasses.dataclass(frozen=True)
class ShardSlice:
    """Holder ``index`` of ``members`` of one shard of ``numel`` elements."""

    shard: int
    numel: int
    members: int
    index: int
    holders: Tuple[int, ...]      # the plan's ranks holding the shard, sorted

    @property
    def length(self) -> int:
        return slice_length(self.numel, self.members)

    @property
    def start(self) -> int:
        return self.index * self.length

    @property
    def valid(self) -> int:
        """Elements of the slice inside the shard (the rest is padding)."""
        return max(0, min(self.length, self.numel - self.start))

    def pieces(self, slots: Sequence, global_name: Callable[[object], str]) -> List[Piece]:
        """The parameters the slice covers, in layout order (``slots``: the shard's, with their offsets)."""
        lo, hi = self.start, self.start + self.valid
        out = []
        for slot in slots:
            first, last = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if first < last:
                out.append(Piece(global_name(slot), slot, first - slot.offset, first - lo, last - first))
        return out


def holder_slice(plan, shard: int, rank: int, numel: int) -> ShardSlice:
    """``rank``'s slice of ``shard`` (``numel`` elements) among the plan's holders of it (``plan.holders``)."""
    holders = tuple(sorted(plan.holders(shard)))
    return ShardSlice(shard, numel, len(holders), holders.index(rank), holders)


def piece_view(flat_slice: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece``'s elements in a slice-long tensor (a 1-D view)."""
    return flat_slice[piece.slice_start:piece.slice_start + piece.numel]


class SliceTarget:
    """Stands in for a whole parameter while a checkpoint loads: ``copy_(whole)`` keeps the elements this
    rank's slices hold, ``store_state(state)`` installs their Adam state. ``shape`` is the parameter's as this
    rank computes with it (its tensor-parallel slice), with megatron-core's tensor-parallel attributes."""

    def __init__(self, slot, device: torch.device, parts: List[Tuple[Piece, torch.Tensor]],
                 store: Callable[[torch.Tensor, Dict[str, torch.Tensor]], None]):
        self.shape = torch.Size(slot.shape)
        self.device = device
        self.dtype = torch.float32
        self._parts, self._store = parts, store
        if slot.partition_dim >= 0:
            self.tensor_model_parallel, self.partition_dim, self.partition_stride = True, slot.partition_dim, 1

    def copy_(self, whole: torch.Tensor) -> "SliceTarget":
        flat = whole.reshape(-1)
        for piece, master in self._parts:
            master.copy_(flat[piece.param_start:piece.param_start + piece.numel])
        return self

    def store_state(self, state: Dict[str, torch.Tensor]) -> None:
        for piece, master in self._parts:
            self._store(master, {key: (value.reshape(-1)[piece.param_start:piece.param_start + piece.numel]
                                      .to(self.device, copy=True) if value.dim() else value.clone())
                                for key, value in state.items()})
