"""Per-iteration metrics: Megatron-style log lines and a JSON-lines metrics file.

The metrics file (``--metrics-file``) holds one JSON object per iteration and
is what comparison runs and tools read; the log line is for people.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from typing import IO, Optional

from megatron_tawpipe.arguments.run_config import ModelConfig, RunConfig


def model_flops_per_sample(model: ModelConfig) -> float:
    """Model FLOPs of one sample of ``--seq-length`` tokens (forward + backward = 3 x forward), Megatron-LM's count.

    Dense matmuls per token per layer: the query, key and value projections (q = kv_channels x
    heads outputs for the query, kv_channels x groups each for key and value), attention scores
    and context (causal: half of S each), the output projection, and the MLP's two matrices
    (three with SwiGLU); plus the output layer. Recomputation is not counted (model FLOPs, as in MFU).
    """
    h, f, s = model.hidden_size, model.ffn_hidden_size, model.seq_length
    d = model.kv_channels or h // model.num_attention_heads
    q = d * model.num_attention_heads
    kv = d * model.num_query_groups
    mlp_matrices = 3 if model.swiglu else 2
    per_token_layer = 2 * h * (q + 2 * kv) + 2 * 2 * s * q * 0.5 + 2 * q * h + mlp_matrices * 2 * h * f
    per_token = model.num_layers * per_token_layer + 2 * h * model.padded_vocab_size
    return 3.0 * per_token * s


@dataclass
class IterationRecord:
    iteration: int
    consumed_samples: int
    lm_loss: float
    grad_norm: Optional[float]
    learning_rate: float
    elapsed_ms: float
    tokens_per_sec_per_rank: float
    tflops_per_rank: float
    skipped: bool = False
    loss_scale: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "lm_loss": self.lm_loss,
            "grad_norm": self.grad_norm,
            "learning_rate": self.learning_rate,
            "elapsed_ms": self.elapsed_ms,
            "tokens_per_sec_per_rank": self.tokens_per_sec_per_rank,
            "tflops_per_rank": self.tflops_per_rank,
            "skipped": self.skipped,
            "peak_memory_bytes": peak_memory_bytes(),
        }
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        out.update(self.extra)
        return out


class MetricsWriter:
    """Writes records to the metrics file and prints a log line every ``log_interval``."""

    def __init__(self, run: RunConfig, world_size: int, is_writer: bool):
        self.logging, self.seq_length, self.train_iters = run.logging, run.model.seq_length, run.training.train_iters
        self.world_size = world_size
        self.is_writer = is_writer
        self.flops_per_sample = model_flops_per_sample(run.model)
        self._file: Optional[IO[str]] = None
        if is_writer and self.logging.metrics_file:
            directory = os.path.dirname(os.path.abspath(self.logging.metrics_file))
            os.makedirs(directory, exist_ok=True)
            # Appending keeps the history of a resumed run in one file.
            self._file = open(self.logging.metrics_file, "a", encoding="utf-8")

    def record(self, iteration: int, consumed_samples: int, elapsed: float, lm_loss: float,
               grad_norm: Optional[float], learning_rate: float, global_batch_size: int, skipped: bool = False,
               loss_scale: Optional[float] = None, extra: Optional[dict] = None) -> IterationRecord:
        """``elapsed``: seconds of the training step alone (evaluation and saving excluded); ``global_batch_size``:
        the iteration's samples."""
        tokens = global_batch_size * self.seq_length
        record = IterationRecord(
            iteration=iteration,
            consumed_samples=consumed_samples,
            lm_loss=lm_loss,
            grad_norm=grad_norm,
            learning_rate=learning_rate,
            elapsed_ms=elapsed * 1000.0,
            tokens_per_sec_per_rank=tokens / elapsed / self.world_size,
            tflops_per_rank=self.flops_per_sample * global_batch_size / elapsed / self.world_size / 1e12,
            skipped=skipped,
            loss_scale=loss_scale,
            extra=dict(extra or {}),
        )
        if self.is_writer:
            if self._file is not None:
                self._file.write(json.dumps(record.to_json()) + "\n")
                self._file.flush()
            if iteration % self.logging.log_interval == 0:
                print(format_log_line(record, self.train_iters, global_batch_size), flush=True)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def peak_memory_bytes() -> int:
    """Peak memory of this process: GPU memory allocated on a GPU, resident set size on a CPU."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2():
    """glibc's ``mallinfo2`` (looked up once), or None where it is missing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def held_memory_bytes() -> Optional[int]:
    """Bytes this process holds now: ``torch.cuda.memory_allocated`` on a GPU; on a CPU, what glibc's
    allocator has handed out and not taken back (``mallinfo2``: heap blocks plus mmapped blocks, where
    tensors live), which unlike the resident set drops when tensors are freed. None where glibc's
    ``mallinfo2`` is missing."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def max_over_ranks(value):
    """The largest ``value`` over all ranks, on every rank (one all-reduce); a list: each entry's."""
    import torch.distributed as dist

    return _all_reduce_scalar(value, dist.ReduceOp.MAX)


def min_over_ranks(value):
    """The smallest ``value`` over all ranks, on every rank (one all-reduce); a list: each entry's."""
    import torch.distributed as dist

    return _all_reduce_scalar(value, dist.ReduceOp.MIN)


def mean_over_ranks(value):
    """The mean of ``value`` over all ranks, on every rank (one all-reduce); a list: each entry's."""
    import torch.distributed as dist

    total, world = _all_reduce_scalar(value, dist.ReduceOp.SUM), dist.get_world_size()
    return [v / world for v in total] if isinstance(value, (list, tuple)) else total / world


def _all_reduce_scalar(value: float, op) -> float:
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.common.device import current_device

    device = current_device()
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist() if isinstance(value, (list, tuple)) else float(t[0])


def _fmt_float(value: Optional[float], spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def format_log_line(record: IterationRecord, train_iters: int, global_batch_size: int) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{stamp}] iteration {record.iteration:8d}/{train_iters:8d}",
        f"consumed samples: {record.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {record.elapsed_ms:.1f}",
        f"tokens per second per rank: {record.tokens_per_sec_per_rank:.1f}",
        f"throughput per rank (TFLOP/s): {record.tflops_per_rank:.3f}",
        f"learning rate: {record.learning_rate:.6E}",
        f"global batch size: {global_batch_size:5d}",
        f"lm loss: {_fmt_float(record.lm_loss, '.6E')}",
        f"grad norm: {_fmt_float(record.grad_norm, '.3f')}",
    ]
    if record.loss_scale is not None:
        parts.append(f"loss scale: {record.loss_scale:.1f}")
    if record.skipped:
        parts.append("skipped")
    return " | ".join(parts) + " |"
