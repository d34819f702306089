"""The pre-training loop on megatron-core parts.

``pretrain(args, forward_step_func)`` is what ``pretrain_llama.py`` runs on every rank: it sets
up process groups, tokenizer, datasets, the trainer of the chosen
``--pipeline-schedule``, the LR schedule and checkpoints, then iterates. It
returns the per-iteration records so that tests can call it in-process.
"""

from __future__ import annotations

import functools
import math
import signal
import time
from typing import List, Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_tawpipe.compat import cpu as cpu_compat
from megatron_tawpipe.monitor import exits
from megatron_tawpipe.monitor import progress
from megatron_tawpipe.arguments import is_weight_passing
from megatron_tawpipe.arguments.run_config import RunConfig
from megatron_tawpipe.checkpoint import close_async_saves, finalize_async_saves, load_checkpoint, save_checkpoint
from megatron_tawpipe.data import build_data_iterator, build_datasets, build_tokenizer, close_data_iterators
from megatron_tawpipe.distributed.initialize import initialize_distributed, initialize_model_parallel
from megatron_tawpipe.monitor.metrics import (IterationRecord, MetricsWriter, held_memory_bytes, max_over_ranks,
                                              mean_over_ranks, peak_memory_bytes)
from megatron_tawpipe.monitor.tensorboard_log import TensorboardLog
from megatron_tawpipe.training.summary import print_closing_summary
from megatron_tawpipe.monitor.log_level import set_logging_level
from megatron_tawpipe.monitor.progress_log import ProgressLog
from megatron_tawpipe.data import batch_schedule
from megatron_tawpipe.common.checkpointable import ReferenceFactory
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.training.tawpipe_layout import settle_tawpipe_layout
from megatron_tawpipe.training.tawpipe_layout_args import layout_record
from megatron_tawpipe.common.errors import NonFiniteGradientError, PeerFailure, TrainingError, first_line


def build_trainer(args, forward_step_func, run: Optional[RunConfig] = None):
    """The trainer of ``--pipeline-schedule`` (FSDP2 with ``--use-torch-fsdp2``, Megatron-FSDP with
    ``--use-megatron-fsdp``), running ``forward_step_func``; ``run``: the run's records (read off ``args``
    when not given)."""
    if run is None:
        settle_tawpipe_layout(args, dist.get_world_size(), current_device())   # once: settled flags stay
        run = RunConfig.from_args(args, world_size=dist.get_world_size())
    if run.schedule.weight_passing:
        from megatron_tawpipe.runtime.trainer import WeightPassingTrainer

        return WeightPassingTrainer(args, forward_step_func, run)
    if run.layout.use_torch_fsdp2:
        from megatron_tawpipe.baselines.fsdp import FsdpTrainer

        return FsdpTrainer(args, forward_step_func, run)
    if run.layout.use_megatron_fsdp:
        from megatron_tawpipe.baselines.megatron_fsdp import MegatronFsdpTrainer

        return MegatronFsdpTrainer(args, forward_step_func, run)
    from megatron_tawpipe.baselines.native import NativeTrainer

    return NativeTrainer(args, forward_step_func, run)


def legacy_reference_factory(args, forward_step_func) -> Optional[ReferenceFactory]:
    """A weight-passing run's builder (collective, on demand) of megatron-core's own model and non-distributed
    optimizer at tensor/pipeline size 1, through which ``--ckpt-format torch`` writes and reads its optimizer
    state; None for the other trainers (their own megatron-core objects do, or nothing does)."""
    if not is_weight_passing(args.pipeline_schedule):
        return None
    from megatron_tawpipe.baselines.native_reference import native_reference_trainer

    return functools.partial(native_reference_trainer, args, forward_step_func)


