"""Whether a node link carries both directions at full rate at once, for the simulator's ``--backend gloo``.

The simulator gives each node link its rate in each direction independently (full duplex). A
pipeline's boundary carries activations one way and their gradients the other at the same time;
so does TawPipe's weights-out / gradients-in traffic. Run under torchrun on the emulated cluster,
two nodes, one or two ranks per node::

    python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        tools/tawpipe_lab/link_duplex.py --sizes 1048576,3145728,6291456,8388608,12582912

For each message size it times ``--messages`` gloo point-to-point messages per transfer (as
megatron's p2p exchanges send them: each rank posts its sends and receives of a step together with
``batch_isend_irecv``), the median of ``--repeats``, in these patterns (``a->b``: rank a sends to
rank b; the first rank of node 0 is 0, of node 1 is G):

* ``one way``: 0->G alone;
* ``both ways, one pair``: 0->G and G->0 at once;
* ``both ways, other pairs`` (2 ranks per node): 0->G and G+1->1 at once;
* ``both ways, two pairs`` (2 ranks per node): 0<->G and 1<->G+1 at once;
* ``both ways, one pair, a group per direction``: 0->G and G->0 at once, each direction on a process
  group of its own (two gloo connections), as the weight-passing runtime sends them;

and rank 0 prints one JSON object: per pattern and size, bytes per second per transfer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist


#: The pattern "both ways, one pair" with each direction on a process group of its own.
DIRECTED = "both ways, one pair, a group per direction"


def patterns(world: int) -> Dict[str, List[Tuple[int, int]]]:
    """The transfers of each pattern, as (source, destination) ranks."""
    g = world // 2
    out = {"one way": [(0, g)], "both ways, one pair": [(0, g), (g, 0)]}
    if g >= 2:
        out["both ways, other pairs"] = [(0, g), (g + 1, 1)]
        out["both ways, two pairs"] = [(0, g), (g, 0), (1, g + 1), (g + 1, 1)]
    return out


def _exchange(transfers, out: torch.Tensor, inp: torch.Tensor, messages: int, directions=None) -> None:
    """``messages`` rounds of the transfers; with ``directions`` (``{True: group, False: group}``) each
    message goes on the group of its direction (source below destination or not), as the weight-passing
    runtime sends them, else all on the default group in one batch, as megatron's pipelines do."""
    me = dist.get_rank()
    out_inp = inp.clone()   # a second receive buffer: a rank may receive on both groups at once
    for _ in range(messages):
        if directions is not None:
            works = [dist.isend(out, dst, group=directions[src < dst]) for src, dst in transfers if src == me]
            works += [dist.irecv(inp if i == 0 else out_inp, src, group=directions[src < dst])
                      for i, (src, dst) in enumerate((s, d) for s, d in transfers if d == me)]
            for work in works:
                work.wait()
            continue
        ops = [dist.P2POp(dist.isend, out, dst) for src, dst in transfers if src == me]
        ops += [dist.P2POp(dist.irecv, inp, src) for src, dst in transfers if dst == me]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _rate(transfers, out, inp, messages: int, repeats: int, directions=None) -> float:
    times = []
    for _ in range(repeats + 1):          # the first warms the connections up
        dist.barrier()
        t = time.perf_counter()
        _exchange(transfers, out, inp, messages, directions)
        dist.barrier()
        times.append(time.perf_counter() - t)
    return out.numel() * out.element_size() * messages / statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1048576,3145728,6291456,8388608,12582912", help="message bytes, comma-separated")
    p.add_argument("--messages", type=int, default=8, help="messages per transfer and timing")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit("link_duplex: run it on 2 nodes with 1 or 2 ranks each (world size 2 or 4)")
    result: Dict[str, Dict[str, float]] = {}
    directions = {True: dist.new_group(), False: dist.new_group()}   # one group per direction
    for size in (int(x) for x in args.sizes.split(",")):
        out, inp = torch.ones(max(1, size // 4)), torch.empty(max(1, size // 4))
        for name, transfers in patterns(world).items():
            result.setdefault(name, {})[str(size)] = _rate(transfers, out, inp, args.messages, args.repeats)
        both = patterns(world)["both ways, one pair"]
        result.setdefault(DIRECTED, {})[str(size)] = _rate(both, out, inp, args.messages, args.repeats, directions)
    if dist.get_rank() == 0:
        alone = result["one way"]
        print(json.dumps({"bytes_per_s": result,
                          "over_one_way": {name: {s: v / alone[s] for s, v in rates.items()}
                                           for name, rates in result.items()}}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
