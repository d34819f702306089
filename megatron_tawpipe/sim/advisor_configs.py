"""The advisor's inputs and candidates: the model (:class:`ModelSpec`, Llama-shaped :data:`PRESETS`),
the cluster (:class:`Cluster`), one strategy with its knobs (:class:`Config`, filled in by
:class:`megatron_tawpipe.sim.advisor.Advisor`), and :func:`enumerate_configs`, every strategy x knobs
whose shapes divide (see :mod:`megatron_tawpipe.sim.advisor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from megatron_tawpipe.arguments import LLAMA_FLAGS
from megatron_tawpipe.sim.costmodel import params_per_layer
from megatron_tawpipe.sim.layout_choice import LayoutRequest, candidate_layouts, visit_sizes  # noqa: F401
from megatron_tawpipe.sim.memory import MemoryBreakdown
from megatron_tawpipe.sim.stages import split_label, weight_passing_split
from megatron_tawpipe.sim.context_parallel import (CONTEXT_PARALLEL_SIZES, CONTEXT_PARALLEL_STRATEGIES,
                                                   MIN_TOKENS_PER_RANK, context_parallel_problem)
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

#: micro-batch sizes whose absence (not dividing the batch) is reported; larger powers of two are searched up to
#: each strategy's batch per replica (:func:`micro_batch_sizes`) without a line for those that do not divide
MICRO_BATCHES = (1, 2, 4)


def micro_batch_sizes(global_batch: int) -> List[int]:
    """Every micro-batch size the advisor tries: the powers of two up to the global batch (each strategy
    keeps those that split over its data-parallel replicas; memory stops each family at the first size
    that does not fit, :meth:`megatron_tawpipe.sim.advisor.Advisor.run`)."""
    out, b = [], 1
    while b <= global_batch:
        out.append(b)
        b *= 2
    return out


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
    status: str = "pending"                  # ok, no-fit, pruned, larger (a smaller size did not fit)
    tokens_per_sec_per_gpu: float = 0.0
    iteration_time: float = 0.0
    bubble: float = 0.0
    inter_bytes_per_node: float = 0.0
    context_parallel_bytes_per_gpu: float = 0.0   # the ring attention's bytes one GPU sends per iteration
    memory: Optional[MemoryBreakdown] = None
    trainable: Optional[bool] = True         # None: not checked against pretrain_llama.py (not listed)
    checked: bool = False
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
        if k.get("cp", 1) > 1:
            parts.append(f"cp={k['cp']}")
        if "chunk" in k:
            parts.append(f"c={k['chunk']}")
        if "cache" in k:
            parts.append("cache" if k["cache"] else "no-cache")
        if k.get("replicate_first"):
            parts.append("rep0")
        if k.get("ownership") == "spread":
            parts.append("spread")
        if k.get("shards_per_rank", 1) != 1:
            parts.append(f"x{k['shards_per_rank']}")
        if k.get("zero_bubble"):
            parts.append(f"wzb{k['zero_bubble']}")
        if k.get("plan_schedule"):
            parts.append(k["plan_schedule"])
        split = k.get("shard_layers") or k.get("stage_layers")
        if split:
            parts.append(f"[{split_label(split)}]")
        parts.append("recompute" if self.recompute else "no-recompute")
        return " ".join(parts)

    def row(self) -> dict:
        out = {"strategy": self.strategy, "knobs": dict(self.knobs, micro_batch_size=self.micro_batch_size,
                                                        recompute=self.recompute),
               "label": self.label(), "status": self.status,
               "tokens_per_sec_per_gpu": self.tokens_per_sec_per_gpu,
               "iteration_time_s": self.iteration_time, "bubble_ratio": self.bubble,
               "inter_bytes_per_node": self.inter_bytes_per_node,
               "memory_bytes": self.memory.total if self.memory else None,
               "memory_breakdown": self.memory.as_dict() if self.memory else None,
               "compute_bound_tokens_per_sec_per_gpu": self.bound, "trainable": self.trainable,
               "note": self.note, "command": self.command}
        if self.knobs.get("cp", 1) > 1:
            out["context_parallel_bytes_per_gpu"] = self.context_parallel_bytes_per_gpu
        return out


#: split-backward schedules and the schedule whose transfers they keep (their weight passes move, not their bytes)
PLAIN_TWINS = {"tawpipe-zb": "tawpipe", "weipipe-interleave-zb": "weipipe"}


def size_of(cfg: Config) -> int:
    """The samples a configuration's memory grows with: micro-batch size x micro-batches per visit."""
    return cfg.micro_batch_size * cfg.knobs.get("chunk", 1)


