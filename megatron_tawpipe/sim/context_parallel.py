"""Context parallelism under the native schedules, as the simulator and the advisor model it.

With ``--context-parallel-size C`` every sequence of S tokens is cut into 2C chunks and context-parallel
rank i keeps chunks i and 2C-1-i (S/C tokens; :mod:`megatron_tawpipe.models.ring_attention`). Megatron orders
its ranks tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline, so a tensor x
context-parallel group is T x C consecutive ranks, inside one node when T x C divides the GPUs of a node
(required here: :func:`context_parallel_problem`). Like tensor parallelism (:mod:`.tensor_parallel`) such a
group is modelled as one *virtual rank* of T x C GPUs: the native strategy (``distopt``, ``distopt-node``,
``pp-nodes``, ``1f1b``, ``interleaved``; not the weight-passing schedules nor FSDP, which do not run context
parallelism) runs over P / (T x C) virtual ranks with the cost model of :func:`context_parallel_cost`, and
its figures are turned back into per-GPU ones (:func:`per_gpu_breakdown`, :func:`per_gpu_result`).

Compute, per decoder layer and micro-batch, on each GPU:

* everything but attention's score blocks (the linear layers, norms, MLP, the output layer and loss) is per
  token and splits exactly: 1/C of it (and 1/T under tensor parallelism, whose collectives move the hidden
  state of the S/C local tokens only);
* attention's share of a layer's time is taken from the FLOP model (:func:`attention_share`, the split
  :meth:`~megatron_tawpipe.sim.costmodel.CostModel.from_flops` uses: QK^T and AV, halved by the causal mask,
  beside the linear layers' 2 x tokens x weights); with the balanced split every rank computes the same
  score blocks, 1/C of the whole, in C ring steps of equal work (the first: one chunk against itself and
  the later chunk against the earlier, two causal diagonal blocks and one full block; every other step: two
  full blocks). Blocks whose keys all follow their queries are skipped; diagonal blocks are priced with
  causal kernels (half a block each: Transformer Engine's, or any flash kernel). The project's own ring
  attention computes its two diagonal blocks in full and masks them (``full_diagonal=True``: (2C+1)/(2C) of
  the score work, the first step three blocks' time);
* the ring (:func:`ring_attention_exposed`): in the forward each of the first C-1 steps sends this rank's
  current keys and values (2 x S/C x b x kv channels / T values in the compute dtype) to the next rank while
  it computes that step's blocks; the backward sends the keys and values again (C-1 times) and the fp32
  key/value-gradient accumulator (the same shape, 4 B per value) C times: the accumulator of step s travels
  while step s+1 is computed, beside step s+1's keys and values, and the last one after the last step, with
  nothing left to hide behind. A recompute (full recompute of every layer) runs the forward's ring again.
  Each step shows ``max(0, transfer time - that step's block compute)`` plus the latency of each message:
  the transfers overlap only attention's own blocks (the linear layers run before and after the ring), the
  messages of one step share the GPU's link inside the node (its bandwidth, ``CostModel.intra`` per GPU:
  the group sits in one node), and no other traffic shares the link meanwhile;
* the loss's reduction over the C ranks (a few scalars) is not priced.

Communication between virtual ranks:

* the data-parallel gradient reduction and the distributed optimizer run over the data x context-parallel
  ranks: the weights and gradients are whole on every context-parallel rank, so their rings have C times the
  virtual ranks' members, each with its whole (1/T) gradient (``context_parallel`` of
  :func:`~megatron_tawpipe.sim.strategies.simulate_distopt` and
  :func:`~megatron_tawpipe.sim.pipelines.simulate_pipeline`);
* a pipeline boundary's activation leaves as T x C slices (the local tokens, sequence-parallel over T), each on
  its own link inside the node; between nodes through the node's link, as without context parallelism.

Memory per GPU: the weights and gradients of the virtual rank / T (whole over C); its optimizer state /
(T x C) (the distributed optimizer shards over the data x context-parallel ranks: the virtual rank's share
of it is split again over its C ranks), its activations, logits and boundary buffers / (T x C) (the local
tokens). Not modelled: the ring's own buffers (the keys and values held and in flight, the fp32 gradient
accumulators: about 32 B per local token and key/value channel while a layer's backward runs) and the score
block the project's ring attention forms in the sdpa backend (b x heads x (S/2C)^2 fp32 values, where
Transformer Engine's kernels form none): the model assumes flash-style block kernels.

Tokens/s per GPU: 1/(T x C) of the virtual rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron_tawpipe.sim.costmodel import CostModel, params_per_layer
from megatron_tawpipe.sim.memory import TERMS, MemoryBreakdown
from megatron_tawpipe.sim.tensor_parallel import per_gpu_breakdown as _tensor_parallel_breakdown
from megatron_tawpipe.sim.tensor_parallel import virtual_rank_cost

CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)
#: the advisor's strategies that run ``--context-parallel-size`` (megatron's DDP / distributed optimizer, with or
#: without a pipeline); the weight-passing schedules and FSDP do not
CONTEXT_PARALLEL_STRATEGIES = ("distopt-node", "distopt", "pp-nodes", "1f1b", "interleaved")
#: the fewest tokens a context-parallel rank keeps that the advisor tries (S / C): shorter chunks make the
#: score blocks small, where the FLOP model's constant efficiency and the ring's per-step latency stop holding
MIN_TOKENS_PER_RANK = 2048
#: bytes per value of the key/value-gradient accumulator that travels the ring in the backward (fp32)
ACCUMULATOR_BYTES = 4
#: memory terms that hold the local tokens' share (the rest, weights and gradients, are whole on every rank)
PER_TOKEN_TERMS = ("optimizer", "comm_buffers", "activations", "logits")


@dataclass(frozen=True)
class AttentionShape:
    """What the ring's bytes and attention's share of a layer depend on: one micro-batch's shape."""
    seq_length: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    causal: bool = True

    @classmethod
    def of_flags(cls, args) -> "AttentionShape":
        """The shape a run's (or the simulator's) flags give: ``--seq-length``, ``--micro-batch-size``,
        ``--hidden-size``, ``--num-attention-heads``, ``--num-query-groups``, ``--ffn-hidden-size``."""
        return cls(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                   ffn_hidden_size=args.ffn_hidden_size)

    @property
    def kv_channels(self) -> float:
        """Key (or value) channels of one token: key/value heads x head size (the hidden size without
        grouped-query attention), as the FLOP model counts them."""
        H, n, g = self.hidden_size, self.num_attention_heads, self.num_query_groups
        return H * g // n if n and g else H

    def kv_bytes(self, cp: int, tp: int = 1, dtype_bytes: int = 2) -> float:
        """One ring message of keys and values: 2 x S/C x b x kv channels / T values."""
        return 2 * self.seq_length / cp * self.micro_batch_size * self.kv_channels / tp * dtype_bytes


