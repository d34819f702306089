"""Side-by-side benchmark of the pipeline schedules on one model, batch and data.

Each strategy runs as its own torchrun of ``pretrain_llama.py`` with
``--metrics-file``, configured as its users would configure it (see
:data:`STRATEGIES`);
repetitions alternate (A B C A B C ...) so that slow drift of the machine
affects every schedule alike. Warm-up iterations are dropped; the remaining
iterations of a run give its median tokens/s per rank, ms/iteration, bytes
between and inside nodes (every collective and transfer of every strategy, counted
as it is called: ``bench/counted_pretrain.py``, ``bench/collective_bytes.py``; the
weight-passing executor's own count of its plan's transfers beside it), peak memory
and compute busy fraction. Across repetitions the table reports the median
of the per-run medians and their spread (max - min). A failed run keeps every
rank's log and is reported with its failing rank's tail (``bench/bench_runs.py``);
the other strategies still run, then :class:`BenchmarkFailed` is raised.

Locally the ranks run on this machine (``torch.distributed.run --standalone``);
with ``cluster=(nodes, ranks_per_node, rate)`` they run on an emulated cluster that
the caller supplies (``tools/benchmark.py --nodes``: the lab's
``tools/tawpipe_lab/benchmark_cluster.py``, a network namespace per node, shaped
links, root needed), and the bytes each node's ``eth0`` sent are measured for
every schedule as well.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence

from megatron_tawpipe.common.errors import BenchmarkError
from megatron_tawpipe.bench.bench_runs import (COUNTED_PRETRAIN, PortSequence, failure_report, launch_local,
                                               launch_on_cluster, retryable)
from megatron_tawpipe.bench.collective_bytes import ENV_OUTPUT, ENV_RANKS_PER_NODE, read_rank_files, summarize_counts
from megatron_tawpipe.bench.stages import (SPLIT_FLAGS, flag_value, interleaved_layers_per_virtual_stage,
                                           interleaved_virtual_stages, model_args_for, native_stage_flags,
                                           variant_layout_flags, without_flags)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_llama.py")

# What each strategy is, with the flags its best users would pass (nodes = the cluster's nodes).
STRATEGIES = {
    "tawpipe": "TawPipe as pretrain_llama.py runs it by default: weight passing, one group per node, the layout "
               "decided by the run (every --tawpipe-* layout flag at auto)",
    "tawpipe-owner": "TawPipe with one owner per shard, its layout pinned (--tawpipe-ownership owner, the cache on, "
                     "no replicated shard: what --pipeline-schedule tawpipe ran before the run decided its layout)",
    "tawpipe-rep": "TawPipe with shard 0 held by one rank of every node (--tawpipe-replicate-first-shard)",
    "tawpipe-nocache": "TawPipe without its shard cache (--tawpipe-cache off: foreign shards fetched every visit; "
                       "the other named variants keep them)",
    "tawpipe-spread": "TawPipe with every node keeping a slice of every shard (--tawpipe-ownership spread: shards "
                      "gathered from and gradients reduce-scattered to all nodes at once)",
    "tawpipe-tp": "TawPipe over tensor-parallel groups inside each node (--tensor-model-parallel-size: the "
                  "ranks per node unless --tensor-parallel-size says otherwise; --sequence-parallel)",
    "weipipe": "WeiPipe: weight passing in one ring",
    "weipipe-zb1": "WeiPipe zero-bubble 1: backward split, the weight-gradient pass after the input gradient "
                   "(--weipipe-zero-bubble 1)",
    "weipipe-zb2": "WeiPipe zero-bubble 2: the weight-gradient pass one round later (--weipipe-zero-bubble 2)",
    "1f1b": "megatron 1F1B, one pipeline over all ranks",
    "interleaved": "megatron interleaved 1F1B over all ranks, 2 virtual stages",
    "pp-nodes": "megatron 1F1B with one stage per node, data parallel inside (distributed optimizer, "
                "overlapped gradient reduce and parameter gather)",
    "distopt-node": "megatron data parallel, distributed optimizer with one instance per node "
                    "(overlapped gradient reduce and parameter gather)",
    "distopt": "megatron data parallel, distributed optimizer over all ranks (overlapped)",
    "fsdp": "torch FSDP2 (ZeRO-3) over all ranks",
    "hsdp": "torch FSDP2 HSDP: sharded inside a node, replicated across nodes, one all-reduce per iteration",
    "hfsdp": "Megatron-FSDP HFSDP: parameters, gradients and optimizer state sharded inside a node, "
             "optimizer state also across nodes",
}
SCHEDULES = tuple(STRATEGIES)
DEFAULT_SCHEDULES = ("tawpipe", "weipipe", "1f1b", "pp-nodes", "distopt-node", "fsdp", "hsdp")
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _distributed_optimizer(config: "BenchmarkConfig") -> List[str]:
    bucket = [] if config.ddp_bucket_size is None else ["--ddp-bucket-size", str(config.ddp_bucket_size)]
    return DISTRIBUTED_OPTIMIZER + bucket


@dataclass
class BenchmarkConfig:
    schedules: Sequence[str] = DEFAULT_SCHEDULES
    ranks: int = 4
    repetitions: int = 2
    train_iters: int = 4
    warmup_iters: int = 1
    groups: Optional[int] = None  # weight-pipeline groups; default: cluster nodes, else 2 (if it divides ranks)
    model_args: Sequence[str] = ()  # pretrain_llama.py model/data/batch flags shared by every schedule
    num_layers: int = 8
    outdir: str = "runs/benchmark"
    cluster: Optional[tuple] = None  # (nodes, ranks_per_node, rate) for the emulated cluster
    burst: Optional[str] = None  # htb burst of the emulated node links (default: the cluster's)
    timeout_s: Optional[float] = None
    recompute: Optional[bool] = None   # weight passing: None decides (--tawpipe-recompute auto), True on, False off
    emulated_compute_times: Optional[str] = None  # --emulated-compute-times for every schedule
    deferred_weight_gradients: bool = False  # split backwards emulated (and simulated) with deferred wgrad kernels
    record_plan_memory: bool = False  # --record-plan-memory on the weight-passing runs
    measured_times: Optional[str] = None  # the simulator's --measured-times (default: emulated_compute_times)
    tawpipe_microbatches_per_visit: Optional[int] = None   # of the named TawPipe variants (default 1)
    tawpipe_shards_per_rank: Optional[int] = None   # of the named TawPipe variants (default 1)
    tensor_parallel_size: Optional[int] = None  # tawpipe-tp's T (default: ranks per node)
    ddp_bucket_size: Optional[int] = None  # --ddp-bucket-size for megatron's DDP strategies (overlap on small models)
    bf16_gradients: bool = False  # every strategy's bf16 gradient option (bf16_gradient_flags), with --bf16
    micro_batch_sizes: Dict[str, int] = field(default_factory=dict)  # a strategy's own --micro-batch-size
    equal_memory: bool = False   # choose each strategy's micro-batch size under a memory budget (.equal_memory)
    equal_memory_rule: str = "whole"   # what equal memory counts: the whole footprint or activations (.equal_memory.RULES)
    memory_budget: Optional[float] = None  # bytes of whole memory (rule whole); default: TawPipe's
    activation_budget: Optional[float] = None  # bytes of activations (rule activations); default: TawPipe's
    count_bytes: bool = True   # run pretrain_llama.py through bench/counted_pretrain.py: every collective's bytes
    python: str = sys.executable
    env: Dict[str, str] = field(default_factory=dict)

    def ranks_per_node(self) -> int:
        return int(self.cluster[1]) if self.cluster is not None else self.ranks

    def tawpipe_tensor_parallel_size(self) -> int:
        return self.tensor_parallel_size or self.ranks // self.num_groups()

    def micro_batch_size_of(self, schedule: str) -> int:
        """The ``--micro-batch-size`` ``schedule`` runs with (its own, else the model flags')."""
        if schedule in self.micro_batch_sizes:
            return int(self.micro_batch_sizes[schedule])
        return int(flag_value(self.model_args, "--micro-batch-size") or 1)

    def num_groups(self) -> int:
        if self.groups is not None:
            return self.groups
        if self.cluster is not None:
            return int(self.cluster[0])
        return 2 if self.ranks % 2 == 0 and self.ranks > 1 else 1


def bf16_gradient_flags(schedule: str) -> List[str]:
    """A strategy's bf16 gradients (with --bf16): weight passing's precision-aware optimizer with bf16 main
    gradients (accumulators and travelling partial gradients); megatron's DDP and FSDP2 accumulate and reduce
    in bf16 with --grad-reduce-in-bf16 (megatron-core's own precision-aware optimizer needs Transformer
    Engine's FusedAdam)."""
    if schedule.startswith(("tawpipe", "weipipe")):
        return ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]
    if schedule == "hfsdp":
        raise BenchmarkError("--bf16-gradients: Megatron-FSDP's gradient dtype is not wired to a flag here")
    return ["--grad-reduce-in-bf16"]


