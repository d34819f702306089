"""The replicated parts' optimizer sharded over the ranks (``--tawpipe-replicated-reduce sharded``).

The embedding, final norm and output layer are computed with on every rank; here their fp32 master and Adam
moments are kept in slices, one per rank, as megatron's distributed optimizer keeps every parameter's. Each
part the plan reduces on its own ("embedding": what shard 0's backward writes; "head": the rest) is laid out
flat, its parameters one after another, zero-padded to P equal slices of ``c = ceil(n / P)`` elements:

* its gradients accumulate (over the micro-batches, in the gradient dtype) into the whole flat buffer, whose
  views the parameters' accumulators are; at the iteration's end the plan reduce-scatters it (through the nodes
  where it runs so), this rank keeping the sum of its slice;
* the optimizer steps the slice, seen as the pieces of the parameters it covers (each under the parameter's
  name, so that weight decay and learning-rate groups are the parameter's);
* at the next iteration's start the plan all-gathers every rank's stepped slice, in the compute dtype, into the
  flat weight buffer whose views the model's parameters are.

Which slice a rank holds follows the collective: rank position i of the plan's ranks; through nodes of G
ranks (``node_size``), node n = i // G and member j = i % G hold slice j D + n (D nodes: the reduce-scatter
inside the node leaves member j chunk j, the one over the j-th members leaves node n its n-th piece).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_tawpipe.runtime.shard_slices import (ADAM_MOMENTS as _MOMENTS, Piece, ShardSlice, SliceTarget,
                                                   parameter_slot as _slot, piece_view, slice_length)

PARTS = ("embedding", "head")


def part_of(name: str) -> str:
    """The part of the plan's replicated reductions a replicated parameter belongs to."""
    return "embedding" if name.startswith("embedding.") else "head"