def attention_share(shape: AttentionShape) -> float:
    """The score blocks' share (QK^T, AV) of a decoder layer's FLOPs, as
    :meth:`~megatron_tawpipe.sim.costmodel.CostModel.from_flops` counts them: ``4 b S^2 H (x 1/2 causal)``
    beside ``2 b S`` x the layer's matrix weights. Per token the ratio does not depend on the micro-batch."""
    H, S = shape.hidden_size, shape.seq_length
    ppl = params_per_layer(H, shape.ffn_hidden_size, shape.num_attention_heads, shape.num_query_groups)
    matmul = ppl - (2 * H if shape.ffn_hidden_size else 0)
    attn = 2.0 * S * H * (0.5 if shape.causal else 1.0)      # per token, / 2 as the matrix FLOPs are
    return attn / (matmul + attn)


@dataclass(frozen=True)
class RingTimes:
    """Per decoder layer and micro-batch on one GPU: the ring's exposed seconds (forward, backward,
    recompute) and its messages' bytes in each (one pass)."""
    forward: float
    backward: float
    recompute: float
    forward_bytes: float
    backward_bytes: float


def _step_blocks(cp: int, causal: bool, full_diagonal: bool):
    """Block-equivalents (one chunk x one chunk, unmasked) each of the C ring steps computes."""
    if not causal:                              # every query chunk against both key chunks
        return [4.0] * cp
    first = 3.0 if full_diagonal else 2.0       # two diagonal blocks (causal: half each) + one full block
    return [first] + [2.0] * (cp - 1)


