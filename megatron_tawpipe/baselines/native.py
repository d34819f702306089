"""Native megatron-core training: no pipelining, 1F1B, interleaved 1F1B.

Everything here is megatron-core, reused as is: the model chunks are
wrapped in megatron's ``DistributedDataParallel``, the optimizer comes from
``get_megatron_optimizer``, and one iteration is megatron's
``get_forward_backward_func(pp_size, vp_size)`` (called as the installed release
expects, see :mod:`megatron_tawpipe.runtime.schedules`) followed by ``optimizer.step()``.
"""

from __future__ import annotations

import itertools
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_tawpipe.compat import patches
from megatron_tawpipe.monitor import progress
from megatron_tawpipe.baselines.sharded_state import (SliceTarget, distributed_optimizer_target,
                                                      gather_distributed_optimizer)
from megatron_tawpipe.common.checkpointable import CheckpointDefaults
from megatron_tawpipe.common.step import StepResult
from megatron_tawpipe.emulation.compute import EmulatedCompute
from megatron_tawpipe.arguments import virtual_pipeline_size
from megatron_tawpipe.arguments.run_config import OptimizerSettings, PrecisionConfig, RunConfig
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.models.llama import build_llama_model, llama_config
from megatron_tawpipe.optimizer.precision_aware import OptimizerDtypes
from megatron_tawpipe.models.parameters import global_parameter_names, global_shape, tensor_parallel_slice, unwrap_model
from megatron_tawpipe.common.errors import PeerFailure, first_line
from megatron_tawpipe.distributed.megatron_schedules import megatron_forward_backward_func


def report_pipeline_waits():
    """Make megatron's pipeline transfers visible on the progress board (the registered patch
    ``pipeline-transfer-waits``, :mod:`megatron_tawpipe.compat.patches`); the result's ``undo()`` ends it.

    megatron-core waits on its stage-to-stage transfers without a bound; with
    each transfer marked as a wait, the board's watchdog can tell a rank stuck
    waiting for a peer from the peer that stalled, and name the latter.
    Users at the same time share one application.
    """
    return patches.apply("pipeline-transfer-waits", wrap={f"{patches.P2P}._communicate": _reporting_waits})


def _reporting_waits(original):
    """megatron's ``P2PCommunicator._communicate`` as a wait on the progress board; a failed transfer raises
    :class:`PeerFailure` naming rank, iteration and peers."""
    def communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, **kwargs):
        parts = [f"{verb} rank {peer}" for verb, peer, active in (
            ("send to", self.next_rank, tensor_send_next is not None),
            ("send to", self.prev_rank, tensor_send_prev is not None),
            ("receive from", self.prev_rank, recv_prev),
            ("receive from", self.next_rank, recv_next)) if active]
        what = "pipeline transfer (" + ", ".join(parts) + ")"
        board = progress.board()
        with board.waiting(what):
            try:
                return original(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                recv_prev=recv_prev, recv_next=recv_next, **kwargs)
            except RuntimeError as exc:  # the transport saw a peer go (connection closed or reset)
                raise PeerFailure(f"rank {dist.get_rank()}, iteration {board.iteration}, {what} failed: "
                                  f"{first_line(exc)}") from exc

    return communicate


def optimizer_config(adam: OptimizerSettings, precision: PrecisionConfig) -> OptimizerConfig:
    """megatron-core's optimizer config of the run's optimizer and precision records."""
    return OptimizerConfig(
        optimizer="adam",
        lr=adam.lr,
        min_lr=adam.min_lr,
        weight_decay=adam.weight_decay,
        adam_beta1=adam.adam_beta1,
        adam_beta2=adam.adam_beta2,
        adam_eps=adam.adam_eps,
        clip_grad=adam.clip_grad,
        bf16=precision.bf16,
        fp16=precision.fp16,
        params_dtype=torch.bfloat16 if precision.bf16 else (torch.float16 if precision.fp16 else torch.float32),
        loss_scale=adam.loss_scale,
        initial_loss_scale=adam.initial_loss_scale,
        use_distributed_optimizer=adam.use_distributed_optimizer,
        decoupled_lr=adam.decoupled_lr,
        decoupled_min_lr=adam.decoupled_min_lr,
        hysteresis=adam.hysteresis,
        loss_scale_window=adam.loss_scale_window,
        min_loss_scale=adam.min_loss_scale,
        **precision_aware_fields(precision),
    )


