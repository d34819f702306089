"""What must not depend on the device a run happens on, checked on a CPU with the GPU's side simulated.

* RNG states saved on a GPU machine restore on a CPU machine and vice versa (the CPU-side generators
  exactly, the device generators kept as seeded at start-up, one warning line);
* initial weights are drawn on the host, whatever the parameter's device;
* the final norm of the decoder block is the layers' norm, whatever megatron-core would pick from what is
  installed (Apex without Transformer Engine: its LayerNorm, which does no RMSNorm);
* the data loader pins its batches when they go to a GPU.
"""

from __future__ import annotations

import io
import logging
import random

import numpy as np
import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import GPT_FLAGS, tiny_args
from megatron_tawpipe.arguments import LLAMA_FLAGS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a GPU on a CPU-only machine")

CUDA_STATE_BYTES = 16  # a CUDA (Philox) generator's state: seed and offset, 8 bytes each


# ---- RNG states ------------------------------------------------------------------------------------------


@pytest.fixture()
def seeded_tracker():
    """megatron-core's RNG tracker seeded as at start-up, on the CPU (the compatibility layer applied)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_tawpipe.compat import cpu as cpu_compat

    assert cpu_compat.apply() is True
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    return get_cuda_rng_tracker()


def _draws(tracker) -> tuple:
    """Numbers from every generator a checkpoint restores: Python, NumPy, torch's CPU generator, and the
    tracker's model-parallel state (dropout inside tensor-parallel regions)."""
    with tracker.fork():
        dropout = torch.rand(4)
    return random.random(), float(np.random.rand()), torch.rand(4), dropout


def _assert_same_draws(got: tuple, want: tuple, tracker_too: bool = True) -> None:
    assert got[0] == want[0], "Python's generator"
    assert got[1] == want[1], "NumPy's generator"
    assert torch.equal(got[2], want[2]), "torch's CPU generator"
    if tracker_too:
        assert torch.equal(got[3], want[3]), "the RNG tracker"


def _gpu_saved(cpu_state: dict, tracker_names) -> dict:
    """The state a GPU machine saves at the same point: the same host generators, a CUDA generator state and
    tracker states of CUDA generators (16-byte ByteTensors), device ``cuda``."""
    generator = torch.Generator().manual_seed(5)
    cuda_state = lambda: torch.randint(0, 256, (CUDA_STATE_BYTES,), dtype=torch.uint8, generator=generator)  # noqa: E731
    state = {key: value for key, value in cpu_state.items() if key != "tracker"}
    state.update(device="cuda", cuda=cuda_state(), tracker={name: cuda_state() for name in tracker_names})
    return state


