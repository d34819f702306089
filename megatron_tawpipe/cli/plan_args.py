"""Command-line plumbing shared by ``tools/simulate.py`` and
``tools/plot_schedule.py``: cluster/model arguments, cost model and plan
construction."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional

from megatron_tawpipe.arguments import ArgumentError, build_parser, fill_defaults, llama_ffn_hidden_size
from megatron_tawpipe.common.units import parse_rate, parse_time
from megatron_tawpipe.sim.context_parallel import AttentionShape, context_parallel_cost, context_parallel_problem
from megatron_tawpipe.sim.context_parallel import per_gpu_result as context_parallel_result
from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
from megatron_tawpipe.sim.context_parallel_weights import per_gpu_result as weight_passing_result
from megatron_tawpipe.sim.costmodel import BACKENDS, CostModel
from megatron_tawpipe.sim.fsdp import simulate_fsdp
from megatron_tawpipe.sim.layout_choice import LayoutRequest, choose_layout
from megatron_tawpipe.sim.ownership import spread_problem
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.sim.pipelines import simulate_pipeline, with_embedding_allreduce
from megatron_tawpipe.sim.simulate import simulate
from megatron_tawpipe.sim.strategies import STRATEGIES, plan_memory, run_strategy
from megatron_tawpipe.sim.tensor_parallel import per_gpu_result, virtual_rank_cost
from megatron_tawpipe.plan.validate import validate_plan
from megatron_tawpipe.training.validate_args import validate_args

ACTIVATION = ("gpipe", "1f1b", "interleaved")
ANALYTIC = ("fsdp",) + tuple(STRATEGIES)      # not plan schedules
ALL = ("tawpipe", "tawpipe-rep", "tawpipe-paper", "tawpipe-nooverlap", "tawpipe-flat", "weipipe",
       "weipipe-naive", "weipipe-zb1", "weipipe-zb2", "weipipe-interleave-zb", "tawpipe-zb",
       "gpipe", "1f1b", "interleaved", "fsdp") + tuple(STRATEGIES)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--ranks", type=int, default=8, help="total ranks P")
    g.add_argument("--groups", type=int, default=2, help="groups (nodes) D; ranks of a group "
                   "are consecutive")
    g.add_argument("--intra-bw", default="200GB/s", help="bandwidth inside a group")
    g.add_argument("--inter-bw", default="12.5GB/s", help="bandwidth of a node's link to "
                   "other groups (per direction, shared by its ranks)")
    g.add_argument("--intra-latency", default="5us")
    g.add_argument("--inter-latency", default="20us")
    g.add_argument("--peak-tflops", type=float, default=312.0)
    g.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak reached")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="nccl", help="library collectives: "
                   + "; ".join(f"{k}: {v}" for k, v in BACKENDS.items()))
    g.add_argument("--measured-times", metavar="JSON", help="per-layer forward/backward/"
                   "recompute times measured on a GPU (overrides the FLOP model)")
    m = p.add_argument_group("model and batch")
    m.add_argument("--num-layers", type=int, default=16)
    m.add_argument("--hidden-size", type=int, default=4096)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 12*H^2 "
                   "parameters per layer (ffn = 8H/3)")
    m.add_argument("--num-attention-heads", type=int, default=None)
    m.add_argument("--num-query-groups", type=int, default=None)
    m.add_argument("--vocab-size", type=int, default=32000)
    m.add_argument("--seq-length", type=int, default=16384)
    m.add_argument("--micro-batch-size", type=int, default=1)
    m.add_argument("--num-microbatches", type=int, default=8, help="per rank")
    m.add_argument("--no-recompute", action="store_true", help="keep all activations instead "
                   "of recomputing shards in backward (the same as --recompute off)")
    m.add_argument("--recompute", choices=("on", "off", "auto"), default=None,
                   help="weight passing: recompute shards in backward (on, the default), keep their activations "
                        "(off), or decide as pretrain_llama.py's --tawpipe-recompute auto does (auto: with "
                        "--tawpipe-ownership auto TawPipe's layout decision takes recompute too; the other "
                        "schedules keep activations, as nothing here sets a memory limit)")
    m.add_argument("--dtype-bytes", type=int, default=2, help="compute dtype size (bf16: 2)")
    m.add_argument("--tie-embeddings-and-output-weights", action="store_true",
                   help="the output layer shares the word embedding, as pretrain_llama.py builds it without "
                        "--untie-embeddings-and-output-weights (Megatron-LM's default): one V x H matrix "
                        "among the replicated parameters, and pipelines all-reduce its gradient between "
                        "their first and last stage. Default: untied, as Llama (and the advisor) have them")
    m.add_argument("--deferred-weight-gradients", action=argparse.BooleanOptionalAction, default=True,
                   help="split backwards (weipipe-zb1/zb2, -zb schedules): the weight-gradient kernels run in the "
                        "weight pass, as the runtime and the emulation run them (default); "
                        "--no-deferred-weight-gradients prices the former model (the whole backward in the "
                        "input pass, the weight gradients held until the weight pass)")
    s = p.add_argument_group("schedule options")
    s.add_argument("--no-overlap", action="store_true", help="tawpipe/weipipe without "
                   "comm/compute overlap")
    s.add_argument("--flat", action="store_true", help="tawpipe with one flat group")
    s.add_argument("--no-cache", action="store_true", help="tawpipe: fetch foreign shards "
                   "every visit instead of keeping them for the iteration (--tawpipe-cache off)")
    s.add_argument("--cache", action="store_true", help="tawpipe: keep fetched foreign shards for the iteration "
                   "with any number of groups (--tawpipe-cache on); default: with up to 4 groups")
    s.add_argument("--drain", action="store_true", help="tawpipe: re-align groups after each "
                   "micro-batch round")
    s.add_argument("--chunk", type=int, default=None, help="tawpipe: micro-batches per visit")
    s.add_argument("--prefetch", type=int, default=None, help="tawpipe: slots of look-ahead for "
                   "inter-group fetches")
    s.add_argument("--replicate-first-shard", action="store_true", help="tawpipe: shard 0 held by one "
                   "rank in every group (--tawpipe-replicate-first-shard)")
    s.add_argument("--tawpipe-ownership", choices=("owner", "spread", "auto"), default="owner",
                   help="tawpipe: owner: each shard's state (master weights, gradient, optimizer state) on one rank "
                        "of one group; spread: each group keeps a 1/D slice of every shard, the groups run in step, "
                        "gather each shard from the D holders and reduce-scatter its gradient to them; auto: the "
                        "layout pretrain_llama.py --pipeline-schedule tawpipe decides by default "
                        "(megatron_tawpipe/sim/layout_choice.py): every knob not given here (--chunk, --cache / "
                        "--no-cache, --replicate-first-shard, --tawpipe-shards-per-rank, --tawpipe-replicated-reduce) "
                        "decided on this cost model")
    s.add_argument("--early-grads", action=argparse.BooleanOptionalAction, default=None,
                   help="tawpipe: each shard's last gradient leaves during the next visit, after its first "
                        "micro-batch, instead of after it (default: with --tawpipe-ownership spread)")
    s.add_argument("--tawpipe-replicated-reduce", choices=("hierarchical", "flat", "sharded"), default=None,
                   help="tawpipe: the replicated gradients' all-reduce through the nodes (default, or decided under "
                        "--tawpipe-ownership auto), flat over every rank, or their optimizer sharded (reduce-scatter, "
                        "each rank steps its slice, all-gather)")
    s.add_argument("--tawpipe-shards-per-rank", type=int, default=None, metavar="V",
                   help="tawpipe: V shards per rank (the layers cut into V x ranks shards; needs that many layers): "
                        "smaller pieces across the node links (--tawpipe-shards-per-rank; default 1, or decided "
                        "under --tawpipe-ownership auto)")
    s.add_argument("--virtual-stages", type=int, default=None, help="interleaved: chunks per rank")
    s.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T",
                   help="tawpipe/weipipe: tensor parallelism inside each node; the plan runs over ranks / T "
                        "virtual ranks (--num-microbatches is then per virtual rank); see "
                        "megatron_tawpipe/sim/tensor_parallel.py")
    s.add_argument("--context-parallel-size", type=int, default=1, metavar="C",
                   help="1f1b, interleaved, distopt, distopt-node, pp-nodes, tawpipe, weipipe: context parallelism "
                        "inside each node (each sequence split over C GPUs, ring attention); the schedule runs over "
                        "ranks / C virtual ranks (tawpipe/weipipe beside --tensor-model-parallel-size T: ranks / "
                        "(T x C) of T x C GPUs; --num-microbatches is then per virtual rank); see "
                        "megatron_tawpipe/sim/context_parallel.py and context_parallel_weights.py")


def recompute_of(args) -> bool:
    """Whether the cost model of ``args`` recomputes (``--recompute auto``: not, but for TawPipe's decision)."""
    if args.no_recompute or getattr(args, "recompute", None) in ("off", "auto"):
        return False
    return True


def cost_model(args, recompute: Optional[bool] = None) -> CostModel:
    """The simulator's cost model of ``args`` (``recompute``: instead of the flags' setting)."""
    recompute = recompute_of(args) if recompute is None else recompute
    cost = CostModel.from_flops(
        hidden_size=args.hidden_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.vocab_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, peak_tflops=args.peak_tflops,
        efficiency=args.efficiency, recompute=recompute,
        intra_bw=parse_rate(args.intra_bw), intra_latency=parse_time(args.intra_latency),
        inter_bw=parse_rate(args.inter_bw), inter_latency=parse_time(args.inter_latency),
        dtype_bytes=args.dtype_bytes,
        untied_embeddings=not args.tie_embeddings_and_output_weights)
    cost = replace(cost, backend=args.backend,
                   deferred_weight_gradients=bool(args.deferred_weight_gradients))
    if args.measured_times:
        cost = cost.with_measured(args.measured_times, micro_batch_size=args.micro_batch_size,
                                  seq_length=args.seq_length)
    return cost


def planner_options(name: str, args) -> dict:
    kw = {}
    if name.startswith("tawpipe"):
        if args.no_overlap:
            kw["overlap"] = False
        if args.flat:
            kw["groups"] = 1
        if args.no_cache and args.cache:
            raise ValueError("--cache and --no-cache: give one of them")
        if args.no_cache or args.cache:
            kw["cache"] = not args.no_cache
        if args.drain:
            kw["drain"] = True
        if args.chunk:
            kw["chunk"] = args.chunk
        if args.prefetch:
            kw["prefetch"] = args.prefetch
        if args.replicate_first_shard and replicable(name, args):
            kw["replicate_first"] = True
        ownership = args.tawpipe_ownership
        if ownership == "auto" and name in SPREADABLE:
            raise ValueError("--tawpipe-ownership auto picks a layout by simulating both (tools/simulate.py); "
                             "to build a plan give owner or spread")
        if ownership == "spread" and name in SPREADABLE:
            check_spread(name, args)
            kw["ownership"] = "spread"
        if args.early_grads is not None:
            kw["early_grads"] = args.early_grads
        kw.update({"flat": {"hierarchical_replicated": False},
                   "sharded": {"sharded_replicated": True}}.get(args.tawpipe_replicated_reduce, {}))
        if args.tawpipe_shards_per_rank not in (None, 1):
            kw["shards_per_rank"] = args.tawpipe_shards_per_rank
    elif name.startswith("weipipe") and args.no_overlap:
        kw["overlap"] = False
    elif name == "interleaved" and args.virtual_stages:
        kw["virtual_stages"] = args.virtual_stages
    return kw


SPREADABLE = ("tawpipe", "tawpipe-nooverlap", "tawpipe-zb")   # the TawPipe plans --tawpipe-ownership applies to
AUTO_LAYOUT = ("tawpipe", "tawpipe-nooverlap")   # the plans pretrain_llama.py's --pipeline-schedule tawpipe runs


def layout_request_of(args) -> LayoutRequest:
    """What ``tools/simulate.py``'s flags fix of TawPipe's layout under ``--tawpipe-ownership auto`` (the rest is
    decided as ``pretrain_llama.py`` decides it): ``--chunk``, ``--cache`` / ``--no-cache``,
    ``--replicate-first-shard``, ``--tawpipe-shards-per-rank``, ``--tawpipe-replicated-reduce`` where given."""
    return LayoutRequest(
        shards_per_rank=None if args.tawpipe_shards_per_rank in (None, "auto") else int(args.tawpipe_shards_per_rank),
        replicate_first=True if args.replicate_first_shard else (False if args.no_overlap else None),
        cache=False if args.no_cache else (True if args.cache else None),
        microbatches_per_visit=args.chunk or None,
        replicated_reduce=args.tawpipe_replicated_reduce)


def decide_layout(name: str, args, cost: CostModel, memory_limit: float = float("inf")):
    """``pretrain_llama.py``'s decision (:func:`megatron_tawpipe.sim.layout_choice.choose_layout`) on the simulator's
    cost model, ranks, groups and batch."""
    tp = tensor_parallel_for(name, args)
    cp = context_parallel_for(name, args)
    groups = 1 if args.flat else args.groups
    one = {cost.recompute: cost}
    if getattr(args, "recompute", None) == "auto":   # recompute decided with the layout
        one = {rc: cost if cost.recompute == rc else cost_model(args, rc) for rc in (False, True)}
    # with C > 1: over the virtual ranks of T x C GPUs, priced as the run prices them (the pieces' collectives too)
    costs, pieces = virtual_rank_pricing(one, cp, attention_shape(args), tp)
    request = layout_request_of(args)
    if cp > 1 and request.ownership is None:   # the spread layout does not run with context parallelism
        request = replace(request, ownership="owner")
    return choose_layout(request, costs, args.ranks // (tp * cp), groups, args.num_layers,
                         [args.num_microbatches], memory_limit, tensor_parallel=tp, pieces=pieces,
                         plan_schedule="tawpipe-nooverlap" if name == "tawpipe-nooverlap" or args.no_overlap
                         else "tawpipe")


def layout_args(layout) -> dict:
    """The simulator's flags of a decided layout."""
    return {"tawpipe_ownership": layout.ownership, "tawpipe_shards_per_rank": layout.shards_per_rank,
            "replicate_first_shard": layout.replicate_first, "cache": layout.cache, "no_cache": not layout.cache,
            "chunk": layout.microbatches_per_visit, "tawpipe_replicated_reduce": layout.replicated_reduce,
            "recompute": "on" if layout.recompute else "off", "no_recompute": not layout.recompute}


def _ownership_speeds(choice) -> dict:
    """The best predicted tokens/s ratio per ownership among the layouts priced (relative: 1 / iteration time)."""
    out = {}
    for priced in choice.priced:
        if priced.fits:
            speed = 1.0 / priced.iteration_time
            out[priced.layout.ownership] = max(out.get(priced.layout.ownership, 0.0), speed)
    return out


def check_spread(name: str, args) -> None:
    """A one-line ``ValueError`` naming the flags where ``--tawpipe-ownership spread`` cannot apply to ``name``."""
    if args.tawpipe_ownership != "spread" or name not in SPREADABLE:
        return
    problem = spread_problem(args.groups, args.replicate_first_shard, args.flat)
    if problem:
        flags = "--flat" if args.flat else "--replicate-first-shard" if args.replicate_first_shard else \
            f"--groups {args.groups}"
        raise ValueError(f"--tawpipe-ownership spread with {flags}: {problem}")


def replicable(name: str, args) -> bool:
    """Whether TawPipe schedule ``name`` can hold shard 0 in every group: at
    least 2 groups, not the flat variant."""
    return name.startswith("tawpipe") and name != "tawpipe-flat" and not args.flat and args.groups >= 2


def make_plan(name: str, args, validate: bool = True):
    n = args.num_microbatches * (args.ranks if name in ACTIVATION else 1)
    virtual = tensor_parallel_for(name, args) * (context_parallel_for(name, args) if name in WEIGHT_PASSING_CP else 1)
    plan = build_plan(name, num_ranks=args.ranks // virtual, num_groups=args.groups,
                      num_layers=args.num_layers, num_microbatches=n,
                      **planner_options(name, args))
    if validate:
        validate_plan(plan)
    return plan


def run_one(name: str, args, cost: CostModel, validate: bool = True, record: bool = False):
    """(plan or None, SimResult); the result's ``options["memory_breakdown"]`` is
    the per-GPU memory by term (:mod:`plan.memory`). ``--tawpipe-ownership auto``: both layouts simulated, the
    faster kept (its speeds in ``options["ownership_speeds"]``)."""
    if args.tawpipe_ownership == "auto" and name in AUTO_LAYOUT:
        choice = decide_layout(name, args, cost)
        fixed = argparse.Namespace(**{**vars(args), **layout_args(choice.chosen)})
        if cost.recompute != choice.chosen.recompute:
            cost = cost_model(fixed)
        plan, result = run_one(name, fixed, cost, validate, record)
        result.options["layout_choice"] = choice.record()
        result.options["ownership_speeds"] = _ownership_speeds(choice)
        return plan, result
    tp = tensor_parallel_for(name, args)
    if context_parallel_for(name, args) > 1:
        return run_context_parallel(name, args, cost, validate, record)
    if name in STRATEGIES:
        return None, run_strategy(name, cost, args.ranks, args.groups, args.num_layers,
                                  args.num_microbatches)
    if tp > 1:
        virtual = virtual_rank_cost(cost, tp)
        plan = make_plan(name, args, validate)
        result = simulate(plan, virtual, record=record)
        result.options["memory_breakdown"] = plan_memory(result, virtual, plan).as_dict()
        return plan, per_gpu_result(result, tp, cost, args.num_layers, args.num_microbatches)
    if name == "fsdp":
        result = simulate_fsdp(cost, args.ranks, args.groups, args.num_layers,
                               args.num_microbatches)
        plan = None
    else:
        plan = make_plan(name, args, validate)
        result = simulate(plan, cost, record=record)
        if name in ACTIVATION:   # one pipeline over all ranks: the tied embedding's all-reduce (if tied)
            result = with_embedding_allreduce(result, cost, args.groups)
    result.options["memory_breakdown"] = plan_memory(result, cost, plan).as_dict()
    return plan, result


#: the schedules ``--context-parallel-size`` applies to: megatron's native ones, and the weight-passing plans
#: pretrain_llama.py runs with it (the pieces of :mod:`megatron_tawpipe.sim.context_parallel_weights`)
CONTEXT_PARALLEL = ("1f1b", "interleaved", "distopt", "distopt-node", "pp-nodes")
WEIGHT_PASSING_CP = ("tawpipe", "tawpipe-rep", "tawpipe-nocache", "tawpipe-nooverlap", "weipipe")


def context_parallel_for(name: str, args) -> int:
    """C for a native schedule (1 when not given; a ``ValueError`` naming the flag where it cannot apply)."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp == 1:
        return 1
    if name not in CONTEXT_PARALLEL + WEIGHT_PASSING_CP:
        known = ", ".join(CONTEXT_PARALLEL + WEIGHT_PASSING_CP)
        raise ValueError(f"--context-parallel-size {cp} is modelled for {known} only, not {name}")
    if name in WEIGHT_PASSING_CP and (args.tawpipe_ownership == "spread" or args.tawpipe_replicated_reduce == "sharded"):
        raise ValueError(f"--context-parallel-size {cp} with --tawpipe-ownership spread or --tawpipe-replicated-reduce "
                         "sharded: neither runs with context parallelism")
    tp = (args.tensor_model_parallel_size or 1) if name in WEIGHT_PASSING_CP else 1
    problem = context_parallel_problem(cp, tp, args.ranks // args.groups, args.seq_length, args.ranks)
    if problem:
        raise ValueError(f"--context-parallel-size {cp}: {problem}")
    return cp


def attention_shape(args) -> AttentionShape:
    """One micro-batch's shape for the ring attention's bytes and attention's share of a layer."""
    return AttentionShape.of_flags(args)


def run_context_parallel(name: str, args, cost: CostModel, validate: bool = True, record: bool = False):
    """``name`` with ``--context-parallel-size C``: over ranks / C virtual ranks of C GPUs (ranks / (T x C) of
    T x C with ``--tensor-model-parallel-size T``, weight passing), each with ``--num-microbatches`` micro-batches,
    on the cost model of :func:`megatron_tawpipe.sim.context_parallel.context_parallel_cost` (weight passing:
    :func:`megatron_tawpipe.sim.context_parallel_weights.virtual_rank_pricing`); per-GPU figures. 1f1b and interleaved
    are priced as the advisor prices a pipeline (:func:`megatron_tawpipe.sim.pipelines.simulate_pipeline`): one
    pipeline over the virtual ranks, each stage's gradients reduced over its C GPUs and its optimizer state
    sharded over them (the distributed optimizer)."""
    cp = context_parallel_for(name, args)
    shape = attention_shape(args)
    if name in WEIGHT_PASSING_CP:
        tp = tensor_parallel_for(name, args)
        plan = make_plan(name, args, validate)
        costs, priced = virtual_rank_pricing({cost.recompute: cost}, cp, shape, tp)
        virtual, pieces = costs[cost.recompute], priced.around(cost.recompute)(plan)
        result = simulate(plan, virtual, record=record, around=pieces)
        result.options["memory_breakdown"] = plan_memory(result, virtual, plan).as_dict()
        return plan, weight_passing_result(result, cp, cost, shape, pieces, args.num_microbatches, tp)
    virtual = context_parallel_cost(cost, cp, shape)
    P, D, L, N = args.ranks // cp, args.groups, args.num_layers, args.num_microbatches
    if name in STRATEGIES:
        result = run_strategy(name, virtual, P, D, L, N, context_parallel=cp)
        if name == "pp-nodes":
            layers, microbatches = -(-L // D), result.options["microbatches_per_pipeline"]
        else:
            layers, microbatches = L, N
    else:
        V = 1
        if name == "interleaved":
            V = args.virtual_stages or build_plan(name, num_ranks=P, num_groups=D, num_layers=L,
                                                  num_microbatches=P).num_shards // P
        result = simulate_pipeline(virtual, P, D, L, N * P, pipeline_size=P, virtual_stages=V, name=name,
                                   context_parallel=cp)
        layers, microbatches = -(-L // P), N * P
    return None, context_parallel_result(result, cp, cost, shape, layers, microbatches)


def tensor_parallel_for(name: str, args) -> int:
    """T for a weight-passing schedule (1 for the others; refused for them when T > 1)."""
    tp = args.tensor_model_parallel_size or 1
    if tp == 1:
        return 1
    if not name.startswith(("tawpipe", "weipipe")):
        raise ValueError(f"--tensor-model-parallel-size {tp} is modelled for tawpipe/weipipe only, not {name}")
    per_node = args.ranks // args.groups
    if per_node % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the {per_node} ranks of a group")
    return tp


# ----------------------------------------------------------------- the advisor
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "vocab_size")


def add_advisor_args(p: argparse.ArgumentParser) -> None:
    from megatron_tawpipe.sim.advisor_configs import PRESETS

    a = p.add_argument_group("advisor (--advise)")
    a.add_argument("--advise", action="store_true", help="rank every strategy and its knobs for this "
                   "cluster, model and global batch; print the best command")
    a.add_argument("--ranks-per-node", type=int, default=None, help="GPUs per node (sets --groups)")
    a.add_argument("--gpu-memory", default="80GB", help="memory per GPU (80GB = 80e9 bytes, 80GiB)")
    a.add_argument("--memory-reserve", default="5GB", help="kept free for the CUDA context, NCCL "
                   "buffers and fragmentation, which the memory model does not count")
    a.add_argument("--model", choices=sorted(PRESETS), default=None, help="Llama-shaped preset "
                   "(Llama-2 7B/13B/70B, Code Llama 34B); explicit model flags override it")
    a.add_argument("--global-batch-size", type=int, default=None, help="sequences per iteration "
                   "(default: micro-batch size x num-microbatches x ranks)")
    a.add_argument("--prune", choices=("strategy", "top2"), default="strategy",
                   help="which simulations to skip (see megatron_tawpipe/sim/advisor.py)")
    a.add_argument("--trainable-only", action="store_true", help="leave out what only the "
                   "simulator models (what pretrain_llama.py refuses, e.g. HFSDP with tensor parallelism)")
    a.add_argument("--top", type=int, default=15, help="rows of the ranking to print")


def _given(argv, name: str) -> bool:
    flag = "--" + name.replace("_", "-")
    return any(x == flag or x.startswith(flag + "=") for x in argv)


def advisor_inputs(args, argv):
    """(ModelSpec, Cluster, global batch) from the parsed flags."""
    from megatron_tawpipe.sim.advisor_configs import PRESETS, Cluster, ModelSpec
    from megatron_tawpipe.sim.memory import parse_size

    values = {}
    preset = PRESETS[args.model] if args.model else {}
    for name in MODEL_FLAGS:
        given = getattr(args, name)
        values[name] = given if (_given(argv, name) or name not in preset) else preset[name]
    H = values["hidden_size"]
    if values["ffn_hidden_size"] is None:
        values["ffn_hidden_size"] = llama_ffn_hidden_size(H)
    if values["num_attention_heads"] is None:
        values["num_attention_heads"] = max(1, H // 128)
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    model = ModelSpec(seq_length=args.seq_length, **values)
    groups = args.ranks // args.ranks_per_node if args.ranks_per_node else args.groups
    if args.ranks % groups:
        raise ValueError(f"--ranks {args.ranks} is not a multiple of the node size")
    cluster = Cluster(ranks=args.ranks, nodes=groups, intra_bw=parse_rate(args.intra_bw),
                      inter_bw=parse_rate(args.inter_bw), peak_tflops=args.peak_tflops,
                      efficiency=args.efficiency, gpu_memory=parse_size(args.gpu_memory),
                      memory_reserve=parse_size(args.memory_reserve),
                      intra_latency=parse_time(args.intra_latency),
                      inter_latency=parse_time(args.inter_latency))
    gbs = args.global_batch_size or args.micro_batch_size * args.num_microbatches * args.ranks
    return model, cluster, gbs


def check_command(argv, world_size: int) -> str:
    """Why ``pretrain_llama.py`` would refuse ``argv`` on ``world_size`` ranks ("" when it accepts it): the
    trainer's own argument validation. The advisor is given this check (``Advisor(check_command=...)``)."""
    args, unknown = build_parser().parse_known_args(
        list(argv) + ["--train-iters", "1", "--distributed-backend", "nccl", "--lr", "1e-4",
                      "--tokenizer-type", "NullTokenizer"])
    if unknown:
        return "unknown flags " + " ".join(x for x in unknown if x.startswith("--"))
    try:
        validate_args(fill_defaults(args), world_size=world_size)
    except ArgumentError as exc:
        return str(exc)
    return native_stage_problem(args)


def native_stage_problem(args) -> str:
    """Why megatron-core would not build the pipeline stages a validated native command asks for with
    ``--decoder-first/last-pipeline-num-layers`` or ``--pipeline-model-parallel-layout`` ("" when it
    would): the native baseline's own TransformerConfig (``models.llama.llama_config``) is handed to
    megatron-core's ``get_num_layers_to_build`` for every stage, as the baseline's model chunks are built."""
    split = args.decoder_layer_split
    if args.pipeline_schedule not in ("1f1b", "interleaved") or split is None:
        return ""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_tawpipe.arguments import virtual_pipeline_size
    from megatron_tawpipe.models.llama import llama_config

    pp, vpp = args.pipeline_model_parallel_size, virtual_pipeline_size(args)
    try:
        config = llama_config(args, pp, vpp, main_grad_buffers=True,
                              tensor_model_parallel_size=args.tensor_model_parallel_size,
                              sequence_parallel=args.sequence_parallel)
        if getattr(config, "pipeline_model_parallel_layout", None) is not None:
            return ""
        built = tuple(get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=r)
                      for v in range(vpp or 1) for r in range(pp))
    except (AssertionError, ValueError) as exc:
        built, problem = None, str(exc).strip() or type(exc).__name__
    if built is None or built != tuple(split):
        got = f"megatron-core says: {problem}" if built is None else f"megatron-core would build {list(built)}"
        return (f"the native baseline does not pass the stages {list(split)} to megatron-core's TransformerConfig "
                f"({got}); Megatron-LM's pretrain_gpt.py takes these flags")
    return ""
