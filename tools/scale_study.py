#!/usr/bin/env python
"""Which strategy the advisor picks across models, cluster sizes, link speeds
and context lengths (a prediction of the cost model, not a measurement).

Sweep: Llama-shaped 7B, 13B, 34B, 70B (``--model`` presets of tools/simulate.py);
16, 32, 64 GPUs in nodes of 8 with 80 GB each (75 GB usable: 5 GB kept for the
CUDA context, NCCL and fragmentation); 10, 25, 100, 400 Gbit/s between nodes,
NVLink 450 GB/s inside; S = 8192, 32768, 131072; H100-like 989 TFLOP/s bf16 at
40% efficiency.  Global batch: 4M tokens (2^22: 512, 128, 32 sequences), raised
to one sequence per GPU where that is more (S = 131072 on 64 GPUs: 64).

For every cell the advisor ranks all strategies (``prune="top2"``: winner,
runner-up, margin and the best configuration pretrain_llama.py can run are exact;
other strategies' figures are lower bounds of their best; TawPipe with and without
its shard cache, ``--tawpipe-cache on|off``, where memory allows) and the study
records the winner, the runner-up (best of another strategy), the margin, and the best runnable strategy (what
pretrain_llama.py runs: every strategy, FSDP2 and HSDP with full recompute
included, but HFSDP with tensor parallelism).

    python tools/scale_study.py                      # examples/results/scale_study.{json,png}
    python tools/scale_study.py --models 7b --gpus 16 --seq 8192 --out /tmp/s.json
    python tools/scale_study.py --summary            # the counts docs/advisor-scale-study.md quotes
    python tools/scale_study.py --gpus 64 --tawpipe-cache off --out /tmp/off.json   # TawPipe without the cache only
    python tools/scale_study.py --gpus 64 --only tawpipe --out /tmp/taw.json        # TawPipe's exact best per cell

The search is the advisor's (``tools/simulate.py --advise``): micro-batch sizes 1, 2, 4, ... up to each strategy's
batch per replica, TawPipe's micro-batches per visit up to one visit per shard, each within memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    import megatron_tawpipe  # noqa: F401
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.cli.plan_args import check_command  # noqa: E402
from megatron_tawpipe.sim.advisor import advise  # noqa: E402
from megatron_tawpipe.sim.advisor_configs import PRESETS, Cluster, ModelSpec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = {"tawpipe": "#d62728", "hsdp": "#1f77b4", "hfsdp": "#9467bd", "distopt-node": "#2ca02c",
           "distopt": "#98df8a", "fsdp": "#aec7e8", "pp-nodes": "#ff7f0e", "1f1b": "#ffbb78",
           "interleaved": "#8c564b", "weipipe": "#e377c2", "none": "#dddddd"}


#: --tawpipe-cache of the study: TawPipe's configurations tried with the shard cache on and off (choice), or
#: only one of them (the runtime's rule before the flag was cache on for <= 4 nodes, off above)
CACHE_CHOICES = {"choice": (True, False), "on": (True,), "off": (False,)}


def cell(model_name, gpus, gbit, seq, plan_cache, per_node=8, peak=989.0, eff=0.4, tawpipe_cache="choice",
         only=None):
    model = ModelSpec(seq_length=seq, **PRESETS[model_name])
    cluster = Cluster(ranks=gpus, nodes=gpus // per_node, intra_bw=450e9, inter_bw=gbit * 1e9 / 8,
                      peak_tflops=peak, efficiency=eff, gpu_memory=80e9, memory_reserve=5e9)
    gbs = max(2 ** 22 // seq, gpus)
    caches = CACHE_CHOICES[tawpipe_cache]

    def keep(c):
        return (c.strategy != "tawpipe" or c.knobs["cache"] in caches or cluster.nodes == 1) and \
            (only is None or c.strategy in only)

    s = advise(model, cluster, gbs, prune="top2", plan_cache=plan_cache, runtime_knobs_only=True,
               check_command=check_command, keep=keep)
    ranked = s["ranked"]
    out = {"model": model_name, "gpus": gpus, "inter_gbit": gbit, "seq_length": seq,
           "global_batch": gbs, "tawpipe_cache": tawpipe_cache, "winner": None, "runner_up": None, "margin": None,
           "best_trainable": None, "tawpipe": None, "error": s.get("error")}
    if not ranked:
        return out
    best_of = {}
    for r in ranked:
        best_of.setdefault(r["strategy"], r)
    keep = ("strategy", "label", "tokens_per_sec_per_gpu", "memory_bytes", "bubble_ratio",
            "inter_bytes_per_node", "trainable")
    slim = lambda r: {k: r[k] for k in keep} if r else None  # noqa: E731
    order = sorted(best_of.values(), key=lambda r: -r["tokens_per_sec_per_gpu"])
    out["winner"] = slim(order[0])
    out["runner_up"] = slim(order[1]) if len(order) > 1 else None
    if out["runner_up"]:
        out["margin"] = order[0]["tokens_per_sec_per_gpu"] / order[1]["tokens_per_sec_per_gpu"] - 1
    out["best_trainable"] = slim(next((r for r in order if r["trainable"]), None))
    out["tawpipe"] = slim(best_of.get("tawpipe"))
    out["strategies"] = {k: v["tokens_per_sec_per_gpu"] for k, v in best_of.items()}
    top = order[0]["tokens_per_sec_per_gpu"]
    out["within_1pct"] = [r["strategy"] for r in order if r["tokens_per_sec_per_gpu"] >= 0.99 * top]
    return out


def _tp(row) -> int:
    """Tensor-parallel size of a cell's row (its label's ``tp=T``; 1 without)."""
    return next((int(w[3:]) for w in row["label"].split() if w.startswith("tp=")), 1)


def summary(rows) -> str:
    """The study's counts: cells where something fits, winners by strategy and tensor-parallel size,
    where TawPipe fits, wins, is the best runnable or within 1% of the winner, and what
    pretrain_llama.py runs best."""
    from collections import Counter

    fit = [r for r in rows if r["winner"]]
    taw = [r for r in fit if r["tawpipe"]]
    cell = lambda r: f"{r['model']} {r['gpus']} GPUs {r['inter_gbit']} Gbit/s S={r['seq_length'] // 1024}k"  # noqa: E731
    lines = [f"cells: {len(rows)}; something fits in {len(fit)}; nothing fits: "
             + (", ".join(cell(r) for r in rows if not r["winner"]) or "none"),
             "winners by tensor-parallel size: " + ", ".join(
                 f"T={t}: {n}" for t, n in sorted(Counter(_tp(r["winner"]) for r in fit).items())),
             "winners by strategy: " + ", ".join(f"{s} {n}" for s, n in Counter(
                 r["winner"]["strategy"] + ("" if r["winner"]["trainable"] else "*") for r in fit).most_common()),
             "best runnable by strategy: " + ", ".join(f"{s} {n}" for s, n in Counter(
                 r["best_trainable"]["strategy"] for r in fit if r["best_trainable"]).most_common()),
             f"best runnable is the winner in {sum(r['best_trainable'] == r['winner'] for r in fit)}, within 1% of it "
             f"in {sum(r['best_trainable'] is not None and r['best_trainable'] != r['winner'] and r['best_trainable']['tokens_per_sec_per_gpu'] >= 0.99 * r['winner']['tokens_per_sec_per_gpu'] for r in fit)} more",
             f"tawpipe fits in {len(taw)} (its best without tensor parallelism in "
             f"{sum(_tp(r['tawpipe']) == 1 for r in taw)}, with shards of different sizes in "
             f"{sum('[' in r['tawpipe']['label'] for r in taw)}, with the replicated first shard in "
             f"{sum('rep0' in r['tawpipe']['label'] for r in taw)})",
             "tawpipe fastest: " + (", ".join(f"{cell(r)} (+{100 * r['margin']:.1f}% over {r['runner_up']['strategy']})"
                                              for r in fit if r["winner"]["strategy"] == "tawpipe") or "none"),
             "tawpipe best runnable: " + (", ".join(
                 f"{cell(r)} ({100 * (r['tawpipe']['tokens_per_sec_per_gpu'] / r['winner']['tokens_per_sec_per_gpu'] - 1):+.1f}% "
                 f"vs {r['winner']['strategy']}, `{r['tawpipe']['label']}`)"
                 for r in fit if r["best_trainable"] and r["best_trainable"]["strategy"] == "tawpipe") or "none"),
             "tawpipe within 1% of the winner: " + (", ".join(cell(r) for r in fit if "tawpipe" in r["within_1pct"])
                                                    or "none")]
    behind = [r["tawpipe"]["tokens_per_sec_per_gpu"] / r["winner"]["tokens_per_sec_per_gpu"] - 1 for r in taw]
    if behind:
        lines.append(f"tawpipe against the winner where it fits: {100 * min(behind):+.1f}% to {100 * max(behind):+.1f}%")
    return "\n".join(lines)


def compare(before, after) -> str:
    """TawPipe's best per cell in two studies of the same cells (e.g. ``--tawpipe-cache off`` and the default):
    tokens/s per GPU, against each study's winner, and its configuration (a markdown table)."""
    key = lambda r: (r["model"], r["gpus"], r["inter_gbit"], r["seq_length"])  # noqa: E731
    old = {key(r): r for r in before}
    lines = ["| cell | winner | TawPipe before | TawPipe after | change |", "|---|---|---|---|---|"]

    def taw(r):
        t, w = r["tawpipe"], r["winner"]
        if not t:   # nothing fits, or (prune top2) no configuration's ceiling beats the runner-up
            return "not ranked", None
        v = t["tokens_per_sec_per_gpu"]
        return f"{v:.0f} ({100 * (v / w['tokens_per_sec_per_gpu'] - 1):+.1f}%) `{t['label']}`", v
    for r in after:
        b = old.get(key(r))
        if b is None or not r["winner"]:
            continue
        (bt, bv), (at, av) = taw(b), taw(r)
        change = f"{100 * (av / bv - 1):+.1f}%" if av and bv else "-"
        w = r["winner"]
        lines.append(f"| {r['model']} {r['gpus']} GPUs {r['inter_gbit']} Gbit/s S={r['seq_length'] // 1024}k | "
                     f"{w['strategy']} {w['tokens_per_sec_per_gpu']:.0f} | {bt} | {at} | {change} |")
    return "\n".join(lines)


