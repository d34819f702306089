"""Loss scaling and RNG replay for the weight-passing runtime.

* fp16 needs loss scaling: megatron-core's ``DynamicGradScaler`` (or a constant
  scale with ``--loss-scale``). Partial gradients are summed at their owners
  while still scaled; the owners unscale, and one all-reduced flag tells every
  rank whether any gradient overflowed, so all skip (or take) the step together.
* Full recompute must replay the forward's dropout masks: the RNG states seen
  by a shard's forward are captured and restored around its recompute, like
  megatron's activation checkpointing does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.run_config import OptimizerSettings, PrecisionConfig


def find_non_finite(groups: List[List[torch.Tensor]], device: torch.device) -> List[int]:
    """Indices of the gradient groups holding a NaN/Inf on *any* rank (one all-reduced flag vector).

    The flags are computed on the device: the host waits once, for the all-reduced vector.
    """
    flags = torch.zeros(len(groups), dtype=torch.float32, device=device)
    for i, grads in enumerate(groups):
        if grads:
            flags[i] = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [i for i, flag in enumerate(flags.tolist()) if flag > 0]


class GradScaling:
    """No-op for fp32/bf16; megatron's grad scaler for fp16."""

    def __init__(self, scaler=None, device: Optional[torch.device] = None):
        self.scaler = scaler
        self.device = device

    @classmethod
    def of(cls, adam: OptimizerSettings, precision: PrecisionConfig, device: torch.device) -> "GradScaling":
        """megatron-core's scaler for ``--fp16`` (a constant ``--loss-scale``, else dynamic), none otherwise."""
        if not precision.fp16:
            return cls(None, device)
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        if adam.loss_scale:
            return cls(ConstantGradScaler(adam.loss_scale), device)
        return cls(DynamicGradScaler(initial_scale=adam.initial_loss_scale, min_scale=adam.min_loss_scale,
                                     growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=int(adam.loss_scale_window), hysteresis=adam.hysteresis), device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else loss * self.scaler.scale.to(loss.device)

    def unscale_and_check(self, grads: List[torch.Tensor]) -> bool:
        """Unscale ``grads`` in place; True (on every rank) if any rank saw inf/nan.

        One fused kernel per device and dtype (torch's AMP unscale) multiplies and checks; the
        host waits once, for the all-reduced flag.
        """
        if self.scaler is None:
            return False
        inv_scale = self.scaler.inv_scale.detach().to(device=self.device, dtype=torch.float32).reshape(1)
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found, inv_scale)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        overflow = bool(found.item() > 0)
        self.scaler.update(overflow)
        return overflow

    def loss_scale(self) -> Optional[float]:
        return None if self.scaler is None else float(self.scaler.scale)

    def state_dict(self) -> Optional[dict]:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


@dataclass
class RngSnapshot:
    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    tracker: dict

    @classmethod
    def capture(cls) -> "RngSnapshot":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_cuda_rng_tracker().set_states(self.tracker)

    @staticmethod
    @contextlib.contextmanager
    def replay(snapshot: Optional["RngSnapshot"]):
        """Run the body with the RNG as it was at ``snapshot``; put the current state back after."""
        if snapshot is None:
            yield
            return
        current = RngSnapshot.capture()
        snapshot.restore()
        try:
            yield
        finally:
            current.restore()
