#!/usr/bin/env python
"""Per-layer compute times of the Llama model, measured on this device (GPU when present) or from the FLOP model.

    python tools/calibrate.py --output times.json --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 16384 --micro-batch-size 1 --vocab-size 32000 --bf16           # measure here
    python tools/calibrate.py --output times.json --from-cost-model --peak-tflops 312 --efficiency 0.5 ...

On a GPU every run is timed with CUDA events (kernels are asynchronous: a host clock around them
would measure their launch), on a CPU with the wall clock; each figure is the fastest of --repeats.
The JSON feeds ``tools/simulate.py --measured-times`` and ``pretrain_llama.py --emulated-compute-times``.
``tools/gpu_check.py`` writes the same JSON from one weight-passing shard (``--checks timings``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron_tawpipe.bench.calibrate import main

    sys.exit(main())
