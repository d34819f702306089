"""Memory per GPU: a breakdown into parameters, gradients, optimizer state,
communication buffers, activations and logits, with the arithmetic behind each
term (what ``tools/simulate.py --advise`` prints).

Assumptions (bf16 mixed precision, AdamW, as megatron runs it with ``--bf16``):

* compute-dtype weights: ``dtype_bytes`` (2) per parameter wherever a full
  compute copy is resident (DDP, the distributed optimizer, pipeline stages);
* gradient accumulators in fp32, 4 B per parameter (megatron's
  ``grad_reduce_in_fp32``, which ``--bf16`` turns on; FSDP2 with
  ``reduce_dtype=float32``), sharded where the strategy shards them.  The
  weight-passing runtime keeps the owner's main gradient in fp32 too, and its
  partial-gradient buffers (``CostModel.grad_bytes``, 4); with shards of
  different sizes every buffer holds the largest shard;
* optimizer state: fp32 master weights and two fp32 Adam moments, 12 B per
  parameter, divided over the ranks that shard it;
* activations: a layer keeps ``34 * tokens * H`` bytes for its backward in bf16
  with flash attention (no S^2 scores; Korthikanti et al.).  With full
  recompute a native strategy keeps only each layer's input (``tokens * H *
  dtype_bytes``, megatron's ``--recompute-method uniform --recompute-num-layers
  1``) plus one layer's activations while it is recomputed; the weight-passing
  runtime checkpoints whole shards (one boundary per shard, a shard's
  activations while recomputing);
* logits: the output layer's bf16 logits and the loss's fp32 copy of them,
  ``6 * tokens * vocab`` bytes for one micro-batch, on every rank that runs
  the output layer (its backward follows before the next micro-batch's);
* not modelled: the CUDA context, NCCL's own buffers, allocator
  fragmentation and temporary tensors of kernels (``--memory-reserve`` of the
  advisor keeps room for them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict

TERMS = ("weights", "grads", "optimizer", "comm_buffers", "activations", "logits")

_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text) -> float:
    """'80GB' -> 8e10 bytes, '80GiB' -> 80 * 2^30, a bare number is bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"([0-9.eE+-]+)\s*([A-Za-z]*)", text.strip())
    if not m or m.group(2).lower() not in _SIZE_UNITS and m.group(2):
        raise ValueError(f"cannot parse size {text!r} (e.g. 80GB, 80GiB)")
    return float(m.group(1)) * _SIZE_UNITS.get(m.group(2).lower() or "b")


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


@dataclass
class MemoryBreakdown:
    """Bytes per GPU by term; ``notes[term]`` says how the number was reached."""
    weights: float = 0.0        # compute-dtype weights kept resident
    grads: float = 0.0          # gradient accumulators (fp32)
    optimizer: float = 0.0      # fp32 master + two Adam moments
    comm_buffers: float = 0.0   # gathered / received weights and gradients in flight
    activations: float = 0.0    # stored for backward + the recompute working set
    logits: float = 0.0         # output layer logits + fp32 loss copy, one micro-batch
    notes: Dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(getattr(self, t) for t in TERMS)

    def dominant(self):
        """(term, bytes) of the largest term."""
        return max(((t, getattr(self, t)) for t in TERMS), key=lambda x: x[1])

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryBreakdown":
        return cls(**{t: d[t] for t in TERMS}, notes=dict(d.get("notes", {})))

    def as_dict(self) -> dict:
        out = {t: getattr(self, t) for t in TERMS}
        out["total"] = self.total
        out["notes"] = dict(self.notes)
        return out

    def lines(self) -> list:
        """One line per term, with its arithmetic."""
        out = [f"  {t:<13}{gb(getattr(self, t)):>11}   {self.notes.get(t, '')}".rstrip() for t in TERMS]
        out.append(f"  {'total':<13}{gb(self.total):>11}")
        return out


# --------------------------------------------------------------- building blocks
def hidden_size(cost) -> float:
    tokens = cost.tokens_per_microbatch
    return cost.activation_bytes / (tokens * cost.dtype_bytes) if tokens else 0.0


def logits_bytes(cost, microbatches: int = 1) -> float:
    """bf16 logits + fp32 loss copy: 6 B per token and vocabulary entry."""
    H = hidden_size(cost)
    vocab = cost.embedding_params / H if H else 0.0
    return 6.0 * cost.tokens_per_microbatch * vocab * microbatches


def _logits_note(cost, microbatches: int = 1) -> str:
    H = hidden_size(cost)
    vocab = cost.embedding_params / H if H else 0.0
    n = f" x {microbatches} micro-batches" if microbatches != 1 else ""
    return f"6 B x {cost.tokens_per_microbatch} tokens x {vocab:.0f} vocab{n}"


def native_activations(cost, layers: float, in_flight: float):
    """Activations of ``in_flight`` micro-batches through ``layers`` decoder layers
    under megatron's per-layer full recompute (or none): (bytes, note)."""
    if cost.recompute:
        stored = in_flight * layers * cost.activation_bytes
        work = cost.layer_activation_bytes
        note = (f"{in_flight:g} mb x {layers:g} layers x {gb(cost.activation_bytes)} layer input "
                f"(recompute) + 1 layer working set {gb(work)}")
        return stored + work, note
    stored = in_flight * layers * cost.layer_activation_bytes
    return stored, (f"{in_flight:g} mb x {layers:g} layers x {gb(cost.layer_activation_bytes)} "
                    "(34 B x tokens x H, no recompute)")


