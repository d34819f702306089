"""Weight-pipeline topology, beside megatron-core's ``parallel_state``.

megatron-core sees a weight-passing run as plain data parallelism (TP = 1,
PP = 1, DP = world). On top of that, the weight pipeline needs its own
layout: D groups (nodes) of G = P / D consecutive ranks, the process groups
inside each group, and which rank owns which shard. This module builds that
once per run, with getters in megatron's style and a clean destroy.

Rank ``r = k * G + j`` is local index ``j`` of group ``k``. With tensor parallelism
inside the weight pipeline (``--tensor-model-parallel-size T``) these are *virtual*
ranks: virtual rank ``v`` is the T consecutive global ranks ``v * T .. v * T + T - 1``
(megatron-core's tensor-parallel group, inside one node), and the topology is that
of the P / T virtual ranks; with ``--context-parallel-size C`` too, a virtual rank is the T x C
consecutive ranks of a tensor x context-parallel group (P / (T x C) virtual ranks). The plan decides
shard ownership (TawPipe spreads each group's shards over the model's depth);
the topology records it so that checkpoints and tools can ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.common import launcher
from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.distributed import groups
from megatron_tawpipe.plan.plan import shards_held_by


@dataclass(frozen=True)
class WeightPipeTopology:
    world_size: int
    num_groups: int
    rank: int
    shard_owners: Tuple[int, ...]
    shard_replicas: Tuple[Tuple[int, Tuple[int, ...]], ...] = ()   # (shard, other holders)

    @property
    def ranks_per_group(self) -> int:
        return self.world_size // self.num_groups

    @property
    def group_index(self) -> int:
        return self.rank // self.ranks_per_group

    @property
    def local_index(self) -> int:
        return self.rank % self.ranks_per_group

    def group_ranks(self, group: Optional[int] = None) -> List[int]:
        group = self.group_index if group is None else group
        start = group * self.ranks_per_group
        return list(range(start, start + self.ranks_per_group))

    def peer_in_group(self, group: int) -> int:
        """The rank with this rank's local index in ``group`` (TawPipe's staging rank)."""
        return group * self.ranks_per_group + self.local_index

    def owned_shards(self, rank: Optional[int] = None) -> List[int]:
        rank = self.rank if rank is None else rank
        return [s for s, owner in enumerate(self.shard_owners) if owner == rank]

    def held_shards(self, rank: Optional[int] = None) -> List[int]:
        """Owned shards and the shards ``rank`` holds a replica of (``Plan.replicas``)."""
        return shards_held_by(self.shard_owners, dict(self.shard_replicas), self.rank if rank is None else rank)


def default_num_groups(world_size: int, schedule: str = "tawpipe") -> int:
    """One group per node as torchrun reports it (LOCAL_WORLD_SIZE ranks per node). Collective when the
    default process group exists: every rank's LOCAL_WORLD_SIZE is compared, and nodes of different
    sizes are refused on every rank alike (the weight pipeline runs groups of equal size)."""
    local = launcher.local_world_size(world_size)
    smallest = largest = local
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sizes = torch.tensor([local, -local], dtype=torch.int64, device=current_device())
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        largest, smallest = int(sizes[0]), -int(sizes[1])
    if smallest != largest or local <= 0 or world_size % local:
        raise ValueError(f"the nodes run different numbers of ranks (LOCAL_WORLD_SIZE from {smallest} to {largest}, "
                         f"{world_size} ranks): weight passing needs groups (nodes) of equal size; start the same "
                         "number of ranks on every node, or give --tawpipe-num-groups D with D dividing "
                         f"{world_size} (groups of {world_size}/D consecutive ranks)"
                         + ("; weipipe's ring does not depend on the groups: --tawpipe-num-groups 1 runs it"
                            if schedule == "weipipe" else ""))
    return world_size // local


_TOPOLOGY: Optional[WeightPipeTopology] = None
_INTRA_GROUPS: Dict[int, dist.ProcessGroup] = {}


def initialize_weight_pipeline(num_groups: int, shard_owners: Sequence[int],
                               group_size: int = 1,
                               shard_replicas: Optional[Dict[int, Sequence[int]]] = None) -> WeightPipeTopology:
    """Create the topology (of virtual ranks of ``group_size`` = T x C consecutive ranks when > 1: tensor x
    context parallelism) and one process group per group with all its global ranks (collective: every rank
    calls it)."""
    global _TOPOLOGY
    if _TOPOLOGY is not None:
        raise RuntimeError("the weight pipeline is already initialised; call destroy_weight_pipeline() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (num_groups * group_size):
        raise ValueError(f"--tawpipe-num-groups {num_groups} x --tensor-model-parallel-size x --context-parallel-size "
                         f"({group_size}) must divide the number of ranks {world}")
    t = group_size
    replicas = tuple(sorted((s, tuple(r)) for s, r in (shard_replicas or {}).items()))
    topology = WeightPipeTopology(world // t, num_groups, rank // t, tuple(shard_owners), replicas)
    for group in range(num_groups):
        # new_group is collective over the default group: every rank creates every group.
        _INTRA_GROUPS[group] = groups.new_group([v * t + j for v in topology.group_ranks(group) for j in range(t)])
    _TOPOLOGY = topology
    return topology


def is_initialized() -> bool:
    return _TOPOLOGY is not None


def get_topology() -> WeightPipeTopology:
    if _TOPOLOGY is None:
        raise RuntimeError("the weight pipeline is not initialised")
    return _TOPOLOGY


def get_num_groups() -> int:
    return get_topology().num_groups


def get_group_index() -> int:
    return get_topology().group_index


def get_intra_group() -> dist.ProcessGroup:
    """The process group of this rank's group (fast links)."""
    return _INTRA_GROUPS[get_topology().group_index]


def get_shard_owner(shard: int) -> int:
    return get_topology().shard_owners[shard]


def destroy_weight_pipeline() -> None:
    global _TOPOLOGY
    for group in _INTRA_GROUPS.values():
        if dist.is_initialized():
            dist.destroy_process_group(group)
    _INTRA_GROUPS.clear()
    _TOPOLOGY = None
