"""What the executor records of a plan's run (``--timeline-file``; the records and labels are
:mod:`megatron_tawpipe.plan.timeline`'s) and shows on the progress board: which way a transfer goes, the plan
position, and the device times resolved after the plan."""

from __future__ import annotations

from megatron_tawpipe.plan import actions as A


def arrives_here(action, rank: int) -> bool:
    """Whether a transfer brings data to ``rank`` (else it takes data away); an all-reduce
    both sends and receives, and what a rank waits on is its result: "in"."""
    if isinstance(action, A.RecvStart):
        return True
    if isinstance(action, A.BroadcastStart):
        return action.root != rank
    if isinstance(action, A.ReduceStart):
        return action.root == rank
    return isinstance(action, (A.AllReduceStart,) + A.SLICE_COLLECTIVES)


class PlanPosition:
    """A plan step as the progress board shows it; formatted only when posted."""

    __slots__ = ("step", "length", "action")

    def __init__(self, step: int, length: int, action) -> None:
        self.step, self.length, self.action = step, length, action

    def __str__(self) -> str:
        return f"plan step {self.step} of {self.length}, {self.action}"


def resolve_times(trace: dict) -> None:
    """Turn times measured with CUDA events into wall-clock seconds (after the plan)."""
    spans, transfers, actions = trace["spans"], trace["transfers"], trace["actions"]
    for i, span in enumerate(spans):
        if callable(span.start):
            spans[i] = span._replace(start=span.start(), end=span.end())
    for i, transfer in enumerate(transfers):
        if callable(transfer.posted):
            transfers[i] = transfer._replace(posted=transfer.posted(), end=transfer.end())
    for i, record in enumerate(actions):
        if isinstance(record.detail, list) and callable(record.detail[0]):
            actions[i] = record._replace(detail=[record.detail[0](), record.detail[1]()])