def ring_attention_exposed(cost: CostModel, shape: AttentionShape, cp: int, tp: int = 1,
                           full_diagonal: bool = False) -> RingTimes:
    """The ring's time on the critical path per decoder layer and micro-batch (see the module docstring):
    ``cost`` is one GPU's without context or tensor parallelism (its layer times, its link inside the node)."""
    if cp == 1:
        return RingTimes(0.0, 0.0, 0.0, 0.0, 0.0)
    share = attention_share(shape)
    blocks = _step_blocks(cp, shape.causal, full_diagonal)
    # one block's share of a layer's time: the rank's score work (1/C of the layer's) is 2C blocks (causal) or 4C
    per_block = share / (tp * cp) / ((2 if shape.causal else 4) * cp)
    link = cost.intra
    bw = link.bandwidth
    kv = shape.kv_bytes(cp, tp, cost.dtype_bytes)
    dkv = shape.kv_bytes(cp, tp, ACCUMULATOR_BYTES)
    send = (lambda n: 0.0) if bw == float("inf") else (lambda n: n / bw)  # noqa: E731

    def forward(layer_time: float) -> float:
        out = 0.0
        for s in range(cp - 1):            # the last step sends nothing
            out += max(0.0, send(kv) - blocks[s] * per_block * layer_time) + link.latency
        return out

    def backward(layer_time: float) -> float:
        out = 0.0
        for s in range(cp):
            nbytes = (kv if s < cp - 1 else 0.0) + (dkv if s >= 1 else 0.0)
            messages = (s < cp - 1) + (s >= 1)
            out += max(0.0, send(nbytes) - blocks[s] * per_block * layer_time) + messages * link.latency
        return out + send(dkv) + link.latency     # the last accumulator: after the last step

    recompute = forward(cost.layer_recompute) if cost.recompute and cost.layer_recompute else 0.0
    return RingTimes(forward(cost.layer_forward), backward(cost.layer_backward), recompute,
                     (cp - 1) * kv, (cp - 1) * kv + cp * dkv)


def context_parallel_cost(cost: CostModel, cp: int, shape: AttentionShape, tp: int = 1,
                          full_diagonal: bool = False) -> CostModel:
    """The cost model of one virtual rank of T x C GPUs (see the module docstring); ``cost`` is one GPU's
    without context or tensor parallelism. C = 1: tensor parallelism's
    (:func:`~megatron_tawpipe.sim.tensor_parallel.virtual_rank_cost`)."""
    if cp == 1:
        return virtual_rank_cost(cost, tp)
    share = attention_share(shape)
    scores = (2 * cp + 1) / (2 * cp) if full_diagonal and shape.causal else 1.0
    local = (1.0 - share + share * scores) / cp              # a layer's work left on one context-parallel rank
    ring = ring_attention_exposed(cost, shape, cp, tp, full_diagonal)
    tokens = replace(cost, layer_forward=cost.layer_forward * local, layer_backward=cost.layer_backward * local,
                     layer_recompute=cost.layer_recompute * local, head_forward=cost.head_forward / cp,
                     head_backward=cost.head_backward / cp,
                     # tensor parallelism's collectives move the local tokens' hidden state
                     activation_bytes=cost.activation_bytes / cp,
                     optimizer_time_per_param=cost.optimizer_time_per_param / cp)
    v = virtual_rank_cost(tokens, tp)
    return replace(v, layer_forward=v.layer_forward + ring.forward,
                   layer_backward=v.layer_backward + ring.backward,
                   layer_recompute=(v.layer_recompute + ring.recompute) if v.layer_recompute else 0.0,
                   # the virtual rank's micro-batch, whole (memory and boundaries are turned per GPU later)
                   activation_bytes=cost.activation_bytes)


def context_parallel_bytes_per_gpu(cost: CostModel, shape: AttentionShape, cp: int, tp: int, layers: float,
                                   microbatches: float) -> float:
    """Bytes one GPU sends to its ring neighbour inside the node per iteration: every decoder layer it runs, for
    every micro-batch through it, the forward's keys and values, the backward's keys, values and fp32
    gradient accumulators, and the recompute's keys and values again (with recompute)."""
    if cp == 1:
        return 0.0
    ring = ring_attention_exposed(cost, shape, cp, tp)
    passes = ring.forward_bytes * (2 if cost.recompute and cost.layer_recompute else 1) + ring.backward_bytes
    return microbatches * layers * passes


def context_parallel_ring_seconds_per_gpu(cost: CostModel, shape: AttentionShape, cp: int, tp: int, layers: float,
                                          microbatches: float) -> float:
    """Seconds of one GPU's iteration the ring shows beside its attention blocks (its exposed time,
    :func:`ring_attention_exposed`): every decoder layer it runs, for every micro-batch through it, forward,
    backward and (with recompute) the recompute's ring."""
    if cp == 1:
        return 0.0
    ring = ring_attention_exposed(cost, shape, cp, tp)
    return microbatches * layers * (ring.forward + ring.backward + ring.recompute)


