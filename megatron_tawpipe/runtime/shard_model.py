"""Model adapter for weight passing: one shard's worth of Megatron layers, run for any shard.

Every decoder layer has the same shapes, so a rank builds a single template of
as many megatron-core decoder layers as the largest shard has (plus the replicated
embedding, final norm and output layer) and runs shard ``s`` by pointing the
template's parameters at a flat buffer that holds shard ``s``'s weights.
Flat buffers are what travels between ranks; parameters are views into them.
The template's parameters lie layer after layer in the flat layout, so a shard of
``n`` layers is the first ``n`` layers' worth of a buffer and runs the template's
first ``n`` layers (shards may differ in size: ``Plan.shard_layers``).

With ``--tensor-model-parallel-size T`` the template is built from megatron-core's
tensor-parallel layers: each rank's flat buffer holds its column- and row-parallel
slices (and its copy of what tensor parallelism does not split), so a shard's buffer
is about 1/T of the shard; the embedding and output layer are vocabulary-parallel.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_tawpipe.common.layer_split import layer_offsets
from megatron_tawpipe.models.initialization import init_parameter
from megatron_tawpipe.models.deferred_linear import WgradStore, deferred_wgrad_kind
from megatron_tawpipe.models.llama import construct_llama_model, llama_config, params_dtype, resolve_attention_backend
from megatron_tawpipe.models.parameters import mark_tensor_parallel_weights


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one template parameter lives inside a shard's flat buffer."""

    local_name: str          # name inside one template layer stack, e.g. "1.mlp.linear_fc1.weight"
    offset: int
    shape: Tuple[int, ...]
    partition_dim: int = -1  # the dimension tensor parallelism splits; -1: whole on every tensor-parallel rank
    tp_reduce: bool = False  # its gradient is a partial sum over the tensor-parallel group (all-reduced)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ShardTemplate:
    """The GPTModel the flags describe with the largest shard's decoder layers, rebindable to any shard
    (``shard_layers[s]`` layers of shard ``s``)."""

    def __init__(self, args, shard_layers: Sequence[int], device: torch.device, split_backward: bool = False):
        self.args = args
        self.shard_layers = tuple(shard_layers)
        self.num_shards = len(self.shard_layers)
        self.first_layer = layer_offsets(self.shard_layers)
        self.max_layers = max(self.shard_layers)
        # The full-model config decides initialisation (output-projection std uses all layers).
        self.full_config = llama_config(args)
        # No fp32 ``main_grad`` on the template's parameters: weights are rebound per shard
        # (``param.data`` views of a flat buffer) and wgrads leave through autograd's
        # ``param.grad`` into the plan's gradient buffers (layer_grads_into), so megatron's
        # fused wgrad accumulation, which writes into ``weight.main_grad``, stays off.
        # (Enabling it would need a template-owned fp32 main_grad flat buffer bound once as
        # views, drained into the plan buffer after each backward, and the same for the
        # output layer among the replicated parts.) The other fusions follow llama_config.
        self.tensor_parallel_size = args.tensor_model_parallel_size
        template_config = llama_config(args, main_grad_buffers=False,
                                       tensor_model_parallel_size=self.tensor_parallel_size,
                                       sequence_parallel=args.sequence_parallel)
        template_config.num_layers = self.max_layers
        # A split backward (plans with BackwardInput/BackwardWeight) defers the layers' weight-gradient
        # kernels to its weight pass: deferred local linear layers in the spec, or Transformer Engine's
        # delay_wgrad_compute (set on the built config: megatron-core's own check ties the field to its MoE
        # overlap schedule, the TE layers only read it). ``wgrad_store`` holds the deferred work.
        self.wgrad_store: Optional[WgradStore] = None
        if split_backward:
            kind = deferred_wgrad_kind(resolve_attention_backend(args.attention_backend, args))
            self.wgrad_store = WgradStore(kind)
            template_config.delay_wgrad_compute = kind == "te"
        self.config = template_config
        local_store = self.wgrad_store if self.wgrad_store is not None and self.wgrad_store.kind == "local" else None
        self.model = construct_llama_model(args, template_config, wgrad_store=local_store).to(device)
        if self.tensor_parallel_size > 1:
            mark_tensor_parallel_weights(self.model)
        if template_config.params_dtype != torch.float32:
            # As megatron's Float16Module does for the native schedules: torch's own modules (norms,
            # learned position embeddings) are created in fp32 and must compute in bf16/fp16 too.
            self.model.to(template_config.params_dtype)
        self.device = device
        self.layers = self.model.decoder.layers
        self.slots = self._layout()
        self.shard_numel = sum(slot.numel for slot in self.slots)   # the largest shard: a buffer
        self.layer_numel = self.shard_numel // self.max_layers
        self._layer_params = [param for _, param in self.layers.named_parameters()]
        self._params_per_layer = len(self._layer_params) // self.max_layers
        for param in self._layer_params:
            param.requires_grad_(True)
        # Weight slot for copy-binding (bind_by_copy, no-recompute mode only): allocated on first
        # use, so that recompute mode keeps no spare shard copy.
        self._slot: Optional[torch.Tensor] = None
        self._slot_dtype = template_config.params_dtype
        self._unbound = torch.empty(0, dtype=template_config.params_dtype, device=device)
        self._init_replicated(args.seed)

    # ---- layout ---------------------------------------------------------------------

    def _layout(self) -> List[ParamSlot]:
        slots, offset = [], 0
        for name, param in self.layers.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            slots.append(ParamSlot(name, offset, tuple(param.shape), param.partition_dim if split else -1,
                                   self.gradient_is_partial(name, param)))
            offset += param.numel()
        # A shard of n layers is the first n layers' worth of a buffer: every layer must lie alike.
        per_layer = [[(slot.local_name.split(".", 1)[1], slot.shape) for slot in slots
                      if slot.local_name.split(".", 1)[0] == str(i)] for i in range(self.max_layers)]
        if any(layer != per_layer[0] for layer in per_layer):
            raise ValueError("the decoder layers of one shard differ in their parameters; weight passing needs "
                             "every layer alike")
        return slots

    def layout_fingerprint(self) -> List[int]:
        """``[buffer elements, elements per layer, checksum of the parameter names and shapes]``: equal on
        every rank, or their transfers would not match (a node whose layer spec differs, e.g. without
        Transformer Engine, lays its buffers out otherwise)."""
        text = ";".join(f"{slot.local_name}:{slot.shape}" for slot in self.slots)
        return [self.shard_numel, self.layer_numel, zlib.crc32(text.encode())]

    def gradient_is_partial(self, name: str, param: torch.Tensor) -> bool:
        """Whether a parameter's gradient on one tensor-parallel rank is a partial sum (all-reduced over
        the group after the backward, as megatron-core's ``finalize_model_grads`` does): weights marked
        ``sequence_parallel`` under --sequence-parallel, and the query/key norms, which see only the
        rank's heads."""
        if self.tensor_parallel_size == 1 or getattr(param, "tensor_model_parallel", False):
            return False
        if self.config.sequence_parallel and getattr(param, "sequence_parallel", False):
            return True
        return bool(self.config.qk_layernorm) and ("q_layernorm" in name or "k_layernorm" in name)

    def numel_of(self, shard: int) -> int:
        """Elements of ``shard``'s flat weights (a prefix of a buffer)."""
        return self.shard_layers[shard] * self.layer_numel

    def slots_of(self, shard: int) -> List[ParamSlot]:
        """The slots of ``shard``'s layers: the template's first ``shard_layers[shard]`` layers."""
        return self.slots[:self.shard_layers[shard] * self._params_per_layer]

    def _slots_for(self, flat: torch.Tensor) -> List[ParamSlot]:
        """The slots a flat tensor of whole layers covers."""
        layers, rest = divmod(flat.numel(), self.layer_numel)
        if rest or not 1 <= layers <= self.max_layers:
            raise ValueError(f"a flat buffer of {flat.numel()} elements is not 1 to {self.max_layers} layers of "
                             f"{self.layer_numel}")
        return self.slots[:layers * self._params_per_layer]

    def global_name(self, shard: int, slot: ParamSlot) -> str:
        local_layer, rest = slot.local_name.split(".", 1)
        return f"decoder.layers.{self.first_layer[shard] + int(local_layer)}.{rest}"

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Parameter-shaped views of ``flat``: one shard's weights or gradients (its first layers' slots)."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self._slots_for(flat)]

    def tagged_views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """:meth:`views` carrying megatron-core's tensor-parallel attributes (``tensor_model_parallel``,
        ``partition_dim``): what initialisation, checkpoints and the gradient norm read."""
        views = self.views(flat)
        for slot, view in zip(self.slots, views):
            if slot.partition_dim >= 0:
                view.tensor_model_parallel, view.partition_dim, view.partition_stride = True, slot.partition_dim, 1
        return views

    def init_shard(self, shard: int, flat: torch.Tensor) -> None:
        """Initial weights of ``shard``: the same values (this rank's slices of them) a whole-model build gets."""
        for slot, view in zip(self.slots_of(shard), self.tagged_views(flat)):
            init_parameter(view, self.global_name(shard, slot), self.args.seed, self.full_config)

    # ---- replicated parts -----------------------------------------------------------

    def replicated_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """Embedding, final norm and (untied) output layer, under their global names."""
        out = []
        for name, param in self.model.named_parameters():
            if not name.startswith("decoder.layers."):
                out.append((name, param))
        return out

    def _init_replicated(self, seed: int) -> None:
        for name, param in self.replicated_parameters():
            init_parameter(param, name, seed, self.full_config)  # the parameter: its tensor-parallel attributes

    # ---- binding and running ------------------------------------------------------

    def bind(self, flat: torch.Tensor) -> int:
        """Point the template's first decoder layers' parameters at ``flat`` (no copy): as many layers
        as ``flat`` holds, which it returns.

        For full recompute: each computation builds and consumes its own graph.
        """
        views = self.views(flat)
        for param, view in zip(self._layer_params, views):
            param.data = view
            param.grad = None
        for param in self._layer_params[len(views):]:   # layers this shard does not run hold no buffer
            param.data = self._unbound
            param.grad = None
        return len(views) // self._params_per_layer

    def unbind(self) -> None:
        """Let go of every buffer the decoder layers' parameters point at (before the buffers are freed)."""
        for param in self._layer_params:
            param.data = self._unbound
            param.grad = None

    def bind_by_copy(self, flat: torch.Tensor) -> int:
        """Copy ``flat`` into the template's own weight slot.

        Without recompute, a forward's autograd graph lives until that
        micro-batch's backward and refers to the parameters as they are
        *then*: the backward copies its shard's weights into the same slot
        (bypassing autograd's version counter, since the values are the ones
        the forward used) and runs the stored graph.
        """
        if self._slot is None:
            self._slot = torch.empty(self.shard_numel, dtype=self._slot_dtype, device=self.device)
        if self._layer_params[0].data_ptr() != self._slot.data_ptr():
            for param, view in zip(self._layer_params, self.views(self._slot)):
                param.data = view
        layers = len(self._slots_for(flat)) // self._params_per_layer   # (checks whole layers)
        with torch.no_grad():
            self._slot[:flat.numel()].copy_(flat)
        return layers

    def trainable_parameters(self) -> List[torch.nn.Parameter]:
        """Every parameter a shard's backward can reach: the decoder layers' and the replicated ones."""
        return list(self._layer_params) + [param for _, param in self.replicated_parameters()]

    def layer_parameters(self) -> List[torch.nn.Parameter]:
        """The decoder layers' parameters in the order of a flat buffer's :meth:`views`."""
        return list(self._layer_params)

    def layer_grads_into(self, grad_flat: torch.Tensor) -> None:
        """Add the template's accumulated layer gradients into ``grad_flat`` (one shard's: its first
        layers' worth) and clear them all."""
        views = self.views(grad_flat)
        for i, param in enumerate(self._layer_params):
            if param.grad is not None:
                if i < len(views):
                    views[i].add_(param.grad)
                param.grad = None

    def replicated_grads_into(self, grads: List[torch.Tensor]) -> None:
        """Add the replicated parameters' gradients into fp32 accumulators and clear them."""
        for (_, param), grad in zip(self.replicated_parameters(), grads):
            if param.grad is not None:
                grad.add_(param.grad)
                param.grad = None

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embedding(input_ids=tokens, position_ids=position_ids)

    def rotary(self, seq_len: int) -> Optional[torch.Tensor]:
        """Rotary embeddings for ``seq_len`` positions; None for learned absolute or no positions."""
        if self.model.position_embedding_type != "rope":
            return None
        return self.model.rotary_pos_emb(seq_len)

    def run_layers(self, hidden: torch.Tensor, rotary: Optional[torch.Tensor],
                   attention_mask: Optional[torch.Tensor], num_layers: Optional[int] = None) -> torch.Tensor:
        """The template's first ``num_layers`` decoder layers (default: all) on ``hidden``."""
        for layer in list(self.layers)[:num_layers]:
            hidden, _ = layer(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary)
        return hidden

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Final norm, output layer and per-token cross entropy ``[b, s]``."""
        hidden = self.model.decoder.final_layernorm(hidden)
        weight = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights else None
        logits, _ = self.model.output_layer(hidden, weight=weight)
        return self.model.compute_language_model_loss(labels, logits)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)


def bound_shard_template(args, layers: int, device: torch.device) -> Tuple[ShardTemplate, torch.Tensor]:
    """A template of one shard of ``layers`` decoder layers on ``device``, in training mode, bound to a weight
    buffer holding shard 0's initial weights: ``(template, weights)`` (the measuring tools' shard)."""
    shard_args = copy.copy(args)
    shard_args.num_layers = layers
    template = ShardTemplate(shard_args, shard_layers=(layers,), device=device)
    weights = torch.empty(template.shard_numel, dtype=params_dtype(shard_args), device=device)
    template.init_shard(0, weights)
    template.bind(weights)
    template.train(True)
    return template, weights