def slice_index(ranks: Sequence[int], rank: int, node_size: int) -> int:
    """The slice ``rank`` holds after the replicated reduce-scatter over ``ranks`` (module text)."""
    i = list(ranks).index(rank)
    if node_size <= 1:
        return i
    return (i % node_size) * (len(ranks) // node_size) + i // node_size


@dataclass
class _Part:
    names: List[str]
    params: List[torch.nn.Parameter]
    offsets: List[int]
    numel: int
    length: int
    index: int
    grads: torch.Tensor        # whole, padded: the accumulators' storage (gradient dtype)
    weights: torch.Tensor      # whole, padded: the parameters' storage (compute dtype)
    master: torch.Tensor       # this rank's slice (master dtype)
    grad: torch.Tensor         # the sum of this rank's slice after the reduce-scatter (gradient dtype)
    mine: torch.Tensor         # the slice in the compute dtype, the all-gather's input

    @property
    def start(self) -> int:
        return self.index * self.length


class ReplicatedSlices:
    """One rank's slices of the replicated parts (module text). ``replicated``: the model's ``(name, param)``
    pairs (their current values are the initial weights, the slices' masters are taken from them); ``ranks`` and
    ``node_size``: the plan's replicated reduce-scatter's."""

    def __init__(self, replicated: Sequence[Tuple[str, torch.nn.Parameter]], ranks: Sequence[int], rank: int,
                 node_size: int, master_dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device):
        members = len(ranks)
        self.index = slice_index(ranks, rank, node_size)
        self.parts: Dict[str, _Part] = {}
        for part in PARTS:
            chosen = [(name, param) for name, param in replicated if part_of(name) == part]
            if not chosen:
                continue
            offsets, total = [], 0
            for _, param in chosen:
                offsets.append(total)
                total += param.numel()
            length = slice_length(total, members)
            dtype = chosen[0][1].dtype
            weights = torch.zeros(length * members, dtype=dtype, device=device)
            grads = torch.zeros(length * members, dtype=grad_dtype, device=device)
            start = self.index * length
            valid = max(0, min(length, total - start))
            master = torch.zeros(length, dtype=master_dtype, device=device)
            with torch.no_grad():
                for (_, param), offset in zip(chosen, offsets):
                    weights[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
                    param.data = weights[offset:offset + param.numel()].view(param.shape)
                whole = torch.cat([param.detach().reshape(-1).float() for _, param in chosen])
                master[:valid].copy_(whole[start:start + valid])
            self.parts[part] = _Part([n for n, _ in chosen], [p for _, p in chosen], offsets, total, length,
                                     self.index, grads, weights, master,
                                     torch.zeros(length, dtype=grad_dtype, device=device),
                                     torch.empty(length, dtype=dtype, device=device))
        self._pieces = {part: self._make_pieces(p) for part, p in self.parts.items()}

    # ---- layout ---------------------------------------------------------------------------------------------

    def accumulators(self) -> Dict[str, torch.Tensor]:
        """Each replicated parameter's gradient accumulator (a view of its part's whole flat buffer)."""
        out = {}
        for p in self.parts.values():
            for name, param, offset in zip(p.names, p.params, p.offsets):
                out[name] = p.grads[offset:offset + param.numel()].view(param.shape)
        return out

    @staticmethod
    def _make_pieces(p: _Part) -> List[Tuple[Piece, torch.nn.Parameter, torch.Tensor, torch.Tensor]]:
        members = len(p.weights) // p.length
        held = ShardSlice(-1, p.numel, members, p.index, ())
        slots = [_slot(name, param, offset) for name, param, offset in zip(p.names, p.params, p.offsets)]
        params = dict(zip(p.names, p.params))
        return [(piece, params[piece.name], piece_view(p.master, piece), piece_view(p.grad, piece))
                for piece in held.pieces(slots, lambda slot: slot.name)]

    def pieces(self) -> List[Tuple[Piece, torch.nn.Parameter, torch.Tensor, torch.Tensor]]:
        """``(piece, parameter, master view, gradient view)`` of every parameter this rank's slices cover."""
        return [entry for part in PARTS for entry in self._pieces.get(part, ())]

    def slice_grads(self) -> List[torch.Tensor]:
        """The reduced gradients of this rank's slices (what its optimizer steps)."""
        return [p.grad for p in self.parts.values()]

    def all_grads(self) -> List[torch.Tensor]:
        return [p.grads for p in self.parts.values()] + self.slice_grads()

    # ---- the plan's collectives ---------------------------------------------------------------------------

    def scatter_tensors(self, part: str) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(output slice, whole input)`` of the gradients' reduce-scatter of ``part`` ("all": both)."""
        return [(p.grad, p.grads) for name, p in self.parts.items() if part in ("all", name)]

    def gather_tensors(self, part: str) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(whole output, input slice)`` of the weights' all-gather of ``part``; the input is cast from the
        slice's master now."""
        out = []
        for name, p in self.parts.items():
            if part in ("all", name):
                p.mine.copy_(p.master)
                out.append((p.weights, p.mine))
        return out

    def tensors(self, mode: str, part: str) -> List[torch.Tensor]:
        """The plan's collective ``mode`` ("scatter" or "gather") of ``part``: its ``[output, input, ...]`` pairs."""
        pairs = self.scatter_tensors(part) if mode == "scatter" else self.gather_tensors(part)
        return [t for pair in pairs for t in pair]

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def load_target(self, name: str, device: torch.device, store) -> SliceTarget:
        """A stand-in for parameter ``name`` that keeps the piece of a loaded whole tensor this rank's slice covers
        (its master and, through ``store``, its Adam state)."""
        parts = [(piece, master) for piece, _param, master, _grad in self.pieces() if piece.name == name]
        param = next(param for p in self.parts.values() for n, param in zip(p.names, p.params) if n == name)
        return SliceTarget(_slot(name, param), device, parts, store)

    def gather(self, state_for, group, members: int, order: Sequence[int], writer: bool
               ) -> List[Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]]:
        """Every replicated parameter whole, ``(name, fp32 master, Adam state)`` in host memory, on the group's first
        member (``writer``; the others get ``[]``), gathered from the ranks' slices one part at a time (a collective
        over ``group``, every rank alike; ``order[i]``: the slice member i of the group holds). ``state_for(master
        view)``: a piece's Adam state."""
        import torch.distributed as dist

        rows = 1 + len(_MOMENTS)
        entries = []
        for part, p in self.parts.items():
            device = p.master.device
            local = torch.zeros(rows, p.length, dtype=torch.float32, device=device)
            local[0].copy_(p.master)
            step = torch.zeros(1, dtype=torch.float64, device=device)
            for piece, _param, master, _grad in self._pieces[part]:
                state = state_for(master)
                for row, moment in enumerate(_MOMENTS, start=1):
                    if moment in state:
                        local[row, piece.slice_start:piece.slice_start + piece.numel].copy_(state[moment].reshape(-1))
                if "step" in state:
                    step.fill_(float(state["step"]))
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)   # a rank without a piece has no step
            pieces = [torch.empty_like(local) for _ in range(members)] if writer else None
            dist.gather(local, pieces, dst=dist.get_global_rank(group, 0), group=group)
            if not writer:
                continue
            by_slice = [None] * members
            for member, k in enumerate(order):
                by_slice[k] = pieces[member]
            whole = torch.cat(by_slice, dim=1).cpu()   # rows x (members x length), in slice order
            del pieces, by_slice
            taken = float(step)
            for name, param, offset in zip(p.names, p.params, p.offsets):
                values = [whole[row, offset:offset + param.numel()].view(param.shape) for row in range(rows)]
                for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    if hasattr(param, attribute):   # where a tensor-parallel slice lies in the whole tensor
                        setattr(values[0], attribute, getattr(param, attribute))
                state = ({moment: values[row] for row, moment in enumerate(_MOMENTS, start=1)}
                         | {"step": torch.tensor(taken, dtype=torch.float32)}) if taken > 0 else {}
                entries.append((name, values[0], state))
        return entries
