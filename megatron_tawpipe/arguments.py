"""Command-line arguments with Megatron-LM's flag names, and their validation.

Megatron-LM's own parser lives in ``megatron.training``, which is not part of
the megatron-core wheel; this parser accepts the same flags (a subset: those
that make sense for dense Llama pre-training) plus ``--pipeline-schedule`` and
the weight-pipeline options. :func:`validate_args` runs before any process
group exists and turns every inconsistency into one :class:`ArgumentError`
line that names the flag.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "weipipe", "tawpipe")
WEIGHT_PASSING_SCHEDULES = ("weipipe", "tawpipe")


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message names the flag."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_llama.py",
        description="Pre-train a Llama-style model with megatron-core, with native or weight-passing pipeline schedules.",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_training_args(parser)
    _add_low_precision_args(parser)
    _add_parallel_args(parser)
    _add_data_args(parser)
    _add_checkpoint_and_logging_args(parser)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive_int, default=4)
    g.add_argument("--hidden-size", type=_positive_int, default=128)
    g.add_argument("--num-attention-heads", type=_positive_int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=_positive_int, default=None)
    g.add_argument("--ffn-hidden-size", type=_positive_int, default=None,
                   help="default: Llama's 8/3 * hidden rounded up to a multiple of 64")
    g.add_argument("--seq-length", type=_positive_int, default=128)
    g.add_argument("--max-position-embeddings", type=_positive_int, default=None,
                   help="default: --seq-length")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (Llama); default ties it to the word embeddings")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "te", "sdpa", "local"],
                   help="auto: Transformer Engine when installed with a GPU, else torch SDPA")
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_positive_int, default=2)
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="default: micro-batch size x data-parallel size")
    g.add_argument("--train-iters", type=_positive_int, default=None)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-warmup-iters", type=_non_negative_int, default=0)
    g.add_argument("--lr-decay-iters", type=_positive_int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16 static loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="stop with the iteration and shard where a NaN/Inf loss or gradient appears (default); "
                        "with --fp16 such steps are skipped and the loss scale lowered instead")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=_positive_int, default=1)


# Megatron-LM's fp8 / fp4 flags (Transformer Engine recipes), recognised so that they are refused
# with a clear message rather than argparse's "unrecognized arguments": (flag, add_argument kwargs).
LOW_PRECISION_FLAGS = (
    ("--fp8-format", {"default": None, "metavar": "{e4m3,hybrid}"}),
    ("--fp8-recipe", {"default": None, "metavar": "{tensorwise,delayed,mxfp8,blockwise,custom}"}),
    ("--fp8-param-gather", {"action": "store_true"}),
    ("--fp8-margin", {"type": int, "default": None}),
    ("--fp8-interval", {"type": int, "default": None}),
    ("--fp8-amax-history-len", {"type": int, "default": None}),
    ("--fp8-amax-compute-algo", {"default": None, "metavar": "{most_recent,max}"}),
    ("--no-fp8-wgrad", {"action": "store_true"}),
    ("--fp8-dot-product-attention", {"action": "store_true"}),
    ("--fp8-multi-head-attention", {"action": "store_true"}),
    ("--first-last-layers-bf16", {"action": "store_true"}),
    ("--fp4-format", {"default": None, "metavar": "{e2m1}"}),
    ("--fp4-recipe", {"default": None, "metavar": "{nvfp4,custom}"}),
    ("--fp4-param-gather", {"action": "store_true"}),
)


def _add_low_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fp8 / fp4 (Megatron-LM's flags; not supported yet: refused)")
    for flag, kwargs in LOW_PRECISION_FLAGS:
        g.add_argument(flag, help=argparse.SUPPRESS, **kwargs)


def _flag_dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _validate_precision(args: argparse.Namespace) -> None:
    """fp8 / fp4 training is refused, naming the flag given and what is supported."""
    for flag, _kwargs in LOW_PRECISION_FLAGS:
        value = getattr(args, _flag_dest(flag), None)
        if value is None or value is False:
            continue
        given = flag if value is True else f"{flag} {value}"
        kind = "fp4" if flag.startswith("--fp4") else "fp8"
        raise ArgumentError(
            f"{given}: {kind} training is not supported yet; train in fp32 (default), --bf16 or --fp16")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--pipeline-schedule", default="1f1b",
                   help=f"one of {', '.join(PIPELINE_SCHEDULES)}")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, default=None)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=10.0,
                   help="a peer that sends nothing for this long is reported as stopped (no silent hangs)")
    g.add_argument("--tawpipe-num-groups", type=_positive_int, default=None,
                   help="groups (nodes) of the weight pipeline; default: one per node")
    g.add_argument("--tawpipe-no-overlap", action="store_true", help="ablation: no weight prefetch")
    g.add_argument("--tawpipe-nccl-faithful", action="store_true",
                   help="weipipe/tawpipe on gloo: run the plan's transfers under NCCL's ordering rules "
                        "(one FIFO per communicator, rendezvous sends), so that a plan that would hang "
                        "on a GPU cluster fails here after --distributed-timeout-minutes, naming rank "
                        "and step (tests; slower)")
    g.add_argument("--tawpipe-microbatches-per-visit", type=_positive_int, default=1,
                   help="tawpipe: micro-batches each rank runs per visit of a shard; the shard is broadcast "
                        "in the group (and its gradient reduced) once per visit, so intra-node traffic falls "
                        "by this factor while boundary activations of that many micro-batches are kept")
    g.add_argument("--tawpipe-no-recompute", action="store_true",
                   help="weipipe/tawpipe: keep each shard's activations instead of recomputing the shard "
                        "in backward (faster, needs memory for N x L/P layers of activations)")
    _add_data_parallel_args(parser)


def _add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallelism (native schedules and FSDP)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the fp32 master weights and optimizer state over the data-parallel ranks "
                        "(megatron's distributed optimizer: reduce-scatter gradients, all-gather weights)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradient buckets while backward goes on")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: all-gather updated weights during the next forward "
                        "(needs --use-distributed-optimizer and --overlap-grad-reduce)")
    g.add_argument("--ddp-bucket-size", type=_positive_int, default=None,
                   help="parameters per gradient-reduction bucket with --overlap-grad-reduce (default: megatron's, "
                        "max(40M, 1M x data-parallel size); smaller buckets start reducing earlier in backward)")
    g.add_argument("--num-distributed-optimizer-instances", type=_positive_int, default=1,
                   help="partial data parallelism: that many replicas of the sharded optimizer state, each over "
                        "consecutive ranks (one per node: reduce-scatter inside the node, one all-reduce "
                        "across nodes per iteration); with --use-torch-fsdp2, the replicas of HSDP's 2-D mesh")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="train with torch FSDP2 (ZeRO-3) instead of megatron's DDP; with "
                        "--num-distributed-optimizer-instances N > 1 it is HSDP: shards inside groups of "
                        "world/N consecutive ranks (a node), replicated across the N groups")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefix(es) of .bin/.idx files, optionally weighted: W1 P1 W2 P2")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of --data-path")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default="NullTokenizer", choices=["SentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=_positive_int, default=None, help="for NullTokenizer")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_true", default=False,
                   help="materialise the S x S causal mask per sample (default: attention applies it implicitly)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false")


def _add_checkpoint_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=_positive_int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only, restart iteration count")
    g.add_argument("--log-interval", type=_positive_int, default=1)
    g.add_argument("--eval-interval", type=_positive_int, default=1000)
    g.add_argument("--eval-iters", type=_non_negative_int, default=10)
    g.add_argument("--metrics-file", default=None, help="write one JSON object per iteration here")
    g.add_argument("--exit-interval", type=_positive_int, default=None, help="stop after this iteration")

    g = parser.add_argument_group("benchmarking")
    g.add_argument("--emulated-compute-times", default=None, metavar="FILE",
                   help="emulated compute: layer/output-layer forward, backward and recompute become sleeps "
                        "of the seconds in FILE (tools/calibrate.py writes it); communication stays real")
    g.add_argument("--timeline-file", default=None, metavar="FILE",
                   help="weipipe/tawpipe: write every rank's measured timeline of the latest training "
                        "iteration (compute and transfers, wall clock) as JSON; draw it with "
                        "tools/plot_schedule.py --timeline FILE")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    fill_defaults(args)
    return args


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = _llama_ffn_size(args.hidden_size)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_query_groups is None or not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args


def _llama_ffn_size(hidden: int) -> int:
    return 64 * ((int(8 * hidden / 3) + 63) // 64)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def weight_passing_runtime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron_tawpipe.runtime.trainer") is not None


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check flags before any process group is created; raise ArgumentError naming the flag."""
    world_size = world_size_from_env() if world_size is None else world_size
    if args.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ArgumentError(
            f"--pipeline-schedule {args.pipeline_schedule!r} is unknown; choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES and not weight_passing_runtime_available():
        raise ArgumentError(
            f"--pipeline-schedule {args.pipeline_schedule} is registered but its runtime is not part of this "
            "version yet; use --pipeline-schedule 1f1b or interleaved")
    _validate_precision(args)
    if args.train_iters is None:
        raise ArgumentError("--train-iters is required")
    if args.emulated_compute_times:
        from megatron_tawpipe.bench.emulated_compute import load_compute_times

        try:
            load_compute_times(args.emulated_compute_times)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (default: --train-iters)")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are mutually exclusive")
    if args.tensor_model_parallel_size != 1:
        raise ArgumentError("--tensor-model-parallel-size must be 1 (tensor parallelism is not supported yet)")
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError(
            f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(
            f"--num-attention-heads {args.num_attention_heads} must be divisible by --num-query-groups {args.num_query_groups}")
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    _validate_parallel_layout(args, world_size)
    _validate_data_parallel(args, world_size)
    _validate_batch(args, world_size)
    if (args.save_interval is not None) and not args.save:
        raise ArgumentError("--save-interval needs --save DIR")
    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ArgumentError(f"{flag} must be in [0, 1), got {value}")
    return args


def _validate_parallel_layout(args: argparse.Namespace, world_size: int) -> None:
    pp = args.pipeline_model_parallel_size
    if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES:
        if pp != 1:
            raise ArgumentError(
                f"--pipeline-schedule {args.pipeline_schedule} uses every rank as a data-parallel rank; "
                f"--pipeline-model-parallel-size must be 1, got {pp}")
        if args.num_layers % world_size:
            raise ArgumentError(
                f"--num-layers {args.num_layers} must be divisible by the number of ranks {world_size} "
                f"for --pipeline-schedule {args.pipeline_schedule}")
        if args.recompute_granularity == "selective":
            raise ArgumentError(
                f"--recompute-granularity selective is not supported with --pipeline-schedule "
                f"{args.pipeline_schedule} (it recomputes whole shards; --tawpipe-no-recompute turns that off)")
        if args.timeline_file and os.path.isdir(args.timeline_file):
            raise ArgumentError(f"--timeline-file {args.timeline_file} is a directory; give a file name")
        if args.tawpipe_microbatches_per_visit != 1 and args.pipeline_schedule != "tawpipe":
            raise ArgumentError("--tawpipe-microbatches-per-visit applies to --pipeline-schedule tawpipe only")
        backend = args.distributed_backend or ("nccl" if _cuda_available() else "gloo")
        if args.tawpipe_nccl_faithful and backend != "gloo":
            raise ArgumentError("--tawpipe-nccl-faithful runs NCCL's rules on gloo: it needs "
                                "--distributed-backend gloo (on NCCL the rules are NCCL's own)")
        groups = args.tawpipe_num_groups
        if groups is not None and world_size % groups:
            raise ArgumentError(
                f"--tawpipe-num-groups {groups} must divide the number of ranks {world_size}")
        return
    if (args.tawpipe_num_groups is not None or args.tawpipe_no_overlap or args.tawpipe_no_recompute
            or args.tawpipe_microbatches_per_visit != 1 or args.timeline_file or args.tawpipe_nccl_faithful):
        raise ArgumentError(
            "--tawpipe-num-groups / --tawpipe-no-overlap / --tawpipe-no-recompute / "
            "--tawpipe-microbatches-per-visit / --tawpipe-nccl-faithful / --timeline-file need "
            "--pipeline-schedule tawpipe or weipipe")
    if world_size % pp:
        raise ArgumentError(
            f"--pipeline-model-parallel-size {pp} must divide the number of ranks {world_size}")
    if args.num_layers % pp:
        raise ArgumentError(
            f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {pp}")
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_schedule == "interleaved":
        if per_virtual is None:
            raise ArgumentError("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage")
        if pp < 2:
            raise ArgumentError("--pipeline-schedule interleaved needs --pipeline-model-parallel-size >= 2")
        if (args.num_layers // pp) % per_virtual or args.num_layers // pp == per_virtual:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} must divide the {args.num_layers // pp} "
                "layers of a pipeline stage into at least two virtual stages")
    elif per_virtual is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --pipeline-schedule interleaved")


def _validate_data_parallel(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's rules for its data-parallel flags, plus what FSDP2 and weight passing allow."""
    instances = args.num_distributed_optimizer_instances
    if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES:
        if args.use_torch_fsdp2 or instances != 1:
            raise ArgumentError(
                f"--use-torch-fsdp2 / --num-distributed-optimizer-instances do not apply to --pipeline-schedule "
                f"{args.pipeline_schedule} (it already spreads weights, gradients and optimizer state over all ranks)")
        if args.use_distributed_optimizer or args.overlap_grad_reduce or args.overlap_param_gather:
            notice(f"--pipeline-schedule {args.pipeline_schedule}: every rank already owns 1/P of the optimizer "
                   "state and transfers overlap compute; --use-distributed-optimizer / --overlap-grad-reduce / "
                   "--overlap-param-gather change nothing")
        return
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    dp = data_parallel_size(args, world_size)
    if args.use_torch_fsdp2:
        if args.pipeline_schedule != "1f1b" or args.pipeline_model_parallel_size != 1:
            raise ArgumentError("--use-torch-fsdp2 shards over all ranks: leave --pipeline-schedule at 1f1b and "
                                "--pipeline-model-parallel-size at 1")
        if args.use_distributed_optimizer or args.overlap_grad_reduce or args.overlap_param_gather:
            raise ArgumentError("--use-torch-fsdp2 replaces megatron's DDP: it always shards the optimizer and "
                                "overlaps its gathers and reductions; drop --use-distributed-optimizer / "
                                "--overlap-grad-reduce / --overlap-param-gather")
        if args.fp16:
            raise ArgumentError("--use-torch-fsdp2 trains in fp32 or --bf16 (fp16 needs a loss scaler FSDP2 "
                                "does not have)")
    if args.ddp_bucket_size is not None and (args.use_torch_fsdp2 or not args.overlap_grad_reduce):
        notice("--ddp-bucket-size changes nothing without --overlap-grad-reduce (megatron's DDP reduces all "
               "gradients at once then) or with --use-torch-fsdp2 (it reduces per layer)")
    if instances != 1 and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        raise ArgumentError("--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer "
                            "(or --use-torch-fsdp2 for HSDP)")
    if dp % instances:
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances} must divide the data-parallel "
                            f"size {dp}")


def notice(message: str) -> None:
    """A one-line notice about a flag that has no effect, printed once by the first rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"notice: {message}", flush=True)


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    if args.pipeline_schedule in WEIGHT_PASSING_SCHEDULES:
        return world_size
    return world_size // args.pipeline_model_parallel_size


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    if args.pipeline_schedule != "interleaved":
        return None
    return args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage


def _validate_batch(args: argparse.Namespace, world_size: int) -> None:
    dp = data_parallel_size(args, world_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} must be divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}")
    num_microbatches = args.global_batch_size // per_step
    if args.pipeline_schedule == "interleaved" and num_microbatches % args.pipeline_model_parallel_size:
        raise ArgumentError(
            f"--pipeline-schedule interleaved needs the number of micro-batches ({num_microbatches}) "
            f"to be a multiple of --pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.data_parallel_size = dp
    args.num_microbatches = num_microbatches


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
