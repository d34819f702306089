"""The micro-batches of one run of a rank's plan, as megatron's ``forward_step_func`` contract delivers them.

At a micro-batch's first shard the forward step is called with a recorder standing in for the model; it records
the inputs and returns a placeholder, and the ``loss_func`` the step returns is applied to the per-token losses
once the last shard has run. Every compute (the real layers, or emulated compute) goes through this object.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Optional, Tuple

import torch


class _MicroBatchRecorder:
    """Stands in for the model inside ``forward_step_func``: records one micro-batch's inputs."""

    def __init__(self):
        self.inputs: Optional[dict] = None

    def __call__(self, input_ids, position_ids, attention_mask, labels=None, **unused):
        self.inputs = dict(tokens=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                           labels=labels)
        return None  # the real output (per-token losses) reaches loss_func after the last shard


def normalised_loss(outputs, num_microbatches: int,
                    total_tokens: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Tuple[torch.Tensor, object]:
    """Megatron's normalisation of a loss_func result (see schedules.forward_step_calc_loss). ``total_tokens``:
    with context parallelism, the micro-batch's tokens over the context-parallel group from this member's count,
    so that each member's loss is its tokens' loss sum over the whole sequence's tokens and the members'
    gradients sum to the micro-batch's mean token loss."""
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if total_tokens is not None:
            num_tokens = total_tokens(num_tokens)
        return loss / torch.clamp(num_tokens, min=1) / num_microbatches, report
    loss, report = outputs
    return loss / num_microbatches, report


class MicroBatches:
    """Inputs, loss functions and reports of the micro-batches of one run (one iteration, or one evaluation)."""

    def __init__(self, forward_step_func: Optional[Callable], data_iterator: Optional[Iterator],
                 num_microbatches: int, forward_only: bool,
                 total_tokens: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """``total_tokens``: see :func:`normalised_loss` (context parallelism)."""
        self.forward_step_func = forward_step_func
        self.total_tokens = total_tokens
        self.data_iterator = data_iterator
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.inputs: Dict[int, dict] = {}
        self.loss_funcs: Dict[int, Callable] = {}
        self.reports: Dict[int, object] = {}

    def start(self, mb: int) -> None:
        """Draw micro-batch ``mb`` through the forward step (at its first shard)."""
        recorder = _MicroBatchRecorder()
        _, loss_func = self.forward_step_func(self.data_iterator, recorder)
        if recorder.inputs is None:
            raise RuntimeError("forward_step_func must call the model once per micro-batch")
        self.inputs[mb] = recorder.inputs
        self.loss_funcs[mb] = loss_func

    def loss(self, mb: int, per_token: torch.Tensor) -> Tuple[torch.Tensor, object]:
        """``(loss, report)``: the micro-batch's loss_func on its per-token losses, normalised like megatron."""
        return normalised_loss(self.loss_funcs[mb](per_token), self.num_microbatches, self.total_tokens)

    def finish_forward(self, mb: int, report: object) -> None:
        """The last shard's forward has run: keep the report; a forward-only run is done with the inputs."""
        self.reports[mb] = report
        if self.forward_only:
            self.inputs.pop(mb)

    def release(self, mb: int) -> None:
        """The first shard's backward has run: the micro-batch is done."""
        self.inputs.pop(mb, None)
        self.loss_funcs.pop(mb, None)

    def ordered_reports(self) -> list:
        return [self.reports[mb] for mb in sorted(self.reports)]
