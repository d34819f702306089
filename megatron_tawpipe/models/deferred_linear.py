"""Deferred weight-gradient kernels for megatron-core's local (torch) linear layers: a split backward.

A split backward runs in two passes: B, the input gradient (what the previous layers' backward needs), and
W, later, the weight gradient. :class:`DeferredColumnParallelLinear` and :class:`DeferredRowParallelLinear`
are megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` whose matrix multiply is this module's
autograd function. Its backward computes only the input gradient (``grad_output @ weight``, with the
tensor-parallel all-reduce or sequence-parallel reduce-scatter of it that megatron's does) and, while a
:class:`WgradStore` is recording a (micro-batch, shard), leaves ``(input, grad_output)`` in the store
instead of computing ``grad_output^T @ input``; :meth:`WgradStore.pop` returns them and
:meth:`DeferredWgrad.compute` runs the weight (and bias) gradient kernels as megatron's backward would.
Outside a recording the layers compute both gradients in their backward, like megatron's.

The layers are given through the layer spec (:func:`deferred_layer_spec`); megatron's modules are not
patched (the override of megatron's private hook is registered, and checked, in
:mod:`megatron_tawpipe.compat.patches`). With Transformer Engine's layer the split is TE's own
(``delay_wgrad_compute`` and each TE linear's ``backward_dw()``, TE >= 2.3): :func:`deferred_wgrad_kind`
chooses, :func:`te_wgrad_modules` finds the modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_tawpipe.compat import patches

Key = Tuple[int, int]   # (micro-batch, shard)

TE_MIN_VERSION = (2, 3)


@dataclasses.dataclass
class DeferredWgrad:
    """One linear layer's weight-gradient work of one backward: its (gathered) input and output gradient,
    2-D and contiguous as megatron's wgrad GEMM takes them."""

    weight: torch.nn.Parameter
    bias: Optional[torch.nn.Parameter]
    total_input: torch.Tensor    # [s*b (all tensor-parallel ranks' with sequence parallelism), in]
    grad_output: torch.Tensor    # [s*b, out]

    def compute(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(weight gradient, bias gradient or None)``: megatron's non-fused kernels."""
        with torch.no_grad():
            grad_weight = self.grad_output.t().matmul(self.total_input)
            grad_bias = self.grad_output.sum(dim=0) if self.bias is not None else None
        return grad_weight, grad_bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.total_input, self.grad_output))


class WgradStore:
    """The weight-gradient work a split backward's B leaves for its W, by (micro-batch, shard).

    ``kind`` is "local" (this module's layers push :class:`DeferredWgrad` entries) or "te" (Transformer
    Engine's layers keep their own first-in-first-out queues; the store keeps the order of the keys so
    that a W out of that order is refused instead of taking another backward's gradients)."""

    def __init__(self, kind: str = "local"):
        if kind not in ("local", "te"):
            raise ValueError(f"WgradStore kind must be 'local' or 'te', got {kind!r}")
        self.kind = kind
        self._entries: Dict[Key, List[DeferredWgrad]] = {}
        self._order: List[Key] = []
        self._recording: Optional[Key] = None
        self.peak_bytes = 0
        self.deferred_gemms = 0   # weight-gradient GEMMs left to W (counted as they are stored)
        self.eager_gemms = 0      # weight-gradient GEMMs run in a backward outside a recording

    @contextlib.contextmanager
    def recording(self, key: Key) -> Iterator[None]:
        """Backwards run inside leave their weight-gradient work under ``key``."""
        if self._recording is not None:
            raise RuntimeError(f"the weight-gradient store is recording {self._recording} already, not {key}")
        if key in self._entries or key in self._order:
            raise RuntimeError(f"the weight-gradient store holds {key} already (its weight pass has not run)")
        self._entries[key] = []
        self._order.append(key)
        self._recording = key
        try:
            yield
        finally:
            self._recording = None
            self.peak_bytes = max(self.peak_bytes, self.bytes_held())

    @property
    def is_recording(self) -> bool:
        return self._recording is not None

    def push(self, entry: DeferredWgrad) -> None:
        self._entries[self._recording].append(entry)
        self.deferred_gemms += 1

    def pop(self, key: Key) -> List[DeferredWgrad]:
        """The work recorded under ``key``, removed from the store. With Transformer Engine's queues the
        keys must leave in the order they came."""
        if key not in self._entries:
            raise RuntimeError(f"no weight-gradient work recorded for (micro-batch, shard) {key}")
        if self.kind == "te" and self._order[0] != key:
            raise RuntimeError(f"Transformer Engine's deferred weight gradients leave first in, first out: the "
                               f"weight pass of {key} runs before that of {self._order[0]}")
        self._order.remove(key)
        return self._entries.pop(key)

    def keys(self) -> List[Key]:
        return list(self._order)

    def bytes_held(self) -> int:
        """Bytes of the tensors the store holds now (each stored tensor counted once)."""
        seen, total = set(), 0
        for entries in self._entries.values():
            for entry in entries:
                for t in (entry.total_input, entry.grad_output):
                    ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                    if ptr not in seen:
                        seen.add(ptr)
                        total += t.numel() * t.element_size()
        return total

    def clear(self) -> None:
        self._entries.clear()
        self._order.clear()
        self._recording = None
        self.peak_bytes = 0


