"""Build and validate every planner's plans over a range of shapes and options.

``tools/check_plans.py`` runs it; the tests run a small range.  Each plan is
checked by :func:`validate_plan`: matching, symbolic execution on gloo's
semantics, and NCCL's ordering rules in both communicator arrangements.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.connect import check_nccl_order, communicators_in_flight
from megatron_tawpipe.plan.context_parallel import lanes
from megatron_tawpipe.plan.nccl import MODES, NcclModel
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.plan.validate import validate_plan

# Every TawPipe option with the values worth checking (chunk and prefetch are
# capped by N in ``_tawpipe_options``).
TAWPIPE_OPTIONS = {
    "overlap": (True, False),
    "cache": (True, False),
    "stagger": (True, False),
    "drain": (False, True),
    "chunk": (1, 2, 3),
    "prefetch": (2, 1, 3),
    "flat": (False, True),
    "replicate_first": (False, True),
}
# The spread layout's options (every group keeps a slice of every shard; the groups run in step, so no
# stagger, and every shard is in every group, so no replicated first shard): ``tawpipe-spread`` in the sweep.
SPREAD_OPTIONS = {
    "overlap": (True, False),
    "cache": (True, False),
    "early_grads": (True, False),
    "drain": (False, True),
    "chunk": (1, 2, 3),
    "prefetch": (2, 1, 3),
    "shards_per_rank": (1, 2),
}
# TawPipe's plans with two shards per rank beside the option product (which they would double): the default
# options, and each of these changed from them.
TAWPIPE_TWO_SHARDS = ({}, {"cache": False}, {"overlap": False}, {"replicate_first": True}, {"chunk": 2},
                      {"stagger": False}, {"drain": True})


@dataclass
class SweepResult:
    checked: int = 0
    by_schedule: dict = field(default_factory=dict)
    failures: List[Tuple[str, dict, str]] = field(default_factory=list)
    # Stricter readings, reported, not required (``report=True``), by schedule: plans that would hang
    # under lazy connection without the executor's warm-up (group mode), and plans that run with
    # every operation of a GPU in one issue order across its communicators ("device" mode).
    hang_without_warmup: dict = field(default_factory=dict)
    device_order_ok: dict = field(default_factory=dict)
    most_in_flight: dict = field(default_factory=dict)    # communicators in flight at once on one rank
    # TawPipe's plans by shard cache and scheduling groups: {"cache on, D > 4": [checked, failed], ...}
    tawpipe_cache: dict = field(default_factory=dict)
    # With context-parallel sizes: weight-passing plans (one owner per shard: the spread layout does not run with
    # context parallelism) whose per-GPU plans were checked too, by size: {C: count}
    context_parallel: dict = field(default_factory=dict)


def tawpipe_cache_class(kwargs: dict) -> str:
    """A TawPipe case's shard cache and scheduling groups as the sweep counts them."""
    groups = kwargs.get("groups", kwargs["num_groups"])
    return f"cache {'on' if kwargs.get('cache', groups <= 4) else 'off'}, D {'> 4' if groups > 4 else '<= 4'}"


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tawpipe_options(N: int, D: int, full: bool) -> Iterator[dict]:
    """Option sets: the whole product when ``full``, else each option changed
    on its own from the default, plus the named variants (no overlap, flat, paper);
    ``replicate_first`` only where there are 2 or more groups (not flat)."""
    names = list(TAWPIPE_OPTIONS)
    default = {k: v[0] for k, v in TAWPIPE_OPTIONS.items()}
    if full:
        combos = [dict(zip(names, values)) for values in itertools.product(*TAWPIPE_OPTIONS.values())]
    else:
        combos = [default] + [dict(default, **{k: v}) for k, values in TAWPIPE_OPTIONS.items()
                              for v in values[1:]]
        combos += [dict(default, cache=False, drain=True),            # tawpipe-paper
                   dict(default, overlap=False, cache=False)]
    combos += [dict(default, shards_per_rank=2, **change) for change in TAWPIPE_TWO_SHARDS]
    seen = set()
    for c in combos:
        c = dict(c, chunk=min(c["chunk"], N))
        key = tuple(sorted(c.items()))
        if key in seen:
            continue
        seen.add(key)
        flat = c.pop("flat")
        if c["replicate_first"] and (flat or D < 2):
            continue
        if not c["replicate_first"]:
            del c["replicate_first"]
        if flat:
            c["groups"] = 1
        yield c


SPLITS = ("even", "uneven")


SWEPT = ("tawpipe", "tawpipe-spread", "weipipe", "weipipe-naive", "weipipe-zb1", "weipipe-zb2", "tawpipe-zb", "weipipe-interleave-zb",
         "weipipe-zb1-paired", "gpipe", "1f1b", "interleaved")