def build_scheduler(run: RunConfig, optimizer) -> OptimizerParamScheduler:
    """Megatron's LR / weight-decay schedule in samples (as Megatron-LM counts it), stepped by the
    global batch after every applied optimizer step; the spans come from validate_args."""
    lrs, adam = run.training.lr_schedule, run.optimizer
    wsd = lrs.lr_decay_style == "WSD"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lrs.lr_warmup_init,
        max_lr=adam.lr,
        min_lr=adam.min_lr,
        lr_warmup_steps=lrs.lr_warmup_steps,
        lr_decay_steps=lrs.lr_decay_steps,
        lr_decay_style=lrs.lr_decay_style,
        start_wd=lrs.start_weight_decay,
        end_wd=lrs.end_weight_decay,
        wd_incr_steps=lrs.wd_incr_steps,
        wd_incr_style=lrs.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=lrs.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=lrs.override_opt_param_scheduler,
        wsd_decay_steps=lrs.wsd_decay_steps if wsd else None,
        lr_wsd_decay_style=lrs.lr_wsd_decay_style if wsd else None,
    )


def data_parallel_rank_and_size(run: RunConfig):
    if run.schedule.weight_passing:   # one data stream per virtual rank
        group = run.layout.tensor_model_parallel_size * run.layout.context_parallel_size
        return dist.get_rank() // group, dist.get_world_size() // group
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def _data_iterators(dataset, run: RunConfig, count: int, consumed_samples: int, num_workers: int = 0):
    dp_rank, dp_size = data_parallel_rank_and_size(run)
    # Slurm signals every process of the job: data-loader workers must leave --exit-signal to the rank.
    ignore = getattr(signal, run.training.exit_signal) if run.training.exit_signal_handler else None
    return [build_data_iterator(dataset, run.schedule.micro_batch_size, dp_rank, dp_size, consumed_samples,
                                dataloader_type=run.data.dataloader_type,
                                num_workers=num_workers, ignore_signal=ignore)
            for _ in range(count)]


def evaluate(trainer, dataset, run: RunConfig, num_microbatches: int) -> Optional[float]:
    """Mean validation loss over ``--eval-iters`` global batches of ``num_microbatches`` micro-batches per
    rank, always from the start of the split."""
    if dataset is None or run.training.eval_iters <= 0:
        return None
    iterators = _data_iterators(dataset, run, trainer.num_data_iterators, 0)
    loss_sum = tokens = 0.0
    board = progress.board()
    try:
        for _ in range(run.training.eval_iters):
            with board.step(board.iteration, "evaluation step"):
                step_sum, step_tokens = trainer.eval_step(iterators, num_microbatches)
            loss_sum += step_sum
            tokens += step_tokens
    finally:
        close_data_iterators(iterators)
    return loss_sum / max(tokens, 1.0)


def _is_writer() -> bool:
    # The last rank sits on the last pipeline stage, where native schedules compute the loss.
    return dist.get_rank() == dist.get_world_size() - 1


def _current_lr(scheduler: OptimizerParamScheduler) -> float:
    return float(scheduler.optimizer.param_groups[0]["lr"])


def pretrain(args, forward_step_func, trainer_factory=None) -> List[IterationRecord]:
    """Train with megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)`` (this project's
    is :func:`megatron_tawpipe.training.forward_step.gpt_forward_step`); ``trainer_factory(args, forward_step_func,
    run)`` (``run``: the run's :class:`RunConfig`) replaces the schedule's trainer (tests use it to substitute
    their own)."""
    factory = trainer_factory or build_trainer
    with cpu_compat.explain_cuda_errors():
        return _pretrain(args, lambda run_args, run: factory(run_args, forward_step_func, run),
                         legacy_reference_factory(args, forward_step_func))


def _pretrain(args, trainer_factory, legacy_reference: Optional[ReferenceFactory]) -> List[IterationRecord]:
    initialize_distributed(args)
    initialize_model_parallel(args)
    progress.start_board(args.distributed_timeout_minutes * 60.0)
    try:
        return _train(args, trainer_factory, legacy_reference)
    except BaseException as exc:
        board = progress.board()
        if not _is_peer_failure(exc):
            board.finish("failed", f"{type(exc).__name__}: {exc}")
            raise
        reason = str(exc) if isinstance(exc, PeerFailure) else (
            f"rank {dist.get_rank()}, iteration {board.iteration}: {first_line(exc)}")
        board.finish("failed", reason)  # tell the others first: this rank gave up, it is not the cause
        # The watchdog may have diagnosed already (it fired while this thread was blocked).
        diagnosis = board.last_diagnosis or board.diagnose(settle_s=progress.SILENT_AFTER_S + 1)
        board.reported()
        board.linger_for_readers()
        raise PeerFailure(f"{reason}; {diagnosis}") from exc
    finally:
        progress.stop_board()


