"""megatron-core's own Megatron-FSDP (``--use-megatron-fsdp``), HFSDP included.

The model is the one every schedule trains (``build_llama_model``, emulated compute included), wrapped
in megatron-core's ``FullyShardedDataParallel`` (``megatron.core.distributed.fsdp.mcore_fsdp_adapter``)
instead of its DDP; everything else is :class:`~megatron_tawpipe.baselines.native.NativeTrainer`:
megatron's optimizer (``get_megatron_optimizer`` with the distributed optimizer), megatron's schedule
without pipelining, ``finalize_model_grads``. Megatron-LM's flags::

    --use-megatron-fsdp --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --data-parallel-sharding-strategy optim_grads_params        # inside an optimizer instance (a node)
    --outer-dp-sharding-strategy optim                          # HFSDP: optimizer state also across nodes
    --num-distributed-optimizer-instances N                     # N instances of consecutive ranks

Two things the path must get right (both as Megatron-LM's training loop does, or works around):

* ``config.no_sync_func = model.no_sync`` (set by NativeTrainer): Megatron-FSDP reduces gradients across
  optimizer instances only when the backward runs outside ``no_sync()`` (``is_last_microbatch``,
  megatron_fsdp.py:660-672 and 1044-1055 in megatron-core 0.16.1); without it the outer reduction
  never happens.
* The gradient norm (and so clipping): with ``--outer-dp-sharding-strategy optim``, megatron-core's
  ``get_megatron_optimizer`` reduces the norm over one optimizer instance
  (``megatron/core/optimizer/__init__.py:459``, ``grad_stats_parallel_group = intra_dist_opt_group``),
  but the gradient shards then span the whole data-parallel group: each instance holds only part of the
  gradient, so the reported norm is too small and clipping too weak. :func:`fix_grad_stats_group`
  reduces over every rank that holds a distinct shard instead (megatron-core 0.16.1 and 0.17.1).

On the CPU (gloo), :mod:`megatron_tawpipe.compat.cpu` runs the CUDA streams, events and allocations
on the host, the wrapper gets ``device=cpu``, and ``gradient_reduce_div_fusion`` is off (it needs
NCCL's ``PREMUL_SUM``, param_and_grad_buffer.py:3772).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import FullyShardedDataParallel

from megatron_tawpipe.baselines.native import NativeTrainer, ddp_config
from megatron_tawpipe.models.llama import build_llama_model


def megatron_fsdp_config(args):
    """megatron's DDP config for Megatron-FSDP, from the same flags as Megatron-LM's."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return dataclasses.replace(
        ddp_config(args),
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        # Fusing the 1/dp scale into the reduction is NCCL's PREMUL_SUM; gloo scales separately.
        gradient_reduce_div_fusion=nccl,
    )


def fix_grad_stats_group(optimizer, args) -> None:
    """Reduce gradient statistics (norm, zeros) over every rank holding a distinct gradient shard.

    Only needed with an outer ``optim`` sharding (see the module docstring): the shards then span the
    full data-parallel group; without pipeline parallelism (refused with Megatron-FSDP here) that group
    times tensor parallelism is every rank.
    """
    if args.outer_dp_sharding_strategy == "no_shard":
        return
    assert args.pipeline_model_parallel_size == 1
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        chained.grad_stats_parallel_group = dist.group.WORLD


class MegatronFsdpTrainer(NativeTrainer):
    """NativeTrainer with Megatron-FSDP in place of megatron's DDP (no pipelining, one model chunk)."""

    def __init__(self, args, forward_step_func):
        super().__init__(args, forward_step_func)
        fix_grad_stats_group(self.optimizer, args)

    def _build_model_chunks(self, vpp: Optional[int]) -> List[FullyShardedDataParallel]:
        assert vpp is None, "Megatron-FSDP runs without pipelining"
        model = build_llama_model(self.args, self.config, pre_process=True, post_process=True,
                                  compute=self.emulation)
        if self.args.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.config, model)
        device = None if torch.cuda.is_available() else torch.device("cpu")
        return [FullyShardedDataParallel(self.config, megatron_fsdp_config(self.args), model, device=device)]

    def megatron_sharded_state_dict(self, with_optimizer: bool) -> dict:
        raise NotImplementedError("checkpoints are not supported with --use-megatron-fsdp")

    def gathered_masters(self):
        raise NotImplementedError("checkpoints are not supported with --use-megatron-fsdp")

    def writes_checkpoint(self) -> bool:
        return parallel_state.get_data_parallel_rank() == 0
