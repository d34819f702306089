"""Context-parallel ring attention (megatron_tawpipe/models/ring_attention.py) against single-process SDPA.

One rank: the module's output and gradients equal ``scaled_dot_product_attention``'s. Two and four forked gloo
ranks: each rank takes its balanced share of one seeded global q/k/v and upstream gradient; the ranks'
outputs and gradients, put back in sequence order, equal SDPA's on the whole sequence. The causal block
schedule covers every needed (query chunk, key chunk) pair exactly once, skips the hidden ones, and gives every
rank the same count; the kernels are counted while they run, and the ring's sends and receives are posted in
one order on every rank."""

import pytest
import torch
import torch.nn.functional as F

from distributed_harness import run_ranks
from megatron_tawpipe.models import ring_attention as ring
from megatron_tawpipe.models.ring_attention import (causal_block_pairs, gather_from_context_parallel, ring_attention,
                                                    split_for_context_parallel)

B, NQ, NKV, S, D = 2, 4, 2, 32, 8
SCALE = 0.37
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def _global_inputs(seed=1234):
    """Seeded full-sequence q, k, v and upstream gradient (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, NQ, S, D, generator=gen), torch.randn(B, NKV, S, D, generator=gen),
            torch.randn(B, NKV, S, D, generator=gen), torch.randn(B, NQ, S, D, generator=gen))


def _reference(q, k, v, dout, causal):
    """SDPA on the full sequence in fp32, key/value heads repeated for the query heads by hand."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(NQ // NKV, 1), v.repeat_interleave(NQ // NKV, 1),
                                         is_causal=causal, scale=SCALE)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


# ---- one rank ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_equals_sdpa_forward_and_backward(causal, dtype):
    q, k, v, dout = _global_inputs()
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, None, scale=SCALE, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    out.backward(dout)
    expected = _reference(q, k, v, dout, causal)
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], expected):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype], msg=name)


def test_one_rank_uses_sdpa_grouped_heads_convention():
    """Query head h reads key/value head h // (n_q // n_kv), as SDPA's enable_gqa does."""
    q, k, v, _ = _global_inputs(7)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(ring_attention(q, k, v, None, scale=SCALE), want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise_value_error_naming_them():
    q, k, v, _ = _global_inputs()
    with pytest.raises(ValueError, match=r"query heads must be a multiple.*query \(2, 4, 32, 8\), key \(2, 3"):
        ring_attention(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), None, scale=SCALE)
    with pytest.raises(ValueError, match="local length"):
        ring_attention(q, k[:, :, :16], v[:, :, :16], None, scale=SCALE)
    with pytest.raises(ValueError, match="one float dtype"):
        ring_attention(q, k.double(), v, None, scale=SCALE)
    # one rank: an odd length is fine (the whole sequence is one chunk)
    out = ring_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], None, scale=SCALE)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7],
                                                                   is_causal=True, scale=SCALE, enable_gqa=True))


