"""``--pipeline-schedule`` and the weight-passing runtime's own flags (added to the parser the way
Megatron-LM's ``extra_args_provider`` hook adds a script's flags)."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_tawpipe.arguments.choices import positive_int

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "weipipe", "tawpipe")
WEIGHT_PASSING_SCHEDULES = ("weipipe", "tawpipe")
# ``--pipeline-schedule plan:FILE`` runs the weight-passing plan in FILE (JSON or CSV, as Plan.to_json /
# to_csv write it) on the same runtime as weipipe and tawpipe.
PLAN_FILE_PREFIX = "plan:"
# --tawpipe-cache: TawPipe's shard cache always, never, or where the memory model says it fits.
TAWPIPE_CACHE_SETTINGS = ("auto", "on", "off")
# auto: the cache is on when its predicted peak per device is at most this share of the device's memory
# (the rest is kept for what the memory model does not count: the CUDA context, NCCL's buffers,
# allocator fragmentation, kernels' temporaries).
AUTO_CACHE_MEMORY_FRACTION = 0.9
# --tawpipe-ownership: each shard's state on one rank of one group (owner), or a 1/D slice of it in every group
# (spread), or decided with the other layout knobs (auto: sim.layout_choice, the one decision of every auto).
TAWPIPE_OWNERSHIP_SETTINGS = ("owner", "spread", "auto")
TAWPIPE_REPLICATED_REDUCE_SETTINGS = ("auto", "hierarchical", "flat", "sharded")
AUTO = "auto"
# The TawPipe layout flags (dest names) whose default, auto, the run decides at start-up.
TAWPIPE_LAYOUT_FLAGS = ("tawpipe_ownership", "tawpipe_shards_per_rank", "tawpipe_replicate_first_shard",
                        "tawpipe_cache", "tawpipe_microbatches_per_visit", "tawpipe_replicated_reduce",
                        "tawpipe_recompute")
TAWPIPE_RECOMPUTE_SETTINGS = (AUTO, "on", "off")


def auto_or_positive_int(text: str):
    """``auto``, or a positive integer."""
    if text == AUTO:
        return AUTO
    return positive_int(text)


def is_auto(value) -> bool:
    """Whether a layout flag's value is left to the run (``auto``; ``None`` for the replicated first shard)."""
    return value is None or value == AUTO


def layout_flags_given(args) -> list:
    """The TawPipe layout flags ``args`` sets to something other than auto, as the command line names them."""
    return ["--" + name.replace("_", "-") for name in TAWPIPE_LAYOUT_FLAGS if not is_auto(getattr(args, name))]


def plan_file_of(schedule: str) -> Optional[str]:
    """The plan file of ``--pipeline-schedule plan:FILE``, or None for a named schedule."""
    return schedule[len(PLAN_FILE_PREFIX):] if schedule.startswith(PLAN_FILE_PREFIX) else None


def is_weight_passing(schedule: str) -> bool:
    """Whether ``--pipeline-schedule`` runs on the weight-passing runtime: weipipe, tawpipe, a plan file."""
    return schedule in WEIGHT_PASSING_SCHEDULES or plan_file_of(schedule) is not None


def tawpipe_cache_problem(schedule: str, setting: str, groups: int) -> str:
    """Why ``--tawpipe-cache SETTING`` cannot apply to ``--pipeline-schedule SCHEDULE`` over ``groups`` groups
    ("" when it can): on or off only with tawpipe; on needs two or more groups (with one, every shard's owner
    is in the group: nothing is fetched from another group to keep, and off is the same plan)."""
    if setting == "auto":
        return ""
    if schedule != "tawpipe":
        where = (" (a plan file carries its own choice: tools/plan.py build --no-cache writes one without)"
                 if plan_file_of(schedule) is not None else "")
        return f"--tawpipe-cache {setting} applies to --pipeline-schedule tawpipe only{where}; leave it at auto"
    if setting == "on" and groups < 2:
        return ("--tawpipe-cache on needs two or more groups (nodes, or --tawpipe-num-groups): this run has one, "
                "so every shard's owner is in the group and there is no foreign shard to keep; leave it at auto "
                "(off with one group)")
    return ""


