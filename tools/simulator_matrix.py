#!/usr/bin/env python
"""The simulator out of sample: measure a matrix of emulated configurations (root), simulate
them, and report measured against predicted for every strategy.

    sudo python tools/simulator_matrix.py measure --out runs/matrix      # ~80 min, resumable
    python tools/simulator_matrix.py simulate --out runs/matrix          # after a model change
    python tools/simulator_matrix.py report --out runs/matrix \\
        --json examples/results/simulator_matrix.json --text examples/results/simulator_matrix.txt

The configurations are in tools/tawpipe_lab/matrix.py (MATRIX); --configs picks some.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tawpipe_lab.matrix import (MATRIX, compare, format_config, format_markdown, format_summary,  # noqa: E402
                                measure, simulate, summarize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("stage", choices=("measure", "simulate", "report", "all"))
    p.add_argument("--out", default="runs/matrix", help="one folder per configuration")
    p.add_argument("--configs", default=None, help="comma-separated names (default: all of MATRIX)")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=4)
    p.add_argument("--burst", default=None, help="measure: htb burst of the node links (default: "
                   "tools/emulated_cluster.py's)")
    p.add_argument("--equal-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure: each strategy at its own micro-batch size under TawPipe's memory "
                   "(tools/benchmark.py --equal-memory); --no-equal-memory runs every strategy at 1")
    p.add_argument("--equal-memory-rule", choices=("whole", "activations"), default="whole",
                   help="measure: what equal memory counts (tools/benchmark.py --equal-memory-rule): the whole "
                        "footprint, or activations and logits only (the matrix's runs before 2026-11-28)")
    p.add_argument("--remeasure", default=None, metavar="S,S",
                   help="measure: these strategies again in every measured configuration (at the micro-batch sizes "
                        "its results chose) and replace their rows")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="the simulator's collectives: as gloo runs them on CPU (the emulated runs), or NCCL on GPUs")
    p.add_argument("--json", default=None, help="report: write the comparison here")
    p.add_argument("--text", default=None, help="report: write the printed tables here too")
    p.add_argument("--markdown", default=None, help="report: write one table row per configuration here")
    args = p.parse_args(argv)
    names = [c.name for c in MATRIX]
    wanted = names if args.configs is None else [x.strip() for x in args.configs.split(",")]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {', '.join(names)}")
    configs = [c for c in MATRIX if c.name in wanted]
    if args.stage in ("measure", "all") and os.geteuid() != 0:
        p.error("measure needs root (the emulated cluster's network namespaces)")
    entries, text = [], []
    for c in configs:
        outdir = os.path.join(args.out, c.name)
        os.makedirs(outdir, exist_ok=True)
        results = os.path.join(outdir, "results.json")
        if args.stage in ("measure", "all") and (not os.path.exists(results) or args.remeasure):
            only = [s.strip() for s in (args.remeasure or "").split(",") if s.strip()] if os.path.exists(results) else []
            print(f"== {c.name}" + (f" (again: {', '.join(only)})" if only else ""), flush=True)
            measure(c, outdir, args.repetitions, args.train_iters, progress=lambda line: print(line, flush=True),
                    burst=args.burst, equal_memory=args.equal_memory, only=only,
                    equal_memory_rule=args.equal_memory_rule)
        if args.stage in ("simulate", "all"):
            simulate(c, outdir, args.backend)
        if args.stage in ("report", "all"):
            if not os.path.exists(results):
                print(f"{c.name}: not measured yet ({results})", file=sys.stderr)
                continue
            with open(results, encoding="utf-8") as f:
                measured = json.load(f)
            sim_path = os.path.join(outdir, "simulated.json")
            if not os.path.exists(sim_path):
                simulate(c, outdir, args.backend)
            with open(sim_path, encoding="utf-8") as f:
                simulated = json.load(f)
            entry = compare(c, measured, simulated)
            entries.append(entry)
            text.append(format_config(entry))
    if entries:
        summary = summarize(entries)
        text.append(format_summary(summary))
        print("\n\n".join(text))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"summary": summary, "configs": entries}, f, indent=1)
        if args.text:
            with open(args.text, "w", encoding="utf-8") as f:
                f.write("\n\n".join(text) + "\n")
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(format_markdown(entries, summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
