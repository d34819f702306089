"""The weight-pipeline model of one rank: owned shards, replicated parts, per-shard compute.

Each rank owns one shard (device-bound storage): its master weights and
its gradient accumulator stay on the owner; only compute-dtype weight copies
and partial gradients travel, as the plan says. The replicated parts
(embedding, final norm, output layer) live on every rank with their own masters.
Masters and gradients are fp32, or with --use-precision-aware-optimizer
--main-params-dtype / --main-grads-dtype (``optimizer.precision_aware``).

This object is the ``model`` that :func:`megatron_tawpipe.runtime.schedules.forward_backward_tawpipe`
takes, and the ``compute`` side of the plan executor: the executor calls
:meth:`forward` / :meth:`backward` for each (micro-batch, shard) action.

Micro-batches enter through megatron's ``forward_step_func(data_iterator, model)``
contract (:class:`megatron_tawpipe.runtime.microbatches.MicroBatches`); the compute
that runs each action is given to the model (:class:`LayerCompute`, or emulated compute).
"""

from __future__ import annotations

import datetime
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.distributed import parallel_state
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.models.llama import params_dtype
from megatron_tawpipe.optimizer.precision_aware import OptimizerDtypes
from megatron_tawpipe.arguments.run_config import RunConfig, ScheduleConfig
from megatron_tawpipe.plan import (BackwardInput, BackwardWeight, Plan, ReplicatedAllReduceStart, build_plan, read_plan,
                                   validate_plan)
from megatron_tawpipe.data import batch_schedule
from megatron_tawpipe.runtime.context_parallel import ContextParallelPieces
from megatron_tawpipe.runtime.executor import Communicators, PlanExecutor
from megatron_tawpipe.runtime.layer_compute import LayerCompute, ShardCompute
from megatron_tawpipe.runtime.member_state import MemberPieces
from megatron_tawpipe.runtime.microbatches import MicroBatches
from megatron_tawpipe.runtime import tawpipe_cache
from megatron_tawpipe.runtime.shard_model import ParamSlot, ShardTemplate
from megatron_tawpipe.runtime.replicated_slices import ReplicatedSlices, slice_index
from megatron_tawpipe.runtime.shard_slices import Piece, ShardSlice, holder_slice, piece_view
from megatron_tawpipe.runtime.warmup import launch_order_problem
from megatron_tawpipe.sim.layout_choice import TawPipeLayout


def plan_options(schedule: ScheduleConfig, cache: Optional[bool] = None, groups: int = 1) -> dict:
    """The planner's options from the schedule's (settled) layout flags; ``cache``: TawPipe's shard cache as decided
    at start-up (``--tawpipe-cache``, :mod:`megatron_tawpipe.runtime.tawpipe_cache`); None leaves it to the planner.
    ``groups``: the run's scheduling groups."""
    if schedule.pipeline_schedule != "tawpipe":
        return {}
    layout = TawPipeLayout(schedule.ownership(groups), int(schedule.tawpipe_shards_per_rank),
                           bool(schedule.tawpipe_replicate_first_shard), bool(cache),
                           int(schedule.tawpipe_microbatches_per_visit), schedule.tawpipe_replicated_reduce)
    options = layout.plan_options()
    if cache is None:
        options.pop("cache")
    return options


def planned_microbatch_counts(run: RunConfig) -> List[int]:
    """Micro-batches per rank of every global batch the run may take (those that fit the layout;
    the loop refuses, before training, a batch still ahead that does not)."""
    per_rank = run.schedule.micro_batch_size, run.layout.data_parallel_size
    counts = {batch_schedule.micro_batches(batch, *per_rank) for _, batch in run.data.schedule}
    counts.discard(None)
    if not counts:
        raise ValueError("no global batch of --step-batch-size-schedule fits --micro-batch-size x data-parallel size")
    return sorted(counts)


def plans_for_run(run: RunConfig, world: int, groups: int, cache: Optional[bool] = None) -> Dict[int, Plan]:
    """The run's plans by micro-batches per rank: built by the schedule's planner for every count the run's
    global batches give, or the one plan of ``--pipeline-schedule plan:FILE`` (checked against the flags in
    validate_args; here again against the world and the groups, which every rank agrees on)."""
    schedule = run.schedule
    path = schedule.plan_file
    if path is None:
        return {count: build_plan(schedule.plan_name, num_ranks=world, num_groups=groups,
                                  num_layers=run.model.num_layers, num_microbatches=count,
                                  shard_layers=run.layout.decoder_layer_split, **plan_options(schedule, cache, groups))
                for count in planned_microbatch_counts(run)}
    plan = read_plan(path)
    if (plan.num_ranks, plan.num_groups) != (world, groups):
        raise ValueError(f"plan file {path}: planned for {plan.num_ranks} ranks in {plan.num_groups} groups; this run "
                         f"has {world} ranks in {groups} groups")
    return {plan.num_microbatches: plan}


