"""Context parallelism inside the weight pipeline (``--context-parallel-size C`` with tawpipe / weipipe).

A virtual rank is T x C GPUs of one node (megatron-core's order: tensor-parallel rank t fastest, then
context-parallel rank c; global rank ``v * T * C + c * T + t``). The C context-parallel members of a virtual rank
run the same plan actions in the same order, each on its S / C tokens of every micro-batch (the ring attention
exchanges keys and values between them), and each holds the whole (tensor-parallel slice of the) shard's weights
for compute. So that the links carry what they carry with C = 1, member c moves only *piece c* of every weight and
gradient transfer (the flat buffer cut into C pieces of ``ceil(n / C)`` elements, the last one shorter), on the
communicators of its index ``j = c * T + t`` (:class:`runtime.transport.Communicators`):

* weights: once a piece has arrived (a receive, or a broadcast's), the pieces are all-gathered over the
  context-parallel group, so that every member holds the whole buffer again;
* gradients: the invariant is "the true gradient is the sum over the C members of their buffers" (each member's
  backward adds the gradient of its own tokens). Before a gradient leaves (a send, a reduction to its owner, an
  all-reduce over the holders of a replicated shard) it is reduce-scattered over the group into piece c, the other
  pieces zeroed, and piece c travels; a received piece lands in slot c of a zeroed buffer. The replicated
  parameters' gradients (embedding, final norm, output layer) are reduce-scattered over the group alike and piece
  c of each is all-reduced over the virtual ranks.
* before the optimizer step every accumulated gradient (owned shards, and the replicated parameters where the
  plan has not reduced them) is reduce-scattered over the group, each member stepping its piece of every
  master (it keeps 1/C of the Adam moments), and after the step the masters' pieces are all-gathered (:mod:`runtime.member_state`).

Every collective here is synchronous and issued at a *member point* of the action list (a start, or the ``Wait``
of a weight's arrival: :func:`megatron_tawpipe.plan.context_parallel.member_points`, which the executor runs),
identically on every member, so the context-parallel communicator's operations are in the same order on every
member whatever the timing of the plan's own transfers; the per-GPU plan with those points as collectives
(:func:`megatron_tawpipe.plan.context_parallel.lanes`) is what the NCCL model proves.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.plan.context_parallel import MemberPoint, member_points, points_by_step
from megatron_tawpipe.runtime.node_reduce import all_gather_into, reduce_scatter_from


class ContextParallelPieces:
    """Member ``rank`` of a context-parallel group of ``size`` GPUs (``group``): its piece of every transfer and
    the group's collectives."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self._points: Optional[Tuple[list, dict]] = None
        self._summed_parts: set = set()   # replicated parts reduce-scattered since :meth:`take_summed_parts`

    @classmethod
    def of_megatron(cls) -> Optional["ContextParallelPieces"]:
        """From megatron-core's parallel state (initialised with the run's context-parallel size); None for C = 1."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("context parallelism inside the weight pipeline needs megatron-core's parallel state "
                               "(initialize_model_parallel with the run's --context-parallel-size) first")
        size = parallel_state.get_context_parallel_world_size()
        if size == 1:
            return None
        return cls(parallel_state.get_context_parallel_group(), size, parallel_state.get_context_parallel_rank())

    # ---- where the members meet ------------------------------------------------------------

    def points(self, actions, plan_rank: int) -> Dict[Tuple[int, str], List[MemberPoint]]:
        """The member points of plan rank ``plan_rank``'s list ``actions`` an executor runs, by (step, when): all
        but the compute actions' (the ring attention's, inside the compute) and the last (the gradients'
        reduce-scatter before the step and the masters' all-gather after it, from the model:
        :mod:`runtime.member_state`). Computed once per list."""
        if self._points is None or self._points[0] is not actions:
            points = [p for p in member_points(actions, plan_rank, compute=False) if p.op != "sum"]
            self._points = (actions, points_by_step(points))
        return self._points[1]

    def meet(self, point: MemberPoint, buffer: Optional[torch.Tensor], numel: int,
             replicated: Callable[[str], Sequence[torch.Tensor]]) -> None:
        """Run ``point``: an arrived weight's pieces gathered into ``buffer`` (its first ``numel`` elements), a
        leaving gradient in ``buffer`` reduce-scattered into this member's piece, or the replicated gradients
        (``replicated(part)``) reduce-scattered, each tensor into this member's piece of it (the piece its lane
        all-reduces over the virtual ranks, :meth:`piece`), the rest zeroed."""
        if point.op == "gather":
            self.gather(buffer, numel)
        elif point.op == "scatter":
            self.scatter(buffer, numel)
        elif point.op == "replicated":   # each member needs only its piece of the sum: a reduce-scatter
            for grad in replicated(point.action.part):
                if grad.numel():
                    self.scatter(grad.view(-1), grad.numel())
            self._summed_parts.add(point.action.part)
        else:
            raise ValueError(f"member point {point.op!r} is not run by the executor")

    # ---- geometry ------------------------------------------------------------------------

    def piece_length(self, numel: int) -> int:
        return -(-numel // self.size)

    def padded(self, numel: int) -> int:
        """Elements a buffer of ``numel`` needs for the group's collectives (C equal pieces)."""
        return self.size * self.piece_length(numel)

    def bounds(self, numel: int) -> Tuple[int, int]:
        """``[start, end)`` of this member's piece of ``numel`` elements (the last piece may be shorter or empty)."""
        length = self.piece_length(numel)
        start = min(self.rank * length, numel)
        return start, min(start + length, numel)

    def piece(self, flat: torch.Tensor) -> torch.Tensor:
        """This member's piece of the flat ``flat`` (a view: what it sends or receives)."""
        start, end = self.bounds(flat.numel())
        return flat[start:end]

    # ---- weights -------------------------------------------------------------------------

    def gather(self, buffer: torch.Tensor, numel: int) -> None:
        """Every member's piece of the first ``numel`` elements of ``buffer`` into all members' ``buffer``."""
        length = self.piece_length(numel)
        whole, copied = self._room(buffer, numel)
        mine = whole[self.rank * length:(self.rank + 1) * length].clone()
        all_gather_into(whole, mine, group=self.group)
        if copied:
            buffer[:numel].copy_(whole[:numel])

    def _room(self, buffer: torch.Tensor, numel: int) -> Tuple[torch.Tensor, bool]:
        """The first :meth:`padded` elements of ``buffer``, or (``True``) a zero-padded copy of its first ``numel``
        where it is shorter (a master or accumulator sized to its parameters)."""
        need = self.padded(numel)
        if buffer.numel() >= need:
            return buffer[:need], False
        return torch.cat([buffer[:numel], buffer.new_zeros(need - numel)]), True

    # ---- gradients ------------------------------------------------------------------------

    def scatter(self, buffer: torch.Tensor, numel: int) -> None:
        """The members' first ``numel`` elements of ``buffer`` summed; this member keeps piece c of the sum in
        place, every other element zero (the sum over the members is unchanged). A ``buffer`` shorter than
        :meth:`padded` goes through a padded copy."""
        length = self.piece_length(numel)
        whole, copied = self._room(buffer, numel)
        whole[numel:].zero_()
        mine = torch.empty(length, dtype=whole.dtype, device=whole.device)
        reduce_scatter_from(mine, whole, op=dist.ReduceOp.SUM, group=self.group)
        whole.zero_()
        whole[self.rank * length:(self.rank + 1) * length].copy_(mine)
        if copied:
            buffer[:numel].copy_(whole[:numel])

    def take_summed_parts(self) -> set:
        """The replicated parts ("all", "embedding", "head") whose gradients the plan summed over the members since
        the last call (after that point and its all-reduce over the virtual ranks, each member holds the total of
        its piece, the rest zero); the set is emptied."""
        parts, self._summed_parts = self._summed_parts, set()
        return parts

    def total_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss-mask tokens over the members' shares (a copy: no gradient flows through it)."""
        total = num_tokens.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total
