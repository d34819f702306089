"""--pipeline-schedule plan:FILE: a plan written by hand runs on the weight-passing runtime, trains exactly like
one process, and a broken or ill-fitting plan file is refused in one line before any process group exists.

The plan is examples/plans/relay-ring.json (docs/writing-a-schedule.md): 4 ranks in 2 groups, 4 layers,
2 micro-batches per rank; each shard's weights are relayed around the ring from its owner, and its gradient
is relayed back to the owner, each rank adding its part on the way.
"""

import json
import os

import pytest
import torch.distributed as dist

from distributed_harness import run_ranks
from megatron_tawpipe.plan import SCHEDULES, PlanError, build_plan, read_plan, validate_plan, write_plan
from training_helpers import assert_trains_like, tiny_args, train_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, "examples", "plans", "relay-ring.json")
ITERS = 3
RANKS, GROUPS, LAYERS, MICROBATCHES = 4, 2, 4, 2


def _args(plan=PLAN, *extra, layers=LAYERS, global_batch=RANKS * MICROBATCHES, save=None):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=global_batch, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(layers)
    if plan is not None:
        argv += ["--pipeline-schedule", f"plan:{plan}"]
    if save:
        argv += ["--save", save, "--save-interval", "1"]
    return argv


def test_the_hand_written_plan_is_sound_and_no_planner_wrote_it():
    plan = read_plan(PLAN)
    validate_plan(plan)
    assert (plan.family, plan.num_ranks, plan.num_groups, plan.num_layers, plan.num_microbatches) == (
        "weight", RANKS, GROUPS, LAYERS, MICROBATCHES)
    compared = 0
    for name in SCHEDULES:
        for groups in (1, GROUPS):
            try:
                built = build_plan(name, num_ranks=RANKS, num_groups=groups, num_layers=LAYERS,
                                   num_microbatches=MICROBATCHES)
            except ValueError:   # (a replicated first shard needs two groups)
                continue
            assert built.actions != plan.actions, name
            compared += 1
    assert compared >= 2 * len(SCHEDULES) - 1


def test_the_plan_file_trains_like_one_process(tmp_path):
    """Loss, gradient norm and every parameter within 1e-5 of a single-process run over 3 iterations (clipping
    active), with NCCL's ordering rules enforced on gloo; bytes per link class as the plan prescribes; the
    measured timeline written."""
    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "plan")
    timeline = str(tmp_path / "timeline.json")
    (reference,) = run_ranks(train_rank, 1, _args(None, save=ref_save))
    per_rank = run_ranks(train_rank, RANKS, _args(PLAN, "--tawpipe-num-groups", str(GROUPS), "--tawpipe-nccl-faithful",
                                                  "--distributed-timeout-minutes", "2", "--timeline-file", timeline,
                                                  save=save))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)
    for record in per_rank[0]:
        assert record["inter_group_bytes"] == record["planned_inter_group_bytes"] > 0
        assert record["intra_group_bytes"] == record["planned_intra_group_bytes"] > 0
    with open(timeline) as f:
        doc = json.load(f)
    assert doc["schedule"] == "relay-ring" and doc["num_ranks"] == RANKS and doc["spans"]


def _refusal(argv, world, capsys, monkeypatch):
    """The one error line pretrain_llama.py prints for ``argv`` on ``world`` ranks, before any process group."""
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    assert pretrain_llama.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not dist.is_initialized()
    return err[0]


def _edited(tmp_path, edit, name="broken.json"):
    with open(PLAN) as f:
        doc = json.load(f)
    edit(doc["actions"])
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _drop_first_wait(actions):
    rank = actions[2]
    del rank[next(i for i, a in enumerate(rank) if a["op"] == "Wait")]


def _send_gradient_to_wrong_peer(actions):
    send = next(a for a in actions[0] if a["op"] == "SendStart" and a["kind"] == "grad")
    send.update(peer=2, link="inter")


def _wait_too_late(actions):
    rank = actions[1]
    rank[1], rank[2] = rank[2], rank[1]   # sends the weights on before their receive is complete


BROKEN = [(_drop_first_wait, "rank 2, step 0", "never waited"),
          (_send_gradient_to_wrong_peer, "rank 1, step 21", "send to rank 2 is matched by a receive on rank 1"),
          (_wait_too_late, "rank 1, step 1", "has a transfer in flight")]


@pytest.mark.parametrize("edit,where,why", BROKEN, ids=["wait-removed", "wrong-peer", "wait-too-late"])
def test_a_plan_with_one_wrong_step_is_refused_naming_rank_and_step(edit, where, why, tmp_path, capsys, monkeypatch):
    path = _edited(tmp_path, edit)
    with pytest.raises(PlanError) as info:
        validate_plan(read_plan(path))
    assert str(info.value).startswith(where) and why in str(info.value)
    line = _refusal(_args(path, "--tawpipe-num-groups", "2"), RANKS, capsys, monkeypatch)
    assert f"--pipeline-schedule plan:{path}: the validator refuses the plan: {where}" in line and why in line


