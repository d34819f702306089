"""The CPU compatibility layer: what it maps, what it leaves alone, and how it fails."""

import pytest
import torch

from megatron_tawpipe.compat import cpu as cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is only applied without CUDA")


@pytest.fixture(autouse=True)
def applied():
    assert cpu_compat.apply() is True
    yield
    cpu_compat.apply()


def test_cuda_device_arguments_land_on_cpu():
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.arange(4.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device="cuda:0").device.type == "cpu"


def test_megatron_literal_cuda_sites_run():
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(5)
    assert mask.device.type == "cpu"
    assert mask.dtype == torch.bool and mask[0, 1] and not mask[1, 0]


def test_fp32_cpu_tensors_report_the_cuda_type_name_megatron_asserts_on():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    converted = torch.zeros(1, dtype=torch.float64).type("torch.cuda.FloatTensor")
    assert converted.dtype == torch.float32 and converted.device.type == "cpu"


def test_rng_tracker_forks_the_generator_dropout_uses():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core import parallel_state

    # The tracker only needs its states, not process groups, for tp_rank given explicitly.
    model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(5)
    outer_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer_before), "fork must restore the outer generator"
    model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert torch.equal(first, again), "the same tracker seed must give the same numbers"
    assert not parallel_state.model_parallel_is_initialized()


def test_fork_warning_about_the_cpu_generator_is_dropped_only_on_the_cpu(caplog):
    import logging

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    logger = "megatron.core.tensor_parallel.random"
    with caplog.at_level(logging.WARNING, logger=logger):
        with get_cuda_rng_tracker().fork():
            torch.rand(4)               # draws from the CPU generator: the "CUDA" one here
        logging.getLogger(logger).warning("another warning of that logger")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["another warning of that logger"]
    cpu_compat.remove()
    with caplog.at_level(logging.WARNING, logger=logger):
        logging.getLogger(logger).warning("CPU RNG state changed within GPU RNG context")
    assert caplog.records[-1].getMessage() == "CPU RNG state changed within GPU RNG context"


def test_tensors_created_during_backward_are_mapped_too():
    devices = []

    class MakesTensorInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            devices.append(torch.ones(1, device=torch.cuda.current_device()).device.type)
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    MakesTensorInBackward.apply(x).sum().backward()
    torch.autograd.backward(MakesTensorInBackward.apply(x).sum())
    assert devices == ["cpu", "cpu"]
    assert torch.equal(x.grad, torch.full((3,), 4.0))


def test_remove_restores_torch():
    cpu_compat.remove()
    assert not cpu_compat.is_applied()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_missing_patch_target_fails_loudly_naming_the_version(monkeypatch):
    import megatron.core.tensor_parallel.random as megatron_random

    cpu_compat.remove()
    original = torch.cuda.current_device
    monkeypatch.delattr(megatron_random, "_set_cuda_rng_state")   # a release without one of the targets
    with pytest.raises(cpu_compat.CpuCompatError) as info:
        cpu_compat.apply()
    assert cpu_compat.megatron_version() in str(info.value)
    assert "_set_cuda_rng_state" in str(info.value) and "\n" not in str(info.value)
    assert not cpu_compat.is_applied(), "a failed apply must not leave a half-patched torch"
    assert torch.cuda.current_device is original


def test_uncovered_cuda_call_is_explained():
    with pytest.raises(cpu_compat.CpuCompatError) as info:
        with cpu_compat.explain_cuda_errors():
            raise AssertionError("Torch not compiled with CUDA enabled")
    assert cpu_compat.megatron_version() in str(info.value)
    with pytest.raises(ValueError):
        with cpu_compat.explain_cuda_errors():
            raise ValueError("unrelated")
