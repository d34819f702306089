"""GPU-native runtime choices, checked on CPU: gradient norm without fp64 copies, fused AdamW,
megatron's fusions (CUDA faked), the single-connection warning, fp8 refused, and the calls
into megatron-core's schedules across its releases."""

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distributed_harness import run_ranks
from training_helpers import tiny_args

# ---- 1. gradient norm -------------------------------------------------------------------------


class _Float64Outputs(TorchDispatchMode):
    """Records the size of every fp64 tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        return out


def test_squared_norm_matches_fp64_without_fp64_copies_of_gradients():
    from megatron_tawpipe.optimizer.clip import squared_l2_norm

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(5000, generator=generator), torch.randn(64, 33, generator=generator) * 1e-3,
             torch.randn(7, generator=generator) * 50]
    expected = sum(float(g.double().pow(2).sum()) for g in grads)
    with _Float64Outputs() as recorder:
        got = squared_l2_norm(grads, torch.device("cpu"))
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert abs(float(got) - expected) <= 1e-6 * expected
    # fp64 only for per-tensor norms and their sum: never a tensor the size of a gradient.
    assert recorder.sizes and max(recorder.sizes) <= len(grads), recorder.sizes
    # 16-bit gradients are read as fp32 (no overflow of the squares, no fp32 copy either).
    half = [g.to(torch.bfloat16) for g in grads]
    expected_half = sum(float(g.double().pow(2).sum()) for g in half)
    assert abs(float(squared_l2_norm(half, torch.device("cpu"))) - expected_half) <= 1e-5 * expected_half
    assert float(squared_l2_norm([], torch.device("cpu"))) == 0.0


def test_squared_norm_on_cpu_does_not_drift_with_tensor_size():
    """The CPU's fp32 norm kernels sum sequentially (7e-5 relative error at 4M elements): the norm would
    depend on how a run groups its gradients (one rank's flat shards against two ranks')."""
    from megatron_tawpipe.optimizer.clip import squared_l2_norm

    big = torch.randn(4_000_000, generator=torch.Generator().manual_seed(1)) * 1e-3
    exact = float(big.double().pow(2).sum())
    assert abs(float(squared_l2_norm([big], torch.device("cpu"))) - exact) <= 1e-8 * exact
    halves = list(big.split(2_000_000))
    assert abs(float(squared_l2_norm(halves, torch.device("cpu"))) - exact) <= 1e-8 * exact


def _clip_on_two_ranks(rank):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed
    from megatron_tawpipe.runtime.trainer import WeightPassingTrainer

    initialize_distributed(parse_args(["--train-iters", "1"]))
    try:
        shard = [torch.full((4,), 3.0 * (rank + 1))]          # owned: summed over ranks
        replicated = [torch.full((2, 2), 0.5), torch.ones(3)]  # the same on every rank: counted once
        model = SimpleNamespace(member_pieces=None, shard_grads=lambda: shard, replicated_grads=lambda: replicated,
                                stepped_replicated_grads=lambda: replicated,   # (their optimizer not sharded)
                                norm_grads=lambda: (shard, replicated), tensor_parallel_size=1)
        config = SimpleNamespace(optimizer=SimpleNamespace(clip_grad=1.0))   # the run's records: --clip-grad 1
        trainer = SimpleNamespace(model=model, device=torch.device("cpu"), config=config,
                                  _mark=lambda phase: None)   # no --timeline-file
        norm = WeightPassingTrainer._global_norm(trainer)
        WeightPassingTrainer._clip_gradients(trainer, norm)
        clipped = torch.cat([g.reshape(-1) for g in shard + replicated])
        local = float(clipped.pow(2).sum())
        return norm, float(shard[0][0]), local
    finally:
        destroy()


def test_clipping_all_reduces_owned_norms_and_counts_replicated_parts_once():
    results = run_ranks(_clip_on_two_ranks, 2)
    expected = (4 * 9.0 + 4 * 36.0 + 4 * 0.25 + 3.0) ** 0.5
    coeff = 1.0 / (expected + 1e-6)
    for rank, (norm, first, _) in enumerate(results):
        assert abs(norm - expected) <= 1e-9 * expected
        assert abs(first - 3.0 * (rank + 1) * coeff) <= 1e-6
    # After clipping, the global norm (owned parts summed, replicated once) is the clip value.
    replicated_sq = 4 * 0.25 * coeff ** 2 + 3 * coeff ** 2
    clipped_sq = sum(local - replicated_sq for _, _, local in results) + replicated_sq
    assert abs(clipped_sq ** 0.5 - 1.0) <= 1e-5


# ---- 2. fused AdamW ------------------------------------------------------------------------


def _param(device_type, dtype):
    return SimpleNamespace(is_cuda=device_type == "cuda", dtype=dtype)


def test_adamw_is_fused_only_when_every_parameter_is_cuda_fp32():
    from megatron_tawpipe.runtime.trainer import adamw_kernel_options

    assert adamw_kernel_options([_param("cuda", torch.float32)] * 3) == {"fused": True}
    assert adamw_kernel_options([_param("cuda", torch.float32), _param("cuda", torch.bfloat16)]) == {"foreach": True}
    assert adamw_kernel_options([_param("cpu", torch.float32)] * 2) == {}
    assert adamw_kernel_options([]) == {}
    # The options are ones torch's AdamW takes.
    assert {"fused", "foreach"} <= set(inspect.signature(torch.optim.AdamW).parameters)


def test_loaded_step_goes_where_the_fused_kernel_wants_it():
    from megatron_tawpipe.runtime.trainer import WeightPassingTrainer

    master = torch.zeros(3)
    state = {"step": torch.tensor(5.0, dtype=torch.float64), "exp_avg": torch.ones(3, dtype=torch.float64)}
    for defaults, step_dtype in (({"fused": True}, torch.float32), ({"foreach": None}, torch.float64)):
        trainer = SimpleNamespace(_adamw=SimpleNamespace(defaults=defaults))
        placed = {k: WeightPassingTrainer._place_state(trainer, k, v, master) for k, v in state.items()}
        assert placed["step"].dtype == step_dtype and float(placed["step"]) == 5.0
        assert placed["exp_avg"].dtype == torch.float32 and placed["exp_avg"].device == master.device


# ---- 3. megatron's fusions --------------------------------------------------------------------

ALL_KERNELS = dict(swiglu=True, rope=True, masked_softmax=True, wgrad_accumulation=True)


def test_fusions_need_cuda_and_their_kernel():
    from megatron_tawpipe.models.llama import FusionKernels, fusion_settings

    everything = FusionKernels(**ALL_KERNELS)
    assert not any(fusion_settings(False, everything, main_grad_buffers=True).values())
    assert fusion_settings(True, everything, main_grad_buffers=True) == {
        "bias_activation_fusion": True, "apply_rope_fusion": True, "masked_softmax_fusion": True,
        "gradient_accumulation_fusion": True}
    # Without main_grad buffers (the weight-passing template), no fused wgrad accumulation.
    assert not fusion_settings(True, everything, main_grad_buffers=False)["gradient_accumulation_fusion"]
    assert not any(fusion_settings(True, FusionKernels(), main_grad_buffers=True).values())
    only_rope = fusion_settings(True, FusionKernels(rope=True), main_grad_buffers=True)
    assert only_rope["apply_rope_fusion"] and sum(only_rope.values()) == 1


def test_kernel_probe_finds_only_what_is_installed():
    import importlib.util

    from megatron_tawpipe.models.llama import FusionKernels

    # No Transformer Engine or Apex extensions on the CPU machines; megatron's SwiGLU fusion is
    # compiled by Triton, which only a CUDA build of torch brings along (none in CI's CPU build).
    triton = importlib.util.find_spec("triton") is not None
    assert FusionKernels.probe() == FusionKernels(swiglu=triton)


def test_config_with_cuda_faked_turns_importable_fusions_on(monkeypatch):
    from megatron_tawpipe.models import llama as model
    from megatron_tawpipe.arguments import LLAMA_FLAGS, parse_args

    kernels = model.FusionKernels(swiglu=True, masked_softmax=True, wgrad_accumulation=True)
    monkeypatch.setattr(model, "available_fusion_kernels", lambda: kernels)
    args = parse_args(list(LLAMA_FLAGS) + ["--train-iters", "1", "--bf16"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    template = model.llama_config(args)
    native = model.llama_config(args, 2, None, main_grad_buffers=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = model.llama_config(args, 2, None, main_grad_buffers=True)
    for config in (template, native):
        assert config.bias_activation_fusion  # SwiGLU: gated linear unit with silu
        assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
        assert config.masked_softmax_fusion
        assert not config.apply_rope_fusion  # no fused RoPE kernel among those faked
    assert not template.gradient_accumulation_fusion and native.gradient_accumulation_fusion
    assert not any((cpu.bias_activation_fusion, cpu.masked_softmax_fusion, cpu.apply_rope_fusion,
                    cpu.gradient_accumulation_fusion))


# ---- 7. CUDA_DEVICE_MAX_CONNECTIONS=1 ----------------------------------------------------------


def test_single_connection_warning_only_for_cuda_with_one_connection():
    from megatron_tawpipe.runtime.trainer import single_connection_warning

    message = single_connection_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cuda", "tawpipe")
    assert message and "\n" not in message and "CUDA_DEVICE_MAX_CONNECTIONS=1" in message
    assert "--pipeline-schedule tawpipe" in message and "overlap" in message
    assert single_connection_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cpu", "tawpipe") is None
    assert single_connection_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "cuda", "weipipe") is None
    assert single_connection_warning({}, "cuda", "weipipe") is None


@pytest.mark.parametrize("rank,lines", [(0, 1), (1, 0)])
def test_single_connection_warning_is_printed_by_the_first_rank(rank, lines, monkeypatch, capsys):
    from megatron_tawpipe.runtime.trainer import WeightPassingTrainer

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    trainer = SimpleNamespace(device=torch.device("cuda", 0), rank=rank,
                              config=SimpleNamespace(schedule=SimpleNamespace(pipeline_schedule="weipipe")))
    WeightPassingTrainer._warn_about_single_connection(trainer)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == lines and all("CUDA_DEVICE_MAX_CONNECTIONS=1" in line for line in err)


# ---- 6. fp8 refused ---------------------------------------------------------------------------

FP8_FLAGS = [
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: fp8 training is not supported yet"),
    (["--fp8-format", "e4m3", "--fp8-amax-history-len", "1024"], "--fp8-format e4m3: fp8 training"),
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise: fp8 training is not supported yet"),
    (["--fp8-param-gather"], "--fp8-param-gather: fp8 training is not supported yet"),
    (["--fp4-format", "e2m1"], "--fp4-format e2m1: fp4 training is not supported yet"),
]


@pytest.mark.parametrize("extra,message", FP8_FLAGS, ids=[f[0][0] + str(i) for i, f in enumerate(FP8_FLAGS)])
@pytest.mark.parametrize("schedule", ["tawpipe", "1f1b"])
def test_fp8_is_refused_in_one_line_before_any_process_group(extra, message, schedule, capsys, monkeypatch):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_llama.main(tiny_args("--pipeline-schedule", schedule, "--bf16") + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert message in err[0] and "--bf16" in err[0]
    assert not dist.is_initialized()


# ---- 8. megatron-core's schedule functions across releases ------------------------------------


def _get_0_15():
    return "0.15"


def _get_0_16(pp_size=None, vp_size=None):
    return ("0.16", pp_size, vp_size)


def _get_0_19(pp_size=None, vp_size=None, schedule_pg_collection=None):
    return ("0.19", pp_size, vp_size, schedule_pg_collection)


def test_layout_keywords_follow_the_installed_signature():
    from megatron_tawpipe.distributed.megatron_schedules import layout_keywords

    assert layout_keywords(_get_0_15, 2, None) == {}
    assert _get_0_16(**layout_keywords(_get_0_16, 2, 3)) == ("0.16", 2, 3)
    assert _get_0_19(**layout_keywords(_get_0_19, 4, None)) == ("0.19", 4, None, None)
    assert layout_keywords(_get_0_19, None, None) == {}  # from parallel_state


def test_installed_megatron_schedules_are_picked_from_explicit_sizes():
    from megatron.core.pipeline_parallel import schedules as megatron_schedules

    from megatron_tawpipe.distributed.megatron_schedules import megatron_forward_backward_func

    # No parallel state initialised here: the sizes must have been passed.
    assert megatron_forward_backward_func(1, None) is megatron_schedules.forward_backward_no_pipelining
    one_f_one_b = megatron_schedules.forward_backward_pipelining_without_interleaving
    assert megatron_forward_backward_func(2, None) is one_f_one_b
    assert megatron_forward_backward_func(2, 2) is megatron_schedules.forward_backward_pipelining_with_interleaving


def test_weight_passing_schedules_take_megatrons_newer_keywords():
    from megatron.core.pipeline_parallel import schedules as megatron_schedules

    from megatron_tawpipe.runtime.schedules import forward_backward_tawpipe, forward_backward_weipipe

    calls = []
    model = SimpleNamespace(plan=SimpleNamespace(schedule="tawpipe-nooverlap"),
                            run=lambda *a: calls.append(a) or ["report"])
    # What Megatron-LM 0.19's train_step passes, plus megatron's first_val_step.
    newer = dict(decoder_seq_length=None, adjust_tensor_shapes_fn=None, force_all_reduce=False,
                 p2p_communicator=object(), pg_collection=object(), first_val_step=True)
    out = forward_backward_tawpipe(forward_step_func="fs", data_iterator=["it"], model=[model], num_microbatches=4,
                                   seq_length=32, micro_batch_size=1, forward_only=True, **newer)
    assert out == ["report"] and calls == [("fs", "it", 4, True)]
    # Every keyword megatron's own schedule function takes is named by ours.
    from megatron_tawpipe.runtime.schedules import _forward_backward_weight_passing

    megatron_keywords = set(inspect.signature(megatron_schedules.forward_backward_no_pipelining).parameters)
    ours = set(inspect.signature(_forward_backward_weight_passing).parameters)
    assert megatron_keywords <= ours, megatron_keywords - ours
    with pytest.raises(ValueError, match="planned for tawpipe"):
        forward_backward_weipipe(forward_step_func="fs", data_iterator="it", model=model, num_microbatches=4,
                                 seq_length=32, micro_batch_size=1, **newer)



# ---- on a GPU (``gpu`` tests: skipped without one) ---------------------------------------------


def _fused_adamw_and_norm_on_cuda():
    from megatron_tawpipe.optimizer.clip import squared_l2_norm
    from megatron_tawpipe.runtime.trainer import WeightPassingTrainer, adamw_kernel_options

    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(5000, generator=generator), torch.randn(64, 33, generator=generator) * 1e-3,
             torch.randn(7, generator=generator) * 50]
    norm = squared_l2_norm([g.to(device) for g in grads], device)
    norm_half = squared_l2_norm([g.to(device, torch.bfloat16) for g in grads], device)
    masters_cpu = [torch.nn.Parameter(torch.randn(257, 31, generator=generator)) for _ in range(3)]
    masters_cuda = [torch.nn.Parameter(p.detach().to(device)) for p in masters_cpu]
    options = adamw_kernel_options(masters_cuda)
    fused = torch.optim.AdamW(masters_cuda, lr=1e-2, weight_decay=0.1, **options)
    reference = torch.optim.AdamW(masters_cpu, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for cpu, cuda in zip(masters_cpu, masters_cuda):
            g = torch.randn(cpu.shape, generator=generator)
            cpu.grad, cuda.grad = g, g.to(device)
        fused.step()
        reference.step()
    trainer = SimpleNamespace(_adamw=fused)
    step = WeightPassingTrainer._place_state(trainer, "step", torch.tensor(3.0, dtype=torch.float64), masters_cuda[0])
    return {"norm": (norm.device.type, norm.dtype, float(norm)), "norm_half": float(norm_half),
            "expected": sum(float(g.double().pow(2).sum()) for g in grads),
            "expected_half": sum(float(g.to(torch.bfloat16).double().pow(2).sum()) for g in grads),
            "options": options, "fused_default": fused.defaults.get("fused"),
            "max_diff": max(float((a.detach().cpu() - b.detach()).abs().max()) for a, b in zip(masters_cuda, masters_cpu)),
            "step": (step.device.type, step.dtype, float(step))}


@pytest.mark.gpu
def test_squared_norm_and_fused_adamw_on_cuda():
    """On the GPU: the fp64 norm of fp32 and bf16 gradients, the fused AdamW kernel the trainer picks for
    CUDA fp32 masters (it follows torch's reference AdamW), and a loaded step placed as that kernel wants."""
    from test_cuda_one_rank import run_in_fresh_process

    out = run_in_fresh_process(_fused_adamw_and_norm_on_cuda)
    device_type, dtype, norm = out["norm"]
    assert device_type == "cuda" and dtype == torch.float64
    assert abs(norm - out["expected"]) <= 1e-6 * out["expected"]
    assert abs(out["norm_half"] - out["expected_half"]) <= 1e-5 * out["expected_half"]
    assert out["options"] == {"fused": True} and out["fused_default"] is True
    assert out["max_diff"] <= 1e-5, out["max_diff"]
    assert out["step"] == ("cuda", torch.float32, 3.0)