class WeightPipeModel:
    """One rank's weight-pipeline model: the plan, its executor and the compute callbacks."""

    def __init__(self, args, config: RunConfig, compute: Optional[Callable[["WeightPipeModel"], ShardCompute]] = None):
        """``compute(model)`` makes what runs the (micro-batch, shard) forward and backward actions
        (a :class:`ShardCompute`): the real layers (:class:`LayerCompute`, the default) or emulated compute.
        ``config``: the run's records of ``args``."""
        self.args = args
        self.config = config
        # With --tensor-model-parallel-size T and --context-parallel-size C the plan runs over P / (T x C) virtual
        # ranks, one per tensor x context-parallel group (T x C consecutive ranks, megatron-core's layout: tensor
        # parallel fastest): ``rank`` and ``world`` are the plan's, ``index`` = c * T + t this rank's in its group.
        self.tensor_parallel_size = self.config.layout.tensor_model_parallel_size
        self.context_parallel_size = self.config.layout.context_parallel_size
        self.group_size = self.tensor_parallel_size * self.context_parallel_size
        self.index = dist.get_rank() % self.group_size
        self.tensor_parallel_rank = self.index % self.tensor_parallel_size
        self.rank = dist.get_rank() // self.group_size
        self.world = dist.get_world_size() // self.group_size
        # C > 1: this member's piece of every transfer and the group's collectives (None with C = 1)
        self.context_parallel = ContextParallelPieces.of_megatron() if self.context_parallel_size > 1 else None
        self.device = current_device()
        groups = (self.config.layout.tawpipe_num_groups
                  or parallel_state.default_num_groups(dist.get_world_size(), self.config.schedule.pipeline_schedule))
        # One plan per micro-batch count the run's global batches give (one, unless
        # --step-batch-size-schedule): the same shard owners, so a step-up only changes the plan.
        self.plans = self._plans(groups)
        for plan in self.plans.values():   # (with C > 1, its members' collectives too)
            validate_plan(plan, context_parallel=self.context_parallel_size)
        first = batch_schedule.micro_batches(self.config.data.schedule[0][1], self.config.schedule.micro_batch_size,
                                             self.config.layout.data_parallel_size)   # the first batch's
        self.plan = self.plans.get(first) or self.plans[min(self.plans)]
        if any(plan.owners != self.plan.owners or plan.replicas != self.plan.replicas for plan in self.plans.values()):
            raise ValueError("the plans for the schedule's micro-batch counts give shards different owners")
        self.topology = parallel_state.initialize_weight_pipeline(groups, self.plan.owners, self.group_size,
                                                                  self.plan.replicas)
        self.recompute = self.config.schedule.recompute
        if any(plan.shard_layers != self.plan.shard_layers for plan in self.plans.values()):
            raise ValueError("the plans for the schedule's micro-batch counts split the layers differently")
        # Plans with BackwardInput/BackwardWeight: the layers leave their weight-gradient kernels to the weight pass.
        split = any(isinstance(a, (BackwardInput, BackwardWeight))
                    for plan in self.plans.values() for acts in plan.actions for a in acts)
        self.template = ShardTemplate(args, self.plan.shard_layers, self.device, split_backward=split)
        self.shard_numel = self.template.shard_numel   # the largest shard's: the executor's buffers
        self._check_same_layout()
        self.compute_dtype = params_dtype(args)
        # masters' and gradients' dtypes: fp32, or --main-params-dtype / --main-grads-dtype
        self.dtypes = OptimizerDtypes.of(self.config.precision)
        self.grad_dtype = self.dtypes.main_grads   # the executor's gradient buffers too: they travel in it
        # Every shard whose master this rank keeps and steps (owned or replicated, --tawpipe-replicate-first-shard);
        # ``counted`` are the ones it counts in the global norm and writes to checkpoints (owned).
        self.owned = self.topology.held_shards()
        # The spread layout (--tawpipe-ownership spread): every holder of a shard keeps one slice of it, and counts
        # and writes (gathered) its slice; otherwise the owner counts and writes a shard its replicas also hold.
        self.slices: Dict[int, ShardSlice] = {}
        if self.plan.spread:
            self.slices = {shard: holder_slice(self.plan, shard, self.rank, self.template.numel_of(shard))
                           for shard in self.owned}
        self.counted = list(self.owned) if self.slices else self.topology.owned_shards()
        length = {s: self.slices[s].length if s in self.slices else self.template.numel_of(s) for s in self.owned}
        self._masters = {s: torch.zeros(length[s], dtype=self.dtypes.main_params, device=self.device)
                         for s in self.owned}
        self._main_grads = {s: torch.zeros(length[s], dtype=self.grad_dtype, device=self.device)
                            for s in self.owned}
        for shard, flat in self._masters.items():
            if flat.dtype == torch.float32 and shard not in self.slices:
                self.template.init_shard(shard, flat)
            else:   # initialised whole in fp32 (partition-independent values), then rounded and/or sliced
                whole = torch.empty(self.template.numel_of(shard), dtype=torch.float32, device=self.device)
                self.template.init_shard(shard, whole)
                piece = self.slices.get(shard)
                start, valid = (piece.start, piece.valid) if piece else (0, whole.numel())
                flat[:valid].copy_(whole[start:start + valid])
        # each parameter piece's master and gradient views, made once (the optimizer keys its state by them)
        self._pieces: Dict[int, List[Tuple[Piece, torch.Tensor, torch.Tensor]]] = {
            s: [(p, piece_view(self._masters[s], p), piece_view(self._main_grads[s], p))
                for p in held.pieces(self.template.slots_of(s), lambda slot, s=s: self.template.global_name(s, slot))]
            for s, held in self.slices.items()}
        self._build_replicated_masters()
        # C > 1: the members divide the Adam state, each stepping its piece of every master (runtime.member_state)
        self.member_pieces = MemberPieces.of_model(self) if self.context_parallel is not None else None
        self._replica_names = {self.template.global_name(shard, slot) for shard in self.owned
                               if shard not in self.counted for slot in self.template.slots_of(shard)}
        self.loss_scale_func: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        if dist.get_backend() == "nccl":
            refusal = launch_order_problem(list(self.plans.values()), os.environ)
            if refusal:
                raise ValueError(refusal)
        self.communicators = Communicators(list(self.plans.values()), self.world, self.group_size, self.index)
        self._create_megatron_communicators()
        self.executor = self._executor(self.plan)
        self.compute: ShardCompute = (compute or LayerCompute)(self)
        self._reset(None, None, 1, forward_only=True)

    def _plans(self, groups: int) -> Dict[int, Plan]:
        """The run's plans; tawpipe's with the shard cache decided once at start-up (``--tawpipe-cache``: every
        rank alike), the decision printed by the first rank."""
        run = self.config
        if run.schedule.pipeline_schedule != "tawpipe":
            return plans_for_run(run, self.world, groups)
        self.cache_decision, plans = tawpipe_cache.decide(
            run, groups, lambda cache: plans_for_run(run, self.world, groups, cache), self.device)
        if dist.get_rank() == 0 and getattr(self.args, "tawpipe_layout", None) is None:
            print(self.cache_decision.line(), flush=True)   # a run's layout line says it already
        return plans

    def _check_same_layout(self) -> None:
        """Every rank lays a shard's weights out alike (same elements, names and shapes), or the plan's
        transfers would not match: refused on every rank alike, before any plan runs."""
        mine = self.template.layout_fingerprint()
        both = torch.tensor(mine + [-x for x in mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if [int(x) for x in both[:3]] != [-int(x) for x in both[3:]]:
            raise ValueError(f"the ranks build shards of different layouts (this rank: {mine[0]} elements, {mine[1]} "
                             "per layer): every node needs the same layer implementation (--transformer-impl, "
                             "Transformer Engine or Apex installed alike)")

    def _create_megatron_communicators(self) -> None:
        """On NCCL with tensor parallelism: megatron-core's tensor- and data-parallel communicators are
        created here, before any plan runs, by one small all-reduce each in the same order on every
        rank. Otherwise the first tensor-parallel collective (inside the first forward) would create
        its communicator lazily, blocking while the plan's transfers are in flight."""
        if self.group_size == 1 or dist.get_backend() != "nccl":
            return
        from megatron.core import parallel_state as megatron_state

        probe = torch.zeros(1, device=self.device)
        groups = [megatron_state.get_tensor_model_parallel_group(), megatron_state.get_data_parallel_group()]
        if self.context_parallel is not None:   # its pieces' collectives, the reports' and the norm's reductions
            groups += [self.context_parallel.group, megatron_state.get_data_parallel_group(with_context_parallel=True)]
        for group in groups:
            dist.all_reduce(probe, group=group)

    def _executor(self, plan, transport=None) -> PlanExecutor:
        """An executor for ``plan`` with every connection of the plan made (every rank builds it at the
        same point: start-up, or the iteration where all switch plans)."""
        executor = PlanExecutor(plan, self.rank, self, self.communicators,
                                timeout=datetime.timedelta(minutes=self.config.training.distributed_timeout_minutes),
                                nccl_faithful=self.config.schedule.tawpipe_nccl_faithful, transport=transport)
        executor.connect()
        executor.memory_probe = getattr(self, "memory_probe", None)   # --record-plan-memory
        return executor

    def use_plan_for(self, num_microbatches: int) -> None:
        """Switch to the plan for ``num_microbatches`` per rank (every rank switches at the same
        iteration); the process groups and the transport stay, the buffers follow the plan."""
        if num_microbatches == self.plan.num_microbatches:
            return
        if num_microbatches not in self.plans:
            raise ValueError(f"no plan for {num_microbatches} micro-batches per rank (planned: "
                             f"{sorted(self.plans)})")
        transport = self.executor.transport
        self.template.unbind()
        self.executor = None   # the old buffers go before the new ones are allocated
        self.plan = self.plans[num_microbatches]
        self.executor = self._executor(self.plan, transport)

    def _build_replicated_masters(self) -> None:
        self.replicated = self.template.replicated_parameters()
        self.replicated_masters: List[torch.Tensor] = []
        self._replicated_grads: List[torch.Tensor] = []
        # --tawpipe-replicated-reduce sharded: their masters and Adam state in slices, one per rank
        self.replicated_slices: Optional[ReplicatedSlices] = None
        scatter = next((a for a in self.plan.actions[self.rank]
                        if type(a) is ReplicatedAllReduceStart and a.mode == "scatter"), None)
        if scatter is not None:
            if self.context_parallel is not None:
                raise ValueError("--tawpipe-replicated-reduce sharded does not run with --context-parallel-size > 1 "
                                 "yet: use hierarchical or flat")
            self.replicated_slices = ReplicatedSlices(self.replicated, scatter.ranks, self.rank, scatter.node_size,
                                                      self.dtypes.main_params, self.grad_dtype, self.device)
            accumulators = self.replicated_slices.accumulators()
            self._replicated_grads = [accumulators[name] for name, _ in self.replicated]
            self._replicated_pieces = self.replicated_slices.pieces()
            self._replicated_scatter = scatter
            return
        for _, param in self.replicated:
            dtype = self.dtypes.main_params
            master = param.data if param.dtype == dtype else param.detach().to(dtype).clone()
            grad = torch.zeros_like(master, dtype=self.grad_dtype)
            if grad.dtype == master.dtype:
                master.grad = grad
            self._replicated_grads.append(grad)
            for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel"):
                if hasattr(param, attribute):   # (``param.data`` is a new tensor without them)
                    setattr(master, attribute, getattr(param, attribute))
            self.replicated_masters.append(master)

    # ---- parameters ---------------------------------------------------------------------

    def named_masters(self) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(global name, master, gradient)`` for every parameter this rank updates (of a shard kept in slices,
        the flat piece of each parameter its slice covers: :meth:`parameter_shape` gives the parameter's shape;
        with context parallelism the pieces this member steps)."""
        if self.member_pieces is not None:
            return self.member_pieces.named()
        out = []
        for shard in self.owned:
            if shard in self.slices:
                out.extend((piece.name, master, grad) for piece, master, grad in self._pieces[shard])
                continue
            views = self.template.tagged_views(self._masters[shard])
            grads = self.template.views(self._main_grads[shard])
            for slot, view, grad in zip(self.template.slots_of(shard), views, grads):
                out.append((self.template.global_name(shard, slot), view, grad))
        return out + self.replicated_named_masters()

    def replicated_named_masters(self) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(global name, master, gradient)`` of the replicated parts this rank steps: each parameter whole, or
        with their optimizer sharded the pieces this rank's slices cover."""
        if self.replicated_slices is not None:
            return [(piece.name, master, grad) for piece, _param, master, grad in self._replicated_pieces]
        return [(name, master, grad) for (name, _), master, grad in
                zip(self.replicated, self.replicated_masters, self._replicated_grads)]

    def parameter_shape(self, name: str, master: torch.Tensor) -> Tuple[int, ...]:
        """The shape of the parameter ``master`` (a piece of, under the spread layout or a sharded replicated
        optimizer, or of a context-parallel member's) belongs to."""
        if self.member_pieces is not None:
            return self.member_pieces.shape_of(name)
        for pieces in self._pieces.values():
            for piece, _master, _grad in pieces:
                if piece.name == name:
                    return piece.slot.shape
        if self.replicated_slices is not None:
            for piece, param, _master, _grad in self._replicated_pieces:
                if piece.name == name:
                    return tuple(param.shape)
        return tuple(master.shape)

    def slice_pieces(self, shard: int) -> List[Tuple[Piece, torch.Tensor]]:
        """``(piece, master view)`` of every parameter this rank's slice of ``shard`` covers (spread layout)."""
        return [(piece, master) for piece, master, _grad in self._pieces[shard]]

    def shard_grads(self) -> List[torch.Tensor]:
        return list(self._main_grads.values())

    def _owned_grad_slots(self, shards: Optional[List[int]] = None) -> Iterator[Tuple[ParamSlot, torch.Tensor]]:
        """``(slot, gradient view)`` of every parameter of ``shards`` (default: every shard held)."""
        for shard in self.owned if shards is None else shards:
            if shard in self.slices:
                yield from ((piece.slot, grad) for piece, _master, grad in self._pieces[shard])
            else:
                yield from zip(self.template.slots_of(shard), self.template.views(self._main_grads[shard]))

    def is_replica(self, name: str) -> bool:
        """Whether ``name`` is a decoder parameter of a shard this rank holds as a replica (its owner
        writes it to checkpoints and counts it in the global norm)."""
        return name in self._replica_names

    def norm_grads(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The gradients this rank counts in the global norm: (owned shards', replicated parts').
        Owned shards' are summed over all ranks, replicated parts' over the tensor-parallel group
        (they are the same on every virtual rank). A tensor that tensor parallelism does not
        split is counted on tensor-parallel rank 0 only (megatron-core's rule). With context parallelism every
        member counts its pieces (the rest of its accumulators is zero after :meth:`reduce_partial_grads`): the
        replicated parts' are then summed over the context-parallel group too."""
        counted = self.counted
        first = self.tensor_parallel_rank == 0
        # a sharded replicated optimizer's slices: summed over all ranks, as the owned shards
        sliced = [] if self.replicated_slices is None else [
            grad for _piece, param, _master, grad in self._replicated_pieces
            if first or getattr(param, "tensor_model_parallel", False)]
        if self.tensor_parallel_size == 1:
            return ([self._main_grads[s] for s in counted] + sliced,
                    [] if self.replicated_slices is not None else self.replicated_grads())
        shards = [view for slot, view in self._owned_grad_slots(counted) if first or slot.partition_dim >= 0]
        if self.replicated_slices is not None:
            return shards + sliced, []
        replicated = [grad for master, grad in zip(self.replicated_masters, self._replicated_grads)
                      if first or getattr(master, "tensor_model_parallel", False)]
        return shards, replicated

    def reduce_partial_grads(self) -> None:
        """All-reduce over the tensor-parallel group the gradients that are partial sums there
        (sequence-parallel norms and biases, query/key norms; see ShardTemplate.gradient_is_partial),
        in one coalesced all-reduce. Nothing to do without tensor parallelism. With context
        parallelism, first every gradient (owned shards, and the replicated parts the plan has not
        reduced already) is reduce-scattered over the context-parallel group: each member held its
        tokens' share, and steps its piece of the sum."""
        if self.member_pieces is not None:
            self.member_pieces.reduce_scatter(self.context_parallel.take_summed_parts())
        if self.tensor_parallel_size == 1:
            return
        from megatron.core import parallel_state as megatron_state

        partial = [view for slot, view in self._owned_grad_slots() if slot.tp_reduce]
        if self.replicated_slices is not None:   # the slices are laid out alike on every tensor-parallel rank
            partial += [grad for piece, param, _master, grad in self._replicated_pieces
                        if self.template.gradient_is_partial(piece.name, param)]
        else:
            partial += [grad for (name, param), grad in zip(self.replicated, self._replicated_grads)
                        if self.template.gradient_is_partial(name, param)]
        if not partial:
            return
        flat = torch.cat([g.reshape(-1) for g in partial])
        dist.all_reduce(flat, group=megatron_state.get_tensor_model_parallel_group())
        offset = 0
        for grad in partial:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def zero_grads(self) -> None:
        for grad in self.shard_grads() + self.replicated_grads():
            grad.zero_()
        if self.replicated_slices is not None:
            for grad in self.replicated_slices.all_grads():
                grad.zero_()

    def replicated_group(self) -> Tuple[object, int, List[int]]:
        """A sharded replicated optimizer's process group over every (virtual) rank of this tensor-parallel index,
        its size, and the slice each of its members holds, in member order."""
        a = self._replicated_scatter
        group = self.communicators.groups[("replicated", a.ranks)]
        return group, len(a.ranks), [slice_index(a.ranks, r, a.node_size) for r in a.ranks]

    def stepped_replicated_grads(self) -> List[torch.Tensor]:
        """The replicated gradients the optimizer steps: the accumulators, or with their optimizer sharded the
        reduced slices (unscaled, checked and clipped with the shards')."""
        if self.replicated_slices is not None:
            return self.replicated_slices.slice_grads()
        return self.replicated_grads()

    def gather_member_masters(self) -> None:
        """After a step with context parallelism: every member's stepped pieces into every member's masters."""
        if self.member_pieces is not None:
            self.member_pieces.all_gather()

    def copy_replicated_masters_to_model(self) -> None:
        """The replicated parameters follow their masters (a sharded optimizer's: at the plan's all-gather)."""
        if self.replicated_slices is not None:
            return
        with torch.no_grad():
            for (_, param), master in zip(self.replicated, self.replicated_masters):
                if param.data_ptr() != master.data_ptr():
                    param.copy_(master)

    def train(self, mode: bool = True) -> None:
        self.template.train(mode)

    def eval(self) -> None:
        self.template.train(False)

    # ---- one iteration ------------------------------------------------------------------

    def run(self, forward_step_func, data_iterator: Iterator, num_microbatches: int,
            forward_only: bool) -> List[object]:
        """Execute this rank's plan; returns the loss_func reports, one per local micro-batch."""
        if num_microbatches != self.plan.num_microbatches and num_microbatches in self.plans:
            self.use_plan_for(num_microbatches)
        if num_microbatches != self.plan.num_microbatches:
            raise ValueError(f"the plan was built for {self.plan.num_microbatches} micro-batches per rank, "
                             f"got num_microbatches={num_microbatches}")
        self._reset(forward_step_func, data_iterator, num_microbatches, forward_only)
        self.executor.run(self.plan.actions[self.rank], forward_only=forward_only)
        return self.microbatches.ordered_reports()

    def _reset(self, forward_step_func, data_iterator, num_microbatches: int, forward_only: bool) -> None:
        self.microbatches = MicroBatches(forward_step_func, data_iterator, num_microbatches, forward_only,
                                         self.context_parallel.total_tokens if self.context_parallel else None)
        self.compute.reset()
        self.executor.reset_counters()

    # ---- executor callbacks ---------------------------------------------------------

    def master(self, shard: int) -> torch.Tensor:
        return self._masters[shard]

    def main_grad(self, shard: int) -> torch.Tensor:
        return self._main_grads[shard]

    def replicated_grads(self, part: str = "all") -> List[torch.Tensor]:
        """Gradients of the replicated parameters (``grad_dtype``); ``part`` as in the plan's
        ``ReplicatedAllReduceStart``: "embedding" (what shard 0's backward writes,
        a tied output layer included), "head" (the rest: final norm, untied output
        layer) or "all"."""
        return [grad for (name, _), grad in zip(self.replicated, self._replicated_grads)
                if part == "all" or (name.startswith("embedding.") == (part == "embedding"))]

    def optimizer_step(self) -> None:
        """The plan's last action: every gradient has reached its owner. The step itself
        is the caller's (megatron convention: forward_backward_func does not step)."""

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        self.compute.forward(mb, shard, weights)

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        self.compute.backward(mb, shard, weights, grad_buffer)

    def backward_input(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        self.compute.backward_input(mb, shard, weights)

    def backward_weight(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        self.compute.backward_weight(mb, shard, weights, grad_buffer)

    def close(self) -> None:
        self.executor.close()
        parallel_state.destroy_weight_pipeline()
