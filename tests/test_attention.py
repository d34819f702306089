"""SDPA core attention against megatron-core's local DotProductAttention."""

import pytest
import torch

from distributed_harness import run_ranks


def _compare(rank, heads, groups, with_mask, seq):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tawpipe.compat import cpu as cpu_compat
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.models.attention import SDPAttention
    from megatron_tawpipe.models.llama import llama_config

    cpu_compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(3)
    argv = ["--train-iters", "1", "--hidden-size", str(16 * heads), "--num-attention-heads", str(heads),
            "--attention-dropout", "0.0"]
    if groups != heads:
        argv += ["--group-query-attention", "--num-query-groups", str(groups)]
    config = llama_config(parse_args(argv))
    ours = SDPAttention(config, 1, AttnMaskType.causal, "self")
    theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)
    q = torch.randn(seq, 2, heads, 16, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(seq, 2, groups, 16).requires_grad_()
    v = torch.randn(seq, 2, groups, 16).requires_grad_()
    mask = None
    if with_mask:  # causal plus a padded tail: True = masked out (megatron's convention)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None].repeat(2, 1, 1, 1)
        mask[1, :, :, seq - 3:] = True
        mask[1, :, seq - 3:, :] = False  # keep rows fully valid where everything else is masked
        mask[1, :, seq - 3:, seq - 3:] = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    results = []
    for module in (ours, theirs):
        out = module(q, k, v, mask)
        grad_out = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out.detach(), [g.detach() for g in grads]))
    (o1, g1), (o2, g2) = results
    return (o1 - o2).abs().max().item(), max((a - b).abs().max().item() for a, b in zip(g1, g2)), tuple(o1.shape)


@pytest.mark.parametrize("heads,groups,with_mask", [(4, 4, False), (4, 2, False), (4, 4, True)],
                         ids=["mha-causal", "gqa-causal", "explicit-mask"])
def test_sdpa_matches_local_attention(heads, groups, with_mask):
    (out_diff, grad_diff, shape), = run_ranks(_compare, 1, heads, groups, with_mask, 24)
    assert shape == (24, 2, heads * 16)
    assert out_diff < 1e-5, out_diff
    assert grad_diff < 1e-5, grad_diff


def test_unsupported_options_are_refused():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.models.attention import SDPAttention
    from megatron_tawpipe.models.llama import llama_config

    config = llama_config(parse_args(["--train-iters", "1"]))
    config.window_size = (16, 0)
    with pytest.raises(ValueError, match="window_size"):
        SDPAttention(config, 1, AttnMaskType.causal, "self")
