#!/usr/bin/env python
"""Pre-train a Llama-style model with megatron-core.

    torchrun --nproc-per-node 4 pretrain_llama.py --pipeline-schedule 1f1b \\
        --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 256 ... \\
        --train-iters 100 --mock-data --vocab-size 32000

Flags follow Megatron-LM's names (``python pretrain_llama.py --help``).
``--pipeline-schedule`` picks megatron's native ``1f1b`` / ``interleaved`` or
the weight-passing ``weipipe`` / ``tawpipe``. Bad flags are reported in one
line before any process group is created.
"""

import sys


def main(argv=None) -> int:
    from megatron_tawpipe.arguments import ArgumentError, parse_args, validate_args
    from megatron_tawpipe.data import validate_data_args

    try:
        args = parse_args(argv)
        validate_args(args)
        validate_data_args(args)
    except (ArgumentError, ValueError, FileNotFoundError) as exc:
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr)
        return 2

    from megatron_tawpipe.checkpoint import CheckpointError
    from megatron_tawpipe.initialize import DistributedSetupError, destroy
    from megatron_tawpipe.runtime.executor import ExecutionError
    from megatron_tawpipe.training import TrainingError, pretrain

    try:
        pretrain(args)
    except DistributedSetupError as exc:
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr)
        return 2
    except (TrainingError, ExecutionError, CheckpointError) as exc:
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
