"""One-rank training runs in this process, through the project's own entry points.

A run is what ``python pretrain_llama.py ...`` does with a world of one:
:func:`megatron_tawpipe.arguments.parse_args` / ``validate_args``, then
:func:`megatron_tawpipe.training.pretrain`, which creates a single-rank
process group (NCCL on a GPU, gloo on the CPU) on a free local port, trains
and returns the per-iteration records; the groups are destroyed afterwards so
that the next run starts clean.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

from megatron_tawpipe.arguments import TOOL_FLAGS, llama_ffn_hidden_size

_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1"}


@dataclass(frozen=True)
class LlamaRun:
    """The model and batch of a one-rank run (pretrain_llama.py's flags)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    dtype: str                     # "bf16" or "fp32"
    attention_backend: str = "auto"
    ffn_hidden_size: Optional[int] = None      # default: Llama's 8H/3 rounded up to 64
    num_query_groups: Optional[int] = None     # default: as many as attention heads
    seed: int = 1234

    def argv(self, *schedule_flags: str) -> List[str]:
        """pretrain_llama.py's flags for this model, then ``schedule_flags``."""
        flags = list(TOOL_FLAGS) + [
            "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.num_attention_heads),
            "--seq-length", str(self.seq_length), "--max-position-embeddings", str(self.seq_length),
            "--vocab-size", str(self.vocab_size), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--untie-embeddings-and-output-weights", "--attention-backend", self.attention_backend,
            "--micro-batch-size", str(self.micro_batch_size),
            "--global-batch-size", str(self.global_batch_size), "--train-iters", str(self.train_iters),
            "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
            "--clip-grad", "1.0", "--seed", str(self.seed),
            "--eval-interval", "1000000", "--log-interval", "1000000",
        ]
        flags += ["--ffn-hidden-size", str(self.ffn_hidden_size or llama_ffn_hidden_size(self.hidden_size))]
        if self.num_query_groups and self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.dtype == "bf16":
            flags.append("--bf16")
        return flags + list(schedule_flags)


# one rank's TawPipe, its layout pinned (one shard, one micro-batch per visit): the checks compare this runtime
# with the simulator's plan of the same layout, not the layout a run would decide
TAWPIPE_FLAGS = ("--pipeline-schedule", "tawpipe", "--tawpipe-ownership", "owner", "--tawpipe-shards-per-rank", "1",
                 "--tawpipe-cache", "off", "--tawpipe-microbatches-per-visit", "1", "--no-tawpipe-replicate-first-shard",
                 "--tawpipe-replicated-reduce", "hierarchical", "--tawpipe-recompute", "on")
NATIVE_1F1B_FLAGS = ("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def single_rank_environment() -> Iterator[None]:
    """RANK/WORLD_SIZE/MASTER_* of a world of one on a free port, restored afterwards.

    ``sys.excepthook`` is restored too: every ``init_process_group`` wraps it to prefix
    the rank, and several runs in one process would stack the prefixes.
    """
    wanted = dict(_RANK_ENV, MASTER_PORT=str(free_port()))
    saved = {key: os.environ.get(key) for key in wanted}
    excepthook = sys.excepthook
    os.environ.update(wanted)
    try:
        yield
    finally:
        sys.excepthook = excepthook
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parsed_args(run: LlamaRun, *schedule_flags: str):
    """The validated pretraining arguments of ``run`` for a world of one.

    ``padded_vocab_size`` is set by the tokenizer, as in training (NullTokenizer: the
    vocabulary plus an end-of-document id, padded).
    """
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.data import build_tokenizer

    args = validate_args(parse_args(run.argv(*schedule_flags)), world_size=1)
    build_tokenizer(args)
    return args


@contextlib.contextmanager
def one_rank_process_group(args) -> Iterator[None]:
    """A world of one (NCCL on a GPU, gloo on the CPU) and megatron's parallel state, torn down after."""
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel

    with single_rank_environment():
        initialize_distributed(args)
        try:
            initialize_model_parallel(args)
            yield
        finally:
            destroy()


def train_one_rank(argv: List[str], trainer_factory: Optional[Callable] = None) -> List[Dict[str, object]]:
    """Train a world of one with pretrain_llama.py's flags ``argv``; return the iteration records."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    args = validate_args(parse_args(argv), world_size=1)
    with single_rank_environment():
        try:
            return [record.to_json() for record in pretrain(args, gpt_forward_step, trainer_factory=trainer_factory)]
        finally:
            destroy()


class TrainerCapture:
    """A ``trainer_factory`` for :func:`train_one_rank` that keeps the trainer it builds.

    The trainer (and every tensor it holds) stays reachable after training, so
    that what one rank keeps can be counted (:mod:`.memory`).
    """

    def __init__(self):
        self.trainer = None

    def __call__(self, args, forward_step_func, run=None):
        from megatron_tawpipe.training import build_trainer

        self.trainer = build_trainer(args, forward_step_func, run)
        return self.trainer


def relative_loss_differences(candidate: List[float], reference: List[float]) -> List[float]:
    """``|candidate - reference| / |reference|`` per iteration."""
    if len(candidate) != len(reference):
        raise ValueError(f"{len(candidate)} losses against {len(reference)} reference losses")
    return [abs(c - r) / max(abs(r), 1e-30) for c, r in zip(candidate, reference)]