def _roundtrip(state: dict, weights_only: bool) -> dict:
    """Through torch.save/torch.load as the checkpoints store it (per-parameter files: weights_only;
    torch_dist's sharded object: a pickle)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=weights_only)


def test_a_cpu_state_records_its_device_and_holds_cpu_generator_states(seeded_tracker):
    from megatron_tawpipe.checkpoint.state import rng_state, saved_rng_device

    state = rng_state()
    assert state["device"] == "cpu" and saved_rng_device(state) == "cpu"
    assert "cuda" not in state
    assert set(state["tracker"]) == set(seeded_tracker.get_states())
    # On the CPU the tracker holds CPU generator states, which a CUDA generator cannot take.
    assert all(value.numel() == torch.get_rng_state().numel() != CUDA_STATE_BYTES
               for value in state["tracker"].values())


@pytest.mark.parametrize("weights_only", [True, False], ids=["per-parameter-file", "torch_dist-object"])
def test_a_cpu_state_restores_every_generator_on_a_cpu(seeded_tracker, weights_only, caplog):
    from megatron_tawpipe.checkpoint.state import rng_state, set_rng_state

    state = _roundtrip(rng_state(), weights_only)
    want = _draws(seeded_tracker)
    _draws(seeded_tracker)  # move every generator on
    with caplog.at_level(logging.WARNING, logger="megatron_tawpipe.checkpoint.state"):
        set_rng_state(state)
    _assert_same_draws(_draws(seeded_tracker), want)
    assert not _notices(caplog), "no device change, nothing to say"


@pytest.mark.parametrize("legacy", [False, True], ids=["device-recorded", "saved-before-device-was-recorded"])
@pytest.mark.parametrize("weights_only", [True, False], ids=["per-parameter-file", "torch_dist-object"])
def test_a_gpu_state_restores_on_a_cpu(seeded_tracker, weights_only, legacy, caplog):
    from megatron_tawpipe.checkpoint.state import rng_state, saved_rng_device, set_rng_state

    gpu_state = _gpu_saved(rng_state(), seeded_tracker.get_states())
    if legacy:
        del gpu_state["device"]  # recognised by its CUDA generator state
    gpu_state = _roundtrip(gpu_state, weights_only)
    assert saved_rng_device(gpu_state) == "cuda"
    want = _draws(seeded_tracker)
    _draws(seeded_tracker)  # move every generator on, the tracker's model-parallel state included
    kept = {name: value.clone() for name, value in seeded_tracker.get_states().items()}

    with caplog.at_level(logging.WARNING, logger="megatron_tawpipe.checkpoint.state"):
        set_rng_state(gpu_state)

    # The tracker keeps its own (CPU) states, which it can still fork on; Python, NumPy and torch's CPU
    # generator are restored exactly.
    after = seeded_tracker.get_states()
    assert set(after) == set(kept)
    assert all(torch.equal(after[name], kept[name]) for name in kept)
    _assert_same_draws(_draws(seeded_tracker), want, tracker_too=False)
    (record,) = _notices(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "saved on a GPU (cuda) machine, restored on a CPU machine" in message
    assert "RNG tracker" in message and "--seed" in message


def _notices(caplog) -> list:
    """What the checkpoint code logged (megatron-core's tracker warns on every fork on a CPU: there the CPU
    generator is the one it forks)."""
    return [record for record in caplog.records if record.name == "megatron_tawpipe.checkpoint.state"]


class _Recorder:
    """Stands in for a CUDA RNG call: records its arguments, returns ``value``."""

    def __init__(self, value=None):
        self.calls, self.value = [], value

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.value


def _simulate_gpu(tracker, monkeypatch) -> dict:
    """The process as a GPU machine sees it: CUDA available; the CUDA generator's calls and the tracker's
    ``set_states`` recorders."""
    cuda_state = torch.arange(CUDA_STATE_BYTES, dtype=torch.uint8)
    recorders = {"get": _Recorder(cuda_state), "set": _Recorder(), "tracker": _Recorder()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", recorders["get"])
    monkeypatch.setattr(torch.cuda, "set_rng_state", recorders["set"])
    monkeypatch.setattr(tracker, "set_states", recorders["tracker"])
    return recorders


@pytest.fixture()
def simulated_gpu(seeded_tracker, monkeypatch):
    return _simulate_gpu(seeded_tracker, monkeypatch)


def test_a_gpu_state_records_its_device_and_the_cuda_generator(seeded_tracker, simulated_gpu):
    from megatron_tawpipe.checkpoint.state import rng_state

    state = rng_state()
    assert state["device"] == "cuda"
    assert torch.equal(state["cuda"], simulated_gpu["get"].value)
    assert all(value.device.type == "cpu" for value in state["tracker"].values())


def test_a_cpu_state_restores_on_a_gpu_keeping_the_device_generators(seeded_tracker, caplog, monkeypatch):
    from megatron_tawpipe.checkpoint.state import rng_state, set_rng_state

    cpu_state = _roundtrip(rng_state(), weights_only=True)   # saved on this (CPU) machine
    want = _draws(seeded_tracker)
    _draws(seeded_tracker)
    recorders = _simulate_gpu(seeded_tracker, monkeypatch)   # now "on a GPU"
    with caplog.at_level(logging.WARNING, logger="megatron_tawpipe.checkpoint.state"):
        set_rng_state(cpu_state)
    # Neither a missing CUDA state nor a CPU generator state reaches the CUDA generator or the tracker.
    assert recorders["set"].calls == []
    assert recorders["tracker"].calls == []
    _assert_same_draws(_draws(seeded_tracker), want, tracker_too=False)
    (record,) = _notices(caplog)
    message = record.getMessage()
    assert "saved on a CPU machine, restored on a GPU (cuda) machine" in message
    assert "CUDA generator" in message and "--seed" in message


def test_a_gpu_state_restores_every_generator_on_a_gpu(seeded_tracker, simulated_gpu, caplog):
    from megatron_tawpipe.checkpoint.state import set_rng_state

    saved = {"device": "cuda", "python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": _numpy_entry(), "cuda": torch.full((CUDA_STATE_BYTES,), 7, dtype=torch.uint8),
             "tracker": {"model-parallel-rng": torch.full((CUDA_STATE_BYTES,), 9, dtype=torch.uint8)}}
    with caplog.at_level(logging.WARNING, logger="megatron_tawpipe.checkpoint.state"):
        set_rng_state(_roundtrip(saved, weights_only=True))
    ((cuda_state,),) = simulated_gpu["set"].calls
    assert torch.equal(cuda_state, saved["cuda"])
    ((tracker_states,),) = simulated_gpu["tracker"].calls
    assert set(tracker_states) == {"model-parallel-rng"}
    assert torch.equal(tracker_states["model-parallel-rng"], saved["tracker"]["model-parallel-rng"])
    assert not _notices(caplog)


def _numpy_entry() -> list:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def test_an_unknown_device_type_is_refused():
    from megatron_tawpipe.checkpoint.state import saved_rng_device
    from megatron_tawpipe.common.errors import CheckpointError

    with pytest.raises(CheckpointError, match="'xpu'"):
        saved_rng_device({"device": "xpu"})


# ---- initial weights -------------------------------------------------------------------------------------


def _config(num_layers: int = 2):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2, init_method_std=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_initial_weights_are_a_cpu_generators_fp32_draw(dtype):
    from megatron_tawpipe.models.initialization import init_parameter, init_std_for, initial_values, parameter_seed

    config = _config()
    for name, shape in [("decoder.layers.1.mlp.linear_fc2.weight", (16, 64)),
                        ("embedding.word_embeddings.weight", (50, 16))]:
        std = init_std_for(name, config)
        expected = torch.empty(shape, dtype=torch.float32)
        expected.normal_(0.0, std, generator=torch.Generator("cpu").manual_seed(parameter_seed(7, name)))
        values = initial_values(shape, std, 7, name)
        assert values.device.type == "cpu" and values.dtype == torch.float32
        assert torch.equal(values, expected)
        param = torch.empty(shape, dtype=dtype)
        init_parameter(param, name, 7, config)
        assert torch.equal(param, expected.to(dtype))
    # Another name or seed: other numbers (the draw depends on both).
    assert not torch.equal(initial_values((4, 4), 0.02, 7, "a.weight"), initial_values((4, 4), 0.02, 7, "b.weight"))
    assert not torch.equal(initial_values((4, 4), 0.02, 7, "a.weight"), initial_values((4, 4), 0.02, 8, "a.weight"))


def test_a_parameter_off_the_host_gets_values_drawn_on_the_host(monkeypatch):
    """A parameter on another device (``meta`` here, a GPU in a run) never gets a generator of its device."""
    from megatron_tawpipe.models import initialization

    created = []
    real_generator = torch.Generator

    def recording_generator(device="cpu"):
        created.append(torch.device(device).type)
        return real_generator(device=device)

    copied = []
    param = torch.empty(16, 64, device="meta")
    monkeypatch.setattr(torch, "Generator", recording_generator)
    real_slice = initialization.tensor_parallel_slice
    monkeypatch.setattr(initialization, "tensor_parallel_slice",
                        lambda name, whole, p, config: copied.append(whole) or real_slice(name, whole, p, config))
    initialization.init_parameter(param, "decoder.layers.0.self_attention.linear_qkv.weight", 7, _config())
    assert created == ["cpu"]
    (values,) = copied
    assert values.device.type == "cpu" and values.dtype == torch.float32 and values.shape == (16, 64)


def test_the_shard_template_initialises_through_init_parameter():
    """Weight passing assembles shards with the same function a whole-model build uses."""
    import inspect

    from megatron_tawpipe.models import initialization
    from megatron_tawpipe.runtime import shard_model

    assert shard_model.init_parameter is initialization.init_parameter
    for method in (shard_model.ShardTemplate.init_shard, shard_model.ShardTemplate._init_replicated):
        source = inspect.getsource(method)
        assert "init_parameter(" in source and "Generator" not in source


# ---- the decoder block's final norm ----------------------------------------------------------------------


def _norm_classes(rank, argv, simulate_apex_gpu: bool):
    """Build the model ``argv`` describes (one rank) and name the classes of its norms. With
    ``simulate_apex_gpu``: CUDA available, Apex's fused LayerNorm importable, no Transformer Engine, and
    megatron-core's own install-time choices as they are with Apex (its LayerNorm, a stand-in here that, as
    Apex's, refuses RMSNorm)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import transformer_block

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.compat import cpu as cpu_compat
    from megatron_tawpipe.data import pad_vocab_size
    from megatron_tawpipe.models import llama
    from megatron_tawpipe.training.validate_args import validate_args

    class ApexLayerNorm(torch.nn.LayerNorm):
        """megatron-core's FusedLayerNorm as far as the model sees it (LayerNorm only)."""

        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                     normalization="LayerNorm"):
            assert config.normalization == "LayerNorm", f"({config.normalization}) is not supported in FusedLayerNorm"
            super().__init__(hidden_size, eps=eps)

    cpu_compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    args = validate_args(parse_args(argv), world_size=1)
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    config = llama.llama_config(args)
    if simulate_apex_gpu:
        importable = llama._importable
        llama._importable = lambda module: (module in ("apex", "apex.normalization.fused_layer_norm",
                                                       "fused_layer_norm_cuda") or importable(module))
        assert not llama.transformer_engine_available()
        fused_layer_norm.FusedLayerNorm = ApexLayerNorm
        transformer_block.LayerNormImpl = backends.LNImpl = gpt_layer_specs.LNImpl = ApexLayerNorm
        torch.cuda.is_available = lambda: True
    model = llama.construct_llama_model(args, config)
    torch.cuda.is_available = lambda: False
    layer = model.decoder.layers[0]
    attention = layer.self_attention
    return {"final": type(model.decoder.final_layernorm).__name__,
            "input": type(layer.input_layernorm).__name__, "pre_mlp": type(layer.pre_mlp_layernorm).__name__,
            "q": type(attention.q_layernorm).__name__, "k": type(attention.k_layernorm).__name__,
            "layers": len(model.decoder.layers), "num_layers": args.num_layers}


