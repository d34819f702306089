#!/usr/bin/env python
"""Pre-train a GPT / Llama model with megatron-core, from Megatron-LM's command line.

    torchrun --nproc-per-node 4 pretrain_llama.py --pipeline-schedule tawpipe \\
        --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \\
        --num-layers 8 --hidden-size 256 ... --train-iters 100 --lr 3e-4 \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000

Flags are Megatron-LM's, with its meanings and defaults (``python pretrain_llama.py --help``;
without architecture flags the model is Megatron-LM's GPT).
``--pipeline-schedule`` picks megatron's native ``1f1b`` / ``interleaved`` or
the weight-passing ``weipipe`` / ``tawpipe``. Bad flags are reported in one
line before any process group is created.
"""

import sys


def main(argv=None) -> int:
    from megatron_tawpipe.compat.extensions import missing_extension_warnings_once

    missing_extension_warnings_once()   # before megatron-core is imported: each such warning once per job
    from megatron_tawpipe.cli.pretrain import run_training
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    return run_training(argv, prog="pretrain_llama.py", forward_step_func=gpt_forward_step)


if __name__ == "__main__":
    sys.exit(main())
