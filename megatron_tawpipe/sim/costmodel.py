"""Cost model: how long compute takes and how fast links are.

Compute times are per layer and per micro-batch, either derived from FLOPs
(``CostModel.from_flops``) or measured (``CostModel.with_measured`` reading a
JSON file).  A shard's time is its number of layers times the layer time; the last shard
also runs the head (final norm + output layer + loss).

Links come in two classes: ``intra`` (inside a group/node, e.g. NVLink) and
``inter`` (between groups, e.g. Ethernet/IB).  Each node has one inter-group
link per direction, shared by all concurrent flows of its ranks.

Weight/gradient transfers move one shard in the compute dtype:
``shard_bytes = params_per_layer * shard_layers[s] * dtype_bytes`` (a buffer holds the
largest shard) with
``params_per_layer = 12 H^2`` (Llama-style layer with ffn = 8H/3, no norms) or,
when the FFN size is given, ``4 H^2 + 3 H ffn + 2 H`` exactly (the latter with
grouped-query attention shrinking the K/V projections when ``num_query_groups``
is given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Optional

# Rates and times as text (``--inter-bw 25Gbit/s``, ``--inter-latency 20us``); megatron_tawpipe.sim exports them.
from megatron_tawpipe.common.units import parse_rate, parse_time


@dataclass(frozen=True)
class Link:
    bandwidth: float          # bytes/s (inf = free)
    latency: float = 0.0      # s per message

    def time(self, nbytes: float) -> float:
        return self.latency + (0.0 if self.bandwidth == float("inf") else nbytes / self.bandwidth)


# The measured-times JSON (tools/calibrate.py writes it): seconds per layer and micro-batch,
# plus descriptive keys that say where the figures come from.
MEASURED_TIME_KEYS = ("layer_forward", "layer_backward", "layer_recompute", "head_forward", "head_backward")
# Bytes measured on the device (tools/calibrate.py --measure-activations): what one decoder layer keeps for
# its backward per micro-batch (autograd's saved tensors, weights excluded), for the memory model.
MEASURED_MEMORY_KEYS = ("layer_activation_bytes",)
MEASURED_INFO_KEYS = ("comment", "device", "source", "attention", "dtype", "hidden_size", "seq_length",
                      "micro_batch_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


#: --backend of the simulator: what the analytic strategies assume of the library collectives.
BACKENDS = {
    "nccl": "GPUs: FSDP2's gathers and reductions and megatron's bucket reductions run on side CUDA "
            "streams and overlap compute as the strategy models say",
    "gloo": "the CPU (the emulated cluster): FSDP2 issues every all-gather, reduce-scatter and HSDP "
            "all-reduce as a blocking call (its overlap lives in CUDA streams), and its gloo "
            "reduce-scatter moves an all-reduce's bytes; megatron with more than one distributed-"
            "optimizer instance reduces each bucket synchronously; one instance's reductions are "
            "asynchronous gloo work and still overlap; two ranks exchanging large messages both ways "
            "at once on one group take turns beyond the first 256 KiB of each (GLOO_PAIR_DUPLEX_BYTES)",
}

#: gloo point-to-point between two ranks in both directions at once on one process group (a pipeline
#: boundary's activations one way and gradients the other): the first bytes of a message flow both ways
#: at the link rate, the rest takes turns with the reverse message -- each direction at half the rate.
#: Measured with ``tools/tawpipe_lab/link_duplex.py`` on the emulated cluster (1 Gbit/s, htb bucket
#: of 500 us at the rate, 2026-11-26, ``examples/results/link_duplex_1gbit.json``): both ways over one
#: pair, per direction, 0.55 of one way alone for 1 MB, 0.52 for 3 MB, 0.50-0.51 for 6.3 and 12.6 MB
#: (the model with 256 KiB: 0.58, 0.52, 0.51, 0.51). With the former 2 MiB bucket, which let a link
#: catch up after idling, the same pair measured 1.0 up to 3 MB (``link_duplex_1gbit_burst2m.json``).
#: Each direction on a process group of its own (the weight-passing runtime's point-to-point groups)
#: measured 0.89-0.95 from 3 MB up (0.72 at 1 MB): modelled as full duplex (``network.Flow.shared``).
#: NCCL's connections do not take turns (no limit on that backend).
GLOO_PAIR_DUPLEX_BYTES = 256 * 2 ** 10


def weight_store_values_per_token(hidden: float, ffn: float, kv: float) -> float:
    """Values a split backward keeps per token and decoder layer between its two passes: every linear
    layer's input (QKV, projection, FC1: ``hidden`` each; FC2: ``ffn``) and output gradient (QKV:
    ``hidden + 2 kv``, projection and FC2: ``hidden``, the gated FC1: ``2 ffn``)."""
    return (3 * hidden + ffn) + (3 * hidden + 2 * kv + 2 * ffn)


@dataclass(frozen=True)
class CostModel:
    layer_forward: float                  # s per layer per micro-batch
    layer_backward: float                 # s, backward proper
    layer_recompute: float = 0.0          # s, forward recompute before backward (0 = none)
    head_forward: float = 0.0             # s per micro-batch (last shard)
    head_backward: float = 0.0
    params_per_layer: float = 0.0
    dtype_bytes: int = 2                  # compute dtype on the wire (weights, activations)
    grad_bytes: int = 4                   # partial gradients travel and accumulate in fp32
    activation_bytes: float = 0.0         # one boundary activation of one micro-batch
    layer_activation_bytes: float = 0.0   # everything one layer keeps for backward, one mb
    # the gradients of one layer's matmul outputs, one mb (QKV, projection, gated FC1, FC2)
    layer_output_grad_bytes: float = 0.0
    # what a split backward keeps of one layer and micro-batch between its input-gradient pass and its
    # weight-gradient pass: every linear layer's input and output gradient, in the compute dtype
    layer_weight_store_bytes: float = 0.0
    tokens_per_microbatch: int = 0
    replicated_params: float = 0.0        # embedding + final norm + output layer (tied: embedding + norm)
    embedding_params: float = 0.0         # the embedding's share of them (its all-reduce part)
    # The output layer shares the word embedding (Megatron-LM's default; --untie-embeddings-and-output-
    # weights unties them): one V x H matrix among the replicated parameters, and a pipeline's first and
    # last stage all-reduce its gradient (megatron's word-embedding group).
    tied_embeddings: bool = False
    intra: Link = field(default_factory=lambda: Link(float("inf")))
    inter: Link = field(default_factory=lambda: Link(float("inf")))
    copy_bandwidth: float = float("inf")  # bytes/s of local copies (load, accumulate)
    optimizer_time_per_param: float = 0.0
    recompute: bool = True
    # How library collectives (FSDP2's, megatron's data-parallel reductions) behave: "nccl" runs them
    # on side CUDA streams, overlapping compute; "gloo" (the CPU) has no streams (see BACKENDS).
    backend: str = "nccl"
    # The rate two ranks' opposite messages take turns on (gloo; see GLOO_PAIR_DUPLEX_BYTES): the node
    # link's (None) unless ``inter`` is a share of it (pp-nodes' pipelines share a node's link).
    pair_bandwidth: Optional[float] = None
    # Where a split backward's weight-gradient kernels run. True (the runtime): BackwardInput runs the
    # recompute and the input-gradient (dgrad) half of the layers' backward and stores each linear layer's
    # input and output gradient; BackwardWeight runs the weight-gradient (wgrad) half from the store.
    # False: both halves in the input pass, the weight pass adding the held weight gradients (a runtime
    # without deferred kernels).
    deferred_weight_gradients: bool = True

    @property
    def library_collectives_block(self) -> bool:
        """Whether FSDP2's collectives and megatron's partial-DP reductions block compute (gloo)."""
        return self.backend == "gloo"

    @property
    def pair_duplex_bytes(self) -> float:
        """Bytes of a message that flow at full rate while its pair sends the other way (see
        :data:`GLOO_PAIR_DUPLEX_BYTES`); beyond them the two directions share the rate."""
        return GLOO_PAIR_DUPLEX_BYTES if self.backend == "gloo" else float("inf")

    @property
    def reduce_scatter_factor(self) -> float:
        """A library reduce-scatter's cost in ring reduce-scatters: gloo's moves an all-reduce's bytes."""
        return 2.0 if self.backend == "gloo" else 1.0

    # ------------------------------------------------------------ builders
    @classmethod
    def from_flops(cls, *, hidden_size: int, seq_length: int, micro_batch_size: int = 1,
                   ffn_hidden_size: Optional[int] = None, vocab_size: int = 32000,
                   num_attention_heads: Optional[int] = None,
                   num_query_groups: Optional[int] = None, peak_tflops: float = 312.0,
                   efficiency: float = 0.5, recompute: bool = True, causal: bool = True,
                   intra_bw="200GB/s", intra_latency="5us", inter_bw="12.5GB/s",
                   inter_latency="20us", dtype_bytes: int = 2,
                   hbm_bandwidth="2TB/s", untied_embeddings: bool = True) -> "CostModel":
        H, S, B = hidden_size, seq_length, micro_batch_size
        tokens = S * B
        ppl = params_per_layer(H, ffn_hidden_size, num_attention_heads, num_query_groups)
        matmul_params = ppl - (2 * H if ffn_hidden_size else 0)
        attn = 4 * B * S * S * H * (0.5 if causal else 1.0)   # QK^T and AV
        fwd_flops = 2 * tokens * matmul_params + attn
        rate = peak_tflops * 1e12 * efficiency
        fwd = fwd_flops / rate
        head = 2 * tokens * H * vocab_size / rate
        hbm = parse_rate(hbm_bandwidth)
        kv = H * num_query_groups // num_attention_heads if num_attention_heads and num_query_groups else H
        ffn = ffn_hidden_size or 8 * H / 3
        return cls(layer_forward=fwd, layer_backward=2 * fwd,
                   layer_recompute=fwd if recompute else 0.0,
                   head_forward=head, head_backward=2 * head, params_per_layer=ppl,
                   dtype_bytes=dtype_bytes, activation_bytes=tokens * H * dtype_bytes,
                   # ~34 bytes per token and hidden unit for a bf16 layer with flash
                   # attention (no S^2 score matrix kept).
                   layer_activation_bytes=34 * tokens * H * dtype_bytes / 2,
                   # outputs of QKV, the attention projection, the (gated) FC1 and FC2
                   layer_output_grad_bytes=tokens * (3 * H + 2 * kv + 2 * ffn) * dtype_bytes,
                   # linear inputs (QKV, projection, FC1: H each; FC2: ffn) and their output gradients
                   layer_weight_store_bytes=tokens * weight_store_values_per_token(H, ffn, kv) * dtype_bytes,
                   tokens_per_microbatch=tokens,
                   replicated_params=(2 if untied_embeddings else 1) * vocab_size * H + H,
                   embedding_params=vocab_size * H, tied_embeddings=not untied_embeddings,
                   intra=Link(parse_rate(intra_bw), parse_time(intra_latency)),
                   inter=Link(parse_rate(inter_bw), parse_time(inter_latency)),
                   copy_bandwidth=hbm / 2,
                   # Adam on fp32 master: ~16 B read + 16 B written per parameter
                   optimizer_time_per_param=32 / hbm, recompute=recompute)

    def with_measured(self, path_or_dict, micro_batch_size: Optional[int] = None,
                      seq_length: Optional[int] = None) -> "CostModel":
        """Override compute times with measured ones.  JSON keys (seconds per
        layer per micro-batch unless noted): ``layer_forward``,
        ``layer_backward`` (backward proper), ``layer_recompute``,
        ``head_forward``, ``head_backward`` (per micro-batch); any subset.
        Given the run's ``micro_batch_size`` (and ``seq_length``), times
        recorded for another micro-batch size are scaled to it
        (:func:`measured_time_scale`)."""
        if isinstance(path_or_dict, dict):
            data = path_or_dict
        else:
            with open(path_or_dict) as f:
                data = json.load(f)
        unknown = set(data) - set(MEASURED_TIME_KEYS) - set(MEASURED_MEMORY_KEYS) - set(MEASURED_INFO_KEYS)
        if unknown:
            raise ValueError(f"unknown keys in measured times: {sorted(unknown)}")
        scale = measured_time_scale(data, micro_batch_size, seq_length)   # bytes scale with the samples too
        times = {k: scale * float(v) for k, v in data.items() if k in MEASURED_TIME_KEYS + MEASURED_MEMORY_KEYS}
        if "layer_activation_bytes" in times and self.layer_activation_bytes:   # the model's other byte
            ratio = times["layer_activation_bytes"] / self.layer_activation_bytes  # terms follow it
            times["layer_output_grad_bytes"] = self.layer_output_grad_bytes * ratio
            # (the split backward's store is exact arithmetic on the shapes: it does not follow the ratio)
        if not self.recompute:  # a measured recompute time does not bring recompute back
            times.pop("layer_recompute", None)
        return replace(self, **times)

    def with_links(self, intra: Link = None, inter: Link = None) -> "CostModel":
        return replace(self, intra=intra or self.intra, inter=inter or self.inter)

    # ---------------------------------------------------------- per plan
    def replicated_part_params(self, part: str) -> float:
        """Parameters of one part of the replicated all-reduce ("all", "head", "embedding")."""
        if part == "embedding":
            return self.embedding_params
        if part == "head":
            return self.replicated_params - self.embedding_params
        return self.replicated_params

    def shard_bytes(self, plan, shard: Optional[int] = None) -> float:
        """Shard ``shard``'s weights in the compute dtype (a weight transfer); without a shard, the
        largest shard's: what a weight buffer holds."""
        return self.params_per_layer * _layers(plan, shard) * self.dtype_bytes

    def grad_shard_bytes(self, plan, shard: Optional[int] = None) -> float:
        """Shard ``shard``'s partial gradient (a gradient transfer; without a shard, the largest
        shard's: a gradient buffer): fp32, as the runtime's gradient buffers are."""
        return self.params_per_layer * _layers(plan, shard) * self.grad_bytes

    def unit_bytes(self, plan, kind: str, shard: Optional[int] = None) -> float:
        if kind == "weight":
            return self.shard_bytes(plan, shard)
        return self.grad_shard_bytes(plan, shard) if kind == "grad" else self.activation_bytes

    def forward_time(self, plan, shard: int) -> float:
        t = self.layer_forward * plan.shard_layers[shard]
        return t + (self.head_forward if shard == plan.num_shards - 1 else 0.0)

    def backward_time(self, plan, shard: int) -> float:
        t = (self.layer_backward + self.layer_recompute) * plan.shard_layers[shard]
        return t + (self.head_backward if shard == plan.num_shards - 1 else 0.0)

    def backward_input_time(self, plan, shard: int) -> float:
        """Recompute (when on), the dgrad half of the layers' backward and the head's whole backward
        (its weight gradient included); without deferred kernels the whole backward."""
        # A linear layer's input and weight gradients are one GEMM each, of the same FLOPs.
        share = 0.5 if self.deferred_weight_gradients else 1.0
        t = (self.layer_recompute + self.layer_backward * share) * plan.shard_layers[shard]
        return t + (self.head_backward if shard == plan.num_shards - 1 else 0.0)

    def backward_weight_time(self, plan, shard: int) -> float:
        """The wgrad half of the layers' backward (none without deferred kernels)."""
        if not self.deferred_weight_gradients:   # adding the held gradients, as a plain backward does: not
            return 0.0                           # priced for either
        return self.layer_backward / 2 * plan.shard_layers[shard]

    def copy_time(self, plan, shard: Optional[int] = None) -> float:
        bw = self.copy_bandwidth
        return 0.0 if bw == float("inf") else self.shard_bytes(plan, shard) / bw

    def optimizer_time(self, plan, rank: int) -> float:
        n = plan.layers_held_by(rank) * self.params_per_layer
        replicated = self.replicated_params / (plan.num_ranks if plan.options.get("sharded_replicated") else 1)
        return (n + replicated) * self.optimizer_time_per_param


