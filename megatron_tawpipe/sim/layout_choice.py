"""TawPipe's layout, decided: the one function behind every ``auto`` of a TawPipe run.

A TawPipe layout is seven knobs (:class:`TawPipeLayout`): where each shard's state lives (``owner``: one rank of
one group; ``spread``: a slice in every group), shards per rank, shard 0 replicated in every group, the shard
cache, micro-batches per visit, how the replicated parameters' gradients are all-reduced, and whether a shard's
forward is recomputed in its backward (or its activations kept). Every layout computes the same step (the
equivalence tests prove each exact); they differ in bytes on the node links, in when those bytes move, in
compute (recompute: one more forward per shard and micro-batch) and in memory.

:func:`choose_layout` takes what the user fixed (:class:`LayoutRequest`: ``None`` = auto), enumerates every
layout that agrees with it and that the ranks, groups and layers allow (:func:`candidate_layouts`), prices each
with the simulator on the run's cost model (compute times and links), drops those whose predicted peak per
device exceeds the memory limit, and keeps the fastest. Near-ties (within :data:`TIE`, 0.2%) go to the earlier
candidate in a fixed order -- one owner per shard, one shard per rank, no replication, the cache, one
micro-batch per visit, the hierarchical reduction, activations kept first -- so that a run does not flip layouts
on noise. Recompute is priced only where it can win: a layout recomputing is never faster than the same layout
keeping its activations (the same plan, longer backward actions), so it is priced for the layouts that do not
fit without it and would beat the fastest that does.

``pretrain_llama.py`` (``training.tawpipe_layout_args``), ``tools/simulate.py`` and the advisor call it, so
``auto`` means one thing everywhere.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.pipelines import simulate_extended
from megatron_tawpipe.sim.tawpipe_cache import predicted_memory
from megatron_tawpipe.sim.tensor_parallel import virtual_rank_cost

#: two layouts whose predicted iteration times differ by less than this share are a tie (the earlier wins)
TIE = 0.002
#: the shard counts per rank tried where the layers allow them
SHARDS_PER_RANK = (1, 2)


@dataclass(frozen=True)
class TawPipeLayout:
    ownership: str = "owner"               # --tawpipe-ownership
    shards_per_rank: int = 1               # --tawpipe-shards-per-rank
    replicate_first: bool = False          # --tawpipe-replicate-first-shard
    cache: bool = False                    # --tawpipe-cache on / off
    microbatches_per_visit: int = 1        # --tawpipe-microbatches-per-visit
    replicated_reduce: str = "hierarchical"   # --tawpipe-replicated-reduce
    recompute: bool = True                 # --tawpipe-recompute on / off

    def plan_options(self) -> dict:
        """The TawPipe planner's options for this layout."""
        options = {"chunk": self.microbatches_per_visit, "cache": self.cache}
        if self.replicate_first:
            options["replicate_first"] = True
        if self.ownership == "spread":
            options["ownership"] = "spread"
        if self.shards_per_rank != 1:
            options["shards_per_rank"] = self.shards_per_rank
        if self.replicated_reduce == "flat":
            options["hierarchical_replicated"] = False
        elif self.replicated_reduce == "sharded":
            options["sharded_replicated"] = True
        return options

    def flags(self) -> List[str]:
        """The ``pretrain_llama.py`` flags that pin this layout."""
        out = ["--tawpipe-ownership", self.ownership, "--tawpipe-shards-per-rank", str(self.shards_per_rank),
               "--tawpipe-cache", "on" if self.cache else "off",
               "--tawpipe-microbatches-per-visit", str(self.microbatches_per_visit),
               "--tawpipe-replicated-reduce", self.replicated_reduce,
               "--tawpipe-recompute", "on" if self.recompute else "off"]
        return out + (["--tawpipe-replicate-first-shard"] if self.replicate_first else
                      ["--no-tawpipe-replicate-first-shard"])

    def label(self) -> str:
        parts = [self.ownership, f"{self.shards_per_rank} shard{'s' if self.shards_per_rank > 1 else ''}/rank",
                 f"cache {'on' if self.cache else 'off'}", f"{self.microbatches_per_visit}/visit"]
        if self.replicate_first:
            parts.append("first shard replicated")
        if self.replicated_reduce != "hierarchical":
            parts.append(f"{self.replicated_reduce} replicated reduce")
        parts.append("recompute" if self.recompute else "activations kept")
        return ", ".join(parts)


