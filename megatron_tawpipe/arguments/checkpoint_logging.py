"""The checkpointing and logging flags of ``pretrain_llama.py``: Megatron-LM's names, meanings and defaults
(docs/checkpoints.md; docs/pretrain-llama-and-megatron-lm.md, 'Metrics')."""

from __future__ import annotations

import argparse

from megatron_tawpipe.arguments.choices import (ASYNC_STRATEGIES, CKPT_FORMATS, MEGATRON_LM_ONLY_CKPT_FORMATS,
                                                positive_int)


def add_checkpoint_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument("--no-save-optim", action="store_true", help="checkpoints without optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints without random-number states")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only, restart iteration count")
    g.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS + MEGATRON_LM_ONLY_CKPT_FORMATS,
                   help="torch_dist (default): Megatron-LM's format through megatron-core's dist_checkpointing; "
                        "torch: Megatron-LM's legacy per-rank files (weights); "
                        "tawpipe: this project's earlier per-parameter files. Loading reads any of them")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model flags (sizes, architecture, tokenizer) from the checkpoint under --load")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop if --load holds no checkpoint instead of starting from scratch")
    # Megatron-LM's checkpoint companions (docs/checkpoints.md).
    g.add_argument("--save-retain-interval", type=positive_int, default=None,
                   help="keep only checkpoints whose iteration is a multiple of this, and the latest")
    g.add_argument("--async-save", action="store_true",
                   help="write torch_dist checkpoints in the background while training goes on")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="--async-save on megatron-core's persistent writer process (needs a GPU)")
    g.add_argument("--async-strategy", default="nvrx", choices=ASYNC_STRATEGIES,
                   help="Megatron-LM's default nvrx (nvidia-resiliency-ext) or mcore; this project writes with mcore")
    g.add_argument("--async-ckpt-cpu-priority", type=int, default=10,
                   help="nice value (0-19) of the background checkpoint writer")
    g.add_argument("--async-ckpt-io-priority", type=int, default=3, help="I/O class (0-3, 3 = idle) of that writer")
    g.add_argument("--async-ckpt-use-cpu-shm", action="store_true",
                   help="Megatron-LM: nvrx's CPU shared-memory staging; answered in one line")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="the distributed optimizer's state in model space: what this project always writes")
    g.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                   help="Megatron-LM's low-memory gathering for the above; answered in one line")
    g.add_argument("--use-dist-ckpt", dest="use_dist_ckpt_deprecated", action="store_true",
                   help="deprecated in Megatron-LM, no effect: see --ckpt-format")
    g.add_argument("--dist-ckpt-format", dest="dist_ckpt_format_deprecated", default=None,
                   help="deprecated in Megatron-LM, no effect: see --ckpt-format")
    g.add_argument("--log-interval", type=positive_int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="accepted: the log line always has tokens/s and TFLOP/s per rank")
    g.add_argument("--eval-interval", type=positive_int, default=None,
                   help="validate every this many iterations (default: only after training)")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per validation; 0 or less: no validation")
    g.add_argument("--wandb-project", default=None,
                   help="log Megatron-LM's scalars to this Weights & Biases project (needs the wandb package; "
                        "WANDB_MODE=offline works without network)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B's local directory (default: SAVE/wandb)")
    g.add_argument("--wandb-entity", default=None, help="the W&B team or user the run is logged under (default: "
                   "the account's own)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write Megatron-LM's TensorBoard scalars here (needs the tensorboard package)")
    g.add_argument("--tensorboard-log-interval", type=positive_int, default=1)
    g.add_argument("--tensorboard-queue-size", type=positive_int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="iteration-time (and throughput with --log-throughput) every --log-interval")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--exit-interval", type=positive_int, default=None, help="stop after this iteration")
    # Megatron-LM's logging switches (monitor/): names, meanings and defaults as Megatron-LM's.
    g.add_argument("--log-progress", action="store_true",
                   help="append job start and, after every checkpoint, job and cumulative throughput, "
                        "floating-point operations and tokens to SAVE/progress.txt")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   dest="log_loss_scale_to_tensorboard", action="store_false", default=True,
                   help="leave loss-scale out of TensorBoard/W&B (written by default, 1.0 without --fp16)")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                   action="store_false", default=True,
                   help="leave learning-rate out of TensorBoard/W&B (Megatron-LM's spelling)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="memory scalars (mem-allocated-bytes, ...) to TensorBoard every --tensorboard-log-interval")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="world-size to TensorBoard/W&B every --tensorboard-log-interval")
    g.add_argument("--logging-level", type=int, default=None,
                   help="the root logger's level (10 DEBUG, 20 INFO, ...); default: MEGATRON_LOGGING_LEVEL if set")
