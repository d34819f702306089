"""Run megatron-core on a machine without CUDA.

megatron-core assumes a GPU in a few dozen places: factory calls with
``device=torch.cuda.current_device()`` or ``device="cuda"``, ``torch.cuda``
RNG and synchronisation calls, and type checks against ``torch.cuda.FloatTensor``.
This module makes those places run on the CPU, and nothing else:

* a :class:`~torch.overrides.TorchFunctionMode` rewrites CUDA device arguments
  of torch calls to ``cpu`` (``device=0`` included, since that is what
  ``torch.cuda.current_device()`` now returns);
* ``torch.cuda.current_device/synchronize/manual_seed/get_rng_state/...`` are
  replaced with CPU equivalents (the "CUDA" RNG *is* the CPU generator, so
  megatron's RNG tracker forks the generator that CPU dropout really uses);
* megatron's own CUDA-RNG helpers are redirected, and fp32 CPU tensors
  report the CUDA type name that megatron's optimizer asserts on.

It is applied only when CUDA is unavailable (:func:`apply` is a no-op on a GPU
machine), it can be removed again (:func:`remove`), and it refuses to run on
a megatron-core whose patch targets moved, or outside the supported releases
(:mod:`.versions`): it raises :class:`CpuCompatError` naming the installed
version instead of letting anything run half-patched. The replacements are the
registered patch ``cpu-without-cuda`` (:mod:`.patches`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

from megatron_tawpipe.common.errors import CpuCompatError, PatchError
from megatron_tawpipe.compat import patches, patching

__all__ = ["CpuCompatError", "apply", "remove", "is_applied", "explain_cuda_errors", "megatron_version"]


def megatron_version() -> str:
    """The installed megatron-core's version ("unknown" where it cannot be told)."""
    found = patching.installed_version("megatron-core")
    return "unknown" if found == "not installed" else found


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer device index means a CUDA device to torch factories.
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


def _map_device(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call made under it.

    Torch pops the mode while its handler runs, and ``Tensor.backward`` /
    ``torch.autograd.backward`` are dispatched through the handler, so the
    autograd engine (recompute, gradient hooks) would run without it:
    :func:`_engine_with_mode` re-enters it around the engine call.
    ``Tensor.type()`` of an fp32 CPU tensor reports the CUDA type name, because
    megatron's optimizer and gradient clipping assert on that string.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False   # host memory pinned for a device copy (megatron's CP split of RoPE)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    tensor = args[0]
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    if target is None:
        name = func(tensor)
        return name.replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" else name
    if isinstance(target, str) and target.startswith("torch.cuda."):
        target = target.replace("torch.cuda.", "torch.", 1)
    return func(tensor, target, *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})


def _engine_with_mode(original: Callable) -> Callable:
    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        if _mode is not None and _mode not in _current_modes():
            with _mode:
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    return run_backward


def _current_modes():
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


# --------------------------------------------------------------------------------------
# Function replacements
# --------------------------------------------------------------------------------------


def _current_device() -> int:
    return 0


def _noop(*args, **kwargs) -> None:
    return None


def _manual_seed(seed: int) -> None:
    # torch.manual_seed would call back into torch.cuda.manual_seed_all.
    torch.default_generator.manual_seed(int(seed))


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _megatron_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _megatron_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _null_stream_context(*args, **kwargs):
    # Reusable: megatron enters one stream context more than once.
    return contextlib.nullcontext()


class _FakeStream:
    """Enough of torch.cuda.Stream for code that only records and waits."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        # Megatron-FSDP waits on the event it gets back (param_and_grad_buffer.py:3121, 3328).
        return event if event is not None else _FakeEvent()

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    """Enough of torch.cuda.Event for code that records on a (fake) stream and waits: all work is in order."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _memory_zero(*args, **kwargs) -> int:
    return 0


