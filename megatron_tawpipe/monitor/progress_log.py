"""``--log-progress``: Megatron-LM's ``progress.txt`` under ``--save``.

One line per event, appended by the first rank after a barrier of all ranks, tab-separated as Megatron-LM
writes it (tools that read Megatron-LM's file read this one)::

    2026-01-02 03:04:05<TAB>Job ID: <SLURM_JOB_ID><TAB># GPUs: <world size><TAB>Starting job
    ...<TAB>Saved checkpoint<TAB>Iteration: 20<TAB>Job throughput: 1.2 TFLOP/s/GPU<TAB>
        Cumulative throughput: 1.1 TFLOP/s/GPU<TAB>Floating-point operations: 3.45e+15<TAB>Tokens (in billions): 0.01

``Starting job`` when training starts; ``Saved checkpoint`` after every checkpoint. Job throughput is the
model FLOPs of this job's iterations over the time since the program started, per rank; cumulative throughput
counts from the first ``Starting job`` of the latest run of jobs with this world size (a job with another
world size starts the count again), from the operations of the checkpoint saved before it, as Megatron-LM
reads the file back. The operations so far are the model FLOPs per sample (Megatron-LM's count,
:func:`megatron_tawpipe.monitor.metrics.model_flops_per_sample`) times the consumed samples, which a
resumed job knows from its checkpoint. Without ``--save`` nothing is written, as in Megatron-LM. With
``--async-save`` the line says ``Saving async checkpoint``, Megatron-LM's words for a save still being written.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional, Tuple

from megatron_tawpipe.arguments.run_config import RunConfig

PROGRESS_FILE = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def progress_path(save: str) -> str:
    return os.path.join(save, PROGRESS_FILE)


def progress_line(world_size: int, text: str, now: Optional[datetime.datetime] = None) -> str:
    """One line of the file: time, job id (``SLURM_JOB_ID``, empty outside Slurm), ranks, then ``text``."""
    stamp = (now or datetime.datetime.now()).strftime(TIME_FORMAT)
    return f"{stamp}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t# GPUs: {world_size}\t{text}\n"


def _field(token: str, kind):
    return kind(token.split(": ")[1])


def cumulative_start(path: str, world_size: int) -> Tuple[datetime.datetime, float]:
    """When the latest run of jobs with ``world_size`` ranks started, and the floating-point operations of the
    checkpoint saved before it (Megatron-LM's reading of the file)."""
    start_time, start_ops, latest_ops, uncommitted = None, None, 0.0, None
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            tokens = line.strip().split("\t")
            if len(tokens) < 4:
                continue
            if tokens[3] == "Saved checkpoint":
                latest_ops = _field(tokens[7], float)
            elif tokens[3] == "Saving async checkpoint":
                uncommitted = _field(tokens[7], float)
            elif tokens[3] == "Saved async checkpoint" and uncommitted is not None:
                latest_ops, uncommitted = uncommitted, None
            if _field(tokens[2], int) != world_size:
                start_time, start_ops = None, None
                continue
            if tokens[3] == "Starting job" and start_time is None:
                start_time, start_ops = tokens[0], latest_ops
    if start_time is None:
        raise RuntimeError(f"{path} has no 'Starting job' line of a job with {world_size} ranks")
    return datetime.datetime.strptime(start_time, TIME_FORMAT), start_ops


class ProgressLog:
    """Writes ``SAVE/progress.txt`` with ``--log-progress`` (every rank calls; the first rank writes)."""

    def __init__(self, run: RunConfig, program_start: float, rank: int, world_size: int, flops_per_sample: float):
        """``program_start``: when the job started (its throughput counts from there)."""
        save = run.checkpoint.save
        self.enabled = bool(run.logging.log_progress and save)
        self.path = progress_path(save) if self.enabled else None
        self.rank, self.world_size = rank, world_size
        self.flops_per_sample = float(flops_per_sample)
        self.seq_length = int(run.model.seq_length)
        self.program_start = program_start
        self.job_start_ops = 0.0
        self.async_save = bool(run.checkpoint.async_save)

    def _append(self, text: str) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(progress_line(self.world_size, text))

    def starting(self, consumed_samples: int) -> None:
        """The job starts (after loading a checkpoint at ``consumed_samples``)."""
        if not self.enabled:
            return
        self.job_start_ops = self.flops_per_sample * consumed_samples
        self._append("Starting job")

    def saved(self, iteration: int, consumed_samples: int) -> None:
        """A checkpoint of ``iteration`` was saved."""
        if not self.enabled:
            return
        ops = self.flops_per_sample * consumed_samples
        job = (ops - self.job_start_ops) / (max(time.time() - self.program_start, 1e-9) * 1e12 * self.world_size)
        cumulative = 0.0
        if self.rank == 0:
            started, start_ops = cumulative_start(self.path, self.world_size)
            elapsed = max((datetime.datetime.now() - started).total_seconds(), 1e-9)
            cumulative = (ops - start_ops) / (elapsed * 1e12 * self.world_size)
        tokens = consumed_samples * self.seq_length
        # Megatron-LM's words for a save still being written in the background (--async-save)
        saved = "Saving async checkpoint" if self.async_save else "Saved checkpoint"
        self._append(f"{saved}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                     f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                     f"Floating-point operations: {ops:.2e}\tTokens (in billions): {tokens / 10 ** 9:.2f}")
