#!/usr/bin/env python
"""Draw a plan's simulated timeline as a PNG.

One row per rank (groups separated by lines).  The thick bar is compute:
forward blue, backward green (split backward: input light green, weight dark
green), local copies grey; the label is ``micro-batch.shard``.  Under it two
thin lanes show communication arriving at the rank and leaving it: weights
orange, gradients red, activations purple; solid = between groups (slow link),
pale = inside the group.

    python tools/plot_schedule.py --schedule tawpipe --ranks 8 --groups 2 \\
        --num-layers 16 --num-microbatches 4 --inter-bw 1.25GB/s --out /tmp/tawpipe.png

A measured iteration (``pretrain_llama.py --timeline-file run.json``) draws the same way:

    python tools/plot_schedule.py --timeline run.json --out /tmp/measured.png
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.plan import SCHEDULES
from megatron_tawpipe.plan.timeline import COMPUTE_LABELS
from megatron_tawpipe.cli.plan_args import add_model_args, cost_model, run_one

COMPUTE_COLOURS = {"F": "#4C72B0", "B": "#55A868", "Bi": "#8FD19E", "Bw": "#2D6A3E",
                   "load": "#B0B0B0", "acc": "#909090", "zero": "#D0D0D0", "opt": "#606060"}
KIND_COLOURS = {"weight": "#E08A1E", "grad": "#C44E52", "act": "#8172B2", "actgrad": "#B07AA1"}


def draw(plan, result, out: str, title: str = None, time_range=None, dpi: int = 130) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    P = plan.num_ranks
    G = plan.ranks_per_group
    t_end = result.iteration_time
    lo, hi = time_range if time_range else (0.0, t_end)
    fig_h = 1.2 + 0.55 * P
    fig, ax = plt.subplots(figsize=(16, fig_h))
    row_h = 1.0
    bar_h = 0.5          # compute bar
    lane_h = 0.14        # each comm lane

    def y0(rank):        # top of the rank's row (rank 0 at the top)
        return rank * row_h

    for s in result.spans:
        if s.end < lo or s.start > hi:
            continue
        colour = COMPUTE_COLOURS.get(s.kind, "#CCCCCC")
        ax.broken_barh([(s.start, s.end - s.start)], (y0(s.rank) + 0.05, bar_h),
                       facecolors=colour, edgecolors="white", linewidth=0.3)
        if s.kind in COMPUTE_LABELS and (s.end - s.start) > (hi - lo) / 120:
            ax.text((s.start + s.end) / 2, y0(s.rank) + 0.05 + bar_h / 2, f"{s.mb}.{s.shard}",
                    ha="center", va="center", fontsize=5.5, color="white")
    for tr in result.transfers:
        if tr.end < lo or tr.posted > hi:
            continue
        colour = KIND_COLOURS.get(tr.kind, "black")
        alpha = 1.0 if tr.link == "inter" else 0.35
        width = max(tr.end - tr.posted, (hi - lo) / 2000)
        for rank, lane in ((tr.dst, 0), (tr.src, 1)):
            if rank < 0:  # a measured transfer is drawn on the lane of the rank that recorded it
                continue
            ax.broken_barh([(tr.posted, width)],
                           (y0(rank) + 0.05 + bar_h + 0.04 + lane * (lane_h + 0.02), lane_h),
                           facecolors=colour, alpha=alpha, linewidth=0)
    for g in range(1, plan.num_groups):
        ax.axhline(g * G * row_h - 0.12, color="black", linewidth=0.8)
    ax.set_ylim(P * row_h, -0.1)
    ax.set_yticks([y0(r) + 0.05 + bar_h / 2 for r in range(P)])
    ax.set_yticklabels([f"rank {r} (g{r // G})" for r in range(P)], fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time (s)")
    lb = result.link_bytes
    ax.set_title(title or
                 f"{plan.schedule}: P={P}, {plan.num_groups} groups, {plan.num_layers} layers, "
                 f"N={plan.num_microbatches}  |  iteration {result.iteration_time:.2f} s, bubble "
                 f"{result.bubble_ratio:.1%}, inter-group {lb['inter'] / 1e9:.1f} GB, intra "
                 f"{lb['intra'] / 1e9:.1f} GB, buffers w{plan.max_weight_buffers}/"
                 f"g{plan.max_grad_buffers}", fontsize=9)
    handles = [Patch(color=COMPUTE_COLOURS[k], label=n) for k, n in
               (("F", "forward"), ("B", "backward (+recompute)"), ("load", "local copy"))]
    handles += [Patch(color=KIND_COLOURS[k], label=f"{k} transfer") for k in ("weight", "grad")]
    if plan.family == "activation":
        handles += [Patch(color=KIND_COLOURS[k], label=f"{k} transfer") for k in ("act", "actgrad")]
    handles += [Patch(color="#777777", alpha=1.0, label="solid: inter-group"),
                Patch(color="#777777", alpha=0.35, label="pale: intra-group")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.text(0.01, 0.005, "lanes under each rank: upper = arriving, lower = leaving",
             fontsize=6.5, color="#444444")
    fig.tight_layout(rect=(0, 0.45 / fig_h, 1, 1))
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def load_timeline(path: str):
    """A measured timeline (``pretrain_llama.py --timeline-file``) as the (plan, result) ``draw`` takes."""
    import json
    from types import SimpleNamespace

    from megatron_tawpipe.sim.simulate import Span, Transfer

    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    t0 = min([s[1] for s in doc["spans"]] + [x[4] for x in doc["transfers"]])
    spans = [Span(rank=r, start=a - t0, end=b - t0, kind=k, mb=mb, shard=sh) for r, a, b, k, mb, sh in doc["spans"]]
    transfers = []
    for i, (rank, direction, kind, link, posted, end) in enumerate(doc["transfers"]):
        src, dst = (-1, rank) if direction == "in" else (rank, -1)
        transfers.append(Transfer(tag=i, src=src, dst=dst, kind=kind, link=link, nbytes=0.0,
                                  posted=posted - t0, end=end - t0))
    P, D = doc["num_ranks"], doc["num_groups"]
    plan = SimpleNamespace(schedule=doc["schedule"], num_ranks=P, num_groups=D, ranks_per_group=P // D,
                           num_layers=doc["num_layers"], num_microbatches=doc["num_microbatches"], family="weight",
                           max_weight_buffers=doc["max_weight_buffers"], max_grad_buffers=doc["max_grad_buffers"])
    iteration = max([s.end for s in spans] + [t.end for t in transfers])
    busy = [sum(s.end - s.start for s in spans if s.rank == r and s.kind in COMPUTE_LABELS) for r in range(P)]
    result = SimpleNamespace(spans=spans, transfers=transfers, iteration_time=iteration,
                             bubble_ratio=1.0 - sum(busy) / (P * iteration), link_bytes={"inter": 0.0, "intra": 0.0})
    return plan, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--schedule", default="tawpipe", choices=sorted(SCHEDULES))
    p.add_argument("--timeline", default=None, metavar="JSON",
                   help="draw a measured timeline (pretrain_llama.py --timeline-file) instead of a simulated one")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--time-range", nargs=2, type=float, metavar=("FROM", "TO"),
                   help="zoom into this time window (seconds)")
    p.add_argument("--grid", action="store_true", help="also print the plan's step-by-rank grid")
    p.add_argument("--dpi", type=int, default=130)
    add_model_args(p)
    p.set_defaults(num_microbatches=4)
    args = p.parse_args(argv)
    if args.timeline:
        plan, result = load_timeline(args.timeline)
        title = (f"measured: {plan.schedule}, P={plan.num_ranks}, {plan.num_groups} groups, {plan.num_layers} layers, "
                 f"N={plan.num_microbatches}  |  iteration {result.iteration_time:.2f} s, compute idle "
                 f"{result.bubble_ratio:.1%} (forward/backward spans; the lanes show each rank's transfers "
                 "from post to completed wait)")
        draw(plan, result, args.out, title=title, time_range=args.time_range, dpi=args.dpi)
        print(f"wrote {args.out}: iteration {result.iteration_time:.3f} s, compute idle {result.bubble_ratio:.3f}")
        return 0
    plan, result = run_one(args.schedule, args, cost_model(args), validate=True, record=True)
    if args.grid:
        print(plan.grid())
    draw(plan, result, args.out, time_range=args.time_range, dpi=args.dpi)
    print(f"wrote {args.out}: {plan.summary()}; iteration {result.iteration_time:.3f} s, "
          f"bubble {result.bubble_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
