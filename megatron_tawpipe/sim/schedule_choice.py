"""``--pipeline-schedule auto``: which of what ``pretrain_llama.py`` runs is fastest for a run's model, batch,
cluster and memory.

The candidates are the strategies a Megatron user would compare, at the run's own micro-batch size, global batch,
recomputation and tensor x context parallelism T x C: TawPipe in the layout it decides
(:func:`megatron_tawpipe.sim.layout_choice.choose_layout`), WeiPipe and its zero-bubble forms, megatron's 1F1B
and interleaved pipelines over every stage count whose stages sit inside nodes (with the distributed optimizer
over the data-parallel ranks), and megatron's distributed optimizer over all ranks (one instance, or one per
node). Each is priced by the advisor's simulation on the run's cost model
(:class:`megatron_tawpipe.sim.advisor.Advisor`, with the run's compute times, links, dtypes and collectives),
those over the memory limit or refused by ``pretrain_llama.py``'s validation dropped, and the rest ranked by
predicted tokens/s per GPU. With T x C > 1 every candidate runs over the P / (T x C) virtual ranks of T x C GPUs
inside a node and is priced per GPU as the advisor prices that T x C
(:meth:`megatron_tawpipe.sim.advisor.Advisor.virtual`): the native strategies with the ring attention's exposed
time; TawPipe (one owner per shard) and WeiPipe, with C > 1 (beside any T), with the pieces' collectives too
(:mod:`megatron_tawpipe.sim.context_parallel_weights`; TawPipe's layout decided on that pricing as the run decides
it). Every candidate computes the same step (the equivalence tests hold each to one process): the choice changes
speed, never the math.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional

from megatron_tawpipe.sim.advisor import Advisor
from megatron_tawpipe.sim.advisor_configs import Cluster, Config, ModelSpec
from megatron_tawpipe.sim.advisor_report import strategy_flags
from megatron_tawpipe.sim.context_parallel import context_parallel_problem
from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.layout_choice import LayoutChoice, LayoutInputs, choose_layout

#: the advisor's strategies ``--pipeline-schedule auto`` chooses among (TawPipe: its decided layout)
AUTO_STRATEGIES = ("tawpipe", "weipipe", "1f1b", "interleaved", "pp-nodes", "distopt", "distopt-node")


@dataclass
class Ranked:
    label: str                      # what runs, in words
    flags: List[str]                # the pretrain_llama.py flags that select it (replacing --pipeline-schedule auto)
    tokens_per_sec_per_gpu: float
    memory_bytes: float
    refusal: str = ""               # why pretrain_llama.py refuses it ("" when it runs)
    layout: Optional[LayoutChoice] = None   # TawPipe's decided layout


@dataclass
class ScheduleRanking:
    ranked: List[Ranked]            # runnable and fitting, fastest first
    left_out: List[Ranked] = field(default_factory=list)   # refused, or over the memory limit

    @property
    def winner(self) -> Optional[Ranked]:
        return self.ranked[0] if self.ranked else None

    def lines(self, top: int = 3) -> List[str]:
        """The top ``top`` with their margins to the winner."""
        if not self.ranked:
            return ["--pipeline-schedule auto: no candidate runs: " + "; ".join(
                f"{r.label}: {r.refusal or 'over the memory limit'}" for r in self.left_out[:4])]
        best = self.ranked[0].tokens_per_sec_per_gpu
        out = []
        for i, r in enumerate(self.ranked[:top]):
            margin = "" if i == 0 else f", {100 * (r.tokens_per_sec_per_gpu / best - 1):+.1f}%"
            out.append(f"  {i + 1}. {r.label}: predicted {r.tokens_per_sec_per_gpu:.0f} tokens/s per GPU{margin}, "
                       f"{r.memory_bytes / 1e9:.2f} GB per GPU")
        return out


class _RunAdvisor(Advisor):
    """The advisor on a run's own cost model (``cost_of(micro_batch_size, recompute)``)."""

    def __init__(self, model, cluster, global_batch, cost_of: Callable[[int, bool], CostModel], grad_bytes: int):
        super().__init__(model, cluster, global_batch, grad_bytes=grad_bytes)
        self._cost_of = cost_of

    def cost(self, b: int, recompute: bool) -> CostModel:
        key = (b, recompute)
        if key not in self.costs:
            self.costs[key] = self._cost_of(b, recompute)
        return self.costs[key]


def _label(cfg: Config) -> str:
    k = cfg.knobs
    if cfg.strategy in ("1f1b", "interleaved", "pp-nodes"):
        name = "interleaved" if cfg.strategy == "interleaved" else "1f1b"
        text = f"{name} over {k['pipeline_size']} stages"
        if cfg.strategy == "interleaved":
            text += f" x {k['virtual_stages']} virtual"
        return text + " (distributed optimizer across the pipelines)"
    if cfg.strategy == "weipipe":
        return "weipipe" + (f" zero-bubble {k['zero_bubble']}" if k.get("zero_bubble") else "")
    if cfg.strategy == "distopt":
        return "megatron's distributed optimizer over all ranks (overlapped)"
    if cfg.strategy == "distopt-node":
        return "megatron's distributed optimizer, one instance per node (overlapped)"
    return cfg.strategy