def plan_cases(ranks: Sequence[int], microbatches: Sequence[int], full_product_max_ranks: int = 8,
               layers_per_shard: int = 1, splits: Sequence[str] = SPLITS,
               schedules: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, dict]]:
    """(schedule, build_plan keyword arguments) for every planner (or those of ``schedules``, names of
    :data:`SWEPT`), shape, option set and shard split: ``"even"``, every shard (stage) ``layers_per_shard``
    layers; ``"uneven"``, half of the shards (rounded up, the first ones) one layer more, the default split
    of that many layers."""
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown shard splits {sorted(unknown)}; known: {', '.join(SPLITS)}")
    unknown = set(schedules or ()) - set(SWEPT)
    if unknown:
        raise ValueError(f"unknown schedules {sorted(unknown)}; swept: {', '.join(SWEPT)}")
    for schedule, kwargs in _even_cases(ranks, microbatches, full_product_max_ranks, layers_per_shard):
        if schedules and schedule not in schedules:
            continue
        if "even" in splits:
            yield schedule, kwargs
        if "uneven" in splits:
            stages = kwargs["num_ranks"] * kwargs.get("virtual_stages", 1) * kwargs.get("shards_per_rank", 1)
            yield schedule, dict(kwargs, num_layers=kwargs["num_layers"] + (stages + 1) // 2)


def _spread_options(N: int, D: int, full: bool) -> Iterator[dict]:
    """The spread layout's option sets (two or more groups): the whole product when ``full``, else each
    option changed on its own from the default."""
    if D < 2:
        return
    names = list(SPREAD_OPTIONS)
    if full:
        combos = [dict(zip(names, values)) for values in itertools.product(*SPREAD_OPTIONS.values())]
    else:
        default = {k: v[0] for k, v in SPREAD_OPTIONS.items()}
        combos = [default] + [dict(default, **{k: v}) for k, values in SPREAD_OPTIONS.items() for v in values[1:]]
    seen = set()
    for c in combos:
        c = dict(c, chunk=min(c["chunk"], N), ownership="spread")
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            if c["shards_per_rank"] == 1:
                del c["shards_per_rank"]
            yield c


def build_case(schedule: str, kwargs: dict):
    """The plan of one sweep case (``tawpipe-spread``: TawPipe's planner, ``ownership`` in ``kwargs``)."""
    return build_plan("tawpipe" if schedule == "tawpipe-spread" else schedule, **kwargs)


def _even_cases(ranks: Sequence[int], microbatches: Sequence[int], full_product_max_ranks: int,
                layers_per_shard: int) -> Iterator[Tuple[str, dict]]:
    for P in ranks:
        for D in divisors(P):
            for N in microbatches:
                shape = dict(num_ranks=P, num_groups=D, num_microbatches=N,
                             num_layers=P * layers_per_shard)
                for opts in _tawpipe_options(N, D, full=P <= full_product_max_ranks):
                    here = dict(shape, num_layers=P * layers_per_shard * opts.get("shards_per_rank", 1))
                    yield "tawpipe", dict(here, **opts)
                    yield "tawpipe-zb", dict(here, **opts)     # the same plans with deferred weight passes
                for opts in _spread_options(N, D, full=P <= full_product_max_ranks):
                    here = dict(shape, num_layers=P * layers_per_shard * opts.get("shards_per_rank", 1))
                    yield "tawpipe-spread", dict(here, **opts)
                for interleave, overlap in itertools.product((True, False), (True, False)):
                    name = "weipipe" if interleave else "weipipe-naive"
                    yield name, dict(shape, overlap=overlap)
                for overlap in (True, False):
                    yield "weipipe-interleave-zb", dict(shape, overlap=overlap)
                for name in ("weipipe-zb1", "weipipe-zb2"):
                    for overlap in (True, False):
                        yield name, dict(shape, overlap=overlap)
                if P % 2 == 0:     # the paired layout needs an even ring
                    for overlap in (True, False):
                        yield "weipipe-zb1-paired", dict(shape, overlap=overlap)
                for name in ("gpipe", "1f1b"):
                    yield name, dict(shape)
                yield "interleaved", dict(shape, num_layers=P * 2, virtual_stages=2)


def run_sweep(ranks: Sequence[int], microbatches: Sequence[int], full_product_max_ranks: int = 8,
              stop_on_failure: bool = False, progress=None, splits: Sequence[str] = SPLITS,
              report: bool = False, schedules: Optional[Sequence[str]] = None,
              context_parallel: Sequence[int] = ()) -> SweepResult:
    """``context_parallel``: sizes C > 1 at which each weight-passing plan with one owner per shard is checked
    again as virtual ranks of C context-parallel members (what ``validate_plan(..., context_parallel=C)`` adds)."""
    result = SweepResult()
    for schedule, kwargs in plan_cases(ranks, microbatches, full_product_max_ranks, splits=splits,
                                       schedules=schedules):
        error: Optional[str] = None
        try:
            plan = build_case(schedule, kwargs)
            validate_plan(plan)
            if plan.family == "weight" and plan.ownership == "owner":
                for size in (c for c in context_parallel if c > 1):
                    check_nccl_order(lanes(plan, size), MODES)   # (the rest of validate_plan ran above)
                    result.context_parallel[size] = result.context_parallel.get(size, 0) + 1
            if report:
                _report(plan, schedule, result)
        except PlanError as exc:
            error = str(exc)
        result.checked += 1
        result.by_schedule[schedule] = result.by_schedule.get(schedule, 0) + 1
        if schedule == "tawpipe":
            counts = result.tawpipe_cache.setdefault(tawpipe_cache_class(kwargs), [0, 0])
            counts[0] += 1
            counts[1] += error is not None
        if error is not None:
            result.failures.append((schedule, kwargs, error))
            if stop_on_failure:
                break
        if progress is not None:
            progress(result)
    return result


def _passes(model: NcclModel) -> bool:
    try:
        model.run()
    except PlanError:
        return False
    return True


def _report(plan, schedule: str, result: SweepResult) -> None:
    if not _passes(NcclModel(plan, "group", lazy=True)):
        result.hang_without_warmup[schedule] = result.hang_without_warmup.get(schedule, 0) + 1
    result.most_in_flight[schedule] = max(result.most_in_flight.get(schedule, 0), communicators_in_flight(plan))
    if _passes(NcclModel(plan, "device")):
        result.device_order_ok[schedule] = result.device_order_ok.get(schedule, 0) + 1