def _is_peer_failure(exc: BaseException) -> bool:
    """Our own PeerFailure, or a collective that failed because a peer went away (gloo/NCCL
    report these as plain RuntimeErrors)."""
    if isinstance(exc, PeerFailure):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                      "NCCL error", "Timed out waiting"))


def _train(args, trainer_factory, legacy_reference: Optional[ReferenceFactory]) -> List[IterationRecord]:
    started = args.program_start_time or time.time()
    set_logging_level(args)  # --logging-level
    tokenizer = build_tokenizer(args)
    # TawPipe's layout flags left at auto, decided (collective; after the tokenizer: the padded vocabulary)
    settle_tawpipe_layout(args, dist.get_world_size(), current_device())
    run = RunConfig.from_args(args, world_size=dist.get_world_size())   # after the tokenizer: its padded vocabulary
    train_ds, valid_ds, _test_ds = build_datasets(run.data, tokenizer)
    before_model = peak_memory_bytes()  # interpreter, libraries, process groups, data: not the model's
    held_before_model = held_memory_bytes()
    trainer = trainer_factory(args, run)
    scheduler = build_scheduler(run, trainer.optimizer)
    ckpt, training = run.checkpoint, run.training

    iteration, consumed_samples = 0, 0
    if ckpt.load:
        iteration, consumed_samples = _resume(args, run, trainer, scheduler, legacy_reference)
    _check_batch_layout(args, consumed_samples)

    writer = MetricsWriter(run, dist.get_world_size(), _is_writer())
    progress_log = ProgressLog(run, started, dist.get_rank(), dist.get_world_size(),   # --log-progress
                               writer.flops_per_sample)
    progress_log.starting(consumed_samples)
    board = TensorboardLog(run, args, _is_writer())
    # One loader per model chunk: worker processes are for the single-chunk case (Megatron-LM's --num-workers).
    workers = run.data.num_workers if trainer.num_data_iterators == 1 else 0
    records = TrainingRecords()
    last_saved = iteration if ckpt.load else None
    stop = exits.ExitConditions(run.training, started)
    reason = None
    train_iterators = []
    try:
        train_iterators = _data_iterators(train_ds, run, trainer.num_data_iterators, consumed_samples, workers)
        while iteration < training.train_iters:
            batch = batch_schedule.iteration_batch(run.data.schedule, run.schedule.micro_batch_size,
                                                   run.layout.data_parallel_size, consumed_samples)
            start = time.perf_counter()
            try:
                with progress.board().step(iteration + 1, "training step"):
                    step = trainer.train_step(train_iterators, batch.num_microbatches)
            except NonFiniteGradientError as exc:
                raise TrainingError(f"{exc} at iteration {iteration + 1}; stopping "
                                    "(--no-check-for-nan-in-loss-and-grad to continue anyway)") from exc
            elapsed = time.perf_counter() - start
            iteration += 1
            consumed_samples += batch.global_batch_size
            if not step.skipped:
                scheduler.step(increment=batch.global_batch_size)
            loss = step.loss_sum / max(step.num_tokens, 1.0)
            if not math.isfinite(loss) and not run.precision.fp16 and run.optimizer.check_for_nan_in_loss_and_grad:
                raise TrainingError(f"lm loss is {loss} at iteration {iteration}; stopping "
                                    "(--no-check-for-nan-in-loss-and-grad to continue anyway)")
            extra = dict(step.extra)
            extra["global_batch_size"] = batch.global_batch_size
            if not records and layout_record(args) is not None:   # the first record of this run: its layout
                extra["tawpipe_layout"] = layout_record(args)
            peak, held = peak_memory_bytes(), held_memory_bytes()
            held = -1 if held is None or held_before_model is None else held - held_before_model
            peak_max, growth_max, held_max = max_over_ranks([peak, peak - before_model, held])
            extra["peak_memory_bytes_max_rank"] = int(peak_max)
            extra["memory_since_model_bytes_max_rank"] = int(growth_max)
            if held_max >= 0:  # what the model, optimizer and buffers hold between iterations
                extra["memory_held_since_model_bytes_max_rank"] = int(held_max)
            if step.slept_s is not None:  # emulated: busy = slept compute time, the same measure for every schedule
                extra["compute"] = "emulated"
                extra["compute_busy_fraction"] = mean_over_ranks(step.slept_s / elapsed)
                emulation = getattr(trainer, "emulation", None)
                ring_s = emulation.take_ring_s() if emulation is not None else None
                if ring_s is not None:   # context parallelism: the ring's exchanges beside the sleeps
                    extra["emulated_ring_seconds"] = mean_over_ranks(ring_s)
            reason = stop.reason(iteration)
            # Validation every --eval-interval iterations and, as Megatron-LM does, once after the last
            # iteration (not after an early exit).
            if (training.eval_interval and iteration % training.eval_interval == 0) or (
                    iteration == training.train_iters and not reason):
                validation = _report_validation(trainer, valid_ds, run, iteration, batch.num_microbatches)
                if validation is not None:
                    extra["validation_lm_loss"] = validation
            records.append(writer.record(
                iteration, consumed_samples, elapsed, loss, step.grad_norm, _current_lr(scheduler),
                batch.global_batch_size, skipped=step.skipped, loss_scale=step.loss_scale, extra=extra))
            board.iteration(records[-1], batch.global_batch_size)
            board.validation(extra.get("validation_lm_loss"), iteration, consumed_samples)
            if ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0:
                save_checkpoint(ckpt.save, iteration, consumed_samples, trainer, scheduler, args, legacy_reference)
                progress_log.saved(iteration, consumed_samples)
                last_saved = iteration
            finalize_async_saves(blocking=False)  # --async-save: make finished background saves visible
            if reason:
                break
        if ckpt.save and last_saved != iteration:
            save_checkpoint(ckpt.save, iteration, consumed_samples, trainer, scheduler, args, legacy_reference)
            progress_log.saved(iteration, consumed_samples)
        close_async_saves(abort=False)  # before exiting: wait for background saves and finalize them
        if reason and _is_writer():
            print(f" exiting after iteration {iteration}: {reason}", flush=True)
    finally:
        close_data_iterators(train_iterators)  # their worker processes end now, not when garbage collected
        close_async_saves(abort=True)  # a failed run: unfinished background saves never become the latest
        stop.close()
        board.close()
        writer.close()
        trainer.close()
    print_closing_summary(args, records, iteration, reason, started, _is_writer())
    records.stop_reason = reason
    return records