def per_gpu_breakdown(memory: MemoryBreakdown, tp: int, cp: int = 1) -> MemoryBreakdown:
    """A virtual rank's memory, per GPU: weights and gradients / T, the other terms / (T x C)."""
    if cp == 1:
        return _tensor_parallel_breakdown(memory, tp)
    out = MemoryBreakdown(notes=dict(memory.notes))
    for term in TERMS:
        div = tp * cp if term in PER_TOKEN_TERMS else tp
        setattr(out, term, getattr(memory, term) / div)
        if term in PER_TOKEN_TERMS:
            what = f"{tp} tensor- x {cp} context-parallel GPUs" if tp > 1 else f"{cp} context-parallel GPUs"
        elif tp > 1:
            what = f"{tp} tensor-parallel GPUs (whole on each of {cp} context-parallel GPUs)"
        else:
            what = ""
        note = out.notes.get(term, "")
        if what:
            out.notes[term] = f"({note}) / {what}" if note else f"/ {what}"
        else:
            out.notes[term] = (f"{note} " if note else "") + f"(whole on each of {cp} context-parallel GPUs)"
    return out


def per_gpu_result(result, cp: int, cost: CostModel, shape: AttentionShape, layers: float, microbatches: float,
                   tp: int = 1):
    """A virtual-rank result (a native strategy over P / (T x C) virtual ranks) as per-GPU figures, in place:
    tokens/s, the memory fields and breakdown; the ring's bytes per GPU and the context-parallel size are
    recorded in ``options`` (``layers`` and ``microbatches``: those one GPU runs per iteration)."""
    if cp == 1 and tp == 1:
        return result
    n = tp * cp
    result.tokens_per_sec_per_rank /= n
    for name in ("weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes"):
        setattr(result, name, getattr(result, name) / n)
    breakdown = result.options.get("memory_breakdown")
    if breakdown is not None:
        per_gpu = per_gpu_breakdown(MemoryBreakdown.from_dict(breakdown), tp, cp)
        result.options["memory_breakdown"] = per_gpu.as_dict()
        result.state_bytes = per_gpu.weights + per_gpu.grads + per_gpu.optimizer
    else:
        result.state_bytes /= tp
    result.options["context_parallel_size"] = cp
    if tp > 1:
        result.options["tensor_model_parallel_size"] = tp
    result.options["context_parallel_bytes_per_gpu"] = context_parallel_bytes_per_gpu(cost, shape, cp, tp, layers,
                                                                                      microbatches)
    result.options["context_parallel_ring_seconds_per_gpu"] = context_parallel_ring_seconds_per_gpu(
        cost, shape, cp, tp, layers, microbatches)
    return result


def context_parallel_problem(cp: int, tp: int, ranks_per_node: int, seq_length: int, ranks: int,
                             min_tokens: int = 0) -> str:
    """Why context parallelism of size ``cp`` (with tensor parallelism ``tp``) cannot run ("" when it can):
    the group of T x C GPUs inside one node, the sequence cut into 2C equal chunks (and the local tokens into T
    under sequence parallelism), T x C dividing the GPUs; ``min_tokens``: the fewest tokens per rank tried."""
    if cp == 1:
        return ""
    if ranks_per_node % (tp * cp):
        what = f"T x C = {tp} x {cp}" if tp > 1 else f"C={cp}"
        return f"{what} does not divide the {ranks_per_node} GPUs of a node (a context-parallel ring stays in a node)"
    if ranks % (tp * cp):
        return f"T x C = {tp * cp} does not divide the {ranks} GPUs"
    if seq_length % (2 * cp):
        return f"--seq-length {seq_length} is not divisible by {2 * cp} (C={cp} cuts it into {2 * cp} chunks)"
    if tp > 1 and (seq_length // cp) % tp:
        return f"the {seq_length // cp} tokens per context-parallel rank do not split over T={tp} (sequence parallel)"
    if seq_length // cp < min_tokens:
        return (f"C={cp} leaves {seq_length // cp} tokens per rank, fewer than the {min_tokens} the advisor tries "
                "(short chunks: the score blocks too small for the FLOP model's efficiency)")
    return ""
