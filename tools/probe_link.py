#!/usr/bin/env python
"""Measure the links a TawPipe run's layout decision is priced on, the way the run measures them at start-up.

Run it as the training would run (one process per GPU or CPU rank, torchrun's variables set); rank 0 prints one
JSON line: the node link and the link inside a node (bytes/s, latency, how they were obtained) and the probe's
time, e.g. on the emulated cluster:

    python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 300mbit -- tools/probe_link.py

or on a real one: ``torchrun --nnodes 2 --nproc-per-node 8 ... tools/probe_link.py``. ``--repeat N`` probes N
times (the figures of each).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--budget", type=float, default=3.0, help="seconds per probe (as pretrain_llama.py's)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.common import launcher
    from megatron_tawpipe.distributed.link_probe import probe_links

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(launcher.local_rank())
    dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    per_node = launcher.local_world_size(world)
    try:
        for i in range(args.repeat):
            inter, intra, seconds = probe_links(world // per_node, per_node, device, args.budget)
            if dist.get_rank() == 0:
                print(json.dumps({"repeat": i, "nodes": world // per_node, "ranks_per_node": per_node,
                                  "node_link_bytes_per_s": inter.bandwidth, "node_link_mbit_per_s":
                                  inter.bandwidth * 8 / 1e6, "node_link_latency_s": inter.latency,
                                  "node_link_source": inter.source, "intra_bytes_per_s": intra.bandwidth,
                                  "intra_latency_s": intra.latency, "intra_source": intra.source,
                                  "probe_seconds": seconds}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