def precision_aware_fields(precision: PrecisionConfig) -> dict:
    """megatron-core's precision-aware optimizer fields from Megatron-LM's flags (validate_args has refused
    them where Transformer Engine's FusedAdam or the distributed optimizer is missing)."""
    if not precision.use_precision_aware_optimizer:
        return {}
    dtypes = OptimizerDtypes.of(precision)
    return {"use_precision_aware_optimizer": True, "main_grads_dtype": dtypes.main_grads,
            "main_params_dtype": dtypes.main_params, "exp_avg_dtype": dtypes.exp_avg,
            "exp_avg_sq_dtype": dtypes.exp_avg_sq}


def grad_reduce_in_fp32(adam: OptimizerSettings, precision: PrecisionConfig) -> bool:
    """Megatron-LM's rule: fp32 gradient buffers with --accumulate-allreduce-grads-in-fp32, which
    --bf16 turns on unless --grad-reduce-in-bf16 or --main-grads-dtype bf16 (fp32 training has fp32
    gradients anyway)."""
    if precision.bf16 and not adam.grad_reduce_in_bf16 and OptimizerDtypes.of(precision).main_grads == torch.float32:
        return True
    return bool(adam.accumulate_allreduce_grads_in_fp32) or not (precision.bf16 or precision.fp16)


def ddp_config(adam: OptimizerSettings, precision: PrecisionConfig, interleaved: bool) -> DistributedDataParallelConfig:
    """megatron's DDP as Megatron-LM configures it from the same flags.

    Gradients accumulate and are reduced in fp32 (Megatron-LM's default for bf16 and the only
    choice in fp32); with ``--overlap-grad-reduce`` each bucket (``--ddp-bucket-size``, default
    megatron's 40M parameters, at least 1M per data-parallel rank) is reduced while backward goes on.
    """
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32(adam, precision),
        overlap_grad_reduce=adam.overlap_grad_reduce,
        overlap_param_gather=adam.overlap_param_gather,
        use_distributed_optimizer=adam.use_distributed_optimizer,
        num_distributed_optimizer_instances=adam.num_distributed_optimizer_instances,
        bucket_size=adam.ddp_bucket_size,
        # Megatron-LM's --no-align-param-gather: interleaved chunks (``interleaved``) gather together unless given.
        align_param_gather=interleaved and adam.align_param_gather,
        check_for_nan_in_grad=adam.check_for_nan_in_loss_and_grad and not precision.fp16)


