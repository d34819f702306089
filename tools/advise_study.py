#!/usr/bin/env python
"""The advisor (``tools/simulate.py --advise``) on one cluster for several Llama presets and context
lengths: each case's report, the JSON of every strategy's best, and a markdown summary ranking the
strategies with TawPipe's place (a prediction of the cost model, not a measurement).

Default: the TawPipe paper's cluster shape, 24 GPUs in 3 nodes of 8, 10 Gbit/s between nodes, 300 GB/s
inside (NVLink), 312 TFLOP/s bf16 at 40% and 80 GB per GPU (5 GB kept free); Llama-2 7B (32 layers)
and 13B (40 layers), whose layers divide over neither 24 GPUs nor 24 / T; S = 16384 and 32768; a global
batch of 3,145,728 tokens (192 and 96 sequences, a multiple of every data-parallel size).

    python tools/advise_study.py       # examples/results/advisor_24gpu_10gbe_llama2.{md,json} + one .txt per case
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.cli.plan_args import check_command  # noqa: E402
from megatron_tawpipe.common.units import parse_rate  # noqa: E402
from megatron_tawpipe.sim.advisor import advise  # noqa: E402
from megatron_tawpipe.sim.advisor_configs import PRESETS, Cluster, ModelSpec  # noqa: E402
from megatron_tawpipe.sim.advisor_report import format_report  # noqa: E402
from megatron_tawpipe.sim.memory import parse_size  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best_of_each(ranked):
    """Every strategy's best row, fastest first, with its place in the full ranking (``place`` if the
    rows carry it)."""
    out, seen = [], set()
    for place, row in enumerate(ranked, 1):
        if row["strategy"] not in seen:
            seen.add(row["strategy"])
            out.append(dict(row, place=row.get("place", place)))
    return out


FIELDS = ("place", "strategy", "label", "tokens_per_sec_per_gpu", "iteration_time_s", "bubble_ratio",
          "inter_bytes_per_node", "memory_bytes", "trainable", "note", "command")


def slim(summary: dict, top: int) -> dict:
    """The summary with its ranking cut to the first ``top`` rows and every strategy's best, and every
    strategy's best configuration that pretrain_llama.py runs."""
    ranked = summary["ranked"]
    best = best_of_each(ranked)
    runnable = best_of_each([dict(r, place=i) for i, r in enumerate(ranked, 1) if r["trainable"]])
    keep = ranked[:top] + [r for r in best if r["place"] > top]
    return dict(summary, ranked=keep, ranked_total=len(ranked),
                best_of_each_strategy=[{k: r[k] for k in FIELDS} for r in best],
                best_runnable_of_each_strategy=[{k: r[k] for k in FIELDS} for r in runnable])


