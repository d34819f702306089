"""FSDP (ZeRO-3) and HSDP on the same megatron-core Llama model: ``--use-torch-fsdp2``.

The model is the one every schedule trains (``build_llama_model`` with
``llama_config``, deterministic per-parameter initialisation), wrapped with
torch FSDP2: ``fully_shard`` on every decoder layer, then on the root (the
embedding, final norm and output layer). A layer's weights are all-gathered
just before its forward and again before its backward, its gradients are
reduce-scattered after its backward, every micro-batch; each layer prefetches
the next one's all-gather (the previous one's in backward).

* FSDP: one mesh dimension over all ranks; each rank holds 1/P of every
  parameter, gradient and AdamW state.
* HSDP (``--num-distributed-optimizer-instances N`` > 1): a 2-D mesh
  (N replicas, world/N ranks per replica; a replica is consecutive ranks,
  i.e. a node under torchrun). Gathers and reduce-scatters stay inside the
  replica; the shard's gradient is all-reduced across replicas once per
  iteration, on the last micro-batch (``set_requires_all_reduce``).

Numerics follow megatron's native path so that a run is comparable with
``--pipeline-schedule 1f1b`` on the same seed and batch:

- each micro-batch's loss is its mean token loss divided by the number of
  micro-batches; FSDP averages over data-parallel ranks (megatron's DDP does
  the same with a sum and a 1/dp scale);
- AdamW (megatron's CPU choice, ``decoupled_weight_decay``) with megatron's
  parameter groups: no weight decay on biases and 1-D parameters; the fused
  kernel on CUDA, foreach on the CPU;
- gradient clipping on the global L2 norm with megatron's ``clip / (norm + 1e-6)``;
- ``--bf16``: FSDP2's mixed-precision policy, bf16 weights in forward and
  backward, fp32 sharded master weights, gradients reduced and accumulated in
  fp32 (megatron's ``grad_reduce_in_fp32``); the initial weights are rounded
  to bf16 first, as megatron's fp32 masters are copies of bf16 weights;
- ``--recompute-granularity full``: megatron's own activation recompute inside the
  model; FSDP2 gathers a layer's weights again for its recomputed forward;
- megatron's ``OptimizerParamScheduler``, the project's metrics file and its
  checkpoint format (whole tensors, gathered on save and sliced on load:
  :mod:`.sharded_state`), so a run resumes under any other strategy.

Run it with ``pretrain_llama.py``'s flags::

    torchrun --nnodes 2 --nproc-per-node 8 pretrain_llama.py ... --bf16 \
        --use-torch-fsdp2 --num-distributed-optimizer-instances 2      # HSDP, one replica per node
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.run_config import RunConfig
from megatron_tawpipe.common.checkpointable import CheckpointDefaults
from megatron_tawpipe.common.step import StepResult
from megatron_tawpipe.emulation.compute import EmulatedCompute
from megatron_tawpipe.monitor.metrics import mean_over_ranks
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.baselines.sharded_state import fsdp_target, gather_fsdp
from megatron_tawpipe.models.llama import build_llama_model, llama_config
from megatron_tawpipe.models.parameters import global_parameter_names
from megatron_tawpipe.optimizer.clip import clip_gradients_, squared_l2_norm
from megatron_tawpipe.optimizer.param_groups import megatron_param_groups


def build_mesh(replicas: int):
    """FSDP's 1-D mesh over all ranks, or HSDP's (replicas, ranks per replica) mesh.

    ``init_device_mesh`` lays ranks out row-major, so a replica is a block of consecutive ranks:
    a node under torchrun.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    if replicas == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(run: RunConfig) -> dict:
    """``fully_shard`` keyword for ``--bf16``: bf16 compute, fp32 reductions and accumulation (bf16
    reductions with --grad-reduce-in-bf16, Megatron-LM's flag for megatron's DDP)."""
    if not run.precision.bf16:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce_dtype = torch.bfloat16 if run.optimizer.grad_reduce_in_bf16 else torch.float32
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpTrainer(CheckpointDefaults):
    """One FSDP2-sharded model with ``train_step`` / ``eval_step`` like the other trainers."""

    def __init__(self, args, forward_step_func, run: RunConfig, *, reshard_after_forward: bool = True):
        """``run``: the records of ``args`` (``training.build_trainer`` reads them when not given)."""
        from torch.distributed.fsdp import fully_shard

        self.args = args
        self.run = run
        self.forward_step_func = forward_step_func   # megatron's (data_iterator, model) -> (output, loss_func)
        self.replicas = run.optimizer.num_distributed_optimizer_instances
        # fp32 parameters (FSDP's sharded masters); --bf16 is FSDP's mixed-precision policy below.
        fp32_args = copy.copy(args)
        fp32_args.bf16 = False
        self.config = llama_config(fp32_args, 1, None)
        self.emulation = EmulatedCompute.from_args(args, recompute=run.training.recompute_granularity == "full")
        model = build_llama_model(fp32_args, self.config, compute=self.emulation)
        if run.precision.bf16:
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16))
        self.mesh = build_mesh(self.replicas)
        policy = mixed_precision_policy(run)
        layers = list(model.decoder.layers)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard_after_forward, **policy)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard_after_forward, **policy)
        # megatron's GPTModel returns its per-token losses as a view; FSDP2 warns that an in-place op on
        # it would skip a hook. The loss is only read out of place here (_micro_batch_loss).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        # Explicit prefetch: start the next layer's all-gather while this one computes. FSDP's implicit
        # prefetch relies on CUDA streams; on CPU/gloo only explicit prefetch overlaps anything.
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        self.model = model
        kernel = {"fused": True} if torch.cuda.is_available() else {"foreach": True}
        self.optimizer = torch.optim.AdamW(
            megatron_param_groups(((n, p) for n, p in model.named_parameters() if p.requires_grad), args),
            lr=run.optimizer.lr, weight_decay=run.optimizer.weight_decay,
            betas=(run.optimizer.adam_beta1, run.optimizer.adam_beta2), eps=run.optimizer.adam_eps, **kernel)
        # Time in forward/backward calls (FSDP's all-gathers and reduce-scatters run inside them).
        self.last_forward_backward_s = 0.0

    @property
    def num_data_iterators(self) -> int:
        return 1

    def set_train(self, training: bool) -> None:
        self.model.train(training)

    def _micro_batch_loss(self, data_iterator: Iterator) -> Tuple[torch.Tensor, torch.Tensor]:
        """(loss summed over the micro-batch's loss tokens, their count) from the forward step's loss function."""
        output, loss_func = self.forward_step_func(data_iterator, self.model)
        loss_sum, num_tokens, _ = loss_func(output)
        return loss_sum, num_tokens.to(loss_sum.dtype)

    def train_step(self, data_iterators: List[Iterator], num_microbatches: int) -> StepResult:
        if self.emulation is not None:
            self.emulation.start_step()
        self.set_train(True)
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(2, dtype=torch.float64, device=current_device())
        n = num_microbatches
        start = time.perf_counter()
        for i in range(n):
            if self.replicas > 1:  # HSDP: across replicas once per iteration, with the last backward
                self.model.set_requires_all_reduce(i == n - 1)
            loss_sum, tokens = self._micro_batch_loss(data_iterators[0])
            (loss_sum / torch.clamp(tokens, min=1) / n).backward()
            totals += torch.stack([loss_sum.detach(), tokens]).to(totals)
        self.last_forward_backward_s = time.perf_counter() - start
        grad_norm = self._clip_gradients()
        if self.run.optimizer.check_for_nan_in_loss_and_grad and not math.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}")
        self.optimizer.step()
        dist.all_reduce(totals)
        # Forward/backward time including FSDP's blocking collectives: an upper bound on busy time.
        fraction = mean_over_ranks(self.last_forward_backward_s / max(time.perf_counter() - start, 1e-9))
        return StepResult(loss_sum=float(totals[0]), num_tokens=float(totals[1]), grad_norm=grad_norm,
                          skipped=False, loss_scale=None,
                          slept_s=self.emulation.take_slept_s() if self.emulation is not None else None,
                          extra={"schedule": self.schedule_name, "forward_backward_fraction": fraction})

    @property
    def schedule_name(self) -> str:
        return "hsdp" if self.replicas > 1 else "fsdp"

    def _clip_gradients(self) -> float:
        """Global L2 norm of all (sharded) gradients; scale them by megatron's clip coefficient.

        The shards of one replica make up every gradient once: the squares are summed over the
        shard dimension of the mesh only (HSDP's replicas hold equal copies).
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = squared_l2_norm([_local(g) for g in grads], current_device())
        dist.all_reduce(sq, group=self.shard_group)
        norm = float(sq.sqrt())
        clip_gradients_([_local(g) for g in grads], self.run.optimizer.clip_grad, norm)
        return norm

    @torch.no_grad()
    def eval_step(self, data_iterators: List[Iterator], num_microbatches: int) -> Tuple[float, float]:
        self.set_train(False)
        totals = torch.zeros(2, dtype=torch.float64, device=current_device())
        for _ in range(num_microbatches):
            loss_sum, tokens = self._micro_batch_loss(data_iterators[0])
            totals += torch.stack([loss_sum, tokens]).to(totals)
        dist.all_reduce(totals)
        return float(totals[0]), float(totals[1])

    # ---- checkpoint support (the common format; see baselines.sharded_state) -----------------

    def _named_parameters(self):
        return list(global_parameter_names(self.model))

    def named_master_parameters(self):
        """``(global name, target, target)``: each target copies this rank's shard of a whole tensor."""
        for name, param in self._named_parameters():
            target = fsdp_target(param, self.optimizer)
            yield name, target, target

    def gathered_masters(self):
        """Whole parameters and AdamW state (every rank calls this; the first rank keeps them)."""
        return gather_fsdp(self._named_parameters(), self.optimizer, keep=self.writes_checkpoint())

    def optimizer_state_for(self, master):
        """Not used: FSDP2's masters and Adam state are sharded, so checkpoints always take them whole from
        :meth:`gathered_masters`."""
        raise TypeError("FSDP2 writes checkpoints from gathered_masters(); a shard has no whole optimizer state")

    def set_optimizer_state(self, master, state) -> None:
        master.store_state(state)

    def writes_checkpoint(self) -> bool:
        return dist.get_rank() == 0

    def skip_in_checkpoint(self, name: str) -> bool:
        return False

    def grad_scaler_state(self):
        return None

    def load_grad_scaler_state(self, state) -> None:
        pass

    def after_parameters_loaded(self) -> None:
        pass

    @property
    def shard_group(self):
        return self.mesh["shard"].get_group() if self.replicas > 1 else self.mesh.get_group()

    def param_groups(self):
        return self.optimizer.param_groups

    def close(self) -> None:
        pass
