"""The vocabulary of the NCCL model (:mod:`plan.nccl`): which communicator and FIFO an operation joins,
how a rank's starts group into FIFO entries (NCCL groups), what a transfer carries, and how to name them
in messages."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.actions import MemberCollectiveStart
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.plan import Plan

# ------------------------------------------------------------ communicators
#: The weight-passing runtime's point-to-point process groups are one per channel and direction: "up" carries
#: what a rank sends to a higher rank, "down" what it sends to a lower one, so the two directions between two
#: ranks (two nodes) never wait for each other on one communicator's stream. The activation channels model
#: megatron's pipelines, which keep one group for both directions, and stay undirected.
DIRECTIONS = ("up", "down")
DIRECTED_CHANNELS = A.DIRECTED_CHANNELS


def direction(rank: int, action) -> str:
    """The direction of a send or receive of ``rank``: ``"up"`` when the sender is the lower rank."""
    sender, receiver = (rank, action.peer) if type(action) is A.SendStart else (action.peer, rank)
    return "up" if sender < receiver else "down"


def process_group(action, rank: int) -> tuple:
    """The executor's process group of a start action of ``rank``: a point-to-point transfer's channel and
    direction (:data:`DIRECTIONS`), a collective's members and channel."""
    t = type(action)
    if t is A.SendStart or t is A.RecvStart:
        channel = A.CHANNEL[action.kind]
        return ("p2p", channel, direction(rank, action)) if channel in DIRECTED_CHANNELS else ("p2p", channel)
    if t is A.ReplicatedAllReduceStart:
        return ("replicated", action.ranks)
    if t is MemberCollectiveStart:   # the context-parallel group of a virtual rank's members
        return ("context_parallel", action.ranks)
    return ("collective", action.ranks, A.CHANNEL[action.kind])


def fifo_of(rank: int, action, mode: str) -> tuple:
    """The FIFO ``action`` joins on ``rank``: its communicator's (one per rank in ``"device"`` mode)."""
    if mode == "device":
        return ("device",)
    return communicator_of(rank, action, mode)


def communicator_of(rank: int, action, mode: str) -> tuple:
    """The communicator that pairs ``action`` with its partners."""
    if mode == "device":
        mode = "group"
    pg = process_group(action, rank)
    if mode == "pair" and type(action) in P2P_TYPES and action.batch is None:
        return pg + ("pair", min(rank, action.peer), max(rank, action.peer))
    return pg


def is_pair_communicator(key: tuple) -> bool:
    """Whether a communicator key (:func:`communicator_of`) is a lazily created two-rank one."""
    return key[0] == "p2p" and "pair" in key


def describe_fifo(key: tuple) -> str:
    if key[0] == "device":
        return "device-wide issue order (every communicator)"
    if key[0] == "p2p":
        way = key[2] if len(key) > 2 and key[2] in DIRECTIONS else None
        what = f"{key[1]} point-to-point" + (f" ({way}: toward {'higher' if way == 'up' else 'lower'} ranks)"
                                             if way else "")
        if is_pair_communicator(key):
            return f"{what} communicator of ranks {key[-2]} and {key[-1]}"
        return f"{what} process group"
    if key[0] == "replicated":
        return f"replicated all-reduce group {list(key[1])}"
    if key[0] == "context_parallel":
        return f"context-parallel group {list(key[1])}"
    return f"{key[2]} collective group {list(key[1])}"


# ------------------------------------------------------------------ batches
def batch_entries(plan: Plan, rank: int, mode: str) -> List[Tuple[tuple, List[Tuple[int, object]]]]:
    """The FIFO entries ``rank`` issues, in order: ``(fifo key, [(step, start)])``.

    Raises ``PlanError`` for a batch whose starts are not adjacent, mix
    communicators, or contain a collective."""
    return entries_of(plan.actions[rank], rank, mode)


def entries_of(actions, rank: int, mode: str) -> List[Tuple[tuple, List[Tuple[int, object]]]]:
    """``batch_entries`` of the action list ``actions`` of ``rank``."""
    out: List[Tuple[tuple, List[Tuple[int, object]]]] = []
    closed = set()
    current: Optional[int] = None
    for step, a in enumerate(actions):
        if type(a) not in START_TYPES:
            if current is not None:
                closed.add(current)
                current = None
            continue
        batch = getattr(a, "batch", None)
        if batch is None:
            if current is not None:
                closed.add(current)
                current = None
            out.append((fifo_of(rank, a, mode), [(step, a)]))
            continue
        if type(a) not in P2P_TYPES:
            raise PlanError("only sends and receives can be batched", rank, step, a)
        if batch == current:
            key = fifo_of(rank, a, mode)
            if key != out[-1][0]:
                first = out[-1][1][0]
                raise PlanError(f"batch {batch} mixes communicators: {describe_fifo(key)} and "
                                f"{describe_fifo(out[-1][0])} (step {first[0]})", rank, step, a)
            out[-1][1].append((step, a))
            continue
        if current is not None:
            closed.add(current)
        if batch in closed:
            raise PlanError(f"the starts of batch {batch} are not adjacent on this rank "
                            "(a batch is issued at once)", rank, step, a)
        current = batch
        out.append((fifo_of(rank, a, mode), [(step, a)]))
    return out


def transfer_elements(plan: Plan, action) -> tuple:
    """What a transfer carries, in units both sides know: a weight or gradient shard is its
    layer count (buffers hold whole layers of one shape); activations are one boundary."""
    kind = getattr(action, "kind", None)
    if type(action) is A.ReplicatedAllReduceStart:
        return ("replicated", action.part if action.mode == "sum" else f"{action.part} {action.mode}")
    if type(action) is MemberCollectiveStart:
        return ("members", f"{action.op} of shard {action.shard}" if action.shard >= 0 else action.op)
    if kind in ("weight", "grad") and 0 <= action.shard < len(plan.shard_layers):
        return ("layers", plan.shard_layers[action.shard])
    return (kind, getattr(action, "size", None))


def describe_size(elements: tuple) -> str:
    what, n = elements
    return f"{n} layers" if what == "layers" else f"{what} {n}"


def describe_elements(plan: Plan, action) -> str:
    what, n = transfer_elements(plan, action)
    return f"{n} layers (shard {action.shard})" if what == "layers" else f"{what} {n}"


def nth(k: int) -> str:
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


P2P_TYPES = frozenset(A.P2P)
START_TYPES = frozenset(A.STARTS + (MemberCollectiveStart,))
