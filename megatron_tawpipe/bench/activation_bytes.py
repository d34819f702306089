"""What one decoder layer keeps for its backward, measured on a device.

``tools/calibrate.py --measure-activations`` records it as ``layer_activation_bytes`` beside the compute
times; the simulator's memory model (:meth:`megatron_tawpipe.sim.costmodel.CostModel.with_measured`) then
prices stored activations at the measured size instead of its FLOP-model estimate (34 bytes per token and
hidden unit in bf16 with flash attention), which a CPU's fp32 layers, or another attention kernel, do not
match.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Set

import torch


@contextlib.contextmanager
def saved_storages(excluded: Set[int]) -> Iterator[Dict[int, int]]:
    """Within it, the bytes of every distinct storage autograd saves for backward, by storage address (filled
    as the saves happen), the storages at the addresses in ``excluded`` (a model's parameters) left out."""
    saved: Dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def measure_layer_activation_bytes(args, device: torch.device) -> float:
    """Bytes one decoder layer keeps for its backward per micro-batch on ``device``: the distinct storages of
    the tensors autograd saves in a forward of the runtime's shard template (one layer, the run's
    micro-batch), the layer's weights excluded, plus its output (which the next layer's graph or the
    runtime keeps)."""
    from megatron_tawpipe.runtime.shard_model import bound_shard_template

    template, weights = bound_shard_template(args, 1, device)
    own = {p.untyped_storage().data_ptr() for p in template.model.parameters()} | {weights.untyped_storage().data_ptr()}
    generator = torch.Generator().manual_seed(args.seed)
    hidden_in = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, generator=generator)
    hidden_in = hidden_in.to(device, weights.dtype).requires_grad_(True)
    with torch.enable_grad(), saved_storages(own) as saved:
        out = template.run_layers(hidden_in, template.rotary(args.seq_length), None)
    saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    saved.pop(hidden_in.untyped_storage().data_ptr(), None)   # the input is the previous layer's output
    return float(sum(saved.values()))
