#!/usr/bin/env python
"""Check and measure one rank on one GPU (multi-rank NCCL cannot share one GPU).

    python tools/gpu_check.py --json gpu_check.json                  # on a GPU machine, default sizes
    python tools/gpu_check.py --device cpu --hidden-size 64 ...       # on a CPU: checks the tool itself

Checks: Transformer Engine layer spec vs the local spec; a one-rank bf16 TawPipe run vs native
1F1B (pipeline size 1); host time per plan Wait; per-shard forward/backward/recompute times at a
real size, written as the calibration JSON (--times-output) that tools/simulate.py
--measured-times reads; peak memory of one rank vs the simulator. ``--help`` lists the flags.
"""

import os
import sys


def _hide_gpus_for_cpu_runs(argv) -> None:
    """--device cpu: hide CUDA before torch is imported (the runtime uses CUDA whenever it sees it)."""
    for i, arg in enumerate(argv):
        if arg == "--device=cpu" or (arg == "--device" and i + 1 < len(argv) and argv[i + 1] == "cpu"):
            os.environ["CUDA_VISIBLE_DEVICES"] = ""


if __name__ == "__main__":
    _hide_gpus_for_cpu_runs(sys.argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tawpipe_lab.gpu_check import main

    sys.exit(main())