def plain_family_of(cfg: Config) -> tuple:
    """The family (:func:`family_of`) of a split-backward configuration's plain schedule
    (:data:`PLAIN_TWINS`); its own family for any other."""
    name = cfg.knobs.get("plan_schedule")
    if name not in PLAIN_TWINS:
        return family_of(cfg)
    knobs = {k: v for k, v in cfg.knobs.items() if k != "plan_schedule"}
    return family_of(Config(cfg.strategy, cfg.micro_batch_size, cfg.recompute, knobs))


def family_of(cfg: Config) -> tuple:
    """A configuration's knobs but its size (:func:`size_of`): its memory grows with the size."""
    knobs = sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.knobs.items()
                   if k not in ("chunk", "stage_layers", "split_flags"))
    return (cfg.strategy, cfg.recompute, tuple(knobs))


# ------------------------------------------------------------------ enumerate
#: every strategy the advisor tries, in the order its reports list them
STRATEGY_ORDER = ("distopt-node", "distopt", "hsdp", "hfsdp", "fsdp", "pp-nodes", "1f1b", "interleaved",
                  "tawpipe", "weipipe")
#: strategies whose every rank is a data-parallel rank (the global batch splits over all of them)
DATA_PARALLEL = ("distopt", "fsdp", "distopt-node", "hsdp", "hfsdp", "tawpipe", "weipipe")
PIPELINES = ("pp-nodes", "1f1b", "interleaved")


@dataclass(frozen=True)
class Absence:
    """Configurations the advisor does not try, and why: ``strategies`` (all of them when the
    reason is shared), ``what`` (which knobs: ``"T=8"``, ``"b=2"``, ``"pp=24"``; empty: the
    strategies altogether), ``reason`` (the term that fails) and ``fix`` (what would make it apply)."""
    strategies: Tuple[str, ...]
    what: str
    reason: str
    fix: str

    def line(self) -> str:
        return f"{self.what + ': ' if self.what else ''}{self.reason}; fix: {self.fix}"

    def as_dict(self) -> dict:
        return {"strategies": list(self.strategies), "what": self.what, "reason": self.reason, "fix": self.fix,
                "line": self.line()}


def enumerate_configs(model: ModelSpec, cluster: Cluster, global_batch: int,
                      runtime_knobs_only: bool = False):
    """(configs, absent): every strategy x knobs whose shapes divide, and an :class:`Absence` for
    every strategy or knob that cannot run, saying which term fails and what would fix it.
    ``runtime_knobs_only``: only knobs the runtime offers (all of those tried are, TawPipe's cache included:
    ``--tawpipe-cache on|off``).

    Every strategy is also tried with tensor parallelism inside the nodes (knob ``tp``:
    T = 2, 4, 8 where T divides the GPUs of a node, the heads, the query groups and the
    FFN size): the strategy then runs over P / T virtual ranks (see :mod:`sim.tensor_parallel`).
    The native strategies (:data:`~megatron_tawpipe.sim.context_parallel.CONTEXT_PARALLEL_STRATEGIES`) are
    also tried with context parallelism (knob ``cp``: C = 2, 4, 8, with every T of those where T x C divides
    the GPUs of a node, the sequence splits into 2C chunks and each rank keeps at least
    :data:`~megatron_tawpipe.sim.context_parallel.MIN_TOKENS_PER_RANK` tokens): over P / (T x C) virtual
    ranks (see :mod:`sim.context_parallel`).
    Layers that do not divide over the shards or stages are split unevenly
    (:mod:`megatron_tawpipe.sim.stages`)."""
    out, absent = _enumerate(model, cluster, global_batch, runtime_knobs_only, 1)
    tensor_parallel = [1]
    for tp in TENSOR_PARALLEL_SIZES[1:]:
        problem = tensor_parallel_problem(tp, cluster.per_node, model.num_attention_heads,
                                          model.num_query_groups, model.ffn_hidden_size)
        if problem:
            absent.append(Absence(STRATEGY_ORDER, f"T={tp}", problem,
                                  "a tensor-parallel size dividing the GPUs of a node, the attention heads, "
                                  "the query groups and the FFN size"))
            continue
        tensor_parallel.append(tp)
        configs, why = enumerate_at(model, cluster, global_batch, tp, 1, runtime_knobs_only)
        out += configs
        absent += why
    configs, why = _context_parallel(model, cluster, global_batch, runtime_knobs_only, tensor_parallel)
    return out + configs, _merge(absent + why)