@dataclass(frozen=True)
class LayoutRequest:
    """What the user fixed; ``None``: auto."""

    ownership: Optional[str] = None
    shards_per_rank: Optional[int] = None
    replicate_first: Optional[bool] = None
    cache: Optional[bool] = None
    microbatches_per_visit: Optional[int] = None
    replicated_reduce: Optional[str] = None
    recompute: Optional[bool] = None

    def is_fixed(self) -> bool:
        return all(v is not None for v in asdict(self).values())


def visit_sizes(n: int) -> List[int]:
    """Micro-batches per visit for ``n`` per rank: the powers of two dividing ``n``, and ``n`` (one visit)."""
    out, c = [], 1
    while c <= n and n % c == 0:
        out.append(c)
        c *= 2
    return out + ([n] if n not in out else [])


def candidate_layouts(request: LayoutRequest, ranks: int, groups: int, num_layers: int,
                      microbatch_counts: Sequence[int], shards_allowed: Sequence[int] = SHARDS_PER_RANK,
                      recomputes: Sequence[bool] = (False, True)) -> List[TawPipeLayout]:
    """Every layout that agrees with ``request`` and that ``ranks`` weight-pipeline ranks in ``groups`` groups
    with ``num_layers`` layers run, for every micro-batch count per rank in ``microbatch_counts`` (a batch ramp
    has several), in the preference order of near-ties. ``shards_allowed``: the shard counts per rank the
    layer-split flags allow; ``recomputes``: the recompute settings there is a cost model for."""
    r = request
    several = groups >= 2
    shards = [v for v in shards_allowed if num_layers >= v * ranks]
    # auto: the visit sizes that divide every batch's micro-batches per rank; a size given runs as given (the last
    # visit of a shard then takes what is left)
    visits = ([r.microbatches_per_visit] if r.microbatches_per_visit is not None else
              sorted(set.intersection(*(set(visit_sizes(n)) for n in microbatch_counts))) if microbatch_counts else [1])
    # the flat reduction differs from the hierarchical one only over several nodes of several ranks
    reduces = ("hierarchical", "flat") if several and ranks // groups >= 2 else ("hierarchical",)
    if ranks >= 2:   # first: the replicated parts' optimizer sharded over the ranks (least memory, and on NCCL
        reduces = ("sharded",) + reduces   # fewest bytes; gloo's reduce-scatter moves an all-reduce's)
    out = []
    for ownership in ("owner", "spread") if several else ("owner",):
        for v in shards:
            for rep in (False, True) if several and ownership == "owner" else (False,):
                for cache in (True, False) if several else (False,):
                    if ownership == "spread" and not cache and r.cache is None:
                        continue   # without the cache the spread layout gathers every visit: not tried unless asked
                    for c in visits:
                        for reduce in reduces:
                            out.extend(TawPipeLayout(ownership, v, rep, cache, c, reduce, rc)
                                       for rc in sorted(set(recomputes)))

    def agrees(layout: TawPipeLayout) -> bool:
        return all(want is None or getattr(layout, name) == want for name, want in asdict(r).items())

    return [c for c in out if agrees(c)]


@dataclass
class Priced:
    layout: TawPipeLayout
    iteration_time: float
    memory_bytes: float
    fits: bool


