"""What the analytic strategies' collectives cost (:mod:`megatron_tawpipe.sim.strategies`,
:mod:`megatron_tawpipe.sim.pipelines`): ring times, and how much of a per-bucket collective the
compute beside it cannot hide.

* A ring reduce-scatter or all-gather over ``n`` ranks: ``(n-1)/n * bytes / bandwidth + (n-1) *
  latency`` (an all-reduce twice that); a ring over ranks in several nodes runs at the node link's
  bandwidth.
* Two ranks' all-reduce (:func:`pair_allreduce_time`): both ring steps send both ways at once on
  one pair, which gloo's connections take in turns beyond their first bytes.
* Buckets (:func:`exposed`): megatron's ``overlap_grad_reduce`` / ``overlap_param_gather`` and
  FSDP's per-unit collectives move a model's parameters in buckets of about one decoder layer (the
  granularity every model here prices: one bucket or unit per layer). A reduce-scatter bucket starts
  once its layers' backward ran, so the last one -- after the last layer's backward -- has nothing
  left to hide behind; a parameter all-gather bucket must arrive before its layers' forward, so the
  first one -- before the first layer's forward -- cannot hide either. With ``n`` equal buckets
  running one after another beside ``n`` equal slices of compute (the collective's ``T_comm``, the
  compute's ``T_compute``) the collective ends ``max(T_comm / n, T_comm - T_compute (n-1)/n)``
  after the compute (reduce-scatter) or delays it by as much (all-gather): one bucket when the
  links keep up, the excess over the other buckets' compute when they do not.
"""

from __future__ import annotations

from megatron_tawpipe.sim.costmodel import CostModel, Link

INF = float("inf")


def ring_time(link: Link, nbytes: float, n: int, factor: float = 1.0) -> float:
    """Time of a ring reduce-scatter / all-gather of ``nbytes`` over ``n`` ranks (factor 2: all-reduce)."""
    if n <= 1:
        return 0.0
    bw = 0.0 if link.bandwidth == INF else (n - 1) / n * nbytes / link.bandwidth
    return factor * ((n - 1) * link.latency + bw)


def pair_allreduce_time(cost: CostModel, nbytes: float, link: Link, flows: int = 1) -> float:
    """Time of an all-reduce of ``nbytes`` between two ranks (a pipeline's first and last stage: the tied
    word embedding's gradient). gloo's ring of two members runs a reduce-scatter and an all-gather step,
    each sending ``nbytes / 2`` both ways at once on one pair: ``flows`` such pairs share ``link`` (a
    node's link, per direction), and beyond :attr:`CostModel.pair_duplex_bytes` of a message the two
    directions take turns on the pair's rate (``cost.pair_bandwidth``, default the link's)."""
    if link.bandwidth == INF:
        return 2 * link.latency
    half = nbytes / 2
    rate = link.bandwidth / max(1, flows)
    free = min(half, cost.pair_duplex_bytes)
    turns = min(rate, (cost.pair_bandwidth or link.bandwidth) / 2)   # the rest, each direction
    return 2 * (link.latency + free / rate + (half - free) / turns)


def exposed(t_comm: float, t_compute: float, buckets: int) -> float:
    """What a collective of ``buckets`` equal buckets adds to the iteration beside ``t_compute`` of
    compute (see the module doc): ``max(T_comm / n, T_comm - T_compute (n-1)/n)``; ``buckets = 1``:
    nothing overlaps (a blocking collective)."""
    if t_comm <= 0.0:
        return 0.0
    n = max(1, buckets)
    return max(t_comm / n, t_comm - t_compute * (n - 1) / n)


def total_params(cost: CostModel, num_layers: int) -> float:
    """Psi: the decoder layers' parameters and the replicated ones (embedding, final norm, output layer)."""
    return num_layers * cost.params_per_layer + cost.replicated_params


def per_microbatch(cost: CostModel, num_layers: int):
    """(forward, backward incl. recompute) of one micro-batch through the whole model."""
    fwd = num_layers * cost.layer_forward + cost.head_forward
    bwd = num_layers * (cost.layer_backward + cost.layer_recompute) + cost.head_backward
    return fwd, bwd
