"""What one training step of any trainer reports to the training loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class StepResult:
    """One iteration of a trainer: loss and token sums over all ranks, the optimizer's outcome, and the
    trainer's own metrics (``extra``, written to the metrics file as they are)."""

    loss_sum: float                  # summed per-token losses of the global batch
    num_tokens: float                # loss tokens of the global batch
    grad_norm: Optional[float]       # global gradient norm (None where the optimizer does not report one)
    skipped: bool                    # the update was skipped (fp16 overflow)
    loss_scale: Optional[float]      # None without a loss scaler
    slept_s: Optional[float] = None  # emulated compute: seconds this rank slept in the step; None when real
    extra: Dict[str, object] = field(default_factory=dict)
