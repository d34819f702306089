"""Process-group and megatron-core parallel-state set-up and tear-down.

torchrun (or Slurm via torchrun) sets RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT; a plain ``python pretrain_llama.py`` runs as a world of one.
NCCL on GPUs, gloo on CPUs: no launcher or transport of our own.
"""

from __future__ import annotations

import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron_tawpipe import cpu_compat
from megatron_tawpipe.arguments import WEIGHT_PASSING_SCHEDULES, virtual_pipeline_size


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_distributed(args) -> None:
    """Create the default process group (no-op if one exists, e.g. in tests)."""
    cpu_compat.apply()
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = args.distributed_backend or default_backend()
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
    )


def initialize_model_parallel(args) -> None:
    """megatron-core's parallel state: TP = 1; PP as requested (1 for weight passing)."""
    from megatron.core import parallel_state

    pp = 1 if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES else args.pipeline_model_parallel_size
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        )
    set_seeds(args.seed)


def set_seeds(seed: int) -> None:
    """Host RNGs and megatron's RNG tracker (used by dropout) from one seed.

    Every rank seeds identically: model weights do not depend on these RNGs
    (see model.init_llama_weights), and megatron offsets the tensor-parallel
    stream by the TP rank itself.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