@dataclass
class LayoutChoice:
    """The decision: the chosen layout, every layout priced (fastest first), and what it was decided on."""

    chosen: TawPipeLayout
    priced: List[Priced]
    inputs: Dict[str, str] = field(default_factory=dict)   # what the decision took: link, compute, memory
    decide_seconds: float = 0.0
    request: LayoutRequest = field(default_factory=LayoutRequest)
    key: Optional[Dict[str, object]] = None   # what the decision depended on (the run's flags and cluster)
    saved_from: Optional[str] = None          # the checkpoint whose decision a resumed run took

    @property
    def runner_up(self) -> Optional[Priced]:
        rest = [p for p in self.priced if p.fits and p.layout != self.chosen]
        return rest[0] if rest else None

    @property
    def chosen_priced(self) -> Optional[Priced]:
        return next((p for p in self.priced if p.layout == self.chosen), None)

    def margin(self) -> Optional[float]:
        """The runner-up's predicted iteration time over the chosen one's, less 1 (0.05: 5% slower)."""
        best, second = self.chosen_priced, self.runner_up
        if best is None or second is None or best.iteration_time <= 0:
            return None
        return second.iteration_time / best.iteration_time - 1.0

    def line(self) -> str:
        """The one line rank 0 prints."""
        best = self.chosen_priced
        text = f"tawpipe layout: {self.chosen.label()}"
        if self.saved_from:
            return text + (f" (as decided by the run saved in {self.saved_from}: the same flags, cluster, model and "
                           "batch)")
        if self.request.is_fixed():
            return text + " (every layout flag given)"
        if best is not None:
            text += f" (auto: predicted {best.iteration_time:.3g} s/iteration"
            second, margin = self.runner_up, self.margin()
            if second is not None:
                text += f"; runner-up {second.layout.label()}, {100 * margin:+.1f}%"
            text += f"; {len(self.priced)} layouts priced in {self.decide_seconds:.2f} s)"
        if self.inputs:
            text += "; " + "; ".join(f"{k}: {v}" for k, v in self.inputs.items())
        return text

    def record(self) -> dict:
        """What the metrics file and the checkpoint keep of the decision."""
        best, second = self.chosen_priced, self.runner_up
        return {"layout": asdict(self.chosen), "flags": self.chosen.flags(),
                "predicted_iteration_time": best.iteration_time if best else None,
                "runner_up": asdict(second.layout) if second else None,
                "runner_up_iteration_time": second.iteration_time if second else None,
                "layouts_priced": len(self.priced), "inputs": dict(self.inputs),
                "auto": [name for name, v in asdict(self.request).items() if v is None],
                "key": self.key, "saved_from": self.saved_from}


@dataclass
class LayoutInputs:
    """What a run's layout decision takes from its flags besides the cost model and the memory limit (one reader,
    ``training.tawpipe_layout.layout_inputs``, for the run and for ``--pipeline-schedule auto``): the layout flags
    given, micro-batches per rank of every global batch (None: the one global batch's), the shard counts per rank
    allowed, the layers of each shard by shard count, the plan priced."""

    request: LayoutRequest = field(default_factory=LayoutRequest)
    microbatch_counts: Optional[List[int]] = None
    shards_allowed: Sequence[int] = SHARDS_PER_RANK
    split_of: Callable[[int], Optional[Tuple[int, ...]]] = lambda v: None
    plan_schedule: str = "tawpipe"


PlanBuilder = Callable[[int, dict], object]   # (micro-batches per rank, planner options) -> Plan
#: (layouts, price one) -> each layout priced, in order; a run spreads the pricing over its ranks
PriceMany = Callable[[List["TawPipeLayout"], Callable[["TawPipeLayout"], "Priced"]], List["Priced"]]


def price_here(layouts: List[TawPipeLayout], price: Callable[[TawPipeLayout], Priced]) -> List[Priced]:
    """Every layout priced in this process."""
    return [price(layout) for layout in layouts]


