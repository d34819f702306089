"""How much of the emulated ring attention's exchange shows beside its sleeps, against the simulator's figure.

Run under torchrun on the emulated cluster, one process per rank (every node's ranks one context-parallel group;
all nodes at once, so ranks compete for the cores as in training)::

    python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        tools/tawpipe_lab/ring_overlap.py --times runs/context_parallel/times.json --seq-length 4096 \\
        --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4

For ``--layers`` layer passes it runs :class:`megatron_tawpipe.emulation.ring.EmulatedRing`'s forward and backward
with 1/C of the file's layer times, and reports per layer the seconds measured, the seconds slept, and the
exposed ring time the simulator prices (:func:`megatron_tawpipe.sim.context_parallel.ring_attention_exposed`) at
``--intra-bw``. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_tawpipe.common.units import parse_rate, parse_time
from megatron_tawpipe.emulation.ring import EmulatedRing
from megatron_tawpipe.sim.context_parallel import AttentionShape, attention_share, ring_attention_exposed
from megatron_tawpipe.sim.costmodel import CostModel, Link

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tools/: the lab's modules
from tawpipe_lab.collective_speed import node_group  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", required=True, help="the calibrated times file (tools/calibrate.py)")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--num-attention-heads", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype-bytes", type=int, default=4, choices=(2, 4))
    p.add_argument("--intra-bw", default="0.6GB/s")
    p.add_argument("--intra-latency", default="5us")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group, cp = node_group(world, rank)   # the context-parallel group: a node's ranks
    shape = AttentionShape(args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads,
                           None, args.ffn_hidden_size)
    numel = int(shape.kv_bytes(cp, 1, args.dtype_bytes)) // args.dtype_bytes
    ring = EmulatedRing(group, cp, rank % cp, numel, attention_share(shape))
    with open(args.times, encoding="utf-8") as f:
        times = json.load(f)
    forward, backward = times["layer_forward"] / cp, times["layer_backward"] / cp
    dtype = torch.float32 if args.dtype_bytes == 4 else torch.bfloat16
    slept = [0.0]

    def sleep(s, actual=None):   # counts s, sleeps actual (a pass's owed overrun taken off: emulation.ring.PassSleep)
        if s > 0:
            actual = s if actual is None else actual
            if actual > 0:
                time.sleep(actual)
            slept[0] += s

    measured = {}
    for name, run in (("forward", lambda: ring.forward(forward, sleep, dtype, "cpu")),
                      ("backward", lambda: ring.backward(backward, sleep, dtype, "cpu"))):
        run()   # warm-up
        dist.barrier()
        slept[0] = 0.0
        start = time.perf_counter()
        for _ in range(args.layers):
            run()
        measured[name] = {"seconds_per_layer": (time.perf_counter() - start) / args.layers,
                          "slept_per_layer": slept[0] / args.layers}
    cost = CostModel(layer_forward=times["layer_forward"], layer_backward=times["layer_backward"],
                     dtype_bytes=args.dtype_bytes, recompute=False,
                     intra=Link(parse_rate(args.intra_bw), parse_time(args.intra_latency)))
    exposed = ring_attention_exposed(cost, shape, cp)
    report = {}
    for name, model in (("forward", exposed.forward), ("backward", exposed.backward)):
        m = measured[name]
        report[name] = {**m, "exposed_measured": m["seconds_per_layer"] - m["slept_per_layer"],
                        "exposed_simulated": model}
    if rank == 0:
        print(json.dumps({"context_parallel_size": cp, "nodes": world // cp, "message_bytes": numel * args.dtype_bytes,
                          "intra_bw": args.intra_bw, "per_layer": report}, indent=1), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
