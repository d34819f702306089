"""How fast collectives inside a node are, for the simulator's ``--intra-bw`` and ``--intra-latency``.

Run under torchrun on the emulated cluster (or any cluster), one process per rank::

    python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        tools/tawpipe_lab/collective_speed.py --sizes 65536,819200,3276800

Every node's ranks form a group; all nodes run the same collective at the same
time (as FSDP2/HSDP and megatron's per-node reductions do), so ranks compete
for the shared cores as they do in training. For each size in bytes (of the
gathered / reduced tensor) it times ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce`` and ``ring_exchange`` (the context-parallel ring attention's
step: every rank sends the tensor to the next rank of its node and receives the previous one's, posted
together with ``batch_isend_irecv``), the median of ``--repeats``
after ``--warmup``, and fits ``time = latency + bytes_moved / bandwidth`` per
collective over the sizes, bytes_moved being a ring's ((d-1)/d of the tensor;
twice that for the all-reduce, the whole tensor for the ring exchange). Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_tawpipe.common import launcher


def _time(fn, repeats: int, warmup: int, group) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit(points: List[tuple]) -> Dict[str, float]:
    """Least squares ``t = a + b * x``: latency ``a`` seconds, bandwidth ``1/b`` bytes/s."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    a = my - b * mx
    return {"latency_s": max(a, 0.0), "bandwidth_bytes_per_s": (1.0 / b) if b > 0 else float("inf")}


def node_group(world: int, rank: int):
    """(the process group of this rank's node, ranks per node): one group per node of torchrun's
    LOCAL_WORLD_SIZE ranks, every rank creating every group (collective)."""
    per_node = launcher.local_world_size(world)
    groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world // per_node)]
    return groups[rank // per_node], per_node


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="65536,819200,3276800,13107200", help="tensor bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group, d = node_group(world, rank)
    results: Dict[str, Dict[str, float]] = {}
    fits = {}
    members = dist.get_process_group_ranks(group)
    to_next, from_prev = members[(rank % d + 1) % d], members[(rank % d - 1) % d]

    def exchange(send, recv):
        ops = [dist.P2POp(dist.isend, send, to_next, group), dist.P2POp(dist.irecv, recv, from_prev, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for name in ("all_gather", "reduce_scatter", "all_reduce", "ring_exchange"):
        points = []
        for size in (int(s) for s in args.sizes.split(",")):
            numel = size // 4 // d * d
            full, part = torch.ones(numel), torch.ones(numel // d)
            if name == "all_gather":
                fn = lambda: dist.all_gather_into_tensor(full, part, group=group)  # noqa: E731
                moved = (d - 1) / d * numel * 4
            elif name == "reduce_scatter":
                fn = lambda: dist.reduce_scatter_tensor(part, full, group=group)  # noqa: E731
                moved = (d - 1) / d * numel * 4
            elif name == "all_reduce":
                fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
                moved = 2 * (d - 1) / d * numel * 4
            else:
                incoming = torch.empty_like(full)
                fn = lambda: exchange(full, incoming)  # noqa: E731
                moved = numel * 4
            t = _time(fn, args.repeats, args.warmup, group)
            results.setdefault(name, {})[str(numel * 4)] = t
            points.append((moved, t))
        fits[name] = _fit(points)
    if rank == 0:
        print(json.dumps({"ranks_per_node": d, "nodes": world // d, "seconds": results, "fit": fits},
                         indent=1), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
