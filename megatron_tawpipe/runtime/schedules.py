"""Schedule functions with megatron-core's ``forward_backward_func`` calling convention.

    forward_backward = get_forward_backward_func("tawpipe")
    reports = forward_backward(forward_step_func=..., data_iterator=..., model=weight_pipe_model,
                               num_microbatches=N, seq_length=S, micro_batch_size=G)

``num_microbatches`` is per rank (every rank is a data-parallel rank). Like
megatron's functions they run forward and backward over all micro-batches and
return the ``loss_func`` reports; the optimizer step is the caller's. The
``forward_step_func`` is megatron's: ``(data_iterator, model) -> (output, loss_func)``.

Compatibility with megatron-core releases (checked against their sources, see
:mod:`megatron_tawpipe.distributed.megatron_schedules`):

* ``get_forward_backward_func`` takes ``(pp_size=None, vp_size=None)`` from 0.16
  through 0.18 and adds ``schedule_pg_collection=None`` in 0.19 (used there only
  to pick the multi-module bridge schedule); with no arguments every release
  reads the sizes from ``parallel_state``.
* Megatron-LM's ``train_step`` passes ``decoder_seq_length=``,
  ``adjust_tensor_shapes_fn=`` and ``force_all_reduce=`` (0.16+) and
  ``p2p_communicator=`` and ``pg_collection=`` (0.19+) to the schedule function;
  megatron's own functions also take ``first_val_step=``. The weight-passing
  functions accept all of them.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Union

from megatron_tawpipe.arguments import is_weight_passing, plan_file_of
from megatron_tawpipe.distributed.megatron_schedules import megatron_forward_backward_func


def _forward_backward_weight_passing(expected: Optional[str], *, forward_step_func,
                                     data_iterator: Union[Iterator, List[Iterator]], model, num_microbatches: int,
                                     seq_length: int, micro_batch_size: int,
                                     decoder_seq_length=None, forward_only: bool = False,
                                     collect_non_loss_data: bool = False, first_val_step=None,
                                     adjust_tensor_shapes_fn=None, force_all_reduce=False,
                                     p2p_communicator=None, pg_collection=None, **newer_keywords) -> list:
    """Megatron's keywords are accepted and ignored where weight passing has no use for them:

    ``decoder_seq_length`` (single-stack model), ``first_val_step`` (fp8 weight caching),
    ``adjust_tensor_shapes_fn`` (stage-to-stage shapes: no activations travel here),
    ``force_all_reduce`` (gradients always reach their owner whole), ``p2p_communicator`` and
    ``pg_collection`` (the weight pipeline's groups come from its plan, over all ranks).
    Keywords of later releases are ignored likewise.
    """
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported by weight-passing schedules")
    if isinstance(model, list):
        (model,) = model
    if isinstance(data_iterator, list):
        (data_iterator,) = data_iterator
    family = model.plan.schedule.split("-")[0]
    if expected is not None and family != expected:
        raise ValueError(f"forward_backward_{expected} got a model planned for {model.plan.schedule}")
    return model.run(forward_step_func, data_iterator, num_microbatches, forward_only)


def forward_backward_weipipe(**kwargs) -> list:
    """WeiPipe-Interleave: weights and gradients circulate on a ring of all ranks."""
    return _forward_backward_weight_passing("weipipe", **kwargs)


def forward_backward_tawpipe(**kwargs) -> list:
    """TawPipe: device-bound storage, group-based scheduling, comm/compute overlap."""
    return _forward_backward_weight_passing("tawpipe", **kwargs)


def forward_backward_plan_file(**kwargs) -> list:
    """``--pipeline-schedule plan:FILE``: whatever weight-passing plan the model was given."""
    return _forward_backward_weight_passing(None, **kwargs)


def get_forward_backward_func(pipeline_schedule: str, pp_size: Optional[int] = None,
                              vp_size: Optional[int] = None) -> Callable:
    """Beside megatron-core's ``get_forward_backward_func``: ours for weight passing, megatron's otherwise."""
    if pipeline_schedule == "weipipe":
        return forward_backward_weipipe
    if pipeline_schedule == "tawpipe":
        return forward_backward_tawpipe
    if plan_file_of(pipeline_schedule) is not None:
        return forward_backward_plan_file
    if is_weight_passing(pipeline_schedule):  # pragma: no cover - kept in sync above
        raise ValueError(pipeline_schedule)
    return megatron_forward_backward_func(pp_size, vp_size)