class TrainingRecords(list):
    """The run's iteration records; ``stop_reason`` says why it stopped before ``--train-iters`` (an exit flag
    or ``--exit-signal``), None when it ran them all."""

    stop_reason: Optional[str] = None


def _check_batch_layout(args, consumed_samples: int) -> None:
    """The batches still ahead fit the layout (validate_args checked from the start unless resuming)."""
    try:
        batch_schedule.check_layout(args, consumed_samples)
    except ValueError as exc:
        raise TrainingError(f"{exc} (resuming at {consumed_samples} consumed samples)") from None


def _resume(args, run: RunConfig, trainer, scheduler, legacy_reference: Optional[ReferenceFactory]):
    """Load the latest checkpoint under --load; an empty directory is reported (or refused)."""
    from megatron_tawpipe.checkpoint import CheckpointSetupError, latest_iteration

    load = run.checkpoint.load
    if latest_iteration(load) is None:
        if run.training.exit_on_missing_checkpoint:
            raise CheckpointSetupError(f"--load {load} holds no checkpoint (--exit-on-missing-checkpoint)")
        if _is_writer():
            print(f" no checkpoint found in --load {load}: training from scratch", flush=True)
        return 0, 0
    # (it prints the one line of what it loaded)
    return load_checkpoint(load, trainer, scheduler, args, legacy_reference)


def _report_validation(trainer, dataset, run: RunConfig, iteration: int, num_microbatches: int) -> Optional[float]:
    loss = evaluate(trainer, dataset, run, num_microbatches)
    if loss is not None and _is_writer():
        ppl = math.exp(min(20.0, loss))
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |",
              flush=True)
    return loss
