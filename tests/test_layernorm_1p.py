"""--apply-layernorm-1p (zero-centred norm weights) with torch's norms, on CPUs.

The stored weight is gamma - 1 and the norm computes ``normalised(x) * (1 + weight) (+ bias)``:
checked against the formula written out here, against a model without the flag whose norm weights
are 1 + weight, and in training (weight passing against the single-process reference, tensor and
sequence parallelism inside it).
"""

import pytest
import torch

from distributed_harness import run_ranks
# The single-process reference runs (a module-scoped fixture, cached per shape) and their arguments.
from test_weight_passing_equivalence import ITERS, _args, reference  # noqa: F401
from training_helpers import GPT_FLAGS, assert_close_rel, assert_matches_reference, losses, tiny_args, train_rank
from megatron_tawpipe.arguments import LLAMA_FLAGS

EPS = 1e-5
HIDDEN = 48


def _config(normalization, zero_centred=True, sequence_parallel=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization=normalization,
                             layernorm_zero_centered_gamma=zero_centred, layernorm_epsilon=EPS,
                             tensor_model_parallel_size=2 if sequence_parallel else 1,
                             sequence_parallel=sequence_parallel)


def _reference(x, weight, bias, normalization):
    """The zero-centred norm, written out in float64."""
    x, weight = x.double(), weight.double()
    if normalization == "LayerNorm":
        centred = x - x.mean(-1, keepdim=True)
        normalised = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + EPS)
    else:
        normalised = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    out = normalised * (1.0 + weight)
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_output_and_gradients_follow_the_formula(normalization, dtype):
    from megatron_tawpipe.models.norms import TorchNorm

    norm = TorchNorm(_config(normalization), HIDDEN, eps=EPS)
    assert all(p.abs().max() == 0 for p in norm.parameters())        # gamma - 1 and beta start at 0
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    norm = norm.to(dtype)
    x = (2.0 * torch.randn(5, 3, HIDDEN, generator=generator) + 0.5).to(dtype).requires_grad_(True)
    upstream = torch.randn(5, 3, HIDDEN, generator=generator).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    out.backward(upstream)

    leaves = [x.detach().double().requires_grad_(True)] + [p.detach().double().requires_grad_(True)
                                                           for p in norm.parameters()]
    bias = leaves[2] if normalization == "LayerNorm" else None
    expected = _reference(leaves[0], leaves[1], bias, normalization)
    expected.backward(upstream.double())
    # fp32: rounding only; bf16: the output and the gradients are rounded once to bf16 (8 bits).
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    got = [out, x.grad] + [p.grad for p in norm.parameters()]
    want = [expected] + [leaf.grad for leaf in leaves]
    for name, a, e in zip(["output", "input grad", "weight grad", "bias grad"], got, want):
        diff = (a.double() - e).abs().max().item()
        assert diff <= rtol * e.abs().max().item(), f"{name}: max diff {diff} vs max {e.abs().max().item()}"


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_keeps_megatron_cores_parameters_and_marks(normalization):
    """Same parameter names and shapes as megatron-core's torch norm; sequence_parallel marked on the
    layers' norms under --sequence-parallel, never on the query/key norms."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_tawpipe.models.norms import TorchNorm, TorchQKNorm

    theirs = WrappedTorchNorm(_config(normalization, zero_centred=False), HIDDEN, eps=EPS)
    ours = TorchNorm(_config(normalization, sequence_parallel=True), HIDDEN, eps=EPS)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    assert all(p.sequence_parallel for p in ours.parameters())
    qk = TorchQKNorm(_config(normalization, sequence_parallel=True), HIDDEN, eps=EPS)
    assert not any(p.sequence_parallel for p in qk.parameters())


def _outputs_with_and_without_1p(rank, argv):
    """A model built with --apply-layernorm-1p and norm weights w, and one built without it whose norm
    weights are 1 + w (all else equal): their logits, and the gradients of w and of 1 + w."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.compat import cpu as cpu_compat
    from megatron_tawpipe.data import pad_vocab_size
    from megatron_tawpipe.models.llama import build_llama_model, llama_config
    from megatron_tawpipe.models.norms import ZeroCentredLayerNorm, ZeroCentredRMSNorm
    from megatron_tawpipe.training.validate_args import validate_args

    cpu_compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    models = {}
    for one_p in (True, False):
        args = validate_args(parse_args(argv + (["--apply-layernorm-1p"] if one_p else [])), world_size=1)
        args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
        models[one_p] = build_llama_model(args, llama_config(args)).eval()
    zero_centred = {name for name, module in models[True].named_modules()
                    if isinstance(module, (ZeroCentredLayerNorm, ZeroCentredRMSNorm))}
    generator = torch.Generator().manual_seed(11)
    plain = dict(models[False].named_parameters())
    with torch.no_grad():
        for name, param in models[True].named_parameters():
            if name.rsplit(".", 1)[0] in zero_centred:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
            plain[name].copy_(param + 1.0 if name.endswith(".weight") and name.rsplit(".", 1)[0] in zero_centred
                               else param)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=generator)
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(2, -1)
    upstream, results = None, {}
    for one_p, model in models.items():
        logits = model(tokens, positions, None)
        upstream = torch.randn(logits.shape, generator=generator) if upstream is None else upstream
        (logits * upstream).sum().backward()
        results[one_p] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (ours, our_grads), (theirs, their_grads) = results[True], results[False]
    # Plain numbers back to the test process (tensors do not cross a forked rank's queue).
    grad_diffs = {name: ((our_grads[name] - grad).abs().max().item(), grad.abs().max().item())
                  for name, grad in their_grads.items()}
    return sorted(zero_centred), (ours - theirs).abs().max().item(), theirs.abs().max().item(), grad_diffs


