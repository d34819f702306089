"""``tools/plan.py``: write, check, simulate and draw plan files (docs/writing-a-schedule.md).

    tools/plan.py build --schedule tawpipe --ranks 4 --groups 2 --num-layers 8 --num-microbatches 2 --out p.json
    tools/plan.py build --schedule weipipe --ranks 4 --num-layers 4 --split-backward --out s.json   # B and W apart
    tools/plan.py validate p.json [--grid]        # exit 1 and the validator's line (rank, step) if unsound
    tools/plan.py simulate p.json [--json]        # cost flags as tools/simulate.py; the shape is the file's
    tools/plan.py draw p.json --out p.png         # the step-by-rank grid as text without --out or matplotlib
    torchrun --nproc-per-node 4 pretrain_llama.py ... --pipeline-schedule plan:p.json

Files are JSON (one action per line) or CSV, by extension (``megatron_tawpipe.plan.files``). Exit status:
0 done, 1 the validator refuses the plan, 2 the file cannot be read or the command is wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Callable, List, Optional

from megatron_tawpipe.common.errors import PlanError
from megatron_tawpipe.common.layer_split import check_layer_split
from megatron_tawpipe.plan import SCHEDULES, read_plan, split_backward, validate_plan, write_plan
from megatron_tawpipe.plan.files import plan_to_text

SHAPE = ("ranks", "groups", "num_layers", "num_microbatches")


def build_parser() -> argparse.ArgumentParser:
    from megatron_tawpipe.cli.plan_args import add_model_args

    p = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="a planner's plan, validated, to a JSON or CSV file")
    b.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    b.add_argument("--shard-layers", default=None, metavar="N,N,...", help="layers of each shard (default: the "
                   "default split, the first L mod P shards one layer more)")
    b.add_argument("--out", default=None, metavar="FILE", help=".json or .csv (default: JSON on standard output)")
    b.add_argument("--split-backward", action="store_true",
                   help="split every Backward into BackwardInput + BackwardWeight (the pass split_backward)")
    add_model_args(b)
    v = sub.add_parser("validate", help="run the validator; exit 1 naming rank and step if the plan is unsound")
    v.add_argument("file")
    v.add_argument("--grid", action="store_true", help="also print the step-by-rank grid")
    for name, text in (("simulate", "run the simulator on a plan file (cost flags as tools/simulate.py)"),
                       ("draw", "draw a plan file's simulated timeline as a PNG (text grid without --out)")):
        s = sub.add_parser(name, help=text, description=text + "; --ranks, --groups, --num-layers and "
                           "--num-microbatches are the file's")
        s.add_argument("file")
        s.add_argument("--no-validate", action="store_true", help="skip the validator")
        if name == "simulate":
            s.add_argument("--json", action="store_true", help="print the result as JSON")
        else:
            s.add_argument("--out", default=None, metavar="PNG")
            s.add_argument("--time-range", nargs=2, type=float, metavar=("FROM", "TO"))
            s.add_argument("--dpi", type=int, default=130)
        add_model_args(s)
    return p


def main(argv: Optional[List[str]] = None, draw: Optional[Callable] = None) -> int:
    """The tool; ``draw(plan, result, out, time_range=, dpi=)`` writes a PNG (tools/plot_schedule.py's)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "build":
            return _build(args)
        plan = read_plan(args.file)
    except PlanError as exc:   # (a planner's plan that the validator refuses)
        print(f"error: {args.schedule}: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "validate" or not args.no_validate:
        try:
            report = validate_plan(plan)
        except PlanError as exc:
            print(f"{args.file}: {exc}", file=sys.stderr)
            return 1
        if args.command == "validate":
            print(f"{args.file}: sound: {plan.summary()}; {report.transfers} transfers, "
                  f"{report.collectives} collectives")
            if args.grid:
                print(plan.grid())
            return 0
    return _simulate(plan, args, draw)


def _build(args) -> int:
    from megatron_tawpipe.cli.plan_args import make_plan

    plan = make_plan(args.schedule, args, validate=False)
    if args.shard_layers:
        plan.shard_layers = check_layer_split([int(x) for x in args.shard_layers.split(",")], plan.num_layers,
                                              plan.num_shards)
    if args.split_backward:
        plan = split_backward(plan)
    validate_plan(plan)
    if args.out is None:
        sys.stdout.write(plan_to_text(plan))
    else:
        write_plan(plan, args.out)
        print(f"wrote {args.out}: {plan.summary()}")
    return 0


def _simulate(plan, args, draw: Optional[Callable]) -> int:
    from megatron_tawpipe.cli.plan_args import cost_model
    from megatron_tawpipe.sim.simulate import simulate

    args.ranks, args.groups, args.num_layers, args.num_microbatches = (
        plan.num_ranks, plan.num_groups, plan.num_layers, plan.num_microbatches)
    drawing = args.command == "draw" and args.out is not None
    result = simulate(plan, cost_model(args), record=drawing)
    if args.command == "simulate":
        row = result.row()
        print(json.dumps(row, indent=1) if args.json else "\n".join(
            f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}" for key, value in row.items()))
        return 0
    if drawing and draw is not None and importlib.util.find_spec("matplotlib") is not None:
        draw(plan, result, args.out, time_range=args.time_range, dpi=args.dpi)
        print(f"wrote {args.out}: {plan.summary()}; iteration {result.iteration_time:.3f} s, "
              f"bubble {result.bubble_ratio:.3f}")
        return 0
    if drawing:
        print(f"no {args.out}: matplotlib is not installed (pip install matplotlib); the grid as text instead",
              file=sys.stderr)
    print(f"{plan.summary()}; iteration {result.iteration_time:.3f} s, bubble {result.bubble_ratio:.3f}")
    print(plan.grid())
    return 0
