#!/usr/bin/env python
"""Validate every planner's plans, NCCL's ordering rules included, over a range of shapes.

    python tools/check_plans.py                       # P = 2..16, every D dividing P, N = 1..6
    python tools/check_plans.py --ranks 2-8 --microbatches 1-3 --workers 2
    python tools/check_plans.py --write-plans plans.jsonl    # build only; compare two such files byte for byte
    python tools/check_plans.py --splits even         # only shards of equal size (the default: even and uneven)
    python tools/check_plans.py --context-parallel 2,4   # weight passing's per-GPU plans with C members too

TawPipe's options are checked as a whole product for P <= --full-product-max-ranks
and one at a time (plus the named variants) above.  Prints the count of plans checked
per schedule and every failure; exits 1 if any plan fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tawpipe.plan.sweep import SPLITS, SWEPT, build_case, plan_cases, run_sweep  # noqa: E402


def _range(text: str):
    lo, _, hi = text.partition("-")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N-M, got {text!r}") from None
    if lo_i < 1 or hi_i < lo_i:
        raise argparse.ArgumentTypeError(f"empty or non-positive range {text!r}")
    return list(range(lo_i, hi_i + 1))


def _one(args):
    P, microbatches, full, splits, report, schedules, cp = args
    return P, run_sweep([P], microbatches, full, splits=splits, report=report, schedules=schedules,
                        context_parallel=cp)


def _sizes(text: str):
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(c < 2 for c in sizes):
        raise argparse.ArgumentTypeError(f"--context-parallel takes comma-separated sizes of 2 or more; got {text!r}")
    return sizes


def _names(flag: str, known):
    """An argparse type: a comma-separated list of names from ``known`` (``flag`` names it in the error)."""
    def parse(text: str):
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        if not names or any(x not in known for x in names):
            raise argparse.ArgumentTypeError(f"{flag} takes a comma-separated list of {', '.join(known)}; "
                                             f"got {text!r}")
        return names
    return parse


def write_plans(path: str, ranks, microbatches, full_product_max_ranks: int, splits=SPLITS, schedules=None) -> int:
    """Every plan of the sweep, built (not validated), one line each: schedule, arguments, its JSON.
    Two such files compare byte for byte when the planners are unchanged."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for schedule, kwargs in plan_cases(ranks, microbatches, full_product_max_ranks, splits=splits,
                                           schedules=schedules):
            plan = build_case(schedule, kwargs)
            f.write(json.dumps([schedule, kwargs], sort_keys=True) + "\t" + plan.to_json() + "\n")
            count += 1
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=_range, default=_range("2-16"), help="P range (default 2-16)")
    p.add_argument("--microbatches", type=_range, default=_range("1-6"), help="N range (default 1-6)")
    p.add_argument("--full-product-max-ranks", type=int, default=8,
                   help="check TawPipe's whole option product up to this P (default 8)")
    p.add_argument("--splits", type=_names("--splits", SPLITS), default=SPLITS,
                   help="shard splits: even (every shard the same number of layers), uneven (half of them one "
                        "layer more); default: both")
    p.add_argument("--schedules", type=_names("--schedules", SWEPT), default=None,
                   help=f"only these planners (comma-separated; default all: {', '.join(SWEPT)})")
    p.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    p.add_argument("--context-parallel", type=_sizes, default=(),
                   help="comma-separated context-parallel sizes C > 1: every weight-passing plan with one owner "
                        "per shard is checked again as virtual ranks of C members, their collectives included "
                        "(the per-GPU plan; the spread layout does not run with context parallelism)")
    p.add_argument("--json", metavar="PATH", help="also write the counts and failures as JSON")
    p.add_argument("--no-report", action="store_true",
                   help="skip the stricter readings reported beside the check (lazy connection without the "
                        "warm-up; one issue order across a GPU's communicators)")
    p.add_argument("--write-plans", metavar="PATH",
                   help="only build the sweep's plans and write them, one JSON line each, to PATH (no validation)")
    args = p.parse_args(argv)
    start = time.time()
    if args.write_plans:
        count = write_plans(args.write_plans, args.ranks, args.microbatches, args.full_product_max_ranks,
                            args.splits, args.schedules)
        print(f"wrote {count} plans to {args.write_plans} in {time.time() - start:.0f} s")
        return 0
    jobs = [(P, args.microbatches, args.full_product_max_ranks, args.splits, not args.no_report, args.schedules,
             args.context_parallel) for P in sorted(args.ranks, reverse=True)]
    if args.workers > 1:
        with mp.Pool(args.workers) as pool:
            results = pool.map(_one, jobs, chunksize=1)
    else:
        results = [_one(j) for j in jobs]
    total, by_schedule, failures, unwarmed, device, in_flight, cache, cp = 0, {}, [], {}, {}, {}, {}, {}
    for P, res in sorted(results, key=lambda x: x[0]):
        total += res.checked
        for counts, mine in ((by_schedule, res.by_schedule), (unwarmed, res.hang_without_warmup),
                             (device, res.device_order_ok), (cp, res.context_parallel)):
            for k, v in mine.items():
                counts[k] = counts.get(k, 0) + v
        for k, v in res.most_in_flight.items():
            in_flight[k] = max(in_flight.get(k, 0), v)
        for k, (checked, failed) in res.tawpipe_cache.items():
            cache[k] = [a + b for a, b in zip(cache.get(k, [0, 0]), (checked, failed))]
        failures += res.failures
        print(f"P={P:>2}: {res.checked} plans, {len(res.failures)} failed", flush=True)
    for schedule, kwargs, error in failures[:20]:
        print(f"FAILED {schedule} {kwargs}: {error}")
    print(f"checked {total} plans in {time.time() - start:.0f} s: " +
          ", ".join(f"{k} {v}" for k, v in sorted(by_schedule.items())) +
          f"; {len(failures)} failed")
    if cp:
        print("weight-passing plans checked with context-parallel members too: " +
              ", ".join(f"C = {k}: {v}" for k, v in sorted(cp.items())))
    if cache:
        print("tawpipe by shard cache and scheduling groups D: " +
              ", ".join(f"{k}: {n} ({f} failed)" for k, (n, f) in sorted(cache.items())))
    if not args.no_report:
        print("reported, not required -- would hang under lazy connection without the warm-up: " +
              ", ".join(f"{k} {unwarmed.get(k, 0)}/{v}" for k, v in sorted(by_schedule.items())))
        print("reported, not required -- run in one issue order across a GPU's communicators: " +
              ", ".join(f"{k} {device.get(k, 0)}/{v}" for k, v in sorted(by_schedule.items())))
        print("communicators with operations in flight at once on one rank, at most: " +
              ", ".join(f"{k} {v}" for k, v in sorted(in_flight.items())))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"checked": total, "by_schedule": by_schedule, "tawpipe_cache": cache, "ranks": args.ranks,
                       "context_parallel": {str(k): v for k, v in sorted(cp.items())},
                       "schedules": list(args.schedules or SWEPT),
                       "microbatches": args.microbatches,
                       "full_product_max_ranks": args.full_product_max_ranks, "splits": list(args.splits),
                       **({} if args.no_report else {"hang_without_warmup": unwarmed, "device_order_ok": device,
                                                   "most_communicators_in_flight": in_flight}),
                       "seconds": round(time.time() - start),
                       "failures": [[s, k, e] for s, k, e in failures]}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