def _context_parallel(model: ModelSpec, cluster: Cluster, global_batch: int, runtime_knobs_only: bool,
                      tensor_parallel: List[int]):
    """The native strategies with context parallelism C > 1, and TawPipe / WeiPipe (one owner per shard, no plan
    file: what the simulator prices, :mod:`.context_parallel_weights`), each with every tensor-parallel size in
    ``tensor_parallel`` that fits beside it in a node; the other strategies' absence, once."""
    out: List[Config] = []
    absent: List[Absence] = []
    native = tuple(s for s in STRATEGY_ORDER if s in CONTEXT_PARALLEL_STRATEGIES)
    others = tuple(s for s in STRATEGY_ORDER if s not in CONTEXT_PARALLEL_STRATEGIES + WEIGHT_PASSING)
    sizes = []
    for cp in CONTEXT_PARALLEL_SIZES[1:]:
        problem = context_parallel_problem(cp, 1, cluster.per_node, model.seq_length, cluster.ranks,
                                           MIN_TOKENS_PER_RANK)
        if problem:
            absent.append(Absence(native, f"C={cp}", problem,
                                  "a context-parallel size dividing the GPUs of a node, with --seq-length a multiple "
                                  f"of 2C and at least {MIN_TOKENS_PER_RANK} tokens per rank"))
            continue
        sizes.append(cp)
        for tp in tensor_parallel:
            if context_parallel_problem(cp, tp, cluster.per_node, model.seq_length, cluster.ranks):
                continue            # T x C beyond a node (or the local tokens not splitting): not a line each
            configs, why = enumerate_at(model, cluster, global_batch, tp, cp, runtime_knobs_only)
            out += configs
            for a in why:
                mine = tuple(s for s in a.strategies if s in native)
                if mine:
                    absent.append(Absence(mine, a.what, a.reason, a.fix))
    if sizes:
        absent.append(Absence(others, "C>1", "context parallelism runs under megatron's native schedules and "
                              "weight passing, not FSDP", "distopt, distopt-node, pp-nodes, 1f1b, interleaved, "
                              "tawpipe or weipipe with --context-parallel-size"))
        absent.append(Absence(WEIGHT_PASSING, "C>1 with spread, a plan file", "not priced by the simulator "
                              "inside weight passing", "tawpipe (one owner per shard) or weipipe without a plan "
                              "file"))
    return out, absent


