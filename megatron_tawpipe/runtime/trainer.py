"""Weight-passing training: optimizer, loss scaling, clipping and one iteration.

The model side (owned shards, replicated parts, the plan and its executor) is
:class:`runtime.weight_pipe_model.WeightPipeModel`; an iteration is
``forward_backward_{weipipe,tawpipe}`` (megatron's calling convention, with the
same ``forward_step_func`` the native schedules use) followed by the optimizer
step on the rank's own shard and the replicated parts.

Normalisation is Megatron's: every micro-batch contributes its mean token
loss divided by ``N * P`` (micro-batches per rank x data-parallel ranks), so
the summed gradient equals data-parallel training's averaged one.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.run_config import RunConfig
from megatron_tawpipe.common.atomic import atomic_write_json
from megatron_tawpipe.common.checkpointable import CheckpointDefaults
from megatron_tawpipe.common.step import StepResult
from megatron_tawpipe.emulation.compute import EmulatedCompute
from megatron_tawpipe.monitor.metrics import held_memory_bytes, max_over_ranks, mean_over_ranks
from megatron_tawpipe.models.parameters import global_shape, is_gated_fc1, tensor_parallel_slice
from megatron_tawpipe.optimizer.clip import clip_gradients_, squared_l2_norm
from megatron_tawpipe.optimizer.param_groups import megatron_param_groups
from megatron_tawpipe.optimizer.precision_aware import PrecisionAwareAdamW
from megatron_tawpipe.plan.timeline import StepPhase
from megatron_tawpipe.plan.traffic import link_bytes
from megatron_tawpipe.common.errors import NonFiniteGradientError
from megatron_tawpipe.runtime.precision import GradScaling, find_non_finite
from megatron_tawpipe.runtime.schedules import get_forward_backward_func
from megatron_tawpipe.runtime.shard_slices import SliceTarget
from megatron_tawpipe.runtime.spread_checkpoint import gather_spread_shards, spread_load_targets
from megatron_tawpipe.runtime.weight_pipe_model import WeightPipeModel


def adamw_kernel_options(params: Sequence[torch.Tensor]) -> Dict[str, bool]:
    """torch AdamW's implementation: fused where every parameter is a CUDA fp32 tensor.

    The fused kernel updates all parameters of a device and dtype in a few launches; the
    weight-passing masters are fp32 by construction. Otherwise foreach on CUDA, and torch's
    default on CPU (as before).
    """
    if params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
        return {"fused": True}
    return {"foreach": True} if any(p.is_cuda for p in params) else {}


def single_connection_warning(environ: Mapping[str, str], device_type: str, pipeline_schedule: str) -> Optional[str]:
    """The warning for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` under a weight-passing schedule on CUDA, or None.

    With one hardware queue, the weight and gradient transfers that the plan overlaps with the
    next shard's compute queue behind it instead. (megatron's environments set it so that its
    asynchronous tensor-parallel communication is scheduled ahead of the compute it overlaps: a
    matter of speed, not correctness, and the template's layers run without that overlap's fused
    gradient accumulation; with --tensor-model-parallel-size inside weight passing the plan's
    overlap is the larger gain.)
    """
    if device_type != "cuda" or environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
        return None
    return (f"warning: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream on one hardware queue, so "
            f"--pipeline-schedule {pipeline_schedule} cannot overlap weight/gradient transfers with "
            "compute; unset it (or set it to 8 or more) for this schedule")


class _ParamGroupsView:
    """What megatron's OptimizerParamScheduler needs from an optimizer: ``param_groups``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


class WeightPassingTrainer(CheckpointDefaults):
    """One rank of a ``weipipe`` / ``tawpipe`` run."""

    def __init__(self, args, forward_step_func, run: RunConfig):
        """``run``: the records of ``args`` (``training.build_trainer`` reads them when not given)."""
        self.args = args
        self.config = run
        self.forward_step_func = forward_step_func   # megatron's (data_iterator, model) -> (output, loss_func)
        self.emulation = EmulatedCompute.from_args(args, recompute=self.config.schedule.recompute)
        self.model = WeightPipeModel(args, self.config,
                                     compute=self.emulation.shard_compute if self.emulation else None)
        # Global rank and size (the plan's virtual ranks are the model's: model.rank, model.world).
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), self.model.device
        self.scaling = GradScaling.of(self.config.optimizer, self.config.precision, self.device)
        self.model.loss_scale_func = self.scaling.scale
        self.forward_backward = get_forward_backward_func(self.config.schedule.pipeline_schedule)
        self._build_optimizer()
        self._planned_bytes: Dict[int, Dict[str, float]] = {}
        self._marks: Optional[List[Tuple[str, Optional[float]]]] = None   # --timeline-file: the step's phases
        self._step_left: Optional[float] = None
        self._warn_about_single_connection()

    @property
    def plan(self):
        """The plan of this iteration's micro-batch count (--step-batch-size-schedule may change it)."""
        return self.model.plan

    def _warn_about_single_connection(self) -> None:
        message = single_connection_warning(os.environ, self.device.type, self.config.schedule.pipeline_schedule)
        if message and self.rank == 0:
            print(message, file=sys.stderr, flush=True)

    def _build_optimizer(self) -> None:
        """AdamW over the owned shards' master views and the replicated masters: torch's over fp32 masters and
        gradients, or with --use-precision-aware-optimizer :class:`PrecisionAwareAdamW` (gradients given as
        ``decoupled_grad``, moments stored in --exp-avg-dtype / --exp-avg-sq-dtype)."""
        a, dtypes = self.args, self.model.dtypes
        precision_aware = self.config.precision.use_precision_aware_optimizer
        self._named_masters = []
        for name, master, grad in self.model.named_masters():
            if precision_aware:
                master.decoupled_grad = grad
            elif master.grad is None:
                master.grad = grad
            self._named_masters.append((name, master))
        groups = megatron_param_groups(self._named_masters, a, shape_of=self.model.parameter_shape)
        options = dict(lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, weight_decay=a.weight_decay)
        if precision_aware:
            self._adamw = PrecisionAwareAdamW(groups, exp_avg_dtype=dtypes.exp_avg,
                                              exp_avg_sq_dtype=dtypes.exp_avg_sq, **options)
        else:
            self._adamw = torch.optim.AdamW(groups, **options,
                                            **adamw_kernel_options([master for _, master in self._named_masters]))
        self.optimizer = _ParamGroupsView(self._adamw)

    # ---- iteration ----------------------------------------------------------------------

    @property
    def num_data_iterators(self) -> int:
        return 1

    def train_step(self, data_iterators: List[Iterator], num_microbatches: int) -> StepResult:
        # --timeline-file: (phase, host time at its end) of this step, for tools/tawpipe_lab/idle_breakdown.py
        # (the first: where the previous step's timeline was written, None on the first step)
        self._marks = [(StepPhase.PREVIOUS_STEP, self._step_left), (StepPhase.BETWEEN_STEPS, time.time())] \
            if self.config.logging.timeline_file else None
        if self.emulation is not None:
            self.emulation.start_step()
        self.model.train()
        self.model.zero_grads()
        if self.config.logging.timeline_file:
            self.model.executor.start_trace()
        self._mark(StepPhase.SET_UP)
        record_memory = self.config.logging.record_plan_memory
        if record_memory:
            # on the model, so that an executor built for another plan (a batch-size ramp) samples too
            self.model.memory_probe = self.model.executor.memory_probe = held_memory_bytes
            self.model.executor.memory_peak = None
            held_before = held_memory_bytes()
            store = self.model.template.wgrad_store   # a split backward's store: its peak in this step
            if store is not None:
                store.peak_bytes = 0
        start = time.perf_counter()
        reports = self._forward_backward(data_iterators, num_microbatches, forward_only=False)
        plan_s = time.perf_counter() - start
        self._mark(StepPhase.PLAN)
        slept_in_plan = self.emulation.slept_s if self.emulation is not None else None
        memory = {}
        if record_memory:
            # the most the plan's compute held beyond what the rank held when it started (activations, held
            # gradients, logits), the largest over ranks; every rank joins the reduction (-1: nothing sampled)
            peak = self.model.executor.memory_peak
            growth = max_over_ranks(peak - held_before if peak is not None and held_before is not None else -1)
            if growth >= 0:
                memory["plan_memory_growth_bytes_max_rank"] = int(growth)
            # of it, the most the weight-gradient store held (stored linear inputs and output gradients between
            # a split backward's two passes), the largest over ranks (-1: no rank has a store)
            store_peak = max_over_ranks(store.peak_bytes if store is not None else -1)
            if store_peak >= 0:
                memory["plan_wgrad_store_peak_bytes_max_rank"] = int(store_peak)
        busy = self.model.executor.compute_seconds / max(plan_s, 1e-9)
        self._mark(StepPhase.BUSY_FRACTION)
        step_start = time.perf_counter()
        grad_norm, skipped = self._optimizer_step()
        step_s = time.perf_counter() - step_start
        busy, plan_s, step_s = mean_over_ranks([busy, plan_s, step_s])
        loss_sum, tokens = self._reduce_reports(reports)
        sent = self._reduce_bytes()
        planned = self._planned_bytes.get(self.plan.num_microbatches) or self._planned_bytes.setdefault(
            self.plan.num_microbatches, self.planned_link_bytes())
        self._mark(StepPhase.METRICS)
        if self.config.logging.timeline_file:   # after the step: gathering the timeline holds up nothing it shows
            self._write_timeline(slept_in_plan)
            self._step_left = time.time()
        return StepResult(loss_sum=loss_sum, num_tokens=tokens, grad_norm=grad_norm, skipped=skipped,
                          loss_scale=self.scaling.loss_scale(),
                          slept_s=self.emulation.take_slept_s() if self.emulation is not None else None,
                          extra={"inter_group_bytes": sent["inter"], "intra_group_bytes": sent["intra"],
                                 "planned_inter_group_bytes": planned["inter"],
                                 "planned_intra_group_bytes": planned["intra"],
                                 "compute_busy_fraction": busy,
                                 # where an iteration's time goes (means over ranks): the plan, then the
                                 # norm, clipping and optimizer step
                                 "plan_seconds": plan_s, "optimizer_seconds": step_s, **memory})

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator], num_microbatches: int) -> Tuple[float, float]:
        self.model.eval()
        return self._reduce_reports(self._forward_backward(data_iterators, num_microbatches, forward_only=True))

    def _forward_backward(self, data_iterators: List[Iterator], num_microbatches: int, forward_only: bool) -> list:
        return self.forward_backward(
            forward_step_func=self.forward_step_func, data_iterator=data_iterators[0], model=self.model,
            num_microbatches=num_microbatches, seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.schedule.micro_batch_size, forward_only=forward_only)

    def _mark(self, phase: StepPhase) -> None:
        """--timeline-file: ``phase`` ended now."""
        if self._marks is not None:
            self._marks.append((phase, time.time()))

    def _optimizer_step(self) -> Tuple[Optional[float], bool]:
        self.model.reduce_partial_grads()
        self._mark(StepPhase.PARTIAL_GRADIENTS)
        grads = self.model.shard_grads() + self.model.stepped_replicated_grads()
        if self.scaling.unscale_and_check(grads):
            return None, True
        self._mark(StepPhase.UNSCALE)
        grad_norm = self._global_norm()
        self._mark(StepPhase.NORM_ALL_REDUCE)
        checked = self.config.optimizer.check_for_nan_in_loss_and_grad and not self.config.precision.fp16
        if not math.isfinite(grad_norm) and checked:
            # The norm's all-reduce is the check (a NaN/Inf anywhere makes it non-finite on every
            # rank); only then does every rank look for the shards to name.
            self._check_finite()
            raise NonFiniteGradientError(f"the global gradient norm is {grad_norm} (finite gradients whose "
                                         "squares overflow)")
        self._clip_gradients(grad_norm)
        self._mark(StepPhase.CLIP)
        self._adamw.step()
        self._mark(StepPhase.OPTIMIZER)
        self.model.gather_member_masters()   # (context parallelism; timed with the replicated masters' copy)
        self.model.copy_replicated_masters_to_model()
        self._mark(StepPhase.REPLICATED_MASTERS)
        return grad_norm, False

    def _write_timeline(self, slept_in_plan: Optional[float] = None) -> None:
        """Gather every rank's trace of this iteration; the first rank writes them (atomically)."""
        executor = self.model.executor
        trace = dict(executor.trace, marks=self._marks, slept_in_plan=slept_in_plan)
        traces = [None] * self.world if self.rank == 0 else None
        dist.gather_object(trace, traces, dst=0)
        executor.trace = None
        if self.rank != 0:
            return
        # The ranks of one virtual rank run the same actions: the first one's trace shows them.
        traces = traces[::self.model.group_size]
        plan = self.plan
        doc = {"schedule": plan.schedule, "num_ranks": plan.num_ranks, "num_groups": plan.num_groups,
               "num_layers": plan.num_layers, "num_microbatches": plan.num_microbatches,
               "max_weight_buffers": plan.max_weight_buffers, "max_grad_buffers": plan.max_grad_buffers,
               "spans": [s for t in traces for s in t["spans"]],
               "transfers": [x for t in traces for x in t["transfers"]],
               # per rank: every action's host times, the step's phases, emulated compute slept in the plan
               "ranks": [{key: t[key] for key in ("rank", "actions", "marks", "slept_in_plan")} for t in traces]}
        atomic_write_json(self.config.logging.timeline_file, doc)

    def _check_finite(self) -> None:
        """Every rank checks what it holds; one all-reduced flag per shard makes all ranks agree."""
        groups = [[self.model.main_grad(s)] if s in self.model.owned else [] for s in range(self.plan.num_shards)]
        groups.append(self.model.stepped_replicated_grads())
        bad = find_non_finite(groups, self.device)
        if not bad:
            return
        size = self.model.group_size
        what = "a tensor-parallel group" if self.model.context_parallel_size == 1 else "a tensor x context-parallel group"
        owner = (lambda v: f"owner rank {v}") if size == 1 else (
            lambda v: f"owner ranks {v * size}-{v * size + size - 1}, {what}")
        layers = self.plan.layers_of_shard
        names = [f"shard {s} (layers {layers(s)[0]}-{layers(s)[-1]}, {owner(self.plan.owners[s])})"
                 if s < self.plan.num_shards else "the replicated embedding / final norm / output layer"
                 for s in bad]
        raise NonFiniteGradientError(", ".join(names))

    def _reduce_reports(self, reports) -> Tuple[float, float]:
        """Sum the ``[loss_sum, tokens]`` reports over micro-batches and data-parallel (virtual) ranks
        (the tensor-parallel ranks of one virtual rank report the same micro-batches; its context-parallel
        ranks each their share of every sequence)."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for report in reports:
            totals += report["lm loss"].to(totals)
        dist.all_reduce(totals, group=self._data_parallel_group())
        return float(totals[0]), float(totals[1])

    def _reduce_bytes(self) -> Dict[str, int]:
        """Bytes all ranks sent this iteration, per link class (as the executor counted them)."""
        sent = self.model.executor.bytes_sent
        counts = torch.tensor([sent["intra"], sent["inter"]], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return {"intra": int(counts[0]), "inter": int(counts[1])}

    def _data_parallel_group(self):
        if self.model.tensor_parallel_size == 1:
            return None   # the default group
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=self.model.context_parallel_size > 1)

    def planned_link_bytes(self) -> Dict[str, float]:
        """Bytes per link class per iteration that the plan prescribes, with this run's buffer dtypes
        (each of the T tensor-parallel indices runs the plan on its 1/T of every shard)."""
        weight_bytes = self.model.shard_numel * torch.finfo(self.model.compute_dtype).bits // 8
        grad_bytes = self.model.shard_numel * torch.finfo(self.model.grad_dtype).bits // 8
        planned = link_bytes(self.plan, weight_bytes, bytes_per_grad=grad_bytes)
        return {link: value * self.model.tensor_parallel_size for link, value in planned.items()}

    def _global_norm(self) -> float:
        """L2 norm of all gradients: owned shards (summed over ranks) and the replicated parts (the
        same on every virtual rank; summed over the tensor-parallel group when it splits them, and over the
        context-parallel group, whose members hold pieces of them)."""
        shards, replicated = self.model.norm_grads()
        squared = squared_l2_norm(shards, self.device)
        self._mark(StepPhase.NORM_LOCAL)
        dist.all_reduce(squared)
        others = squared_l2_norm(replicated, self.device)
        if self.model.tensor_parallel_size > 1:
            from megatron.core import parallel_state

            dist.all_reduce(others, group=parallel_state.get_tensor_model_parallel_group())
        if self.model.member_pieces is not None:
            dist.all_reduce(others, group=self.model.member_pieces.group)
        return float((squared + others).sqrt())

    def _clip_gradients(self, norm: float) -> None:
        """Megatron's global-norm clipping: scale every gradient by clip / (norm + 1e-6) when below 1."""
        clip_gradients_(self.model.shard_grads() + self.model.stepped_replicated_grads(), self.config.optimizer.clip_grad,
                        norm)

    # ---- checkpoint support ---------------------------------------------------------

    def named_master_parameters(self):
        """``(global name, master, master)``; a parameter this rank holds a piece of (spread layout) comes as a
        stand-in that keeps its piece of the whole tensor a checkpoint gives; a replicated one whose optimizer is
        sharded as ``(name, parameter, stand-in)``: the parameter takes the whole tensor, the stand-in its piece."""
        model = self.model
        if model.member_pieces is not None:   # context parallelism: the whole masters, the pieces' Adam state
            yield from model.member_pieces.load_targets(self.set_optimizer_state)
            return
        replicated = len(model.replicated_named_masters())
        decoder = self._named_masters[:len(self._named_masters) - replicated]
        if not model.slices:
            for name, tensor in decoder:
                yield name, tensor, tensor
        else:
            yield from spread_load_targets(model, self.set_optimizer_state)
        if model.replicated_slices is None:
            for name, master in self._named_masters[len(decoder):]:
                yield name, master, master
            return
        for name, param in model.replicated:
            yield name, param, model.replicated_slices.load_target(name, self.device, self.set_optimizer_state)

    def gathered_masters(self):
        """Spread layout: each shard's slices gathered (collective over its holders), whole on its owner, which
        writes it; a sharded replicated optimizer: the replicated parts' slices gathered (collective over the
        ranks), whole on every rank; context parallelism: the Adam moments' pieces gathered over the members, whole
        on every member. None (nothing gathered) for the other layouts."""
        model = self.model
        if model.member_pieces is not None:
            return model.member_pieces.gathered(self.optimizer_state_for)
        if not model.slices and model.replicated_slices is None:
            return None
        replicated = len(model.replicated_named_masters())
        if model.slices:
            entries = gather_spread_shards(model, self.optimizer_state_for)
        else:
            entries = [(name, master, self.optimizer_state_for(master))
                       for name, master in self._named_masters[:len(self._named_masters) - replicated]]
        if model.replicated_slices is None:
            return entries + [(name, master, self.optimizer_state_for(master))
                              for name, master in self._named_masters[len(self._named_masters) - replicated:]]
        group, members, order = model.replicated_group()   # written by virtual rank 0 (skip_in_checkpoint)
        return entries + model.replicated_slices.gather(self.optimizer_state_for, group, members, order,
                                                        writer=model.rank == 0)

    def optimizer_state_for(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self._adamw.state.get(master, {})

    def optimized_masters(self) -> List[torch.Tensor]:
        """The very tensors the optimizer steps (its state is keyed by them; the model makes new views on
        every :meth:`named_masters` call)."""
        return [master for _, master in self._named_masters]

    def set_optimizer_state(self, master, state: Dict[str, torch.Tensor]) -> None:
        if isinstance(master, SliceTarget):   # the spread layout's stand-in: its pieces' states
            master.store_state(state)
            return
        self._adamw.state[master] = {key: self._place_state(key, value, master) for key, value in state.items()}

    def _place_state(self, key: str, value: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """Where torch's own ``load_state_dict`` puts a loaded state tensor: moments beside the
        parameter; the step count on the host, or beside the parameter as fp32 for the fused kernel."""
        if isinstance(self._adamw, PrecisionAwareAdamW):
            return self._adamw.place_state(key, value, master)
        defaults = self._adamw.defaults
        if key == "step" and not (defaults.get("fused") or defaults.get("capturable")):
            return value
        if key == "step":
            return value.to(device=master.device, dtype=torch.float32)
        return value.to(device=master.device, dtype=master.dtype)

    def writes_checkpoint(self) -> bool:
        return True

    def checkpoint_shape(self, name: str, param: torch.Tensor) -> Tuple[int, ...]:
        """The whole parameter's shape in a checkpoint (a tensor-parallel rank holds a slice)."""
        return global_shape(param)

    def checkpoint_slice(self, name: str, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel slice of a whole parameter (or of its Adam state) read from a checkpoint."""
        return tensor_parallel_slice(name, whole, param, self.model.template.full_config)

    def checkpoint_fragments(self, name: str, master: torch.Tensor) -> Optional[List[Tuple[int, int, int]]]:
        """Where this rank's tensor-parallel slice lies in the whole tensor, as ``(axis, index, count)``
        pieces (megatron-core's layout: rows of column-parallel and vocabulary-parallel weights,
        columns of row-parallel ones; a SwiGLU ``linear_fc1`` slice is two pieces, its gate rows and
        its up rows); None for a whole tensor. Checkpoints are written and read as these pieces:
        no rank gathers or reads a whole tensor."""
        tp = self.model.tensor_parallel_size
        if tp == 1 or not getattr(master, "tensor_model_parallel", False):
            return None
        j = self.model.tensor_parallel_rank
        if is_gated_fc1(name, self.model.template.full_config):
            return [(0, j, 2 * tp), (0, tp + j, 2 * tp)]
        return [(master.partition_dim, j, tp)]

    def checkpoint_replica(self, name: str, master: Optional[torch.Tensor]) -> int:
        """0 where this rank's copy is the one written: its own slice, or, for what tensor parallelism
        does not split (norms, biases of row-parallel layers, extra state), the group's first rank's; with
        context parallelism, context-parallel rank 0's (its members hold the same)."""
        model = self.model
        if master is not None and getattr(master, "tensor_model_parallel", False):
            return model.index // model.tensor_parallel_size
        return model.index

    def checkpoint_layer_module(self):
        """A decoder layer built from the run's layer spec (its extra state goes into torch_dist checkpoints)."""
        return self.model.template.layers[0]

    def skip_in_checkpoint(self, name: str) -> bool:
        """Replicated parts are identical on every (virtual) rank: the first (tensor-parallel group) writes
        them; a shard held by several ranks is written by its owner."""
        if name.startswith("decoder.layers."):
            return self.model.is_replica(name)   # its owner writes a replicated shard (--tawpipe-replicate-first-shard)
        return self.model.rank != 0

    def grad_scaler_state(self):
        return self.scaling.state_dict()

    def load_grad_scaler_state(self, state) -> None:
        self.scaling.load_state_dict(state)

    def after_parameters_loaded(self) -> None:
        self.model.copy_replicated_masters_to_model()

    def close(self) -> None:
        self.model.close()
