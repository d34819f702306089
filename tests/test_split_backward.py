"""Split backwards run exactly: a plan whose every Backward is split into BackwardInput (the input
gradient, for the previous shard) and BackwardWeight (the weight gradients, later, by the weight-gradient
kernels the deferred linear layers left: tests/test_deferred_wgrad.py) trains like one process; so do
WeiPipe's zero-bubble variants (``--weipipe-zero-bubble 1/2``), whose planners place the weight-gradient
pass on its own."""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan, split_backward, validate_plan, write_plan
from training_helpers import assert_trains_like, tiny_args, train_rank, recompute_as_written

ITERS = 3


def _args(*extra, layers, global_batch, save):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=global_batch, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return recompute_as_written(argv + ["--save", save, "--save-interval", "1"])


CASES = [   # recompute and the NCCL-faithful transport; the forward's kept graph (no recompute), two groups
    ("weipipe", 3, 1, 2, 4, ["--tawpipe-nccl-faithful"]),
    ("tawpipe", 2, 2, 3, 3, ["--tawpipe-no-recompute"]),
]


@pytest.mark.parametrize("schedule,P,D,N,layers,extra", CASES,
                         ids=[f"{c[0]}-P{c[1]}-D{c[2]}-N{c[3]}-L{c[4]}{''.join(c[5])}" for c in CASES])
def test_split_backward_plan_trains_like_one_process(schedule, P, D, N, layers, extra, tmp_path):
    plan = split_backward(build_plan(schedule, num_ranks=P, num_groups=D, num_layers=layers, num_microbatches=N))
    validate_plan(plan)
    kinds = {type(a) for acts in plan.actions for a in acts}
    assert A.BackwardInput in kinds and A.BackwardWeight in kinds and A.Backward not in kinds
    path = str(tmp_path / "split.json")
    write_plan(plan, path)
    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "split")
    (reference,) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=P * N, save=ref_save))
    per_rank = run_ranks(train_rank, P, _args("--pipeline-schedule", f"plan:{path}", "--tawpipe-num-groups", str(D),
                                              *extra, layers=layers, global_batch=P * N, save=save))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)


@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("P,N", [(P, N) for P in (2, 3, 4) for N in (1, 2, 3)])
def test_zero_bubble_plans_are_sound(variant, P, N):
    """WZB1/WZB2 for P = 2..4 ranks and 1-3 micro-batches per rank pass the validator (equivalence to
    data-parallel training, NCCL's ordering rules) and place every weight-gradient pass as described:
    WZB1 in the turn of its input gradient, WZB2 a round (P turns) later on the same gradient's next pass."""
    plan = build_plan(f"weipipe-zb{variant}", num_ranks=P, num_groups=1, num_layers=2 * P, num_microbatches=N)
    validate_plan(plan)
    for r, acts in enumerate(plan.actions):
        order = [(type(a), a.mb, a.shard) for a in acts if type(a) in (A.Forward, A.BackwardInput, A.BackwardWeight)]
        assert A.Backward not in {type(a) for a in acts}
        bi = [(m, s) for t, m, s in order if t is A.BackwardInput]
        bw = [(m, s) for t, m, s in order if t is A.BackwardWeight]
        assert sorted(bi) == sorted(bw) == sorted((m, s) for m in range(N) for s in range(P))
        for m, s in bw:   # WZB1: no input-gradient pass between a backward's two halves; WZB2: a round's (P),
            i, w = order.index((A.BackwardInput, m, s)), order.index((A.BackwardWeight, m, s))   # fewer at the end
            between = sum(1 for x in order[i + 1:w] if x[0] is A.BackwardInput)
            later = sum(1 for x in order[i + 1:] if x[0] is A.BackwardInput)
            assert i < w and between == (0 if variant == 1 else min(P, later)), (r, m, s)


ZB_CASES = [   # P, N, layers, flags: recompute on and off, the NCCL-faithful transport
    (1, 2, 1, 2, ["--tawpipe-nccl-faithful"]),
    (1, 3, 3, 3, ["--tawpipe-no-recompute"]),
    (2, 2, 2, 4, ["--tawpipe-no-recompute", "--tawpipe-nccl-faithful"]),
    (2, 4, 3, 4, ["--tawpipe-nccl-faithful"]),
    (2, 3, 1, 6, []),
]


@pytest.mark.parametrize("variant,P,N,layers,extra", ZB_CASES,
                         ids=[f"wzb{c[0]}-P{c[1]}-N{c[2]}-L{c[3]}{''.join(c[4])}" for c in ZB_CASES])
def test_zero_bubble_trains_like_one_process(variant, P, N, layers, extra, tmp_path):
    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "wzb")
    (reference,) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=P * N, save=ref_save))
    per_rank = run_ranks(train_rank, P, _args("--pipeline-schedule", "weipipe", "--weipipe-zero-bubble", str(variant),
                                              *extra, layers=layers, global_batch=P * N, save=save))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)
