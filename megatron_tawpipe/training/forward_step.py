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
    """megatron-core forward_step_func: one micro-batch through one model chunk (with context parallelism, this
    rank's share of each sequence: :func:`context_parallel_batch`)."""
    batch = get_batch(data_iterator, current_device())
    tokens, labels, loss_mask, attention_mask, position_ids = context_parallel_batch(*batch)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(lm_loss_func, loss_mask)


def context_parallel_batch(tokens, labels, loss_mask, attention_mask, position_ids):
    """This rank's tokens of a micro-batch under megatron-core's context parallelism: each sequence cut into 2C
    chunks, context-parallel rank i taking chunks i and 2C-1-i (every rank the same share of causal attention's
    work). The attention mask is not passed on: it is causal (validation refuses --reset-attention-mask with
    context parallelism), which the layers apply in the global token order. Unchanged with C = 1."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if size == 1 or tokens is None and labels is None:
        return tokens, labels, loss_mask, attention_mask, position_ids
    from megatron_tawpipe.models.ring_attention import split_for_context_parallel

    rank = parallel_state.get_context_parallel_rank()
    parts = [None if t is None else split_for_context_parallel(t, 1, size, rank)
             for t in (tokens, labels, loss_mask, position_ids)]
    return parts[0], parts[1], parts[2], None, parts[3]
