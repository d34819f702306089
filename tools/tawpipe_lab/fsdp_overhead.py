"""What FSDP2 costs on the CPU beyond its collectives, per layer and micro-batch.

The simulator's ``--backend gloo`` prices FSDP2's per-layer all-gathers and reduce-scatters at
the collectives' measured speed. FSDP2 also does CPU work around each of them (copying the local
shards into the flat all-gather buffer and the gathered buffer out into the unsharded parameters,
the gradients into the reduce-scatter buffer, the division, the sharded gradient out). This tool
measures that work apart: ``--layers`` modules of ``--layer-params`` fp32 parameters each, every
one ``fully_shard``-ed over all ranks (the ranks of one node, as HSDP shards), a forward and
backward with a one-token input (no compute to speak of), against the same ranks' bare
``all_gather_into_tensor`` (twice: forward and backward, as with resharding after forward) and
``reduce_scatter_tensor`` of one layer's bytes. Run one process per rank of one node::

    torchrun --nproc-per-node 2 tools/tawpipe_lab/fsdp_overhead.py --layer-params 786432

Rank 0 prints one JSON object: seconds per layer and micro-batch of FSDP2 and of the bare
collectives, their difference, and that difference per byte of the layer (as a copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _median_time(fn, repeats: int) -> float:
    fn()                                   # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _model(layers: int, layer_params: int) -> torch.nn.Module:
    width = max(1, int(layer_params ** 0.5))
    return torch.nn.Sequential(*[torch.nn.Linear(width, layer_params // width, bias=False)
                                 if i % 2 == 0 else torch.nn.Linear(layer_params // width, width, bias=False)
                                 for i in range(layers)])


def main(argv=None) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layer-params", type=int, default=786432, help="fp32 parameters per layer (default: "
                   "about one decoder layer of hidden 256)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _model(args.layers, args.layer_params)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(1, model[0].in_features)

    def step():
        model(x).sum().backward()

    fsdp = _median_time(step, args.repeats) / args.layers
    numel = sum(p.numel() for p in model[0].parameters())     # a DTensor's numel is the unsharded one
    numel -= numel % world
    full, shard = torch.zeros(numel), torch.ones(numel // world)

    def collectives():
        for _ in range(2):
            dist.all_gather_into_tensor(full, shard)
        dist.reduce_scatter_tensor(shard, full)

    bare = _median_time(collectives, args.repeats)
    if dist.get_rank() == 0:
        extra = fsdp - bare
        nbytes = numel * 4
        print(json.dumps({"ranks": world, "layer_params": numel, "layer_bytes": nbytes,
                          "fsdp_s_per_layer_and_microbatch": fsdp, "bare_collectives_s": bare,
                          "extra_s": extra, "extra_bytes_per_s": nbytes / extra if extra > 0 else None}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
