"""Layers over pipeline stages and weight-pipeline shards when they do not divide: which split the
advisor tries and the ``pretrain_llama.py`` flags (Megatron-LM's) that ask for it.

* Weight passing (tawpipe, weipipe): the runtime's default split
  (:func:`megatron_tawpipe.common.layer_split.default_layer_split`: the first ``L mod P`` shards one
  layer more) needs no flag. With shard 0 replicated in every group, the replicated shard is made one
  of the smaller ones, ``--decoder-first-pipeline-num-layers floor(L/P)``: its state lives on one rank
  per group and its gradient is all-reduced between groups (:func:`weight_passing_split`).
* Megatron pipelines (1f1b, pp-nodes): megatron-core's uneven stages, as Megatron-LM users run them:
  ``--decoder-first-pipeline-num-layers`` and/or ``--decoder-last-pipeline-num-layers``, the middle
  stages sharing the rest equally (megatron-core's rule), or ``--pipeline-model-parallel-layout`` with
  the default split where megatron-core's rule cannot balance the stages (40 layers on 24 stages: the
  first and last stages would hold 18 layers between them). The advisor times the best candidates
  (the slowest stage sets the pace; the output layer runs on the last stage) and takes the fastest
  (:func:`native_pipeline_split`).
* Interleaved pipelines: ``--pipeline-model-parallel-layout`` with the default split over the
  ``pp x vp`` virtual stages (megatron-core's layout string).

Pure arithmetic (no torch).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from megatron_tawpipe.common.layer_split import default_layer_split, first_last_layer_split

FIRST, LAST, LAYOUT = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                       "--pipeline-model-parallel-layout")


def split_label(split: Sequence[int]) -> str:
    """Run-length form of a split, in layer order: ``(10, 11, 11)`` -> ``10+11x2``."""
    runs: List[List[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "+".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def layout_string(split: Sequence[int]) -> str:
    """megatron-core's ``--pipeline-model-parallel-layout`` for decoder layers ``split`` per (virtual)
    stage in layer order: the embedding with the first, the loss with the last, runs of equal middle
    stages repeated: ``(3, 3, 3, 2)`` -> ``Et*3|(t*3|)*2t*2L``."""
    def layers(n: int) -> str:
        return "t" if n == 1 else f"t*{n}"

    if len(split) == 1:
        return "E" + layers(split[0]) + "L"
    out = "E" + layers(split[0]) + "|"
    middle = list(split[1:-1])
    i = 0
    while i < len(middle):
        j = i
        while j < len(middle) and middle[j] == middle[i]:
            j += 1
        out += f"({layers(middle[i])}|)*{j - i}" if j - i > 1 else layers(middle[i]) + "|"
        i = j
    return out + layers(split[-1]) + "L"


def pipeline_time_bound(works: Sequence[float], pipeline_size: int, microbatches: int) -> float:
    """A lower bound on one pipeline's time with free communication: ``works[k]`` is virtual stage
    ``k``'s forward + backward time per micro-batch (layer order; rank ``k mod p`` runs it), ``m``
    micro-batches. Rank ``r`` runs ``m`` times its stages' work; its first forward waits for virtual
    stages ``0..r-1`` of the first micro-batch and its last backward (chunk 0 of the last micro-batch)
    is followed by theirs: ``T >= max_r (m W_r + sum_{j<r} works[j])``. Equal stages: ``(V m + p - 1) w``,
    1F1B's and interleaved 1F1B's closed forms."""
    p, m = pipeline_size, microbatches
    per_rank = [sum(works[r::p]) for r in range(p)]
    return max(m * per_rank[r] + sum(works[:r]) for r in range(p))


def stage_works(split: Sequence[int], layer_work: float, head_work: float) -> List[float]:
    """Forward + backward time per micro-batch of each virtual stage: its layers, and the output
    layer on the last one."""
    works = [n * layer_work for n in split]
    works[-1] += head_work
    return works


def first_last_options(num_layers: int, pipeline_size: int) -> List[Tuple[Tuple[int, ...], List[str]]]:
    """Every split megatron-core builds from ``--decoder-first/last-pipeline-num-layers`` (the middle
    stages share the rest equally), with its flags."""
    L, p = num_layers, pipeline_size
    out = []
    if p < 2:
        return out
    for first in [None] + list(range(1, L)):
        for last in [None] + list(range(1, L)):
            if first is None and last is None:
                continue
            try:
                split = first_last_layer_split(L, p, first, last, even_middle=True)
            except ValueError:
                continue
            flags = ([FIRST, str(first)] if first is not None else []) + \
                    ([LAST, str(last)] if last is not None else [])
            out.append((split, flags))
    return out


def native_pipeline_split(num_layers: int, pipeline_size: int, virtual_stages: int, layer_work: float,
                          head_work: float, microbatches: int,
                          evaluate: Optional[Callable[[Tuple[int, ...]], float]] = None,
                          shortlist: int = 8) -> Tuple[Optional[Tuple[int, ...]], List[str]]:
    """(split, flags) of a megatron pipeline whose stages the layers do not divide; (None, []) when
    they divide (megatron-core's even split, no flag). 1F1B: megatron-core's first/last-stage splits
    and the layout of the default split, ranked by the slowest stage's work, then by
    :func:`pipeline_time_bound`; with ``evaluate(split)`` (the advisor's simulation of the pipeline
    with free links) the ``shortlist`` best of them and the layout are timed and the fastest is taken.
    Ties go to the least activation memory (layers x micro-batches in flight on the fullest stage),
    then to the first/last flags, which Megatron-LM users give most."""
    L, p, V, m = num_layers, pipeline_size, virtual_stages, microbatches
    if L % (p * V) == 0:
        return None, []
    default = default_layer_split(L, p * V)
    layout = (default, [LAYOUT, layout_string(default)])
    if V > 1:
        return layout

    def memory(option) -> tuple:
        split, flags = option
        in_flight = max(n * min(p - r, m) for r, n in enumerate(split))
        return (in_flight, flags[0] == LAYOUT, len(flags), flags)

    def rough(option) -> tuple:
        works = stage_works(option[0], layer_work, head_work)
        return (round(max(works), 12), round(pipeline_time_bound(works, p, m), 12)) + memory(option)

    options = sorted(first_last_options(L, p) + [layout], key=rough)
    if evaluate is None:
        return options[0]
    short = options[:shortlist] + ([layout] if layout not in options[:shortlist] else [])
    return min(short, key=lambda option: (round(evaluate(option[0]), 9),) + memory(option))


def weight_passing_split(num_layers: int, shards: int, replicate_first: bool
                         ) -> Tuple[Optional[Tuple[int, ...]], List[str]]:
    """(split, flags) of a weight pipeline whose shards the layers do not divide; (None, []) when
    they divide. The runtime's default split needs no flag; with the first shard replicated the
    smaller shard size goes first (``--decoder-first-pipeline-num-layers``)."""
    L, P = num_layers, shards
    if L % P == 0:
        return None, []
    if replicate_first and P > 1:
        small = L // P
        return first_last_layer_split(L, P, first=small), [FIRST, str(small)]
    return default_layer_split(L, P), []