SHAPES = [
    # extra flags, world, layers, global batch, what the message names
    (["--tawpipe-num-groups", "2"], 2, LAYERS, 4, ["num_ranks=4", "WORLD_SIZE 2", "start 4 ranks"]),
    (["--tawpipe-num-groups", "2"], RANKS, 8, 8, ["--num-layers 8", "num_layers=4"]),
    (["--tawpipe-num-groups", "2"], RANKS, LAYERS, 12, ["--global-batch-size 12", "num_microbatches=2",
                                                        "give --global-batch-size 8"]),
    (["--tawpipe-num-groups", "1"], RANKS, LAYERS, 8, ["--tawpipe-num-groups 1", "num_groups=2"]),
    (["--tawpipe-num-groups", "4"], RANKS, LAYERS, 8, ["--tawpipe-num-groups 4", "num_groups=2"]),
]


@pytest.mark.parametrize("extra,world,layers,batch,named", SHAPES, ids=["ranks", "layers", "micro-batches", "groups-1",
                                                                        "groups-4"])
def test_a_plan_of_another_shape_is_refused_naming_the_flag_and_the_plans_value(extra, world, layers, batch, named,
                                                                                  capsys, monkeypatch):
    line = _refusal(_args(PLAN, *extra, layers=layers, global_batch=batch), world, capsys, monkeypatch)
    assert PLAN in line
    for text in named:
        assert text in line


def test_groups_follow_the_nodes_unless_given(capsys, monkeypatch):
    """Without --tawpipe-num-groups the groups are the nodes (LOCAL_WORLD_SIZE), as for tawpipe."""
    line = _refusal(_args(PLAN), RANKS, capsys, monkeypatch)
    assert "num_groups=2" in line and "1 node(s) of 4 ranks (LOCAL_WORLD_SIZE)" in line
    assert "--tawpipe-num-groups 2" in line
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = validate_args(parse_args(_args(PLAN)), world_size=RANKS)
    assert args.num_microbatches == MICROBATCHES and args.decoder_layer_split == (1, 1, 1, 1)


def test_uneven_shards_and_a_changing_batch(tmp_path, capsys, monkeypatch):
    """The plan's split of the layers must be the run's; a batch that changes during the run needs plans for
    several micro-batch counts, which one plan file is not."""
    with open(PLAN) as f:
        doc = json.load(f)
    doc["meta"].update(num_layers=5, shard_layers=[1, 1, 1, 2])
    path = tmp_path / "uneven.json"
    path.write_text(json.dumps(doc))
    line = _refusal(_args(str(path), "--tawpipe-num-groups", "2", layers=5), RANKS, capsys, monkeypatch)
    assert "shard_layers=[1, 1, 1, 2]" in line and "[2, 1, 1, 1] (the default)" in line
    assert "--decoder-last-pipeline-num-layers" in line
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    argv = _args(str(path), "--tawpipe-num-groups", "2", "--decoder-last-pipeline-num-layers", "2", layers=5)
    assert validate_args(parse_args(argv), world_size=RANKS).decoder_layer_split == (1, 1, 1, 2)
    argv = _args(PLAN, "--tawpipe-num-groups", "2", "--step-batch-size-schedule", "0:8 1000:16")
    del argv[argv.index("--global-batch-size"):argv.index("--global-batch-size") + 2]
    line = _refusal(argv, RANKS, capsys, monkeypatch)
    assert "--step-batch-size-schedule gives 2, 4 micro-batches per rank" in line and "num_microbatches=2" in line


def test_unreadable_activation_and_csv_plan_files(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "nothere.json")
    assert "no such file" in _refusal(_args(missing), RANKS, capsys, monkeypatch)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert "not valid JSON" in _refusal(_args(str(garbage)), RANKS, capsys, monkeypatch)
    activation = str(tmp_path / "gpipe.json")
    write_plan(build_plan("gpipe", num_ranks=RANKS, num_groups=1, num_layers=LAYERS, num_microbatches=8), activation)
    line = _refusal(_args(activation), RANKS, capsys, monkeypatch)
    assert "family is 'activation'" in line and "weight-passing plans" in line
    with open(PLAN) as f:
        doc = json.load(f)
    doc["meta"]["streams"] = [0, 0, 1, 1]
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps(doc))
    assert "streams are [0, 0, 1, 1]" in _refusal(_args(str(shared)), RANKS, capsys, monkeypatch)
    line = _refusal(_args(PLAN, "--tawpipe-num-groups", "2", "--tawpipe-no-overlap"), RANKS, capsys, monkeypatch)
    assert "--tawpipe-no-overlap does not apply" in line
    # The same plan as CSV (decided by the extension, or by the content) is accepted alike.
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    for name in ("relay-ring.csv", "relay-ring.plan"):
        path = str(tmp_path / name)
        with open(path, "w") as f:
            f.write(read_plan(PLAN).to_csv())
        assert read_plan(path).actions == read_plan(PLAN).actions
        validate_args(parse_args(_args(path, "--tawpipe-num-groups", "2")), world_size=RANKS)
