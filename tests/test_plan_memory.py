"""The memory model against what the runtime holds: a plan's compute, measured after every compute action
(``--record-plan-memory``), holds what the simulator's memory model predicts from the plan's order and one
layer's activation bytes measured on this machine (``tools/calibrate.py --measure-activations``) -- stored
activations until each backward and, between a split backward's two passes, the shard's weight gradients."""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.sim import CostModel, simulate
from megatron_tawpipe.sim.strategies import plan_memory
from training_helpers import tiny_args, train_rank

SEQ, HIDDEN, FFN, LAYERS, P = 512, 64, 128, 8, 2


def _argv(*extra, global_batch):
    argv = tiny_args(*extra, train_iters=2, global_batch=global_batch)
    for flag, value in (("--seq-length", SEQ), ("--max-position-embeddings", SEQ)):
        argv[argv.index(flag) + 1] = str(value)
    return argv


def _layer_bytes(rank, argv):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.bench.activation_bytes import measure_layer_activation_bytes
    from megatron_tawpipe.common.device import current_device
    from megatron_tawpipe.data import pad_vocab_size
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel

    args = parse_args(argv)
    args.padded_vocab_size = pad_vocab_size(args.vocab_size)
    initialize_distributed(args)
    initialize_model_parallel(args)
    try:
        return measure_layer_activation_bytes(args, current_device())
    finally:
        destroy()


@pytest.mark.parametrize("schedule,N,flags", [
    ("weipipe", 2, []),
    ("weipipe-zb2", 2, ["--weipipe-zero-bubble", "2"]),
    ("tawpipe", 2, ["--tawpipe-microbatches-per-visit", "2"]),
])
def test_plan_memory_matches_the_memory_model(schedule, N, flags):
    (layer,) = run_ranks(_layer_bytes, 1, _argv(global_batch=P * N))
    assert layer > 20 * SEQ * HIDDEN * 4          # tens of values per token and hidden unit (fp32)
    argv = _argv("--pipeline-schedule", schedule.split("-")[0], "--tawpipe-num-groups", "1", "--tawpipe-no-recompute",
                 "--record-plan-memory", *flags, global_batch=P * N)
    measured = max(r[-1]["plan_memory_growth_bytes_max_rank"] for r in run_ranks(train_rank, P, argv))
    plan = build_plan(schedule, num_ranks=P, num_groups=1, num_layers=LAYERS, num_microbatches=N,
                      **({"chunk": 2} if schedule == "tawpipe" else {}))
    cost = CostModel.from_flops(hidden_size=HIDDEN, seq_length=SEQ, ffn_hidden_size=FFN, num_attention_heads=4,
                                vocab_size=256, recompute=False, dtype_bytes=4).with_measured(
        {"layer_activation_bytes": layer})
    memory = plan_memory(simulate(plan, cost, record=False), cost, plan)
    predicted = memory.activations + memory.logits
    assert measured == pytest.approx(predicted, rel=0.15), (schedule, measured, predicted)
