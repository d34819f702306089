#!/usr/bin/env python
"""TawPipe's ownership layouts against the other strategies, simulated on the emulated clusters' model.

The long-context model of docs/benchmarks-multinode.md (hidden 256, FFN 704, S = 3072, fp32, 2 layers per
rank, no recompute, the emulated compute of ``calibrate_times``) on D nodes of 2 ranks: every cell runs
``tools/simulate.py --json`` the way ``tools/benchmark.py --simulate-as-run`` does (TawPipe at micro-batch 1
with 4 micro-batches per visit, the distributed optimizer and HFSDP at micro-batch 4, the pipeline across
nodes at 1), and prints one Markdown row per (nodes, link, samples per rank):

    source examples/long_context_model.sh && calibrate_times runs/multinode/times.json
    python tools/tawpipe_layouts.py --times runs/multinode/times.json --json layouts.json

Columns: TawPipe with one owner per shard (``--tawpipe-ownership owner``) with the cache, with the replicated
first shard and without the cache; the spread layout (``--tawpipe-ownership spread``) with gradients leaving
after the next visit (``--no-early-grads``), as built (gradients leaving during it), without the cache and
with two shards per rank (``--tawpipe-shards-per-rank 2``, ``spread x2``); the distributed optimizer, HFSDP
and pp-nodes; TawPipe's ratio to the distributed optimizer: one owner, spread, spread with two shards per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = {"300": "37500000B/s", "200": "25000000B/s", "150": "18750000B/s"}     # Mbit/s as tc sets them
MODEL = ["--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "4", "--seq-length", "3072",
         "--vocab-size", "2048", "--dtype-bytes", "4", "--tie-embeddings-and-output-weights", "--no-recompute",
         "--intra-bw", "0.6GB/s", "--backend", "gloo"]
TAWPIPE = ["--micro-batch-size", "1", "--chunk", "4"]
# (column, schedules, flags, micro-batch size: 1 or 4 samples)
CELLS = [("owner", "tawpipe,tawpipe-rep", [], 1), ("owner no cache", "tawpipe", ["--no-cache"], 1),
         ("spread late", "tawpipe", ["--tawpipe-ownership", "spread", "--no-early-grads"], 1),
         ("spread", "tawpipe", ["--tawpipe-ownership", "spread"], 1),
         ("spread no cache", "tawpipe", ["--tawpipe-ownership", "spread", "--no-cache"], 1),
         ("spread x2", "tawpipe", ["--tawpipe-ownership", "spread", "--tawpipe-shards-per-rank", "2"], 1),
         ("others", "distopt,hfsdp", [], 4), ("pp-nodes", "pp-nodes", [], 1)]
COLUMNS = ("tawpipe", "tawpipe-rep", "owner no cache", "spread late", "tawpipe-spread", "spread no cache", "spread x2",
           "distopt", "hfsdp", "pp-nodes")


def simulate(args) -> list:
    done = subprocess.run([sys.executable, "tools/simulate.py", "--json", *args], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"tools/simulate.py {' '.join(args)}: {done.stderr.strip()[-1000:]}")
    return json.loads(done.stdout)


def cell(nodes: int, rate: str, samples: int, times: str, shown: str, reduce: str = "hierarchical") -> dict:
    """Tokens/s per rank of every column, and the commands that gave them (``times`` written as ``shown``);
    ``reduce``: TawPipe's replicated all-reduce (``--tawpipe-replicated-reduce``)."""
    row = {"nodes": nodes, "rate_mbit": int(rate), "samples_per_rank": samples, "commands": []}
    shape = ["--ranks", str(2 * nodes), "--groups", str(nodes), "--num-layers", str(4 * nodes),
             "--inter-bw", RATES[rate], "--measured-times", times] + MODEL
    for column, schedules, flags, size in CELLS:
        batch = ["--micro-batch-size", str(size), "--num-microbatches", str(samples // size)]
        tawpipe = schedules.startswith("tawpipe")
        args = ["--schedule", schedules] + shape + batch + (TAWPIPE[2:] if tawpipe else []) + flags \
            + (["--tawpipe-replicated-reduce", reduce] if tawpipe and reduce != "hierarchical" else [])
        row["commands"].append("python tools/simulate.py " + " ".join(args).replace(times, shown))
        for r in simulate(args):
            name = r["schedule"] if column in ("owner", "others", "pp-nodes", "spread") else column
            row[name] = r["tokens_per_sec_per_rank"]
            row[name + " busy"] = 1.0 - r["bubble_ratio"]
    return row


def markdown(rows) -> str:
    out = ["| nodes x ranks | link | samples/rank | " + " | ".join(COLUMNS)
           + " | TawPipe / distopt: owner -> spread -> spread x2 |",
           "|---" * (len(COLUMNS) + 4) + "|"]
    for r in rows:
        d = r["distopt"]
        out.append(f"| {r['nodes']} x 2 | {r['rate_mbit']} Mbit/s | {r['samples_per_rank']} | "
                   + " | ".join(f"{r[c]:.0f}" for c in COLUMNS)
                   + f" | {r['tawpipe'] / d:.3f} -> {r['tawpipe-spread'] / d:.3f} -> {r['spread x2'] / d:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--times", required=True, help="emulated compute times (calibrate_times writes them)")
    p.add_argument("--nodes", default="3,4", help="node counts, 2 ranks each (default 3,4)")
    p.add_argument("--rates", default="300,200,150", help=f"node links in Mbit/s, of {', '.join(RATES)}")
    p.add_argument("--samples", default="4,16", help="samples per rank, multiples of 4 (default 4,16)")
    p.add_argument("--json", default=None, help="also write the rows (with their commands) here")
    p.add_argument("--tawpipe-replicated-reduce", choices=("hierarchical", "flat"), default="hierarchical",
                   help="TawPipe's replicated gradients through the nodes (default) or in one ring over all ranks")
    args = p.parse_args(argv)
    rates = args.rates.split(",")
    if any(r not in RATES for r in rates):
        p.error(f"--rates takes {', '.join(RATES)} (Mbit/s)")
    samples = [int(x) for x in args.samples.split(",")]
    if any(s < 4 or s % 4 for s in samples):
        p.error("--samples: multiples of 4 (the distributed optimizer runs micro-batches of 4)")
    times = os.path.abspath(args.times)
    rows = [cell(int(n), rate, s, times, args.times, args.tawpipe_replicated_reduce)
            for n in args.nodes.split(",") for rate in rates for s in samples]
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
