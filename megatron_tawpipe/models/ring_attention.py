"""Context-parallel ring attention: exact softmax attention over a sequence split across C ranks.

Layout. Context parallelism cuts each sequence of length S into 2C equal chunks; context-parallel rank i
holds global chunks i and 2C-1-i, concatenated in that order (:func:`split_for_context_parallel`, inverted
by :func:`gather_from_context_parallel`). With a causal mask this balances the work: every rank owns one
early and one late chunk, so every rank computes the same number of score blocks.

Forward. Each rank keeps its queries and passes its keys and values around the ring (rank r sends to r+1
and receives from r-1; C-1 transfers, each posted before the current step's blocks are computed so that the
transfer overlaps the compute). At each step the rank attends each local query chunk to each held key/value
chunk it needs (:func:`_step_blocks`): with the causal mask a (query chunk, key chunk) pair whose key chunk
lies wholly after the query chunk is skipped, a pair of equal chunks is computed with a causal mask, and the
rest unmasked. Blocks are merged online: an fp32 running row maximum, row sum of exponentials and output
accumulator per query row, so no score matrix larger than one chunk by one chunk is ever formed. The
forward saves only the local query, key, value, output and the fp32 log-sum-exp of each row.

Backward. The score blocks are recomputed from the saved log-sum-exp. The query gradient is accumulated
locally; the key/value gradient of the key/value chunks currently held is accumulated in an fp32 buffer that
travels around the ring behind its keys and values, so that after the last step (one more transfer) every
rank holds the gradient of its own keys and values. Each step's block gradients are computed into a fresh
buffer while the previous step's buffer is in transit, then added to it on arrival.

Grouped-query attention: query head h uses key/value head h // (n_q // n_kv); the query heads of a group
are laid out as extra rows of one matrix product against their shared key/value head, which sums the
key/value gradient over the group. Score matrix products run in the input dtype; softmax statistics and
all accumulators are fp32. Dropout and explicit mask tensors are not supported.

Transfers use ``torch.distributed.batch_isend_irecv`` with the send to the next rank and the receive from the
previous rank posted together, in the same order on every rank (as NCCL requires).

With C = 1 (``group`` None or of size one) the whole sequence is a single chunk and the result equals
``scaled_dot_product_attention`` with the same ``scale``, ``is_causal`` and grouped-query heads.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "split_for_context_parallel", "gather_from_context_parallel",
           "causal_block_pairs"]


# ---- the balanced split -------------------------------------------------------------------------------------
def split_for_context_parallel(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s share of a full-length ``tensor`` along ``dim``: chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks, concatenated. ``cp_size`` 1 returns ``tensor``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is not in a group of size {cp_size}")
    if cp_size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of length {length} (dim {dim} of shape {tuple(tensor.shape)}) cannot be cut "
                         f"into {2 * cp_size} equal chunks for context parallelism of size {cp_size}")
    chunks = tensor.split(length // (2 * cp_size), dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim)


def gather_from_context_parallel(local_tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full-length tensor from every rank's share (in rank order): the inverse of
    :func:`split_for_context_parallel`."""
    cp_size = len(local_tensors)
    if cp_size == 0:
        raise ValueError("gather_from_context_parallel needs at least one rank's tensor")
    if cp_size == 1:
        return local_tensors[0]
    shapes = {tuple(t.shape) for t in local_tensors}
    if len(shapes) != 1 or local_tensors[0].shape[dim] % 2:
        raise ValueError(f"the ranks' shares must have one shape with an even length along dim {dim}; got "
                         f"{[tuple(t.shape) for t in local_tensors]}")
    halves = [t.chunk(2, dim) for t in local_tensors]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


# ---- which blocks a rank computes ---------------------------------------------------------------------------
def _kv_source(cp_size: int, cp_rank: int, step: int) -> int:
    """The rank whose keys/values ``cp_rank`` holds at ring step ``step``."""
    return (cp_rank - step) % cp_size