def _model_argv(architecture, *extra):
    argv = tiny_args("--qk-layernorm", *extra, architecture=architecture)
    argv[argv.index("--num-layers") + 1] = "3"
    return argv


@pytest.mark.parametrize("case, architecture, extra, apex, norm", [
    ("rmsnorm-apex-gpu", LLAMA_FLAGS, (), True, "RMSNorm"),
    ("rmsnorm-1p-apex-gpu", LLAMA_FLAGS, ("--apply-layernorm-1p",), True, "ZeroCentredRMSNorm"),
    ("layernorm-apex-gpu", GPT_FLAGS, (), True, "ApexLayerNorm"),
    ("layernorm-1p-apex-gpu", GPT_FLAGS, ("--apply-layernorm-1p",), True, "ApexLayerNorm"),
    ("layernorm-cpu", GPT_FLAGS, (), False, "LayerNorm"),
    ("rmsnorm-cpu", LLAMA_FLAGS, (), False, "RMSNorm"),
], ids=["rmsnorm-apex-gpu", "rmsnorm-1p-apex-gpu", "layernorm-apex-gpu", "layernorm-1p-apex-gpu", "layernorm-cpu",
        "rmsnorm-cpu"])
def test_the_final_norm_is_the_layers_norm_whatever_is_installed(case, architecture, extra, apex, norm):
    (names,) = run_ranks(_norm_classes, 1, _model_argv(list(architecture), *extra), apex)
    assert names["layers"] == names["num_layers"] == 3
    for where in ("final", "input", "pre_mlp", "q", "k"):
        assert names[where] == norm, f"{case}: the {where} norm is {names[where]}, expected {norm}"