def schedule_command(schedule: str, config: BenchmarkConfig, metrics_file: str) -> List[str]:
    """Script and arguments of one run (what follows ``torchrun ... ``).

    Layers that the ranks do not divide: the weight-passing schedules cut them by the default split (the first
    ``L mod P`` shards one layer more); the native pipelines get the same split of their stages
    (:func:`native_stage_flags`), unless the model flags give a split (Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers``, ``--pipeline-model-parallel-layout``: one piece per rank, for
    the weight-passing schedules and ``1f1b``)."""
    p = config.ranks
    layers = int(flag_value(config.model_args, "--num-layers") or config.num_layers)
    given_split = any(flag_value(config.model_args, flag) is not None for flag in SPLIT_FLAGS)
    common = _with_micro_batch_size(model_args_for(schedule, config.model_args), config, schedule) + [
        "--train-iters", str(config.train_iters), "--metrics-file", metrics_file, "--eval-iters", "0"]
    if flag_value(config.model_args, "--num-layers") is None:
        common += ["--num-layers", str(layers)]
    if config.emulated_compute_times:
        common += ["--emulated-compute-times", os.path.abspath(config.emulated_compute_times)]
    if config.bf16_gradients:
        common += bf16_gradient_flags(schedule)
    if schedule.startswith(("tawpipe", "weipipe")):
        extra = [] if config.recompute is None else ["--tawpipe-recompute", "on" if config.recompute else "off"]
        if config.record_plan_memory:
            extra.append("--record-plan-memory")
        if schedule.startswith("weipipe-zb"):
            extra += ["--weipipe-zero-bubble", schedule[-1]]
            if config.deferred_weight_gradients:
                extra.append("--emulated-deferred-weight-gradients")
        if schedule.startswith("tawpipe") and schedule != "tawpipe":
            extra += variant_layout_flags(schedule, config)   # the plain tawpipe runs its decided layout
        if schedule == "tawpipe-tp":
            extra += ["--tensor-model-parallel-size", str(config.tawpipe_tensor_parallel_size()), "--sequence-parallel"]
        return ([PRETRAIN, "--pipeline-schedule", schedule.split("-")[0], "--tawpipe-num-groups",
                 str(config.num_groups())] + extra + common)
    if schedule == "1f1b":
        stages = [] if given_split else native_stage_flags(layers, p)
        return [PRETRAIN, "--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", str(p)] + stages + common
    if schedule == "interleaved":
        virtual = (native_stage_flags(layers, p, interleaved_virtual_stages(layers, p)) if layers % p else
                   ["--num-layers-per-virtual-pipeline-stage", str(interleaved_layers_per_virtual_stage(layers, p))])
        return [PRETRAIN, "--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", str(p)] + (
            virtual + common)
    nodes = config.num_groups()
    if schedule == "pp-nodes":
        if nodes < 2:
            raise BenchmarkError("pp-nodes needs at least 2 nodes (groups)")
        return [PRETRAIN, "--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", str(nodes)] + (
            native_stage_flags(layers, nodes) + _distributed_optimizer(config) + common)
    if schedule == "distopt-node":
        return [PRETRAIN] + _distributed_optimizer(config) + ["--num-distributed-optimizer-instances", str(nodes)] + common
    if schedule == "distopt":
        return [PRETRAIN] + _distributed_optimizer(config) + common
    if schedule == "fsdp":
        return [PRETRAIN, "--use-torch-fsdp2"] + common
    if schedule == "hsdp":
        return [PRETRAIN, "--use-torch-fsdp2", "--num-distributed-optimizer-instances", str(nodes)] + common
    if schedule == "hfsdp":
        if nodes < 2:
            raise BenchmarkError("hfsdp needs at least 2 nodes (groups): it shards the optimizer state across them")
        # Megatron-FSDP buckets its reductions by --ddp-bucket-size too (megatron_fsdp.py:255).
        return [PRETRAIN, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                "--outer-dp-sharding-strategy", "optim", "--num-distributed-optimizer-instances", str(nodes)] + (
            _distributed_optimizer(config) + common)
    raise BenchmarkError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


