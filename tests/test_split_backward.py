"""Split backwards run exactly: a plan whose every Backward is split into BackwardInput (the input
gradient, for the previous shard) and BackwardWeight (the weight gradients, later, from the kept graph)
trains like one process. The runtime half of WeiPipe's zero-bubble variants (their planners are to come)."""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan, split_backward, validate_plan, write_plan
from training_helpers import assert_trains_like, tiny_args, train_rank

ITERS = 3


def _args(*extra, layers, global_batch, save):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=global_batch, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return argv + ["--save", save, "--save-interval", "1"]


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