def _gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    size = list(tensor.shape)
    size[0] *= dist.get_world_size(group)
    out = torch.empty(size, dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out


def _flat2d(tensor: torch.Tensor) -> torch.Tensor:
    """2-D and contiguous, detached (a stored tensor must not keep the backward's graph alive)."""
    tensor = tensor.detach().contiguous()
    return tensor.view(-1, tensor.shape[-1]) if tensor.dim() == 3 else tensor


class DeferredWgradLinear(torch.autograd.Function):
    """``input @ weight^T (+ bias)`` as megatron's linear computes it; its backward leaves the weight
    gradient to the store while it records."""

    @staticmethod
    def forward(ctx, input, weight, bias, store: WgradStore, allreduce_dgrad: bool, sequence_parallel: bool,
                tp_group):
        ctx.save_for_backward(input, weight)
        ctx.weight_param, ctx.bias_param = weight, bias
        ctx.store, ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = (store, allreduce_dgrad,
                                                                              sequence_parallel, tp_group)
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        store = ctx.store
        # The input gradient, and its tensor-parallel communication, here (B).
        total_input = _gather_sequence(input, ctx.tp_group) if ctx.sequence_parallel else input
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        if ctx.sequence_parallel:
            scattered = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            dist.reduce_scatter_tensor(scattered, grad_input.contiguous(), group=ctx.tp_group)
            grad_input = scattered
        entry = DeferredWgrad(ctx.weight_param, ctx.bias_param, _flat2d(total_input), _flat2d(grad_output))
        if store.is_recording:   # the weight gradient: later (W)
            store.push(entry)
            return grad_input, None, None, None, None, None, None
        store.eager_gemms += 1
        grad_weight, grad_bias = entry.compute()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _check_supported(layer) -> None:
    config = layer.config
    if getattr(layer, "gradient_accumulation_fusion", False):
        raise ValueError("deferred weight gradients (a split backward) need --no-gradient-accumulation-fusion: the "
                         "weight-passing template keeps megatron's fused main_grad accumulation off")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("deferred weight gradients (a split backward) and --defer-embedding-wgrad-compute "
                         "exclude each other")
    if getattr(layer, "explicit_expert_comm", False) or getattr(layer, "is_expert", False):
        raise ValueError("deferred weight gradients (a split backward) do not support expert layers "
                         "(--num-experts)")
    if getattr(layer, "gtp_remat_size", 1) > 1:
        raise ValueError("deferred weight gradients (a split backward) do not support GTP-sharded weights")


class _Deferred:
    """The matrix multiply of megatron's linear (its private ``_forward_impl`` hook, overridden: the registered
    patch ``deferred-linear-forward-impl`` of :mod:`megatron_tawpipe.compat.patches`) on
    :class:`DeferredWgradLinear`."""

    def _init_deferred(self, wgrad_store: WgradStore) -> None:
        patches.check("deferred-linear-forward-impl")   # the override's hook, in the releases it is written for
        _check_supported(self)
        self.wgrad_store = wgrad_store

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                      gtp_remat_size=1, **unknown):
        if not weight.requires_grad:   # frozen weights: megatron's own path, nothing to defer
            return super()._forward_impl(input, weight, bias=bias, gradient_accumulation_fusion=
                                         gradient_accumulation_fusion, allreduce_dgrad=allreduce_dgrad,
                                         sequence_parallel=sequence_parallel, grad_output_buffer=grad_output_buffer,
                                         wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **unknown)
        if unknown or gradient_accumulation_fusion or grad_output_buffer is not None or gtp_remat_size > 1:
            raise ValueError(f"deferred weight gradients cannot run this linear layer's options "
                             f"(gradient_accumulation_fusion={gradient_accumulation_fusion}, "
                             f"grad_output_buffer={grad_output_buffer is not None}, gtp_remat_size={gtp_remat_size}, "
                             f"{sorted(unknown)})")
        if (allreduce_dgrad or sequence_parallel) and tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        return DeferredWgradLinear.apply(input, weight, bias, self.wgrad_store, bool(allreduce_dgrad),
                                         bool(sequence_parallel), tp_group)


