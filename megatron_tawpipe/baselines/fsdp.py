"""FSDP / ZeRO-3 baseline on the same megatron-core Llama model.

The model is the one every schedule trains (``build_llama_model`` with
``llama_config``, deterministic per-parameter initialisation), wrapped with
torch FSDP2: ``fully_shard`` on every decoder layer, then on the root (the
embedding, final norm and output layer). Each rank holds 1/P of every
parameter, gradient and AdamW state; a layer's weights are all-gathered just
before its forward and again before its backward, its gradients are
reduce-scattered after its backward (every micro-batch: ZeRO-3). Each layer
prefetches the next one's all-gather (the previous one's in backward).

Numerics follow megatron's native path so that a run is comparable with
``--pipeline-schedule 1f1b`` on the same seed and batch:

- each micro-batch's loss is its mean token loss divided by the number of
  micro-batches; FSDP averages over data-parallel ranks (megatron's DDP does
  the same with a sum and a 1/dp scale);
- AdamW (megatron's CPU choice, ``decoupled_weight_decay``) with megatron's
  parameter groups: no weight decay on biases and 1-D parameters;
- gradient clipping on the global L2 norm with megatron's ``clip / (norm + 1e-6)``;
- megatron's ``OptimizerParamScheduler`` and the project's metrics file.

fp32 only (``--bf16`` / ``--fp16`` are refused: mixed precision would need
FSDP's MixedPrecisionPolicy, which rounds differently from megatron's
Float16Module + fp32 master weights).

Run it like ``pretrain_llama.py`` (same flags; the pipeline flags must be
left at their defaults)::

    torchrun --nproc-per-node 4 tools/fsdp_baseline.py --num-layers 8 ... --metrics-file m.jsonl
"""

from __future__ import annotations

import math
import time
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.bench import emulated_compute
from megatron_tawpipe.metrics import mean_over_ranks
from megatron_tawpipe.model import build_llama_model, llama_config


class FsdpSetupError(ValueError):
    """The flags do not describe an FSDP baseline run."""


def check_fsdp_args(args) -> None:
    if args.pipeline_schedule != "1f1b" or args.pipeline_model_parallel_size != 1:
        raise FsdpSetupError("the FSDP baseline shards over all ranks: leave --pipeline-schedule at 1f1b and "
                             "--pipeline-model-parallel-size at 1")
    if args.bf16 or args.fp16:
        raise FsdpSetupError("the FSDP baseline runs in fp32 only (no --bf16 / --fp16)")
    if args.recompute_granularity is not None:
        raise FsdpSetupError("the FSDP baseline does not support --recompute-granularity")
    if args.load or args.save:
        raise FsdpSetupError("the FSDP baseline does not read or write checkpoints (--load / --save)")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def megatron_param_groups(model: torch.nn.Module, args) -> List[dict]:
    """megatron's default groups: weight decay on matrices, none on biases and 1-D parameters.

    The keys (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``) are those
    megatron's ``OptimizerParamScheduler`` reads.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if (name.endswith(".bias") or len(param.shape) == 1) else decay).append(param)
    groups = []
    for params, wd_mult in ((decay, 1.0), (no_decay, 0.0)):
        if params:
            groups.append({"params": params, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
                           "max_lr": args.lr, "min_lr": args.min_lr, "default_config": True,
                           "is_expert_parallel": False})
    return groups


class FsdpTrainer:
    """One FSDP2-sharded model with ``train_step`` / ``eval_step`` like the other trainers."""

    def __init__(self, args, reshard_after_forward: bool = True):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        check_fsdp_args(args)
        self.args = args
        self.config = llama_config(args, 1, None)
        model = build_llama_model(args, self.config)
        times = emulated_compute.maybe_load(args)
        if times is not None:
            emulated_compute.emulate_gpt_model(model, times, recompute=False)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        layers = list(model.decoder.layers)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        # Explicit prefetch: start the next layer's all-gather while this one computes. FSDP's implicit
        # prefetch relies on CUDA streams; on CPU/gloo only explicit prefetch overlaps anything.
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        self.model = model
        self.optimizer = torch.optim.AdamW(
            megatron_param_groups(model, args), lr=args.lr, weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, foreach=False)
        # Time in forward/backward calls (FSDP's all-gathers and reduce-scatters run inside them).
        self.last_forward_backward_s = 0.0

    @property
    def num_data_iterators(self) -> int:
        return 1

    def set_train(self, training: bool) -> None:
        self.model.train(training)

    def _micro_batch_loss(self, data_iterator: Iterator) -> Tuple[torch.Tensor, torch.Tensor]:
        from megatron_tawpipe.data import get_batch

        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, _device())
        losses = self.model(tokens, position_ids, attention_mask, labels=labels)
        mask = loss_mask.float().view(-1)
        return torch.sum(losses.float().view(-1) * mask), mask.sum()

    def train_step(self, data_iterators: List[Iterator]) -> Dict[str, object]:
        self.set_train(True)
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(2, dtype=torch.float64, device=_device())
        n = self.args.num_microbatches
        start = time.perf_counter()
        for _ in range(n):
            loss_sum, tokens = self._micro_batch_loss(data_iterators[0])
            (loss_sum / torch.clamp(tokens, min=1) / n).backward()
            totals += torch.stack([loss_sum.detach(), tokens]).to(totals)
        self.last_forward_backward_s = time.perf_counter() - start
        grad_norm = self._clip_gradients()
        if self.args.check_for_nan_in_loss_and_grad and not math.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}")
        self.optimizer.step()
        dist.all_reduce(totals)
        # Forward/backward time including FSDP's blocking collectives: an upper bound on busy time.
        fraction = mean_over_ranks(self.last_forward_backward_s / max(time.perf_counter() - start, 1e-9))
        return {"loss_sum": float(totals[0]), "num_tokens": float(totals[1]), "grad_norm": grad_norm,
                "skipped": False, "loss_scale": None,
                "extra": {"schedule": "fsdp", "forward_backward_fraction": fraction}}

    def _clip_gradients(self) -> float:
        """Global L2 norm of all (sharded) gradients; scale them by megatron's clip coefficient."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=_device())
        for g in grads:
            sq += _local(g).double().pow(2).sum()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        clip = self.args.clip_grad
        if clip and clip > 0:
            coeff = clip / (norm + 1.0e-6)
            if coeff < 1.0:
                for g in grads:
                    _local(g).mul_(coeff)
        return norm

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator]) -> Tuple[float, float]:
        self.set_train(False)
        totals = torch.zeros(2, dtype=torch.float64, device=_device())
        for _ in range(self.args.num_microbatches):
            loss_sum, tokens = self._micro_batch_loss(data_iterators[0])
            totals += torch.stack([loss_sum, tokens]).to(totals)
        dist.all_reduce(totals)
        return float(totals[0]), float(totals[1])

    def param_groups(self):
        return self.optimizer.param_groups

    def close(self) -> None:
        pass


def pretrain_fsdp(args) -> list:
    """``pretrain_llama.py``'s training loop around an ``FsdpTrainer``; returns the records."""
    from megatron_tawpipe.training import pretrain

    check_fsdp_args(args)
    return pretrain(args, trainer_factory=FsdpTrainer)


def main(argv=None) -> int:
    """Command-line entry: the same flags, checks and error handling as ``pretrain_llama.py``."""
    from megatron_tawpipe.launch import run_training

    return run_training(argv, prog="fsdp_baseline.py", check=check_fsdp_args, trainer_factory=FsdpTrainer)