def rank_schedules(model: ModelSpec, cluster: Cluster, global_batch: int, micro_batch_size: int,
                   cost_of: Callable[[int, bool], CostModel], weight_passing_recompute: Optional[bool],
                   native_recompute: Optional[bool], check: Callable[[List[str]], str], grad_bytes: int = 4,
                   layout: Optional[LayoutInputs] = None, tensor_parallel: int = 1,
                   context_parallel: int = 1) -> ScheduleRanking:
    """Rank the candidates (see the module docstring) at the run's tensor and context parallelism T x C (every
    candidate over the P / (T x C) virtual ranks, priced per GPU). ``cost_of(b, recompute)``: the run's cost
    model, one GPU's; ``weight_passing_recompute`` / ``native_recompute``: the recomputation the command fixes
    (None: each candidate recomputes only where it does not fit otherwise, and its flags say which);
    ``check(flags)``: why ``pretrain_llama.py`` refuses the run with ``flags`` in place of ``--pipeline-schedule
    auto`` ("" when it accepts it); ``layout``: what TawPipe's layout decision takes from the run's flags
    (``training.tawpipe_layout.layout_inputs``; default: nothing given, the global batch)."""
    advisor = _RunAdvisor(model, cluster, global_batch, cost_of, grad_bytes)
    b, T, C = micro_batch_size, tensor_parallel, context_parallel
    P, D = cluster.ranks, cluster.nodes
    problem = context_parallel_problem(C, T, cluster.per_node, model.seq_length, P)
    if problem:   # the ring is priced inside a node
        return ScheduleRanking([], [Ranked(f"every strategy with --context-parallel-size {C}", [], 0.0, 0.0,
                                           f"not priced: {problem}")])

    def keep(cfg: Config) -> bool:
        recompute = weight_passing_recompute if cfg.strategy == "weipipe" else native_recompute
        return (cfg.strategy in AUTO_STRATEGIES[1:] and cfg.micro_batch_size == b
                and (recompute is None or cfg.recompute == recompute) and not cfg.knobs.get("plan_schedule"))

    configs, _ = advisor.run(prune="strategy", keep=keep, listed=0, parallel=(T, C))
    by_label: dict = {}
    for cfg in configs:
        if cfg.status not in ("ok", "no-fit"):
            continue
        fixed = weight_passing_recompute if cfg.strategy == "weipipe" else native_recompute
        flags = strategy_flags(cfg, model, cluster, recompute_flags=fixed is None)
        if "--pipeline-schedule" not in flags:
            flags = ["--pipeline-schedule", "1f1b"] + flags
        label = _label(cfg)
        r = Ranked(label + ("" if fixed is not None else ", recompute" if cfg.recompute else ""), flags,
                   cfg.tokens_per_sec_per_gpu, cfg.memory.total, "" if cfg.status == "ok" else "over the memory limit")
        other = by_label.get(label)   # with recompute left open: the faster of the two that fit
        if other is None or (not r.refusal, r.tokens_per_sec_per_gpu) > (not other.refusal, other.tokens_per_sec_per_gpu):
            by_label[label] = r
    candidates: List[Ranked] = list(by_label.values())
    tawpipe = _tawpipe(advisor, b, T, C, layout or LayoutInputs(), weight_passing_recompute)
    candidates += [tawpipe] if tawpipe is not None else []
    for r in candidates:
        if not r.refusal:
            r.refusal = check(r.flags)
    ranked = sorted((r for r in candidates if not r.refusal), key=lambda r: -r.tokens_per_sec_per_gpu)
    return ScheduleRanking(ranked, [r for r in candidates if r.refusal])


def _tawpipe(advisor: Advisor, b: int, T: int, C: int, layout: LayoutInputs,
             recompute: Optional[bool]) -> Optional[Ranked]:
    """TawPipe in the layout ``pretrain_llama.py --pipeline-schedule tawpipe`` decides on this cost model and
    memory (recompute with it where left open): over the P / (T x C) virtual ranks, priced as the run prices them
    (:func:`~megatron_tawpipe.sim.context_parallel_weights.virtual_rank_pricing`), its flags the layout's. None
    where the batch or the layers do not split over the ranks."""
    model, cluster, G = advisor.model, advisor.cluster, advisor.G
    P, D, V = cluster.ranks, cluster.nodes, cluster.ranks // (T * C)
    if G % (b * V) or model.num_layers < V:
        return None
    request = layout.request
    if C > 1 and request.ownership is None:   # the run's: one owner per shard with context parallelism
        request = replace(request, ownership="owner")
    settings = (False, True) if recompute is None else (recompute,)
    one = {rc: advisor.cost(b, rc) for rc in settings}
    # C > 1: the virtual ranks' cost model and pieces at T x C; C = 1: choose_layout slices the work over T
    costs, pieces = virtual_rank_pricing(one, C, advisor.virtual(T, C).shape(b), T) if C > 1 else (one, None)
    choice = choose_layout(request, costs, V, D, model.num_layers, layout.microbatch_counts or [G // (b * V)],
                           cluster.usable_memory, layout.split_of, layout.shards_allowed, T,
                           plan_schedule=layout.plan_schedule, pieces=pieces)
    best = choice.chosen_priced
    tokens = G * model.seq_length / (best.iteration_time * P)   # per GPU: the P GPUs of the V virtual ranks
    flags = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", str(D)] + choice.chosen.flags()
    return Ranked(f"tawpipe ({choice.chosen.label()})", flags, tokens, best.memory_bytes,
                  "" if best.fits else "over the memory limit", choice)