def test_norm_modules_leave_transformer_engines_layer_its_own():
    from megatron_tawpipe.models.llama import norm_modules

    assert norm_modules(type("Args", (), {"normalization": "RMSNorm"})(), "te") is None


# ---- pinned batches --------------------------------------------------------------------------------------


def test_batches_are_pinned_for_a_gpu_only():
    from megatron_tawpipe.data.iterators import pin_memory_for

    assert pin_memory_for(torch.device("cuda", 1)) and pin_memory_for("cuda") and pin_memory_for("cuda:0")
    assert not pin_memory_for("cpu") and not pin_memory_for(torch.device("cpu"))


@pytest.mark.parametrize("device, explicit, pinned", [
    ("cuda", None, True), ("cpu", None, False), ("cuda", False, False), ("cpu", True, True)])
def test_the_loader_pins_for_this_ranks_device(monkeypatch, device, explicit, pinned):
    from megatron_tawpipe.common import device as device_module
    from megatron_tawpipe.data.iterators import build_data_iterator

    recorded = []
    real_loader = torch.utils.data.DataLoader

    class RecordingLoader(real_loader):
        def __init__(self, *args, pin_memory=False, **kwargs):
            recorded.append(pin_memory)
            super().__init__(*args, pin_memory=False, **kwargs)   # no accelerator to pin for here

    monkeypatch.setattr(torch.utils.data, "DataLoader", RecordingLoader)
    monkeypatch.setattr(device_module, "current_device", lambda: torch.device(device))
    dataset = [{"tokens": torch.full((4,), i)} for i in range(8)]
    kwargs = {} if explicit is None else {"pin_memory": explicit}
    batches = build_data_iterator(dataset, 2, 0, 1, 0, **kwargs)
    assert recorded == [pinned]
    assert torch.equal(next(batches)["tokens"], torch.tensor([[0] * 4, [1] * 4]))
    # An explicit device decides over this rank's.
    recorded.clear()
    build_data_iterator(dataset, 2, 0, 1, 0, device="cpu" if device == "cuda" else "cuda", **kwargs)
    assert recorded == [explicit if explicit is not None else not pinned]