class DeferredColumnParallelLinear(_Deferred, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear whose weight gradient a split backward's W computes."""

    def __init__(self, *args, wgrad_store: WgradStore, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_deferred(wgrad_store)


class DeferredRowParallelLinear(_Deferred, RowParallelLinear):
    """megatron-core's RowParallelLinear whose weight gradient a split backward's W computes (its bias, added
    after the tensor-parallel reduction outside the matrix multiply, gets its gradient in B)."""

    def __init__(self, *args, wgrad_store: WgradStore, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_deferred(wgrad_store)


_REPLACED = {ColumnParallelLinear: DeferredColumnParallelLinear, RowParallelLinear: DeferredRowParallelLinear}


def _submodules(spec):
    """A module spec's submodules: a ModuleSpec's, or those a ``functools.partial`` builder is given
    (megatron-core 0.19's MLP spec)."""
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    keywords = getattr(spec, "keywords", None) or {}
    if "submodules" not in keywords:
        raise ValueError(f"deferred weight gradients cannot find the linear layers of the spec {spec!r}")
    return keywords["submodules"]


def deferred_layer_spec(spec: ModuleSpec, store: WgradStore) -> ModuleSpec:
    """``spec`` (megatron-core's local decoder-layer spec) with its attention and MLP linear layers the
    deferred ones, all leaving their work in ``store``; the spec given is not changed."""
    import copy

    spec = copy.deepcopy(spec)
    count = 0
    for owner in (_submodules(spec.submodules.self_attention), _submodules(spec.submodules.mlp)):
        for name in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            module = getattr(owner, name, None)
            if module is None:
                continue
            cls = module.module if isinstance(module, ModuleSpec) else module
            if cls not in _REPLACED:
                raise ValueError(f"deferred weight gradients need megatron-core's local linear layers; the spec's "
                                 f"{name} is {getattr(cls, '__name__', cls)}")
            params = dict(module.params) if isinstance(module, ModuleSpec) else {}
            setattr(owner, name, ModuleSpec(module=_REPLACED[cls], params={**params, "wgrad_store": store}))
            count += 1
    if count != 4:
        raise ValueError(f"deferred weight gradients expect 4 linear layers in a decoder layer's spec, found {count}")
    return spec


def te_version() -> Optional[Tuple[int, ...]]:
    """Transformer Engine's installed version (major, minor), or None where it is not installed."""
    from importlib import metadata

    for name in ("transformer-engine", "transformer_engine"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return None


def deferred_wgrad_kind(backend: str, version: Optional[Tuple[int, ...]] = None) -> str:
    """How a split backward defers its weight gradients for the layer ``backend`` builds: "te" (Transformer
    Engine's ``delay_wgrad_compute`` and ``backward_dw``, TE >= 2.3) or "local" (this module's layers)."""
    if backend != "te":
        return "local"
    version = te_version() if version is None else version
    if version is None or tuple(version) < TE_MIN_VERSION:
        found = "not installed" if version is None else ".".join(map(str, version))
        raise ValueError(f"a split backward (BackwardInput/BackwardWeight: --weipipe-zero-bubble or a split plan file) "
                         f"with Transformer Engine's layers needs Transformer Engine >= 2.3 (delay_wgrad_compute), "
                         f"found {found}; use --transformer-impl local")
    return "te"


def te_wgrad_modules(layers) -> List[torch.nn.Module]:
    """The modules of ``layers`` whose ``backward_dw()`` runs deferred weight-gradient work: those that have
    one and no child that has one (so that no queue is popped twice)."""
    def has(module) -> bool:
        return callable(getattr(module, "backward_dw", None))

    return [m for layer in layers for m in layer.modules() if has(m) and not any(has(c) for c in m.children())]
