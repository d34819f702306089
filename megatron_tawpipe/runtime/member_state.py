"""Context parallelism inside the weight pipeline: the C members of a virtual rank divide its Adam state.

The members of a virtual rank (``runtime.context_parallel``) compute the same shards on their own tokens. Each
keeps the whole master of every shard it holds and of the replicated parts (it loads its compute copy from it)
and the whole gradient accumulator (its backward adds its tokens' share), but it steps only *piece c* of every
flat tensor -- an owned shard's flat layout, each replicated parameter -- the piece ``[c L, (c + 1) L)`` with
``L = ceil(n / C)`` that its transfers move:

* before the step the accumulators are reduce-scattered over the members: member c keeps the sum of piece c, the
  rest of its accumulator zeroed, so that the sum over the members is still the true gradient (the norm and the
  non-finite check read whole accumulators: each piece is counted once, on its member). The replicated
  parameters' gradients are already so where the plan reduced them over the virtual ranks (their member point
  reduce-scatters them, and lane c all-reduces piece c): they are not reduce-scattered twice;
* the optimizer steps piece c, seen as the pieces of the parameters it covers (each under its parameter's name
  and shape, so that weight decay and learning-rate groups are the parameter's): a member keeps 1/C of the Adam
  moments;
* after the step the masters' pieces are all-gathered over the members, which hold identical masters again.

A reduce-scatter and an all-gather move an all-reduce's bytes (on gloo the reduce-scatter is an all-reduce, so
there the all-gather is extra). Checkpoints hold every parameter whole: saving all-gathers each flat tensor's Adam
moments over the members (every member then holds them whole, as it holds the masters); loading copies the whole
master on every member and keeps the piece of the Adam state it steps (:class:`PieceTarget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.runtime.context_parallel import ContextParallelPieces
from megatron_tawpipe.runtime.node_reduce import all_gather_into
from megatron_tawpipe.runtime.replicated_slices import part_of
from megatron_tawpipe.runtime.shard_slices import (ADAM_MOMENTS as _MOMENTS, Piece, ShardSlice, SliceTarget,
                                                   parameter_slot, piece_view)

Entry = Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]


@dataclass
class MemberFlat:
    """One flat tensor the members divide: its whole master and gradient accumulator (1-D, ``n`` elements), its
    parameters' slots (``offset``, ``numel``, ``shape``, ``partition_dim``), global names and whole master views
    (parameter-shaped, with megatron-core's tensor-parallel attributes); for a replicated parameter, its ``part``
    (``runtime.replicated_slices.part_of``)."""

    master: torch.Tensor
    grad: torch.Tensor
    slots: Sequence
    names: List[str]
    views: List[torch.Tensor]
    part: Optional[str] = None   # a replicated parameter's part of the plan's replicated reductions


class PieceTarget(SliceTarget):
    """Stands in for a parameter while a checkpoint loads: ``copy_(whole)`` fills the whole master (every member
    loads it whole), ``store_state(state)`` installs the Adam state of the pieces this member steps."""

    def __init__(self, slot, view: torch.Tensor, parts: List[Tuple[Piece, torch.Tensor]],
                 store: Callable[[torch.Tensor, Dict[str, torch.Tensor]], None]):
        super().__init__(slot, view.device, parts, store)
        self._view = view

    def copy_(self, whole: torch.Tensor) -> "PieceTarget":
        self._view.copy_(whole.reshape(self._view.shape))
        return self


class MemberPieces:
    """Member ``rank`` of ``size`` (the context-parallel ``group``): its pieces of ``flats`` (module text)."""

    def __init__(self, group, size: int, rank: int, flats: Sequence[MemberFlat]):
        self.group, self.size, self.rank = group, size, rank
        self._collectives = ContextParallelPieces(group, size, rank)   # the same pieces as the plan's transfers
        self.flats = list(flats)
        self._held = [ShardSlice(-1, flat.master.numel(), size, rank, ()) for flat in self.flats]
        # (piece, master view, gradient view) per parameter piece, made once: the optimizer keys its state by them
        self._pieces: List[List[Tuple[Piece, torch.Tensor, torch.Tensor]]] = []
        for flat, held in zip(self.flats, self._held):
            names = dict(zip((id(slot) for slot in flat.slots), flat.names))
            master = flat.master[held.start:held.start + held.valid]
            grad = flat.grad[held.start:held.start + held.valid]
            self._pieces.append([(piece, piece_view(master, piece), piece_view(grad, piece))
                                 for piece in held.pieces(flat.slots, lambda slot: names[id(slot)])])
        self._shapes = {name: tuple(slot.shape) for flat in self.flats for slot, name in zip(flat.slots, flat.names)}

    @classmethod
    def of_model(cls, model) -> "MemberPieces":
        """A weight-pipeline model's (``runtime.weight_pipe_model``, with context parallelism): the shards it holds
        whole, then each replicated parameter."""
        cp, template = model.context_parallel, model.template
        flats = []
        for shard in model.owned:
            master, slots = model.master(shard), template.slots_of(shard)
            flats.append(MemberFlat(master, model.main_grad(shard), slots,
                                    [template.global_name(shard, slot) for slot in slots], template.tagged_views(master)))
        for (name, _param), master, grad in zip(model.replicated, model.replicated_masters, model.replicated_grads()):
            if master.numel():
                flats.append(MemberFlat(master.view(-1), grad.view(-1), [parameter_slot(name, master)], [name],
                                        [master], part_of(name)))
        return cls(cp.group, cp.size, cp.rank, flats)

    # ---- the optimizer's view ------------------------------------------------------------------------------

    def named(self) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(global name, master piece, gradient piece)`` of every parameter piece this member steps."""
        return [(piece.name, master, grad) for pieces in self._pieces for piece, master, grad in pieces]

    def shape_of(self, name: str) -> Tuple[int, ...]:
        """The (tensor-parallel) shape of the parameter ``name`` a piece belongs to."""
        return self._shapes[name]

    # ---- the collectives around the step ---------------------------------------------------------------------

    def reduce_scatter(self, summed_parts: Set[str] = frozenset()) -> None:
        """Every accumulator summed over the members, this member keeping piece c of the sum, the rest zeroed; but
        the replicated parameters of ``summed_parts`` ("all", "embedding", "head"), whose pieces the plan's
        replicated reduction left summed already (``ContextParallelPieces.take_summed_parts``)."""
        for flat in self.flats:
            if flat.part is not None and (flat.part in summed_parts or "all" in summed_parts):
                continue
            self._collectives.scatter(flat.grad, flat.grad.numel())

    def all_gather(self) -> None:
        """Every master's pieces (stepped by their members) into every member's whole master."""
        for flat in self.flats:
            self._collectives.gather(flat.master, flat.master.numel())

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def gathered(self, state_for: Callable[[torch.Tensor], Dict[str, torch.Tensor]]) -> List[Entry]:
        """``(global name, whole master view, whole Adam state)`` of every parameter, on every member: each flat
        tensor's moments all-gathered over the members (one collective per flat tensor, in order, every member
        alike), in host memory."""
        entries: List[Entry] = []
        for flat, held, pieces in zip(self.flats, self._held, self._pieces):
            device = flat.master.device
            local = torch.zeros(len(_MOMENTS), held.length, dtype=torch.float32, device=device)
            step = torch.zeros(1, dtype=torch.float64, device=device)
            for piece, master, _grad in pieces:
                state = state_for(master)
                for row, moment in enumerate(_MOMENTS):
                    if moment in state:
                        piece_view(local[row], piece).copy_(state[moment].reshape(-1))
                if "step" in state:
                    step.fill_(float(state["step"]))
            gathered = torch.empty(self.size * local.numel(), dtype=torch.float32, device=device)
            all_gather_into(gathered, local.reshape(-1), group=self.group)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)   # a member without a piece has no step
            rows = gathered.view(self.size, len(_MOMENTS), held.length).transpose(0, 1).reshape(len(_MOMENTS), -1)
            rows = rows[:, :flat.master.numel()].cpu()
            taken = float(step)
            for slot, name, view in zip(flat.slots, flat.names, flat.views):
                # Before the first step taken (fp16 skipping its first steps) Adam has no state to hand over.
                state = ({moment: rows[row, slot.offset:slot.offset + slot.numel].view(slot.shape)
                          for row, moment in enumerate(_MOMENTS)}
                         | {"step": torch.tensor(taken, dtype=torch.float32)}) if taken > 0 else {}
                entries.append((name, view, state))
        return entries

    def load_targets(self, store: Callable[[torch.Tensor, Dict[str, torch.Tensor]], None]
                     ) -> Iterator[Tuple[str, PieceTarget, PieceTarget]]:
        """``(global name, target, target)`` of every parameter: the whole master, this member's pieces' state."""
        for flat, pieces in zip(self.flats, self._pieces):
            for slot, name, view in zip(flat.slots, flat.names, flat.views):
                parts = [(piece, master) for piece, master, _grad in pieces if piece.name == name]
                target = PieceTarget(slot, view, parts, store)
                yield name, target, target
