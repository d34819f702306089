"""Megatron-LM's ``--use-precision-aware-optimizer`` and its dtype flags.

megatron-core's ``OptimizerConfig`` has ``use_precision_aware_optimizer``, ``main_grads_dtype``,
``main_params_dtype``, ``exp_avg_dtype`` and ``exp_avg_sq_dtype``. Without the first, all four must
be fp32. With it, megatron-core needs ``--optimizer adam``, its distributed optimizer and Transformer
Engine's ``FusedAdam`` (which keeps the master weights in ``main_params_dtype`` and the moments in
their dtypes, computing every update in fp32); ``main_grads_dtype`` bf16 reaches megatron's DDP
through Megatron-LM's rule that, under ``--bf16``, only fp32 main gradients turn on
``--accumulate-allreduce-grads-in-fp32``: the gradient buffers, their accumulation and their
reduction are then bf16.

The weight-passing schedules shard the optimizer by construction (each rank steps its own shard),
so they take the flags without ``--use-distributed-optimizer``: the shard's gradient accumulator,
the travelling partial gradients and the replicated parts' gradients take ``main_grads_dtype``,
the masters ``main_params_dtype``, and :class:`PrecisionAwareAdamW` stores the moments in theirs
(fp32, fp16 or bf16; Transformer Engine's scaled fp8 storage is refused).

:func:`precision_refusal` works on the flags' strings (:mod:`.precision_flags`, no torch needed); the rest maps
them to torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatron_tawpipe.arguments.run_config import PrecisionConfig
from megatron_tawpipe.optimizer.precision_flags import (  # noqa: F401 (the flags' rules, kept importable here)
    DTYPE_FLAGS, MOMENT_DTYPES, precision_refusal, transformer_engine_fused_adam)

# Megatron-LM's names; 'fp8' is Transformer Engine's scaled fp8 storage, which megatron passes as torch.uint8.
DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp8": torch.uint8}


@dataclass(frozen=True)
class OptimizerDtypes:
    """The torch dtypes of the main gradients, main parameters and Adam's moments (all fp32 by default)."""

    main_grads: torch.dtype = torch.float32
    main_params: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @classmethod
    def from_args(cls, args) -> "OptimizerDtypes":
        return cls.of(PrecisionConfig.from_args(args))

    @classmethod
    def of(cls, precision: PrecisionConfig) -> "OptimizerDtypes":
        if not precision.use_precision_aware_optimizer:
            return cls()
        return cls(*(DTYPES[getattr(precision, dest)] for _, dest in DTYPE_FLAGS))

    @property
    def precision_aware(self) -> bool:
        return self != OptimizerDtypes()


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are stored in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``.

    Each update is computed in fp32, as torch's single-tensor AdamW computes it, from fp32 copies of the
    parameter, its gradient and its moments, then rounded (to nearest) into their stored dtypes: with every
    dtype fp32 the result equals ``torch.optim.AdamW``'s bit for bit. A parameter's gradient is its
    ``decoupled_grad`` attribute where set (Transformer Engine's convention: a gradient whose dtype may
    differ from the parameter's), else its ``.grad``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        for dtype in (exp_avg_dtype, exp_avg_sq_dtype):
            if not dtype.is_floating_point:
                raise ValueError(f"Adam's moments can be stored in fp32, fp16 or bf16, not {dtype}")
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @staticmethod
    def gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
        grad = getattr(param, "decoupled_grad", None)
        return param.grad if grad is None else grad

    def place_state(self, key: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A loaded state tensor where this optimizer keeps it: moments beside the parameter in their dtypes,
        the step count on the host as fp32."""
        if key in self.moment_dtypes:
            return value.to(device=param.device, dtype=self.moment_dtypes[key])
        return value.to(dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PrecisionAwareAdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = self.gradient(param)
                if grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key, dtype in self.moment_dtypes.items():
                        state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                self._update(param, grad, state, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        return None

    @staticmethod
    def _update(param, grad, state, lr, beta1, beta2, eps, weight_decay, step) -> None:
        wide = lambda t: t if t.dtype == torch.float32 else t.float()  # noqa: E731 - fp32 working copies
        p, g, m, v = wide(param), wide(grad), wide(state["exp_avg"]), wide(state["exp_avg_sq"])
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        for stored, working in ((param, p), (state["exp_avg"], m), (state["exp_avg_sq"], v)):
            if stored is not working:
                stored.copy_(working)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (moments and step counts)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