def measured_time_scale(data: dict, micro_batch_size: Optional[int], seq_length: Optional[int] = None) -> float:
    """Factor from measured times (``data``: seconds per micro-batch of the ``micro_batch_size`` samples
    of ``seq_length`` tokens it records) to a micro-batch of ``micro_batch_size`` samples.

    At one sequence length a layer's work -- its matrix products and its attention, which is quadratic
    in the sequence but linear in the samples -- grows linearly with the samples of a micro-batch, so
    one file serves every micro-batch size. Times without a recorded ``micro_batch_size`` (or no run
    size given) are taken as they are. Times recorded at another ``seq_length`` are refused (ValueError):
    attention does not scale linearly with the length; calibrate at the run's length."""
    recorded_seq = data.get("seq_length")
    if seq_length is not None and recorded_seq is not None and int(recorded_seq) != int(seq_length):
        raise ValueError(f"the times were measured at seq_length {recorded_seq}, the run has {seq_length}: "
                         f"attention grows with the square of the length, so they do not carry over; "
                         f"calibrate at --seq-length {seq_length}")
    recorded = data.get("micro_batch_size")
    if micro_batch_size is None or recorded is None:
        return 1.0
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 1:
        raise ValueError(f"micro_batch_size must be a positive integer (the samples the times are for), "
                         f"got {recorded!r}")
    return micro_batch_size / recorded


def _layers(plan, shard: Optional[int]) -> int:
    """Layers of ``shard``, or of the largest shard."""
    return plan.max_layers_per_shard if shard is None else plan.shard_layers[shard]


def params_per_layer(hidden_size: int, ffn_hidden_size: Optional[int] = None,
                     num_attention_heads: Optional[int] = None,
                     num_query_groups: Optional[int] = None) -> float:
    """Weights of one Llama decoder layer (no biases)."""
    H = hidden_size
    if ffn_hidden_size is None:
        return 12.0 * H * H
    kv = H
    if num_attention_heads and num_query_groups:
        kv = H * num_query_groups // num_attention_heads
    return float(2 * H * H + 2 * H * kv + 3 * H * ffn_hidden_size + 2 * H)
