"""Schedule functions with megatron-core's ``forward_backward_func`` calling convention.

    forward_backward = get_forward_backward_func("tawpipe")
    reports = forward_backward(forward_step_func=..., data_iterator=..., model=weight_pipe_model,
                               num_microbatches=N, seq_length=S, micro_batch_size=G)

``num_microbatches`` is per rank (every rank is a data-parallel rank). Like
megatron's functions they run forward and backward over all micro-batches and
return the ``loss_func`` reports; the optimizer step is the caller's. The
``forward_step_func`` is megatron's: ``(data_iterator, model) -> (output, loss_func)``.
"""

from __future__ import annotations

from typing import Iterator, List, Union

from megatron_tawpipe.arguments import WEIGHT_PASSING_SCHEDULES


def _forward_backward_weight_passing(expected: str, *, forward_step_func, data_iterator: Union[Iterator, List[Iterator]],
                                     model, num_microbatches: int, seq_length: int, micro_batch_size: int,
                                     decoder_seq_length=None, forward_only: bool = False,
                                     collect_non_loss_data: bool = False, **unused) -> list:
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported by weight-passing schedules")
    if isinstance(model, list):
        (model,) = model
    if isinstance(data_iterator, list):
        (data_iterator,) = data_iterator
    family = model.plan.schedule.split("-")[0]
    if family != expected:
        raise ValueError(f"forward_backward_{expected} got a model planned for {model.plan.schedule}")
    return model.run(forward_step_func, data_iterator, num_microbatches, forward_only)


def forward_backward_weipipe(**kwargs) -> list:
    """WeiPipe-Interleave: weights and gradients circulate on a ring of all ranks."""
    return _forward_backward_weight_passing("weipipe", **kwargs)


def forward_backward_tawpipe(**kwargs) -> list:
    """TawPipe: device-bound storage, group-based scheduling, comm/compute overlap."""
    return _forward_backward_weight_passing("tawpipe", **kwargs)


def get_forward_backward_func(pipeline_schedule: str):
    """Beside megatron-core's ``get_forward_backward_func``: ours for weight passing, megatron's otherwise."""
    if pipeline_schedule == "weipipe":
        return forward_backward_weipipe
    if pipeline_schedule == "tawpipe":
        return forward_backward_tawpipe
    if pipeline_schedule in WEIGHT_PASSING_SCHEDULES:  # pragma: no cover - kept in sync above
        raise ValueError(pipeline_schedule)
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    return megatron_func()