def markdown(cases, cluster_line: str, command_line: str) -> str:
    lines = ["# The advisor on 24 GPUs in 3 nodes (10 Gbit/s): Llama-2 7B and 13B", "",
             "A prediction of the cost model, not a measurement. Reproduce with:", "", "```", command_line, "```", "",
             cluster_line, ""]
    for case in cases:
        s, name = case["summary"], case["name"]
        md = s["model"]
        top = s["best_of_each_strategy"][0]["tokens_per_sec_per_gpu"] if s["best_of_each_strategy"] else 0.0
        lines += [f"## {name}: L={md['num_layers']}, S={md['seq_length']}, global batch "
                  f"{s['global_batch_sequences']} sequences ({s['global_batch_tokens'] / 1e6:.2f}M tokens)", "",
                  f"{s['evaluated']} configurations evaluated, {s['pruned']} not simulated; report: "
                  f"`{case['text']}`.", "",
                  "| place | strategy | best configuration | tok/s/GPU | vs best | iter s | bubble | inter GB/node "
                  "| mem GB | runs with pretrain_llama.py |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["best_of_each_strategy"]:
            runs = "yes" if r["trainable"] else "no: " + r["note"].split(";")[0]
            lines.append(f"| {r['place']} | {r['strategy']} | `{r['label']}` | {r['tokens_per_sec_per_gpu']:.0f} | "
                         f"{100 * (r['tokens_per_sec_per_gpu'] / top - 1):+.1f}% | {r['iteration_time_s']:.1f} | "
                         f"{r['bubble_ratio']:.3f} | {r['inter_bytes_per_node'] / 1e9:.1f} | "
                         f"{r['memory_bytes'] / 1e9:.1f} | {runs} |")
        for s_name, why in s["missing"].items():
            lines.append(f"| - | {s_name} | absent: {why[0]} | | | | | | | |")
        runnable = s["best_runnable_of_each_strategy"]
        order = [r["strategy"] for r in runnable]
        if runnable:
            here = runnable[0]
            lines += ["", "Best of each strategy that pretrain_llama.py runs: " + ", ".join(
                f"{r['strategy']} {r['tokens_per_sec_per_gpu']:.0f} (`{r['label']}`)" for r in runnable) + "."]
        taw = next((r for r in runnable if r["strategy"] == "tawpipe"), None)
        if taw:
            lines += ["", f"TawPipe is #{order.index('tawpipe') + 1} of the {len(order)} strategies pretrain_llama.py "
                          f"runs: {100 * (taw['tokens_per_sec_per_gpu'] / top - 1):+.1f}% against the fastest "
                          f"({s['best_of_each_strategy'][0]['strategy']}), "
                          f"{100 * (taw['tokens_per_sec_per_gpu'] / here['tokens_per_sec_per_gpu'] - 1):+.1f}% "
                          f"against the fastest that runs here ({here['strategy']}); its command:", "", "```",
                      taw["command"], "```"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="7b,13b")
    p.add_argument("--seq", default="16384,32768")
    p.add_argument("--global-batch-tokens", type=int, default=3145728)
    p.add_argument("--ranks", type=int, default=24)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--intra-bw", default="300GB/s")
    p.add_argument("--inter-bw", default="10Gbit/s")
    p.add_argument("--peak-tflops", type=float, default=312.0)
    p.add_argument("--efficiency", type=float, default=0.4)
    p.add_argument("--gpu-memory", default="80GB")
    p.add_argument("--memory-reserve", default="5GB")
    p.add_argument("--top", type=int, default=15, help="rows of each report's ranking")
    p.add_argument("--out", default=os.path.join(ROOT, "examples", "results", "advisor_24gpu_10gbe_llama2"),
                   help="prefix: PREFIX.md, PREFIX.json, PREFIX_<model>_<seq>.txt")
    args = p.parse_args(argv)
    cluster = Cluster(ranks=args.ranks, nodes=args.ranks // args.ranks_per_node, intra_bw=parse_rate(args.intra_bw),
                      inter_bw=parse_rate(args.inter_bw), peak_tflops=args.peak_tflops, efficiency=args.efficiency,
                      gpu_memory=parse_size(args.gpu_memory), memory_reserve=parse_size(args.memory_reserve))
    cases, plan_cache = [], {}
    for name in args.models.split(","):
        for seq in (int(x) for x in args.seq.split(",")):
            model = ModelSpec(seq_length=seq, **PRESETS[name])
            gbs = args.global_batch_tokens // seq
            t0 = time.time()
            summary = advise(model, cluster, gbs, plan_cache=plan_cache, check_command=check_command,
                             listed=args.top)
            text_path = f"{args.out}_{name}_{seq // 1024}k.txt"
            command = (f"python tools/simulate.py --advise --model {name} --ranks {args.ranks} --ranks-per-node "
                       f"{args.ranks_per_node} --seq-length {seq} --global-batch-size {gbs} --intra-bw {args.intra_bw} "
                       f"--inter-bw {args.inter_bw} --peak-tflops {args.peak_tflops:g} --efficiency "
                       f"{args.efficiency:g} --gpu-memory {args.gpu_memory} --memory-reserve {args.memory_reserve}")
            with open(text_path, "w") as f:
                f.write(f"$ {command}\n\n{format_report(summary, rows=args.top)}\n")
            cases.append({"name": f"Llama-2 {name.upper()}", "preset": name, "seq_length": seq,
                          "command": command, "text": os.path.relpath(text_path, ROOT),
                          "seconds": round(time.time() - t0, 1), "summary": slim(summary, args.top)})
            print(f"{name} S={seq}: {cases[-1]['seconds']} s, best {summary['best']['strategy']} "
                  f"{summary['best']['label']}", file=sys.stderr)
    cluster_line = (f"Cluster: {args.ranks} GPUs in {cluster.nodes} nodes of {args.ranks_per_node}, {args.inter_bw} "
                    f"between nodes, {args.intra_bw} inside, {args.peak_tflops:g} TFLOP/s x {args.efficiency:g}, "
                    f"{args.gpu_memory} per GPU ({args.memory_reserve} kept free). Each row is the best configuration "
                    "of its strategy; place: its place in the advisor's full ranking.")
    with open(args.out + ".json", "w") as f:
        json.dump(cases, f, indent=1)
    study = "python tools/advise_study.py" + ("" if argv is None else " " + " ".join(argv))
    with open(args.out + ".md", "w") as f:
        f.write(markdown(cases, cluster_line, study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
