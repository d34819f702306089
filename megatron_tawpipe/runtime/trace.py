"""What the executor records of a plan's run (``--timeline-file``) and shows on the progress board: the span
kinds of the actions, which way a transfer goes, a collective's link class, and the plan position."""

from __future__ import annotations

from megatron_tawpipe.plan import actions as A

COMPUTE = (A.Forward, A.Backward, A.BackwardInput, A.BackwardWeight)
SPAN_KINDS = {A.Forward: "F", A.Backward: "B", A.BackwardInput: "Bi", A.BackwardWeight: "Bw",
              A.LoadWeights: "load", A.AccumulateToOwner: "acc", A.ZeroGrad: "zero", A.OptimizerStep: "opt"}


def collective_link(plan, ranks) -> str:
    """"inter" where a collective's members span groups, else "intra"."""
    return "inter" if len({plan.group_of(r) for r in ranks}) > 1 else "intra"


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
    for span in trace["spans"]:
        if callable(span[1]):
            span[1], span[2] = span[1](), span[2]()
    for transfer in trace["transfers"]:
        if callable(transfer[4]):
            transfer[4], transfer[5] = transfer[4](), transfer[5]()
    for record in trace["actions"]:
        if isinstance(record[4], list) and callable(record[4][0]):
            record[4] = [record[4][0](), record[4][1]()]
