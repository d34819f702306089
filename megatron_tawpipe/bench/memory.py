"""One rank's memory against the simulator's prediction.

Prediction: :func:`megatron_tawpipe.sim.simulate.simulate` on the one-rank TawPipe plan of the
run, with the FLOP cost model of the same shapes; its memory fields are
``weight_buffer_bytes``, ``grad_buffer_bytes``, ``activation_bytes`` and
``state_bytes`` (fp32 master, Adam moments and fp32 gradient of the owned
shard and of the replicated parts, plus the replicated parts' compute copy),
summed in ``memory_bytes``.

Measurements, after a one-rank training run whose trainer is kept:

* held: the bytes of every distinct tensor storage the trainer holds (its
  masters, gradients, optimizer state, plan buffers, model parameters and
  the other tensors its model and shard template keep), set against the
  predicted state and buffers; the same on every device;
* peak (CUDA only): ``torch.cuda.max_memory_allocated`` over the run, from a
  reset just before it, set against the predicted total (the CPU has no
  allocator statistics: the check says so rather than reporting the resident
  set, which holds the interpreter and libraries too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

SIM_FIELDS = ("weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes", "state_bytes")


def predicted_memory(args, num_microbatches: int) -> Dict[str, float]:
    """The simulator's memory fields for one rank of ``--pipeline-schedule tawpipe`` with world size 1."""
    from megatron_tawpipe.arguments.run_config import RunConfig
    from megatron_tawpipe.plan import build_plan
    from megatron_tawpipe.sim.run_cost import cost_model_for_run
    from megatron_tawpipe.sim.simulate import simulate
    from megatron_tawpipe.runtime.weight_pipe_model import plan_options

    config = RunConfig.from_args(args, world_size=1, ranks_per_node=1)
    schedule = config.schedule
    plan = build_plan(schedule.plan_name, num_ranks=1, num_groups=1, num_layers=config.model.num_layers,
                      num_microbatches=num_microbatches, **plan_options(schedule))
    cost = cost_model_for_run(config.model, config.precision, schedule.micro_batch_size, schedule.recompute)
    result = simulate(plan, cost, record=False)
    out = {name: float(getattr(result, name)) for name in SIM_FIELDS}
    out["memory_bytes"] = float(result.memory_bytes)
    return out


def _storage_key(tensor: torch.Tensor) -> Tuple[str, int]:
    storage = tensor.untyped_storage()
    return str(tensor.device), storage.data_ptr()


def _tensors_in(value) -> Iterable[torch.Tensor]:
    """Tensors directly in ``value``: a tensor, or a dict / list / tuple of them (one level)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                yield item
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _trainer_tensors(trainer) -> List[Tuple[str, Iterable[torch.Tensor]]]:
    """What a weight-passing trainer holds, by category (first category wins a shared storage)."""
    model = trainer.model
    masters = [t for _, master, grad in model.named_masters() for t in (master, grad)]
    # The optimizer's state is keyed by the very tensors it was given, not by new views of the same masters.
    optimizer = [value for master in trainer.optimized_masters()
                 for value in trainer.optimizer_state_for(master).values() if isinstance(value, torch.Tensor)]
    executor = model.executor
    buffers = list(executor.weight_buffers.values()) + list(executor.grad_buffers.values())
    parameters = list(model.template.model.parameters())
    other = [t for obj in (model, model.template) for value in vars(obj).values() for t in _tensors_in(value)]
    return [("fp32 masters and gradients", masters), ("optimizer state", optimizer),
            ("plan weight/gradient buffers", buffers), ("model parameters (compute copies)", parameters),
            ("other tensors of the model and template", other)]


def held_bytes(trainer) -> Dict[str, int]:
    """Bytes of distinct storages the trainer holds, by category (see :func:`_trainer_tensors`)."""
    seen = set()
    out: Dict[str, int] = {}
    for category, tensors in _trainer_tensors(trainer):
        total = 0
        for tensor in tensors:
            key = _storage_key(tensor)
            if key in seen or tensor.untyped_storage().nbytes() == 0:
                continue
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
        out[category] = total
    return out


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass
class MemoryComparison:
    predicted: Dict[str, float]
    held: Dict[str, int]
    peak_allocated: Optional[int]        # CUDA only
    tolerance: float

    @property
    def predicted_held(self) -> float:
        p = self.predicted
        return p["state_bytes"] + p["weight_buffer_bytes"] + p["grad_buffer_bytes"]

    @property
    def held_total(self) -> int:
        return sum(self.held.values())

    @property
    def held_ratio(self) -> float:
        return self.held_total / self.predicted_held

    @property
    def peak_ratio(self) -> Optional[float]:
        return None if self.peak_allocated is None else self.peak_allocated / self.predicted["memory_bytes"]

    @property
    def agrees(self) -> bool:
        ratios = [r for r in (self.held_ratio, self.peak_ratio) if r is not None]
        return all(abs(r - 1.0) <= self.tolerance for r in ratios)

    def summary(self) -> str:
        p = self.predicted
        text = (f"held {format_bytes(self.held_total)} vs predicted state+buffers "
                f"{format_bytes(self.predicted_held)} (x{self.held_ratio:.2f}); ")
        if self.peak_allocated is None:
            return text + (f"peak: n/a on the CPU (no allocator statistics); predicted total "
                           f"{format_bytes(p['memory_bytes'])}")
        return text + (f"peak allocated {format_bytes(self.peak_allocated)} vs predicted total "
                       f"{format_bytes(p['memory_bytes'])} (x{self.peak_ratio:.2f}; predicted activations "
                       f"{format_bytes(p['activation_bytes'])})")

    def to_json(self) -> dict:
        return {"predicted": dict(self.predicted), "held_by_category": dict(self.held),
                "held_total_bytes": self.held_total, "predicted_state_and_buffer_bytes": self.predicted_held,
                "held_ratio": self.held_ratio, "peak_allocated_bytes": self.peak_allocated,
                "peak_ratio": self.peak_ratio, "tolerance": self.tolerance, "agrees": self.agrees}
