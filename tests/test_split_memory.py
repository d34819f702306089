"""The split backward's weight-gradient store in a whole run: the peak the runtime records
(``--record-plan-memory``: ``plan_wgrad_store_peak_bytes_max_rank``, ``WgradStore.peak_bytes``) is the memory
model's (``sim.memory.weight_store_peak_bytes`` over the plan, ``CostModel.layer_weight_store_bytes`` per layer),
byte for byte; a plan without split backwards records no store."""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.sim import CostModel
from megatron_tawpipe.sim.memory import weight_store_peak_bytes
from training_helpers import tiny_args, train_rank

SEQ, HIDDEN, FFN, HEADS, LAYERS, P, N = 128, 64, 128, 4, 8, 2, 2


def _argv(*extra):
    argv = tiny_args("--pipeline-schedule", "weipipe", "--tawpipe-num-groups", "1", "--tawpipe-no-recompute",
                     "--record-plan-memory", *extra, train_iters=2, global_batch=P * N)
    for flag, value in (("--seq-length", SEQ), ("--max-position-embeddings", SEQ)):
        argv[argv.index(flag) + 1] = str(value)
    return argv


def test_the_store_peak_a_run_records_is_the_memory_models():
    records = run_ranks(train_rank, P, _argv("--weipipe-zero-bubble", "2"))
    measured = {r["plan_wgrad_store_peak_bytes_max_rank"] for rank in records for r in rank}
    assert len(measured) == 1, measured        # every iteration and rank reports the same (reset every step)
    cost = CostModel.from_flops(hidden_size=HIDDEN, seq_length=SEQ, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                                vocab_size=200, recompute=False, dtype_bytes=4)
    # the runtime's accounting per layer and micro-batch (docs/split-backward.md): 4h + (4 n_q d + 3f) without GQA
    assert cost.layer_weight_store_bytes == SEQ * (4 * HIDDEN + 4 * HIDDEN + 3 * FFN) * 4
    plan = build_plan("weipipe-zb2", num_ranks=P, num_groups=1, num_layers=LAYERS, num_microbatches=N)
    predicted = weight_store_peak_bytes(plan, cost)
    assert predicted >= 2 * (LAYERS // P) * cost.layer_weight_store_bytes   # WZB2 holds several backwards' stores
    assert measured.pop() == pytest.approx(predicted, abs=0)


def test_a_plan_without_split_backwards_records_no_store():
    records = run_ranks(train_rank, P, _argv())
    assert all("plan_wgrad_store_peak_bytes_max_rank" not in r for rank in records for r in rank)
    assert all(r["plan_memory_growth_bytes_max_rank"] > 0 for rank in records for r in rank)
