"""Run the connection warm-up of a plan (:func:`plan.connect.connection_warmup`) before its first iteration.

NCCL connects each algorithm and each point-to-point pair of a communicator on first use, and that first
call blocks its host until the peers involved make theirs; inside a plan that can hang ranks that are
busy elsewhere. The warm-up makes every connection the plan will use, in one order on every rank, with
the plan's own operations and sizes on scratch buffers (so NCCL picks the same algorithms), and waits for
each. Nothing a plan reads or writes is touched, and no bytes are counted. On gloo it costs a few small
messages and checks the same code path.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.connect import connection_warmup
from megatron_tawpipe.plan.errors import PlanError
from megatron_tawpipe.plan.nccl import NcclModel, entries_of
from megatron_tawpipe.runtime.node_reduce import SHARDED_KINDS
from megatron_tawpipe.runtime.transport import Op

_KINDS = {A.SendStart: "send", A.RecvStart: "recv", A.BroadcastStart: "broadcast", A.ReduceStart: "reduce",
          A.AllReduceStart: "allreduce", A.ReplicatedAllReduceStart: "allreduce", A.AllGatherStart: "allgather",
          A.ReduceScatterStart: "reducescatter"}


def connect(executor) -> int:
    """Make every connection ``executor``'s plan uses; returns the number of operations issued."""
    actions = connection_warmup(executor.plan)[executor.rank]
    entries = {ops[0][0]: ops for _, ops in entries_of(actions, executor.rank, "group")}
    handles: Dict[int, object] = {}
    scratch: Dict[int, List[torch.Tensor]] = {}
    issued = 0
    for step, action in enumerate(actions):
        if type(action) is A.Wait:
            handles.pop(action.tag).wait(executor.timeout)
            scratch.pop(action.tag, None)
            continue
        ops = entries.get(step)
        if ops is None:
            continue
        batch = [_op(executor, s, a, scratch) for s, a in ops]
        handles.update(executor.transport.issue(batch))
        issued += len(batch)
    return issued


def _op(executor, step: int, action, scratch: Dict[int, List[torch.Tensor]]) -> Op:
    comms = executor.comms
    tensors = _scratch(executor, action)
    scratch[action.tag] = tensors
    t = type(action)
    if t in (A.SendStart, A.RecvStart):
        peer = comms.physical(action.peer)
    elif t in (A.BroadcastStart, A.ReduceStart):
        peer = comms.physical(action.root)
    else:
        peer = -1
    ranks = tuple(comms.physical(r) for r in getattr(action, "ranks", ()))
    kind = SHARDED_KINDS[action.mode] if t is A.ReplicatedAllReduceStart and action.mode != "sum" else _KINDS[t]
    return Op(action.tag, action, step, kind, tensors, comms.for_action(action, executor.rank), peer=peer,
              ranks=ranks, subgroups=comms.subgroups(action, executor.rank))


def _scratch(executor, action) -> List[torch.Tensor]:
    """Zeros of the sizes and dtypes the plan's own operation moves."""
    compute = executor.compute
    if type(action) is A.ReplicatedAllReduceStart and action.mode != "sum":   # [output, input] pairs
        return [torch.zeros_like(t) for t in compute.replicated_slices.tensors(action.mode, action.part)]
    if type(action) is A.ReplicatedAllReduceStart:
        return [torch.zeros_like(g) for g in compute.replicated_grads(action.part) if g.numel()]
    dtype = compute.compute_dtype if action.kind == "weight" else torch.float32
    if type(action) in A.SLICE_COLLECTIVES:   # [output, input]: the padded whole and one slice
        members, length = executor.slice_geometry(action.shard)
        whole = torch.zeros(members * length, dtype=dtype, device=compute.device)
        return [whole, whole[:length].clone()] if type(action) is A.AllGatherStart else [whole[:length].clone(), whole]
    return [torch.zeros(executor.shard_elements(action.shard), dtype=dtype, device=compute.device)]


def launch_order_problem(plans, environ) -> Optional[str]:
    """The refusal for an environment that serialises a GPU's communicators, or None.

    The plans are proven safe with one FIFO per communicator; most weight-passing plans also need
    their communicators to progress side by side (they fail the one-FIFO-per-GPU reading of NCCL's
    rules, :class:`plan.nccl.NcclModel` mode ``"device"``). ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` orders
    every NCCL kernel of a GPU after the previous one: such a plan would hang."""
    if environ.get("NCCL_LAUNCH_ORDER_IMPLICIT", "").strip() not in ("1",):
        return None
    for plan in plans:
        try:
            NcclModel(plan, "device").run()
        except PlanError as exc:
            return (f"NCCL_LAUNCH_ORDER_IMPLICIT=1 runs a GPU's NCCL operations one after another across "
                    f"communicators, and the {plan.schedule} plan relies on its weight and gradient "
                    f"communicators progressing side by side (under that order: {str(exc)[:300]}...). "
                    "Unset NCCL_LAUNCH_ORDER_IMPLICIT for this schedule")
    return None
