#!/usr/bin/env python
"""The measured-against-predicted table of examples/benchmark_context_parallel.sh.

    python tools/context_parallel_report.py OUT ROUNDS NAME...

reads ``OUT/NAME-K.json`` (the benchmark's results of round K) and ``OUT/NAME-simulated.json`` (its
``--simulate-as-run`` rows) for each strategy NAME, and prints per strategy the median tokens/s per rank of every
measured run (min-max), the simulator's prediction and predicted / measured; then where one iteration's seconds
went, measured (medians over the runs: the compute slept, the ring's exchanges beside the sleeps, the rest) beside
the simulator's (the compute, the ring's exposed time, the rest); writes the same as JSON to ``OUT/summary.json``.
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
        row = next(r for r in simulated if r["schedule"] == name)
        predicted = row["tokens_per_sec_per_rank"]
        measured = statistics.median(tps)
        rows.append({"schedule": name, "runs": len(tps), "measured_tokens_per_sec_per_rank": measured,
                     "measured_min": min(tps), "measured_max": max(tps),
                     "predicted_tokens_per_sec_per_rank": predicted, "predicted_over_measured": predicted / measured,
                     "measured_each": tps, "seconds": seconds(runs, row)})
    return rows


def _median(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def seconds(runs, row) -> dict:
    """One iteration's seconds, measured and predicted: whole, compute, the ring's exposed time, the rest."""
    iteration = _median(runs, "elapsed_ms") / 1000
    busy = _median(runs, "compute_busy_fraction")
    ring = _median(runs, "emulated_ring_seconds") or 0.0
    slept = busy * iteration if busy is not None else None
    t = row["iteration_time_s"]
    ring_p = row.get("options", {}).get("context_parallel_ring_seconds_per_gpu", 0.0)
    compute_p = (1.0 - row["bubble_ratio"]) * t - ring_p   # the simulator's busy time holds the ring's exposed time
    return {"measured": {"iteration": iteration, "compute": slept, "ring": ring,
                         "rest": iteration - slept - ring if slept is not None else None},
            "predicted": {"iteration": t, "compute": compute_p, "ring": ring_p, "rest": t - compute_p - ring_p}}


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
    print("\none iteration, seconds: measured / predicted")
    print(f"{'strategy':<12} {'iteration':>15} {'compute':>15} {'ring':>15} {'rest':>15}")
    for r in rows:
        m, p = r["seconds"]["measured"], r["seconds"]["predicted"]
        cells = ["-" if m[k] is None else f"{m[k]:.3f} / {p[k]:.3f}" for k in ("iteration", "compute", "ring", "rest")]
        print(f"{r['schedule']:<12} " + " ".join(f"{c:>15}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
