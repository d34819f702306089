#!/usr/bin/env python
"""Compare pipeline schedules on a simulated cluster.

Example (24 ranks in 3 nodes, 10 GbE between nodes):

    python tools/simulate.py --schedule tawpipe,weipipe,1f1b,interleaved,fsdp \\
        --ranks 24 --groups 3 --num-layers 48 --hidden-size 4096 --seq-length 16384 \\
        --micro-batch-size 1 --num-microbatches 64 --intra-bw 200GB/s --inter-bw 1.25GB/s \\
        --peak-tflops 312 --efficiency 0.5

``--num-microbatches`` is per rank: weight-passing schedules and FSDP give every
rank that many micro-batches; activation-passing schedules (gpipe, 1f1b,
interleaved) run one pipeline over all ranks with ranks x that many
micro-batches, i.e. the same global batch; pp-nodes runs one pipeline stage per
node with ranks-per-node pipelines side by side.

Advisor (which strategy, which knobs, which command):

    python tools/simulate.py --advise --model 7b --seq-length 32768 --global-batch-size 128 \
        --ranks 32 --ranks-per-node 8 --intra-bw 450GB/s --inter-bw 25Gbit/s \
        --peak-tflops 989 --efficiency 0.4 --gpu-memory 80GB [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.plan import SCHEDULES
from megatron_tawpipe.cli.plan_args import (ALL, ANALYTIC, add_advisor_args, check_command, add_model_args, replicable,
                                       check_spread,
                                       advisor_inputs, context_parallel_for, cost_model, run_one,
                                       tensor_parallel_for)

def format_table(rows) -> str:
    head = ("schedule", "iter s", "tok/s/rank", "bubble", "inter GB", "intra GB", "w bufs",
            "g bufs", "act GB", "mem GB")
    lines = []
    for r in rows:
        lines.append((r["schedule"], f"{r['iteration_time_s']:.2f}",
                      f"{r['tokens_per_sec_per_rank']:.0f}", f"{r['bubble_ratio']:.3f}",
                      f"{r['inter_group_bytes'] / 1e9:.1f}", f"{r['intra_group_bytes'] / 1e9:.1f}",
                      str(r["weight_buffers"]), str(r["grad_buffers"]),
                      f"{r['activation_bytes'] / 1e9:.1f}", f"{r['memory_bytes'] / 1e9:.1f}"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--schedule", default="tawpipe,weipipe,1f1b,interleaved,fsdp",
                   help=f"comma-separated, or 'all' ({','.join(ALL)})")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--no-validate", action="store_true", help="skip validating the plans")
    add_model_args(p)
    add_advisor_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.ranks_per_node:
        args.groups = args.ranks // args.ranks_per_node
    if args.advise:
        return advise_main(args, argv)
    names = ([n for n in ALL if n != "tawpipe-rep" or replicable(n, args)]   # all this cluster can run
             if args.schedule == "all" else [x.strip() for x in args.schedule.split(",")])
    for n in names:
        if n not in ANALYTIC and n not in SCHEDULES:
            p.error(f"unknown schedule {n!r}; known: {', '.join(list(SCHEDULES) + list(ANALYTIC))}")
        if n == "tawpipe-rep" and not replicable(n, args):
            p.error("tawpipe-rep (shard 0 in every group) needs --groups >= 2 and not --flat")
        try:
            tensor_parallel_for(n, args)
            context_parallel_for(n, args)
            check_spread(n, args)
        except ValueError as exc:
            p.error(str(exc))
    cost = cost_model(args)
    rows = []
    for n in names:
        _, result = run_one(n, args, cost, validate=not args.no_validate)
        row = result.row()
        row["options"] = result.options
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"P={args.ranks} ranks in {args.groups} groups, L={args.num_layers}, "
              f"H={args.hidden_size}, S={args.seq_length}, micro-batch {args.micro_batch_size}, "
              f"{args.num_microbatches} micro-batches per rank; intra {args.intra_bw}, "
              f"inter {args.inter_bw}; {args.peak_tflops:g} TFLOP/s x {args.efficiency:g}")
        print(format_table(rows))
    return 0


def advise_main(args, argv) -> int:
    from megatron_tawpipe.sim.advisor import advise
    from megatron_tawpipe.sim.advisor_report import format_report

    model, cluster, gbs = advisor_inputs(args, argv)
    summary = advise(model, cluster, gbs, prune=args.prune, trainable_only=args.trainable_only,
                     check_command=check_command, listed=args.top)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_report(summary, rows=args.top))
    if summary["best"] is None:
        print("error: " + summary["error"], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
