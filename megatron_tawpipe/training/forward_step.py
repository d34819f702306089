"""The GPT forward step every schedule runs: megatron-core's ``forward_step_func`` contract.

``pretrain_llama.py`` passes :func:`gpt_forward_step` to :func:`megatron_tawpipe.training.pretrain`, which hands
it to the trainer of the chosen schedule (weight passing, megatron-core's own schedules, FSDP2), as Megatron-LM's
``pretrain(..., forward_step_func)`` does.
"""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch

from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.data import get_batch


def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's GPT loss: per-token losses summed under the loss mask.

    Returns ``(loss_sum, num_tokens, report)``: megatron divides the loss by
    the token count and by the number of micro-batches, so the gradient is the
    mean over micro-batches of each micro-batch's mean token loss; the report
    ``[loss_sum, num_tokens]`` is summed over micro-batches and ranks.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """megatron-core forward_step_func: one micro-batch through one model chunk."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, current_device())
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(lm_loss_func, loss_mask)
