"""The timeline's vocabulary, one for the executor's trace (``--timeline-file``), the simulator's spans and the
idle breakdown that reads both: each action's label, a Wait's label (what it waited for, on which link class),
the training step's phases around the plan, and the records a trace is made of.

A trace file keeps its form: the records are named tuples, written as JSON lists; the labels and phases are
strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Optional

from megatron_tawpipe.plan import actions as A

COMPUTE = (A.Forward, A.Backward, A.BackwardInput, A.BackwardWeight)
#: The label of each action that spans time on its rank (compute, the copies, the plan's optimizer step).
SPAN_LABELS = {A.Forward: "F", A.Backward: "B", A.BackwardInput: "Bi", A.BackwardWeight: "Bw",
               A.LoadWeights: "load", A.AccumulateToOwner: "acc", A.ZeroGrad: "zero", A.OptimizerStep: "opt"}
COMPUTE_LABELS = tuple(SPAN_LABELS[t] for t in COMPUTE)
COPY_LABELS = ("load", "acc", "zero")
OPTIMIZER_LABEL = "opt"
ISSUE = "issue"     # a start action: the communication issued
WAIT = "wait"       # a Wait whose start the record does not know


@dataclass(frozen=True)
class WaitLabel:
    """What a Wait waited for: ``kind`` "weight", "grad" (a shard's), "allreduce" (the holders' all-reduce of a
    replicated first shard) or "replicated" (the replicated parameters' all-reduce), over ``link``
    "intra" or "inter". Written ``wait:<kind>:<link>``."""

    kind: str
    link: str

    def __str__(self) -> str:
        return f"{WAIT}:{self.kind}:{self.link}"

    @classmethod
    def parse(cls, label: str) -> Optional["WaitLabel"]:
        """The label's parts, or None for a label that is not a Wait's of a known start."""
        parts = label.split(":")
        return cls(parts[1], parts[2]) if len(parts) == 3 and parts[0] == WAIT else None


def wait_label(plan, rank: int, start) -> WaitLabel:
    """The label of ``rank``'s Wait on ``start``: a collective's link is "inter" where its members span
    groups, a transfer's the link it takes."""
    t = type(start)
    kind = "replicated" if t is A.ReplicatedAllReduceStart else (
        "allreduce" if t is A.AllReduceStart else getattr(start, "kind", "allreduce"))
    link = getattr(start, "link", None)
    if link is None:
        root = getattr(start, "root", None)
        link = plan.link_between(rank, root) if root is not None else collective_link(plan, start.ranks)
    return WaitLabel(kind, link)


def collective_link(plan, ranks) -> str:
    """"inter" where a collective's members span groups, else "intra"."""
    return "inter" if len({plan.group_of(r) for r in ranks}) > 1 else "intra"


def action_label(action) -> str:
    """An action's label as a trace records it, a Wait's without its parts."""
    t = type(action)
    if t in A.STARTS:
        return ISSUE
    if t is A.Wait:
        return WAIT
    return SPAN_LABELS.get(t, t.__name__)


class StepPhase(str, Enum):
    """The phases of a weight-passing training step, in the order a step ends them (``marks`` of a trace:
    each phase with the host time at its end)."""

    PREVIOUS_STEP = "previous step"          # where the previous step's timeline was written (None: the first)
    BETWEEN_STEPS = "between steps"
    SET_UP = "set-up"
    PLAN = "plan"
    PARTIAL_GRADIENTS = "partial gradients"
    UNSCALE = "unscale"
    NORM_LOCAL = "gradient norm, local"
    NORM_ALL_REDUCE = "gradient norm, all-reduce"
    CLIP = "clip"
    OPTIMIZER = "optimizer step"
    REPLICATED_MASTERS = "replicated masters to model"
    BUSY_FRACTION = "busy fraction"
    METRICS = "metrics all-reduces"

    def __str__(self) -> str:
        return self.value


class ActionRecord(NamedTuple):
    """One plan action of a rank: its step, label (a Wait's :class:`WaitLabel`), the host's clock around it and
    ``detail``: a compute action's ``[start, end]`` on the device clock, a Wait's seconds of its own work after
    the transfer."""

    step: int
    label: str
    host_start: float
    host_end: float
    detail: Any


class SpanRecord(NamedTuple):
    """A spanning action of a rank (:data:`SPAN_LABELS`) with its micro-batch and shard (-1: none)."""

    rank: int
    start: Any
    end: Any
    label: str
    mb: int
    shard: int


class TransferRecord(NamedTuple):
    """A transfer as the rank waiting on it saw it: "in" or "out", its kind and link, posted and done."""

    rank: int
    direction: str
    kind: str
    link: str
    posted: Any
    end: Any