def price_layout(layout: TawPipeLayout, cost: CostModel, ranks: int, groups: int, num_layers: int,
                 microbatch_counts: Sequence[int], shard_layers: Optional[Tuple[int, ...]] = None,
                 tensor_parallel: int = 1, plan_schedule: str = "tawpipe",
                 plan_builder: Optional[PlanBuilder] = None, pieces=None) -> Tuple[float, float]:
    """(predicted iteration time of the first count's batch, predicted peak bytes per device over every count)
    of ``layout``: the simulator on ``cost`` (over ``ranks`` weight-pipeline ranks, each ``tensor_parallel``
    GPUs). ``plan_builder``: where plans come from (a caller's cache; default: built here, each once).
    ``pieces``: with context parallelism (virtual ranks of T x C GPUs, ``cost`` theirs: the tensor parallelism
    ``tensor_parallel`` is in it already), the pieces' collectives and the memory per GPU
    (:class:`megatron_tawpipe.sim.context_parallel_weights.Pieces`)."""
    if pieces is not None and pieces.tp != tensor_parallel:
        raise ValueError(f"the context-parallel pieces are priced at T={pieces.tp}, the layout at T={tensor_parallel}")
    # with the pieces, ``cost`` is the whole virtual rank's and their per_gpu slices memory over T x C
    tp = 1 if pieces is not None else tensor_parallel
    virtual = virtual_rank_cost(cost, tp)
    options = layout.plan_options()
    if shard_layers is not None:
        options["shard_layers"] = tuple(shard_layers)
    c = layout.microbatches_per_visit
    built: Dict[int, object] = {}

    def build(n):
        if n not in built:
            built[n] = (plan_builder(n, options) if plan_builder is not None else
                        build_plan(plan_schedule, num_ranks=ranks, num_groups=groups, num_layers=num_layers,
                                   num_microbatches=n, **options))
        return built[n]

    first = microbatch_counts[0]
    around = pieces.around(layout.recompute) if pieces is not None else None
    per_gpu = pieces.per_gpu if pieces is not None else (lambda memory: memory)
    result = simulate_extended(build, virtual, first, 2 * c, 4 * c, around)
    # the plan of min(n, 4c) micro-batches has the full plan's buffers and stored boundaries
    peak = max(per_gpu(predicted_memory(build(min(n, 4 * c)), virtual, c, tp)).total
               for n in microbatch_counts)
    return result.iteration_time, peak


Costs = Union[CostModel, Mapping[bool, CostModel]]   # one cost model, or one per recompute setting


def costs_by_recompute(cost: Costs) -> Dict[bool, CostModel]:
    """``{recompute: cost model}``: a single model prices its own setting only."""
    return {cost.recompute: cost} if isinstance(cost, CostModel) else dict(cost)