def tawpipe_ownership_problem(schedule: str, setting: str, groups: int = 2, replicate_first: bool = False) -> str:
    """Why ``--tawpipe-ownership SETTING`` cannot run with ``--pipeline-schedule SCHEDULE`` over ``groups`` groups
    ("" when it can)."""
    if setting in ("owner", AUTO):
        return ""
    if schedule != "tawpipe":
        return f"--tawpipe-ownership {setting} applies to --pipeline-schedule tawpipe only; leave it at owner"
    if setting == "spread" and groups < 2:
        return ("--tawpipe-ownership spread needs two or more groups (nodes, or --tawpipe-num-groups): with one, "
                "every shard is in the group already; leave it at owner (or auto)")
    if setting == "spread" and replicate_first:
        return ("--tawpipe-ownership spread with --tawpipe-replicate-first-shard: the spread layout keeps every "
                "shard, the first included, in every group already; give one of them")
    return ""


def tawpipe_shards_per_rank_problem(schedule: str, per_rank) -> str:
    """Why ``--tawpipe-shards-per-rank PER_RANK`` cannot run with ``--pipeline-schedule SCHEDULE`` ("" when it can).
    A plan file has its shards already: the flag then states how many per rank it has (checked against the file).
    Too few layers for the shards is the layer split's to say (``training.layer_split_args``)."""
    if per_rank not in (1, AUTO) and schedule != "tawpipe" and plan_file_of(schedule) is None:
        return (f"--tawpipe-shards-per-rank {per_rank} applies to --pipeline-schedule tawpipe (or a plan file with "
                "that many shards per rank) only; leave it at 1")
    return ""