def enumerate_at(model: ModelSpec, cluster: Cluster, global_batch: int, tp: int, cp: int,
                 runtime_knobs_only: bool = False):
    """(configs, absent) at tensor parallelism ``tp`` and context parallelism ``cp`` alone (knobs ``tp``, ``cp``
    where above 1), what :func:`enumerate_configs` tries at that T x C: every strategy with C = 1; with C > 1 the
    native strategies, and TawPipe (one owner per shard) and WeiPipe without a plan file. The sizes are
    taken as given (``--pipeline-schedule auto`` prices a run's own T and C: no rule of the search applies)."""
    if tp == 1 and cp == 1:
        return _enumerate(model, cluster, global_batch, runtime_knobs_only, 1)
    configs, why = _enumerate(model, replace(cluster, ranks=cluster.ranks // (tp * cp)), global_batch,
                              runtime_knobs_only, tp, cp)
    out = []
    for cfg in configs:
        if cp > 1 and cfg.strategy in WEIGHT_PASSING and (cfg.knobs.get("plan_schedule")
                                                          or cfg.knobs.get("ownership") == "spread"):
            continue
        if cp > 1 and cfg.strategy not in CONTEXT_PARALLEL_STRATEGIES + WEIGHT_PASSING:
            continue
        if cp > 1 and cfg.knobs.get("replicated_reduce") == "sharded":   # with context parallelism the replicated
            cfg.knobs["replicated_reduce"] = "hierarchical"              # parts' optimizer stays whole
        cfg.knobs.update({k: v for k, v in (("tp", tp), ("cp", cp)) if v > 1})
        out.append(cfg)
    return out, why


def _merge(absent: List[Absence]) -> List[Absence]:
    """One line per strategies, reason and fix, naming every knob it concerns."""
    whats: Dict[tuple, List[str]] = {}
    for a in absent:
        whats.setdefault((a.strategies, a.reason, a.fix), [])
        if a.what not in whats[(a.strategies, a.reason, a.fix)]:
            whats[(a.strategies, a.reason, a.fix)].append(a.what)
    return [Absence(key[0], "" if "" in w else ", ".join(w), key[1], key[2]) for key, w in whats.items()]


WEIGHT_PASSING = ("tawpipe", "weipipe")   # the weight-passing strategies


def _enumerate(model: ModelSpec, cluster: Cluster, global_batch: int, runtime_knobs_only: bool, tp: int,
               cp: int = 1):
    P, D, d, L = cluster.ranks, cluster.nodes, cluster.per_node, model.num_layers
    T = (f"T={tp} " if tp > 1 else "") + (f"C={cp} " if cp > 1 else "")
    if cp > 1:
        who = f"{P} groups of {tp * cp} GPUs (T={tp} x C={cp})"
    else:
        who = f"{P} tensor-parallel groups of {tp} GPUs" if tp > 1 else f"{P} GPUs"
    out, na = [], []

    def absent(strategies, what, reason, fix):
        na.append(Absence(tuple(strategies), (T + what).strip(), reason, fix))

    if D == 1:
        absent(("distopt-node", "hsdp", "hfsdp", "pp-nodes"), "", "one node: nothing to split across nodes",
               "they are distopt, fsdp and 1f1b on one node")
    if L < P:
        absent(("tawpipe", "weipipe"), "", f"--num-layers {L} < {who}: one shard per rank needs a layer each",
               f"tensor parallelism T >= {-(-cluster.ranks * tp // L)} (no more shards than layers), or fewer GPUs")
    for b in micro_batch_sizes(global_batch):
        if global_batch % b:
            if b in MICRO_BATCHES:
                absent(STRATEGY_ORDER, f"b={b}", f"global batch {global_batch} is not a multiple of micro-batch "
                       f"size {b}", f"--global-batch-size a multiple of {b}")
            continue
        mbs = global_batch // b
        if mbs % P and b in MICRO_BATCHES:
            absent(DATA_PARALLEL, f"b={b}", f"{mbs} micro-batches of {b} do not split over {who} (data parallel)",
                   f"--global-batch-size a multiple of {b * P}")
        for r in (True, False):
            def add(strategy, **knobs):
                if cp == 1 or strategy in CONTEXT_PARALLEL_STRATEGIES + WEIGHT_PASSING:
                    out.append(Config(strategy, b, r, knobs))
            if mbs % P == 0:
                for s in ("distopt", "fsdp"):
                    add(s)
                if D > 1:
                    for s in ("distopt-node", "hsdp", "hfsdp"):
                        add(s)
                if L >= P:
                    _weight_passing(add, absent, L, P, D, mbs // P, b, runtime_knobs_only, who)
            _pipelines(add, absent, L, P, D, mbs, b, who)
    return out, na


def _weight_passing(add, absent, L, P, D, N, b, runtime_knobs_only, who):
    """TawPipe and WeiPipe over P ranks with N micro-batches each: one shard per rank, the default
    split where P does not divide L (``knobs["shard_layers"]``)."""
    split, flags = weight_passing_split(L, P, False)
    layers = {"shard_layers": split, "split_flags": flags} if split else {}
    for zero_bubble in (0, 1, 2):       # --weipipe-zero-bubble
        add("weipipe", **layers, **({"zero_bubble": zero_bubble} if zero_bubble else {}))
    # split backwards run from a plan file (knobs["plan_schedule"]): deferred weight passes, WZB1 paired
    add("weipipe", **layers, plan_schedule="weipipe-interleave-zb")
    if P % 2 == 0:
        add("weipipe", **layers, plan_schedule="weipipe-zb1-paired")
    # TawPipe: c micro-batches per visit cost what a c times larger micro-batch costs, with less memory:
    # micro-batch size 1 only, with 1, 2, 4, ... micro-batches per visit up to all of a rank's (one visit
    # per shard in each direction).
    if b != 1:
        absent(("tawpipe",), f"b={b}", "not tried: c micro-batches per visit at b=1 cost what a c times "
               "larger micro-batch costs, with less memory", "c=2, 4, ... at b=1 stand for it")
        return
    for c in (2, 4):
        if N % c:
            absent(("tawpipe",), f"c={c}", f"{N} micro-batches per rank are not a multiple of {c} per visit",
                   f"--global-batch-size a multiple of {c * P} (b={b})")
    # the layouts pretrain_llama.py decides among (sim.layout_choice.candidate_layouts; the replicated parts'
    # optimizer sharded, which on NCCL moves fewer bytes than either all-reduce and holds less), so that the
    # advisor's TawPipe is the run's: each with the plan-file split-backward twin (tawpipe-zb) of one owner per
    # shard (recompute: the advisor's own knob, every configuration tried both ways)
    reduce = "sharded" if P > 1 else "hierarchical"
    for layout in candidate_layouts(LayoutRequest(replicated_reduce=reduce, recompute=True), P, D, L, [N]):
        knobs = dict(chunk=layout.microbatches_per_visit, cache=layout.cache, replicate_first=layout.replicate_first,
                     replicated_reduce=reduce)
        if layout.ownership == "spread":
            knobs["ownership"] = "spread"
        if layout.shards_per_rank != 1:
            knobs["shards_per_rank"] = layout.shards_per_rank
        split, flags = weight_passing_split(L, layout.shards_per_rank * P, layout.replicate_first)
        layers = {"shard_layers": split, "split_flags": flags} if split else {}
        add("tawpipe", **knobs, **layers)
        if layout.ownership == "owner" and layout.shards_per_rank == 1:
            add("tawpipe", **knobs, plan_schedule="tawpipe-zb", **layers)


def _pipelines(add, absent, L, P, D, mbs, b, who):
    """Megatron pipelines with stages inside nodes: sizes D, 2D, 4D, ... that divide P; uneven stages
    (``knobs["uneven"]``; the advisor chooses the split) where the size does not divide L."""
    p = D
    while p <= P:
        here = ("pp-nodes",) if p == D else ("1f1b",)
        if p == 1:          # one node: pipelines start at 2 stages
            pass
        elif P % p:
            absent(here + ("interleaved",), f"pp={p}", f"{p} stages do not divide the {who}",
                   "a pipeline size dividing the GPUs")
        elif L < p:
            absent(here + ("interleaved",), f"pp={p}", f"--num-layers {L} < {p} stages: a stage needs a layer",
                   "a smaller pipeline size")
        elif mbs % (P // p):
            if b in MICRO_BATCHES:      # larger sizes: past the search's end, no line
                absent(here + ("interleaved",), f"pp={p} b={b}", f"{mbs} micro-batches of {b} do not split over "
                       f"{P // p} pipelines (data parallel)", f"--global-batch-size a multiple of {b * (P // p)}")
        else:
            m = mbs // (P // p)
            add(here[0], pipeline_size=p, **({"uneven": True} if L % p else {}))
            for v in (2, 4):
                if L < p * v:
                    absent(("interleaved",), f"pp={p} vp={v}", f"--num-layers {L} < {p * v} virtual stages",
                           "fewer virtual stages or a smaller pipeline")
                elif m % p:
                    if b in MICRO_BATCHES:
                        absent(("interleaved",), f"pp={p} vp={v} b={b}", f"{m} micro-batches per pipeline are "
                               f"not a multiple of the pipeline size {p}", f"--global-batch-size a multiple of "
                               f"{b * (P // p) * p}")
                else:
                    add("interleaved", pipeline_size=p, virtual_stages=v,
                        **({"uneven": True} if L % (p * v) else {}))
        p *= 2


def wp_schedule(cfg: Config) -> str:
    """The plan schedule of a weight-passing configuration: its strategy, or the split-backward schedule
    its plan file holds (``knobs["plan_schedule"]``)."""
    return cfg.knobs.get("plan_schedule") or cfg.strategy


def bytes_twin(cfg: Config):
    """(schedule, options) of a plan with ``cfg``'s transfers that is cheap to build: a split-backward
    schedule's plain twin (:data:`~megatron_tawpipe.sim.advisor_configs.PLAIN_TWINS`), else ``cfg``'s own."""
    name = wp_schedule(cfg)
    return PLAIN_TWINS.get(name, name), wp_options(cfg)


def wp_options(cfg: Config) -> dict:
    options = {}
    if cfg.strategy == "tawpipe":
        options = {"chunk": cfg.knobs["chunk"], "cache": cfg.knobs["cache"]}
        if cfg.knobs.get("replicate_first"):
            options["replicate_first"] = True
        if cfg.knobs.get("ownership") == "spread":
            options["ownership"] = "spread"
        if cfg.knobs.get("shards_per_rank", 1) != 1:
            options["shards_per_rank"] = cfg.knobs["shards_per_rank"]
        if cfg.knobs.get("replicated_reduce") == "sharded":
            options["sharded_replicated"] = True
    if cfg.knobs.get("zero_bubble"):
        options["zero_bubble"] = cfg.knobs["zero_bubble"]
    if cfg.knobs.get("shard_layers"):
        options["shard_layers"] = tuple(cfg.knobs["shard_layers"])
    return options
