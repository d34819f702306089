#!/usr/bin/env python
"""Compare the per-iteration losses of two --metrics-file runs.

    python tools/compare_metrics.py runs/tawpipe.jsonl runs/1f1b.jsonl --rtol 1e-5

Prints one row per iteration (both losses and their relative difference) and
exits non-zero when any iteration differs by more than --rtol.
"""

import argparse
import json
import sys


def read_losses(path, key):
    values = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if key in record:
                values[record["iteration"]] = record[key]
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("candidate")
    parser.add_argument("reference")
    parser.add_argument("--key", default="lm_loss")
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    ours, theirs = read_losses(args.candidate, args.key), read_losses(args.reference, args.key)
    common = sorted(set(ours) & set(theirs))
    if not common:
        print(f"no common iterations with {args.key!r} in {args.candidate} and {args.reference}", file=sys.stderr)
        return 2
    worst = 0.0
    print(f"{'iteration':>9}  {'candidate':>14}  {'reference':>14}  {'rel diff':>9}")
    for it in common:
        rel = abs(ours[it] - theirs[it]) / max(abs(theirs[it]), 1e-30)
        worst = max(worst, rel)
        print(f"{it:9d}  {ours[it]:14.8f}  {theirs[it]:14.8f}  {rel:9.2e}")
    verdict = "agree" if worst <= args.rtol else "DIFFER"
    print(f"{len(common)} iterations, max relative difference {worst:.2e}: {verdict} (rtol {args.rtol:g})")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
