"""Emulated compute with --context-parallel-size 2: each layer sleeps 1/C of its calibrated times around the ring
attention's real exchange (keys and values of the real size forward, again with their fp32 gradients backward),
under megatron's native schedule and inside TawPipe."""

import json

import pytest

from distributed_harness import run_ranks
from training_helpers import pinned_layout, tiny_args, train_rank

TIMES = {"layer_forward": 0.002, "layer_backward": 0.004, "layer_recompute": 0.002,
         "head_forward": 0.001, "head_backward": 0.002}
KV = 2 * (32 // 2) * 1 * 64   # keys and values of S / C tokens: 2 x 16 tokens x 64 channels (no grouped heads)


def _ring_messages_rank(rank, argv):
    """Train, recording every ring message (the send of each batch_isend_irecv posted on the context-parallel
    group: elements, dtype, peer)."""
    import torch.distributed as dist

    seen = []
    original = dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            if op.op is dist.isend and op.group is not None and dist.get_world_size(op.group) == 2:
                from megatron.core import parallel_state

                if op.group is parallel_state.get_context_parallel_group():
                    seen.append((op.tensor.numel(), str(op.tensor.dtype), op.peer))
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        records = train_rank(rank, argv)
    finally:
        dist.batch_isend_irecv = original
    return records, seen


def _times_file(tmp_path):
    path = tmp_path / "times.json"
    path.write_text(json.dumps(TIMES))
    return str(path)


@pytest.mark.parametrize("schedule", ["native", "tawpipe"])
def test_emulated_layers_run_the_rings_exchange(tmp_path, schedule):
    """Per layer and micro-batch: one message of keys and values forward (C - 1 = 1), one more and two fp32
    gradient accumulators backward (C = 2), one more in TawPipe's recompute; each to the ring's next rank, of
    the real size; half of the calibrated times slept."""
    t = TIMES
    if schedule == "native":   # 2 ranks, one context-parallel group: 8 micro-batches, no recompute
        world, extra, microbatches, recompute = 2, [], 8, 0
    else:                      # 4 ranks in 2 groups: 2 virtual ranks of 2, 4 micro-batches each, recomputing
        world, microbatches, recompute = 4, 4, 1
        extra = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *pinned_layout(2)]
    argv = tiny_args("--context-parallel-size", "2", *extra, "--emulated-compute-times", _times_file(tmp_path),
                     train_iters=2)
    results = run_ranks(_ring_messages_rank, world, argv)
    layers = 8
    for rank, (records, seen) in enumerate(results):
        peer = rank ^ 1                      # the other member of the rank's context-parallel pair
        per_iteration = microbatches * layers * (1 + recompute + 3)
        assert len(seen) == 2 * per_iteration, (schedule, rank, len(seen))
        assert {p for _, _, p in seen} == {peer}
        assert all(numel == KV for numel, _, _ in seen)
        for record in records:
            assert record["compute"] == "emulated"
            slept = microbatches * (layers * (t["layer_forward"] + t["layer_backward"] + recompute *
                                              t["layer_recompute"]) + t["head_forward"] + t["head_backward"]) / 2
            assert record["elapsed_ms"] / 1000 >= 0.95 * slept
            assert 0.0 < record["compute_busy_fraction"] <= 1.0
            # the ring's posts and waits, timed beside the sleeps: some time, less than the iteration's rest
            assert 0.0 < record["emulated_ring_seconds"] < (1 - record["compute_busy_fraction"]) * \
                record["elapsed_ms"] / 1000 + 0.01
            if schedule == "tawpipe":   # each member moves its piece: the links carry the plan's bytes
                assert record["inter_group_bytes"] == record["planned_inter_group_bytes"] > 0


def test_ring_sleeps_its_share_around_each_exchange():
    """The ring alone on 2 ranks: forward 1 exchange, backward 1 + 2 (the accumulators fp32), the sleeps
    adding up to the layer time given, the score blocks' share slept between the posts and the waits."""
    results = run_ranks(_ring_alone_rank, 2)
    for sleeps, sent in results:
        forward, backward = sleeps
        assert abs(sum(forward) - 0.010) < 1e-12 and abs(sum(backward) - 0.020) < 1e-12
        # linear half, step 0 (overlapping the exchange), step 1, linear half
        assert forward == pytest.approx([0.0035, 0.0015, 0.0015, 0.0035])
        assert [(n, d) for n, d in sent] == [(6, "torch.bfloat16"), (6, "torch.bfloat16"), (6, "torch.float32"),
                                            (6, "torch.float32")]


def _ring_alone_rank(rank):
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.emulation.ring import EmulatedRing

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    ring = EmulatedRing(group, 2, rank, kv_numel=6, share=0.3)
    sent = []
    original = dist.batch_isend_irecv

    def recording(ops):
        sent.extend((op.tensor.numel(), str(op.tensor.dtype)) for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        forward, backward = [], []
        ring.forward(0.010, lambda seconds, actual=None: forward.append(seconds), torch.bfloat16, "cpu")
        ring.backward(0.020, lambda seconds, actual=None: backward.append(seconds), torch.bfloat16, "cpu")
        spent = ring.take_spent_s()
        assert spent > 0.0 and ring.take_spent_s() == 0.0   # the exchanges' posts and waits, taken once
    finally:
        dist.batch_isend_irecv = original
        dist.destroy_process_group()
    return (forward, backward), sent


def test_a_pass_owes_each_sleeps_overrun_to_the_next_until_a_wait_hides_it():
    import time

    from megatron_tawpipe.emulation.ring import PassSleep

    asked = []

    def oversleeping(seconds, actual):   # every sleep wakes 2 ms late
        asked.append((seconds, actual))
        time.sleep(actual + 0.002)

    sleep = PassSleep(oversleeping)
    sleep(0.010)
    sleep(0.010)                 # shortened by the first one's overrun
    assert asked[0] == (0.010, 0.010)
    assert asked[1][0] == 0.010 and asked[1][1] <= 0.008
    sleep.waited(1.0)            # a blocking wait absorbed what was owed
    assert sleep.owed == 0.0
    sleep(0.010)
    assert asked[2] == (0.010, 0.010)
    sleep.owed = 0.015           # owed more than a step: skipped, the rest still owed
    sleep(0.010)
    assert asked[3] == (0.010, 0.0) and abs(sleep.owed - 0.005) < 1e-12
