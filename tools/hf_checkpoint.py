#!/usr/bin/env python
"""Hugging Face weights in and out, without Megatron-LM's converter.

    python tools/hf_checkpoint.py import HF_DIR OUT_DIR
    python pretrain_llama.py $(cat OUT_DIR/model_flags.txt) --load OUT_DIR --finetune ...
    python tools/hf_checkpoint.py export CKPT_DIR HF_DIR

Llama 2/3/3.1 (grouped-query attention, rope scaling), Mistral, Qwen 2 and Qwen 3. See docs/checkpoints.md;
the logic is megatron_tawpipe/cli/hf_checkpoint.py and megatron_tawpipe/checkpoint/hf_convert.py.
"""

import os
import sys

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.cli.hf_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
