"""Tensor parallelism inside the weight pipeline, as the simulator and the advisor model it.

With ``--tensor-model-parallel-size T`` a weight-passing run is the same plan over P / T
*virtual ranks*, each a tensor-parallel group of T GPUs inside one node. The simulator
runs that plan with the cost model of one virtual rank (:func:`virtual_rank_cost`) and
turns the result back into per-GPU figures (:func:`per_gpu_result`):

* compute: each GPU does 1/T of every layer's and of the output layer's work, plus
  megatron's tensor-parallel collectives, which sit on the critical path (no overlap
  with compute is assumed), counted in ring all-reduces of the hidden state over the
  node's links (an all-gather and a reduce-scatter move one all-reduce's bytes): per
  decoder layer and micro-batch, under ``--sequence-parallel`` (the advisor's commands
  with T > 1, and the default here), 2 in the forward, 3 in the backward and 2 in a
  recompute (:data:`SEQUENCE_PARALLEL_COLLECTIVES`, with megatron-core's source lines);
  without it 2, 2 and 2 all-reduces; one for the output layer each way;
* weight and gradient transfers: a virtual rank's shard leaves as T slices, one per
  GPU, each on its own link inside the node (T times one GPU's bandwidth) and all
  through the node's link between nodes (its bandwidth, unchanged): the plan's bytes
  between nodes are those of T = 1;
* memory per GPU: 1/T of the virtual rank's (weights, gradients, optimizer state and
  buffers are sliced; activations and logits too, under ``--sequence-parallel``, which
  the advisor always uses with T > 1); tokens/s per GPU: 1/T of the virtual rank's.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import TERMS, MemoryBreakdown

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
#: Tensor-parallel collectives of the hidden state per decoder layer and micro-batch under
#: ``--sequence-parallel``, in all-reduces' bytes (an all-gather + a reduce-scatter = 1). Each layer has
#: two column-parallel linears (QKV, FC1) and two row-parallel ones (attention output, FC2); megatron-core
#: 0.16.1, megatron/core/tensor_parallel/:
#:
#: * forward, 2: a column-parallel linear all-gathers its sequence-sharded input
#:   (layers.py:483, LinearWithGradAccumulationAndAsyncCommunication.forward,
#:   ``dist_all_gather_func(all_gather_buffer, input, group=tp_group)``), a row-parallel one
#:   reduce-scatters its output (layers.py:1290, ``reduce_scatter_to_sequence_parallel_region``):
#:   2 all-gathers + 2 reduce-scatters;
#: * backward, 3: the row-parallel reduce-scatter's backward all-gathers the output gradient
#:   (mappings.py:373, _ReduceScatterToSequenceParallelRegion.backward, ``_gather_along_first_dim``);
#:   the column-parallel linear all-gathers its input again for the weight gradient (layers.py:522,
#:   LinearWithGradAccumulationAndAsyncCommunication.backward, ``handle = dist_all_gather_func(
#:   all_gather_buffer, input, group=tp_group, async_op=True)``; the forward kept only its shard) and
#:   reduce-scatters the input gradient (layers.py:555, ``handle = dist_reduce_scatter_func(
#:   sub_grad_input, grad_input, group=tp_group, async_op=True)``): 4 all-gathers + 2 reduce-scatters;
#: * recompute, 2: the forward again.
SEQUENCE_PARALLEL_COLLECTIVES = {"forward": 2, "backward": 3, "recompute": 2}
#: Without sequence parallelism: the row-parallel linears all-reduce their outputs in the forward
#: (layers.py:1294, ``reduce_from_tensor_model_parallel_region``), the column-parallel ones their input
#: gradients in the backward (layers.py:544, ``torch.distributed.all_reduce(grad_input, ...)``).
ALL_REDUCES_PER_LAYER = {"forward": 2, "backward": 2, "recompute": 2}


def collectives_per_layer(sequence_parallel: bool = True) -> dict:
    """Tensor-parallel collectives per decoder layer and micro-batch, in all-reduces' bytes."""
    return SEQUENCE_PARALLEL_COLLECTIVES if sequence_parallel else ALL_REDUCES_PER_LAYER


