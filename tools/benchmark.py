#!/usr/bin/env python
"""Run training strategies side by side on the same model, global batch and data; print a table.

Local (ranks on this machine):

    python tools/benchmark.py --ranks 4 --schedules tawpipe 1f1b distopt-node fsdp hsdp --repetitions 3 \\
        --train-iters 4 --warmup-iters 1 --json runs/bench.json --chart runs/bench.png -- \\
        --num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 1024 --micro-batch-size 1 \\
        --global-batch-size 16 --mock-data --vocab-size 8000

On an emulated cluster (root; one network namespace per node, links shaped to --rate):

    python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate 100mbit ... -- MODEL FLAGS

Strategies (each configured as its users would; "nodes" is --nodes, locally --groups):

{strategies}

Flags after ``--`` go to every run (pretrain_llama.py's model, data and batch flags). Repetitions
alternate (A B C A B C ...); the first --warmup-iters iterations of each run are dropped.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.arguments import TOOL_FLAGS  # noqa: E402
from megatron_tawpipe.sim.memory import parse_size  # noqa: E402
from megatron_tawpipe.bench.benchmark import (DEFAULT_SCHEDULES, SCHEDULES, STRATEGIES,  # noqa: E402
                                              BenchmarkConfig, config_of, BenchmarkError, BenchmarkFailed,
                                              run_benchmark)
from megatron_tawpipe.bench.benchmark_report import (compare_with_simulation, format_comparison,  # noqa: E402
                                                     format_table, write_chart)
from megatron_tawpipe.bench.equal_memory import simulate_as_run  # noqa: E402

__doc__ = __doc__.format(strategies="\n".join(f"  {name:<13}{what}" for name, what in STRATEGIES.items()))

DEFAULT_MODEL = list(TOOL_FLAGS) + ["--num-layers", "8", "--hidden-size", "128", "--ffn-hidden-size", "384", "--num-attention-heads", "4",
                 "--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "16",
                 "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8000",
                 "--lr", "1e-4", "--log-interval", "1000", "--eval-interval", "1000"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, model_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="benchmark.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES), choices=SCHEDULES,
                   help="strategies to run (default: %(default)s)")
    p.add_argument("--ranks", type=int, default=None, help="local ranks (default 4; nodes x ranks-per-node on a cluster)")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=4)
    p.add_argument("--warmup-iters", type=int, default=1)
    p.add_argument("--groups", type=int, default=None,
                   help="--tawpipe-num-groups for tawpipe/weipipe (default: nodes; locally 2)")
    p.add_argument("--nodes", type=int, default=None, help="run on an emulated cluster of this many nodes (root)")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--rate", default="100mbit", help="emulated link rate per node, e.g. 100mbit, 1gbit")
    p.add_argument("--outdir", default="runs/benchmark")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--chart", default=None, help="draw the table to this PNG")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default="auto",
                   help="the weight-passing schedules' --tawpipe-recompute: auto (default) decides as a run does "
                        "(activations kept where they fit, like the native schedules and FSDP by default); on / off "
                        "pin it (the simulator's prediction alike)")
    p.add_argument("--no-recompute", action="store_true", help="the same as --recompute off")
    p.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="--ddp-bucket-size for the megatron DDP strategies (pp-nodes, distopt-node, distopt): "
                        "on a small model megatron's default (40M parameters) is one bucket, reduced only after "
                        "the whole backward")
    p.add_argument("--bf16-gradients", action="store_true",
                   help="with --bf16 in the model flags: every strategy's bf16 gradients (weight passing: "
                        "--use-precision-aware-optimizer --main-grads-dtype bf16; megatron's DDP and FSDP2: "
                        "--grad-reduce-in-bf16)")
    p.add_argument("--tawpipe-microbatches-per-visit", type=int, default=None,
                   help="passed to the named TawPipe variants (tawpipe-spread, -rep, -nocache, -tp; default 1); "
                        "tawpipe itself runs the layout the run decides, as pretrain_llama.py does by default")
    p.add_argument("--tawpipe-shards-per-rank", type=int, default=None,
                   help="passed to the named TawPipe variants and their simulation (default 1); not to tawpipe")
    p.add_argument("--equal-memory", action="store_true",
                   help="give each strategy its own --micro-batch-size: the fastest (by tools/simulate.py on the "
                        "same model, times and links) whose memory (--equal-memory-rule) fits the budget; tawpipe "
                        "keeps the model flags' size, its window being the visit "
                        "(megatron_tawpipe/bench/equal_memory.py)")
    p.add_argument("--equal-memory-rule", choices=("whole", "activations"), default="whole",
                   help="with --equal-memory: what is counted against the budget: the whole footprint per rank "
                        "(weights, gradients, optimizer state, buffers, activations, logits; the default) or "
                        "activations and logits only (equal activation memory)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="with --equal-memory (rule whole): the whole memory per rank (e.g. 4GB; default: TawPipe's "
                        "at the model's micro-batch size, in the layout it decides)")
    p.add_argument("--activation-budget", default=None, metavar="SIZE",
                   help="with --equal-memory --equal-memory-rule activations: the activation memory per rank (e.g. "
                        "2GB; default: TawPipe's at the model's micro-batch size, in the layout it decides)")
    p.add_argument("--micro-batch-size-of", action="append", default=[], metavar="STRATEGY=N",
                   help="a strategy's own --micro-batch-size (repeatable; wins over --equal-memory's choice)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="--tensor-model-parallel-size of the tawpipe-tp runs (default: the ranks per node)")
    p.add_argument("--emulated-compute-times", default=None, metavar="FILE",
                   help="emulated compute for every schedule (see tools/calibrate.py)")
    p.add_argument("--deferred-weight-gradients", action="store_true",
                   help="no effect, kept for existing command lines: split backwards are always emulated and "
                        "simulated with the weight-gradient kernels in the weight pass, as the runtime runs them")
    p.add_argument("--record-plan-memory", action="store_true",
                   help="weight-passing runs: --record-plan-memory (what each plan's compute held; set against the "
                        "memory model's activations in the comparison)")
    p.add_argument("--measured-times", default=None, metavar="FILE",
                   help="the simulator's measured times (and tools/calibrate.py --measure-activations' bytes) for "
                        "--equal-memory's predictions (default: --emulated-compute-times)")
    p.add_argument("--compare-simulated", default=None, metavar="SIM_JSON",
                   help="with --results: print measured against tools/simulate.py --json output (default for an "
                        "--equal-memory run: the predictions it chose the micro-batch sizes by); run nothing")
    p.add_argument("--results", default=None, metavar="JSON", help="a --json file of an earlier benchmark")
    p.add_argument("--simulate-as-run", default=None, metavar="SIM_JSON",
                   help="with --results: run tools/simulate.py for every strategy at the micro-batch size it ran (the "
                        "run's model, times and links), write its rows here and compare with them")
    args = p.parse_args(argv)
    if args.compare_simulated or args.results or args.simulate_as_run:
        if not args.results:
            p.error("--compare-simulated and --simulate-as-run go with --results")
        with open(args.results, encoding="utf-8") as f:
            result = json.load(f)
        simulated = None    # an equal-memory run's own predictions, each strategy at its micro-batch size
        if args.simulate_as_run:
            simulated = simulate_as_run(config_of(result))
            with open(args.simulate_as_run, "w", encoding="utf-8") as f:
                json.dump(simulated, f, indent=1)
        elif args.compare_simulated:
            with open(args.compare_simulated, encoding="utf-8") as f:
                simulated = json.load(f)
        elif not result.get("equal_memory"):
            p.error("--results of a run without --equal-memory needs --compare-simulated SIM_JSON")
        print(format_table(result))
        print()
        print(format_comparison(compare_with_simulation(result, simulated)))
        return 0

    own_sizes = {}
    for item in args.micro_batch_size_of:
        name, _, value = item.partition("=")
        if name not in SCHEDULES or not value.isdigit() or int(value) < 1:
            p.error(f"--micro-batch-size-of {item!r}: give STRATEGY=N with N >= 1 and STRATEGY one of "
                    f"{', '.join(SCHEDULES)}")
        own_sizes[name] = int(value)
    budgets = {}
    for flag, rule in (("--memory-budget", "whole"), ("--activation-budget", "activations")):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if not args.equal_memory or args.equal_memory_rule != rule:
            p.error(f"{flag} goes with --equal-memory --equal-memory-rule {rule}")
        try:
            budgets[rule] = parse_size(value)
        except ValueError as exc:
            p.error(f"{flag}: {exc}")
    if args.equal_memory_rule != "whole" and not args.equal_memory:
        p.error("--equal-memory-rule goes with --equal-memory")
    cluster = None
    ranks = args.ranks or 4
    if args.nodes is not None:
        if os.geteuid() != 0:
            print("benchmark.py: error: the emulated cluster needs root (network namespaces)", file=sys.stderr)
            return 2
        per_node = args.ranks_per_node or 1
        cluster = (args.nodes, per_node, args.rate)
        ranks = args.nodes * per_node
    config = BenchmarkConfig(schedules=args.schedules, ranks=ranks, repetitions=args.repetitions,
                             train_iters=args.train_iters, warmup_iters=args.warmup_iters, groups=args.groups,
                             model_args=model_args if model_args is not None else DEFAULT_MODEL,
                             outdir=args.outdir, cluster=cluster, timeout_s=args.timeout,
                             recompute=_recompute(args), emulated_compute_times=args.emulated_compute_times,
                             deferred_weight_gradients=args.deferred_weight_gradients,
                             record_plan_memory=args.record_plan_memory, measured_times=args.measured_times,
                             tawpipe_microbatches_per_visit=args.tawpipe_microbatches_per_visit,
                             tawpipe_shards_per_rank=args.tawpipe_shards_per_rank,
                             ddp_bucket_size=args.ddp_bucket_size, tensor_parallel_size=args.tensor_parallel_size,
                             micro_batch_sizes=own_sizes, equal_memory=args.equal_memory,
                             equal_memory_rule=args.equal_memory_rule, memory_budget=budgets.get("whole"),
                             activation_budget=budgets.get("activations"),
                             bf16_gradients=args.bf16_gradients)
    if args.bf16_gradients and "--bf16" not in config.model_args:
        p.error("--bf16-gradients needs --bf16 among the model flags (bf16 main gradients hold bf16 compute's)")
    if args.record_plan_memory and args.emulated_compute_times:
        p.error("--record-plan-memory measures what real compute holds: not with --emulated-compute-times")
    if args.measured_times and not args.equal_memory:
        p.error("--measured-times prices --equal-memory's predictions: give --equal-memory")
    if args.warmup_iters >= args.train_iters:
        print("benchmark.py: error: --warmup-iters must be smaller than --train-iters", file=sys.stderr)
        return 2
    print(f"benchmark: {', '.join(args.schedules)} x {args.repetitions} repetitions on {ranks} ranks"
          + (f" (emulated {cluster[0]} x {cluster[1]}, {cluster[2]})" if cluster else " (local)"), flush=True)
    emulated = None
    if cluster is not None:   # the measurement lab builds it (tools/tawpipe_lab), the package never does
        from tawpipe_lab.benchmark_cluster import benchmark_cluster as emulated
    failed = None
    try:
        result = run_benchmark(config, progress=lambda line: print(line, flush=True), cluster=emulated)
    except BenchmarkFailed as exc:   # the other strategies' results are still shown and written
        result, failed = exc.result, exc
    except BenchmarkError as exc:
        print(f"benchmark.py: error: {exc}", file=sys.stderr)
        return 1
    if result["summary"]:
        print()
        print(format_table(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.chart and result["summary"]:
        write_chart(result, args.chart)
    if failed is not None:
        print(f"\nbenchmark.py: error: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def _recompute(args):
    """The weight-passing runs' recompute: None (auto), True (on) or False (off, also --no-recompute)."""
    if args.no_recompute or args.recompute == "off":
        return False
    return None if args.recompute == "auto" else True


if __name__ == "__main__":
    sys.exit(main())
