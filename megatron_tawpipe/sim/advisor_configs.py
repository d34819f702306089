"""The advisor's inputs and candidates: the model (:class:`ModelSpec`, Llama-shaped :data:`PRESETS`),
the cluster (:class:`Cluster`), one strategy with its knobs (:class:`Config`, filled in by
:class:`megatron_tawpipe.sim.advisor.Advisor`), and :func:`enumerate_configs`, every strategy x knobs
whose shapes divide (see :mod:`megatron_tawpipe.sim.advisor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from megatron_tawpipe.arguments import LLAMA_FLAGS
from megatron_tawpipe.sim.costmodel import params_per_layer
from megatron_tawpipe.sim.memory import MemoryBreakdown
from megatron_tawpipe.sim.tensor_parallel import TENSOR_PARALLEL_SIZES, tensor_parallel_problem

#: Llama-shaped presets: Llama-2 7B/13B/70B, Code Llama 34B.
PRESETS = {
    "7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
               num_query_groups=32, vocab_size=32000),
    "13b": dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                num_query_groups=40, vocab_size=32000),
    "34b": dict(num_layers=48, hidden_size=8192, ffn_hidden_size=22016, num_attention_heads=64,
                num_query_groups=8, vocab_size=32000),
    "70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                num_query_groups=8, vocab_size=32000),
}

MICRO_BATCHES = (1, 2, 4)


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int

    @property
    def params(self) -> float:
        ppl = params_per_layer(self.hidden_size, self.ffn_hidden_size, self.num_attention_heads,
                               self.num_query_groups)
        return self.num_layers * ppl + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def flags(self) -> List[str]:
        out = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
               "--ffn-hidden-size", self.ffn_hidden_size, "--num-attention-heads",
               self.num_attention_heads]
        if self.num_query_groups != self.num_attention_heads:
            out += ["--group-query-attention", "--num-query-groups", self.num_query_groups]
        out += ["--vocab-size", self.vocab_size, "--untie-embeddings-and-output-weights",
                "--seq-length", self.seq_length]
        return list(LLAMA_FLAGS) + [str(x) for x in out]


@dataclass(frozen=True)
class Cluster:
    ranks: int
    nodes: int
    intra_bw: float
    inter_bw: float
    peak_tflops: float = 989.0
    efficiency: float = 0.4
    gpu_memory: float = 80e9
    memory_reserve: float = 5e9
    intra_latency: float = 5e-6
    inter_latency: float = 20e-6

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory - self.memory_reserve


@dataclass
class Config:
    strategy: str
    micro_batch_size: int
    recompute: bool
    knobs: Dict = field(default_factory=dict)
    bound: float = 0.0                       # compute-bound tokens/s per GPU
    # filled by evaluation
    status: str = "pending"                  # ok, no-fit, pruned
    tokens_per_sec_per_gpu: float = 0.0
    iteration_time: float = 0.0
    bubble: float = 0.0
    inter_bytes_per_node: float = 0.0
    memory: Optional[MemoryBreakdown] = None
    trainable: bool = True
    note: str = ""
    argv: List[str] = field(default_factory=list)
    command: str = ""

    def label(self) -> str:
        parts = [f"b={self.micro_batch_size}"]
        k = self.knobs
        if "pipeline_size" in k:
            parts.append(f"pp={k['pipeline_size']}")
        if k.get("virtual_stages", 1) > 1:
            parts.append(f"vp={k['virtual_stages']}")
        if k.get("tp", 1) > 1:
            parts.append(f"tp={k['tp']}")
        if "chunk" in k:
            parts.append(f"c={k['chunk']}")
        if "cache" in k:
            parts.append("cache" if k["cache"] else "no-cache")
        if k.get("replicate_first"):
            parts.append("rep0")
        parts.append("recompute" if self.recompute else "no-recompute")
        return " ".join(parts)

    def row(self) -> dict:
        return {"strategy": self.strategy, "knobs": dict(self.knobs, micro_batch_size=self.micro_batch_size,
                                                         recompute=self.recompute),
                "label": self.label(), "status": self.status,
                "tokens_per_sec_per_gpu": self.tokens_per_sec_per_gpu,
                "iteration_time_s": self.iteration_time, "bubble_ratio": self.bubble,
                "inter_bytes_per_node": self.inter_bytes_per_node,
                "memory_bytes": self.memory.total if self.memory else None,
                "memory_breakdown": self.memory.as_dict() if self.memory else None,
                "compute_bound_tokens_per_sec_per_gpu": self.bound, "trainable": self.trainable,
                "note": self.note, "command": self.command}


# ------------------------------------------------------------------ enumerate
def enumerate_configs(model: ModelSpec, cluster: Cluster, global_batch: int,
                      runtime_knobs_only: bool = False):
    """(configs, not_applicable): every strategy x knobs whose shapes divide, and
    one line per strategy/knob that cannot run at all, saying why.
    ``runtime_knobs_only``: TawPipe's cache only as the runtime sets it.

    Every strategy is also tried with tensor parallelism inside the nodes (knob ``tp``:
    T = 2, 4, 8 where T divides the GPUs of a node, the heads, the query groups and the
    FFN size): the strategy then runs over P / T virtual ranks (see :mod:`plan.tensor_parallel`)."""
    out, na = _enumerate(model, cluster, global_batch, runtime_knobs_only)
    for tp in TENSOR_PARALLEL_SIZES[1:]:
        if tensor_parallel_problem(tp, cluster.per_node, model.num_attention_heads, model.num_query_groups,
                                   model.ffn_hidden_size):
            continue
        configs, _ = _enumerate(model, replace(cluster, ranks=cluster.ranks // tp), global_batch,
                                runtime_knobs_only)
        for cfg in configs:
            cfg.knobs["tp"] = tp
        out += configs
    return out, na


def _enumerate(model: ModelSpec, cluster: Cluster, global_batch: int, runtime_knobs_only: bool):
    P, D, d, L = cluster.ranks, cluster.nodes, cluster.per_node, model.num_layers
    out, na = [], []
    for b in MICRO_BATCHES:
        if global_batch % b:
            continue
        mbs = global_batch // b
        for r in (True, False):
            def add(strategy, **knobs):
                out.append(Config(strategy, b, r, knobs))
            dp_ok = mbs % P == 0
            if dp_ok:
                for s in ("distopt", "fsdp"):
                    add(s)
                if D > 1:
                    for s in ("distopt-node", "hsdp", "hfsdp"):
                        add(s)
                if L % P == 0:
                    N = mbs // P
                    add("weipipe")
                    # TawPipe: b micro-batches per visit cost what a b times larger
                    # micro-batch costs, with less memory: micro-batch size 1 only.
                    for c in (1, 2, 4) if b == 1 else ():
                        if N % c == 0:
                            for cache in ((D <= 4,) if runtime_knobs_only else (True, False)):
                                for rep in (False, True) if D > 1 else (False,):
                                    add("tawpipe", chunk=c, cache=cache, replicate_first=rep)
            p = D
            while p <= P:
                if P % p == 0 and L % p == 0 and mbs % (P // p) == 0:
                    m = mbs // (P // p)
                    if p > 1:
                        add("pp-nodes" if p == D else "1f1b", pipeline_size=p)
                    for v in (2, 4):
                        if p > 1 and L % (p * v) == 0 and m % p == 0:
                            add("interleaved", pipeline_size=p, virtual_stages=v)
                p *= 2
    if global_batch % P:
        na.append(f"data-parallel strategies: global batch {global_batch} is not a multiple of {P} ranks")
    if L % P:
        na.append(f"tawpipe, weipipe: --num-layers {L} is not divisible by {P} ranks (one shard per rank)")
    if D == 1:
        na.append("hsdp, distopt-node, hfsdp, pp-nodes: one node (D = 1)")
    elif L % D:
        na.append(f"pp-nodes: --num-layers {L} is not divisible by {D} nodes")
    return out, na
