"""Weight-passing training: shard ownership, compute callbacks, optimizer, one iteration.

Each rank owns one shard (device-bound storage): its fp32 master weights, its
gradient accumulator and its AdamW state stay on the owner; only compute-dtype
weight copies and partial gradients travel, as the plan says. The replicated
parts (embedding, final norm, output layer) live on every rank and their
gradients are all-reduced once per iteration.

Normalisation is Megatron's: every micro-batch contributes its mean token
loss divided by ``N * P`` (micro-batches per rank x data-parallel ranks), so
the summed gradient equals data-parallel training's averaged one.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.data import get_batch
from megatron_tawpipe.model import params_dtype
from megatron_tawpipe.plan import build_plan, validate_plan
from megatron_tawpipe.runtime.executor import Communicators, PlanExecutor
from megatron_tawpipe.runtime.shard_model import ShardTemplate


def default_num_groups(world_size: int) -> int:
    """One group per node as torchrun reports it (LOCAL_WORLD_SIZE ranks per node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, world_size // max(1, local))


def plan_name(args) -> str:
    if args.pipeline_schedule == "weipipe":
        return "weipipe"
    return "tawpipe-nooverlap" if args.tawpipe_no_overlap else "tawpipe"


def _no_weight_decay(name: str, shape) -> bool:
    # Megatron's rule: no weight decay on biases and on 1-D parameters (norm weights).
    return name.endswith(".bias") or len(shape) == 1


class _ParamGroupsView:
    """What megatron's OptimizerParamScheduler needs from an optimizer: ``param_groups``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


class WeightPassingTrainer:
    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        groups = args.tawpipe_num_groups or default_num_groups(self.world)
        if args.pipeline_schedule == "weipipe" and args.tawpipe_num_groups is None:
            groups = default_num_groups(self.world)
        self.plan = build_plan(plan_name(args), num_ranks=self.world, num_groups=groups,
                               num_layers=args.num_layers, num_microbatches=args.num_microbatches)
        validate_plan(self.plan)
        self.template = ShardTemplate(args, self.plan.num_shards, self.device)
        self.shard_numel = self.template.shard_numel
        self.compute_dtype = params_dtype(args)
        self.owned = self.plan.shards_owned_by(self.rank)
        self._masters = {s: torch.empty(self.shard_numel, dtype=torch.float32, device=self.device) for s in self.owned}
        self._main_grads = {s: torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device) for s in self.owned}
        for shard, flat in self._masters.items():
            self.template.init_shard(shard, flat)
        self._build_optimizer()
        self.executor = PlanExecutor(self.plan, self.rank, self, Communicators(self.plan, self.world))
        self._reset_step_state()

    # ---- optimizer -------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        """AdamW over the owned shards' master views and the replicated parameters."""
        decay, no_decay = [], []
        self._named_masters: List[Tuple[str, torch.Tensor]] = []
        for shard in self.owned:
            views = self.template.views(self._masters[shard])
            grad_views = self.template.views(self._main_grads[shard])
            for slot, view, grad in zip(self.template.slots, views, grad_views):
                view.grad = grad
                name = self.template.global_name(shard, slot)
                self._named_masters.append((name, view))
                (no_decay if _no_weight_decay(name, slot.shape) else decay).append(view)
        self._replicated = self.template.replicated_parameters()
        for name, param in self._replicated:
            param.grad = torch.zeros_like(param, dtype=torch.float32)
            self._named_masters.append((name, param))
            (no_decay if _no_weight_decay(name, param.shape) else decay).append(param)
        a = self.args
        self._adamw = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, weight_decay=a.weight_decay)
        self.optimizer = _ParamGroupsView(self._adamw)

    # ---- callbacks used by the executor ---------------------------------------------

    def master(self, shard: int) -> torch.Tensor:
        return self._masters[shard]

    def main_grad(self, shard: int) -> torch.Tensor:
        return self._main_grads[shard]

    def replicated_grads(self) -> List[torch.Tensor]:
        return [param.grad for _, param in self._replicated]

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        if shard == 0:
            self._load_microbatch(mb)
        batch = self._batches[mb]
        self.template.bind(weights)
        with torch.no_grad():
            hidden = self._inputs.get((mb, shard))
            if shard == 0:
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
                self._inputs[(mb, 0)] = hidden
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"])
            if shard + 1 < self.plan.num_shards:
                self._inputs[(mb, shard + 1)] = out
            else:
                losses = self.template.head_loss(out, batch["labels"])
                mask = batch["loss_mask"].float()
                self._report += torch.stack([(losses.float() * mask).sum().double(), mask.sum().double()])

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        batch = self._batches[mb]
        self.template.bind(weights)
        with torch.enable_grad():
            if shard == 0:  # recompute the embedding so that its weights get gradients
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
                self._inputs.pop((mb, 0))
            else:
                hidden = self._inputs.pop((mb, shard)).detach().requires_grad_(True)
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"])
            if shard + 1 == self.plan.num_shards:
                losses = self.template.head_loss(out, batch["labels"])
                mask = batch["loss_mask"].float()
                scale = 1.0 / (mask.sum().clamp(min=1.0) * self.args.num_microbatches * self.world)
                (losses.float() * mask).sum().mul(scale).backward()
            else:
                out.backward(self._output_grads.pop((mb, shard)))
        if shard > 0:
            self._output_grads[(mb, shard - 1)] = hidden.grad
        self.template.layer_grads_into(grad_buffer)
        if shard == 0:
            self._batches.pop(mb)

    def optimizer_step(self) -> None:
        """Called at the plan's OptimizerStep: all gradients are at their owners."""
        self._grad_norm = self._clip_gradients()
        self._adamw.step()

    # ---- iteration ----------------------------------------------------------------------

    def _reset_step_state(self) -> None:
        self._batches: Dict[int, dict] = {}
        self._inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._output_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self._report = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._grad_norm: Optional[float] = None
        self._rotary = self.template.rotary(self.args.seq_length)

    def _load_microbatch(self, mb: int) -> None:
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(self._data_iterator, self.device)
        self._batches[mb] = dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                                 attention_mask=attention_mask, position_ids=position_ids)

    @property
    def num_data_iterators(self) -> int:
        return 1

    def set_train(self, training: bool) -> None:
        self.template.train(training)

    def train_step(self, data_iterators: List[Iterator]) -> Dict[str, object]:
        self.set_train(True)
        self._data_iterator = data_iterators[0]
        self._reset_step_state()
        for grad in self._main_grads.values():
            grad.zero_()
        for grad in self.replicated_grads():
            grad.zero_()
        self.executor.run(self.plan.actions[self.rank])
        loss_sum, tokens = self._reduce_report()
        return {"loss_sum": loss_sum, "num_tokens": tokens, "grad_norm": self._grad_norm,
                "skipped": False, "loss_scale": None}

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator]) -> Tuple[float, float]:
        self.set_train(False)
        self._data_iterator = data_iterators[0]
        self._reset_step_state()
        self.executor.run(self.plan.actions[self.rank], forward_only=True)
        return self._reduce_report()

    def _reduce_report(self) -> Tuple[float, float]:
        report = self._report.clone()
        dist.all_reduce(report)
        return float(report[0]), float(report[1])

    def _clip_gradients(self) -> float:
        """Megatron's global-norm clipping over owned shards (summed over ranks) and replicated parts."""
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in self._main_grads.values():
            local += grad.double().pow(2).sum()
        dist.all_reduce(local)
        for grad in self.replicated_grads():
            local += grad.double().pow(2).sum()
        norm = math.sqrt(float(local))
        if self.args.clip_grad > 0:
            coeff = self.args.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for grad in list(self._main_grads.values()) + self.replicated_grads():
                    grad.mul_(coeff)
        return norm

    # ---- checkpoint support ---------------------------------------------------------

    def named_master_parameters(self):
        for name, tensor in self._named_masters:
            yield name, tensor, tensor

    def optimizer_state_for(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self._adamw.state.get(master, {})

    def set_optimizer_state(self, master: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        self._adamw.state[master] = state

    def writes_checkpoint(self) -> bool:
        return True

    def skip_in_checkpoint(self, name: str) -> bool:
        """Replicated parts are identical on every rank: rank 0 writes them."""
        return self.rank != 0 and not name.startswith("decoder.layers.")

    def grad_scaler_state(self):
        return None

    def load_grad_scaler_state(self, state) -> None:
        pass

    def after_parameters_loaded(self) -> None:
        pass

    def bytes_sent(self) -> Dict[str, int]:
        return dict(self.executor.bytes_sent)