def plot(rows, path, models, gpus, gbits, seqs) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(models), len(seqs), figsize=(4.2 * len(seqs), 2.5 * len(models)),
                             squeeze=False)
    index = {(r["model"], r["gpus"], r["inter_gbit"], r["seq_length"]): r for r in rows}
    used = set()
    for i, m in enumerate(models):
        for j, s in enumerate(seqs):
            ax = axes[i][j]
            for y, g in enumerate(gpus):
                for x, bw in enumerate(gbits):
                    r = index.get((m, g, bw, s))
                    win = r["winner"]["strategy"] if r and r["winner"] else "none"
                    used.add(win)
                    ax.add_patch(plt.Rectangle((x, y), 1, 1, color=COLOURS.get(win, "#777777"), ec="white"))
                    if r and r["winner"]:
                        short = lambda n: n.replace("distopt-node", "dopt-n").replace("interleaved", "intl")  # noqa: E731
                        text = short(win) + ("" if r["winner"]["trainable"] else "*")
                        if r["margin"] is not None and r["margin"] < 0.01:
                            text += f"\n= {r['runner_up']['strategy']}"
                        elif r["margin"] is not None:
                            text += f"\n+{100 * r['margin']:.0f}%"
                        if r["winner"]["strategy"] == "tawpipe" or (r["tawpipe"] is None):
                            pass
                        elif r["tawpipe"]:
                            t = r["tawpipe"]["tokens_per_sec_per_gpu"] / r["winner"]["tokens_per_sec_per_gpu"] - 1
                            text += f"\nT {100 * t:.0f}%"
                        bt = r["best_trainable"]
                        if not r["winner"]["trainable"] and bt:
                            t = bt["tokens_per_sec_per_gpu"] / r["winner"]["tokens_per_sec_per_gpu"] - 1
                            text += f"\nhere: {short(bt['strategy'])} {100 * t:.0f}%"
                    else:
                        text = "no fit"
                    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=6.5)
            ax.set_xlim(0, len(gbits))
            ax.set_ylim(0, len(gpus))
            ax.set_xticks([k + 0.5 for k in range(len(gbits))])
            ax.set_xticklabels([f"{b}G" for b in gbits], fontsize=7)
            ax.set_yticks([k + 0.5 for k in range(len(gpus))])
            ax.set_yticklabels([f"{g} GPU" for g in gpus], fontsize=7)
            ax.set_title(f"{m.upper()}, S={s // 1024}k", fontsize=9)
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS if k in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle("Advisor's pick per cell (x: Gbit/s between 8-GPU nodes). Text: winner (* not runnable with "
                 "pretrain_llama.py), margin over the runner-up strategy or '= runner-up' within 1%,\n"
                 "T: TawPipe vs the winner where TawPipe applies, here: best runnable with pretrain_llama.py vs "
                 "the winner", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=130)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="7b,13b,34b,70b")
    p.add_argument("--gpus", default="16,32,64")
    p.add_argument("--gbits", default="10,25,100,400", help="Gbit/s between nodes")
    p.add_argument("--seq", default="8192,32768,131072")
    p.add_argument("--efficiency", type=float, default=0.4)
    p.add_argument("--tawpipe-cache", choices=sorted(CACHE_CHOICES), default="choice",
                   help="TawPipe's shard cache in the study: tried on and off (choice, the default), or only on / "
                        "only off (off at 8 nodes is the runtime's rule before --tawpipe-cache)")
    p.add_argument("--only", default=None, metavar="STRATEGIES",
                   help="rank only these strategies (comma-separated, e.g. tawpipe: its exact best per cell, which "
                        "--prune top2 leaves a lower bound where it is neither winner nor runner-up)")
    p.add_argument("--out", default=os.path.join(ROOT, "examples", "results", "scale_study.json"))
    p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    p.add_argument("--replot", action="store_true", help="only redraw the chart from --out")
    p.add_argument("--summary", action="store_true", help="only print the counts of --out")
    p.add_argument("--compare", metavar="BEFORE", help="only print TawPipe's best per cell in BEFORE (a study's "
                   "JSON) against --out's")
    args = p.parse_args(argv)
    if args.compare:
        with open(args.compare) as f, open(args.out) as g:
            print(compare(json.load(f)["cells"], json.load(g)["cells"]))
        return 0
    if args.summary:
        with open(args.out) as f:
            print(summary(json.load(f)["cells"]))
        return 0
    models = args.models.split(",")
    gpus = [int(x) for x in args.gpus.split(",")]
    gbits = [float(x) if "." in x else int(x) for x in args.gbits.split(",")]
    seqs = [int(x) for x in args.seq.split(",")]
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f)["cells"], png, models, gpus, gbits, seqs)
        print(f"wrote {png}")
        return 0
    rows, t0 = [], time.time()
    for m in models:
        for g in gpus:
            cache = {}     # plans depend on ranks, layers and micro-batches, not on links or S
            for s in seqs:
                for bw in gbits:
                    r = cell(m, g, bw, s, cache, eff=args.efficiency, tawpipe_cache=args.tawpipe_cache,
                             only=args.only.split(",") if args.only else None)
                    rows.append(r)
                    w = r["winner"]
                    print(f"{m:>4} {g:>3} GPUs {bw:>4} Gbit/s S={s:>6}: "
                          + (f"{w['strategy']} {w['label']} {w['tokens_per_sec_per_gpu']:.0f} tok/s/GPU"
                             + (f", +{100 * r['margin']:.1f}% over {r['runner_up']['strategy']}"
                                if r["margin"] is not None else "") if w else f"nothing fits: {r['error']}")
                          + f"  [{time.time() - t0:.0f} s]", flush=True)
    meta = {"description": "advisor's pick per cell (cost-model prediction)",
            "command": "python tools/scale_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "gpus_per_node": 8, "gpu_memory_GB": 80, "memory_reserve_GB": 5, "intra_GB_per_s": 450,
            "peak_tflops": 989, "efficiency": args.efficiency, "tawpipe_cache": args.tawpipe_cache,
            "only": args.only,
            "global_batch": "max(2^22 tokens / S, one sequence per GPU) sequences"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cells": rows}, f, indent=1)
    print(f"wrote {args.out}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib, or megatron_tawpipe[plot])")
        return 0
    plot(rows, png, models, gpus, gbits, seqs)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
