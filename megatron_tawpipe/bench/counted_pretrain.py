"""``pretrain_llama.py`` with every collective's bytes counted (:mod:`.collective_bytes`): what the benchmark
hands torchrun instead of the script itself.

    torchrun ... megatron_tawpipe/bench/counted_pretrain.py PRETRAIN_FLAGS...

Each rank writes ``rank<r>.json`` to ``$TAWPIPE_COLLECTIVE_BYTES_DIR`` when it exits (also after a failure),
with its totals per link class, the cumulative totals at each iteration's end and its calls by formula.
The counter is installed before megatron-core or this package is imported, so functions they bind at
import time are the counted ones.
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from megatron_tawpipe.bench.collective_bytes import (ENV_OUTPUT, ENV_RANKS_PER_NODE, CollectiveCounter,
                                                         install_in_training)
    from megatron_tawpipe.common import launcher

    per_node = int(os.environ.get(ENV_RANKS_PER_NODE) or launcher.local_world_size())
    counter = CollectiveCounter(launcher.rank(), per_node).install()
    snapshots = install_in_training(counter)
    directory = os.environ.get(ENV_OUTPUT)
    script = os.path.join(ROOT, "pretrain_llama.py")
    sys.argv = [script] + sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        snapshots.undo()
        counter.uninstall()
        if directory:
            counter.write(directory)


if __name__ == "__main__":
    main()
