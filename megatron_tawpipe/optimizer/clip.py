"""Megatron's gradient clipping on the global L2 norm, shared by every trainer.

The trainer sums :func:`squared_l2_norm` of its local gradients over the ranks that split them (its own
reduction), takes the square root, and :func:`clip_gradients_` scales every gradient by
``clip_grad / (norm + 1e-6)`` when that is below 1, as megatron-core's ``clip_grad_by_total_norm_fp32`` does.
"""

from __future__ import annotations

from typing import Sequence

import torch


def squared_l2_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared L2 norms of ``grads``, as a one-element fp64 tensor on ``device``.

    Each gradient's norm is taken in fp32 by ``torch._foreach_norm`` (one kernel per device and
    dtype, no copy of any gradient; 16-bit gradients are read as fp32); only the per-tensor norms
    are widened to fp64 before they are squared and summed.
    """
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        widen = {"dtype": torch.float32} if any(g.dtype in (torch.float16, torch.bfloat16) for g in grads) else {}
        norms = torch._foreach_norm(list(grads), 2, **widen)
        total += torch.stack(norms).to(torch.float64).square().sum()
    return total


def clip_gradients_(grads: Sequence[torch.Tensor], clip_grad: float, norm: float) -> None:
    """Scale ``grads`` in place by megatron's clip coefficient ``clip_grad / (norm + 1e-6)`` when it is
    below 1; no clipping when ``clip_grad`` is 0 or None."""
    if clip_grad and clip_grad > 0:
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            torch._foreach_mul_(list(grads), coeff)