@pytest.mark.parametrize("architecture", ["llama", "gpt"])
def test_model_with_1p_equals_model_without_whose_weights_are_1_plus_w(architecture):
    flags = list(LLAMA_FLAGS) if architecture == "llama" else list(GPT_FLAGS)
    argv = tiny_args("--qk-layernorm", architecture=flags)
    argv[argv.index("--num-layers") + 1] = "2"
    ((zero_centred, diff, scale, grad_diffs),) = run_ranks(_outputs_with_and_without_1p, 1, argv)
    # Every norm is zero-centred: both layers' input, pre-MLP, query and key norms, and the final norm.
    assert len(zero_centred) == 2 * 4 + 1 and "decoder.final_layernorm" in zero_centred
    assert diff <= 1e-6 * scale, (diff, scale)
    for name, (grad_diff, grad_scale) in grad_diffs.items():
        assert grad_diff <= 1e-5 * grad_scale + 1e-12, f"{name}: max diff {grad_diff} vs max {grad_scale}"


def test_check_model_support_accepts_layernorm_1p_on_cpu():
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    for flags in (LLAMA_FLAGS, GPT_FLAGS):
        args = validate_args(parse_args(tiny_args("--apply-layernorm-1p", "--qk-layernorm", architecture=flags)),
                             world_size=1)
        assert args.apply_layernorm_1p


LLAMA_1P = list(LLAMA_FLAGS) + ["--apply-layernorm-1p", "--qk-layernorm"]
GPT_1P = list(GPT_FLAGS) + ["--apply-layernorm-1p"]
TAWPIPE = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"]
CASES = [
    # world, flags, layers, global batch, architecture
    (4, TAWPIPE, 8, 8, LLAMA_1P),                                              # RMSNorm, q/k norms
    (4, TAWPIPE + ["--tawpipe-no-recompute"], 4, 8, GPT_1P),                   # LayerNorm with biases
    (4, TAWPIPE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4, 6, LLAMA_1P),
]


@pytest.mark.parametrize("world,extra,layers,global_batch,architecture", CASES,
                         ids=["tawpipe-P4-rmsnorm-qk", "tawpipe-P4-norecompute-layernorm", "tawpipe-P4-T2-sp-rmsnorm-qk"])
def test_tawpipe_with_layernorm_1p_matches_single_process_reference(world, extra, layers, global_batch,
                                                                      architecture, reference, tmp_path):
    """Losses, gradient norms and every parameter after every step equal one process's (fp32)."""
    ref_records, ref_save = reference(layers, global_batch, architecture=architecture)
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, world, _args(*extra, "--tawpipe-nccl-faithful", "--distributed-timeout-minutes",
                                                  "2", layers=layers, global_batch=global_batch, save=save,
                                                  architecture=architecture))
    for records in per_rank:
        assert_close_rel(losses(records), losses(ref_records), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], 1e-5,
                         "grad norm")
    assert losses(ref_records)[0] != losses(ref_records)[-1]
    # Gradients entering every optimizer step within 1e-5, parameters within what Adam makes of that.
    assert_matches_reference(save, ref_save, ITERS)
    # The checkpoint holds gamma - 1: the norm weights moved away from 0, not from 1.
    import os

    from megatron_tawpipe.checkpoint import read_parameters

    params = read_parameters(os.path.join(save, f"iter_{ITERS:07d}"))
    norm_weights = {k: v for k, v in params.items() if k.endswith(("layer_norm_weight", "layernorm.weight"))}
    assert norm_weights and all(0 < v.abs().max().item() < 0.1 for v in norm_weights.values())