def replicated_state(params: float, shards: float, dtype_bytes: int, weights_sharded: bool,
                     grads_sharded: bool, opt_shards: float, label: str = "") -> MemoryBreakdown:
    """Weights, fp32 grads and optimizer state of ``params`` parameters, the
    optimizer divided over ``opt_shards`` ranks, weights/grads over ``shards``
    ranks when sharded."""
    m = MemoryBreakdown()
    w_div = shards if weights_sharded else 1
    g_div = shards if grads_sharded else 1
    p = f"{params / 1e9:.3g}e9 params{label}"
    m.weights = dtype_bytes * params / w_div
    m.notes["weights"] = f"{dtype_bytes} B x {p}" + (f" / {w_div:g}" if w_div != 1 else "")
    m.grads = 4.0 * params / g_div
    m.notes["grads"] = f"4 B (fp32) x {p}" + (f" / {g_div:g}" if g_div != 1 else "")
    m.optimizer = 12.0 * params / opt_shards
    m.notes["optimizer"] = f"12 B (master + 2 Adam moments) x {p}" + \
        (f" / {opt_shards:g}" if opt_shards != 1 else "")
    return m


# ------------------------------------------------------- plan-based schedules
def weight_passing_breakdown(result, cost, plan, microbatches_per_visit: int = 1) -> MemoryBreakdown:
    """Breakdown of a simulated weight-passing plan (tawpipe, weipipe): the same
    figures as the simulator's memory fields (their sum is ``memory_bytes``),
    split by term, plus the logits."""
    own = max(plan.layers_held_by(r) for r in range(plan.num_ranks)) * cost.params_per_layer
    rep = cost.replicated_params
    m = MemoryBreakdown()
    m.weights = cost.dtype_bytes * rep
    m.notes["weights"] = (f"{cost.dtype_bytes} B x {rep / 1e9:.3g}e9 replicated params (embedding, "
                          "output layer); the owned shards' copies are weight buffers")
    m.grads = 4.0 * (own + rep)
    m.notes["grads"] = f"4 B x ({own / 1e9:.3g}e9 owned + {rep / 1e9:.3g}e9 replicated) params"
    slices = plan.num_ranks if plan.options.get("sharded_replicated") else 1   # the replicated parts' slice
    m.optimizer = 12.0 * (own + rep / slices)
    m.notes["optimizer"] = f"12 B x ({own / 1e9:.3g}e9 + {rep / 1e9:.3g}e9" + \
        (f" / {slices} sharded" if slices > 1 else "") + ") params"
    m.comm_buffers = result.weight_buffer_bytes + result.grad_buffer_bytes
    m.notes["comm_buffers"] = (f"{result.weight_buffers} weight buffers x {gb(cost.shard_bytes(plan))} + "
                               f"{result.grad_buffers} fp32 grad buffers x {gb(cost.grad_shard_bytes(plan))} "
                               f"({_shard_sizes(plan)})")
    m.activations = result.activation_bytes
    lps = plan.max_layers_per_shard
    per = cost.activation_bytes if cost.recompute else lps * cost.layer_activation_bytes
    working = lps * cost.layer_activation_bytes if cost.recompute else 0.0
    from megatron_tawpipe.sim.plan_memory import activation_peaks

    peaks = activation_peaks(plan, cost)   # the busiest rank's peak: its stored inputs and its W store
    store = activation_peaks(plan, cost, store=True)[peaks.index(max(peaks))] if peaks else 0.0
    peak = round((result.activation_bytes - working - store) / per) if per else 0
    m.notes["activations"] = (f"{peak} stored shard inputs x {gb(per)}" +
                              (f" + weight-gradient store {gb(store)} (split backwards between their input and "
                               "weight passes: linear layers' inputs and output gradients)" if store else "") +
                              (f" + shard working set {gb(working)} (recompute)" if cost.recompute
                               else " (no recompute: whole shards' activations)"))
    visits = 1 if cost.recompute else microbatches_per_visit
    m.logits = logits_bytes(cost, visits)
    m.notes["logits"] = _logits_note(cost, visits)
    return m


def _shard_sizes(plan) -> str:
    if not plan.uneven:
        return f"shards of {plan.max_layers_per_shard} layers"
    return f"shards of {min(plan.shard_layers)} to {plan.max_layers_per_shard} layers, buffers sized to the largest"


def generic_breakdown(result, cost) -> MemoryBreakdown:
    """Breakdown of a result whose memory fields carry no finer split (the
    analytic FSDP model): state as 16 B/param + the replicated compute copy."""
    m = MemoryBreakdown()
    rep_w = cost.dtype_bytes * cost.replicated_params
    state = max(result.state_bytes - rep_w, 0.0)
    m.weights = result.state_bytes - state
    m.notes["weights"] = f"{cost.dtype_bytes} B x replicated params"
    m.grads = state / 4
    m.notes["grads"] = "4 B (fp32) per sharded param"
    m.optimizer = state * 3 / 4
    m.notes["optimizer"] = "12 B per sharded param"
    m.comm_buffers = result.weight_buffer_bytes + result.grad_buffer_bytes
    m.notes["comm_buffers"] = (f"{result.weight_buffers} gathered units + {result.grad_buffers} "
                               "unsharded gradient unit")
    m.activations = result.activation_bytes
    m.notes["activations"] = "stored unit inputs (recompute) or activations"
    m.logits = logits_bytes(cost)
    m.notes["logits"] = _logits_note(cost)
    return m


def weight_store_peak_bytes(plan, cost) -> float:
    """The most a rank's weight-gradient store holds at once (plan order only): the sum of
    :func:`~megatron_tawpipe.sim.plan_memory.weight_store_bytes` over the split backwards between their input
    and weight passes, the largest over ranks (the runtime's ``WgradStore.peak_bytes``, measured after each
    input pass)."""
    from megatron_tawpipe.sim.plan_memory import held_after_each

    return max([0.0] + [kept for acts in plan.actions for _, kept in held_after_each(plan, cost, acts)])
