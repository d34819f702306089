#!/usr/bin/env python
"""Split a measured weight-passing iteration's wall time per rank, beside the simulator's for the same plan.

    python tools/idle_breakdown.py --timeline run/timeline.json                  # measured only
    python tools/idle_breakdown.py --timeline run/timeline.json --schedule tawpipe-rep \\
        --ranks 2 --groups 2 --num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 3072 \\
        --num-microbatches 8 --chunk 4 --vocab-size 2048 --dtype-bytes 4 --no-recompute \\
        --measured-times times.json --inter-bw 300Mbit/s --intra-bw 0.6GB/s --backend gloo

The timeline is ``pretrain_llama.py --timeline-file`` (the latest training iteration); with
``--schedule`` (and tools/simulate.py's cluster and model flags) the same plan is simulated and its
per-rank idle per Wait set beside the measurement (the tool refuses a plan whose actions differ from the
timeline's). Categories: tools/tawpipe_lab/idle_breakdown.py.
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

from tawpipe_lab.idle_breakdown import (check_plan_matches, format_table, grouped,  # noqa: E402
                                        mean_over_ranks, measured_breakdown, simulated_breakdown)
from megatron_tawpipe.cli.plan_args import add_model_args, cost_model, run_one  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="idle_breakdown.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeline", required=True, metavar="JSON", help="pretrain_llama.py --timeline-file output")
    p.add_argument("--schedule", default=None, help="simulate this plan (tawpipe, tawpipe-rep, weipipe, ...) beside it")
    p.add_argument("--per-rank", action="store_true", help="a column per rank (default: means over ranks)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every rank's categories here")
    add_model_args(p)
    args = p.parse_args(argv)
    with open(args.timeline, encoding="utf-8") as f:
        doc = json.load(f)
    try:
        measured = measured_breakdown(doc)
    except ValueError as exc:
        p.error(f"--timeline {args.timeline}: {exc}")
    columns = ([(f"r{r} meas", grouped(c)) for r, c in sorted(measured.items())] if args.per_rank
               else [("measured", grouped(mean_over_ranks(measured)))])
    out = {"measured": measured}
    if args.schedule:
        plan, result = run_one(args.schedule, args, cost_model(args), record=True)
        if plan is None:
            p.error(f"--schedule {args.schedule}: not a plan schedule")
        problem = check_plan_matches(doc, plan)
        if problem:
            p.error(f"--schedule {args.schedule} with these flags is not the plan the timeline ran: {problem}")
        simulated = simulated_breakdown(plan, result)
        out["simulated"] = simulated
        columns += ([(f"r{r} sim", grouped(c)) for r, c in sorted(simulated.items())] if args.per_rank
                    else [("simulated", grouped(mean_over_ranks(simulated)))])
    print(format_table(columns))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: {str(r): c for r, c in v.items()} for k, v in out.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
