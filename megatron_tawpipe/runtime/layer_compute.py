"""The real compute of a weight-pipeline rank: one shard's decoder layers forward and backward.

The plan executor calls the model's ``forward`` / ``backward`` for each (micro-batch, shard) action; the model
hands them to its compute: this class, or emulated compute (:class:`megatron_tawpipe.emulation.EmulatedCompute`)
with the same two methods.
"""

from __future__ import annotations

from typing import Dict, Optional, Protocol, Tuple

import torch

from megatron_tawpipe.runtime.precision import RngSnapshot


class ShardCompute(Protocol):
    """What a weight-pipeline model is given to run its plan's compute actions."""

    def reset(self) -> None:
        """A run of the plan starts (the model's ``microbatches`` are new)."""

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        """Forward of micro-batch ``mb`` through ``shard`` with its compute-dtype ``weights``."""

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        """Backward of (``mb``, ``shard``), accumulating the shard's weight gradient into ``grad_buffer``."""


class LayerCompute:
    """Runs a shard's layers on the weights the executor delivers (bound to the shard template)."""

    def __init__(self, model):
        self.model = model
        self.template = model.template

    def reset(self) -> None:
        """Start a run: no activations, gradients or RNG snapshots held."""
        args = self.model.args
        self._inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._output_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self._losses: Dict[int, torch.Tensor] = {}
        needs_rng = args.hidden_dropout > 0 or args.attention_dropout > 0
        self._rng: Optional[Dict[Tuple[int, int], RngSnapshot]] = {} if needs_rng and self.model.recompute else None
        self._rotary = self.template.rotary(args.seq_length)

    def _bind(self, weights: torch.Tensor, shard: int) -> int:
        """Bind the shard's weights (the executor's view of its layers); returns its layer count."""
        layers = self.template.bind(weights) if self.model.recompute else self.template.bind_by_copy(weights)
        if layers != self.model.plan.shard_layers[shard]:
            raise RuntimeError(f"shard {shard} has {self.model.plan.shard_layers[shard]} layers, its weights {layers}")
        return layers

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        model, batches = self.model, self.model.microbatches
        if shard == 0:
            batches.start(mb)
        batch = batches.inputs[mb]
        layers = self._bind(weights, shard)
        keep_graph = not model.recompute and not batches.forward_only
        if self._rng is not None and not batches.forward_only:
            self._rng[(mb, shard)] = RngSnapshot.capture()
        with torch.set_grad_enabled(keep_graph):
            if shard == 0:
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
                if not keep_graph:
                    self._inputs[(mb, 0)] = hidden
            else:
                hidden = self._inputs[(mb, shard)]
                if keep_graph:
                    hidden = hidden.detach().requires_grad_(True)
                    self._inputs[(mb, shard)] = hidden
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"], layers)
            if keep_graph:
                self._outputs[(mb, shard)] = out
            if shard + 1 < model.plan.num_shards:
                self._inputs[(mb, shard + 1)] = out.detach() if keep_graph else out
            else:
                loss, report = self._loss(mb, out)
                if keep_graph:
                    self._losses[mb] = loss
                batches.finish_forward(mb, report)

    def _loss(self, mb: int, out: torch.Tensor) -> Tuple[torch.Tensor, object]:
        """loss_func on the per-token losses, normalised like megatron and averaged over ranks."""
        batches = self.model.microbatches
        per_token = self.template.head_loss(out, batches.inputs[mb]["labels"])
        loss, report = batches.loss(mb, per_token)
        return self.model.loss_scale_func(loss / self.model.world), report

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        model = self.model
        layers = self._bind(weights, shard)
        if model.recompute:
            hidden, out = self._recompute(mb, shard, layers)
        else:
            hidden, out = self._inputs.pop((mb, shard), None), self._outputs.pop((mb, shard))
        if shard + 1 == model.plan.num_shards:
            loss = self._loss(mb, out)[0] if model.recompute else self._losses.pop(mb)
            loss.backward()
        else:
            out.backward(self._output_grads.pop((mb, shard)))
        if shard > 0:
            self._output_grads[(mb, shard - 1)] = hidden.grad
        self.template.layer_grads_into(grad_buffer)
        self.template.replicated_grads_into(model.replicated_grads())
        if shard == 0:
            model.microbatches.release(mb)

    def _recompute(self, mb: int, shard: int, layers: int):
        """Full recompute of (mb, shard), replaying the forward's RNG state (dropout)."""
        batch = self.model.microbatches.inputs[mb]
        snapshot = self._rng.pop((mb, shard)) if self._rng is not None else None
        with RngSnapshot.replay(snapshot), torch.enable_grad():
            if shard == 0:  # recompute the embedding so that its weights get gradients
                hidden = self.template.embed(batch["tokens"], batch["position_ids"])
                self._inputs.pop((mb, 0))
            else:
                hidden = self._inputs.pop((mb, shard)).detach().requires_grad_(True)
            out = self.template.run_layers(hidden, self._rotary, batch["attention_mask"], layers)
        return hidden, out
