"""The flags of ``pretrain_llama.py``: Megatron-LM's names, meanings and defaults, plus
``--pipeline-schedule`` and the weight-pipeline options; parsing and Megatron-LM's derived defaults.

Megatron-LM's own parser lives in ``megatron.training``, which is not part of the megatron-core
0.16 wheel; this one defines the flags this project implements, and answers the rest of Megatron-LM's
(:mod:`megatron_tawpipe.compat.megatron_lm`) in one line each.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_tawpipe.compat.megatron_lm import NOTICES, add_compat_args, explain_unknown, settle_compat_flags
from megatron_tawpipe.common.errors import ArgumentError
from megatron_tawpipe.arguments.choices import (ASYNC_STRATEGIES, CKPT_FORMATS, FILE_TOKENIZERS,  # noqa: F401
                                                MEGATRON_LM_ONLY_CKPT_FORMATS, SENTENCEPIECE_TOKENIZERS,
                                                SUPPORTED_TOKENIZERS, TOKENIZER_TYPES, non_negative_int,
                                                positive_float, positive_int)
from megatron_tawpipe.arguments.weight_passing import (PIPELINE_SCHEDULES, PLAN_FILE_PREFIX,  # noqa: F401
                                                       WEIGHT_PASSING_SCHEDULES, add_tawpipe_args,
                                                       is_weight_passing, plan_file_of)
from megatron_tawpipe.arguments.checkpoint_logging import add_checkpoint_and_logging_args
from megatron_tawpipe.arguments.native_pipeline import add_native_pipeline_args, native_pipeline_notices

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_llama.py",
        description="Pre-train a Llama-style model with megatron-core, with native or weight-passing pipeline schedules.",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_data_args(parser)
    add_checkpoint_and_logging_args(parser)
    add_native_pipeline_args(parser)
    add_tawpipe_args(parser)
    add_compat_args(parser)
    parser.set_defaults(**RUN_VALUES)
    return parser


# Values of a run that no flag gives, set on the parsed flags later; declared here so that every parsed
# namespace has them: validate_args' global batch schedule, the tokenizer's padded vocabulary, the time the
# job started (cli.pretrain), the checkpoint loaded (checkpoint.load_checkpoint).
RUN_VALUES = {"batch_schedule": None, "padded_vocab_size": None, "program_start_time": None,
              "loaded_checkpoint": None}


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
# Megatron-LM's --attention-backend values, then this project's: te (Transformer Engine, its own
# choice of kernel) and sdpa (torch's scaled_dot_product_attention under megatron-core's local layer).
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "te", "sdpa")


def _normalization(text: str) -> str:
    """LayerNorm / RMSNorm; Megatron-DeepSpeed's lower-case spellings are taken too."""
    for name in NORMALIZATIONS:
        if text == name or text == name.lower():
            return name
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(NORMALIZATIONS)}, got {text}")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, with Megatron-LM's flags and defaults (a GPT: LayerNorm, GELU, biases, learned
    positions, dropout 0.1). Llama is --normalization RMSNorm --swiglu --disable-bias-linear
    --position-embedding-type rope --hidden-dropout 0 --attention-dropout 0 (LLAMA_FLAGS)."""
    g = parser.add_argument_group("model (Megatron-LM's flags and defaults)")
    g.add_argument("--num-layers", type=positive_int, default=4)
    g.add_argument("--hidden-size", type=positive_int, default=128)
    g.add_argument("--num-attention-heads", type=positive_int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=positive_int, default=None,
                   help="with --group-query-attention (default 1, as Megatron-LM)")
    g.add_argument("--num-key-value-heads", type=positive_int, default=None,
                   help="Megatron-DeepSpeed's spelling of --group-query-attention --num-query-groups N")
    g.add_argument("--kv-channels", type=positive_int, default=None, help="default: hidden / heads")
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                   help="default: 4 x hidden; with --swiglu int(8 x hidden / 3 / 64) x 64, as Megatron-LM")
    g.add_argument("--seq-length", type=positive_int, default=128)
    g.add_argument("--max-position-embeddings", type=positive_int, default=None,
                   help="default: --seq-length")
    g.add_argument("--normalization", type=_normalization, default="LayerNorm",
                   metavar="{LayerNorm,RMSNorm}")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: stored as gamma - 1, applied as (1 + weight); LayerNorm and RMSNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (Llama) instead of GELU")
    g.add_argument("--squared-relu", action="store_true", help="squared-ReLU MLP instead of GELU")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=True,
                   help="no biases in the linear layers (Llama)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query/key/value projection only (on anyway without --disable-bias-linear)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDING_TYPES)
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false", default=True,
                   help="Megatron-LM's older flag; only valid with rope, where it changes nothing")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 rotary frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q.K^T by 1/layer number (implies --attention-softmax-in-fp32)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (Llama); default ties it to the word embeddings")
    g.add_argument("--transformer-impl", default=None, choices=TRANSFORMER_IMPLS,
                   help="default: transformer_engine where it is installed with a GPU, else local")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: Transformer Engine's choice with TE, else torch SDPA; local: megatron-core's "
                        "unfused attention; flash/fused/unfused: Transformer Engine's kernels")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)


# The Llama architecture in Megatron-LM's flags: what examples, tools and tests pass.
LLAMA_FLAGS = ("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
               "--attention-softmax-in-fp32", "--no-create-attention-mask-in-dataloader")
# What this project's measuring tools pass besides: Llama, no validation pass (they measure
# training), data loaded in the training process (no worker processes competing for the cores).
TOOL_FLAGS = LLAMA_FLAGS + ("--eval-iters", "0", "--num-workers", "0")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training (Megatron-LM's flags and defaults)")
    g.add_argument("--micro-batch-size", type=positive_int, default=2)
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="default: micro-batch size x data-parallel size")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="\"THRESHOLD:BATCH ...\"",
                   help="instead of --global-batch-size: the global batch steps up as training proceeds, e.g. "
                        "\"0:16 2.4B:320\" (thresholds in tokens, K/M/B/T suffixes; Megatron-LM's format)")
    g.add_argument("--train-iters", type=positive_int, default=None)
    g.add_argument("--train-samples", type=positive_int, default=None,
                   help="instead of --train-iters: train on this many samples (floor(samples / global batch) "
                        "iterations); LR warmup and decay are then given in samples")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (required, as in Megatron-LM)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-warmup-iters", type=non_negative_int, default=0)
    g.add_argument("--lr-warmup-samples", type=non_negative_int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay span (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=positive_int, default=None, help="default: --train-samples")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=positive_int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=positive_int, default=None)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, take the schedule from these flags, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, take the schedule from the checkpoint")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the word embeddings and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their minimum learning rate (default --min-lr)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap",
                                                           "adaptive_muon"],
                   help="adam (AdamW, decoupled weight decay, as Megatron-LM's adam); the others are refused")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16 static loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="native schedules: accumulate and reduce gradients in fp32 (on by default with --bf16)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="native schedules with --bf16: reduce gradients in bf16")
    # Megatron-LM's precision-aware optimizer (megatron-core's OptimizerConfig fields of the same names);
    # 'fp8' is megatron's name for Transformer Engine's scaled fp8 storage (torch.uint8).
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="keep main gradients, main parameters and Adam's moments in the dtypes below")
    g.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="dtype of the main gradients (accumulators and, with weight passing, the travelling "
                        "partial gradients); bf16 needs --bf16 and --use-precision-aware-optimizer")
    g.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"],
                   help="dtype of the main (master) parameters with --use-precision-aware-optimizer")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="dtype Adam's first moment is stored in with --use-precision-aware-optimizer "
                        "(the update is computed in fp32)")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="dtype Adam's second moment is stored in with --use-precision-aware-optimizer")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over the tokens of the whole global batch")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused cross entropy (with CUDA)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="stop with the iteration and shard where a NaN/Inf loss or gradient appears (default); "
                        "with --fp16 such steps are skipped and the loss scale lowered instead")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with --recompute-granularity full; default uniform")
    g.add_argument("--recompute-num-layers", type=positive_int, default=None,
                   help="with --recompute-granularity full; default 1")
    g.add_argument("--exit-duration-in-mins", type=positive_float, default=None,
                   help="stop (saving a checkpoint with --save) once the run has lasted this long")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (or --exit-signal), save a checkpoint with --save after the current iteration "
                        "and exit (Slurm preemption)")
    g.add_argument("--exit-signal", default="SIGTERM",
                   help="the signal --exit-signal-handler waits for, by name (SIGTERM, SIGUSR1, ...)")
    # Fusions Megatron-LM turns on by default and these flags turn off; with CUDA they decide, on a
    # CPU every fused kernel is off anyway.
    for flag, dest in (("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
                       ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                       ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
                       ("--no-rope-fusion", "apply_rope_fusion"),
                       ("--no-persist-layer-norm", "persist_layer_norm")):
        g.add_argument(flag, dest=dest, action="store_false", default=True)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--context-parallel-size", type=positive_int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive_int, default=None,
                   help="decoder layers of the first pipeline stage (weight-passing schedules: of the first shard)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive_int, default=None,
                   help="decoder layers of the last pipeline stage (weight-passing schedules: of the last shard)")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="every stage's layers, megatron-core's layout string, e.g. 'Ettt|(tt|)*2,tL' "
                        "(weight-passing schedules: one stage per shard)")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=positive_float, default=10.0,
                   help="a peer that sends nothing for this long is reported as stopped (no silent hangs)")
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
    g.add_argument("--ddp-bucket-size", type=positive_int, default=None,
                   help="parameters per gradient-reduction bucket with --overlap-grad-reduce (default: megatron's, "
                        "max(40M, 1M x data-parallel size); smaller buckets start reducing earlier in backward)")
    g.add_argument("--num-distributed-optimizer-instances", type=positive_int, default=1,
                   help="partial data parallelism: that many replicas of the sharded optimizer state, each over "
                        "consecutive ranks (one per node: reduce-scatter inside the node, one all-reduce "
                        "across nodes per iteration); with --use-torch-fsdp2, the replicas of HSDP's 2-D mesh")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="train with torch FSDP2 (ZeRO-3) instead of megatron's DDP; with "
                        "--num-distributed-optimizer-instances N > 1 it is HSDP: shards inside groups of "
                        "world/N consecutive ranks (a node), replicated across the N groups")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="train with megatron-core's Megatron-FSDP instead of its DDP (native schedule, no pipeline "
                        "parallelism); with --outer-dp-sharding-strategy optim and "
                        "--num-distributed-optimizer-instances N it is HFSDP")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
                   help="Megatron-FSDP: what is sharded over the ranks of one optimizer instance (default "
                        "optim_grads_params: parameters, gradients and optimizer state)")
    g.add_argument("--outer-dp-sharding-strategy", default="no_shard", choices=("no_shard", "optim"),
                   help="Megatron-FSDP with --num-distributed-optimizer-instances N > 1: no_shard replicates the "
                        "instance's shards across the N instances (HSDP); optim also shards the optimizer state "
                        "across them (HFSDP)")


def plain_arguments(args: argparse.Namespace) -> dict:
    """The arguments whose values are plain data (what a checkpoint's ``args`` and a W&B config keep)."""
    return {key: value for key, value in vars(args).items()
            if value is None or isinstance(value, (bool, int, float, str, list, tuple, dict))}


def add_tokenizer_file_args(group) -> None:
    """The flags naming a tokenizer's files and options (``pretrain_llama.py`` and ``tools/preprocess_data.py``)."""
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model file, Hugging Face tokenizer directory (or its tokenizer.json), "
                            "or TikTokenizer vocabulary file")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"])
    group.add_argument("--tiktoken-num-special-tokens", type=non_negative_int, default=1000,
                       help="TikTokenizer: special-token ids before the vocabulary's (Megatron-LM's default 1000)")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       help="TikTokenizer: the special tokens' names (megatron-core's defaults otherwise)")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: leave out the tokenizer's own special tokens (a bos)")
    group.add_argument("--tokenizer-hf-no-use-fast", action="store_true",
                       help="HuggingFaceTokenizer: transformers' slow (Python) tokenizer")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefix(es) of .bin/.idx files, optionally weighted: W1 P1 W2 P2; cut into "
                        "train/valid/test by --split")
    g.add_argument("--split", default=None, help="train,valid,test shares of --data-path (default 969,30,1)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own prefix(es), as --data-path (instead of --data-path and --split)")
    g.add_argument("--data-args-path", default=None,
                   help="a file holding the --data-path list (whitespace-separated), for long blends")
    g.add_argument("--per-split-data-args-path", default=None,
                   help="a JSON file with keys train, valid, test, each a --*-data-path list or string")
    g.add_argument("--num-dataset-builder-threads", type=positive_int, default=1,
                   help="threads per rank building the blended datasets' parts (megatron-core's builder)")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of --data-path")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES, metavar="TOKENIZER_TYPE",
                   help=f"required: {', '.join(SUPPORTED_TOKENIZERS)} (Megatron-LM's other types are refused)")
    add_tokenizer_file_args(g)
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="NullTokenizer's ids; TikTokenizer's size with its special tokens")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_true", default=True,
                   help="materialise the S x S causal mask per sample (Megatron-LM's default; "
                        "--no-create-attention-mask-in-dataloader lets attention apply it implicitly)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false", default=True)
    g.add_argument("--num-workers", type=non_negative_int, default=2, help="data-loader worker processes per rank")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"],
                   help="single (default): every sample once, in the dataset's shuffled order; cyclic: "
                        "Megatron-LM's random sampler (epochs, each reshuffled by its number)")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse ``argv``; a Megatron-LM flag this project does not implement is an ArgumentError naming it."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        raise ArgumentError(explain_unknown(unknown))
    try:   # Megatron-LM's flags answered from the flag table: refused in one line, or notices
        notices = settle_compat_flags(args) + native_pipeline_notices(args)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    if notices:    # validate_args prints and removes them
        setattr(args, NOTICES, notices)
    fill_defaults(args)
    return args


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-LM's derived defaults (those that need no world size)."""
    if args.num_key_value_heads is not None:       # Megatron-DeepSpeed's spelling
        args.group_query_attention = True
        args.num_query_groups = args.num_key_value_heads
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if args.add_bias_linear:                        # Megatron-LM: linear biases include the QKV bias
        args.add_qkv_bias = True
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads == 0:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None:             # Megatron-LM's default: one key/value group
        args.num_query_groups = 1
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.eval_iters < 0:
        args.eval_iters = 0
    return args


def llama_ffn_hidden_size(hidden: int) -> int:
    """Llama's FFN size: 8/3 x hidden rounded up to a multiple of 64 (what this project's tools use)."""
    return 64 * ((int(8 * hidden / 3) + 63) // 64)


def default_ffn_hidden_size(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's: 4 x hidden, or with SwiGLU two thirds of that rounded down to a multiple of 64."""
    return int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