# ---- the split and the schedule ----------------------------------------------------------------------------
def test_split_takes_chunks_i_and_2c_minus_1_minus_i_and_gather_inverts_it():
    seq = torch.arange(16).view(1, 16)
    assert split_for_context_parallel(seq, 1, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_for_context_parallel(seq, 1, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert split_for_context_parallel(seq, 1, 4, 1).tolist() == [[2, 3, 12, 13]]
    x = torch.randn(3, 24, 2)
    for cp in (1, 2, 3, 4, 6):
        parts = [split_for_context_parallel(x, 1, cp, r) for r in range(cp)]
        assert all(p.shape == (3, 24 // cp, 2) for p in parts)
        assert torch.equal(gather_from_context_parallel(parts, 1), x)
    with pytest.raises(ValueError, match="cannot be cut into 10 equal chunks"):
        split_for_context_parallel(x, 1, 5, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_causal_schedule_covers_each_visible_block_once_and_is_balanced(cp):
    chunks = 2 * cp if cp > 1 else 1
    per_rank = [causal_block_pairs(cp, r) for r in range(cp)]
    all_pairs = [pair for pairs in per_rank for pair in pairs]
    visible = {(qc, kc) for qc in range(chunks) for kc in range(chunks) if kc <= qc}
    assert len(all_pairs) == len(set(all_pairs)) and set(all_pairs) == visible   # once each; none hidden
    assert {len(pairs) for pairs in per_rank} == {1 if cp == 1 else 2 * cp + 1}    # the same work on each rank
    for r, pairs in enumerate(per_rank):    # a rank computes only its own query chunks
        assert {qc for qc, _ in pairs} <= {r, 2 * cp - 1 - r}


# ---- several ranks -----------------------------------------------------------------------------------------
def _rank(rank, world_size):
    """One rank: local outputs and gradients (fp32 and bf16, causal and not), the kernels' calls, the posted
    transfers, and the error for an odd local length."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    calls, posts = [], []
    attend, grads, batch = ring._attend_block, ring._block_grads, dist.batch_isend_irecv

    def counted(kernel, kind):
        def wrapper(q, k, *args):
            calls.append((kind, tuple(q.shape), tuple(k.shape)))
            return kernel(q, k, *args)
        return wrapper

    def recorded(ops):
        posts.append([(op.op.__name__, op.peer, op.tensor.numel()) for op in ops])
        return batch(ops)

    ring._attend_block, ring._block_grads = counted(attend, "forward"), counted(grads, "backward")
    dist.batch_isend_irecv = recorded
    q, k, v, dout = (split_for_context_parallel(t, 2, world_size, rank) for t in _global_inputs())
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            del calls[:], posts[:]
            leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*leaves, dist.group.WORLD, scale=SCALE, causal=causal)
            out.backward(dout.to(dtype))
            results[dtype, causal] = dict(
                tensors=[t.detach().float().numpy() for t in [out] + [leaf.grad for leaf in leaves]],
                dtypes=[t.dtype for t in [out] + [leaf.grad for leaf in leaves]],
                calls=list(calls), posts=list(posts))
    try:
        ring_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], dist.group.WORLD, scale=SCALE)
        results["odd"] = None
    except ValueError as error:
        results["odd"] = str(error)
    dist.barrier()
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_together_equal_sdpa_on_the_whole_sequence(world_size):
    per_rank = run_ranks(_rank, world_size, world_size, timeout=240)
    global_inputs = _global_inputs()
    local = S // world_size
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            rounded = [t.to(dtype) for t in global_inputs]
            expected = _reference(*rounded, causal)
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                got = gather_from_context_parallel([torch.from_numpy(r[dtype, causal]["tensors"][i])
                                                    for r in per_rank], 2)
                torch.testing.assert_close(got, expected[i], **TOLERANCE[dtype],
                                           msg=f"{name} {dtype} causal={causal} C={world_size}")
            assert all(r[dtype, causal]["dtypes"] == [dtype] * 4 for r in per_rank)
    for rank, result in enumerate(per_rank):
        for causal in (True, False):
            calls = result[torch.float32, causal]["calls"]
            forward = [c for c in calls if c[0] == "forward"]
            backward = [c for c in calls if c[0] == "backward"]
            if world_size == 1:
                blocks = 1
            else:
                blocks = len(causal_block_pairs(world_size, rank)) if causal else 4 * world_size
            assert len(forward) == len(backward) == blocks
            # never a score matrix over more than one chunk of keys: local/2 keys, (g * local/2) query rows
            chunk = local if world_size == 1 else local // 2
            assert {(c[1][2], c[2][2]) for c in calls} == {((NQ // NKV) * chunk, chunk)}
            posts = result[torch.float32, causal]["posts"]
            if world_size == 1:
                assert posts == []
            else:
                # C-1 key/value transfers forward; C-1 key/value and C gradient transfers backward; every one
                # a send to the next rank then a receive from the previous, the same sequence on every rank
                assert len(posts) == (world_size - 1) + (world_size - 1) + world_size
                nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
                assert all([(op, peer) for op, peer, _ in p] == [("isend", nxt), ("irecv", prv)] for p in posts)
                assert [[n for *_, n in p] for p in posts] == [[n for *_, n in p]
                                                               for p in per_rank[0][torch.float32, causal]["posts"]]
        if world_size == 1:
            assert result["odd"] is None
        else:
            assert "even" in result["odd"] and f"query (2, 4, {local - 1}, 8)" in result["odd"]
    if world_size > 1:   # balanced: every rank the same number of causal blocks
        assert len({len(r[torch.float32, True]["calls"]) for r in per_rank}) == 1
