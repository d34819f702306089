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
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_tawpipe.compat import cpu as cpu_compat
from megatron_tawpipe.arguments import is_weight_passing, virtual_pipeline_size
from megatron_tawpipe.common import launcher
from megatron_tawpipe.common.errors import DistributedSetupError
from megatron_tawpipe.distributed import groups


def check_master_reachable(addr: str, port: int, timeout_s: float, must_connect: bool) -> None:
    """Fail with a clear message instead of hanging in init_process_group.

    The name must resolve at once. Ranks that connect to a store hosted elsewhere
    (every rank under torchrun; ranks > 0 otherwise) retry a TCP connection until
    the distributed timeout: the store may simply not be up yet.
    """
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DistributedSetupError(
            f"MASTER_ADDR {addr!r} does not resolve ({exc.strerror}); set MASTER_ADDR "
            "(torchrun --master-addr) to the address of node 0") from exc
    if not must_connect:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise DistributedSetupError(
                    f"cannot reach MASTER_ADDR:MASTER_PORT {addr}:{port} within {timeout_s:.0f} s ({exc}); "
                    "check --master-addr / --master-port and the network between nodes") from exc
            time.sleep(0.5)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend_for_device(backend: str, cuda: bool) -> None:
    """The backend must move tensors where the run keeps them: NCCL needs GPUs; where a GPU is visible
    the runtime keeps its buffers on it, and gloo cannot send or receive CUDA tensors."""
    if backend == "nccl" and not cuda:
        raise DistributedSetupError("--distributed-backend nccl needs CUDA GPUs and this machine has none "
                                    "(torch.cuda.is_available() is False): use --distributed-backend gloo, "
                                    "the default without a GPU")
    if backend == "gloo" and cuda:
        raise DistributedSetupError("--distributed-backend gloo on a machine with a visible GPU: the run keeps "
                                    "its weights and buffers on the GPU and gloo cannot send or receive CUDA "
                                    "tensors. Use --distributed-backend nccl (the default with GPUs), or hide "
                                    "the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU with gloo -- also what "
                                    "--tawpipe-nccl-faithful needs")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_distributed(args) -> None:
    """Create the default process group (no-op if one exists, e.g. in tests)."""
    cpu_compat.apply()
    groups.set_timeout(args.distributed_timeout_minutes)
    check_backend_for_device(args.distributed_backend or default_backend(), torch.cuda.is_available())
    if dist.is_initialized():
        return
    rank, world_size = launcher.rank(), launcher.world_size()
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    else:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise DistributedSetupError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (launch with torchrun)")
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        check_master_reachable(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               timeout.total_seconds(), must_connect=under_torchrun or rank != 0)
    if torch.cuda.is_available():
        torch.cuda.set_device(launcher.local_rank())
    backend = args.distributed_backend or default_backend()
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def initialize_model_parallel(args) -> None:
    """megatron-core's parallel state: TP, CP and PP as requested for the native schedules; for weight passing,
    PP 1 and TP as requested (the tensor-parallel groups inside the weight pipeline's virtual ranks)."""
    from megatron.core import parallel_state

    weight_passing = is_weight_passing(args.pipeline_schedule)
    pp = 1 if weight_passing else args.pipeline_model_parallel_size
    tp = args.tensor_model_parallel_size
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=args.context_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
            num_distributed_optimizer_instances=(
                1 if args.use_torch_fsdp2 else args.num_distributed_optimizer_instances),
            distributed_timeout_minutes=args.distributed_timeout_minutes,
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