class NativeTrainer(CheckpointDefaults):
    """Model chunks, optimizer and one-iteration step for megatron's own schedules."""

    def __init__(self, args, forward_step_func, run: RunConfig):
        """``run``: the records of ``args`` (``training.build_trainer`` reads them when not given)."""
        self.args = args
        self.run = run
        self.forward_step_func = forward_step_func   # megatron's (data_iterator, model) -> (output, loss_func)
        self.emulation = EmulatedCompute.from_args(args, recompute=run.training.recompute_granularity == "full")
        vpp = virtual_pipeline_size(args)
        layout = run.layout
        # megatron's DDP gives every parameter an fp32 ``main_grad``: fused wgrad accumulation fits.
        self.config = llama_config(args, layout.pipeline_model_parallel_size, vpp, main_grad_buffers=True,
                                   tensor_model_parallel_size=layout.tensor_model_parallel_size,
                                   sequence_parallel=layout.sequence_parallel)
        self.model = self._build_model_chunks(vpp)
        self.optimizer = get_megatron_optimizer(optimizer_config(run.optimizer, run.precision), self.model)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        if len(self.model) > 1:
            self.config.no_sync_func = [chunk.no_sync for chunk in self.model]
        else:
            self.config.no_sync_func = self.model[0].no_sync
        if run.optimizer.overlap_grad_reduce and run.optimizer.align_grad_reduce:  # --no-align-grad-reduce
            sync = [chunk.start_grad_sync for chunk in self.model]
            self.config.grad_sync_func = sync if len(sync) > 1 else sync[0]
        # --no-align-param-gather
        if run.optimizer.overlap_param_gather and self.model[0].ddp_config.align_param_gather:
            gather = [chunk.start_param_sync for chunk in self.model]
            self.config.param_sync_func = gather if len(gather) > 1 else gather[0]
        self.forward_backward = megatron_forward_backward_func(layout.pipeline_model_parallel_size, vpp)
        self._pipeline_waits = report_pipeline_waits()   # undone by close()

    def _build_model_chunks(self, vpp: Optional[int]) -> List[DistributedDataParallel]:
        config = ddp_config(self.run.optimizer, self.run.precision, interleaved=vpp is not None)
        chunks = []
        for vp_stage in range(vpp or 1):
            stage = vp_stage if vpp else None
            model = build_llama_model(
                self.args,
                self.config,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                compute=self.emulation,
            )
            if self.run.precision.bf16 or self.run.precision.fp16:
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(self.config, model)
            chunks.append(DistributedDataParallel(self.config, config, model))
        return chunks

    @property
    def num_data_iterators(self) -> int:
        return len(self.model)

    def set_train(self, training: bool) -> None:
        for chunk in self.model:
            chunk.train(training)

    def train_step(self, data_iterators: List[Iterator], num_microbatches: int) -> StepResult:
        """One iteration: forward/backward over all micro-batches, then the optimizer step."""
        if self.emulation is not None:
            self.emulation.start_step()
        self.set_train(True)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._forward_backward(data_iterators, num_microbatches, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        loss_sum, tokens = self._reduce_reports(reports)
        return StepResult(
            loss_sum=loss_sum,
            num_tokens=tokens,
            grad_norm=None if grad_norm is None else float(grad_norm),
            skipped=not update_successful,
            loss_scale=float(self.optimizer.get_loss_scale()) if self.run.precision.bf16 or self.run.precision.fp16
            else None,
            slept_s=self.emulation.take_slept_s() if self.emulation is not None else None,
        )

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator], num_microbatches: int) -> Tuple[float, float]:
        self.set_train(False)
        reports = self._forward_backward(data_iterators, num_microbatches, forward_only=True)
        return self._reduce_reports(reports)

    def _forward_backward(self, data_iterators: List[Iterator], num_microbatches: int, forward_only: bool):
        iterators = data_iterators if len(self.model) > 1 else data_iterators[0]
        board = progress.board()
        forwards = itertools.count()

        def forward_step(data_iterator, model):
            board.at(f"native schedule, forward number {next(forwards)} of this step")
            return self.forward_step_func(data_iterator, model)

        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=num_microbatches,
            seq_length=self.run.model.seq_length,
            micro_batch_size=self.run.schedule.micro_batch_size,
            forward_only=forward_only,
        )

    def _reduce_reports(self, reports) -> Tuple[float, float]:
        """Sum ``[loss_sum, tokens]`` over micro-batches, data- and context-parallel ranks; share it with every rank.

        Only the last pipeline stage computes losses; a MAX over the pipeline
        group hands its totals to the other stages (the rest contribute zeros).
        """
        totals = torch.zeros(2, dtype=torch.float64, device=current_device())
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for report in reports:
                totals += report["lm loss"].to(totals)
            # the data-parallel ranks and, with context parallelism, the ranks holding the other parts of each sequence
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
        return float(totals[0]), float(totals[1])

    # ---- checkpoint support: schedule-independent per-parameter state --------------------

    def named_master_parameters(self) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(global name, model param, fp32 master param)`` for every parameter on this rank.

        With the distributed optimizer the master is a :class:`SliceTarget` for this rank's range.
        """
        sharded = self.run.optimizer.use_distributed_optimizer
        for chunk in self.model:
            for name, param in global_parameter_names(chunk):
                if sharded:
                    yield name, param, distributed_optimizer_target(self._chained_single(), param)
                else:
                    yield name, param, getattr(param, "main_param", param)

    def megatron_model_chunks(self) -> List[torch.nn.Module]:
        """The unwrapped model chunks, once the last step's parameter gather is finished."""
        self._finish_param_gather()
        return [unwrap_model(chunk) for chunk in self.model]

    def megatron_optimizer(self):
        return self.optimizer

    def _finish_param_gather(self) -> None:
        if self.run.optimizer.use_distributed_optimizer and self.run.optimizer.overlap_param_gather:
            # The last step's parameter all-gather waits for the next forward: finish it now, so that the
            # saved weights are the updated ones (as Megatron-LM does before saving).
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
                chunk.enable_forward_pre_hook()

    def checkpoint_shape(self, name: str, param: torch.Tensor) -> Tuple[int, ...]:
        """The whole parameter's shape in a checkpoint (a tensor-parallel rank holds a slice)."""
        return global_shape(param)

    def checkpoint_slice(self, name: str, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel slice of a whole parameter (or of its optimizer state) read from a checkpoint."""
        return tensor_parallel_slice(name, whole, param, self.config)

    def gathered_masters(self):
        """Distributed optimizer: whole masters and Adam state, gathered over the optimizer's data-parallel
        group (every rank calls this); None when masters are whole on every rank already."""
        if not self.run.optimizer.use_distributed_optimizer:
            return None
        instances = self.run.optimizer.num_distributed_optimizer_instances
        group = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=instances > 1)
        named = [pair for chunk in self.model for pair in global_parameter_names(chunk)]
        return gather_distributed_optimizer(self._chained_single(), named, group, keep=self.writes_checkpoint())

    def optimizer_state_for(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        optimizer = self._torch_optimizer()
        state = dict(optimizer.state.get(master, {}))
        group = self._group_of(master)
        if "step" not in state and group is not None and group.get("step"):
            # Transformer Engine's and Apex's fused Adam keep the step in the parameter group.
            state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
        return state

    def set_optimizer_state(self, master, state: Dict[str, torch.Tensor]) -> None:
        if isinstance(master, SliceTarget):
            master.store_state(state)
            return
        group = self._group_of(master)
        if group is not None and "step" in group and "step" in state:
            group["step"] = int(float(state["step"]))
        self._torch_optimizer().state[master] = state

    def _group_of(self, master: torch.Tensor):
        for group in self._torch_optimizer().param_groups:
            if any(param is master for param in group["params"]):
                return group
        return None

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return self._chained_single().optimizer

    def writes_checkpoint(self) -> bool:
        """One data-parallel replica writes the parameters it holds (context-parallel ranks hold the same ones)."""
        return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0

    def skip_in_checkpoint(self, name: str) -> bool:
        return False

    def grad_scaler_state(self) -> Optional[dict]:
        scaler = getattr(self._chained_single(), "grad_scaler", None)
        return scaler.state_dict() if scaler is not None else None

    def load_grad_scaler_state(self, state: Optional[dict]) -> None:
        scaler = getattr(self._chained_single(), "grad_scaler", None)
        if scaler is not None and state is not None:
            scaler.load_state_dict(state)

    def _chained_single(self):
        optimizer = self.optimizer
        if hasattr(optimizer, "chained_optimizers"):
            (optimizer,) = optimizer.chained_optimizers
        return optimizer

    def after_parameters_loaded(self) -> None:
        """Float16 optimizers keep fp32 masters: copy loaded masters to the model params."""
        optimizer = self._chained_single()
        if hasattr(optimizer, "_copy_main_params_to_model_params"):
            optimizer._copy_main_params_to_model_params()

    def param_groups(self):
        return self.optimizer.param_groups

    def close(self) -> None:
        self._pipeline_waits.undo()
