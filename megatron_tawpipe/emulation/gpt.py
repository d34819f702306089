"""megatron-core's GPTModel with emulated compute, built from a layer spec and a model class.

:meth:`EmulatedCompute.layer_spec` swaps the decoder layer of megatron-core's spec for
:class:`EmulatedTransformerLayer` (same submodules, so every parameter keeps its size and its DDP/FSDP
hooks), and :class:`EmulatedGPTModel` replaces the model's forward by sleeps: its input is the embedding
output on the first stage and the received activation elsewhere, its output a hidden state of the real shape
``[s, b, h]`` or, on the last stage, per-token losses ``[b, s]``. Every module with parameters runs as a
module, as in the real model -- the embedding, each layer, the final norm and the output layer (the last two
sleep the output layer's calibrated times, the embedding none: as the weight-passing emulation) -- so the
hooks a data-parallel library puts on them fire as they would: Megatron-FSDP, for one, notices the end of a micro-batch's backward through
a hook on the output layer, and without it reduces and gathers across instances every micro-batch.

With ``--context-parallel-size C`` the input is this rank's S / C tokens (the balanced split of the data), each
layer sleeps 1/C of its times around the ring attention's real exchange of keys and values
(:meth:`EmulatedCompute.layer`, :mod:`.ring`), and the output layer 1/C of its times.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import TransformerLayer


class EmulatedTransformerLayer(TransformerLayer):
    """A decoder layer whose forward and backward sleep the calibrated times of one layer.

    Its submodules with parameters (norms, linear layers) still run, in their order, as modules that take
    no time and hand back a zero gradient of their parameters' size: megatron's DDP dispatches the next
    parameter all-gather bucket from each module's forward pre-hook, and a module that never runs would
    stop that chain."""

    def __init__(self, *args, emulated_compute=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.emulated_compute = emulated_compute
        self._parts = [m for m in self.modules() if m is not self and next(m.parameters(recurse=False), None) is not None]
        for module in self._parts:
            _emulate(module, emulated_compute, 0.0, 0.0, lambda x: x.shape)

    def forward(self, hidden_states, *args, **kwargs):
        compute = self.emulated_compute
        hidden = hidden_states
        for module in self._parts:   # each on its parameters as registered when it runs (FSDP: the gathered)
            hidden = module(hidden)
        return compute.layer(hidden, list(self.parameters(recurse=False)))


class EmulatedGPTModel(GPTModel):
    """A GPTModel (one pipeline chunk, or the whole model under FSDP) whose forward sleeps."""

    def __init__(self, *args, emulated_compute=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.emulated_compute = emulated_compute
        if self.pre_process:
            embedding = self.embedding

            def embed(input_ids, position_ids, *args, **kwargs):
                batch, seq = input_ids.shape
                shape = (seq, batch, self.config.hidden_size)
                params = list(embedding.parameters())
                return emulated_compute.block(params[0].new_empty(shape), shape, 0.0, 0.0, params)

            embedding.forward = embed
        if self.post_process:
            times = emulated_compute.times
            if self.decoder.final_layernorm is not None:
                _emulate(self.decoder.final_layernorm, emulated_compute, 0.0, 0.0, lambda x: x.shape)
            # the output layer's logits and the loss, slept: per-token losses [b, s] from [s, b, h]
            cp = emulated_compute.context_parallel_size   # per token: 1/C of the sequence's times
            _emulate(self.output_layer, emulated_compute, times.head_forward / cp, times.head_backward / cp,
                     lambda x: (x.shape[1], x.shape[0]))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **_):
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids, position_ids=position_ids)
        else:
            hidden = self.decoder.input_tensor
        for layer in self.decoder.layers:
            hidden = layer(hidden)
        if not self.post_process:
            return hidden
        if self.decoder.final_layernorm is not None:
            hidden = self.decoder.final_layernorm(hidden)
        return self.output_layer(hidden).float()


def _emulate(module, compute, forward_s: float, backward_s: float, out_shape) -> None:
    """Make ``module`` (called as a module, so its hooks fire) sleep ``forward_s`` / ``backward_s`` on its own
    parameters as registered when it runs, returning a tensor of ``out_shape(input)``."""
    def forward(x, *args, **kwargs):
        if isinstance(x, tuple):   # a part handed (output, bias)
            x = x[0]
        return compute.block(x, tuple(out_shape(x)), forward_s, backward_s, list(module.parameters()))

    module.forward = forward


def emulated_layer_spec(layer_spec, compute):
    """A decoder layer's ``ModuleSpec`` with the layer emulated (same submodules, so the same parameters)."""
    if layer_spec.module is not TransformerLayer:
        raise ValueError(f"emulated compute needs megatron-core's TransformerLayer, the spec has {layer_spec.module}")
    return dataclasses.replace(layer_spec, module=EmulatedTransformerLayer,
                               params={**layer_spec.params, "emulated_compute": compute})
