#!/usr/bin/env python
"""The measured-against-predicted table of examples/benchmark_context_parallel.sh.

    python tools/context_parallel_report.py OUT ROUNDS NAME...

reads ``OUT/NAME-K.json`` (the benchmark's results of round K) and ``OUT/NAME-simulated.json`` (its
``--simulate-as-run`` rows) for each strategy NAME, and prints per strategy the median tokens/s per rank of every
measured run (min-max), the simulator's prediction and predicted / measured; writes the same as JSON to
``OUT/summary.json``.
"""

from __future__ import annotations

import json
import statistics
import sys


def summary(out: str, rounds: int, names) -> list:
    rows = []
    for name in names:
        runs = [r for k in range(1, rounds + 1) for r in json.load(open(f"{out}/{name}-{k}.json"))["runs"]]
        tps = [r["tokens_per_sec_per_rank"] for r in runs]
        simulated = json.load(open(f"{out}/{name}-simulated.json"))
        predicted = next(r for r in simulated if r["schedule"] == name)["tokens_per_sec_per_rank"]
        measured = statistics.median(tps)
        rows.append({"schedule": name, "runs": len(tps), "measured_tokens_per_sec_per_rank": measured,
                     "measured_min": min(tps), "measured_max": max(tps),
                     "predicted_tokens_per_sec_per_rank": predicted, "predicted_over_measured": predicted / measured,
                     "measured_each": tps})
    return rows


def main(argv) -> int:
    out, rounds, names = argv[0], int(argv[1]), argv[2:]
    rows = summary(out, rounds, names)
    with open(f"{out}/summary.json", "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(f"{'strategy':<12} {'runs':>4} {'measured tok/s/rank':>20} {'(min-max)':>12} {'predicted':>10} {'pred/meas':>9}")
    for r in rows:
        print(f"{r['schedule']:<12} {r['runs']:>4} {r['measured_tokens_per_sec_per_rank']:>20.1f} "
              f"{r['measured_min']:>5.0f}-{r['measured_max']:<6.0f} {r['predicted_tokens_per_sec_per_rank']:>10.1f} "
              f"{r['predicted_over_measured']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
