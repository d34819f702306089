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
    from megatron_tawpipe.launch import run_training

    return run_training(argv, prog="pretrain_llama.py")


if __name__ == "__main__":
    sys.exit(main())
