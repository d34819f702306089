"""``--tensorboard-dir``: the scalars Megatron-LM writes, under Megatron-LM's names.

Written by the last rank (the one that prints the log line), every ``--tensorboard-log-interval``
iterations: ``learning-rate``, ``batch-size``, ``lm loss``, ``grad-norm`` and, with ``--fp16``,
``loss-scale``, each also as ``<name> vs samples`` over consumed samples. Every
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


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _start_wandb(args):
    import wandb

    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    from megatron_tawpipe.arguments import plain_arguments

    return wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None, dir=save_dir,
                      config=plain_arguments(args))


class TensorboardLog:
    """Megatron-LM's scalars to TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``)."""

    def __init__(self, args, is_writer: bool):
        self.args = args
        self.writer = None
        self.wandb = None
        if is_writer and getattr(args, "tensorboard_dir", None):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir,
                                        max_queue=getattr(args, "tensorboard_queue_size", None) or 1000)
        if is_writer and getattr(args, "wandb_project", None):
            self.wandb = _start_wandb(args)

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
        args, it, samples = self.args, record.iteration, record.consumed_samples
        if it % (getattr(args, "tensorboard_log_interval", None) or 1) == 0:
            self._pair("learning-rate", record.learning_rate, it, samples)
            self._pair("batch-size", batch_size, it, samples)
            self._pair("lm loss", record.lm_loss, it, samples)
            if record.loss_scale is not None:
                self._pair("loss-scale", record.loss_scale, it, samples)
            if record.grad_norm is not None:
                self._pair("grad-norm", record.grad_norm, it, samples)
        if it % args.log_interval == 0 and getattr(args, "log_timers_to_tensorboard", False):
            self._scalar("iteration-time", record.elapsed_ms / 1000.0, it)
            if getattr(args, "log_throughput", False):
                self._scalar("throughput", record.tflops_per_rank, it)

    def validation(self, loss: Optional[float], iteration: int, samples: int) -> None:
        if not self.active or loss is None:
            return
        self._pair("lm loss validation", loss, iteration, samples)
        if getattr(self.args, "log_validation_ppl_to_tensorboard", False):
            self._pair("lm loss validation ppl", math.exp(min(20.0, loss)), iteration, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