# (module, attribute, replacement): the targets of the registered patch cpu-without-cuda
# (megatron_tawpipe.compat.patches), whose self-check refuses a megatron-core or torch they do not fit.
def _patch_table() -> List[Tuple[str, str, Any]]:
    return [
        ("torch.cuda", "current_device", _current_device),
        ("torch.cuda", "synchronize", _noop),
        ("torch.cuda", "manual_seed", _manual_seed),
        ("torch.cuda", "manual_seed_all", _manual_seed),
        ("torch.cuda", "get_rng_state", _get_rng_state),
        ("torch.cuda", "set_rng_state", _set_rng_state),
        ("torch.cuda", "empty_cache", _noop),
        ("torch.cuda", "current_stream", _FakeStream),
        ("torch.cuda", "default_stream", _FakeStream),
        # megatron's partial data parallelism (--num-distributed-optimizer-instances > 1) runs its
        # reductions on a side stream; on the CPU they run in order on the host instead.
        ("torch.cuda", "Stream", _FakeStream),
        ("torch.cuda", "stream", _null_stream_context),
        ("torch.cuda", "memory_allocated", _memory_zero),
        ("torch.cuda", "max_memory_allocated", _memory_zero),
        ("torch.cuda", "reset_peak_memory_stats", _noop),
        ("torch.cuda.random", "get_rng_state", _get_rng_state),
        ("torch.cuda.random", "set_rng_state", _set_rng_state),
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _megatron_get_rng_state),
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _megatron_set_rng_state),
        ("torch.autograd", "_engine_run_backward", _engine_with_mode),
    ]


# --------------------------------------------------------------------------------------
# apply / remove
# --------------------------------------------------------------------------------------

_applied: patching.Applied | None = None
_mode: _CudaToCpuMode | None = None

# megatron's RNG tracker warns when the CPU generator changes inside a fork of the "CUDA" one. Here the
# "CUDA" generator *is* the CPU one, so it changes inside every fork (dropout draws from it): the warning
# says nothing on a CPU and came dozens of times per iteration. Only that message is dropped.
_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_MESSAGE = "CPU RNG state changed within GPU RNG context"


class _SameGeneratorFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_MESSAGE


_rng_filter = _SameGeneratorFilter()


def is_applied() -> bool:
    return _mode is not None


def apply(force: bool = False) -> bool:
    """Make megatron-core run on the CPU. Returns True if the layer is active.

    A no-op (returns False) when CUDA is available, unless ``force``.
    Must be called before models are built, in every process.
    """
    global _mode, _applied
    if _mode is not None:
        return True
    if torch.cuda.is_available() and not force:
        return False
    replace, wrap = {}, {}
    for module_name, attr, replacement in _patch_table():
        (wrap if replacement is _engine_with_mode else replace)[f"{module_name}:{attr}"] = replacement
    try:
        _applied = patches.apply("cpu-without-cuda", replace=replace, wrap=wrap)
    except PatchError as exc:
        raise CpuCompatError(f"CPU compatibility layer: {exc}; not supported on CPU") from None
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    logging.getLogger(_RNG_LOGGER).addFilter(_rng_filter)
    _self_check()
    return True


def remove() -> None:
    """Undo :func:`apply` (for tests and for code that later moves to a GPU)."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    logging.getLogger(_RNG_LOGGER).removeFilter(_rng_filter)
    _applied.undo()


def _self_check() -> None:
    probe = torch.empty(1, device=torch.cuda.current_device())
    literal = torch.ones(1, device="cuda")
    if probe.device.type != "cpu" or literal.device.type != "cpu":  # pragma: no cover
        remove()
        raise CpuCompatError(
            f"megatron-core {megatron_version()}: CPU compatibility layer failed its self-check"
        )


_CUDA_ERROR_MARKERS = (
    "Torch not compiled with CUDA",
    "Found no NVIDIA driver",
    "CUDA driver",
    "No CUDA GPUs are available",
)


@contextlib.contextmanager
def explain_cuda_errors():
    """Turn a stray CUDA call on a CPU-only machine into a clear error.

    A megatron-core release may add a CUDA call site that the layer does not
    cover; torch then fails deep inside megatron with a terse message. We name
    the megatron-core version so that the cause is obvious.
    """
    try:
        yield
    except (AssertionError, RuntimeError) as exc:
        if is_applied() and any(marker in str(exc) for marker in _CUDA_ERROR_MARKERS):
            raise CpuCompatError(
                f"megatron-core {megatron_version()} made a CUDA call that the CPU compatibility "
                f"layer does not cover ({exc}); this megatron-core version is not supported on CPU"
            ) from exc
        raise
