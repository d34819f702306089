"""``--tensorboard-dir``: the scalars Megatron-LM writes, under Megatron-LM's names.

Written by the last rank (the one that prints the log line), every ``--tensorboard-log-interval``
iterations: ``learning-rate`` (not with ``--no-log-learnig-rate-to-tensorboard``), ``batch-size``, ``lm loss``,
``loss-scale`` (1.0 without ``--fp16``; not with ``--no-log-loss-scale-to-tensorboard``), ``grad-norm``,
with ``--log-world-size-to-tensorboard`` ``world-size``, each also as ``<name> vs samples`` over consumed
samples; with ``--log-memory-to-tensorboard`` (TensorBoard only, as Megatron-LM) ``mem-reserved-bytes``,
``mem-allocated-bytes``, ``mem-max-allocated-bytes`` and ``mem-allocated-count`` from
``torch.cuda.memory_stats()``; on a CPU ``mem-allocated-bytes`` is the heap in use (glibc's ``mallinfo2``)
and ``mem-max-allocated-bytes`` the peak resident set (the two the metrics file has). Every
``--log-interval`` iterations, ``iteration-time`` (seconds) with ``--log-timers-to-tensorboard``,
and ``throughput`` (TFLOP/s per rank) with both that and ``--log-throughput``, as Megatron-LM
does. Validation: ``lm loss validation`` (and ``... vs samples``), with
``--log-validation-ppl-to-tensorboard`` also ``lm loss validation ppl``.

``--wandb-project`` (with ``--wandb-exp-name``, ``--wandb-save-dir``, default ``SAVE/wandb``) logs the
same scalars by iteration to Weights & Biases from the same rank, with the run's arguments as its
config; ``WANDB_MODE=offline`` keeps the run on disk.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

from megatron_tawpipe.arguments.run_config import LoggingConfig, RunConfig


def memory_scalars() -> dict:
    """``--log-memory-to-tensorboard``'s scalars: Megatron-LM's four from ``torch.cuda.memory_stats()`` on a
    GPU; on a CPU the heap in use and the peak resident set."""
    import torch

    from megatron_tawpipe.monitor.metrics import held_memory_bytes, peak_memory_bytes

    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    scalars = {"mem-max-allocated-bytes": peak_memory_bytes()}
    held = held_memory_bytes()
    if held is not None:
        scalars["mem-allocated-bytes"] = held
    return scalars


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _start_wandb(args, logging: LoggingConfig, save: Optional[str]):
    import wandb

    save_dir = logging.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    from megatron_tawpipe.arguments import plain_arguments

    return wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name or None, dir=save_dir,
                      entity=logging.wandb_entity or None, config=plain_arguments(args))


class TensorboardLog:
    """Megatron-LM's scalars to TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``)."""

    def __init__(self, run: RunConfig, args, is_writer: bool):
        """``args``: the flags as parsed, every one of which W&B records with the run."""
        self.logging = logging = run.logging
        self.writer = None
        import torch.distributed as dist

        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.wandb = None
        if is_writer and logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=logging.tensorboard_queue_size)
        if is_writer and logging.wandb_project:
            self.wandb = _start_wandb(args, logging, run.checkpoint.save)

    @property
    def active(self) -> bool:
        return self.writer is not None or self.wandb is not None

    def _scalar(self, name: str, value: float, iteration: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log({name: value}, step=iteration)

    def _pair(self, name: str, value: float, iteration: int, samples: int) -> None:
        self._scalar(name, value, iteration)
        if self.writer is not None:
            self.writer.add_scalar(f"{name} vs samples", value, samples)

    def iteration(self, record, batch_size: int) -> None:
        """One training iteration's scalars (``record``: a metrics IterationRecord)."""
        if not self.active:
            return
        logging, it, samples = self.logging, record.iteration, record.consumed_samples
        if it % logging.tensorboard_log_interval == 0:
            if logging.log_learning_rate_to_tensorboard:
                self._pair("learning-rate", record.learning_rate, it, samples)
            self._pair("batch-size", batch_size, it, samples)
            self._pair("lm loss", record.lm_loss, it, samples)
            if logging.log_loss_scale_to_tensorboard:
                self._pair("loss-scale", 1.0 if record.loss_scale is None else record.loss_scale, it, samples)
            if logging.log_world_size_to_tensorboard:
                self._pair("world-size", self.world_size, it, samples)
            if record.grad_norm is not None:
                self._pair("grad-norm", record.grad_norm, it, samples)
            if logging.log_memory_to_tensorboard and self.writer is not None:
                for name, value in memory_scalars().items():
                    self.writer.add_scalar(name, value, it)
        if it % logging.log_interval == 0 and logging.log_timers_to_tensorboard:
            self._scalar("iteration-time", record.elapsed_ms / 1000.0, it)
            if logging.log_throughput:
                self._scalar("throughput", record.tflops_per_rank, it)

    def validation(self, loss: Optional[float], iteration: int, samples: int) -> None:
        if not self.active or loss is None:
            return
        self._pair("lm loss validation", loss, iteration, samples)
        if self.logging.log_validation_ppl_to_tensorboard:
            self._pair("lm loss validation ppl", math.exp(min(20.0, loss)), iteration, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
