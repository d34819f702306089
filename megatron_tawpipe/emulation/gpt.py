"""megatron-core's GPTModel with emulated compute, built from a layer spec and a model class.

:meth:`EmulatedCompute.layer_spec` swaps the decoder layer of megatron-core's spec for
:class:`EmulatedTransformerLayer` (same submodules, so every parameter keeps its size and its DDP/FSDP
hooks), and :class:`EmulatedGPTModel` replaces the model's forward by sleeps: its input is the embedding
output on the first stage and the received activation elsewhere, its output a hidden state of the real shape
``[s, b, h]`` or, on the last stage, per-token losses ``[b, s]``. Layers run as modules, so FSDP all-gathers
each layer's weights as usual.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import TransformerLayer


class EmulatedTransformerLayer(TransformerLayer):
    """A decoder layer whose forward and backward sleep the calibrated times of one layer."""

    def __init__(self, *args, emulated_compute=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.emulated_compute = emulated_compute

    def forward(self, hidden_states, *args, **kwargs):
        # The layer's parameters as registered now: FSDP2 swaps in the gathered (unsharded)
        # parameters for the forward, and only gradients on those are reduced.
        compute = self.emulated_compute
        times = compute.times
        return compute.block(hidden_states, hidden_states.shape, times.layer_forward,
                             times.backward_s(1, False, compute.recompute), list(self.parameters()))


class EmulatedGPTModel(GPTModel):
    """A GPTModel (one pipeline chunk, or the whole model under FSDP) whose forward sleeps."""

    def __init__(self, *args, emulated_compute=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.emulated_compute = emulated_compute

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **_):
        compute = self.emulated_compute
        batch, seq = input_ids.shape
        hidden_shape = (seq, batch, self.config.hidden_size)
        if self.pre_process:
            embedding = list(self.embedding.parameters())
            hidden = compute.block(embedding[0].new_empty(hidden_shape), hidden_shape, 0.0, 0.0, embedding)
        else:
            hidden = self.decoder.input_tensor
        for layer in self.decoder.layers:
            hidden = layer(hidden)
        if not self.post_process:
            return hidden
        head = list(self.decoder.final_layernorm.parameters()) if self.decoder.final_layernorm is not None else []
        head += list(self.output_layer.parameters())
        per_token = compute.block(hidden, (batch, seq), compute.times.head_forward, compute.times.head_backward, head)
        return per_token.float()


def emulated_layer_spec(layer_spec, compute):
    """A decoder layer's ``ModuleSpec`` with the layer emulated (same submodules, so the same parameters)."""
    if layer_spec.module is not TransformerLayer:
        raise ValueError(f"emulated compute needs megatron-core's TransformerLayer, the spec has {layer_spec.module}")
    return dataclasses.replace(layer_spec, module=EmulatedTransformerLayer,
                               params={**layer_spec.params, "emulated_compute": compute})
