"""Weight-passing training: shard ownership, compute callbacks, optimizer, one iteration.

Each rank owns one shard (device-bound storage): its fp32 master weights, its
gradient accumulator and its AdamW state stay on the owner; only compute-dtype
weight copies and fp32 partial gradients travel, as the plan says. The
replicated parts (embedding, final norm, output layer) live on every rank with
fp32 masters; their gradients are all-reduced once per iteration.

Normalisation is Megatron's: every micro-batch contributes its mean token
loss divided by ``N * P`` (micro-batches per rank x data-parallel ranks), so
the summed gradient equals data-parallel training's averaged one.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe import parallel_state
from megatron_tawpipe.data import get_batch
from megatron_tawpipe.model import params_dtype
from megatron_tawpipe.plan import build_plan, link_bytes, validate_plan
from megatron_tawpipe.runtime.executor import Communicators, PlanExecutor
from megatron_tawpipe.runtime.precision import GradScaling, RngSnapshot
from megatron_tawpipe.runtime.shard_model import ShardTemplate


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
    """One rank of a ``weipipe`` / ``tawpipe`` run: the compute side of the plan executor."""

    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        groups = args.tawpipe_num_groups or parallel_state.default_num_groups(self.world)
        self.plan = build_plan(plan_name(args), num_ranks=self.world, num_groups=groups,
                               num_layers=args.num_layers, num_microbatches=args.num_microbatches)
        validate_plan(self.plan)
        self.topology = parallel_state.initialize_weight_pipeline(groups, self.plan.owners)
        self.recompute = not args.tawpipe_no_recompute
        self.template = ShardTemplate(args, self.plan.num_shards, self.device)
        self.shard_numel = self.template.shard_numel
        self.compute_dtype = params_dtype(args)
        self.owned = self.topology.owned_shards()
        self._masters = {s: torch.empty(self.shard_numel, dtype=torch.float32, device=self.device) for s in self.owned}
        self._main_grads = {s: torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device) for s in self.owned}
        for shard, flat in self._masters.items():
            self.template.init_shard(shard, flat)
        self._build_replicated_masters()
        self._build_optimizer()
        self.scaling = GradScaling.from_args(args, self.device)
        self.executor = PlanExecutor(self.plan, self.rank, self, Communicators(self.plan, self.world))
        self._reset_step_state()

    # ---- parameters and optimizer ------------------------------------------------------

    def _build_replicated_masters(self) -> None:
        """fp32 masters (and gradient accumulators) of the replicated parts."""
        self._replicated = self.template.replicated_parameters()
        self._replicated_masters: List[torch.Tensor] = []
        for _, param in self._replicated:
            master = param.data if param.dtype == torch.float32 else param.detach().float().clone()
            master.grad = torch.zeros_like(master)
            self._replicated_masters.append(master)

    def _build_optimizer(self) -> None:
        """AdamW over the owned shards' master views and the replicated masters."""
        decay, no_decay = [], []
        self._named_masters: List[Tuple[str, torch.Tensor]] = []
        for shard in self.owned:
            views = self.template.views(self._masters[shard])
            grad_views = self.template.views(self._main_grads[shard])
            for slot, view, grad in zip(self.template.slots, views, grad_views):
                view.grad = grad
                self._named_masters.append((self.template.global_name(shard, slot), view))
        for (name, _), master in zip(self._replicated, self._replicated_masters):
            self._named_masters.append((name, master))
        for name, master in self._named_masters:
            (no_decay if _no_weight_decay(name, master.shape) else decay).append(master)
        a = self.args
        self._adamw = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, weight_decay=a.weight_decay)
        self.optimizer = _ParamGroupsView(self._adamw)

    def _copy_replicated_masters_to_model(self) -> None:
        with torch.no_grad():
            for (_, param), master in zip(self._replicated, self._replicated_masters):
                if param.data_ptr() != master.data_ptr():
                    param.copy_(master)

    # ---- callbacks used by the executor ---------------------------------------------

    def master(self, shard: int) -> torch.Tensor:
        return self._masters[shard]

    def main_grad(self, shard: int) -> torch.Tensor:
        return self._main_grads[shard]

    def replicated_grads(self) -> List[torch.Tensor]:
        return [master.grad for master in self._replicated_masters]

    def _bind(self, weights: torch.Tensor) -> None:
        if self.recompute:
            self.template.bind(weights)
        else:
            self.template.bind_by_copy(weights)

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        if shard == 0:
            self._load_microbatch(mb)
        batch = self._batches[mb]
        self._bind(weights)
        keep_graph = not self.recompute and torch.is_grad_enabled() and not self._forward_only
        if self.recompute and self._rng is not None:
            self._rng[(mb, shard)] = RngSnapshot.capture()
        with torch.set_grad_enabled(keep_graph):
            if shard == 0:
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
            else:
                hidden = self._inputs[(mb, shard)]
                if keep_graph:
                    hidden = hidden.detach().requires_grad_(True)
                    self._inputs[(mb, shard)] = hidden
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"])
            if shard == 0 and not keep_graph:
                self._inputs[(mb, 0)] = hidden
            if keep_graph:
                self._outputs[(mb, shard)] = out
            if shard + 1 < self.plan.num_shards:
                self._inputs[(mb, shard + 1)] = out.detach() if keep_graph else out
            else:
                losses = self.template.head_loss(out, batch["labels"])
                self._record_loss(mb, losses, batch, keep_graph)

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        batch = self._batches[mb]
        self._bind(weights)
        if self.recompute:
            hidden, out = self._recompute(mb, shard, batch)
        else:
            hidden, out = self._inputs.pop((mb, shard), None), self._outputs.pop((mb, shard))
        if shard + 1 == self.plan.num_shards:
            loss = self._scaled_losses.pop(mb) if not self.recompute else \
                self._scaled_loss(self.template.head_loss(out, batch["labels"]), batch)
            loss.backward()
        else:
            out.backward(self._output_grads.pop((mb, shard)))
        if shard > 0:
            self._output_grads[(mb, shard - 1)] = hidden.grad
        self.template.layer_grads_into(grad_buffer)
        self.template.replicated_grads_into(self.replicated_grads())
        if shard == 0:
            self._batches.pop(mb)

    def _recompute(self, mb: int, shard: int, batch: dict):
        """Full recompute of (mb, shard), replaying the forward's RNG state (dropout)."""
        snapshot = self._rng.pop((mb, shard)) if self._rng is not None else None
        with RngSnapshot.replay(snapshot), torch.enable_grad():
            if shard == 0:  # recompute the embedding so that its weights get gradients
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
                self._inputs.pop((mb, 0))
            else:
                hidden = self._inputs.pop((mb, shard)).detach().requires_grad_(True)
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"])
        return hidden, out

    def _scaled_loss(self, losses: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch["loss_mask"].float()
        scale = 1.0 / (mask.sum().clamp(min=1.0) * self.args.num_microbatches * self.world)
        return self.scaling.scale((losses.float() * mask).sum() * scale)

    def _record_loss(self, mb: int, losses: torch.Tensor, batch: dict, keep_graph: bool) -> None:
        mask = batch["loss_mask"].float()
        loss_sum = (losses.float() * mask).sum()
        self._report += torch.stack([loss_sum.detach().double(), mask.sum().double()])
        if keep_graph:
            self._scaled_losses[mb] = self._scaled_loss(losses, batch)

    def optimizer_step(self) -> None:
        """Called at the plan's OptimizerStep: all gradients are at their owners."""
        grads = list(self._main_grads.values()) + self.replicated_grads()
        found_inf = self.scaling.unscale_and_check(grads)
        if found_inf:
            self._skipped = True
            return
        self._grad_norm = self._clip_gradients()
        self._adamw.step()
        self._copy_replicated_masters_to_model()

    # ---- iteration ----------------------------------------------------------------------

    def _reset_step_state(self, forward_only: bool = False) -> None:
        self._forward_only = forward_only
        self._batches: Dict[int, dict] = {}
        self._inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._output_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self._scaled_losses: Dict[int, torch.Tensor] = {}
        needs_rng = self.args.hidden_dropout > 0 or self.args.attention_dropout > 0
        self._rng: Optional[Dict[Tuple[int, int], RngSnapshot]] = {} if needs_rng else None
        self._report = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._grad_norm: Optional[float] = None
        self._skipped = False
        self._rotary = self.template.rotary(self.args.seq_length)
        self.executor.reset_counters()

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
        for grad in list(self._main_grads.values()) + self.replicated_grads():
            grad.zero_()
        self.executor.run(self.plan.actions[self.rank])
        loss_sum, tokens = self._reduce_report()
        sent = self._reduce_bytes()
        return {"loss_sum": loss_sum, "num_tokens": tokens, "grad_norm": self._grad_norm,
                "skipped": self._skipped, "loss_scale": self.scaling.loss_scale(),
                "extra": {"inter_group_bytes": sent["inter"], "intra_group_bytes": sent["intra"]}}

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator]) -> Tuple[float, float]:
        self.set_train(False)
        self._data_iterator = data_iterators[0]
        self._reset_step_state(forward_only=True)
        self.executor.run(self.plan.actions[self.rank], forward_only=True)
        return self._reduce_report()

    def _reduce_report(self) -> Tuple[float, float]:
        report = self._report.clone()
        dist.all_reduce(report)
        return float(report[0]), float(report[1])

    def _reduce_bytes(self) -> Dict[str, int]:
        """Bytes all ranks sent this iteration, per link class (as the executor counted them)."""
        counts = torch.tensor([self.executor.bytes_sent["intra"], self.executor.bytes_sent["inter"]],
                              dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return {"intra": int(counts[0]), "inter": int(counts[1])}

    def planned_link_bytes(self) -> Dict[str, float]:
        """Bytes per link class per iteration that the plan prescribes, with this run's buffer dtypes."""
        weight_bytes = self.shard_numel * torch.finfo(self.compute_dtype).bits // 8
        grad_bytes = self.shard_numel * 4
        total = {"intra": 0.0, "inter": 0.0}
        for kind, unit in (("weight", weight_bytes), ("grad", grad_bytes)):
            only = dataclasses.replace(self.plan, actions=[
                [a for a in acts if getattr(a, "kind", None) == kind] for acts in self.plan.actions])
            for link, value in link_bytes(only, unit).items():
                total[link] += value
        return total

    def _clip_gradients(self) -> float:
        """Megatron's global-norm clipping over owned shards (summed over ranks) and replicated parts."""
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in self._main_grads.values():
            local += grad.double().pow(2).sum()
        dist.all_reduce(local)
        for grad in self.replicated_grads():
            local += grad.double().pow(2).sum()
        norm = float(local.sqrt())
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
        return self.scaling.state_dict()

    def load_grad_scaler_state(self, state) -> None:
        self.scaling.load_state_dict(state)

    def after_parameters_loaded(self) -> None:
        self._copy_replicated_masters_to_model()

    def close(self) -> None:
        parallel_state.destroy_weight_pipeline()
