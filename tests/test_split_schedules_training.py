"""The split-backward schedules train like one process: split TawPipe (``tawpipe-zb``), WeiPipe-Interleave
with deferred weight passes (``weipipe-interleave-zb``) and WZB1 in the paper's paired layout
(``weipipe-zb1-paired``: weight passes one turn after their input passes, on the copy kept), as plan files."""

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan, validate_plan, write_plan
from training_helpers import assert_trains_like, tiny_args, train_rank

ITERS = 2
CASES = [("tawpipe-zb", 2, 2, 2, 2), ("weipipe-interleave-zb", 3, 1, 2, 3),   # schedule, P, D, N, layers
         ("weipipe-zb1-paired", 4, 2, 2, 4)]


@pytest.mark.parametrize("schedule,P,D,N,layers", CASES, ids=[c[0] for c in CASES])
def test_split_schedule_trains_like_one_process(schedule, P, D, N, layers, tmp_path):
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_layers=layers, num_microbatches=N)
    validate_plan(plan)
    assert {A.BackwardInput, A.BackwardWeight} <= {type(a) for acts in plan.actions for a in acts}
    path = str(tmp_path / "plan.json")
    write_plan(plan, path)

    def argv(*extra, save):
        args = tiny_args(*extra, train_iters=ITERS, global_batch=P * N, micro_batch=1)
        args[args.index("--num-layers") + 1] = str(layers)
        return args + ["--save", save, "--save-interval", "1"]

    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "split")
    (reference,) = run_ranks(train_rank, 1, argv(save=ref_save))
    per_rank = run_ranks(train_rank, P, argv("--pipeline-schedule", f"plan:{path}", "--tawpipe-num-groups", str(D),
                                             "--tawpipe-nccl-faithful", save=save))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)


def test_emulated_deferred_weight_gradients_is_accepted_with_a_notice(capsys):
    """The runtime and the emulation always run a split backward's weight-gradient GEMMs in its weight pass:
    the former flag that asked the emulation for it is accepted and says it has no effect."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    args = validate_args(parse_args(tiny_args("--pipeline-schedule", "weipipe", "--emulated-deferred-weight-gradients",
                                              global_batch=4)), world_size=4)
    assert args.emulated_deferred_weight_gradients
    out = capsys.readouterr().out
    assert "notice: --emulated-deferred-weight-gradients: no effect" in out