def choose_layout(request: LayoutRequest, cost: Costs, ranks: int, groups: int, num_layers: int,
                  microbatch_counts: Sequence[int], memory_limit: float = float("inf"),
                  split_of: Callable[[int], Optional[Tuple[int, ...]]] = lambda v: None,
                  shards_allowed: Sequence[int] = SHARDS_PER_RANK, tensor_parallel: int = 1,
                  inputs: Optional[Dict[str, str]] = None, plan_schedule: str = "tawpipe",
                  plan_builder: Optional[PlanBuilder] = None, price_many: PriceMany = price_here,
                  pieces=None) -> LayoutChoice:
    """The fastest layout that agrees with ``request`` and fits ``memory_limit`` bytes per device (see the module
    docstring); ``cost``: the run's cost model, or one per recompute setting (``{False: ..., True: ...}``: the
    decision takes recompute too); ``split_of(shards_per_rank)``: the layers of each shard (None: the default
    split). With nothing that fits, the one of least memory (its peak in the choice: the runtime says it does not
    fit). Raises ``ValueError`` when no layout agrees with the request. ``plan_builder``: see
    :func:`price_layout`; ``price_many``: how a list of layouts gets priced (:func:`price_here`, or shared out by
    a run's ranks); ``pieces``: context parallelism's, with ``cost`` the virtual ranks' (see :func:`price_layout`;
    :func:`megatron_tawpipe.sim.context_parallel_weights.virtual_rank_pricing` gives both)."""
    started = time.perf_counter()
    counts = list(microbatch_counts)
    costs = costs_by_recompute(cost)
    layouts = candidate_layouts(request, ranks, groups, num_layers, counts, shards_allowed, tuple(costs))
    if pieces is not None:   # context parallelism: the replicated parts' optimizer stays whole on every rank
        layouts = [layout for layout in layouts if layout.replicated_reduce != "sharded"]
    if not layouts:
        raise ValueError(f"no TawPipe layout agrees with the flags given ({_given(request)}) on {ranks} ranks in "
                         f"{groups} groups, {num_layers} layers, {counts[0]} micro-batches per rank")
    priced: Dict[TawPipeLayout, Priced] = {}

    def price(layout: TawPipeLayout) -> Priced:
        t, peak = price_layout(layout, costs[layout.recompute], ranks, groups, num_layers, counts,
                               split_of(layout.shards_per_rank), tensor_parallel, plan_schedule, plan_builder,
                               pieces)
        return Priced(layout, t, peak, peak <= memory_limit)

    def price_all(todo: List[TawPipeLayout]) -> None:
        todo = [layout for layout in todo if layout not in priced]
        priced.update((p.layout, p) for p in price_many(todo, price))

    # The replicated reduction is independent of the rest of the layout: every layout is priced with the first
    # reduction its request allows, and the best of them with the other too. Recompute: every layout is priced
    # with the first setting allowed (activations kept where both are); a recomputing layout only where the same
    # layout keeping its activations does not fit and would beat the fastest that fits (recompute never speeds a
    # layout up).
    first_reduce, first_recompute = layouts[0].replicated_reduce, layouts[0].recompute
    price_all([layout for layout in layouts
               if layout.replicated_reduce == first_reduce and layout.recompute == first_recompute])
    fitting = [p.iteration_time for p in priced.values() if p.fits]
    bar = min(fitting) * (1 + TIE) if fitting else float("inf")
    price_all([layout for layout in layouts if layout.replicated_reduce == first_reduce
               and layout.recompute != first_recompute and _worth_recomputing(
                   priced.get(replace(layout, recompute=first_recompute)), bar)])
    best = _best(list(priced.values()))
    price_all([layout for layout in layouts if layout.replicated_reduce != first_reduce
               and replace(layout, replicated_reduce=first_reduce) == best.layout])
    chosen = _best([priced[layout] for layout in layouts if layout in priced])
    priced_list = [priced[layout] for layout in layouts if layout in priced]
    order = sorted(priced_list, key=lambda p: (not p.fits, p.iteration_time))
    order.remove(chosen)
    return LayoutChoice(chosen.layout, [chosen] + order, dict(inputs or {}), time.perf_counter() - started,
                        request)


def _worth_recomputing(kept: Optional[Priced], bar: float) -> bool:
    """Whether a layout's recomputing form can be chosen, given its form keeping activations (``kept``): only
    where that does not fit and would be faster than ``bar`` (the fastest that fits, with the tie margin)."""
    return kept is None or (not kept.fits and kept.iteration_time < bar)


def _best(priced: List[Priced]) -> Priced:
    """The earliest near-tie of the fastest that fits (in candidate order); with nothing that fits, the one of
    least memory."""
    fitting = [p for p in priced if p.fits]
    if not fitting:
        return min(priced, key=lambda p: p.memory_bytes)
    fastest = min(p.iteration_time for p in fitting)
    return next(p for p in fitting if p.iteration_time <= fastest * (1 + TIE))


def fixed_choice(request: LayoutRequest, inputs: Optional[Dict[str, str]] = None) -> LayoutChoice:
    """The choice when every knob is given (nothing priced)."""
    layout = replace(TawPipeLayout(), **{k: v for k, v in asdict(request).items() if v is not None})
    return LayoutChoice(layout, [], dict(inputs or {}), 0.0, request)


def _given(request: LayoutRequest) -> str:
    given = [f"{k}={v}" for k, v in asdict(request).items() if v is not None]
    return ", ".join(given) or "none"
