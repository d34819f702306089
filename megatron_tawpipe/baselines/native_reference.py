"""megatron-core's own model and non-distributed optimizer over the whole model (tensor/pipeline size 1), built
beside a weight-passing run (every rank builds it: megatron-core agrees its parameter groups over all ranks) for Megatron-LM's legacy ``--ckpt-format torch`` files: the checkpoint code puts the
run's whole masters and Adam moments into it and lets megatron-core write (``optimizer.state_dict()``) or read
(``load_state_dict``) its optimizer state, so the parameter order is megatron-core's own."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_tawpipe.arguments.run_config import RunConfig
from megatron_tawpipe.baselines.native import NativeTrainer


def native_reference_trainer(args, forward_step_func) -> NativeTrainer:
    """A :class:`NativeTrainer` of ``args``' model as a native run at tensor/pipeline size 1 with megatron-core's
    non-distributed optimizer builds it (collective); the RNG states are left as they were."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    reference = argparse.Namespace(**vars(args))
    reference.pipeline_schedule = "1f1b"
    reference.tensor_model_parallel_size = reference.pipeline_model_parallel_size = 1
    reference.num_layers_per_virtual_pipeline_stage = reference.virtual_pipeline_model_parallel_size = None
    reference.use_distributed_optimizer = reference.use_torch_fsdp2 = reference.use_megatron_fsdp = False
    reference.overlap_grad_reduce = reference.overlap_param_gather = False
    reference.sequence_parallel = False
    reference.use_precision_aware_optimizer = False   # (megatron-core's needs the distributed optimizer)
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state() if torch.cuda.is_available() else None, get_cuda_rng_tracker().get_states())
    try:
        return NativeTrainer(reference, forward_step_func,
                             RunConfig.from_args(reference, world_size=dist.get_world_size()))
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state(states[3])
        get_cuda_rng_tracker().set_states(states[4])