def all_reduce_time(link: Link, nbytes: float, n: int) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks on ``link``."""
    if n <= 1:
        return 0.0
    bandwidth = 0.0 if link.bandwidth == float("inf") else 2 * (n - 1) / n * nbytes / link.bandwidth
    return 2 * (n - 1) * link.latency + bandwidth


def virtual_rank_cost(cost: CostModel, tp: int, sequence_parallel: bool = True) -> CostModel:
    """The cost model of one virtual rank of ``tp`` GPUs (see the module docstring)."""
    if tp == 1:
        return cost
    ar = all_reduce_time(cost.intra, cost.activation_bytes, tp)
    per = collectives_per_layer(sequence_parallel)
    return replace(
        cost,
        layer_forward=cost.layer_forward / tp + per["forward"] * ar,
        layer_backward=cost.layer_backward / tp + per["backward"] * ar,
        layer_recompute=(cost.layer_recompute / tp + per["recompute"] * ar) if cost.layer_recompute else 0.0,
        head_forward=cost.head_forward / tp + ar,
        head_backward=cost.head_backward / tp + ar,
        intra=Link(cost.intra.bandwidth * tp, cost.intra.latency),
        copy_bandwidth=cost.copy_bandwidth * tp,
        optimizer_time_per_param=cost.optimizer_time_per_param / tp,
    )


def tensor_parallel_bytes_per_gpu(cost: CostModel, tp: int, num_layers: int, microbatches: int,
                                  sequence_parallel: bool = True) -> float:
    """Bytes one GPU sends inside its node per iteration for tensor parallelism (ring all-reduces:
    2 (T-1)/T of the hidden state each)."""
    if tp == 1:
        return 0.0
    per = collectives_per_layer(sequence_parallel)
    per_layer = per["forward"] + per["backward"] + (per["recompute"] if cost.recompute and cost.layer_recompute else 0)
    count = microbatches * (num_layers * per_layer + 2)
    return count * 2 * (tp - 1) / tp * cost.activation_bytes


def per_gpu_breakdown(memory: MemoryBreakdown, tp: int) -> MemoryBreakdown:
    """A virtual rank's memory, per GPU: every term / T."""
    if tp == 1:
        return memory
    out = MemoryBreakdown(notes=dict(memory.notes))
    for term in TERMS:
        setattr(out, term, getattr(memory, term) / tp)
        note = out.notes.get(term, "")
        out.notes[term] = f"({note}) / {tp} tensor-parallel GPUs" if note else f"/ {tp} tensor-parallel GPUs"
    return out


def per_gpu_result(result, tp: int, cost: CostModel, num_layers: int, microbatches: int):
    """A virtual-rank simulation result as per-GPU figures (tokens/s, memory), in place; the
    tensor-parallel bytes inside the node are recorded in ``options``."""
    if tp == 1:
        return result
    result.tokens_per_sec_per_rank /= tp
    for name in ("weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes", "state_bytes"):
        setattr(result, name, getattr(result, name) / tp)
    result.options["tensor_model_parallel_size"] = tp
    result.options["tensor_parallel_bytes_per_gpu"] = tensor_parallel_bytes_per_gpu(cost, tp, num_layers,
                                                                                     microbatches)
    breakdown = result.options.get("memory_breakdown")
    if breakdown is not None:
        result.options["memory_breakdown"] = per_gpu_breakdown(MemoryBreakdown.from_dict(breakdown), tp).as_dict()
    return result


def tensor_parallel_problem(tp: int, ranks_per_node: int, heads: int, query_groups: int, ffn: int) -> str:
    """Why tensor parallelism of size ``tp`` cannot run ("" when it can): megatron-core's and the
    runtime's rules (the group inside one node; heads, query groups and FFN size divisible)."""
    if ranks_per_node % tp:
        return f"T={tp} does not divide the {ranks_per_node} GPUs of a node"
    for name, value in (("attention heads", heads), ("query groups", query_groups), ("FFN size", ffn)):
        if value % tp:
            return f"T={tp} does not divide the {value} {name}"
    return ""
