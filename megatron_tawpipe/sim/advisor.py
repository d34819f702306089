"""Which strategy to run on a cluster: enumerate every strategy with its knobs,
keep what divides the global batch and fits in GPU memory, rank the rest by
predicted tokens/s per GPU, and print the command line of the best
(``tools/simulate.py --advise``).

Strategies: the weight-passing ``tawpipe`` (micro-batches per visit 1, 2, 4, ... up to one visit per
shard, cache on/off, shard 0 replicated in every group or not) and ``weipipe``;
megatron pipelines (``pp-nodes``: one stage per node; ``1f1b`` /
``interleaved`` with larger pipelines, every stage inside one node, data
parallel inside the node); ``fsdp`` over all ranks, ``hsdp``,
``distopt-node``, ``distopt`` and ``hfsdp`` (megatron-core's Megatron-FSDP,
``--use-megatron-fsdp``).  Every strategy
is tried with micro-batch sizes 1, 2, 4, ... up to its batch per replica, each family of knobs up to the
first size that does not fit, and recompute on/off (:meth:`Advisor.run`; what was searched:
:func:`megatron_tawpipe.sim.advisor_report.searched`), with tensor parallelism T inside the nodes, and the
native ones and TawPipe / WeiPipe also with context parallelism C (T x C inside a node): over
P / (T x C) virtual ranks (:mod:`.tensor_parallel`, :mod:`.context_parallel`, :mod:`.context_parallel_weights`).

Plan-based strategies cost a plan simulation each (more than 4 visits' worth
of micro-batches per rank, or 4 x pipeline size per pipeline, are simulated as
2x and 4x and extended linearly: :func:`megatron_tawpipe.sim.pipelines.simulate_extended`); a
configuration is not
simulated when its ceiling (tokens/s with free communication and the ideal
bubble, or what its inter-node bytes allow at full link speed, whichever is
lower) cannot beat what it would need to beat: its strategy's best so
far (``prune="strategy"``: every strategy's best is exact) or also the
runner-up across strategies and the best configuration this project can run
(``prune="top2"``: winner, runner-up, margin and best runnable exact; what the
scale study uses).  The candidates and their enumeration:
:mod:`megatron_tawpipe.sim.advisor_configs`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

from megatron_tawpipe.common.layer_split import default_layer_split
from megatron_tawpipe.sim.advisor_configs import (STRATEGY_ORDER, Cluster, Config, ModelSpec, bytes_twin,
                                                  enumerate_at, enumerate_configs, family_of, plain_family_of, size_of,
                                                  wp_options, wp_schedule)
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.advisor_report import (check_listed, check_with_plan_file, command, left_out, mark_auto_layouts,
                                                 searched, summarize)
from megatron_tawpipe.sim.memory import MemoryBreakdown, weight_passing_breakdown
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.plan.traffic import link_bytes, replicated_allreduce_bytes
from megatron_tawpipe.sim.fsdp import simulate_fsdp
from megatron_tawpipe.sim.pipelines import pipeline_memory, simulate_extended, simulate_pipeline
from megatron_tawpipe.sim.strategies import plan_memory_fields, simulate_distopt, simulate_hfsdp, simulate_hsdp
from megatron_tawpipe.sim.memory import generic_breakdown
from megatron_tawpipe.sim.stages import first_last_options, native_pipeline_split, pipeline_time_bound, stage_works
from megatron_tawpipe.sim.context_parallel import (AttentionShape, context_parallel_bytes_per_gpu,
                                                   context_parallel_cost, per_gpu_breakdown)
from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
from megatron_tawpipe.sim.context_parallel_weights import per_gpu_breakdown as weight_passing_per_gpu

ORDER = STRATEGY_ORDER
PLAN_BASED = ("pp-nodes", "1f1b", "interleaved", "tawpipe", "weipipe")


# ------------------------------------------------------------------- evaluate
class Advisor:
    tp = cp = 1   # the GPUs of one of this advisor's ranks: tensor x context-parallel (1 x 1: the GPUs themselves)

    def __init__(self, model: ModelSpec, cluster: Cluster, global_batch: int,
                 plan_cache: Optional[Dict] = None, grad_bytes: int = 4,
                 check_command: Optional[Callable[[List[str], int], str]] = None):
        """``check_command(argv, world_size)`` says why ``pretrain_llama.py`` would refuse a command ("" when it
        accepts it); the command line passes the trainer's validation (``cli.plan_args.check_command``).
        Without it every configuration's command is taken as accepted."""
        self.model, self.cluster, self.G = model, cluster, global_batch
        self.check_command = check_command
        self.plan_cache = {} if plan_cache is None else plan_cache
        self.costs: Dict = {}
        self.grad_bytes = grad_bytes
        self._virtual: Dict[tuple, "Advisor"] = {}
        self._stage_splits: Dict[tuple, tuple] = {}
        self._node_bytes: Dict[tuple, float] = {}
        self._candidate_splits: Dict[int, set] = {}      # pipeline size -> the splits settle() chooses among

    def cost(self, b: int, recompute: bool) -> CostModel:
        key = (b, recompute)
        if key not in self.costs:
            m, c = self.model, self.cluster
            self.costs[key] = CostModel.from_flops(
                hidden_size=m.hidden_size, seq_length=m.seq_length, micro_batch_size=b,
                ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size,
                num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                peak_tflops=c.peak_tflops, efficiency=c.efficiency, recompute=recompute,
                intra_bw=c.intra_bw, intra_latency=c.intra_latency, inter_bw=c.inter_bw,
                inter_latency=c.inter_latency)
        return self.costs[key]

    # ---- tensor and context parallelism: the same strategy over P / (T x C) virtual ranks ------------

    def virtual(self, tp: int, cp: int = 1) -> "Advisor":
        """The advisor of the P / (``tp`` x ``cp``) virtual ranks (tensor x context-parallel groups) of this
        cluster."""
        if tp == 1 and cp == 1:
            return self
        if (tp, cp) not in self._virtual:
            self._virtual[(tp, cp)] = _VirtualRankAdvisor(self, tp, cp)
        return self._virtual[(tp, cp)]

    def _split(self, cfg: Config):
        """(advisor, configuration, T x C): a tensor- or context-parallel configuration as the virtual ranks'
        one, and the GPUs of a virtual rank."""
        tp, cp = cfg.knobs.get("tp", 1), cfg.knobs.get("cp", 1)
        if tp == 1 and cp == 1:
            return self, cfg, 1
        inner = Config(cfg.strategy, cfg.micro_batch_size, cfg.recompute,
                       {k: v for k, v in cfg.knobs.items() if k not in ("tp", "cp")})
        return self.virtual(tp, cp), inner, tp * cp

    def per_gpu(self, memory: MemoryBreakdown, strategy: str = "") -> MemoryBreakdown:
        """This advisor's (virtual) rank's memory per GPU (weight passing keeps its masters' tensor-parallel slice
        whole on each context-parallel member, the Adam moments divided over them)."""
        if self.cp > 1 and strategy in ("tawpipe", "weipipe"):
            return weight_passing_per_gpu(memory, self.cp, self.tp)
        return per_gpu_breakdown(memory, self.tp, self.cp)

    def wp_cost(self, b: int, recompute: bool):
        """(cost model, ``around`` of a plan: the context-parallel pieces' collectives, or None) of weight passing."""
        return self.cost(b, recompute), None

    def settle(self, cfg: Config) -> Config:
        """Choose the stages of a megatron pipeline whose size does not divide the layers
        (``knobs["uneven"]``): ``knobs["stage_layers"]`` and the ``split_flags`` that ask
        ``pretrain_llama.py`` (Megatron-LM) for them (:func:`megatron_tawpipe.sim.stages.native_pipeline_split`:
        1F1B's candidates timed by a simulation with free links)."""
        k = cfg.knobs
        if not k.get("uneven") or "stage_layers" in k:
            return cfg
        sub, inner, n = self._split(cfg)
        if n > 1:
            sub.settle(inner)
            k.update(stage_layers=inner.knobs["stage_layers"], split_flags=inner.knobs["split_flags"])
            return cfg
        b, P, D, L = cfg.micro_batch_size, self.cluster.ranks, self.cluster.nodes, self.model.num_layers
        p, V = k["pipeline_size"], k.get("virtual_stages", 1)
        m = self.G // b // (P // p)
        key = (b, cfg.recompute, p, V, m)
        if key not in self._stage_splits:
            c = self.cost(b, cfg.recompute)
            free = replace(c, intra=Link(float("inf")), inter=Link(float("inf")))

            def evaluate(split):
                build = lambda n: build_plan("1f1b", num_ranks=p, num_groups=D, num_layers=L,  # noqa: E731
                                             num_microbatches=n, shard_layers=split)
                return simulate_extended(build, free, m, 2 * p, 4 * p).iteration_time

            self._stage_splits[key] = native_pipeline_split(
                L, p, V, c.layer_forward + c.layer_backward + c.layer_recompute, c.head_forward + c.head_backward,
                m, evaluate)
        split, flags = self._stage_splits[key]
        k.update(stage_layers=split, split_flags=flags)
        return cfg

    def bound(self, cfg: Config) -> float:
        """Tokens/s per GPU with free communication: compute only, times the
        pipeline bubble where the schedule has one (pipelines: the bound of
        :func:`megatron_tawpipe.sim.stages.pipeline_time_bound`, each stage with its own layers and the
        output layer on the last, 1F1B's ``m/(m+p-1)`` and interleaved's ``Vm/(Vm+p-1)`` for equal
        stages; WeiPipe ``NP/(NP+P-1)``).  A pipeline whose stages are not chosen yet (:meth:`settle`
        simulates candidates) takes the best of the candidates' bounds: its ceiling whichever is chosen."""
        sub, inner, n = self._split(cfg)
        if n > 1:
            return sub.bound(inner) / n
        c = self.cost(cfg.micro_batch_size, cfg.recompute)
        L, P = self.model.num_layers, self.cluster.ranks
        t = L * (c.layer_forward + c.layer_backward + c.layer_recompute) + c.head_forward + c.head_backward
        mbs = self.G // cfg.micro_batch_size
        k = cfg.knobs
        if "pipeline_size" in k:
            p, v = k["pipeline_size"], k.get("virtual_stages", 1)
            m = mbs // (P // p)
            if k.get("stage_layers"):
                splits = [k["stage_layers"]]
            elif k.get("uneven") and v == 1:       # settle() picks one of these
                if p not in self._candidate_splits:
                    self._candidate_splits[p] = {split for split, _ in first_last_options(L, p)} | \
                        {default_layer_split(L, p)}
                splits = self._candidate_splits[p]
            else:
                splits = [default_layer_split(L, p * v)]
            work = c.layer_forward + c.layer_backward + c.layer_recompute
            t = min(pipeline_time_bound(stage_works(split, work, c.head_forward + c.head_backward), p, m)
                    for split in splits)
            return m * c.tokens_per_microbatch / (t * p)
        elif cfg.strategy == "weipipe":
            # (P - 1) turns of the largest work of one turn (3 of F = 1, B = 2 once a round holds every
            # pass; WZB2's trail: 1, 2 at 1, 2 micro-batches per rank; docs/plan-ir-and-schedules.md)
            peak = min(3, mbs // P) if k.get("zero_bubble") == 2 else 3
            peak = 0 if k.get("plan_schedule") else peak   # split, weight passes moved: no closed form
            t *= (3 * mbs + (P - 1) * peak) / (3 * mbs)
        return c.tokens_per_microbatch / t

    def comm_bound(self, cfg: Config) -> float:
        """Tokens/s per GPU that the node links allow: an iteration takes at least
        the bytes a node sends over its link (on average) / inter bandwidth.
        Pipelines: every boundary between nodes carries each micro-batch's
        activation once per virtual stage (and its gradient back); weight
        passing: the plan's inter-node bytes (exact, linear in N) and the replicated
        parts' ring all-reduce."""
        sub, inner, n = self._split(cfg)
        if n > 1:
            return sub.comm_bound(inner) / n
        cl, k = self.cluster, cfg.knobs
        if cl.nodes == 1:
            return float("inf")
        cost = self.cost(cfg.micro_batch_size, cfg.recompute)
        mbs = self.G // cfg.micro_batch_size
        if "pipeline_size" in k:
            node_bytes = k.get("virtual_stages", 1) * mbs * cost.activation_bytes
        else:
            N, c = mbs // cl.ranks, k.get("chunk", 1)
            n1, n2 = (N, N) if N <= 4 * c else (2 * c, 4 * c)
            # a split backward moves its weight passes, not its transfers: its plain schedule's bytes
            name, opts = bytes_twin(cfg)
            plan = self._plan(name, n2, **opts)
            weight, grad = cost.shard_bytes(plan), cost.grad_shard_bytes(plan)
            rep_bytes = cost.replicated_params * cost.grad_bytes
            # the same for every micro-batch size and recompute setting with these plans: counted once
            key = (name, tuple(sorted(opts.items())), N, n1, n2, weight, grad, rep_bytes, cost.reduce_scatter_factor,
                   cost.dtype_bytes)
            if key not in self._node_bytes:
                b1, b2 = (link_bytes(self._plan(name, n, **opts), weight, bytes_per_grad=grad,
                                     reduce_scatter_factor=cost.reduce_scatter_factor)["inter"] for n in (n1, n2))
                rep = replicated_allreduce_bytes(plan, rep_bytes, cost.reduce_scatter_factor,
                                                 cost.replicated_params * cost.dtype_bytes)["inter"]
                self._node_bytes[key] = ((b2 + (N - n2) * (b2 - b1) / (n2 - n1) if n2 > n1 else b2) / cl.nodes
                                         + rep / cl.nodes)
            node_bytes = self._node_bytes[key]
        t = node_bytes / cl.inter_bw
        return self.G * self.model.seq_length / (cl.ranks * t) if t > 0 else float("inf")

    def _plan_key(self, name, N, **opts):
        return (name, self.cluster.ranks, self.cluster.nodes, self.model.num_layers, N, tuple(sorted(opts.items())))

    def _plan(self, name, N, **opts):
        P, D, L = self.cluster.ranks, self.cluster.nodes, self.model.num_layers
        key = self._plan_key(name, N, **opts)
        if key not in self.plan_cache:
            self.plan_cache[key] = build_plan(name, num_ranks=P, num_groups=D, num_layers=L,
                                              num_microbatches=N, **opts)
        return self.plan_cache[key]

    def memory_only(self, cfg: Config) -> MemoryBreakdown:
        """Memory of a plan-based config without simulating it.  Weight passing:
        a plan with 2c micro-batches per rank has the buffers and the stored
        boundaries of the full one (peak = c visits' worth)."""
        self.settle(cfg)
        sub, inner, n = self._split(cfg)
        if n > 1:
            return sub.per_gpu(sub.memory_only(inner), cfg.strategy)
        cost = self.cost(cfg.micro_batch_size, cfg.recompute)
        cl = self.cluster
        if cfg.strategy in ("tawpipe", "weipipe"):
            N = self.G // cfg.micro_batch_size // cl.ranks
            c = cfg.knobs.get("chunk", 1)
            # WZB2 keeps a third micro-batch while its weight-gradient passes trail a round (moved weight
            # passes and WZB1's paired blocks may too)
            extra = cfg.knobs.get("zero_bubble") == 2 or bool(cfg.knobs.get("plan_schedule"))
            # the plan its simulation needs (4c or N micro-batches; at least 2c + 1: the same peak) where it is
            # built already or costly to build (a plan-file schedule's), else the smaller one
            name, opts = wp_schedule(cfg), wp_options(cfg)
            n = min(N, 4 * c)
            if not cfg.knobs.get("plan_schedule") and self._plan_key(name, n, **opts) not in self.plan_cache:
                n = min(N, 2 * c + extra)
            probe = self._plan(name, n, **opts)
            return weight_passing_breakdown(plan_memory_fields(probe, cost), cost, probe, c)
        pp = cfg.knobs["pipeline_size"]
        m = self.G // cfg.micro_batch_size // (cl.ranks // pp)
        return pipeline_memory(cost, cl.ranks, cl.nodes, self.model.num_layers,
                               self.G // cfg.micro_batch_size, pp, cfg.knobs.get("virtual_stages", 1),
                               self.plan_cache, min(m, 4 * pp), cfg.knobs.get("stage_layers"))

    def evaluate(self, cfg: Config) -> Config:
        """Simulate ``cfg``; its figures per GPU, whether it fits, its command line and whether
        ``pretrain_llama.py`` runs it (:meth:`check`)."""
        self._evaluate(cfg)
        self.check(cfg)
        return cfg

    def check(self, cfg: Config) -> Optional[bool]:
        """Whether ``pretrain_llama.py`` accepts ``cfg``'s command (``check_command``; once per configuration):
        ``cfg.trainable``, with the refusal in ``cfg.note``."""
        if cfg.checked or not cfg.argv:
            return cfg.trainable
        cfg.checked = True
        if cfg.trainable and self.check_command is not None:
            problem = check_with_plan_file(self, cfg)
            if problem:
                cfg.trainable = False
                cfg.note = "pretrain_llama.py refuses it: " + problem
        return cfg.trainable

    def _evaluate(self, cfg: Config) -> Config:
        self.settle(cfg)
        sub, inner, n = self._split(cfg)
        if n > 1:
            sub.measure(inner)
            cfg.tokens_per_sec_per_gpu = inner.tokens_per_sec_per_gpu / n
            cfg.iteration_time, cfg.bubble = inner.iteration_time, inner.bubble
            cfg.inter_bytes_per_node = inner.inter_bytes_per_node
            cfg.memory = sub.per_gpu(inner.memory, cfg.strategy)
            cfg.trainable, cfg.note = inner.trainable, inner.note
            cfg.context_parallel_bytes_per_gpu = inner.context_parallel_bytes_per_gpu
        else:
            self.measure(cfg)
        cfg.status = "ok" if cfg.memory.total <= self.cluster.usable_memory else "no-fit"
        cfg.argv, cfg.command = command(cfg, self.model, self.cluster, self.G)
        return cfg

    def measure(self, cfg: Config) -> Config:
        """The simulation of ``cfg`` on this advisor's (possibly virtual) ranks: tokens/s, time,
        bubble, bytes per node, memory; what only the simulator models is marked not trainable."""
        cl, model = self.cluster, self.model
        P, D, L = cl.ranks, cl.nodes, model.num_layers
        b = cfg.micro_batch_size
        cost = self.cost(b, cfg.recompute)
        N = self.G // b // P
        s = cfg.strategy
        if s in ("tawpipe", "weipipe"):
            opts, c, name = wp_options(cfg), cfg.knobs.get("chunk", 1), wp_schedule(cfg)
            cost, around = self.wp_cost(b, cfg.recompute)
            res = simulate_extended(lambda n: self._plan(name, n, **opts), cost, N, 2 * c, 4 * c, around)
            plan = self._plan(name, min(N, 4 * c), **opts)   # simulated: its shards and peaks are the full plan's
            mem = weight_passing_breakdown(res, cost, plan, c)
            res_inter = res.link_bytes["inter"] / D
        elif s in ("pp-nodes", "1f1b", "interleaved"):
            pp, V = cfg.knobs["pipeline_size"], cfg.knobs.get("virtual_stages", 1)
            res = simulate_pipeline(cost, P, D, L, self.G // b, pp, V, self.grad_bytes,
                                    self.plan_cache, name=s, exact=False,
                                    stage_layers=cfg.knobs.get("stage_layers"), context_parallel=self.cp)
            mem = MemoryBreakdown.from_dict(res.options["memory_breakdown"])
            res_inter = res.options["inter_bytes_per_node"]
            split = cfg.knobs.get("stage_layers") or default_layer_split(L, pp * V)
            cfg.context_parallel_bytes_per_gpu = self.ring_bytes(
                b, cfg.recompute, max(sum(split[r::pp]) for r in range(pp)), res.options["microbatches_per_pipeline"])
        else:
            if s == "fsdp":
                # one unit per layer, as the FSDP2 baseline wraps every decoder layer
                res = simulate_fsdp(cost, P, D, L, N, unit_layers=1, grad_bytes=self.grad_bytes)
                mem = generic_breakdown(res, cost)
                res_inter = res.link_bytes["inter"] / D if D > 1 else 0.0
            else:
                C = self.cp
                fn = {"hsdp": lambda: simulate_hsdp(cost, P, D, L, N, self.grad_bytes),
                      "distopt-node": lambda: simulate_distopt(cost, P, D, L, N, D, self.grad_bytes, C),
                      "distopt": lambda: simulate_distopt(cost, P, D, L, N, 1, self.grad_bytes, C),
                      "hfsdp": lambda: simulate_hfsdp(cost, P, D, L, N, self.grad_bytes)}[s]
                res = fn()
                mem = MemoryBreakdown.from_dict(res.options["memory_breakdown"])
                res_inter = res.options["inter_bytes_per_node"]
                cfg.context_parallel_bytes_per_gpu = self.ring_bytes(b, cfg.recompute, L, N)
        cfg.tokens_per_sec_per_gpu = res.tokens_per_sec_per_rank
        cfg.iteration_time = res.iteration_time
        cfg.bubble = res.bubble_ratio
        cfg.inter_bytes_per_node = res_inter
        cfg.memory = mem
        return cfg

    def ring_bytes(self, b: int, recompute: bool, layers: int, microbatches: int) -> float:
        """Bytes one GPU sends in its context-parallel ring per iteration (0 without context parallelism)."""
        return 0.0

    def run(self, prune: str = "strategy", trainable_only: bool = False,
            runtime_knobs_only: bool = False, keep: Optional[Callable[[Config], bool]] = None,
            listed: int = 15, parallel: Optional[Tuple[int, int]] = None):
        """Evaluate every configuration (pruned as described in the module doc);
        returns (configs, absent): :class:`~megatron_tawpipe.sim.advisor_configs.Absence` lines for every
        strategy or knob not tried (enumeration), not simulated (pruning) or left out (``trainable_only``).  Analytic
        strategies first (cheap), then plan-based ones by decreasing ceiling; within a strategy's
        knobs, the smaller micro-batches (TawPipe: fewer per visit) first, and once one does not fit the
        larger ones of the same knobs are not evaluated (status ``larger``: memory grows with them).
        ``keep``: only the configurations it accepts (a study's restriction, e.g. TawPipe's cache off).
        ``pretrain_llama.py``'s check (``check_command``) runs on what the answer needs: the ``listed`` best,
        each strategy's best down to its first runnable configuration, the best runnable one (and, with
        ``trainable_only``, every configuration); the others' ``trainable`` is None (not checked).
        ``parallel``: (T, C), the configurations at that tensor x context parallelism only
        (:func:`~megatron_tawpipe.sim.advisor_configs.enumerate_at`)."""
        if parallel is None:
            configs, na = enumerate_configs(self.model, self.cluster, self.G, runtime_knobs_only or trainable_only)
        else:
            configs, na = enumerate_at(self.model, self.cluster, self.G, *parallel, runtime_knobs_only)
        if keep is not None:
            configs = [c for c in configs if keep(c)]
        for c in configs:
            c.bound = self.bound(c)
        rank = {s: i for i, s in enumerate(ORDER)}
        configs.sort(key=lambda c: (c.strategy in PLAN_BASED,
                                    -c.bound if c.strategy in PLAN_BASED else rank[c.strategy], size_of(c),
                                    bool(c.knobs.get("plan_schedule"))))
        best: Dict[str, float] = {}
        best_runnable = 0.0
        too_large: Dict[tuple, int] = {}      # knobs -> smallest size (b x c) known not to fit
        for cfg in configs:
            family, size = family_of(cfg), size_of(cfg)
            # a split backward holds at least what its plain schedule holds (its weight-gradient store more)
            if min(too_large.get(f, size + 1) for f in (family, plain_family_of(cfg))) <= size:
                cfg.status = "larger"
                continue
            if cfg.strategy in PLAN_BASED:
                vals = sorted(best.values(), reverse=True)
                need = best.get(cfg.strategy, 0.0)
                if prune == "top2" and len(vals) >= 2:
                    # plan-based configurations are runnable: the best runnable one stays exact too
                    need = max(need, min(vals[1], best_runnable))
                if cfg.bound <= need:
                    cfg.status = "pruned"
                    continue
                cfg.bound = min(cfg.bound, self.comm_bound(cfg))
                if cfg.bound <= need:
                    cfg.status = "pruned"
                    continue
                probe = self.memory_only(cfg)        # no simulation for what does not fit
                if probe.total > self.cluster.usable_memory:
                    cfg.memory, cfg.status = probe, "no-fit"
                    cfg.argv, cfg.command = command(cfg, self.model, self.cluster, self.G)
                    too_large[family] = size
                    continue
            self._evaluate(cfg)
            if cfg.status == "no-fit":
                too_large[family] = size
                continue
            if trainable_only and not self.check(cfg):
                cfg.status = "skipped"
                continue
            best[cfg.strategy] = max(best.get(cfg.strategy, 0.0), cfg.tokens_per_sec_per_gpu)
            if prune == "top2" and cfg.tokens_per_sec_per_gpu > best_runnable and self.check(cfg):
                best_runnable = cfg.tokens_per_sec_per_gpu
        check_listed(self, configs, listed)
        mark_auto_layouts(self, configs, listed)
        return configs, na + left_out(configs, prune)


class _VirtualRankAdvisor(Advisor):
    """The advisor of a cluster's P / (T x C) tensor x context-parallel groups, each one *virtual rank*: T x C
    GPUs' memory, and the cost model of :func:`megatron_tawpipe.sim.tensor_parallel.virtual_rank_cost` (1/T
    compute plus the tensor-parallel collectives, T GPUs' links inside the node, the node's link between nodes)
    or, with C > 1, of :func:`megatron_tawpipe.sim.context_parallel.context_parallel_cost` (1/C of it plus the
    ring's exposed time)."""

    def __init__(self, parent: Advisor, tp: int, cp: int = 1):
        cl = parent.cluster
        n = tp * cp
        cluster = replace(cl, ranks=cl.ranks // n, gpu_memory=cl.gpu_memory * n,
                          memory_reserve=cl.memory_reserve * n)
        super().__init__(parent.model, cluster, parent.G, parent.plan_cache, parent.grad_bytes,
                         check_command=parent.check_command)
        self.parent, self.tp, self.cp = parent, tp, cp

    def shape(self, b: int) -> AttentionShape:
        m = self.model
        return AttentionShape(seq_length=m.seq_length, micro_batch_size=b, hidden_size=m.hidden_size,
                              num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                              ffn_hidden_size=m.ffn_hidden_size)

    def cost(self, b: int, recompute: bool) -> CostModel:
        key = (b, recompute)
        if key not in self.costs:
            self.costs[key] = context_parallel_cost(self.parent.cost(b, recompute), self.cp, self.shape(b), self.tp)
        return self.costs[key]

    def ring_bytes(self, b: int, recompute: bool, layers: int, microbatches: int) -> float:
        return context_parallel_bytes_per_gpu(self.parent.cost(b, recompute), self.shape(b), self.cp, self.tp,
                                              layers, microbatches)

    def wp_cost(self, b: int, recompute: bool):
        if self.cp == 1:
            return super().wp_cost(b, recompute)
        costs, pieces = virtual_rank_pricing({recompute: self.parent.cost(b, recompute)}, self.cp, self.shape(b),
                                             self.tp)
        return costs[recompute], pieces.around(recompute)


def advise(model: ModelSpec, cluster: Cluster, global_batch: int, prune: str = "strategy",
           plan_cache: Optional[Dict] = None, trainable_only: bool = False,
           runtime_knobs_only: bool = False,
           check_command: Optional[Callable[[List[str], int], str]] = None,
           keep: Optional[Callable[[Config], bool]] = None, listed: int = 15) -> dict:
    """Run the advisor; returns the summary dict (``--json`` prints it; ``searched``: what was searched,
    per strategy, :func:`megatron_tawpipe.sim.advisor_report.searched`).  ``listed``: the rows of the report
    (checked against ``pretrain_llama.py``, see :meth:`Advisor.run`)."""
    adv = Advisor(model, cluster, global_batch, plan_cache, check_command=check_command)
    configs, na = adv.run(prune=prune, trainable_only=trainable_only,
                          runtime_knobs_only=runtime_knobs_only, keep=keep, listed=listed)
    out = summarize(model, cluster, global_batch, configs, na, prune)
    out["searched"] = searched(configs, global_batch, cluster.ranks)
    return out