def _with_micro_batch_size(args: List[str], config: BenchmarkConfig, schedule: str) -> List[str]:
    """``args`` with ``schedule``'s own ``--micro-batch-size`` where it has one."""
    if schedule not in config.micro_batch_sizes:
        return args
    return without_flags(args, ("--micro-batch-size",)) + ["--micro-batch-size", str(config.micro_batch_size_of(schedule))]


def read_metrics(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _max_of(records: List[dict], key: str) -> Optional[float]:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def summarize_run(records: List[dict], warmup: int) -> dict:
    """Median over the measured (post warm-up) iterations of one run."""
    measured = records[warmup:] if len(records) > warmup else records[-1:]
    if not measured:
        raise BenchmarkError("the run wrote no metrics")

    def med(key):
        return _median([r.get(key) for r in measured])

    peak = [r.get("peak_memory_bytes_max_rank", r.get("peak_memory_bytes")) for r in measured]
    busy = med("compute_busy_fraction")
    return {
        "iterations": len(measured),
        "tokens_per_sec_per_rank": med("tokens_per_sec_per_rank"),
        "elapsed_ms": med("elapsed_ms"),
        "inter_group_bytes": med("inter_group_bytes"),
        "intra_group_bytes": med("intra_group_bytes"),
        "peak_memory_bytes_max_rank": max(p for p in peak if p is not None) if any(p is not None for p in peak) else None,
        "compute_busy_fraction": busy,
        "emulated_ring_seconds": med("emulated_ring_seconds"),
        "plan_seconds": med("plan_seconds"),
        "optimizer_seconds": med("optimizer_seconds"),
        "memory_since_model_bytes_max_rank": _max_of(measured, "memory_since_model_bytes_max_rank"),
        "memory_held_since_model_bytes_max_rank": _max_of(measured, "memory_held_since_model_bytes_max_rank"),
        "plan_memory_growth_bytes_max_rank": _max_of(measured, "plan_memory_growth_bytes_max_rank"),
        "lm_loss": [r.get("lm_loss") for r in records],
    }


def _log_dir(log_path: str) -> str:
    """Where a run's ranks keep their own logs: beside its combined log."""
    return log_path[:-len(".log")] + "-ranks" if log_path.endswith(".log") else log_path + "-ranks"


def _run_env(config: BenchmarkConfig) -> Dict[str, str]:
    env = dict(config.env)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("PYTHONPATH", ROOT)
    return env


def _launch_local(config: BenchmarkConfig, script_args: List[str], log_path: str) -> int:
    env = dict(os.environ)
    env.update(_run_env(config))
    return launch_local(config.ranks, script_args, log_path, _log_dir(log_path), env, config.python,
                        config.timeout_s).rc


class _ClusterLauncher:
    """Runs each torchrun on an emulated cluster (a fresh rendezvous port each); measures every node's eth0
    tx bytes around it and stops what a run left running."""

    def __init__(self, cluster, progress: Callable[[str], None] = print):
        self.cluster = cluster
        self.ports = PortSequence()
        self.progress = progress

    def __call__(self, config: BenchmarkConfig, script_args: List[str], log_path: str):
        done = launch_on_cluster(self.cluster, self.ports, script_args, log_path, _log_dir(log_path),
                                 _run_env(config), config.python, config.timeout_s)
        if done.leftovers:
            self.progress(f"  stopped {done.leftovers} process(es) the run left in the node namespaces")
        return done.rc, done.node_tx


class BenchmarkFailed(BenchmarkError):
    """Some runs failed (each said so as it failed); ``result`` holds what the others measured."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def run_benchmark(config: BenchmarkConfig, progress: Callable[[str], None] = print,
                  launcher: Optional[Callable] = None, cluster: Optional[Callable] = None) -> dict:
    """Run every schedule ``repetitions`` times, alternating; return the results dict.

    ``launcher(config, script_args, log_path)`` starts one run and returns its
    exit status (default: torchrun on this machine, or on the emulated cluster).
    With ``config.cluster``, ``cluster(nodes, ranks_per_node, rate, burst, progress)``
    is a context manager giving the emulated cluster the runs share (the package
    itself builds none: ``tools/tawpipe_lab/benchmark_cluster.py``).
    """
    for s in config.schedules:
        if s not in SCHEDULES:
            raise BenchmarkError(f"unknown schedule {s!r}; choose from {', '.join(SCHEDULES)}")
    if config.cluster is not None:
        nodes, per_node, _rate = config.cluster
        if nodes * per_node != config.ranks:
            raise BenchmarkError(f"--nodes x --ranks-per-node ({nodes} x {per_node}) must equal the ranks {config.ranks}")
        if cluster is None:
            raise BenchmarkError("an emulated cluster run needs the cluster (run_benchmark's cluster=; "
                                 "tools/benchmark.py --nodes gives it)")
    if "tawpipe-rep" in config.schedules and config.num_groups() < 2:
        raise BenchmarkError("tawpipe-rep (--tawpipe-replicate-first-shard) needs at least 2 nodes (groups): "
                             "one holder of shard 0 per node")
    if "tawpipe-spread" in config.schedules and config.num_groups() < 2:
        raise BenchmarkError("tawpipe-spread (--tawpipe-ownership spread) needs at least 2 nodes (groups): one slice "
                             "holder of every shard per node")
    for s in config.micro_batch_sizes:
        if s not in config.schedules:
            raise BenchmarkError(f"a micro-batch size is given for {s!r}, which is not among the strategies run "
                                 f"({', '.join(config.schedules)})")
    selection = None
    if config.equal_memory:
        from megatron_tawpipe.bench.equal_memory import check_rule, choose_micro_batch_sizes, format_choices

        rule = check_rule(config.equal_memory_rule)
        if (config.activation_budget is not None and rule != "activations") or \
                (config.memory_budget is not None and rule != "whole"):
            raise BenchmarkError("an activation budget goes with the equal-memory rule 'activations', a memory "
                                 f"budget with 'whole' (the rule here: {rule!r})")
        selection = choose_micro_batch_sizes(config, config.memory_budget if rule == "whole"
                                             else config.activation_budget, rule=rule)
        chosen = {s: c["micro_batch_size"] for s, c in selection["choices"].items()}
        config = replace(config, micro_batch_sizes={**chosen, **config.micro_batch_sizes})  # given by hand win
        progress(format_choices(selection))
    for s in config.schedules:  # every command line can be built (e.g. its stages), before any run
        schedule_command(s, config, os.devnull)
    os.makedirs(config.outdir, exist_ok=True)
    runs: List[dict] = []
    start = time.time()

    failures: List[dict] = []

    def launch_once(launch, schedule, rep, args, metrics, log):
        if os.path.exists(metrics):
            os.remove(metrics)  # the metrics writer appends
        counts = _log_dir(log)[:-len("-ranks")] + "-bytes"
        shutil.rmtree(counts, ignore_errors=True)
        shutil.rmtree(_log_dir(log), ignore_errors=True)
        run_config = config
        if config.count_bytes:   # locally, each group's ranks count as a node
            node = {} if config.cluster is not None else {ENV_RANKS_PER_NODE: str(config.ranks // config.num_groups())}
            run_config = replace(config, env={**config.env, ENV_OUTPUT: counts, **node})
        result = launch(run_config, args, log)
        rc, node_tx = (result, None) if isinstance(result, int) else result
        return rc, node_tx, counts

    def body(launch):
        for rep in range(config.repetitions):
            for schedule in config.schedules:
                if any(f["schedule"] == schedule for f in failures):
                    continue   # failed once: its later repetitions would not be comparable
                metrics = os.path.abspath(os.path.join(config.outdir, f"{schedule}-rep{rep}.jsonl"))
                log = os.path.abspath(os.path.join(config.outdir, f"{schedule}-rep{rep}.log"))
                args = schedule_command(schedule, config, metrics)
                if config.count_bytes and args[0] == PRETRAIN:
                    args = [COUNTED_PRETRAIN] + args[1:]
                t0 = time.time()
                rc, node_tx, counts = launch_once(launch, schedule, rep, args, metrics, log)
                retries = 0
                why = retryable(log, metrics) if rc != 0 else None
                if why is not None:
                    progress(f"  {schedule:<12} rep {rep}: failed at start-up ({why!r}, exit {rc}); "
                             "starting it again on a fresh port")
                    os.replace(log, log[:-len(".log")] + "-try0.log")
                    if os.path.isdir(_log_dir(log)):
                        os.replace(_log_dir(log), log[:-len(".log")] + "-try0-ranks")
                    retries = 1
                    rc, node_tx, counts = launch_once(launch, schedule, rep, args, metrics, log)
                wall = time.time() - t0
                if rc != 0:
                    report = failure_report(schedule, rep, rc, log, _log_dir(log), config.ranks_per_node())
                    failures.append({"schedule": schedule, "repetition": rep, "exit_status": rc, "log": log,
                                     "report": report})
                    progress(f"  {schedule:<12} rep {rep}: FAILED\n{report}")
                    continue
                run = {"schedule": schedule, "repetition": rep, "wall_s": wall, "metrics_file": metrics,
                       "micro_batch_size": config.micro_batch_size_of(schedule), "retries": retries,
                       **summarize_run(read_metrics(metrics), config.warmup_iters)}
                counted = summarize_counts(read_rank_files(counts), config.train_iters, config.warmup_iters)
                if counted is not None:
                    run.update({k: v for k, v in counted.items() if k != "ranks"})
                if node_tx is not None:
                    # Whole run (start-up included) over all iterations, warm-up included.
                    run["node_tx_bytes_per_iteration"] = node_tx / config.train_iters
                runs.append(run)
                progress(f"  {schedule:<12} rep {rep}: {run['tokens_per_sec_per_rank']:.1f} tokens/s/rank, "
                         f"{run['elapsed_ms']:.0f} ms/iteration ({wall:.0f} s)")

    if config.cluster is None:
        body(launcher or _launch_local)
    else:
        nodes, per_node, rate = config.cluster
        with cluster(nodes, per_node, rate, config.burst, progress) as emulated:
            body(launcher or _ClusterLauncher(emulated, progress))
    result = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()
                   if k not in ("env", "python")},
        "num_groups": config.num_groups(),
        "wall_s": time.time() - start,
        "runs": runs,
        "summary": summarize(runs, config.schedules),
        "equal_memory": selection,
        "failures": failures,
    }
    if failures:
        names = ", ".join(f"{f['schedule']} (repetition {f['repetition']}, exit {f['exit_status']})" for f in failures)
        raise BenchmarkFailed(f"{len(failures)} run(s) failed: {names}\n\n"
                              + "\n\n".join(f["report"] for f in failures), result)
    return result


def config_of(result: dict) -> BenchmarkConfig:
    """The configuration a results dict (``run_benchmark``'s, as ``--json`` wrote it) was measured with."""
    known = {f for f in BenchmarkConfig.__dataclass_fields__}
    cfg = {k: v for k, v in result["config"].items() if k in known}
    if cfg.get("cluster") is not None:
        cfg["cluster"] = tuple(cfg["cluster"])
    return BenchmarkConfig(**cfg)


def summarize(runs: List[dict], schedules: Sequence[str]) -> List[dict]:
    rows = []
    for schedule in schedules:
        mine = [r for r in runs if r["schedule"] == schedule]
        if not mine:
            continue
        tps = [r["tokens_per_sec_per_rank"] for r in mine]

        def med(key):
            return _median([r.get(key) for r in mine])

        rows.append({
            "schedule": schedule,
            "micro_batch_size": mine[0].get("micro_batch_size"),
            "repetitions": len(mine),
            "tokens_per_sec_per_rank": statistics.median(tps),
            "tokens_per_sec_per_rank_min": min(tps),
            "tokens_per_sec_per_rank_max": max(tps),
            "spread_pct": 100.0 * (max(tps) - min(tps)) / statistics.median(tps) if statistics.median(tps) else None,
            "elapsed_ms": med("elapsed_ms"),
            "inter_group_bytes": med("inter_group_bytes"),
            "intra_group_bytes": med("intra_group_bytes"),
            "node_tx_bytes_per_iteration": med("node_tx_bytes_per_iteration"),
            # every collective and transfer, counted as it was called (bench/collective_bytes.py)
            "inter_node_bytes_per_iteration": med("inter_node_bytes_per_iteration"),
            "intra_node_bytes_per_iteration": med("intra_node_bytes_per_iteration"),
            "inter_node_bytes_whole_run_per_iteration": med("inter_node_bytes_whole_run_per_iteration"),
            "intra_node_bytes_whole_run_per_iteration": med("intra_node_bytes_whole_run_per_iteration"),
            "formulas": mine[0].get("formulas"),
            "formulas_per_iteration": mine[0].get("formulas_per_iteration"),
            "retries": sum(r.get("retries", 0) for r in mine),
            "peak_memory_bytes_max_rank": max(r["peak_memory_bytes_max_rank"] for r in mine
                                              if r["peak_memory_bytes_max_rank"] is not None),
            "compute_busy_fraction": med("compute_busy_fraction"),
            "emulated_ring_seconds": med("emulated_ring_seconds"),
            "plan_seconds": med("plan_seconds"),
            "optimizer_seconds": med("optimizer_seconds"),
            "memory_since_model_bytes_max_rank": med("memory_since_model_bytes_max_rank"),
            "memory_held_since_model_bytes_max_rank": med("memory_held_since_model_bytes_max_rank"),
            "plan_memory_growth_bytes_max_rank": med("plan_memory_growth_bytes_max_rank"),
        })
    return rows