def _step_blocks(cp_size: int, cp_rank: int, kv_rank: int, causal: bool) -> List[Tuple[int, int, bool]]:
    """``(local query chunk, local key chunk, diagonal)`` blocks that ``cp_rank`` computes against the
    keys/values of ``kv_rank``; ``diagonal`` blocks take the causal mask. Local chunk 0 of rank j is global
    chunk j, local chunk 1 global chunk 2C-1-j; with C = 1 there is one chunk, the whole sequence."""
    if cp_size == 1:
        return [(0, 0, causal)]
    if not causal:
        return [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]
    # Query chunk i never sees key chunk 2C-1-j (>= C > i); query chunk 2C-1-i always sees key chunk j (< C).
    if kv_rank == cp_rank:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if kv_rank < cp_rank:      # key chunk j < i: query chunk i sees it; key chunk 2C-1-j > 2C-1-i is hidden
        return [(0, 0, False), (1, 0, False)]
    return [(1, 0, False), (1, 1, False)]   # j > i: only query chunk 2C-1-i sees keys, and it sees both


def causal_block_pairs(cp_size: int, cp_rank: int) -> List[Tuple[int, int]]:
    """The ``(query chunk, key chunk)`` pairs, in global chunk numbers of the 2C-chunk split and in ring
    order, that rank ``cp_rank`` computes with the causal mask (2C+1 for every rank when C > 1). With C = 1
    the sequence is a single chunk: ``[(0, 0)]``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is not in a group of size {cp_size}")
    if cp_size == 1:
        return [(0, 0)]

    def chunk(rank: int, local: int) -> int:
        return rank if local == 0 else 2 * cp_size - 1 - rank

    pairs = []
    for step in range(cp_size):
        kv_rank = _kv_source(cp_size, cp_rank, step)
        blocks = _step_blocks(cp_size, cp_rank, kv_rank, True)
        pairs += [(chunk(cp_rank, qc), chunk(kv_rank, kc)) for qc, kc, _ in blocks]
    return pairs


# ---- block kernels -----------------------------------------------------------------------------------------
def _attend_block(q, k, v, scale, mask, acc, row_max, row_sum) -> None:
    """Merge one block into the running statistics, in place. ``q``: ``[b, n_kv, g*L, d]`` (a query chunk,
    the group's query heads as rows); ``k``, ``v``: ``[b, n_kv, L, d]``; ``acc`` fp32 ``[b, n_kv, g*L, d_v]``;
    ``row_max``, ``row_sum`` fp32 ``[b, n_kv, g*L]``; ``mask`` (True = hidden) ``[g*L, L]`` or None."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    new_max = torch.maximum(row_max, scores.amax(-1))   # every row has an unmasked entry: finite
    probs = torch.exp(scores.sub_(new_max.unsqueeze(-1)))
    correction = torch.exp(row_max - new_max)
    row_sum.mul_(correction).add_(probs.sum(-1))
    acc.mul_(correction.unsqueeze(-1)).add_(torch.matmul(probs.to(v.dtype), v).float())
    row_max.copy_(new_max)


def _block_grads(q, k, v, dout, lse, delta, scale, mask, dq, dk, dv) -> None:
    """Add one block's gradients, in place, to the fp32 ``dq`` (``[b, n_kv, g*L, d]``), ``dk`` and ``dv``
    (``[b, n_kv, L, d]``), recomputing its probabilities from the rows' log-sum-exp ``lse``; ``delta`` is
    each row's ``sum(dout * out)``."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    probs = torch.exp(scores.sub_(lse.unsqueeze(-1)))
    dv.add_(torch.matmul(probs.to(dout.dtype).transpose(-1, -2), dout).float())
    dprobs = torch.matmul(dout, v.transpose(-1, -2)).float()
    dscores = probs.mul_(dprobs.sub_(delta.unsqueeze(-1))).mul_(scale).to(q.dtype)
    dq.add_(torch.matmul(dscores, k).float())
    dk.add_(torch.matmul(dscores.transpose(-1, -2), q).float())


# ---- layout helpers ----------------------------------------------------------------------------------------
def _grouped(x: torch.Tensor, chunk: int, length: int, n_kv: int) -> torch.Tensor:
    """Chunk ``chunk`` of ``x`` ``[b, n_q, s, d]`` as ``[b, n_kv, g*length, d]`` (query heads of a group as rows)."""
    b, n_q, _, d = x.shape
    part = x[:, :, chunk * length:(chunk + 1) * length]
    return part.reshape(b, n_kv, (n_q // n_kv) * length, d)


def _ungrouped(x: torch.Tensor, n_q: int) -> torch.Tensor:
    b, n_kv, rows, d = x.shape
    return x.reshape(b, n_q, rows * n_kv // n_q, d)


def _diagonal_mask(length: int, groups: int, device) -> torch.Tensor:
    """The causal mask of a diagonal block, ``[groups*length, length]``, True where a key follows the query."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu_(1).repeat(groups, 1)


def _cp_layout(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_attention: this process is not a member of the context-parallel group")
    return size, rank


def _post_exchange(send: torch.Tensor, recv: torch.Tensor, group, cp_size: int, cp_rank: int):
    """Post the send of ``send`` to the next rank and the receive into ``recv`` from the previous one, in that
    order on every rank; returns what :func:`_wait` takes."""
    to_next = dist.get_global_rank(group, (cp_rank + 1) % cp_size)
    from_prev = dist.get_global_rank(group, (cp_rank - 1) % cp_size)
    ops = [dist.P2POp(dist.isend, send, to_next, group), dist.P2POp(dist.irecv, recv, from_prev, group)]
    return dist.batch_isend_irecv(ops), send   # the send buffer is kept alive until waited on


def _wait(pending) -> None:
    works, _ = pending
    for work in works:
        work.wait()


# ---- forward and backward ----------------------------------------------------------------------------------
def _forward(q, k, v, group, cp_size, cp_rank, scale, causal):
    b, n_q, s, d = q.shape
    n_kv = k.shape[1]
    chunks = 2 if cp_size > 1 else 1
    length = s // chunks
    rows = (n_q // n_kv) * length
    f32 = dict(dtype=torch.float32, device=q.device)
    queries = [_grouped(q, c, length, n_kv) for c in range(chunks)]
    acc = [torch.zeros(b, n_kv, rows, v.shape[-1], **f32) for _ in range(chunks)]
    row_max = [torch.full((b, n_kv, rows), float("-inf"), **f32) for _ in range(chunks)]
    row_sum = [torch.zeros(b, n_kv, rows, **f32) for _ in range(chunks)]
    mask = _diagonal_mask(length, n_q // n_kv, q.device) if causal else None
    held = torch.cat([k, v], -1) if cp_size > 1 else None   # keys and values travel as one buffer
    for step in range(cp_size):
        pending = incoming = None
        if step < cp_size - 1:
            incoming = torch.empty_like(held)
            pending = _post_exchange(held, incoming, group, cp_size, cp_rank)
        keys, values = (k, v) if held is None else (held[..., :d], held[..., d:])
        for qc, kc, diagonal in _step_blocks(cp_size, cp_rank, _kv_source(cp_size, cp_rank, step), causal):
            window = slice(kc * length, (kc + 1) * length)
            _attend_block(queries[qc], keys[:, :, window], values[:, :, window], scale,
                          mask if diagonal else None, acc[qc], row_max[qc], row_sum[qc])
        if pending is not None:
            _wait(pending)
            held = incoming
    out = torch.cat([_ungrouped(acc[c] / row_sum[c].unsqueeze(-1), n_q) for c in range(chunks)], 2)
    lse = torch.stack([row_max[c] + torch.log(row_sum[c]) for c in range(chunks)], 2)  # [b, n_kv, chunks, rows]
    return out.to(q.dtype), lse


def _backward(q, k, v, out, lse, dout, group, cp_size, cp_rank, scale, causal):
    b, n_q, s, d = q.shape
    n_kv = k.shape[1]
    chunks = 2 if cp_size > 1 else 1
    length = s // chunks
    queries = [_grouped(q, c, length, n_kv) for c in range(chunks)]
    douts = [_grouped(dout, c, length, n_kv) for c in range(chunks)]
    deltas = [(douts[c].float() * _grouped(out, c, length, n_kv).float()).sum(-1) for c in range(chunks)]
    dqs = [torch.zeros(queries[c].shape, dtype=torch.float32, device=q.device) for c in range(chunks)]
    mask = _diagonal_mask(length, n_q // n_kv, q.device) if causal else None
    held = torch.cat([k, v], -1) if cp_size > 1 else None
    grad_shape = (b, n_kv, s, d + v.shape[-1])
    grad_pending = grad_incoming = None
    for step in range(cp_size):
        kv_pending = kv_incoming = None
        if step < cp_size - 1:
            kv_incoming = torch.empty_like(held)
            kv_pending = _post_exchange(held, kv_incoming, group, cp_size, cp_rank)
        keys, values = (k, v) if held is None else (held[..., :d], held[..., d:])
        grads = torch.zeros(grad_shape, dtype=torch.float32, device=q.device)   # this step's part
        for qc, kc, diagonal in _step_blocks(cp_size, cp_rank, _kv_source(cp_size, cp_rank, step), causal):
            window = slice(kc * length, (kc + 1) * length)
            _block_grads(queries[qc], keys[:, :, window], values[:, :, window], douts[qc], lse[:, :, qc],
                         deltas[qc], scale, mask if diagonal else None, dqs[qc],
                         grads[:, :, window, :d], grads[:, :, window, d:])
        if grad_pending is not None:   # the earlier ranks' sum for the keys/values held now
            _wait(grad_pending)
            grads += grad_incoming
        if cp_size > 1:
            grad_incoming = torch.empty_like(grads)
            grad_pending = _post_exchange(grads, grad_incoming, group, cp_size, cp_rank)
        if kv_pending is not None:
            _wait(kv_pending)
            held = kv_incoming
    if grad_pending is not None:       # after C passes, the gradient of this rank's own keys/values
        _wait(grad_pending)
        grads = grad_incoming
    dq = torch.cat([_ungrouped(dqs[c], n_q) for c in range(chunks)], 2)
    return dq.to(q.dtype), grads[..., :d].to(k.dtype), grads[..., d:].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, scale, causal):
        cp_size, cp_rank = _cp_layout(group)
        out, lse = _forward(query, key, value, group, cp_size, cp_rank, scale, causal)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout = (group, cp_size, cp_rank, scale, causal)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(query, key, value, out, lse, grad_out.contiguous(), *ctx.layout)
        return dq, dk, dv, None, None, None


def _check_inputs(query, key, value, cp_size: int) -> None:
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"ring_attention takes [b, heads, s_local, d] tensors; got {shapes}")
    if not (query.is_floating_point() and query.dtype == key.dtype == value.dtype):
        raise ValueError(f"ring_attention needs query, key and value of one float dtype; got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    b, n_q, s, d = query.shape
    if key.shape[0] != b or key.shape[2] != s or key.shape[3] != d or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"ring_attention: key and value must match query's batch and local length, key its "
                         f"head size, value key's heads; got {shapes}")
    if key.shape[1] == 0 or n_q % key.shape[1]:
        raise ValueError(f"ring_attention: the {n_q} query heads must be a multiple of the {key.shape[1]} "
                         f"key/value heads; got {shapes}")
    if s == 0 or (cp_size > 1 and s % 2):
        raise ValueError(f"ring_attention with context parallelism of size {cp_size} needs an even, non-zero local "
                         f"sequence length (two chunks per rank); got {shapes}")


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Optional["dist.ProcessGroup"],
                   *, scale: float, causal: bool = True) -> torch.Tensor:
    """Softmax attention of this rank's queries against the whole sequence's keys/values, the sequence split
    over ``group``'s ranks by :func:`split_for_context_parallel`.

    ``query`` ``[b, n_q, s_local, d]``, ``key``/``value`` ``[b, n_kv, s_local, d]`` (``n_q % n_kv == 0``), one
    float dtype; returns ``[b, n_q, s_local, d]`` in that dtype. ``group`` None means one rank. ``causal``:
    causal in the global token order; otherwise every query sees every key. Differentiable (hand-written
    backward); every rank of ``group`` must call it, forward and backward, with the same shapes.
    """
    cp_size, _ = _cp_layout(group)
    _check_inputs(query, key, value, cp_size)
    return _RingAttention.apply(query, key, value, group, float(scale), bool(causal))
