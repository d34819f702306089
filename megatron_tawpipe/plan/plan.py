"""Plan: per-rank action lists plus the metadata needed to run or check them,
with a JSON and a CSV text form and a step-by-rank grid printout."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_tawpipe.common.layer_split import default_layer_split, is_even, layer_offsets
from megatron_tawpipe.plan import actions as A

FORMAT_VERSION = 1


def shards_held_by(owners: Sequence[int], replicas: Dict[int, Sequence[int]], rank: int) -> List[int]:
    """The shards ``rank`` keeps a master of, given each shard's owner and other holders."""
    return [s for s, o in enumerate(owners) if o == rank or rank in replicas.get(s, ())]


@dataclass
class Plan:
    """A complete schedule for one training iteration.

    ``owners[s]`` is the global rank owning shard ``s`` (its master weights,
    optimizer state and ``main`` gradient).  ``streams[r]`` is the data stream
    whose micro-batches rank ``r`` computes (weight passing: ``r``; activation
    passing: 0).  Ranks ``r`` with ``r // ranks_per_group == k`` form group
    (node) ``k``; ``link`` fields of communication actions follow this map.
    ``replicas[s]`` (shards absent: none) are the other ranks that hold shard
    ``s`` as its owner does -- master weights, optimizer state, ``main``
    gradient -- and step it identically: its ``main`` gradients are all-reduced
    among the holders (``AllReduceStart``) before the step.
    ``max_weight_buffers``/``max_grad_buffers`` bound the number of distinct
    weight/gradient buffer names on any rank (``main`` not counted).
    ``shard_layers[s]`` is the number of decoder layers of shard ``s`` (consecutive
    layers, in shard order); not given, the default split of ``num_layers`` over the
    shards (:func:`common.layer_split.default_layer_split`: equal when they divide).
    Buffers hold the largest shard; a shard uses the first ``shard_layers[s]`` layers' worth.
    ``ownership``: ``"owner"`` (each holder of a shard keeps all of it) or ``"spread"`` (the holders of a
    shard -- its owner and replicas -- each keep one slice of it, member k of the sorted holders slice k:
    master weights, optimizer state and ``main`` gradient; its weights are gathered from them
    (``AllGatherStart``) and its gradient reduce-scattered to them (``ReduceScatterStart``)).
    """

    schedule: str
    family: str                       # "weight" or "activation"
    num_ranks: int
    num_groups: int                   # physical groups (nodes)
    num_layers: int
    num_microbatches: int             # per data stream
    owners: Tuple[int, ...]
    streams: Tuple[int, ...]
    max_weight_buffers: int
    max_grad_buffers: int
    actions: List[List[object]]
    options: Dict[str, object] = field(default_factory=dict)
    replicas: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    shard_layers: Tuple[int, ...] = ()
    ownership: str = "owner"

    def __post_init__(self) -> None:
        if self.shard_layers:
            self.shard_layers = tuple(int(x) for x in self.shard_layers)
        elif 1 <= len(self.owners) <= self.num_layers:
            self.shard_layers = default_layer_split(self.num_layers, len(self.owners))

    # ------------------------------------------------------------------ shape
    @property
    def num_shards(self) -> int:
        return len(self.owners)

    @property
    def ranks_per_group(self) -> int:
        return self.num_ranks // self.num_groups

    @property
    def max_layers_per_shard(self) -> int:
        """Layers of the largest shard: what a weight or gradient buffer holds."""
        return max(self.shard_layers)

    @property
    def uneven(self) -> bool:
        """Whether the shards differ in size."""
        return not is_even(self.shard_layers)

    @property
    def num_streams(self) -> int:
        return len(set(self.streams))

    def group_of(self, rank: int) -> int:
        return rank // self.ranks_per_group

    def link_between(self, a: int, b: int) -> str:
        return "intra" if self.group_of(a) == self.group_of(b) else "inter"

    def shards_owned_by(self, rank: int) -> List[int]:
        """Shards whose owner is ``rank`` (each shard has one)."""
        return [s for s, o in enumerate(self.owners) if o == rank]

    def shards_held_by(self, rank: int) -> List[int]:
        """Shards whose master weights, optimizer state and ``main`` gradient ``rank`` keeps:
        the ones it owns and the ones it holds a replica of."""
        return shards_held_by(self.owners, self.replicas, rank)

    @property
    def spread(self) -> bool:
        """Whether every holder of a shard keeps a slice of it (``ownership`` "spread")."""
        return self.ownership == "spread"

    def layers_held_by(self, rank: int) -> float:
        """Decoder layers of the shards ``rank`` keeps masters of (a slice counts its share: the spread
        layout's holders of a shard keep 1/len(holders) of it each)."""
        if self.spread:
            return sum(self.shard_layers[s] / len(self.holders(s)) for s in self.shards_held_by(rank))
        return sum(self.shard_layers[s] for s in self.shards_held_by(rank))

    def holders(self, shard: int) -> Tuple[int, ...]:
        """The ranks that hold ``shard``: its owner, then its replicas."""
        return (self.owners[shard],) + tuple(self.replicas.get(shard, ()))

    def layers_of_shard(self, shard: int) -> range:
        first = layer_offsets(self.shard_layers)[shard]
        return range(first, first + self.shard_layers[shard])

    def communicators(self) -> List[Tuple[Tuple[int, ...], str]]:
        """Distinct (member ranks, channel) pairs used by collectives, in first
        use order: the process groups an executor has to create."""
        seen = {}
        for rank_actions in self.actions:
            for a in rank_actions:
                if isinstance(a, (A.BroadcastStart, A.ReduceStart, A.AllReduceStart) + A.SLICE_COLLECTIVES):
                    seen.setdefault((a.ranks, A.CHANNEL[a.kind]), None)
                elif isinstance(a, A.ReplicatedAllReduceStart):
                    seen.setdefault((a.ranks, "replicated"), None)
        return list(seen)

    def num_actions(self) -> int:
        return sum(len(x) for x in self.actions)

    # ------------------------------------------------------------- text forms
    def meta(self) -> dict:
        return {
            "format": FORMAT_VERSION, "schedule": self.schedule, "family": self.family,
            "num_ranks": self.num_ranks, "num_groups": self.num_groups,
            "num_layers": self.num_layers, "num_microbatches": self.num_microbatches,
            "owners": list(self.owners), "streams": list(self.streams),
            "max_weight_buffers": self.max_weight_buffers,
            "max_grad_buffers": self.max_grad_buffers, "options": self.options,
            **({"replicas": {str(s): list(r) for s, r in self.replicas.items()}} if self.replicas else {}),
            **({"shard_layers": list(self.shard_layers)} if self.uneven else {}),
            **({"ownership": self.ownership} if self.spread else {}),
        }

    @classmethod
    def _from_meta(cls, meta: dict, actions) -> "Plan":
        if meta.get("format", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"unsupported plan format {meta.get('format')}")
        return cls(schedule=meta["schedule"], family=meta["family"],
                   num_ranks=int(meta["num_ranks"]), num_groups=int(meta["num_groups"]),
                   num_layers=int(meta["num_layers"]),
                   num_microbatches=int(meta["num_microbatches"]),
                   owners=tuple(meta["owners"]), streams=tuple(meta["streams"]),
                   max_weight_buffers=int(meta["max_weight_buffers"]),
                   max_grad_buffers=int(meta["max_grad_buffers"]),
                   actions=actions, options=dict(meta.get("options", {})),
                   replicas={int(s): tuple(r) for s, r in meta.get("replicas", {}).items()},
                   shard_layers=tuple(meta.get("shard_layers", ())),
                   ownership=str(meta.get("ownership", "owner")))

    def to_json(self, indent: Optional[int] = None) -> str:
        doc = {"meta": self.meta(),
               "actions": [[A.action_to_dict(a) for a in acts] for acts in self.actions]}
        return json.dumps(doc, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        doc = json.loads(text)
        actions = [[A.action_from_dict(d) for d in acts] for acts in doc["actions"]]
        return cls._from_meta(doc["meta"], actions)

    _CSV_COLUMNS = ("rank", "step", "op", "tag", "mb", "shard", "wbuf", "gbuf", "buf",
                    "peer", "root", "ranks", "kind", "link", "size", "batch", "part", "node_size", "mode")

    def to_csv(self) -> str:
        """One row per action; the first line is ``# plan-meta: {json}``."""
        out = io.StringIO()
        out.write("# plan-meta: " + json.dumps(self.meta()) + "\n")
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(self._CSV_COLUMNS)
        for rank, acts in enumerate(self.actions):
            for step, a in enumerate(acts):
                d = A.action_to_dict(a)
                if "ranks" in d:
                    d["ranks"] = " ".join(str(x) for x in d["ranks"])
                d["rank"], d["step"] = rank, step
                writer.writerow(["" if d.get(c) is None else d[c] for c in self._CSV_COLUMNS])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Plan":
        first, _, rest = text.partition("\n")
        if not first.startswith("# plan-meta: "):
            raise ValueError("CSV plan must start with a '# plan-meta:' line")
        meta = json.loads(first[len("# plan-meta: "):])
        actions: List[List[object]] = [[] for _ in range(int(meta["num_ranks"]))]
        for row in csv.DictReader(io.StringIO(rest)):
            d = {k: v for k, v in row.items() if k not in ("rank", "step")}
            rank, step = int(row["rank"]), int(row["step"])
            if step != len(actions[rank]):
                raise ValueError(f"CSV rows of rank {rank} out of order at step {step}")
            actions[rank].append(A.action_from_dict(d))
        return cls._from_meta(meta, actions)

    # ------------------------------------------------------------------ grid
    def grid(self, compute_only: bool = False, max_steps: Optional[int] = None,
             ranks: Optional[Sequence[int]] = None) -> str:
        """Step-by-rank table of short action codes (one column per rank)."""
        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        columns = []
        for r in ranks:
            starts = {a.tag: a for a in self.actions[r] if isinstance(a, A.STARTS)}
            acts = self.actions[r]
            if compute_only:
                acts = [a for a in acts if isinstance(a, A.COMPUTE)]
            columns.append([A.short(a, starts) for a in acts])
        depth = max((len(c) for c in columns), default=0)
        if max_steps is not None:
            depth = min(depth, max_steps)
        width = max([len(f"rank {r}") for r in ranks] +
                    [len(x) for c in columns for x in c[:depth]] + [1])
        lines = ["step  " + " ".join(f"{'rank ' + str(r):<{width}}" for r in ranks)]
        for i in range(depth):
            cells = [(c[i] if i < len(c) else "") for c in columns]
            lines.append(f"{i:<5} " + " ".join(f"{x:<{width}}" for x in cells).rstrip())
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"{self.schedule}: P={self.num_ranks} groups={self.num_groups} "
                f"L={self.num_layers} shards={self.num_shards}"
                f"{' ' + str(list(self.shard_layers)) if self.uneven else ''} N={self.num_microbatches} "
                f"actions={self.num_actions()} weight_buffers={self.max_weight_buffers} "
                f"grad_buffers={self.max_grad_buffers}")
