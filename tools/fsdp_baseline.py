#!/usr/bin/env python
"""FSDP / ZeRO-3 baseline on the project's megatron-core Llama model (see megatron_tawpipe/fsdp_baseline.py).

    torchrun --nproc-per-node 4 tools/fsdp_baseline.py --num-layers 8 --hidden-size 128 ... \\
        --train-iters 10 --mock-data --vocab-size 32000 --metrics-file runs/fsdp.jsonl

Takes pretrain_llama.py's flags (pipeline flags at their defaults) and writes the same metrics file.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron_tawpipe.baselines.fsdp import main

    sys.exit(main())
