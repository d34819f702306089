"""The real compute of a weight-pipeline rank: one shard's decoder layers forward and backward.

The plan executor calls the model's ``forward`` / ``backward`` for each (micro-batch, shard) action; the model
hands them to its compute: this class, or emulated compute (:class:`megatron_tawpipe.emulation.EmulatedCompute`)
with the same two methods.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple

import torch

from megatron_tawpipe.common.errors import ExecutionError
from megatron_tawpipe.models.deferred_linear import WgradStore, te_wgrad_modules
from megatron_tawpipe.runtime.precision import RngSnapshot


class ShardCompute(Protocol):
    """What a weight-pipeline model is given to run its plan's compute actions."""

    def reset(self) -> None:
        """A run of the plan starts (the model's ``microbatches`` are new)."""

    def forward(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        """Forward of micro-batch ``mb`` through ``shard`` with its compute-dtype ``weights``."""

    def backward(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        """Backward of (``mb``, ``shard``), accumulating the shard's weight gradient into ``grad_buffer``."""

    def backward_input(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        """The input-gradient half of a split backward (for the previous shard's backward)."""

    def backward_weight(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        """The weight-gradient half, after ``backward_input`` of the same (``mb``, ``shard``)."""


class LayerCompute:
    """Runs a shard's layers on the weights the executor delivers (bound to the shard template)."""

    def __init__(self, model):
        self.model = model
        self.template = model.template
        self._layer_params = self.template.layer_parameters()
        self._index = {id(param): i for i, param in enumerate(self._layer_params)}

    def reset(self) -> None:
        """Start a run: no activations, gradients or RNG snapshots held."""
        args = self.model.args
        self._inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._output_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self._losses: Dict[int, torch.Tensor] = {}
        # Split backward: the small gradients (norms, biases) B computed for (mb, shard)'s layers, by their index
        # in the flat layout, until W; the deferred kernels wait in the template's store.
        self._pending: Dict[Tuple[int, int], List[Tuple[int, torch.Tensor]]] = {}
        if self.template.wgrad_store is not None:
            self.template.wgrad_store.clear()
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
        store = self.template.wgrad_store
        if store is not None and store.kind == "te":   # TE's layers defer always: both halves, at once
            self.backward_input(mb, shard, weights)
            self.backward_weight(mb, shard, weights, grad_buffer)
            return
        # (The deferred local layers compute both gradients in a backward their store does not record.)
        hidden, root, grad = self._graph(mb, shard, self._bind(weights, shard))
        root.backward(grad)
        if shard > 0:
            self._output_grads[(mb, shard - 1)] = hidden.grad
        self._collect(mb, shard, grad_buffer)

    def backward_input(self, mb: int, shard: int, weights: torch.Tensor) -> None:
        """B of a split backward: one autograd pass gives the gradient of the shard's input, for the previous
        shard's backward, now, and leaves the decoder layers' linear weight-gradient kernels in the template's
        :class:`~megatron_tawpipe.models.deferred_linear.WgradStore` under (``mb``, ``shard``) (their
        tensor-parallel input-gradient communication runs here). What else autograd computes here is small and
        walked once: the layers' norm weights and the biases added outside a matrix multiply (held, in the
        compute dtype, until :meth:`backward_weight`), and the embedding's, final norm's and output layer's
        (through the loss), added to the replicated accumulators now."""
        store = self._store()
        hidden, root, grad = self._graph(mb, shard, self._bind(weights, shard))
        with store.recording((mb, shard)):
            root.backward(grad)
        if shard > 0:
            self._output_grads[(mb, shard - 1)] = hidden.grad
        held = []
        for index, param in enumerate(self._layer_params):
            if param.grad is not None:
                held.append((index, param.grad))
                param.grad = None
        self._pending[(mb, shard)] = held
        self.template.replicated_grads_into(self.model.replicated_grads())

    def backward_weight(self, mb: int, shard: int, weights: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        """W of a split backward: the weight-gradient kernels (``grad_output^T @ input``, bias sums) that
        :meth:`backward_input` of (``mb``, ``shard``) left, added into ``grad_buffer`` with the gradients it
        held. Only the saved inputs and output gradients are needed: ``weights`` are not bound again, except for
        Transformer Engine's ``backward_dw()``, which writes the bound weights' ``.grad``."""
        store = self._store()
        views = self.template.views(grad_buffer)
        if store.kind == "te":
            store.pop((mb, shard))   # (checks that Transformer Engine's queues give this backward's work)
            layers = self._bind(weights, shard)
            for module in te_wgrad_modules(list(self.template.layers)[:layers]):
                module.backward_dw()
            self.template.layer_grads_into(grad_buffer)
        else:
            for entry in store.pop((mb, shard)):
                grad_weight, grad_bias = entry.compute()
                views[self._index[id(entry.weight)]].add_(grad_weight)
                if grad_bias is not None:
                    views[self._index[id(entry.bias)]].add_(grad_bias)
        for index, grad in self._pending.pop((mb, shard)):
            views[index].add_(grad)
        if shard == 0:
            self.model.microbatches.release(mb)

    def _store(self) -> WgradStore:
        if self.template.wgrad_store is None:
            raise ExecutionError("a split backward (BackwardInput/BackwardWeight) needs the shard template built "
                                 "with split_backward=True (deferred weight-gradient layers)")
        return self.template.wgrad_store

    def _graph(self, mb: int, shard: int, layers: int):
        """(input, what to differentiate, its incoming gradient) of (``mb``, ``shard``): recomputed, or the
        forward's kept graph."""
        model = self.model
        if model.recompute:
            hidden, out = self._recompute(mb, shard, layers)
        else:
            hidden, out = self._inputs.pop((mb, shard), None), self._outputs.pop((mb, shard))
        if shard + 1 == model.plan.num_shards:
            return hidden, (self._loss(mb, out)[0] if model.recompute else self._losses.pop(mb)), None
        return hidden, out, self._output_grads.pop((mb, shard))

    def _collect(self, mb: int, shard: int, grad_buffer: torch.Tensor) -> None:
        self.template.layer_grads_into(grad_buffer)
        self.template.replicated_grads_into(self.model.replicated_grads())
        if shard == 0:
            self.model.microbatches.release(mb)

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
