"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the full
``[b, heads, S, S]`` score matrix, which is what long-context training cannot
afford. This module is a drop-in replacement for the ``core_attention`` slot of
a megatron-core ``SelfAttention`` spec: same constructor and forward
signature, same layouts (``[s, b, heads, head_dim]`` in, ``[s, b, hidden]``
out), but the work is done by SDPA, which picks flash / memory-efficient
kernels on GPUs and a blocked kernel on CPUs. Transformer Engine's attention
is used instead where TE is installed (see :mod:`megatron_tawpipe.models.llama`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Causal / padded self-attention via ``scaled_dot_product_attention``.

    Tensor parallelism is 1 in weight-passing schedules and supported here too
    (heads are divided by the TP size like megatron's own module does).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        _check_supported(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp_size = config.tensor_model_parallel_size
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.groups_per_partition = config.num_query_groups // tp_size
        self.hidden_per_partition = config.kv_channels * self.heads_per_partition
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = None
        if config.context_parallel_size > 1:
            cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            if cp is None:
                from megatron.core import parallel_state

                cp = parallel_state.get_context_parallel_group()
            self.cp_group = cp

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_group is not None:
            return self._context_parallel(q, k, v, attention_mask, mask_type)
        sdpa_mask, is_causal = _sdpa_mask(attention_mask, mask_type, q.size(2))
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            attn_mask=sdpa_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=self.heads_per_partition != self.groups_per_partition,
        )
        if dropout_p > 0.0:
            # Same RNG discipline as megatron's attention dropout.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, n, s, d] -> [s, b, n*d]
        b, n, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)


    def _context_parallel(self, q, k, v, attention_mask, mask_type) -> torch.Tensor:
        """This rank's queries against the whole sequence's keys and values, passed around the context-parallel
        ring (the causal mask in the global token order of megatron's balanced split)."""
        from megatron_tawpipe.models.ring_attention import ring_attention

        if attention_mask is not None:
            raise ValueError("context parallelism takes no attention-mask tensor: the mask is causal (no "
                             "--reset-attention-mask); the data's mask is not passed to the layers")
        if self.training and self.dropout_p > 0.0:
            raise ValueError("context parallelism without Transformer Engine has no attention dropout: "
                             "--attention-dropout 0")
        context = ring_attention(q, k, v, self.cp_group, scale=self.softmax_scale,
                                 causal=mask_type == AttnMaskType.causal)
        b, n, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _sdpa_mask(attention_mask: Optional[torch.Tensor], mask_type: AttnMaskType, seq_len: int):
    """Translate megatron's mask convention (True = masked out) to SDPA's (True = keep)."""
    if attention_mask is None:
        if mask_type == AttnMaskType.causal and seq_len > 1:
            return None, True
        return None, False
    # megatron uses a given mask as is, even for the causal mask type: the
    # data pipeline's mask already contains the causal part.
    return ~attention_mask.bool(), False


def _check_supported(config: TransformerConfig) -> None:
    unsupported = []
    if config.apply_query_key_layer_scaling:
        unsupported.append("apply_query_key_layer_scaling")
    if getattr(config, "window_size", None) is not None:
        unsupported.append("window_size")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        unsupported.append(f"softmax_type={config.softmax_type}")
    if unsupported:
        raise ValueError(
            "SDPAttention does not support: " + ", ".join(unsupported)
            + " (install Transformer Engine or use --attention-backend local)"
        )
