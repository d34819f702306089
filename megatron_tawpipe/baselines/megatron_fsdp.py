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
  reduces over every rank that holds a distinct shard instead (megatron-core 0.16.1 and 0.17.1; in
  0.19.2 the same choice sits at ``optimizer/__init__.py:1086-1090`` and ``:678``).
* The gradient average (megatron-core 0.19.x): with an outer sharding, the gradients are reduced through
  an inner-DP helper buffer (``hfsdp_helper_gbuf``) that ``_create_hfsdp_helper_buffer``
  (``megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3718-3741``) builds
  without the buffer's ``gradient_scaling_factor``. The scale then is None, so
  ``gradient_reduce_preprocessing`` (param_and_grad_buffer.py:4740-4742) sums without the 1/dp factor,
  and the outer reduction (param_and_grad_buffer.py:4137-4142) sums too, trusting that the scale was
  applied: the gradients come out dp times too large (Adam and clipping hide it in the loss, not in
  the norm). :func:`restore_hfsdp_grad_scaling` gives each helper buffer its main buffer's factor
  (1/dp, 1 with ``average_in_collective``, None with ``calculate_per_token_loss``), as megatron-core
  0.16.1's ``hsdp_gbuf`` had (param_and_grad_buffer.py:2079-2089 there); a no-op where the factor is set.

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

from megatron_tawpipe.arguments.run_config import ParallelLayout, RunConfig
from megatron_tawpipe.baselines.native import NativeTrainer, ddp_config
from megatron_tawpipe.models.llama import build_llama_model


def megatron_fsdp_config(run: RunConfig):
    """megatron's DDP config for Megatron-FSDP, from the same flags as Megatron-LM's."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return dataclasses.replace(
        ddp_config(run.optimizer, run.precision, interleaved=False),
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=run.layout.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=run.layout.outer_dp_sharding_strategy,
        # Fusing the 1/dp scale into the reduction is NCCL's PREMUL_SUM; gloo scales separately.
        gradient_reduce_div_fusion=nccl,
    )


def fix_grad_stats_group(optimizer, layout: ParallelLayout) -> None:
    """Reduce gradient statistics (norm, zeros) over every rank holding a distinct gradient shard.

    Only needed with an outer ``optim`` sharding (see the module docstring): the shards then span the
    full data-parallel group; without pipeline parallelism (refused with Megatron-FSDP here) that group
    times tensor parallelism is every rank.
    """
    if layout.outer_dp_sharding_strategy == "no_shard":
        return
    assert layout.pipeline_model_parallel_size == 1
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        chained.grad_stats_parallel_group = dist.group.WORLD


def restore_hfsdp_grad_scaling(model) -> int:
    """Give every HFSDP helper gradient buffer its main gradient buffer's scaling factor (see the module
    docstring); return how many were missing it. Only buffers built without a factor are touched."""
    restored = 0
    for group in model.param_and_grad_buffer.parameter_groups:
        helper = getattr(group, "hfsdp_helper_gbuf", None)
        if helper is None or group.main_grad_buffer is None:
            continue
        expected = group.main_grad_buffer.gradient_scaling_factor
        if helper.gradient_scaling_factor is None and expected is not None:
            helper.gradient_scaling_factor = expected
            restored += 1
        assert helper.gradient_scaling_factor == expected, (helper.gradient_scaling_factor, expected)
    return restored


class MegatronFsdpTrainer(NativeTrainer):
    """NativeTrainer with Megatron-FSDP in place of megatron's DDP (no pipelining, one model chunk)."""

    def __init__(self, args, forward_step_func, run: RunConfig):
        super().__init__(args, forward_step_func, run)
        fix_grad_stats_group(self.optimizer, self.run.layout)

    def _build_model_chunks(self, vpp: Optional[int]) -> List[FullyShardedDataParallel]:
        assert vpp is None, "Megatron-FSDP runs without pipelining"
        model = build_llama_model(self.args, self.config, pre_process=True, post_process=True,
                                  compute=self.emulation)
        if self.run.precision.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.config, model)
        device = None if torch.cuda.is_available() else torch.device("cpu")
        wrapped = FullyShardedDataParallel(self.config, megatron_fsdp_config(self.run), model, device=device)
        restore_hfsdp_grad_scaling(wrapped)
        return [wrapped]

    def megatron_model_chunks(self):
        raise NotImplementedError("checkpoints are not supported with --use-megatron-fsdp")

    def gathered_masters(self):
        raise NotImplementedError("checkpoints are not supported with --use-megatron-fsdp")

    def writes_checkpoint(self) -> bool:
        return parallel_state.get_data_parallel_rank() == 0