def add_tawpipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This project's own flags, added the way Megatron-LM's ``extra_args_provider`` hook adds a
    script's flags (``megatron.training.arguments.parse_args(extra_args_provider=add_tawpipe_args)``
    takes it as is): the schedule, the weight pipeline's options, metrics and benchmarking."""
    g = parser.add_argument_group("weight-passing pipeline (megatron_tawpipe)")
    g.add_argument("--pipeline-schedule", default="1f1b",
                   help=f"one of {', '.join(PIPELINE_SCHEDULES)}, or {PLAN_FILE_PREFIX}FILE: a weight-passing plan "
                        "(JSON or CSV, as tools/plan.py build writes it) that passes the validator; or auto: the run "
                        "measures its links and memory, ranks TawPipe (in the layout it decides), WeiPipe and its "
                        "zero-bubble forms, megatron's 1F1B and interleaved pipelines over every stage count and "
                        "megatron's distributed optimizer at this command's micro-batch size and global batch, "
                        "prints the top three and the flags that pin the winner, and runs it")
    g.add_argument("--tawpipe-num-groups", type=positive_int, default=None,
                   help="groups (nodes) of the weight pipeline; default: one per node")
    g.add_argument("--tawpipe-no-overlap", action="store_true", help="ablation: no weight prefetch")
    g.add_argument("--tawpipe-nccl-faithful", action="store_true",
                   help="weipipe/tawpipe on gloo: run the plan's transfers under NCCL's ordering rules "
                        "(one FIFO per communicator, rendezvous sends), so that a plan that would hang "
                        "on a GPU cluster fails here after --distributed-timeout-minutes, naming rank "
                        "and step (tests; slower)")
    g.add_argument("--tawpipe-microbatches-per-visit", type=auto_or_positive_int, default=AUTO,
                   help="tawpipe: micro-batches each rank runs per visit of a shard; the shard is broadcast "
                        "in the group (and its gradient reduced) once per visit, so intra-node traffic falls "
                        "by this factor while boundary activations of that many micro-batches are kept. "
                        "auto (default): decided with the other layout flags (see --tawpipe-ownership)")
    g.add_argument("--tawpipe-replicate-first-shard", action=argparse.BooleanOptionalAction, default=None,
                   help="tawpipe: every group (node) holds shard 0 (the first layers) -- master weights, optimizer "
                        "state and gradient on one rank per group, gradients all-reduced among them -- so no group "
                        "waits for it at the start of an iteration; costs that shard's state on one more rank per "
                        "extra group. Needs two or more groups. Neither flag (default): decided with the other "
                        "layout flags (see --tawpipe-ownership)")
    g.add_argument("--tawpipe-cache", choices=TAWPIPE_CACHE_SETTINGS, default="auto",
                   help="tawpipe: the shard cache. A rank that fetches a foreign shard (owned by another group) keeps "
                        "it for the whole iteration and adds its group's gradients of it into one buffer sent to "
                        "the owner once at the end, so each foreign shard crosses the node link twice per iteration "
                        "whatever the micro-batches, at the price of more weight and gradient buffers per rank. "
                        "on / off: always / never; auto (default): decided with the other layout flags (see "
                        "--tawpipe-ownership); off with one group (nothing foreign to keep)")
    g.add_argument("--tawpipe-ownership", choices=TAWPIPE_OWNERSHIP_SETTINGS, default=AUTO,
                   help="tawpipe: where each shard's fp32 master weights, gradient accumulator and optimizer state "
                        "live. owner: on one rank of one group, which serves the shard to the other groups and "
                        "receives their gradients; spread: a 1/D slice on one rank of every group, the groups "
                        "running in step, gathering each shard from the D holders and reduce-scattering its "
                        "gradient to them (docs/tawpipe-spread.md). auto (default): the run decides this and every "
                        "other TawPipe layout flag left at auto (shards per rank, the replicated first shard, the "
                        "cache, micro-batches per visit, the replicated reduction) at start-up: every layout the "
                        "flags given allow is priced by the simulator on the run's model, batch, ranks and groups, "
                        "the node link (measured, or --tawpipe-link-bandwidth) and the compute times "
                        "(--tawpipe-compute-times, --emulated-compute-times, or the device's peak), the fastest that "
                        "fits the device's memory runs; rank 0 prints the choice, the runner-up and the flags that "
                        "pin it (docs/tawpipe-layout.md)")
    g.add_argument("--tawpipe-shards-per-rank", type=auto_or_positive_int, default=AUTO,
                   help="tawpipe: shards per weight-pipeline rank (the layers are cut into this many times the ranks' "
                        "shards, each rank owning or staging that many). Smaller shards cross the node links in "
                        "smaller pieces: the last gradients of an iteration and its first weights, which no compute "
                        "hides, take less time (docs/tawpipe-spread.md#two-shards-per-rank), at the price of more, "
                        "smaller transfers inside the nodes. Needs --num-layers >= ranks x this. auto (default): 1 "
                        "or 2, decided with the other layout flags (see --tawpipe-ownership); the count the layer "
                        "split flags give where they are given")
    g.add_argument("--tawpipe-replicated-reduce", choices=TAWPIPE_REPLICATED_REDUCE_SETTINGS, default=AUTO,
                   help="tawpipe: how the replicated parameters' gradients (embedding, final norm, output layer) are "
                        "all-reduced over the ranks. hierarchical: inside each node (a reduce-scatter), "
                        "across the nodes (an all-reduce of each rank's part among the ranks of the same local index), "
                        "back inside (an all-gather), so each node's link carries 2(D-1)/D of them over D nodes; "
                        "flat: one all-reduce over every rank, 2(P-1)/P over P ranks. The same where there is one "
                        "node or one rank per node. sharded: their optimizer sharded over the ranks as megatron's "
                        "distributed optimizer shards it: the gradients reduce-scattered (through the nodes where "
                        "hierarchical would be), each rank stepping its 1/P slice (fp32 master and Adam moments of "
                        "the slice only), the weights all-gathered in the compute dtype at the next iteration's "
                        "start, (D-1)/D x (4 + 2) bytes per parameter on each node's link instead of 2(D-1)/D x 4 "
                        "(NCCL; gloo's reduce-scatter moves an all-reduce's bytes). auto (default): decided with "
                        "the other layout flags")
    g.add_argument("--tawpipe-link-bandwidth", default=None, metavar="RATE",
                   help="tawpipe, auto layout: the node link's rate per direction (e.g. 25Gbit/s, 3GB/s) instead of "
                        "measuring it at start-up (a few transfers between the groups' first ranks, a few seconds at "
                        "most); given, nothing is probed and the link inside a node is taken as 200 GB/s on GPUs, "
                        "0.6 GB/s between CPU processes")
    g.add_argument("--tawpipe-link-latency", default=None, metavar="TIME",
                   help="tawpipe, auto layout: the node link's latency (e.g. 20us) with --tawpipe-link-bandwidth "
                        "(default 20us)")
    g.add_argument("--tawpipe-compute-times", default=None, metavar="FILE",
                   help="tawpipe, auto layout: the compute times the layouts are priced with (tools/calibrate.py "
                        "writes it); default: --emulated-compute-times where given, else the device's peak at a "
                        "stated efficiency")
    g.add_argument("--weipipe-zero-bubble", type=int, choices=(0, 1, 2), default=0,
                   help="weipipe: split every backward into its input-gradient pass and its weight-gradient pass, "
                        "the only one the travelling gradient waits for: 1 (WZB1) runs the weight-gradient pass in "
                        "the same turn, after the input gradient; 2 (WZB2) one round later, when the rank meets the "
                        "same gradient again (holds one more round of activations, one more round of turns)")
    g.add_argument("--tawpipe-recompute", choices=TAWPIPE_RECOMPUTE_SETTINGS, default=AUTO,
                   help="weipipe/tawpipe: on: recompute each shard's forward in its backward (one more forward per "
                        "shard and micro-batch; the activations of one shard at a time); off: keep each shard's "
                        "activations (faster, needs memory for the activations of every shard a rank holds "
                        "micro-batches of); auto (default): off where the memory model's peak per device without "
                        "recompute fits the device's memory, else on (tawpipe: decided with the other layout flags). "
                        "--recompute-granularity full means on")
    g.add_argument("--tawpipe-no-recompute", action="store_true",
                   help="weipipe/tawpipe: the same as --tawpipe-recompute off (kept for existing command lines)")
    g.add_argument("--metrics-file", default=None, help="write one JSON object per iteration here")
    g.add_argument("--emulated-compute-times", default=None, metavar="FILE",
                   help="emulated compute: layer/output-layer forward, backward and recompute become sleeps "
                        "of the seconds in FILE (tools/calibrate.py writes it; times recorded for another "
                        "--micro-batch-size are scaled to this run's, linearly in its samples); communication "
                        "stays real")
    g.add_argument("--emulated-deferred-weight-gradients", action="store_true",
                   help="accepted, no effect: a split backward's weight-gradient kernels always run in its "
                        "weight pass (the runtime defers them, and --emulated-compute-times sleeps that half "
                        "there); kept for existing command lines")
    g.add_argument("--record-plan-memory", action="store_true",
                   help="weipipe/tawpipe: after every compute action of the plan note the bytes this process "
                        "holds (GPU: memory allocated; CPU: what glibc's allocator has handed out) and report the "
                        "most the plan held beyond its start, over ranks, as plan_memory_growth_bytes_max_rank "
                        "(activations, held gradients, logits; a few ms per action on a CPU); with split "
                        "backwards also the weight-gradient store's peak, plan_wgrad_store_peak_bytes_max_rank")
    g.add_argument("--timeline-file", default=None, metavar="FILE",
                   help="weipipe/tawpipe: write every rank's measured timeline of the latest training "
                        "iteration (compute and transfers, wall clock) as JSON; draw it with "
                        "tools/plot_schedule.py --timeline FILE")
    return parser
