"""Every run-time change this package makes to megatron-core, torch and Python, listed in one place.

Each entry says what it changes (``module:qualname``), why, who supplies the replacement, the releases it
is written for (:mod:`.versions`) and its scope; :func:`check` is its self-check, :func:`apply` the only way
it is applied (see :mod:`.patching`). The replacement code stays beside its user; code elsewhere in the
package assigns no attribute of megatron-core, torch or Python's modules (``tests/test_compat_patches.py``
looks). docs/compat.md lists the same.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

from megatron_tawpipe.compat.patching import Applied, Patch, Target
from megatron_tawpipe.compat import patching

P2P = "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator"
WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
WRITE_RESULTS_QUEUE = f"{WRITER}:_results_queue"
C10D = "torch.distributed.distributed_c10d"

# torch.distributed functions whose calls are counted -> the parameters the counter reads (the rest it
# reads where present: group_dst, group_src, input_list, ...). The private and coalesced ones may go.
_COUNTED = {
    "all_reduce": ("tensor", "group"), "all_reduce_coalesced": ("tensors", "group"),
    "reduce_scatter_tensor": ("input", "group"), "_reduce_scatter_base": ("input", "group"),
    "reduce_scatter": ("input_list", "group"), "reduce_scatter_single": ("input", "group"),
    "all_gather_into_tensor": ("output_tensor", "group"), "_all_gather_base": ("output_tensor", "group"),
    "all_gather": ("tensor_list", "group"), "all_gather_single": ("output_tensor", "group"),
    "all_gather_coalesced": ("output_tensor_lists", "group"),
    "broadcast": ("tensor", "src", "group"), "scatter": ("tensor", "scatter_list", "src", "group"),
    "reduce": ("tensor", "dst", "group"), "gather": ("tensor", "dst", "group"),
    "all_to_all_single": ("input", "group"), "all_to_all": ("input_tensor_list", "group"),
    "send": ("tensor", "dst", "group"), "isend": ("tensor", "dst", "group"),
}
_MAY_GO = {"all_reduce_coalesced", "_reduce_scatter_base", "reduce_scatter_single", "_all_gather_base",
           "all_gather_single", "all_gather_coalesced"}

# compat.cpu's replacements (its _patch_table has the same targets).
_CPU_TORCH = ("current_device", "synchronize", "manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state",
              "empty_cache", "current_stream", "default_stream", "Stream", "stream", "memory_allocated",
              "max_memory_allocated", "reset_peak_memory_stats")

REGISTRY: Dict[str, Patch] = {patch.name: patch for patch in (
    Patch(
        name="cpu-without-cuda",
        targets=tuple(Target(f"torch.cuda:{name}") for name in _CPU_TORCH) + (
            Target("torch.cuda.random:get_rng_state"), Target("torch.cuda.random:set_rng_state"),
            Target("megatron.core.tensor_parallel.random:_get_cuda_rng_state"),
            Target("megatron.core.tensor_parallel.random:_set_cuda_rng_state"),
            Target("torch.autograd:_engine_run_backward")),
        why="megatron-core assumes CUDA: on a machine without it, torch.cuda's device, RNG, stream and memory "
            "calls and megatron's CUDA-RNG helpers get CPU equivalents (with a TorchFunctionMode mapping "
            "CUDA devices to the CPU, re-entered around autograd's engine)",
        user="megatron_tawpipe.compat.cpu (apply() where CUDA is unavailable; remove() undoes it)",
        scope="process"),
    Patch(
        name="pipeline-transfer-waits",
        targets=(Target(f"{P2P}._communicate",
                        params=("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next")),),
        why="megatron-core waits on its stage-to-stage transfers without a bound: each is marked as a wait on "
            "the progress board, so that the watchdog names the peer that stalled, and a failed transfer is a "
            "PeerFailure naming rank, iteration and peers",
        user="megatron_tawpipe.baselines.native (NativeTrainer: applied when built, undone by close(); "
             "trainers alive at the same time share it)",
        scope="scoped", shared=True),
    Patch(
        name="checkpoint-write-results-queue",
        targets=(Target(WRITE_RESULTS_QUEUE, callable=False),),
        relies_on=(Target(f"{WRITER}:get_write_results_queue|_get_write_results_queue"),),
        why="megatron-core's torch_dist writer hands its results back through a module-level queue served by "
            "a spawned manager process per rank; a synchronous save and a forked background writer need no "
            "manager (a plain or fork-inherited queue), only the persistent worker does (megatron-core's own)",
        user="megatron_tawpipe.checkpoint.async_save (use_results_queue, before every torch_dist save; "
             "the queue must outlive the background write, so it stays for the process)",
        scope="process"),
    Patch(
        name="deferred-linear-forward-impl",
        targets=(Target("megatron.core.tensor_parallel:ColumnParallelLinear._forward_impl", params=("input", "weight")),
                 Target("megatron.core.tensor_parallel:RowParallelLinear._forward_impl", params=("input", "weight"))),
        why="a split backward defers the weight gradient: subclasses of megatron's local linear layers override "
            "the private _forward_impl hook (the matrix multiply) with this package's autograd function",
        user="megatron_tawpipe.models.deferred_linear (DeferredColumnParallelLinear, DeferredRowParallelLinear; "
             "checked when one is built)",
        scope="override"),
    Patch(
        name="rank0-warnings-once",
        targets=(Target("warnings:showwarning", params=("message", "category", "filename", "lineno", "file", "line")),),
        why="megatron-core's warnings that every rank gives alike (Transformer Engine or Apex missing, the "
            "deprecated 'full' CUDA-graph scope) are shown once, by the first rank; Python documents this hook "
            "for it",
        user="megatron_tawpipe.compat.extensions (missing_extension_warnings_once, before megatron-core is "
             "imported)",
        scope="process", megatron_core=None, torch=None),
    Patch(
        name="collective-bytes",
        targets=tuple(Target(f"{module}:{name}", params=params, optional=name in _MAY_GO)
                      for name, params in _COUNTED.items() for module in (C10D, "torch.distributed")),
        why="the benchmark counts the bytes every collective and point-to-point call sends per link class: "
            "torch.distributed's functions (the module's and distributed_c10d's) are wrapped",
        user="megatron_tawpipe.bench.collective_bytes (CollectiveCounter.install; uninstall undoes it)",
        scope="scoped", megatron_core=None),
    Patch(
        name="collective-bytes-iteration-end",
        targets=(Target("megatron_tawpipe.monitor.metrics:MetricsWriter.record", given=True),),
        why="the counted totals are snapshotted at each training iteration's end, when the iteration's "
            "metrics are recorded",
        user="megatron_tawpipe.bench.collective_bytes (install_in_training; its result's undo() ends it)",
        scope="scoped", megatron_core=None, torch=None),
)}


def get(name: str) -> Patch:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no run-time patch {name!r}; registered: {', '.join(REGISTRY)}") from None


def check(name: str, owners: Optional[Mapping[str, Any]] = None) -> None:
    """The self-check of patch ``name`` (:func:`.patching.check`)."""
    patching.check(get(name), owners)


def apply(name: str, replace: Optional[Mapping[str, Any]] = None,
          wrap: Optional[Mapping[str, Callable[[Any], Any]]] = None,
          owners: Optional[Mapping[str, Any]] = None) -> Applied:
    """Check and apply patch ``name`` (:func:`.patching.apply`); the result's ``undo()`` ends it."""
    return patching.apply(get(name), replace, wrap, owners)


def is_applied(name: str) -> bool:
    return patching.is_applied(get(name))


def undo(name: str) -> None:
    """End patch ``name`` whoever applied it (a process's patch: tests)."""
    patching.undo(get(name))


def new_write_results_queue():
    """A results queue of megatron-core's own making (served by a spawned manager process), not installed:
    megatron-core's maker installs what it makes, so the queue in place is put back."""
    patch = get("checkpoint-write-results-queue")
    owner, name = patching.check(patch)[WRITE_RESULTS_QUEUE]
    maker_owner, maker = patching.resolve(patch, patch.relies_on[0], {})
    saved = getattr(owner, name)
    setattr(owner, name, None)   # the maker makes a new queue only where none is in place
    try:
        return getattr(maker_owner, maker)()
    finally:
        setattr(owner, name, saved)
