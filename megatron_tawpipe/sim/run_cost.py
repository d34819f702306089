"""The cost model of a run of ``pretrain_llama.py``, built from its configuration in one way for every
reader: the runtime's ``--tawpipe-cache auto`` (:mod:`megatron_tawpipe.runtime.tawpipe_cache`), the memory
check (:mod:`megatron_tawpipe.bench.memory`) and ``tools/calibrate.py --from-cost-model``
(:mod:`megatron_tawpipe.bench.calibrate`).

The output layer is the padded vocabulary (what the model builds); weights and activations take the compute
dtype's bytes (2 with ``--bf16`` / ``--fp16``, else 4), the travelling and accumulated gradients the main
gradients' (4, or 2 with ``--use-precision-aware-optimizer --main-grads-dtype bf16``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig
from megatron_tawpipe.sim.costmodel import CostModel


def run_cost_model(*, hidden_size: int, seq_length: int, micro_batch_size: int, ffn_hidden_size: Optional[int],
                   vocab_size: int, num_attention_heads: int, num_query_groups: Optional[int], recompute: bool,
                   dtype_bytes: int, grad_bytes: int, untied_embeddings: bool = True, **flops) -> CostModel:
    """The cost model of a run's shapes and dtypes: ``dtype_bytes`` per weight and activation element in the
    compute dtype, ``grad_bytes`` per element of the travelling and accumulated gradients; ``flops``:
    :meth:`CostModel.from_flops`'s device terms (``peak_tflops``, ``efficiency``), for its times."""
    cost = CostModel.from_flops(hidden_size=hidden_size, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                ffn_hidden_size=ffn_hidden_size, vocab_size=vocab_size,
                                num_attention_heads=num_attention_heads,
                                num_query_groups=num_query_groups or num_attention_heads, recompute=recompute,
                                dtype_bytes=dtype_bytes, untied_embeddings=untied_embeddings, **flops)
    return replace(cost, grad_bytes=grad_bytes)


def cost_model_for_run(model: ModelConfig, precision: PrecisionConfig, micro_batch_size: int, recompute: bool,
                       **flops) -> CostModel:
    """The cost model of a run's configuration (see the module docstring); ``flops`` as :func:`run_cost_model`."""
    return run_cost_model(hidden_size=model.hidden_size, seq_length=model.seq_length,
                          micro_batch_size=micro_batch_size, ffn_hidden_size=model.ffn_hidden_size,
                          vocab_size=model.output_vocab_size, num_attention_heads=model.num_attention_heads,
                          num_query_groups=model.num_query_groups, recompute=recompute,
                          dtype_bytes=precision.compute_bytes, grad_bytes=precision.grad_bytes,
                          untied_embeddings=model.untie_embeddings_and_output_weights, **flops)
